"""FastHistogram.record_many gives exactly what histogram.record() per value gives, or is not taken."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry import trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View
from opentelemetry.sdk.trace import TracerProvider

from otel_generate.fast_metrics import _MIXED, _UNCACHED, FastHistogram, attributes_key, extended_key, record_values

BUCKETS = [0.001, 0.005, 0.01, 0.05, 0.1]
VALUES = [0.0004, 0.002, 0.002, 0.007, 0.03, 0.2, 0.0, 0.049, 0.011] * 5
ATTRS = {"gen_ai.request.model": "m", "gen_ai.operation.name": "text_completion", "k": 3}


def _histogram(views=(), readers=1):
    readers = [InMemoryMetricReader() for _ in range(readers)]
    provider = MeterProvider(metric_readers=readers, views=list(views))
    meter = provider.get_meter("t")
    histogram = meter.create_histogram("h", unit="s", explicit_bucket_boundaries_advisory=BUCKETS)
    return histogram, readers


def _points(reader):
    data = reader.get_metrics_data()
    out = []
    for rm in data.resource_metrics if data is not None else ():
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                for p in metric.data.data_points:
                    out.append(
                        (
                            metric.name,
                            dict(p.attributes),
                            p.count,
                            p.sum,
                            p.min,
                            p.max,
                            tuple(p.bucket_counts),
                            tuple(p.explicit_bounds),
                            sorted((e.value, e.span_id, dict(e.filtered_attributes or {})) for e in p.exemplars),
                        )
                    )
    return sorted(out, key=repr)


def _both(
    values,
    attributes=ATTRS,
    views=(),
    readers=1,
    in_span=True,
    prime=True,
    one_by_one=False,
    keyed=False,
    presorted=False,
):
    """The same values through ``record()`` per value and through ``record_many``. ``prime``: one
    earlier value recorded in both the public way, as an earlier request does, so that the
    aggregations exist and ``record_many`` takes its fast path (else it goes the public way).
    ``keyed``: the attributes' cache key computed once by the caller and passed on, with the
    current context for ``record_one`` (as ``emit._record_metrics`` does for a request's histograms).
    ``presorted``: ``record_many`` is also handed ``sorted(values)`` (as emit hands it the inter-token
    latencies that derive sorted)."""
    tracer = TracerProvider().get_tracer("t")
    public, public_readers = _histogram(views, readers)
    fast_histogram, fast_readers = _histogram(views, readers)
    fast = FastHistogram.for_instrument(fast_histogram)
    assert fast is not None
    if prime:
        public.record(0.5, attributes)
        fast_histogram.record(0.5, attributes)
    span = tracer.start_span("request")
    context = trace.set_span_in_context(span) if in_span else None
    from opentelemetry import context as ctx

    token = ctx.attach(context) if context is not None else None
    try:
        for value in values:
            public.record(value, attributes)
        key = attributes_key(attributes) if keyed else None
        if one_by_one:
            current = ctx.get_current() if keyed else None  # (handed over with the key, as emit does)
            for value in values:
                fast.record_one(value, attributes, key, current)
        else:
            fast.record_many(iter(values), attributes, key, None, sorted(values) if presorted else None)
    finally:
        if token is not None:
            ctx.detach(token)
    return [_points(r) for r in public_readers], [_points(r) for r in fast_readers], fast


def test_same_data_points_and_exemplars_as_the_public_path():
    public, fast, helper = _both(VALUES)
    assert public == fast and not helper.broken
    (points,) = public[0:1]
    # counts per bucket (the primed 0.5 in the last)
    assert points[0][2] == len(VALUES) + 1 and points[0][6] == (10, 10, 5, 15, 0, 6)
    assert points[0][8]  # exemplars were sampled (in a sampled span) on both paths


def test_outside_a_span_no_exemplar_and_the_same_counts():
    public, fast, _ = _both(VALUES, in_span=False)
    assert public == fast and public[0][0][8] == []


def test_refused_values_go_through_the_public_path_and_are_dropped_the_same(caplog):
    values = [0.002, -1.0, math.inf, float("nan"), 0.03]
    public, fast, _ = _both(values)
    assert public == fast and public[0][0][2] == 2 + 1


def test_views_filtering_attributes_and_two_readers():
    views = [View(instrument_name="h", attribute_keys={"k"}, aggregation=ExplicitBucketHistogramAggregation([0.01]))]
    public, fast, _ = _both(VALUES, views=views, readers=2)
    assert public == fast and public[0][0][1] == {"k": 3} and public[0][0][6] == (25, 20 + 1)


def test_no_attributes_and_empty_values():
    public, fast, _ = _both(VALUES, attributes=None)
    assert public == fast
    public, fast, _ = _both([], prime=False)
    assert public == fast == [[]]
    public, fast, _ = _both([])
    assert public == fast and public[0][0][2] == 1


def test_not_taken_for_anything_but_the_sdk_histogram():
    from opentelemetry.metrics import NoOpMeterProvider

    assert FastHistogram.for_instrument(NoOpMeterProvider().get_meter("t").create_histogram("h")) is None
    assert FastHistogram.for_instrument(object()) is None


def test_a_fault_turns_it_off_and_every_value_still_arrives(monkeypatch):
    histogram, (reader,) = _histogram()
    fast = FastHistogram.for_instrument(histogram)

    def boom(cleaned):
        raise RuntimeError("internals changed")

    monkeypatch.setattr(fast, "_targets", boom)
    fast.record_many(VALUES, ATTRS)
    assert fast.broken is True
    assert _points(reader)[0][2] == len(VALUES)


@pytest.mark.parametrize("count", [1, 2, 127])
def test_counts(count):
    public, fast, _ = _both([0.003] * count)
    assert public == fast and public[0][0][2] == count + 1


def test_the_installed_sdk_aggregation_is_the_code_the_bulk_path_repeats():
    # if the SDK changes its histogram aggregation, the bulk path is not taken (and this says so)
    from opentelemetry.sdk.metrics._internal.aggregation import _ExplicitBucketHistogramAggregation

    from otel_generate.fast_metrics import _aggregates_as_expected

    assert _aggregates_as_expected(_ExplicitBucketHistogramAggregation)

    class Other(_ExplicitBucketHistogramAggregation):
        def aggregate(self, measurement, should_sample_exemplar=True):
            return super().aggregate(measurement, should_sample_exemplar)

    assert not _aggregates_as_expected(Other)


@pytest.mark.parametrize(
    "tokens, starts, prefill_steps",
    [
        ([1] * 6, None, 1),  # the common case: computed at once
        ([1, 1, 2, 1, 0, 1], None, 1),  # assisted decoding: several tokens, or none, per step
        ([1] * 6, [5, 16, 30, 47, 51, 70], 1),  # explicit starts (continuous batching)
        ([1] * 6, [0, 10, 25, 43, 60, 66], 1),  # explicit starts, back to back (generate()): at once
        ([1] * 6, None, 2),  # two prefill steps
    ],
)
def test_inter_token_latencies_in_seconds_are_those_of_the_generator(tokens, starts, prefill_steps):
    from otel_generate import clock, derive
    from otel_generate.request import Request

    request = Request(model="m", start_ns=0, start_wall_ns=0, timed=True, synchronized=True)
    request.step_ends_ns = [10, 25, 43, 60, 66, 81]
    request.step_tokens = tokens
    request.step_starts_ns = starts
    request.prefill_steps = prefill_steps
    expected = [gap / clock.NS_PER_S for gap in derive.inter_token_latencies_ns(request)]
    assert derive.inter_token_latencies_s(request) == expected and all(type(v) is float for v in expected)
    # what the emitter records: taken from the step latencies when derived with them
    summary = derive.derive(request, steps=True, inter_token=True)
    assert summary.inter_token_latencies_s == expected
    if tokens == [1] * 6 and starts is None and prefill_steps == 1:
        assert expected == [g / 1e9 for g in (15, 18, 17, 6, 15)]


def _count_resolutions(monkeypatch, fast):
    resolved = {"count": 0}
    targets = fast._targets

    def counting(cleaned):
        resolved["count"] += 1
        return targets(cleaned)

    monkeypatch.setattr(fast, "_targets", counting)
    return resolved


def test_later_calls_with_the_same_attributes_reuse_what_was_resolved(monkeypatch):
    histogram, (reader,) = _histogram()
    public, (public_reader,) = _histogram()
    fast = FastHistogram.for_instrument(histogram)
    resolved = _count_resolutions(monkeypatch, fast)
    for round_ in range(5):
        values = [0.002 * (round_ + 1), 0.03]
        for value in values:
            public.record(value, ATTRS)
        fast.record_many(values, dict(ATTRS))  # an equal dict, built anew as the emitter does
    # the first call finds no aggregation and goes the public way (which creates it); the second
    # resolves it, and every later one reuses that
    assert resolved["count"] == 2
    assert _points(reader) == _points(public_reader) and _points(reader)[0][2] == 10


def test_new_reader_storages_are_resolved_again(monkeypatch):
    histogram, (reader,) = _histogram()
    fast = FastHistogram.for_instrument(histogram)
    resolved = _count_resolutions(monkeypatch, fast)
    fast.record_many([0.002], ATTRS)
    fast.record_many([0.002], ATTRS)
    consumer = histogram._measurement_consumer
    consumer._reader_storages = dict(consumer._reader_storages)  # what adding or removing a reader does
    fast.record_many([0.002], ATTRS)
    assert resolved["count"] == 3 and _points(reader)[0][2] == 3  # (the first found no aggregation)


def test_threads_with_different_attributes_each_get_their_own_values():
    import threading

    histogram, (reader,) = _histogram()
    fast = FastHistogram.for_instrument(histogram)
    models = [f"model-{n}" for n in range(4)]
    for model in models:  # create every aggregation, as a first request does
        fast.record_many([0.5], {**ATTRS, "gen_ai.request.model": model})
    start = threading.Barrier(len(models))

    def requests(model, value):
        start.wait()
        for _ in range(200):
            fast.record_many([value, value], {**ATTRS, "gen_ai.request.model": model})

    threads = [threading.Thread(target=requests, args=(m, 0.001 * (n + 1))) for n, m in enumerate(models)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    points = {p[1]["gen_ai.request.model"]: p for p in _points(reader)}
    for n, model in enumerate(models):
        name, _, count, total, low, high, *_ = points[model]
        assert count == 401 and low == 0.001 * (n + 1) and high == 0.5
        assert total == pytest.approx(0.5 + 400 * 0.001 * (n + 1))


@settings(max_examples=150, deadline=None)
@given(
    values=st.lists(
        st.one_of(
            st.floats(min_value=0, max_value=0.2, allow_nan=False),
            st.sampled_from([0.0, 0.001, 0.005, 0.01, 0.05, 0.1]),  # on a boundary: bisect_left's side
            st.integers(min_value=0, max_value=3),
        ),
        max_size=60,
    ),
    refused=st.lists(st.sampled_from([-1.0, math.inf, float("nan")]), max_size=2),
    at=st.integers(min_value=0, max_value=60),
    in_span=st.booleans(),
    presorted=st.booleans(),
)
def test_any_values_give_what_the_public_path_gives(values, refused, at, in_span, presorted):
    values = values[:at] + refused + values[at:]
    public, fast, helper = _both(values, in_span=in_span, presorted=presorted)
    assert public == fast and not helper.broken


def test_true_one_and_one_point_zero_are_three_series_as_in_the_sdk():
    histogram, (reader,) = _histogram()
    public, (public_reader,) = _histogram()
    fast = FastHistogram.for_instrument(histogram)
    for _ in range(3):  # the first creates each aggregation, the later ones are remembered
        for value in (1, True, 1.0):
            public.record(0.002, {"k": value})
            fast.record_many([0.002], {"k": value})
    assert _points(reader) == _points(public_reader) and len(_points(reader)) == 3


def test_equal_extremes_keep_the_first_as_min_and_max_per_value_do():
    for values in ([1, 5, 5.0], [5.0, 5, 1], [0.0, -0.0, 0.002], [-0.0, 0.0]):
        public, fast, _ = _both(values)
        assert public == fast
        assert [type(p[4]) for p in public[0]] == [type(p[4]) for p in fast[0]]
        assert [type(p[5]) for p in public[0]] == [type(p[5]) for p in fast[0]]


def test_two_random_reservoirs_are_offered_each_value_in_the_public_order():
    import random

    from opentelemetry import context as ctx
    from opentelemetry.sdk.metrics._internal.exemplar import SimpleFixedSizeExemplarReservoir

    def views():
        return [
            View(
                instrument_name="h",
                exemplar_reservoir_factory=lambda aggregation: lambda **kw: SimpleFixedSizeExemplarReservoir(size=1),
            )
        ]

    values = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8]
    public, public_readers = _histogram(views(), readers=2)
    fast_histogram, fast_readers = _histogram(views(), readers=2)
    fast = FastHistogram.for_instrument(fast_histogram)
    span = TracerProvider().get_tracer("t").start_span("request")
    token = ctx.attach(trace.set_span_in_context(span))
    try:
        public.record(0.5, ATTRS)
        fast_histogram.record(0.5, ATTRS)
        random.seed(11)
        for value in values:
            public.record(value, ATTRS)
        random.seed(11)
        fast.record_many(values, ATTRS)
    finally:
        ctx.detach(token)
    assert [_points(r) for r in public_readers] == [_points(r) for r in fast_readers]


def test_a_cleared_aggregation_is_resolved_again_as_after_a_fork():
    from otel_generate._lifecycle import forget_inherited_metrics

    histogram, (reader,) = _histogram()
    fast = FastHistogram.for_instrument(histogram)
    histogram.record(0.5, ATTRS)
    fast.record_many([0.002], ATTRS)
    reader.get_metrics_data()
    assert forget_inherited_metrics([histogram]) == 1  # what a forked child does
    histogram.record(0.5, ATTRS)  # the child's first request (the public path recreates the series)
    fast.record_many([0.002, 0.003], ATTRS)
    (point,) = _points(reader)
    assert point[2] == 3 and point[4] == 0.002 and point[5] == 0.5


@settings(max_examples=300, deadline=None)
@given(
    values=st.lists(
        st.one_of(st.floats(min_value=0, max_value=0.2), st.sampled_from(BUCKETS), st.integers(0, 3)), min_size=1
    ),
    boundaries=st.lists(st.sampled_from([0.0, *BUCKETS, 0.15, 2.0]), unique=True).map(sorted),
)
def test_each_buckets_last_position_is_that_of_a_scan_of_every_value(values, boundaries):
    import bisect

    from otel_generate.fast_metrics import _last_in_each_bucket

    every: dict = {}
    for position, value in enumerate(values):
        every[bisect.bisect_left(boundaries, value)] = position
    assert _last_in_each_bucket(values, sorted(values), boundaries) == every


def test_each_buckets_last_position_when_a_rare_bucket_is_far_from_the_end():
    import bisect

    from otel_generate.fast_metrics import _last_in_each_bucket

    boundaries = list(BUCKETS)
    steady = [0.02 + 0.0001 * (i % 7) for i in range(127)]
    cases = [
        steady[:5] + [0.3] + steady[6:],  # one slow step early (a bucket of one value)
        [0.3, 0.3] + steady[2:],  # two equal slow steps first
        [0.6, 0] + steady[2:-1] + [0.0],  # a rare bucket of 0 and 0.0 (equal values, one bucket)
        [0.07] * 64 + steady[64:],  # a regime change: the earlier bucket's last value far back
        [0.07] * 64 + steady[64:126] + [0.3],  # both, and a rare bucket at the very end
    ]
    for values in cases:
        every: dict = {}
        for position, value in enumerate(values):
            every[bisect.bisect_left(boundaries, value)] = position
        assert _last_in_each_bucket(values, sorted(values), boundaries) == every, values


@settings(max_examples=150, deadline=None)
@given(
    values=st.lists(
        st.one_of(
            st.floats(min_value=0, max_value=0.2, allow_nan=False),
            st.sampled_from([0.0, 0.001, 0.005, 0.01, 0.05, 0.1, True, -1.0, math.inf, float("nan")]),
            st.integers(min_value=0, max_value=3),
        ),
        max_size=12,
    ),
    in_span=st.booleans(),
    readers=st.integers(min_value=1, max_value=2),
)
def test_record_one_gives_what_record_gives_value_by_value(values, in_span, readers):
    public, fast, helper = _both(values, in_span=in_span, readers=readers, one_by_one=True)
    assert public == fast and not helper.broken


def _three_histograms():
    reader = InMemoryMetricReader()
    meter = MeterProvider(metric_readers=[reader]).get_meter("t")
    histograms = [
        meter.create_histogram(f"h{index}", unit="s", explicit_bucket_boundaries_advisory=BUCKETS[: index + 3])
        for index in range(3)
    ]
    return histograms, reader


@settings(max_examples=100, deadline=None)
@given(
    entries=st.lists(
        st.tuples(
            st.integers(min_value=0, max_value=2),
            st.one_of(
                st.floats(min_value=0, max_value=0.2, allow_nan=False),
                st.sampled_from([0.0, 0.01, 7, True, -1.0, math.inf, float("nan")]),
            ),
            st.sampled_from([ATTRS, {"a": "x"}, {"a": "x", "f": 0.5}, None]),
            st.booleans(),
        ),
        max_size=8,
    ),
    primed=st.lists(st.booleans(), min_size=3, max_size=3),
    in_span=st.booleans(),
)
def test_values_into_several_histograms_give_what_record_gives_value_by_value(entries, primed, in_span):
    """record_values (a request's single values: several histograms of one meter, one context)
    gives what record() of each value in turn gives; a histogram whose aggregation does not exist
    yet (not primed) takes the public path for its values."""
    from opentelemetry import context as ctx

    public, public_reader = _three_histograms()
    fast_histograms, fast_reader = _three_histograms()
    helpers = [FastHistogram.for_instrument(histogram) for histogram in fast_histograms]
    assert None not in helpers
    for index, prime in enumerate(primed):
        if prime:  # (an earlier request: the aggregations of ATTRS exist)
            public[index].record(0.5, ATTRS)
            fast_histograms[index].record(0.5, ATTRS)
    span = TracerProvider().get_tracer("t").start_span("request")
    context = trace.set_span_in_context(span) if in_span else ctx.get_current()
    token = ctx.attach(context)
    try:
        for index, value, attributes, _ in entries:
            public[index].record(value, attributes)
        record_values(
            [
                (helpers[index], value, attributes, attributes_key(attributes) if keyed else None)
                for index, value, attributes, keyed in entries
            ],
            context,
        )
    finally:
        ctx.detach(token)
    assert _points(public_reader) == _points(fast_reader)
    assert not any(helper.broken for helper in helpers)


@settings(max_examples=60, deadline=None)
@given(
    values=st.lists(st.floats(min_value=0, max_value=0.2, allow_nan=False), min_size=1, max_size=12),
    attributes=st.sampled_from([ATTRS, {"a": "x", "b": "y"}, {"a": "x", "f": 0.5}, {"a": True, "b": 1}, {}, None]),
    one_by_one=st.booleans(),
    in_span=st.booleans(),
)
def test_a_key_computed_by_the_caller_gives_what_record_gives(values, attributes, one_by_one, in_span):
    public, fast, helper = _both(values, attributes, in_span=in_span, one_by_one=one_by_one, keyed=True)
    assert public == fast and not helper.broken


def test_the_cache_key_of_attributes():
    assert attributes_key({"a": "x", "b": "y"}) == (("a", "x"), ("b", "y"))
    assert attributes_key({"a": True, "b": 1}) == (_MIXED, ("a", "b"), (bool, int), (True, 1))
    assert attributes_key({"a": "x", "f": 0.5}) is _UNCACHED  # floats: resolved every time
    assert attributes_key({"a": ["x"]}) is _UNCACHED
    assert attributes_key(None) == (True,) and attributes_key({}) == (False,)


def test_attributes_that_are_not_cached_are_resolved_every_time_with_a_key_given(monkeypatch):
    histogram, (reader,) = _histogram()
    fast = FastHistogram.for_instrument(histogram)
    attributes = {"a": "x", "f": 0.5}
    histogram.record(0.5, attributes)
    resolved = []
    original = FastHistogram._targets
    monkeypatch.setattr(FastHistogram, "_targets", lambda self, cleaned: resolved.append(1) or original(self, cleaned))
    key = attributes_key(attributes)
    for _ in range(3):
        fast.record_one(0.01, attributes, key)
    assert len(resolved) == 3 and fast._cache == {}
    (point,) = _points(reader)
    assert point[2] == 4


def test_an_exemplar_keeps_its_own_attributes_when_they_equal_another_sets():
    # 0.0 and -0.0 are one series for the SDK, but an exemplar keeps the measurement's own
    # attributes (the view below drops "x" from the point, so the exemplar carries it)
    from opentelemetry.sdk.metrics._internal.exemplar import AlwaysOnExemplarFilter

    def histogram():
        reader = InMemoryMetricReader()
        provider = MeterProvider(
            metric_readers=[reader],
            views=[View(instrument_name="h", attribute_keys={"k"})],
            exemplar_filter=AlwaysOnExemplarFilter(),
        )
        return provider.get_meter("t").create_histogram("h", explicit_bucket_boundaries_advisory=BUCKETS), reader

    public, public_reader = histogram()
    fast_histogram, fast_reader = histogram()
    fast = FastHistogram.for_instrument(fast_histogram)
    for instrument in (public, fast_histogram):
        instrument.record(0.5, {"k": "a", "x": 0.0})
    fast.record_one(0.8, {"k": "a", "x": 0.0})  # the first attribute set resolved (and remembered)
    public.record(0.8, {"k": "a", "x": 0.0})
    fast.record_one(0.08, {"k": "a", "x": -0.0})
    public.record(0.08, {"k": "a", "x": -0.0})
    fast.record_many([0.009], {"k": "a", "x": -0.0})
    public.record(0.009, {"k": "a", "x": -0.0})
    (point,) = _points(fast_reader)
    assert _points(public_reader) == [point]
    assert [str(attributes["x"]) for _, _, attributes in point[8]] == ["-0.0", "-0.0", "0.0"]


def test_record_one_raises_as_record_for_an_int_beyond_the_largest_float():
    histogram, (reader,) = _histogram()
    fast = FastHistogram.for_instrument(histogram)
    histogram.record(5, ATTRS)
    with pytest.raises(OverflowError):
        histogram.record(10**400, ATTRS)
    with pytest.raises(OverflowError):
        fast.record_one(10**400, ATTRS)
    (point,) = _points(reader)
    assert point[2] == 1 and point[3] == 5  # nothing of it recorded by either


def test_the_sum_is_added_value_by_value_in_order_not_compensated():
    # 0.1 ten times: added one at a time (as aggregate() does) the sum is not what a compensated
    # sum (math.fsum, or sum() from Python 3.12) gives
    values = [0.1] * 10
    public, fast, helper = _both(values)
    (point,) = fast[0]
    naive = 0.5
    for value in values:
        naive += value
    assert public == fast and not helper.broken and point[3] == naive != math.fsum([0.5, *values])


@settings(max_examples=100, deadline=None)
@given(
    attributes=st.dictionaries(
        st.text(max_size=3), st.one_of(st.text(max_size=3), st.booleans(), st.integers()), max_size=3
    ),
    value=st.one_of(st.text(max_size=3), st.integers()),
)
def test_a_key_extended_by_one_attribute_is_that_attributes_own_key(attributes, value):
    name = "gen_ai.token.type"  # (not among the drawn names: at most 3 characters)
    extended = extended_key(attributes_key(attributes), name, value)
    if extended is None:  # not told from the key alone: the attributes' own is found when recorded
        assert not attributes or not all(type(v) is str for v in attributes.values()) or type(value) is not str
    else:
        assert extended == attributes_key({**attributes, name: value})
