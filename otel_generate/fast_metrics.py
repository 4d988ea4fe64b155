"""Values into one SDK histogram, taken only where it gives exactly what the public API gives.

A request of ``n`` one-token steps records ``n - 1`` inter-token latencies with the same
attributes and context, and one value into each of its other histograms, with the same
attributes request after request. Through the public API (``histogram.record(value,
attributes)``) each value pays the SDK's whole path again (about 80,000 instructions): the
attributes cleaned (``Measurement``), the exemplar filter asked, each reader's view matches looked
up, the attributes copied, filtered and hashed to find the aggregation, then
``aggregation.aggregate(measurement, should_sample_exemplar)``.

:meth:`FastHistogram.record_many` finds the aggregation each view of each reader feeds for these
attributes once per attribute set, and remembers it for as long as the consumer's reader
storages are the same dict (the SDK replaces that dict when a reader is added or removed, never
changes an instrument's view matches once made and never removes an aggregation); where one does
not exist yet, every value goes through the public API, which creates it. It hands each value
straight to those ``aggregate`` methods,
with a ``Measurement`` holding the same value, its own ``time_ns()``, the same instrument,
context and cleaned attributes. The exemplar filter is asked once when it is one of the SDK's
own (their answer depends on the context alone), else once per value. Where the exemplar
reservoir is the SDK's ``AlignedHistogramBucketExemplarReservoir`` (the histogram default), which
keeps the last value offered per bucket, only each bucket's last value is offered: the reservoir
ends up holding the same exemplars. Where every aggregation is the SDK's explicit-bucket histogram
with one of the SDK's reservoirs (which read a measurement's fields and keep none of it), one
``Measurement`` is reused, its value and time set for each value. A value the public API would
refuse (not finite, negative) goes through the public API, which logs and drops it. Where, in
addition, the aggregation's ``aggregate`` is exactly the SDK's code this module knows (compared
with its source), that code's effect for all values is applied under one lock (the same sum in
the same order, the bucket counts, min and max; iterated in C: ``functools.reduce`` adds left to
right as ``+=`` does), then the exemplars are offered (a ``Measurement`` is built only for them).

That uses SDK internals, so it is taken only when they are exactly as expected
(:meth:`FastHistogram.for_instrument`, once per ``instrument()``, and again for every new
attribute set or reader storages: the reader storages and view matches must be the SDK's own
types, and every aggregation must already exist); otherwise, and after any fault (logged once,
the fast path off for good), every value goes through the public API.
"""

from __future__ import annotations

import bisect
import math
import time
from collections import Counter
from functools import reduce
from itertools import repeat
from operator import add
from typing import Any, Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple

from otel_generate._faults import Fault, log_fault_once


class _NotEligible(Exception):
    pass


#: At most this many attribute sets are remembered per histogram (a request's attributes are its
#: model, operation, provider and error type: few sets in one process).
_CACHE_SIZE = 256
_SCALARS = frozenset((str, bool, int, float))


class _Resolved(NamedTuple):
    """Where one attribute set's values go: its cleaned attributes, ``(aggregate, boundaries)``
    per aggregation (``boundaries``: its reservoir's when that keeps the last value offered per
    bucket, else ``None``), the aggregations, and whether one ``Measurement`` may be reused
    (``reuse``) and the SDK's aggregation code repeated for all values at once (``bulk``)."""

    cleaned: Any
    targets: List[Tuple[Any, Optional[Sequence[float]]]]
    aggregations: List[Any]
    reuse: bool
    bulk: bool
    #: ``(view instrument match, its key of these attributes)`` per aggregation: a remembered
    #: resolution holds while each match still maps that key to that aggregation
    places: List[Tuple[Any, Any]]


#: The SDK's ``_ExplicitBucketHistogramAggregation.aggregate`` (opentelemetry-sdk 1.x) that
#: :meth:`FastHistogram.record_many` repeats for many values under one lock; compared with the
#: installed SDK's source (whitespace aside) before it is relied on.
_AGGREGATE_SOURCE = """
def aggregate(self, measurement: Measurement, should_sample_exemplar: bool = True) -> None:
    with self._lock:
        if self._value is None:
            self._value = self._get_empty_bucket_counts()
        measurement_value = measurement.value
        self._sum += measurement_value
        if self._record_min_max:
            self._min = min(self._min, measurement_value)
            self._max = max(self._max, measurement_value)
        self._value[bisect_left(self._boundaries, measurement_value)] += 1
    self._sample_exemplar(measurement, should_sample_exemplar)
"""
_checked_classes: Dict[type, bool] = {}


def _normalized(source: str) -> str:
    return "\n".join(line.strip() for line in source.splitlines() if line.strip())


def _aggregates_as_expected(cls: type) -> bool:
    """Whether ``cls.aggregate`` is exactly :data:`_AGGREGATE_SOURCE`, with the builtins and
    ``bisect_left`` it names being those (read from its source, once per class)."""
    known = _checked_classes.get(cls)
    if known is None:
        try:
            import inspect
            import sys

            function = cls.__dict__["aggregate"]
            namespace = vars(sys.modules[function.__module__])
            known = (
                _normalized(inspect.getsource(function)) == _normalized(_AGGREGATE_SOURCE)
                and namespace.get("bisect_left") is bisect.bisect_left
                and "min" not in namespace
                and "max" not in namespace
                and callable(getattr(cls, "_get_empty_bucket_counts", None))
            )
        except Exception:  # no source, another layout: never relied on
            known = False
        _checked_classes[cls] = known
    return known


class FastHistogram:
    """Records many values with the same attributes into one SDK histogram (see the module docstring)."""

    def __init__(self, histogram: Any) -> None:
        from opentelemetry.attributes import _clean_attribute_value
        from opentelemetry.context import get_current
        from opentelemetry.sdk.metrics._internal._view_instrument_match import _hash_attributes, _ViewInstrumentMatch
        from opentelemetry.sdk.metrics._internal.aggregation import _Aggregation, _ExplicitBucketHistogramAggregation
        from opentelemetry.sdk.metrics._internal.exemplar.exemplar_filter import (
            AlwaysOffExemplarFilter,
            AlwaysOnExemplarFilter,
            TraceBasedExemplarFilter,
        )
        from opentelemetry.sdk.metrics._internal.exemplar.exemplar_reservoir import (
            AlignedHistogramBucketExemplarReservoir,
            SimpleFixedSizeExemplarReservoir,
        )
        from opentelemetry.sdk.metrics._internal.measurement import Measurement
        from opentelemetry.sdk.metrics._internal.metric_reader_storage import MetricReaderStorage

        self._histogram = histogram
        self._get_current = get_current
        self._hash = _hash_attributes
        self._vim_type = _ViewInstrumentMatch
        self._storage_type = MetricReaderStorage
        self._measurement = Measurement
        self._clean = _clean_attribute_value
        self._context_filters = (AlwaysOffExemplarFilter, AlwaysOnExemplarFilter, TraceBasedExemplarFilter)
        self._aligned = AlignedHistogramBucketExemplarReservoir
        self._histogram_aggregation = _ExplicitBucketHistogramAggregation
        self._reservoirs = (AlignedHistogramBucketExemplarReservoir, SimpleFixedSizeExemplarReservoir)
        #: attribute items -> (the reader storages they were resolved against, :class:`_Resolved`)
        self._cache: Dict[Any, Tuple[Any, _Resolved]] = {}
        self._sample_exemplar = _Aggregation._sample_exemplar  # offers to the reservoir only when told to
        self.broken = False

    @classmethod
    def for_instrument(cls, histogram: Any) -> Optional["FastHistogram"]:
        """A :class:`FastHistogram` for an SDK histogram whose internals are as expected, else ``None``."""
        try:
            from opentelemetry.sdk.metrics._internal.instrument import _Histogram
            from opentelemetry.sdk.metrics._internal.measurement_consumer import SynchronousMeasurementConsumer
        except ImportError:
            return None
        try:
            if type(histogram) is not _Histogram or not callable(getattr(histogram, "_is_enabled", None)):
                return None
            consumer = getattr(histogram, "_measurement_consumer", None)
            if type(consumer) is not SynchronousMeasurementConsumer:
                return None
            if not isinstance(getattr(consumer, "_reader_storages", None), dict):
                return None
            if getattr(getattr(consumer, "_sdk_config", None), "exemplar_filter", None) is None:
                return None
            return cls(histogram)
        except Exception as fault:  # an SDK whose internals look otherwise: the public path
            log_fault_once(Fault.FAST_HISTOGRAM_CHECK, fault)
            return None

    def _targets(self, cleaned: Any) -> "_Resolved":
        """Every aggregation the public path feeds for these (cleaned) attributes, and whether the
        bulk and reuse paths may be taken for them; raises :class:`_NotEligible` where a storage or
        view match is not the SDK's own type, or an aggregation does not exist yet."""
        histogram = self._histogram
        targets: List[Tuple[Any, Optional[Sequence[float]]]] = []
        aggregations: List[Any] = []
        places: List[Tuple[Any, Any]] = []
        reuse = bulk = True
        for storage in histogram._measurement_consumer._reader_storages.values():
            if type(storage) is not self._storage_type:
                raise _NotEligible
            for match in storage._get_or_init_view_instrument_match(histogram):
                if type(match) is not self._vim_type:
                    raise _NotEligible
                attributes = dict(cleaned) if cleaned else {}
                keys = match._view._attribute_keys
                if keys is not None:
                    attributes = {k: v for k, v in attributes.items() if k in keys}
                place = self._hash(attributes)
                aggregation = match._attributes_aggregation.get(place)
                if aggregation is None:
                    raise _NotEligible
                places.append((match, place))
                reservoir = getattr(aggregation, "_reservoir", None)
                boundaries = None
                if type(reservoir) is self._aligned and type(aggregation)._sample_exemplar is self._sample_exemplar:
                    boundaries = list(reservoir._boundaries)
                if type(aggregation) is not self._histogram_aggregation or type(reservoir) not in self._reservoirs:
                    reuse = False
                elif not _aggregates_as_expected(type(aggregation)):
                    bulk = False
                targets.append((aggregation.aggregate, boundaries))
                aggregations.append(aggregation)
        return _Resolved(cleaned, targets, aggregations, reuse, reuse and bulk, places)

    def _resolve(self, attributes: Any) -> "_Resolved":
        """:meth:`_targets` of ``attributes``, from the cache when they were resolved before.

        A remembered resolution is used while the consumer's reader storages are the same dict
        (the SDK replaces that dict when a reader is added or removed; an instrument's view
        matches never change once made) and each view match still maps the attributes' key to
        the same aggregation (a forked child's reset, :func:`otel_generate._lifecycle.forget_inherited_metrics`,
        clears them). Attribute sets whose values are not all ``str``, ``bool``, ``int`` or
        ``float`` are resolved every time: the cache key holds each value's type, as the SDK's
        key does (``True``, ``1`` and ``1.0`` are different series there, equal in a tuple)."""
        storages = self._histogram._measurement_consumer._reader_storages
        key: Any = None
        if attributes:
            values = tuple(attributes.values())
            types = tuple(map(type, values))
            if _SCALARS.issuperset(types):
                key = (tuple(attributes), types, values)
        else:  # None or empty: kept apart (a measurement carries them as given)
            key = (attributes is None,)
        cached = self._cache.get(key) if key is not None else None
        if cached is not None and cached[0] is storages:
            resolved = cached[1]
            for (match, place), aggregation in zip(resolved.places, resolved.aggregations):
                if match._attributes_aggregation.get(place) is not aggregation:
                    break
            else:
                return resolved
        resolved = self._targets(self._clean(attributes, None) if attributes is not None else None)
        if key is not None and (key in self._cache or len(self._cache) < _CACHE_SIZE):
            self._cache[key] = (storages, resolved)
        return resolved

    def _aggregate_all(self, values: List[float], context: Any, should_sample: Any, resolved: "_Resolved") -> bool:
        """What ``aggregate()`` does per value (the SDK's own code, checked by
        :func:`_aggregates_as_expected`), for all values under one lock: the same sum in the same
        order, the bucket counts, min and max; then the exemplars, each bucket's last value where
        the reservoir keeps only that.

        Returns False, having changed nothing, unless every value is finite and >= 0 (then the
        public path logs and drops the others). Iterated in C: the values sorted once give min,
        max and each bucket's count (the values <= a boundary, by ``bisect_right``, are those
        ``bisect_left(boundaries, value)`` puts at or below its bucket); ``functools.reduce``
        adds left to right, as ``+=`` per value does."""
        ordered = sorted(values) if len(values) > 1 else values
        # min and max per value keep the first of equal values (1 and 1.0, -0.0 and 0.0): the
        # sort is stable, so that is the first of its run in the sorted order
        low = ordered[0]
        if not low >= 0:  # a negative value, or NaN first
            return False
        high = ordered[bisect.bisect_left(ordered, ordered[-1])]
        time_ns, setfield = time.time_ns, object.__setattr__
        cleaned = resolved.cleaned
        sample = should_sample(values[0], time_ns(), cleaned, context)  # the filter answers from the context alone
        if sample and len(resolved.targets) > 1 and any(boundaries is None for _, boundaries in resolved.targets):
            # a reservoir that may keep any value draws random numbers: the public path offers each
            # value to every aggregation in turn, and so does the per-value path
            return False
        m = None
        count = len(values)
        bisect_left, bisect_right = bisect.bisect_left, bisect.bisect_right
        checked = False
        for aggregation, (_, boundaries) in zip(resolved.aggregations, resolved.targets):
            same = sample and boundaries is not None and boundaries == list(aggregation._boundaries)
            last: Dict[int, int] = {}
            with aggregation._lock:
                total = reduce(add, values, aggregation._sum)
                if not checked:  # a NaN or an infinity makes the sum so: then nothing is changed
                    if not math.isfinite(total):
                        return False
                    checked = True
                if aggregation._value is None:
                    aggregation._value = aggregation._get_empty_bucket_counts()
                counts, bounds = aggregation._value, aggregation._boundaries
                if count == 1:
                    index = bisect_left(bounds, low)
                    counts[index] += 1
                    last[index] = 0
                elif same:  # each bucket's last position, for the exemplars
                    indices = list(map(bisect_left, repeat(bounds), values))
                    for index, hits in Counter(indices).items():
                        counts[index] += hits
                    last = dict(zip(indices, range(count)))
                else:
                    below = 0  # values in the buckets so far
                    for index, bound in enumerate(bounds):
                        upto = bisect_right(ordered, bound)
                        counts[index] += upto - below
                        below = upto
                        if below == count:
                            break
                    else:
                        counts[len(bounds)] += count - below
                aggregation._sum = total
                if aggregation._record_min_max:
                    aggregation._min = min(aggregation._min, low)
                    aggregation._max = max(aggregation._max, high)
            if not sample:
                continue
            if m is None:  # only an exemplar reads a measurement
                m = self._measurement(values[0], time_ns(), self._histogram, context, None)
                setfield(m, "attributes", cleaned)
            if boundaries is None:  # a reservoir that may keep any value: every value offered, in order
                positions: Iterable[int] = range(len(values))
            else:
                if not same:
                    for position, value in enumerate(values):
                        last[bisect_left(boundaries, value)] = position
                positions = sorted(last.values())
            for position in positions:
                setfield(m, "value", values[position])
                setfield(m, "time_unix_nano", time_ns())
                aggregation._sample_exemplar(m, True)
        return True

    def record_many(self, values: Iterable[float], attributes: Any) -> None:
        """``histogram.record(value, attributes)`` for every value, in order, in the current context."""
        record = self._histogram.record
        rest = values if type(values) is list else list(values)
        if not rest:
            return
        resolved = None
        if not self.broken and self._histogram._is_enabled():
            try:
                resolved = self._resolve(attributes)
                context = self._get_current()
                exemplar_filter = self._histogram._measurement_consumer._sdk_config.exemplar_filter
                once = type(exemplar_filter) in self._context_filters
            except _NotEligible:
                resolved = None
            except Exception as fault:
                self.broken = True
                log_fault_once(Fault.FAST_HISTOGRAM, fault)
                resolved = None
        if resolved is None:
            for value in rest:  # the public path (which creates the aggregations the next call finds)
                record(value, attributes)
            return
        histogram, measurement, time_ns, isfinite = self._histogram, self._measurement, time.time_ns, math.isfinite
        should_sample = exemplar_filter.should_sample
        setfield = object.__setattr__
        cleaned, targets, reuse = resolved.cleaned, resolved.targets, resolved.reuse
        if resolved.bulk and once and self._aggregate_all(rest, context, should_sample, resolved):
            return
        accepted = [isfinite(value) and value >= 0 for value in rest]
        # A reservoir that keeps the last value offered per bucket ends up holding the same exemplars
        # when only each bucket's last value is offered: the others would be overwritten.
        offered: List[Optional[set]] = []
        for _, boundaries in targets:
            if boundaries is None or not once:
                offered.append(None)
                continue
            last: Dict[int, int] = {}
            for position, value in enumerate(rest):
                if accepted[position]:
                    last[bisect.bisect_left(boundaries, value)] = position
            offered.append(set(last.values()))
        decided: Optional[bool] = None
        m: Any = None
        for position, value in enumerate(rest):
            if not accepted[position]:
                record(value, attributes)  # refused with a warning, as the public path does
                continue
            now = time_ns()
            if m is None or not reuse:
                m = measurement(value, now, histogram, context, None)
                object.__setattr__(m, "attributes", cleaned)  # already cleaned, as Measurement would
            else:  # the SDK's histogram aggregation and reservoirs read its fields, never keep it
                setfield(m, "value", value)
                setfield(m, "time_unix_nano", now)
            if decided is None:
                sample = should_sample(value, now, cleaned, context)
                if once:
                    decided = sample
            else:
                sample = decided
            for (aggregate, _), keep in zip(targets, offered):
                aggregate(m, sample and (keep is None or position in keep))
