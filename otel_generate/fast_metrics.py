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
changes an instrument's view matches once made and never removes an aggregation: only a forked
child's reset does, which counts it); where one does
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
the same order, the bucket counts, min and max; iterated in C: ``functools.reduce``, or
``sum()`` before Python 3.12, adds left to right as ``+=`` does), then the exemplars are offered
(a ``Measurement`` is built only for them).
:func:`record_values` is that path for single values, each into its own histogram (a request's
duration, its time to first token, its token counts), in one loop without the list
(:meth:`FastHistogram.record_one`: one such value). The filter's answer and the span ids of the
context are found once for all the histograms a request records in one context
(:func:`_exemplar_decision`), and whether the meter is enabled once per meter config. Where, in
addition, an offer runs exactly the SDK code this module knows for the default reservoir
(:func:`_offers_as_expected`, compared with its source), the offer's effect on the value's bucket
is applied directly (:func:`_offer_to_bucket`): its value, time, attributes and span ids, under
the reservoir's lock.

That uses SDK internals, so it is taken only when they are exactly as expected
(:meth:`FastHistogram.for_instrument`, once per ``instrument()``, and again for every new
attribute set or reader storages: the reader storages and view matches must be the SDK's own
types, and every aggregation must already exist); otherwise, and after any fault (logged once,
the fast path off for good), every value goes through the public API.
"""

from __future__ import annotations

import bisect
import math
import sys
import time
from functools import reduce
from operator import add
from typing import Any, Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple

from opentelemetry.trace import INVALID_SPAN, get_current_span

from otel_generate import _lifecycle
from otel_generate._faults import Fault, log_fault_once
from otel_generate._sdk_code import same_code


class _NotEligible(Exception):
    pass


#: At most this many attribute sets are remembered per histogram (a request's attributes are its
#: model, operation, provider and error type: few sets in one process).
_CACHE_SIZE = 256
_SCALARS = frozenset((str, bool, int, float))
_STRINGS = frozenset((str,))
_NUMBERS = (int, float)
_LARGEST = sys.float_info.max


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
    #: more than one aggregation, and one of them with a reservoir that may keep any value (it
    #: draws random numbers: each value goes to every aggregation in turn, the per-value path)
    random: bool
    #: per aggregation, its reservoir where an offer to it may be made by :func:`_offer_to_bucket`
    #: (:func:`_offers_as_expected`), else ``None``
    reservoirs: List[Any]
    #: ``(aggregation, boundaries, reservoir, same)`` per aggregation: the three lists above side by
    #: side, and whether ``boundaries`` are the aggregation's own (read per value by
    #: :func:`record_values`)
    entries: List[Tuple[Any, Optional[Sequence[float]], Any, bool]]


#: The SDK's ``_ExplicitBucketHistogramAggregation.aggregate`` (opentelemetry-sdk 1.x) that
#: :meth:`FastHistogram.record_many` repeats for many values under one lock; compared with the
#: installed SDK's code (:func:`otel_generate._sdk_code.same_code`) before it is relied on.
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


def _aggregates_as_expected(cls: type) -> bool:
    """Whether ``cls.aggregate`` is exactly :data:`_AGGREGATE_SOURCE`, with the builtins and
    ``bisect_left`` it names being those (read from its source, once per class)."""
    known = _checked_classes.get(cls)
    if known is None:
        try:
            function = cls.__dict__["aggregate"]
            namespace = vars(sys.modules[function.__module__])
            known = (
                same_code(function, _AGGREGATE_SOURCE)
                and namespace.get("bisect_left") is bisect.bisect_left
                and "min" not in namespace
                and "max" not in namespace
                and callable(getattr(cls, "_get_empty_bucket_counts", None))
            )
        except Exception:  # no source, another layout: never relied on
            known = False
        _checked_classes[cls] = known
    return known


#: The SDK's code an exemplar offer runs for the histogram's default reservoir
#: (``AlignedHistogramBucketExemplarReservoir``, opentelemetry-sdk 1.x), that
#: :func:`_offer_to_bucket` repeats; compared with the installed SDK's source before it is relied on.
_OFFER_SOURCES = {
    "sample_exemplar": """
def _sample_exemplar(self, measurement: Measurement, should_sample_exemplar: bool) -> None:
    if should_sample_exemplar:
        self._reservoir.offer(
            measurement.value,
            measurement.time_unix_nano,
            measurement.attributes,
            measurement.context,
        )
""",
    "reservoir_offer": """
def offer(
    self,
    value: float,
    time_unix_nano: int,
    attributes: Attributes,
    context: Context,
) -> None:
    with self._lock:
        try:
            index = self._find_bucket_index(value, time_unix_nano, attributes, context)
            self._reservoir_storage[index].offer(value, time_unix_nano, attributes, context)
        except BucketIndexError:
            pass
""",
    "find_bucket_index": """
def _find_bucket_index(
    self,
    value: float,
    time_unix_nano: int,
    attributes: Attributes,
    context: Context,
) -> int:
    for index, boundary in enumerate(self._boundaries):
        if value <= boundary:
            return index
    return len(self._boundaries)
""",
    "bucket_offer": """
def offer(
    self,
    value: float,
    time_unix_nano: int,
    attributes: Attributes,
    context: Context,
) -> None:
    self.__value = value
    self.__time_unix_nano = time_unix_nano
    self.__attributes = attributes
    span = trace.get_current_span(context)
    if span != INVALID_SPAN:
        span_context = span.get_span_context()
        self.__span_id = span_context.span_id
        self.__trace_id = span_context.trace_id
    self.__offered = True
""",
}
_checked_reservoirs: Dict[Tuple[type, type], bool] = {}


def _offers_as_expected(aggregation_type: type, reservoir: Any) -> bool:
    """Whether an offer to ``reservoir`` from an ``aggregation_type`` aggregation runs exactly
    :data:`_OFFER_SOURCES` (:func:`_offer_code_known`): then :func:`_offer_to_bucket` does what it
    does. Its boundaries must also be sorted (then its bucket scan finds ``bisect_left``'s
    bucket), and its buckets an SDK ``defaultdict`` of ``ExemplarBucket``."""
    from collections import defaultdict

    storage = getattr(reservoir, "_reservoir_storage", None)
    if type(storage) is not defaultdict or not isinstance(getattr(reservoir, "_boundaries", None), (list, tuple)):
        return False
    boundaries = list(reservoir._boundaries)
    if boundaries != sorted(boundaries) or storage.default_factory is not _bucket_type():
        return False
    return _offer_code_known(aggregation_type, type(reservoir))


def _offer_code_known(aggregation_type: type, reservoir_type: type) -> bool:
    """Whether the classes' offer code is :data:`_OFFER_SOURCES` (read once per pair of classes;
    :class:`FastHistogram` reads the SDK's default pair when it is made, at ``instrument()``, so
    that no request pays for reading source files)."""
    key = (aggregation_type, reservoir_type)
    known = _checked_reservoirs.get(key)
    if known is None:
        try:
            bucket = _bucket_type()
            known = (
                same_code(aggregation_type._sample_exemplar, _OFFER_SOURCES["sample_exemplar"])
                and same_code(reservoir_type.offer, _OFFER_SOURCES["reservoir_offer"])
                and same_code(reservoir_type._find_bucket_index, _OFFER_SOURCES["find_bucket_index"])
                and same_code(bucket.offer, _OFFER_SOURCES["bucket_offer"])
                and all(hasattr(bucket(), "_ExemplarBucket__" + name) for name in _BUCKET_FIELDS)
                and _names_are_the_apis(bucket.offer)
            )
        except Exception:  # no source, another layout: never relied on
            known = False
        _checked_reservoirs[key] = known
    return known


def _names_are_the_apis(function: Any) -> bool:
    """Whether the ``trace`` and ``INVALID_SPAN`` that ``function``'s module names are the API's."""

    from opentelemetry import trace

    namespace = vars(sys.modules[function.__module__])
    return namespace.get("trace") is trace and namespace.get("INVALID_SPAN") is trace.INVALID_SPAN


_BUCKET_FIELDS = ("value", "time_unix_nano", "attributes", "span_id", "trace_id", "offered")


def _bucket_type() -> type:
    from opentelemetry.sdk.metrics._internal.exemplar.exemplar_reservoir import ExemplarBucket

    return ExemplarBucket


def _offer_to_bucket(reservoir: Any, index: int, value: float, time_unix_nano: int, attributes: Any, ids: Any) -> None:
    """What ``reservoir.offer(value, time_unix_nano, attributes, context)`` does
    (:data:`_OFFER_SOURCES`) for a value in bucket ``index``; ``ids``: ``(span_id, trace_id)`` of
    the context's span, ``None`` when it is the invalid span (the bucket keeps its ids then)."""
    with reservoir._lock:
        bucket = reservoir._reservoir_storage[index]
        bucket._ExemplarBucket__value = value
        bucket._ExemplarBucket__time_unix_nano = time_unix_nano
        bucket._ExemplarBucket__attributes = attributes
        if ids is not None:
            bucket._ExemplarBucket__span_id, bucket._ExemplarBucket__trace_id = ids
        bucket._ExemplarBucket__offered = True


def _span_ids(context: Any) -> Any:
    """``(span_id, trace_id)`` of the span in ``context``, ``None`` for the invalid span (as an
    exemplar bucket's offer reads them)."""
    span = get_current_span(context)
    if span != INVALID_SPAN:
        span_context = span.get_span_context()
        return span_context.span_id, span_context.trace_id
    return None


#: The last :func:`_exemplar_decision`: ``(context, exemplar filter, sample, span ids)``.
_last_decision: Tuple[Any, Any, bool, Any] = (None, None, False, None)


def _exemplar_decision(
    exemplar_filter: Any, context: Any, value: float, time_unix_nano: int, attributes: Any
) -> Tuple[bool, Any]:
    """``(exemplar_filter.should_sample(value, time_unix_nano, attributes, context), span ids of
    the context)`` for one of the SDK's own filters, whose answer depends on the context alone: a
    request's histograms are recorded in one context, so both are found once for all of them (the
    last context is held, so that it is the same object, not another at its address)."""
    global _last_decision
    last = _last_decision
    if last[0] is context and last[1] is exemplar_filter:
        return last[2], last[3]
    sample = exemplar_filter.should_sample(value, time_unix_nano, attributes, context)
    ids = _span_ids(context) if sample else None
    _last_decision = (context, exemplar_filter, sample, ids)
    return sample, ids


#: a bucket holding at most this many of a request's values is found by looking those values up
#: from the end (:func:`_last_in_each_bucket`)
_FEW = 2


def _last_in_each_bucket(
    values: Sequence[float], ordered: Sequence[float], boundaries: Sequence[float]
) -> Dict[int, int]:
    """``{bucket: the last position in values of a value in that bucket}`` for the buckets that
    ``boundaries`` make (a value's bucket is ``bisect_left(boundaries, value)``), the same dict as
    ``for position, value in enumerate(values): last[bisect_left(boundaries, value)] = position``.

    ``ordered`` is ``values`` sorted: the buckets that hold a value, and which of the sorted values
    each holds, are read from it (the values <= a boundary are ``bisect_right(ordered, boundary)``;
    the buckets below the smallest value are skipped). A bucket of at most :data:`_FEW` values (a
    rare slow step) gets the last position of any of them, searched for from the end in C
    (``list.index`` on the reversed values); the others are found by a walk back from the last value,
    which stops once each has its position (a request's latencies mostly share a few buckets: after
    a value or two; at worst it visits them all)."""
    count, below = len(ordered), 0
    bisect_left, bisect_right = bisect.bisect_left, bisect.bisect_right
    filled: List[Tuple[int, int, int]] = []  # (bucket, first, end): ordered[first:end] are its values
    lowest = bisect_left(boundaries, ordered[0]) if count else 0  # (no value in the buckets below)
    for bucket in range(lowest, len(boundaries)):
        upto = bisect_right(ordered, boundaries[bucket])
        if upto > below:
            filled.append((bucket, below, upto))
            below = upto
            if below == count:
                break
    else:
        if count > below:
            filled.append((len(boundaries), below, count))
    if len(filled) == 1:  # one bucket: the last value's
        return {filled[0][0]: count - 1}
    last: Dict[int, int] = {}
    backwards = None
    for bucket, first, end in filled:
        if end - first <= _FEW:
            if backwards is None:
                backwards = values[::-1]
            # (equal values share a bucket: the first match from the end is one of this bucket's)
            last[bucket] = count - 1 - min(map(backwards.index, ordered[first:end]))
    if len(last) < len(filled):
        for position in range(count - 1, -1, -1):
            bucket = bisect_left(boundaries, values[position])
            if bucket not in last:
                last[bucket] = position
                if len(last) == len(filled):
                    break
    return last


def _add_in_order(values: Sequence[float], start: Any) -> Any:
    """``start + values[0] + values[1] + ...``, left to right, as ``+=`` per value adds: by
    ``functools.reduce`` (a new float object per addition)."""
    return reduce(add, values, start)


if sys.version_info < (3, 12):
    # CPython before 3.12: sum() adds floats left to right in one C double (and an int, or a float
    # subclass, with the same + as the interpreter), allocating nothing per value. From 3.12,
    # sum() compensates a float sum (Neumaier), which is not what += per value gives.
    _add_in_order = sum  # type: ignore[assignment]  # noqa: F811


#: :func:`attributes_key` of attributes that are resolved every time (not cached)
_UNCACHED = object()
#: a value no attribute holds (:func:`record_values`)
_MISSING = object()


def attributes_key(attributes: Any) -> Any:
    """The key :meth:`FastHistogram._resolve` caches ``attributes``' resolution under, or
    :data:`_UNCACHED` for attributes resolved every time (see there). A caller recording several
    values with one attribute dict (one request's histograms) computes it once and passes it on."""
    if attributes:
        if _STRINGS.issuperset(map(type, attributes.values())):
            return tuple(attributes.items())  # (str values: equal values are the same series)
        values = tuple(attributes.values())
        types = tuple(map(type, values))
        # (float values are not cached: 0.0 and -0.0 are equal keys, yet an exemplar keeps the
        # measurement's own attributes)
        if _SCALARS.issuperset(types) and float not in types:
            return (_MIXED, tuple(attributes), types, values)
        return _UNCACHED
    return (attributes is None,)  # None or empty: kept apart (a measurement carries them as given)


#: the first item of :func:`attributes_key`'s key of attributes that are not all ``str``
_MIXED = object()


def extended_key(key: Any, name: str, value: Any) -> Any:
    """:func:`attributes_key` of ``{**attributes, name: value}`` (``name`` not among them), from
    ``key``, :func:`attributes_key` of ``attributes``, where that can be told without them: both
    all ``str`` (a request's token usage, its base attributes and the token type). Else ``None``
    (then the attributes' own key is found when they are recorded)."""
    if type(value) is str and type(key) is tuple and key and type(key[0]) is tuple:  # (all str: (name, value) pairs)
        return key + ((name, value),)
    return None


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
        #: attributes -> (the reader storages they were resolved against, the count of
        #: :func:`~otel_generate._lifecycle.forget_inherited_metrics` runs then, :class:`_Resolved`)
        self._cache: Dict[Any, Tuple[Any, int, _Resolved]] = {}
        self._sample_exemplar = _Aggregation._sample_exemplar  # offers to the reservoir only when told to
        self.broken = False
        # the SDK code checks of the default aggregation and reservoir, read now (at instrument())
        _aggregates_as_expected(_ExplicitBucketHistogramAggregation)
        _offer_code_known(_ExplicitBucketHistogramAggregation, AlignedHistogramBucketExemplarReservoir)

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
        reservoirs: List[Any] = []
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
                direct = boundaries is not None and _offers_as_expected(type(aggregation), reservoir)
                reservoirs.append(reservoir if direct else None)
        random = len(targets) > 1 and any(boundaries is None for _, boundaries in targets)
        entries = [
            # (the reservoir's bucket is the aggregation's where their boundaries are the same)
            (aggregation, boundaries, reservoir, boundaries is not None and boundaries == list(aggregation._boundaries))
            for aggregation, (_, boundaries), reservoir in zip(aggregations, targets, reservoirs)
        ]
        return _Resolved(cleaned, targets, aggregations, reuse, reuse and bulk, random, reservoirs, entries)

    def _resolve(self, attributes: Any, key: Any = None) -> "_Resolved":
        """:meth:`_targets` of ``attributes``, from the cache when they were resolved before.

        A remembered resolution is used while the consumer's reader storages are the same dict
        (the SDK replaces that dict when a reader is added or removed; an instrument's view
        matches never change once made) and no aggregation was removed since (the SDK never
        removes one; a forked child's reset, :func:`otel_generate._lifecycle.forget_inherited_metrics`,
        does, and counts it). Attribute sets whose values are not all ``str``, ``bool``, ``int`` or
        ``float`` are resolved every time: the cache key holds each value's type, as the SDK's
        key does (``True``, ``1`` and ``1.0`` are different series there, equal in a tuple).
        ``key``: :func:`attributes_key` of ``attributes`` when the caller has it already (``None``:
        computed here)."""
        storages = self._histogram._measurement_consumer._reader_storages
        forgotten = _lifecycle.metrics_forgotten
        if key is None:
            key = attributes_key(attributes)
        if key is _UNCACHED:
            key = None
        cached = self._cache.get(key) if key is not None else None
        if cached is not None and cached[0] is storages and cached[1] == forgotten:
            return cached[2]
        resolved = self._targets(self._clean(attributes, None) if attributes is not None else None)
        if key is not None and (key in self._cache or len(self._cache) < _CACHE_SIZE):
            self._cache[key] = (storages, forgotten, resolved)
        return resolved

    def _aggregate_all(
        self,
        values: List[float],
        context: Any,
        exemplar_filter: Any,
        resolved: "_Resolved",
        ordered: Optional[List[float]] = None,
    ) -> bool:
        """What ``aggregate()`` does per value (the SDK's own code, checked by
        :func:`_aggregates_as_expected`), for all values under one lock: the same sum in the same
        order, the bucket counts, min and max; then the exemplars, each bucket's last value where
        the reservoir keeps only that.

        Returns False, having changed nothing, unless every value is finite and >= 0 (then the
        public path logs and drops the others). Iterated in C: the values sorted once give min,
        max and each bucket's count (the values <= a boundary, by ``bisect_right``, are those
        ``bisect_left(boundaries, value)`` puts at or below its bucket); :func:`_add_in_order`
        adds left to right, as ``+=`` per value does. ``ordered``: ``sorted(values)`` when the
        caller has it."""
        time_ns, setfield = time.time_ns, object.__setattr__
        cleaned = resolved.cleaned
        # the filter answers from the context alone
        sample, ids = _exemplar_decision(exemplar_filter, context, values[0], time_ns(), cleaned)
        if sample and resolved.random:
            # a reservoir that may keep any value draws random numbers: the public path offers each
            # value to every aggregation in turn, and so does the per-value path
            return False
        if ordered is None:
            ordered = values if len(values) == 1 else sorted(values)
        # min and max per value keep the first of equal values (1 and 1.0, -0.0 and 0.0): the
        # sort is stable, so that is the first of its run in the sorted order
        low = ordered[0]
        if not low >= 0:  # a negative value, or NaN first
            return False
        high = ordered[bisect.bisect_left(ordered, ordered[-1])]
        m = None
        count = len(values)
        bisect_left, bisect_right = bisect.bisect_left, bisect.bisect_right
        checked = False
        for aggregation, (_, boundaries), reservoir in zip(
            resolved.aggregations, resolved.targets, resolved.reservoirs
        ):
            with aggregation._lock:
                total = _add_in_order(values, aggregation._sum)
                if not checked:  # a NaN or an infinity makes the sum so: then nothing is changed
                    if not math.isfinite(total):
                        return False
                    checked = True
                if aggregation._value is None:
                    aggregation._value = aggregation._get_empty_bucket_counts()
                counts, bounds = aggregation._value, aggregation._boundaries
                if count == 1:
                    counts[bisect_left(bounds, low)] += 1
                else:
                    below = 0  # values in the buckets so far
                    # (from the smallest value's bucket: the buckets below it hold none)
                    for index in range(bisect_left(bounds, low), len(bounds)):
                        upto = bisect_right(ordered, bounds[index])
                        counts[index] += upto - below
                        below = upto
                        if below == count:
                            break
                    else:
                        counts[len(bounds)] += count - below
                aggregation._sum = total
                if aggregation._record_min_max:  # (what min() and max() of the two keep)
                    if low < aggregation._min:
                        aggregation._min = low
                    if high > aggregation._max:
                        aggregation._max = high
            if not sample:
                continue
            if boundaries is None:  # a reservoir that may keep any value: every value offered, in order
                positions: Iterable[int] = range(len(values))
            elif count == 1:
                positions = (0,)
            else:
                positions = sorted(_last_in_each_bucket(values, ordered, boundaries).values())
            if reservoir is not None:  # what its offer does
                for position in positions:
                    value = values[position]
                    _offer_to_bucket(reservoir, bisect_left(boundaries, value), value, time_ns(), cleaned, ids)
                continue
            if m is None:  # only an exemplar reads a measurement
                m = self._measurement(values[0], time_ns(), self._histogram, context, None)
                setfield(m, "attributes", cleaned)
            for position in positions:
                setfield(m, "value", values[position])
                setfield(m, "time_unix_nano", time_ns())
                aggregation._sample_exemplar(m, True)
        return True

    def record_one(self, value: float, attributes: Any, key: Any = None, context: Any = None) -> None:
        """``histogram.record(value, attributes)`` in the current context: one value (a request's
        duration, time to first token, token count): :func:`record_values` of this one value.
        ``key``: :func:`attributes_key` of ``attributes``, and ``context``: the current context,
        when the caller has them (``None``: found here)."""
        record_values(((self, value, attributes, key),), context)

    def record_many(
        self,
        values: Iterable[float],
        attributes: Any,
        key: Any = None,
        context: Any = None,
        ordered: Optional[List[float]] = None,
    ) -> None:
        """``histogram.record(value, attributes)`` for every value, in order, in the current context.
        ``key``: :func:`attributes_key` of ``attributes``, and ``context``: the current context, when
        the caller has them (``None``: found here). ``ordered``: ``sorted(values)``, when the caller
        has it (a list of the same values, sorted: the values are not sorted again)."""
        record = self._histogram.record
        rest = values if type(values) is list else list(values)
        if not rest:
            return
        resolved = None
        if not self.broken and self._histogram._is_enabled():
            try:
                resolved = self._resolve(attributes, key)
                if context is None:
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
        if resolved.bulk and once and self._aggregate_all(rest, context, exemplar_filter, resolved, ordered):
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


def record_values(entries: Iterable[Tuple[FastHistogram, float, Any, Any]], context: Any = None) -> None:
    """``helper``'s ``histogram.record(value, attributes)`` for each ``(helper, value, attributes,
    key)`` of ``entries``, in order, all in ``context`` (the current context when ``None``): one
    value each (a request's duration, time to first token, token counts), into histograms that
    may differ. ``key``: :func:`attributes_key` of ``attributes`` (``None``: computed).

    Where the bulk path of :meth:`FastHistogram.record_many` may be taken and the value is a
    finite ``int`` or ``float`` >= 0, the SDK's ``aggregate()`` is repeated for it (its sum, min
    and max, its bucket; the exemplar offered when the filter says so) in this loop, without a
    call per value; otherwise that value goes to :meth:`FastHistogram.record_many`. What the
    values share is found once per measurement consumer (one per ``MeterProvider``): its
    exemplar filter and reader storages, and the filter's answer for ``context``."""
    consumer_seen = exemplar_filter = storages = None
    bisect_left, time_ns, forgotten = bisect.bisect_left, time.time_ns, _lifecycle.metrics_forgotten
    eligible = False
    sample, ids = False, None
    config_seen: Any = _MISSING
    enabled = False
    for helper, value, attributes, key in entries:
        histogram = helper._histogram
        resolved = None
        # (NaN is not in range; an int beyond the largest float goes to record_many, which raises
        # the OverflowError the public path raises)
        if not helper.broken and type(value) in _NUMBERS and 0 <= value <= _LARGEST:
            try:
                # the SDK's _is_enabled() reads only the meter's config, which a meter's instruments
                # share: asked once per config object (an SDK without one: per histogram)
                config = getattr(histogram, "_meter_config", histogram)
                if config is not config_seen:
                    enabled = histogram._is_enabled()
                    config_seen = config
                if enabled:
                    consumer = histogram._measurement_consumer
                    if consumer is not consumer_seen:  # (the request's histograms share one)
                        exemplar_filter = consumer._sdk_config.exemplar_filter
                        eligible = type(exemplar_filter) in helper._context_filters
                        storages = consumer._reader_storages
                        consumer_seen = consumer
                        if eligible:  # (the filter answers from the context alone)
                            if context is None:
                                context = helper._get_current()
                            sample, ids = _exemplar_decision(exemplar_filter, context, value, time.time_ns(), None)
                    if eligible:
                        # _resolve's remembered answer, without its call (an uncached key is never stored)
                        cached = helper._cache.get(key) if key is not None else None
                        if cached is not None and cached[0] is storages and cached[1] == forgotten:
                            resolved = cached[2]
                        else:
                            resolved = helper._resolve(attributes, key)
            except _NotEligible:
                resolved = None
            except Exception as fault:
                helper.broken = True
                log_fault_once(Fault.FAST_HISTOGRAM, fault)
                resolved = None
        if resolved is None or not resolved.bulk or (sample and resolved.random):
            # (a reservoir that may keep any value: the per-value path, see _aggregate_all)
            helper.record_many((value,), attributes, key, context)
            continue
        now = time_ns() if sample else 0  # (only an exemplar reads the time)
        m = None
        for aggregation, boundaries, reservoir, same in resolved.entries:
            # (the bucket found before the lock is taken: the boundaries never change)
            index = bisect_left(aggregation._boundaries, value)
            with aggregation._lock:  # what aggregate() does under its lock, in its order
                if aggregation._value is None:
                    aggregation._value = aggregation._get_empty_bucket_counts()
                aggregation._sum += value
                if aggregation._record_min_max:  # (what min() and max() of the two keep)
                    if value < aggregation._min:
                        aggregation._min = value
                    if value > aggregation._max:
                        aggregation._max = value
                aggregation._value[index] += 1
            if not sample:
                continue
            if reservoir is not None:  # what its offer does
                _offer_to_bucket(
                    reservoir, index if same else bisect_left(boundaries, value), value, now, resolved.cleaned, ids
                )
                continue
            if m is None:  # only an exemplar reads a measurement
                m = helper._measurement(value, now, histogram, context, None)
                object.__setattr__(m, "attributes", resolved.cleaned)
            aggregation._sample_exemplar(m, True)
