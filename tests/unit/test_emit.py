"""otel_generate.emit: hand-built requests fed to the emitter with an in-memory SDK (no model).

Every expected figure is computed here from the request's own numbers, not read back from
otel_generate.derive.
"""

from __future__ import annotations

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF
from opentelemetry.trace import StatusCode

from otel_generate import attributes as A
from otel_generate import emit, telemetry
from otel_generate.options import Options
from otel_generate.record import GenerationRecord
from otel_generate.request import InnerCall, Request

NS = 1_000_000_000
WALL = 1_700_000_000 * NS  # the wall clock at the request's start
START = 5_000  # the monotonic clock at the request's start


class SDK:
    """An in-memory tracer and meter provider, and a Telemetry on them."""

    def __init__(self, sampler=None, **options):
        self.spans = InMemorySpanExporter()
        self.tracer_provider = TracerProvider(sampler=sampler) if sampler is not None else TracerProvider()
        self.tracer_provider.add_span_processor(SimpleSpanProcessor(self.spans))
        self.reader = InMemoryMetricReader()
        self.meter_provider = MeterProvider(metric_readers=[self.reader])
        self.telemetry = telemetry.Telemetry.from_options(
            Options(tracer_provider=self.tracer_provider, meter_provider=self.meter_provider, **options)
        )

    def run(self, request, **kwargs):
        span = emit.start_request_span(self.telemetry, request.model, start_time=request.start_wall_ns)
        return emit.finish(self.telemetry, span, request, **kwargs)

    def finished(self):
        return list(self.spans.get_finished_spans())

    def request_span(self):
        (span,) = [s for s in self.finished() if s.name == f"text_completion {MODEL}"]
        return span

    def step_spans(self):
        steps = [s for s in self.finished() if s.name in (A.STEP_SPAN_PREFILL, A.STEP_SPAN_DECODE)]
        return sorted(steps, key=lambda s: s.attributes[A.GENERATE_STEP_INDEX])

    def histograms(self):
        """name -> [(attributes, count, sum)]"""
        found = {}
        data = self.reader.get_metrics_data()
        for resource in data.resource_metrics if data else ():
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    found[metric.name] = [(dict(p.attributes), p.count, p.sum) for p in metric.data.data_points]
        return found


MODEL = "tiny"


def make(ends, tokens, **fields):
    request = Request(model=MODEL, start_ns=START, start_wall_ns=WALL, **fields)
    request.step_ends_ns = [START + end for end in ends]
    request.step_tokens = list(tokens)
    request.end_ns = request.step_ends_ns[-1] + 7 if ends else START + 7
    request.input_tokens, request.output_tokens = 4, sum(tokens)
    request.output_tokens_per_sequence = [sum(tokens)]
    request.finish_reasons = ["length"]
    return request


BASE = {
    A.GEN_AI_OPERATION_NAME: "text_completion",
    A.GEN_AI_PROVIDER_NAME: "transformers",
    A.GEN_AI_REQUEST_MODEL: MODEL,
}


def test_a_sampled_request_gives_its_span_step_spans_and_metrics():
    sdk = SDK()
    ends = [100, 130, 170, 200, 260]
    request = make(ends, [1] * 5)
    record = sdk.run(request, need_record=True)

    span = sdk.request_span()
    latencies = [ends[0]] + [b - a for a, b in zip(ends, ends[1:])]
    assert span.start_time == WALL and span.end_time == WALL + ends[-1] + 7
    assert span.attributes[A.GEN_AI_REQUEST_MODEL] == MODEL
    assert span.attributes[A.GEN_AI_USAGE_INPUT_TOKENS] == 4
    assert span.attributes[A.GEN_AI_USAGE_OUTPUT_TOKENS] == 5
    assert list(span.attributes[A.GEN_AI_RESPONSE_FINISH_REASONS]) == ["length"]
    assert span.attributes[A.GENERATE_STEPS] == 5
    assert list(span.attributes[A.GENERATE_STEP_LATENCIES]) == [v / NS for v in latencies]
    assert span.attributes[A.GENERATE_TIME_TO_FIRST_TOKEN] == 100 / NS
    assert span.attributes[A.GENERATE_TIME_PER_OUTPUT_TOKEN] == ((260 - 100) / 4) / NS
    assert span.attributes[A.GENERATE_STEP_SPANS_POLICY] == "all"
    assert span.attributes[A.GENERATE_STEP_SPANS_EMITTED] is True
    assert span.attributes[A.GENERATE_STEP_SPANS_DROPPED] == 0
    assert span.attributes[A.GENERATE_STEP_OUTLIERS] == 0

    steps = sdk.step_spans()
    assert [s.name for s in steps] == ["prefill"] + ["decode"] * 4
    assert all(s.parent.span_id == span.context.span_id for s in steps)
    assert all(s.context.trace_id == span.context.trace_id for s in steps)
    assert [(s.start_time - WALL, s.end_time - WALL) for s in steps] == list(zip([0] + ends[:-1], ends))
    assert [dict(s.attributes) for s in steps] == [
        {
            A.GENERATE_STEP_INDEX: i,
            A.GENERATE_TOKEN_INDEX: i,
            A.GENERATE_STEP_TOKENS: 1,
            A.GENERATE_STEP_LATENCY: latencies[i] / NS,
        }
        for i in range(5)
    ]

    metrics = sdk.histograms()
    duration = (ends[-1] + 7) / NS
    assert metrics[A.METRIC_REQUEST_DURATION] == [(BASE, 1, duration)]
    assert metrics[A.METRIC_CLIENT_OPERATION_DURATION] == [(BASE, 1, duration)]
    assert metrics[A.METRIC_TIME_TO_FIRST_TOKEN] == [(BASE, 1, 100 / NS)]
    assert metrics[A.METRIC_TIME_PER_OUTPUT_TOKEN] == [(BASE, 1, ((260 - 100) / 4) / NS)]
    ((attributes, count, total),) = metrics[A.METRIC_INTER_TOKEN_LATENCY]
    assert attributes == BASE and count == 4 and total == pytest.approx(sum(latencies[1:]) / NS, rel=1e-12)
    usage = {a[A.GEN_AI_TOKEN_TYPE]: (c, s) for a, c, s in metrics[A.METRIC_TOKEN_USAGE]}
    assert usage == {"input": (1, 4), "output": (1, 5)}

    assert isinstance(record, GenerationRecord)
    assert record.step_latencies_s == [v / NS for v in latencies]
    assert record.time_to_first_token_s == 100 / NS and record.duration_s == duration


def test_an_unsampled_request_records_only_its_metrics():
    sdk = SDK(sampler=ALWAYS_OFF)
    request = make([100, 130, 170], [1, 1, 1])
    assert sdk.run(request) is None  # no record built: no one reads it
    assert sdk.finished() == []
    metrics = sdk.histograms()
    assert [(c, s) for _, c, s in metrics[A.METRIC_REQUEST_DURATION]] == [(1, 177 / NS)]
    assert [(c, s) for _, c, s in metrics[A.METRIC_TIME_TO_FIRST_TOKEN]] == [(1, 100 / NS)]
    ((_, count, total),) = metrics[A.METRIC_INTER_TOKEN_LATENCY]
    assert count == 2 and total == pytest.approx(70 / NS, rel=1e-12)


@pytest.mark.parametrize("current", ["none", "sampled-span"])
def test_an_unsampled_requests_metrics_carry_no_exemplar_whatever_span_is_current(current):
    # the measurements are recorded with context= (no span, or the request's): a sampled span that is
    # current is not what exemplars point at, and the thread's context is left as it was
    from opentelemetry import context as otel_context
    from opentelemetry import trace

    sdk = SDK(sampler=ALWAYS_OFF)
    outer = TracerProvider().get_tracer("t").start_span("outer") if current == "sampled-span" else None
    before = otel_context.get_current()
    token = otel_context.attach(trace.set_span_in_context(outer)) if outer is not None else None
    try:
        for _ in range(2):
            sdk.run(make([100, 130, 170], [1, 1, 1]))
        assert trace.get_current_span() is (outer if outer is not None else trace.INVALID_SPAN)
    finally:
        if token is not None:
            otel_context.detach(token)
    assert otel_context.get_current() == before
    data = sdk.reader.get_metrics_data()
    points = [p for r in data.resource_metrics for s in r.scope_metrics for m in s.metrics for p in m.data.data_points]
    # two requests: one value each in six series (token usage: input, output), two inter-token latencies each
    assert sorted(p.count for p in points) == [2] * 6 + [4]
    assert [e for p in points for e in p.exemplars] == []


def test_a_sampled_requests_metrics_point_their_exemplars_at_its_span():
    sdk = SDK()
    sdk.run(make([100, 130, 170], [1, 1, 1]))
    sdk.run(make([100, 130, 170], [1, 1, 1]))
    spans = [s.context.span_id for s in sdk.finished() if s.name == f"text_completion {MODEL}"]
    data = sdk.reader.get_metrics_data()
    points = [p for r in data.resource_metrics for s in r.scope_metrics for m in s.metrics for p in m.data.data_points]
    exemplars = [e for p in points for e in p.exemplars]
    assert len(points) == 7 and exemplars and {e.span_id for e in exemplars} <= set(spans)
    assert spans[1] in {e.span_id for e in exemplars}  # the second request's too


def test_a_failed_request_has_its_error_on_the_span_and_the_metrics():
    sdk = SDK()
    request = make([100, 130], [1, 1], error=ValueError("bad length"))
    sdk.run(request)
    span = sdk.request_span()
    assert span.attributes[A.ERROR_TYPE] == "ValueError"
    assert span.status.status_code is StatusCode.ERROR and span.status.description == "ValueError: bad length"
    assert [e.name for e in span.events] == ["exception"]
    metrics = sdk.histograms()
    assert [a for a, _, _ in metrics[A.METRIC_REQUEST_DURATION]] == [{**BASE, A.ERROR_TYPE: "ValueError"}]
    # defined for successful requests only
    assert A.METRIC_TIME_TO_FIRST_TOKEN not in metrics and A.METRIC_INTER_TOKEN_LATENCY not in metrics


def test_policy_none_and_the_cap_on_step_spans():
    sdk = SDK(step_spans="none")
    sdk.run(make([100, 130, 170], [1, 1, 1]))
    span = sdk.request_span()
    assert sdk.step_spans() == []
    assert span.attributes[A.GENERATE_STEP_SPANS_EMITTED] is False
    assert span.attributes[A.GENERATE_STEP_SPANS_DROPPED] == 3
    assert len(span.attributes[A.GENERATE_STEP_LATENCIES]) == 3  # the latencies are still on the span

    capped = SDK(max_step_spans=2)
    capped.run(make([100, 130, 170, 220], [1, 1, 1, 1]))
    span = capped.request_span()
    assert [s.attributes[A.GENERATE_STEP_INDEX] for s in capped.step_spans()] == [0, 1]
    assert span.attributes[A.GENERATE_STEP_SPANS_DROPPED] == 2
    assert list(span.attributes[A.GENERATE_STEP_LATENCIES]) == [100 / NS, 30 / NS]


def test_inner_calls_group_their_steps_and_their_first_step_is_a_prefill():
    sdk = SDK()
    request = make([100, 130, 170, 200], [1, 1, 1, 1])
    request.calls = [
        InnerCall(start_ns=START, end_ns=START + 130, first_step=0, steps=2, attributes={"whisper.window": 0}),
        InnerCall(start_ns=START + 130, end_ns=START + 200, first_step=2, steps=2, attributes={"whisper.window": 1}),
    ]
    sdk.run(request)
    groups = sorted(
        (s for s in sdk.finished() if s.name == A.SPAN_INNER_GENERATE), key=lambda s: s.attributes["whisper.window"]
    )
    assert [(g.start_time - WALL, g.end_time - WALL) for g in groups] == [(0, 130), (130, 200)]
    steps = sdk.step_spans()
    assert [s.name for s in steps] == ["prefill", "decode", "prefill", "decode"]
    assert [s.parent.span_id for s in steps] == [groups[0].context.span_id] * 2 + [groups[1].context.span_id] * 2
    # the later call's prefill step gives no inter-token latency: steps 1 and 3 only
    ((_, count, total),) = sdk.histograms()[A.METRIC_INTER_TOKEN_LATENCY]
    assert count == 2 and total == pytest.approx((30 + 30) / NS, rel=1e-12)


def test_batch_steps_outliers_and_several_tokens_per_step():
    sdk = SDK(outlier_factor=3.0)
    request = make([100, 110, 120, 130, 190], [1, 2, 1, 1, 1])
    request.step_starts_ns = [START + 50, START + 102, START + 111, START + 121, START + 131]
    request.step_requests = [3, 3, 2, 2, 1]
    sdk.run(request)
    steps = sdk.step_spans()
    latencies = [50, 8, 9, 9, 59]
    assert [s.attributes[A.GENERATE_STEP_LATENCY] for s in steps] == [v / NS for v in latencies]
    assert [s.attributes[A.GENERATE_TOKEN_INDEX] for s in steps] == [0, 1, 3, 4, 5]
    assert [s.attributes[A.GENERATE_STEP_REQUESTS] for s in steps] == [3, 3, 2, 2, 1]
    assert [s.attributes.get(A.GENERATE_STEP_OUTLIER, False) for s in steps] == [False] * 4 + [True]
    assert sdk.request_span().attributes[A.GENERATE_STEP_OUTLIERS] == 1
    assert [(s.start_time - WALL, s.end_time - WALL) for s in steps] == [
        (50, 100),
        (102, 110),
        (111, 120),
        (121, 130),
        (131, 190),
    ]
    ((_, count, total),) = sdk.histograms()[A.METRIC_INTER_TOKEN_LATENCY]
    assert count == 4 and total == pytest.approx((8 / 2 + 9 + 9 + 59) / NS, rel=1e-12)


def test_a_fault_building_the_span_still_records_the_metrics(monkeypatch):
    sdk = SDK()

    def broken(*args, **kwargs):
        raise RuntimeError("attributes")

    monkeypatch.setattr(emit, "_annotate", broken)
    request = make([100, 130, 170], [1, 1, 1])
    assert sdk.run(request) is None
    assert sdk.request_span().attributes[A.GENERATE_STEPS_INCOMPLETE] is True
    metrics = sdk.histograms()
    assert [c for _, c, _ in metrics[A.METRIC_TIME_TO_FIRST_TOKEN]] == [1]
    assert [c for _, c, _ in metrics[A.METRIC_INTER_TOKEN_LATENCY]] == [2]


def test_a_request_not_in_the_metrics_records_none():
    sdk = SDK()
    sdk.run(make([100, 130], [1, 1], metrics=False))
    assert sdk.histograms() == {}
    assert sdk.request_span().attributes[A.GENERATE_STEPS] == 2


def test_telemetry_reads_its_settings_from_the_options_only():
    sdk = SDK(synchronize=False, max_step_spans=7, step_spans="slow", outlier_factor=4.0)
    t = sdk.telemetry
    assert (t.synchronize, t.max_step_spans) == (False, 7)
    assert (t.policy.name, t.policy.max_step_spans, t.policy.outlier_factor) == ("slow", 7, 4.0)
    assert t.slow is t.policy.slow and t.slow is not None
    assert t.content is None  # no content capture asked
    assert t.profilers() == ()  # no profiler registry given: none
    older = telemetry.Telemetry(t.tracer, {}, synchronize=False, max_step_spans=3)
    assert (older.options.synchronize, older.options.max_step_spans, older.max_step_spans) == (False, 3, 3)


def test_inter_token_exemplars_are_those_every_value_offered_would_leave():
    """Every inter-token value is recorded with the request span in its context, so the exemplars
    are those that recording every value by hand leaves (a bucket keeps its last one)."""
    from opentelemetry import trace

    # decode steps of 2, 3, 2, 30, 3, 31, 2 ms: several values share a bucket
    ends = [10_000_000]
    for ms in (2, 3, 2, 30, 3, 31, 2):
        ends.append(ends[-1] + ms * 1_000_000)
    sdk = SDK()
    sdk.run(make(ends, [1] * len(ends)))
    request = sdk.request_span()
    theirs = InMemoryMetricReader()
    histogram = (
        MeterProvider(metric_readers=[theirs])
        .get_meter("by hand")
        .create_histogram(
            A.METRIC_INTER_TOKEN_LATENCY,
            unit="s",
            explicit_bucket_boundaries_advisory=list(A.BUCKETS_INTER_TOKEN_LATENCY_S),
        )
    )
    context = trace.set_span_in_context(trace.NonRecordingSpan(request.context))
    for step in sdk.step_spans()[1:]:
        histogram.record((step.end_time - step.start_time) / NS, BASE, context=context)

    def exemplars(reader):
        data = reader.get_metrics_data()
        (point,) = [
            p
            for r in data.resource_metrics
            for s in r.scope_metrics
            for m in s.metrics
            if m.name == A.METRIC_INTER_TOKEN_LATENCY
            for p in m.data.data_points
        ]
        return point.count, sorted((round(e.value, 9), e.span_id, e.trace_id) for e in point.exemplars)

    ours = exemplars(sdk.reader)
    assert ours == exemplars(theirs)
    count, found = ours
    assert count == 7 and len(found) < 7  # fewer exemplars than values: the buckets kept their last
    assert {span_id for _, span_id, _ in found} == {request.context.span_id}
