"""otel_generate.derive: hand-built requests in, exact figures out (no model, no SDK)."""

from __future__ import annotations

import ast
import pathlib
import random
from decimal import Decimal
from fractions import Fraction

import pytest

from otel_generate.derive import (
    derive,
    inter_token_latencies_ns,
    inter_token_latencies_s,
    outliers,
    prefill_indices,
    step_starts_ns,
)
from otel_generate.policy import STEP_SPANS_ALL, STEP_SPANS_NONE, STEP_SPANS_SLOW, SlowRequests, StepSpanPolicy
from otel_generate.request import InnerCall, Request

NS = 1_000_000_000


def make(ends, tokens, start=0, end=None, **fields):
    request = Request(model="m", start_ns=start, start_wall_ns=1_700_000_000 * NS, **fields)
    request.step_ends_ns = list(ends)
    request.step_tokens = list(tokens)
    request.end_ns = end if end is not None else (ends[-1] + 5 if ends else start + 5)
    return request


def test_back_to_back_steps_of_one_token():
    request = make([10, 25, 43, 60], [1, 1, 1, 1], start=0, end=70)
    s = derive(request, steps=True, inter_token=True)
    assert s.duration_s == 70 / NS
    assert s.error_type is None
    assert s.time_to_first_token_s == 10 / NS
    assert s.time_per_output_token_s == ((60 - 10) / 3) / NS
    assert s.step_latencies_ns == [10, 15, 18, 17]
    assert s.step_latencies_s == [10 / NS, 15 / NS, 18 / NS, 17 / NS]
    assert list(s.step_starts_ns) == [0, 10, 25, 43] and list(s.step_ends_ns) == [10, 25, 43, 60]
    assert s.inter_token_latencies_s == [15 / NS, 18 / NS, 17 / NS]
    assert s.prefill == {0}
    assert not s.steps_unseen and not s.decided and s.step_spans == 0  # no spans asked


def test_explicit_step_starts_of_continuous_batching():
    request = make([10, 25, 43, 60], [1, 1, 1, 1], start=0, end=60)
    request.step_starts_ns = [5, 16, 30, 47]
    s = derive(request, steps=True, inter_token=True)
    assert s.step_latencies_ns == [5, 9, 13, 13]
    assert list(s.step_starts_ns) == [5, 16, 30, 47]
    assert s.time_to_first_token_s == 10 / NS  # from the submission, not the first batch step
    assert s.inter_token_latencies_s == [9 / NS, 13 / NS, 13 / NS]


def test_steps_of_several_tokens_divide_their_latency():
    """Assisted decoding: a step of 3 tokens per sequence is one gap of a third of its latency."""
    request = make([10, 25, 43, 60], [1, 3, 1, 2], start=0)
    s = derive(request, inter_token=True)
    assert s.time_per_output_token_s == ((60 - 10) / 6) / NS
    assert s.inter_token_latencies_s == [(15 / 3) / NS, 18 / NS, (17 / 2) / NS]


def test_a_later_inner_calls_first_step_is_a_prefill_and_no_gap():
    request = make([10, 16, 25, 40, 44, 50], [1, 1, 3, 1, 0, 2], start=0)
    request.calls = [InnerCall(start_ns=0, first_step=0, steps=3), InnerCall(start_ns=25, first_step=3, steps=3)]
    assert prefill_indices(request) == {0, 3}
    assert list(inter_token_latencies_ns(request)) == [6, 3, 3]
    s = derive(request, steps=True, inter_token=True)
    assert s.prefill == {0, 3}
    assert s.inter_token_latencies_s == [6 / NS, 3 / NS, 3 / NS]


def test_chunked_prefill_first_token_at_the_first_step_that_produced_one():
    request = make([10, 25, 43, 60], [0, 1, 1, 1], start=0, prefill_steps=2)
    s = derive(request, steps=True, inter_token=True)
    assert s.prefill == {0, 1}
    assert s.time_to_first_token_s == 25 / NS
    assert s.time_per_output_token_s == ((60 - 25) / 2) / NS
    assert s.inter_token_latencies_s == [18 / NS, 17 / NS]


@pytest.mark.parametrize("ends, tokens", [([], []), ([10], [1]), ([10, 20], [0, 0])])
def test_undefined_figures_are_none(ends, tokens):
    request = make(ends, tokens, start=0, end=30)
    s = derive(request, steps=True, inter_token=True)
    assert s.time_per_output_token_s is None
    assert s.inter_token_latencies_s == ()
    assert s.time_to_first_token_s == (10 / NS if tokens == [1] else None)
    assert s.step_latencies_ns == [end - start for start, end in zip([0] + ends[:-1], ends)]


def test_no_end_is_a_zero_duration():
    request = make([10], [1])
    request.end_ns = None
    assert derive(request).duration_s == 0.0


def test_a_failed_request_has_its_error_type_and_no_inter_token_latencies():
    request = make([10, 25, 43], [1, 1, 1], error=ValueError("boom"))
    s = derive(request, steps=True, inter_token=True)
    assert s.error_type == "ValueError"
    assert s.time_to_first_token_s == 10 / NS  # still on the record; the metrics skip it
    assert s.inter_token_latencies_s == ()


def test_only_what_is_asked_is_derived():
    request = make([10, 25, 43, 60], [1, 1, 1, 1])
    s = derive(request)
    assert (s.step_latencies_ns, s.step_latencies_s, s.inter_token_latencies_s, s.step_starts_ns) == ((),) * 4
    assert s.time_per_output_token_s == ((60 - 10) / 3) / NS
    # the inter-token latencies alone (an unsampled request) equal those read from the step latencies
    assert derive(request, inter_token=True).inter_token_latencies_s == [15 / NS, 18 / NS, 17 / NS]


def test_outliers_are_decode_steps_above_factor_times_the_median():
    assert outliers([100, 10, 10, 10, 50], {0}, 3.0) == {4}
    assert outliers([100, 10, 10, 10, 30], {0}, 3.0) == frozenset()  # not above the limit
    assert outliers([100, 10, 50], {0}, 3.0) == frozenset()  # fewer than 3 decode steps
    assert outliers([10, 10, 12, 10, 100], {0, 3}, 3.0) == {4}  # median of 10, 12, 100


def test_outliers_match_the_definition_on_random_steps():
    import statistics

    rng = random.Random(7)
    for _ in range(2000):
        latencies = [rng.choice((1, 2, 3, 5, 9, 10, 11, 30, 31, 100)) for _ in range(rng.randint(0, 12))]
        prefill = set(rng.sample(range(len(latencies)), min(len(latencies), rng.randint(0, 2)))) | {0}
        factor = rng.choice((1.0, 1.5, 3.0, 10.0))
        decode = [(i, x) for i, x in enumerate(latencies) if i not in prefill]
        expected = frozenset()
        if len(decode) >= 3:
            limit = factor * statistics.median(x for _, x in decode)
            expected = frozenset(i for i, x in decode if x > limit)
        assert outliers(latencies, prefill, factor) == expected, (latencies, prefill, factor)


def test_outliers_of_a_recording_request_are_the_nanosecond_scans_even_at_the_limit():
    """The common case (one token a step, back to back, only the first step a prefill) tells "no
    outlier" from the latencies in seconds, sorted once; a step at, just above or just below factor
    times the median must still get what outliers() gives in nanoseconds."""
    rng = random.Random(18)
    for _ in range(3000):
        count = rng.randint(1, 12)
        base = rng.choice((1, 7, 999_999, 1_000_000, 3_333_333, 10**9 + 1))
        latencies = [base + rng.randint(-2, 2) for _ in range(count)]
        factor = rng.choice((1.0, 1.5, 2.0, 3.0, 3.0000000001))
        median_position = rng.randrange(1, count) if count > 1 else 0
        for index in rng.sample(range(count), min(count, rng.randint(0, 2))):
            # a step at the limit: factor times the median, give or take a nanosecond
            latencies[index] = max(1, int(factor * latencies[median_position]) + rng.randint(-1, 1))
        start = rng.choice((0, 10**15))
        ends = [start + sum(latencies[: i + 1]) for i in range(count)]
        request = make(ends, [1] * count, start=start, prefill_steps=1)
        s = derive(request, StepSpanPolicy(STEP_SPANS_ALL, outlier_factor=factor), spans=True, inter_token=True)
        assert s.outliers == outliers(latencies, {0}, factor), (latencies, factor)
    # beyond 2**53 ns a step 2 ns above the limit reads at or below it in seconds: the margin sends it
    # to the nanosecond scan
    median, above = 13_298_756_866_041_503, 39_896_270_598_124_513
    assert above > 3.0 * median and above / NS <= 3.0 * (median / NS)
    latencies = [5, median, median, median, above]
    request = make([sum(latencies[: i + 1]) for i in range(5)], [1] * 5, prefill_steps=1)
    assert derive(request, StepSpanPolicy(STEP_SPANS_ALL), spans=True, inter_token=True).outliers == {4}
    # explicit starts after their ends (a malformed record): negative latencies get the scan's answer,
    # also a step just above a negative limit (the relative margin would point the wrong way)
    latencies = [10, -10 * NS, -10 * NS, -4_999_999_998]
    request = make([10, 20, 30, 40], [1] * 4, prefill_steps=1)
    request.step_starts_ns = [end - latency for end, latency in zip(request.step_ends_ns, latencies)]
    assert outliers(latencies, {0}, 0.5) == {3}
    assert derive(request, StepSpanPolicy(STEP_SPANS_ALL, outlier_factor=0.5), spans=True).outliers == {3}
    # a median of a negative and a positive latency cancels in seconds: the scan
    big = 123_456_789_012
    latencies = [20_000_000, -big, -big, big + 1, big + 1]
    starts = [10**15 + 10**9 * i for i in range(5)]
    request = make([start + latency for start, latency in zip(starts, latencies)], [1] * 5, start=10**15 - 1)
    request.step_starts_ns = starts
    factor = 246913331112.42197
    assert outliers(latencies, {0}, factor) == {3, 4}
    assert derive(request, StepSpanPolicy(STEP_SPANS_ALL, outlier_factor=factor), spans=True).outliers == {3, 4}


@pytest.mark.parametrize("factor", [10**400, Decimal(3), Fraction(7, 2), 3])
def test_a_factor_that_is_not_a_float_gets_the_nanosecond_scan(factor):
    """Options makes the factor a float; a policy built by hand may hold any number that outliers()
    multiplies (10**400 and a Decimal would raise in the seconds' check)."""
    request = make([10, 13, 16, 25, 29], [1] * 5, prefill_steps=1)
    expected = outliers([10, 3, 3, 9, 4], {0}, factor)
    assert derive(request, StepSpanPolicy(STEP_SPANS_ALL, outlier_factor=factor), spans=True).outliers == expected


def test_step_spans_decision_under_each_policy():
    request = make([10, 20, 30, 40, 90], [1, 1, 1, 1, 1], start=0)
    everything = derive(request, StepSpanPolicy(STEP_SPANS_ALL, max_step_spans=3), spans=True)
    assert (everything.decided, everything.emit_steps, everything.steps_emitted) == (True, True, True)
    assert everything.step_spans == 3 and everything.reason is None
    assert everything.outliers == {4}  # 50 > 3 x 10
    nothing = derive(request, StepSpanPolicy(STEP_SPANS_NONE), spans=True)
    assert (nothing.decided, nothing.emit_steps, nothing.steps_emitted, nothing.step_spans) == (True, False, False, 0)
    capped = derive(request, StepSpanPolicy(STEP_SPANS_ALL, max_step_spans=0), spans=True)
    assert capped.emit_steps and not capped.steps_emitted and capped.step_spans == 0


def test_slow_policy_gives_its_reason():
    fast_enough = SlowRequests(time_to_first_token_s=1.0, time_per_output_token_s=1.0, fraction=0.0)
    policy = StepSpanPolicy(STEP_SPANS_SLOW, slow=fast_enough)
    request = make([10, 20, 30], [1, 1, 1])
    s = derive(request, policy, spans=True)
    assert (s.emit_steps, s.reason, s.step_spans) == (False, None, 0)
    failed = make([10, 20, 30], [1, 1, 1], error=RuntimeError("x"))
    s = derive(failed, policy, spans=True)
    assert (s.emit_steps, s.reason, s.step_spans) == (True, "error", 3)
    slow_first = make([2 * NS, 2 * NS + 10], [1, 1])
    s = derive(slow_first, policy, spans=True)
    assert (s.emit_steps, s.reason) == (True, "time_to_first_token")
    # the two successful requests' ttft and tpot went into the model's windows, the failed one's did not
    assert fast_enough.models() == {"m": 4}


@pytest.mark.parametrize(
    "fields, unseen",
    [
        ({"unobserved": "custom loop"}, True),
        ({"uninstrumented": True}, False),  # steps were timed before uninstrument(): counted
        ({"timed": False}, False),
    ],
)
def test_no_decision_without_seen_and_timed_steps(fields, unseen):
    request = make([10, 20, 30], [1, 1, 1], **fields)
    s = derive(request, StepSpanPolicy(), spans=True)
    assert s.steps_unseen is unseen
    assert s.decided is (not unseen and request.timed)


def test_uninstrumented_before_any_step_is_unseen():
    request = make([], [], uninstrumented=True)
    assert derive(request, spans=True).steps_unseen is True


def test_fast_and_general_inter_token_latencies_agree_on_random_requests():
    rng = random.Random(16)
    for _ in range(200):
        count = rng.randint(0, 12)
        ends, now = [], rng.randint(0, 10**12)
        start = now
        for _ in range(count):
            now += rng.randint(1, 10**9)
            ends.append(now)
        tokens = [rng.choice([1, 1, 1, 0, 2]) if rng.random() < 0.3 else 1 for _ in range(count)]
        request = make(ends, tokens, start=start)
        if rng.random() < 0.3 and count:
            request.step_starts_ns = [end - rng.randint(0, 5) for end in [start] + ends[:-1]]
        expected = [gap / NS for gap in inter_token_latencies_ns(request)]
        assert inter_token_latencies_s(request) == expected
        if derive(request).time_per_output_token_s is not None:
            assert derive(request, steps=True, inter_token=True).inter_token_latencies_s == expected
            assert derive(request, inter_token=True).inter_token_latencies_s == expected
        assert list(step_starts_ns(request)) == (request.step_starts_ns or [start] + ends[:-1])


def test_request_and_derive_import_only_leaf_modules():
    """request.py imports nothing from the package; derive.py only the record and leaf modules."""
    root = pathlib.Path(__file__).resolve().parents[2] / "otel_generate"
    leaves = {"otel_generate.clock", "otel_generate._faults", "otel_generate.attributes", "otel_generate.options"}
    allowed = {
        "request.py": set(),
        "derive.py": leaves | {"otel_generate.policy", "otel_generate.request"},
        "policy.py": {"otel_generate.attributes"},  # the lowest layer: not even the options
    }
    for name, permitted in allowed.items():
        found = set()
        for node in ast.walk(ast.parse((root / name).read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("otel_generate"):
                found.update(
                    f"{node.module}.{alias.name}" if node.module == "otel_generate" else node.module
                    for alias in node.names
                )
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names if alias.name.startswith("otel_generate"))
        assert found <= permitted, (name, found - permitted)


def test_the_policys_defaults_are_the_options_defaults():
    from otel_generate import options

    policy = StepSpanPolicy()
    assert (policy.name, policy.max_step_spans, policy.outlier_factor) == (
        options.STEP_SPANS_ALL,
        options.DEFAULT_MAX_STEP_SPANS,
        options.DEFAULT_OUTLIER_FACTOR,
    )
    with pytest.raises(ValueError):
        StepSpanPolicy(STEP_SPANS_SLOW)


def test_response_figures_in_seconds_time_to_first_chunk_always_the_rest_with_the_steps():
    request = make([10, 25, 43], [1, 1, 1], start=100, first_chunk_ns=130)
    request.streamer_ns, request.queue_ns = 7, 4
    request.candidates_proposed, request.candidates_accepted = 8, 6
    bare = derive(request)  # an unsampled request: only what its metrics and the content event read
    assert bare.time_to_first_chunk_s == 30 / NS
    assert (bare.streamer_s, bare.time_in_queue_s, bare.acceptance_rate) == (None, None, None)
    full = derive(request, steps=True)
    assert full.time_to_first_chunk_s == 30 / NS
    assert (full.streamer_s, full.time_in_queue_s, full.acceptance_rate) == (7 / NS, 4 / NS, 0.75)
    request.candidates_proposed = 0  # nothing proposed: no rate, not a division by zero
    assert derive(request, steps=True).acceptance_rate is None
    assert derive(make([10], [1])).time_to_first_chunk_s is None
