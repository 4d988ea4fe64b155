"""What the SDK gives an application, whatever the application configured: the instrumentation records
through the public API only, so each SDK configuration must treat its values exactly as it treats the
same values recorded by hand.

Each test runs ``generate()`` on the tiny GPT-2 under one configuration, then derives the expectation
independently: the values a user would record (durations from the request span's own start and end,
token counts from the output tensor, step latencies from the step spans) are recorded by hand through a
second, identically configured ``MeterProvider``, and the two readers' data must agree (or, for
traces, the spans an application would get from the same tracer configuration).
"""

from __future__ import annotations

import itertools

import pytest
from opentelemetry import trace
from opentelemetry.sdk.metrics import Histogram, MeterProvider
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    InMemoryMetricReader,
    MetricExporter,
    MetricExportResult,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.metrics.view import DropAggregation, ExplicitBucketHistogramAggregation, View
from opentelemetry.sdk.trace import SpanLimits, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.sdk.trace.sampling import Decision, ParentBased, Sampler, SamplingResult

from otel_generate import attributes as A
from otel_generate.telemetry import create_instruments
from tests.conftest import drain_emitter
from tests.helpers import prompt

NEW_TOKENS = 8
NS = 1_000_000_000


def run_generate(model, calls=1):
    """``calls`` generate() calls of :data:`NEW_TOKENS` greedy tokens; the outputs."""
    ids, mask = prompt(length=4)
    return [
        model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, eos_token_id=None) for _ in range(calls)
    ]


def points(reader):
    """{metric name: [(attributes, count, sum, bucket counts, boundaries)]} (histograms) or
    [(attributes, value)] (sums), sorted, from ``reader``."""
    return points_of(reader.get_metrics_data())


def points_of(data):
    """:func:`points` of one ``MetricsData``."""
    found = {}
    for resource in data.resource_metrics if data else ():
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                rows = []
                for point in metric.data.data_points:
                    attributes = tuple(sorted(point.attributes.items()))
                    if hasattr(point, "bucket_counts"):
                        rows.append(
                            (
                                attributes,
                                point.count,
                                point.sum,
                                tuple(point.bucket_counts),
                                tuple(point.explicit_bounds),
                            )
                        )
                    else:
                        rows.append((attributes, point.value))
                found.setdefault(metric.name, []).extend(sorted(rows, key=repr))
    return found


def by_hand(spans, outputs, meter_provider, prompt_tokens=4):
    """Record, through ``meter_provider`` and the public API, what an application measuring the same
    requests would record: the request span's own duration, the time to first token and the step
    latencies read from the step spans, the token counts from the output tensors."""
    instruments = create_instruments(meter_provider)  # the names, units and buckets of the contract
    requests = sorted((s for s in spans if s.name.startswith("text_completion")), key=lambda s: s.start_time)
    assert len(requests) == len(outputs)
    for span, output in zip(requests, outputs):
        steps = sorted(
            (s for s in spans if s.parent is not None and s.parent.span_id == span.context.span_id),
            key=lambda s: s.attributes[A.GENERATE_STEP_INDEX],
        )
        base = {
            A.GEN_AI_OPERATION_NAME: A.OPERATION_TEXT_COMPLETION,
            A.GEN_AI_PROVIDER_NAME: A.PROVIDER_TRANSFORMERS,
            A.GEN_AI_REQUEST_MODEL: span.attributes[A.GEN_AI_REQUEST_MODEL],
        }
        context = trace.set_span_in_context(trace.NonRecordingSpan(span.context))
        # the timed request runs from its prefill step's start (the span itself starts a little
        # before, when the call is set up) to the span's end
        duration = (span.end_time - steps[0].start_time) / NS
        latencies = [(s.end_time - s.start_time) / NS for s in steps]
        instruments[A.METRIC_REQUEST_DURATION].record(duration, base, context=context)
        instruments[A.METRIC_CLIENT_OPERATION_DURATION].record(duration, base, context=context)
        # the first token: the prefill step; after it, the mean decode step
        instruments[A.METRIC_TIME_TO_FIRST_TOKEN].record(latencies[0], base, context=context)
        tpot = (steps[-1].end_time - steps[0].end_time) / (len(steps) - 1) / NS
        instruments[A.METRIC_TIME_PER_OUTPUT_TOKEN].record(tpot, base, context=context)
        usage = instruments[A.METRIC_TOKEN_USAGE]
        usage.record(prompt_tokens, {**base, A.GEN_AI_TOKEN_TYPE: "input"}, context=context)
        new = output.shape[0] * (output.shape[-1] - prompt_tokens)  # no EOS: every column after the prompt
        usage.record(new, {**base, A.GEN_AI_TOKEN_TYPE: "output"}, context=context)
        for latency in latencies[1:]:
            instruments[A.METRIC_INTER_TOKEN_LATENCY].record(latency, base, context=context)


@pytest.fixture
def traced():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


def _approx_rows(rows):
    """Rows with their sums rounded (a sum of floats in another order may differ in its last bits)."""
    return [tuple(round(v, 12) if isinstance(v, float) else v for v in row) for row in rows]


def assert_same_metrics(ours, expected):
    assert set(ours) == set(expected), (sorted(ours), sorted(expected))
    for name in expected:
        assert _approx_rows(ours[name]) == _approx_rows(expected[name]), name


def _views_cases():
    histograms = (
        A.METRIC_TIME_TO_FIRST_TOKEN,
        A.METRIC_REQUEST_DURATION,
        A.METRIC_INTER_TOKEN_LATENCY,
    )
    return {
        "buckets": [
            View(
                instrument_name=A.METRIC_INTER_TOKEN_LATENCY,
                aggregation=ExplicitBucketHistogramAggregation([0.0001, 0.001, 0.01]),
            )
        ],
        "rename": [View(instrument_name=A.METRIC_TIME_TO_FIRST_TOKEN, name="ttft.renamed")],
        "attribute_keys": [View(instrument_name=name, attribute_keys={A.GEN_AI_REQUEST_MODEL}) for name in histograms],
        "drop": [View(instrument_name=A.METRIC_INTER_TOKEN_LATENCY, aggregation=DropAggregation())],
        "wildcard-buckets": [
            View(instrument_type=Histogram, aggregation=ExplicitBucketHistogramAggregation([0.5, 5.0, 50.0]))
        ],
    }


@pytest.mark.parametrize("case", sorted(_views_cases()))
def test_a_view_gives_what_it_gives_values_recorded_by_hand(case, instrument, traced, gpt2):
    views = _views_cases()[case]
    provider, exporter = traced
    ours, theirs = InMemoryMetricReader(), InMemoryMetricReader()
    meter_provider = MeterProvider(metric_readers=[ours], views=views)
    instrument(tracer_provider=provider, meter_provider=meter_provider)
    outputs = run_generate(gpt2, calls=2)
    drain_emitter()
    by_hand(exporter.get_finished_spans(), outputs, MeterProvider(metric_readers=[theirs], views=views))
    got, expected = points(ours), points(theirs)
    assert_same_metrics(got, expected)
    if case == "drop":
        assert A.METRIC_INTER_TOKEN_LATENCY not in got and A.METRIC_TIME_TO_FIRST_TOKEN in got
    if case == "rename":
        assert "ttft.renamed" in got and A.METRIC_TIME_TO_FIRST_TOKEN not in got
    if case == "buckets":
        ((_, count, _, _, bounds),) = got[A.METRIC_INTER_TOKEN_LATENCY]
        assert count == 2 * (NEW_TOKENS - 1) and bounds == (0.0001, 0.001, 0.01)


def test_two_readers_each_get_every_value(instrument, traced, gpt2):
    provider, exporter = traced
    first, second, theirs = InMemoryMetricReader(), InMemoryMetricReader(), InMemoryMetricReader()
    instrument(tracer_provider=provider, meter_provider=MeterProvider(metric_readers=[first, second]))
    outputs = run_generate(gpt2, calls=3)
    drain_emitter()
    by_hand(exporter.get_finished_spans(), outputs, MeterProvider(metric_readers=[theirs]))
    expected = points(theirs)
    assert_same_metrics(points(first), expected)
    assert_same_metrics(points(second), expected)
    ((_, count, *_),) = expected[A.METRIC_INTER_TOKEN_LATENCY]
    assert count == 3 * (NEW_TOKENS - 1)


def _exemplars(reader):
    found = {}
    data = reader.get_metrics_data()
    for resource in data.resource_metrics if data else ():
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                found[metric.name] = sorted(
                    (e.value, e.span_id, e.trace_id) for p in metric.data.data_points for e in p.exemplars
                )
    return found


@pytest.mark.parametrize("kind", ["always_on", "always_off", "trace_based"])
def test_an_exemplar_filter_gives_the_exemplars_it_gives_values_recorded_by_hand(kind, instrument, traced, gpt2):
    from opentelemetry.sdk.metrics import AlwaysOffExemplarFilter, AlwaysOnExemplarFilter, TraceBasedExemplarFilter

    make = {"always_on": AlwaysOnExemplarFilter, "always_off": AlwaysOffExemplarFilter}.get(
        kind, TraceBasedExemplarFilter
    )
    provider, exporter = traced
    ours, theirs = InMemoryMetricReader(), InMemoryMetricReader()
    instrument(tracer_provider=provider, meter_provider=MeterProvider(metric_readers=[ours], exemplar_filter=make()))
    outputs = run_generate(gpt2, calls=2)
    drain_emitter()
    spans = exporter.get_finished_spans()
    by_hand(spans, outputs, MeterProvider(metric_readers=[theirs], exemplar_filter=make()))
    got, expected = _exemplars(ours), _exemplars(theirs)
    assert got.keys() == expected.keys()
    # exemplars are kept per bucket (histograms): the same values, pointing at the same request spans
    for name in expected:
        assert [(round(v, 12), s, t) for v, s, t in got[name]] == [
            (round(v, 12), s, t) for v, s, t in expected[name]
        ], name
    request_ids = {s.context.span_id for s in spans if s.name.startswith("text_completion")}
    pointed = {span_id for rows in got.values() for _, span_id, _ in rows}
    if kind == "always_off":
        assert not pointed
    else:  # (a bucket keeps its last measurement's exemplar)
        assert pointed and pointed <= request_ids


def _request_and_steps(exporter):
    spans = exporter.get_finished_spans()
    (request,) = [s for s in spans if s.name.startswith("text_completion")]
    steps = sorted(
        (s for s in spans if s.name in (A.STEP_SPAN_PREFILL, A.STEP_SPAN_DECODE)),
        key=lambda s: s.attributes[A.GENERATE_STEP_INDEX],
    )
    return request, steps


@pytest.mark.parametrize("limit", [5, 20])
def test_span_attribute_limits_apply_as_to_attributes_set_by_hand(limit, instrument, gpt2):
    """The request span's attributes under ``SpanLimits(max_span_attributes=limit)`` are those an
    application gets setting the same start attributes, then the same finished attributes, by hand."""
    unlimited = InMemorySpanExporter()
    full = TracerProvider()
    full.add_span_processor(SimpleSpanProcessor(unlimited))
    instrumentor = instrument(tracer_provider=full)
    run_generate(gpt2)
    drain_emitter()
    reference, _ = _request_and_steps(unlimited)
    instrumentor.uninstrument()

    limited_spans = InMemorySpanExporter()
    limited = TracerProvider(span_limits=SpanLimits(max_span_attributes=limit))
    limited.add_span_processor(SimpleSpanProcessor(limited_spans))
    instrument(tracer_provider=limited)
    run_generate(gpt2)
    drain_emitter()
    request, steps = _request_and_steps(limited_spans)

    start_keys = (A.GEN_AI_OPERATION_NAME, A.GEN_AI_PROVIDER_NAME, A.GEN_AI_REQUEST_MODEL, A.GEN_AI_RESPONSE_MODEL)
    by_hand_spans = InMemorySpanExporter()
    application = TracerProvider(span_limits=SpanLimits(max_span_attributes=limit))
    application.add_span_processor(SimpleSpanProcessor(by_hand_spans))
    span = application.get_tracer("app").start_span(
        request.name, attributes={key: reference.attributes[key] for key in start_keys}
    )
    span.set_attributes({k: v for k, v in reference.attributes.items() if k not in start_keys})
    span.end()
    (expected,) = by_hand_spans.get_finished_spans()
    assert list(request.attributes) == list(expected.attributes)
    assert request.dropped_attributes == expected.dropped_attributes
    assert len(request.attributes) == min(limit, len(reference.attributes))
    assert len(steps) == NEW_TOKENS
    # a step span has 4 attributes, 5 with an outlier flag: each within the limit, the four base ones kept
    base = {A.GENERATE_STEP_INDEX, A.GENERATE_TOKEN_INDEX, A.GENERATE_STEP_TOKENS, A.GENERATE_STEP_LATENCY}
    assert all(len(s.attributes) <= limit and base <= set(s.attributes) and not s.dropped_attributes for s in steps)


class AddsTenant(SpanProcessor):
    def on_start(self, span, parent_context=None):
        span.set_attribute("tenant", "blue")


def test_a_processor_that_adds_attributes_on_start_sees_every_span(instrument, gpt2):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(AddsTenant())
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    instrument(tracer_provider=provider)
    run_generate(gpt2)
    drain_emitter()
    request, steps = _request_and_steps(exporter)
    assert request.attributes["tenant"] == "blue" and request.attributes[A.GEN_AI_USAGE_OUTPUT_TOKENS] == NEW_TOKENS
    assert len(steps) == NEW_TOKENS and all(s.attributes["tenant"] == "blue" for s in steps)


class ModelSampler(Sampler):
    """Samples a root span only when its ``gen_ai.request.model`` is the one named."""

    def __init__(self, model):
        self.model = model

    def should_sample(self, parent_context, trace_id, name, kind=None, attributes=None, links=None, trace_state=None):
        keep = (attributes or {}).get(A.GEN_AI_REQUEST_MODEL) == self.model
        return SamplingResult(Decision.RECORD_AND_SAMPLE if keep else Decision.DROP, attributes)

    def get_description(self):
        return f"ModelSampler({self.model})"


@pytest.mark.parametrize("keep", [True, False])
def test_an_attribute_based_sampler_decides_on_the_request_span_attributes(keep, instrument, gpt2):
    model = type(gpt2).__name__
    exporter, reader = InMemorySpanExporter(), InMemoryMetricReader()
    provider = TracerProvider(sampler=ParentBased(ModelSampler(model if keep else "another-model")))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    instrument(tracer_provider=provider, meter_provider=MeterProvider(metric_readers=[reader]))
    run_generate(gpt2, calls=2)
    drain_emitter()
    spans = exporter.get_finished_spans()
    assert len(spans) == (2 * (NEW_TOKENS + 1) if keep else 0)
    # the metrics do not depend on sampling
    found = points(reader)
    ((_, count, *_),) = found[A.METRIC_REQUEST_DURATION]
    ((_, tokens, *_),) = found[A.METRIC_INTER_TOKEN_LATENCY]
    assert (count, tokens) == (2, 2 * (NEW_TOKENS - 1))


class CountingIds(IdGenerator):
    def __init__(self):
        self.span_ids = itertools.count(0x1000)
        self.trace_ids = itertools.count(0xABC00)

    def generate_span_id(self):
        return next(self.span_ids)

    def generate_trace_id(self):
        return next(self.trace_ids)


def test_a_custom_id_generator_gives_every_id(instrument, gpt2):
    exporter = InMemorySpanExporter()
    provider = TracerProvider(id_generator=CountingIds())
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    instrument(tracer_provider=provider)
    run_generate(gpt2)
    drain_emitter()
    request, steps = _request_and_steps(exporter)
    assert request.context.trace_id == 0xABC00 and request.context.span_id == 0x1000
    assert [s.context.span_id for s in steps] == list(range(0x1001, 0x1001 + NEW_TOKENS))
    assert {s.context.trace_id for s in steps} == {0xABC00}


# --- temporality --------------------------------------------------------------------------------------------


class Collected(MetricExporter):
    """A metric exporter that keeps what each export hands it (what an OTLP exporter would send)."""

    def __init__(self, preferred_temporality):
        super().__init__(preferred_temporality=preferred_temporality)
        self.exports = []

    def export(self, metrics_data, timeout_millis=10_000, **kwargs):
        self.exports.append(metrics_data)
        return MetricExportResult.SUCCESS

    def force_flush(self, timeout_millis=10_000):
        return True

    def shutdown(self, timeout_millis=30_000, **kwargs):
        pass


@pytest.mark.parametrize("reader_kind", ["in-memory", "periodic-exporting"])
@pytest.mark.parametrize("temporality", [AggregationTemporality.DELTA, AggregationTemporality.CUMULATIVE])
def test_every_collection_reads_every_request(temporality, reader_kind, instrument, traced, gpt2):
    """Four collections with two generate() calls of 8 tokens before each: a DELTA reader reads 2
    requests and 14 inter-token values in every collection, a CUMULATIVE one 2, 4, 6, 8 and 14, 28,
    42, 56, with the sums of the step spans' latencies. ``in-memory``: an ``InMemoryMetricReader``
    collected after the tracer provider's flush (which drains the background emitter);
    ``periodic-exporting``: a ``PeriodicExportingMetricReader`` exporting at the meter provider's own
    ``force_flush``, as an OTLP exporter with DELTA temporality does."""
    provider, exporter = traced
    preferred = {Histogram: temporality}
    if reader_kind == "in-memory":
        reader = InMemoryMetricReader(preferred_temporality=preferred)
    else:
        collected = Collected(preferred)
        reader = PeriodicExportingMetricReader(collected, export_interval_millis=86_400_000)
    meter_provider = MeterProvider(metric_readers=[reader])
    instrument(tracer_provider=provider, meter_provider=meter_provider)
    delta = temporality is AggregationTemporality.DELTA
    cumulative_latencies = []
    cumulative_output = 0
    for collection in range(1, 5):
        outputs = run_generate(gpt2, calls=2)
        if reader_kind == "in-memory":
            provider.force_flush()  # the tracer provider's own flush drains the background emitter first
            found = points(reader)
        else:
            meter_provider.force_flush()  # records the requests' metrics first, then the reader collects and exports
            found = points_of(collected.exports[-1])
            provider.force_flush()  # the spans: the tracer provider's flush waits for the emitter to build them
        spans = exporter.get_finished_spans()
        exporter.clear()
        latencies = [
            (s.end_time - s.start_time) / NS
            for s in spans
            if s.name == A.STEP_SPAN_DECODE  # the decode steps' latencies: the inter-token values
        ]
        prefills = {s.parent.span_id: s.start_time for s in spans if s.name == A.STEP_SPAN_PREFILL}
        durations = [
            (s.end_time - prefills[s.context.span_id]) / NS for s in spans if s.name.startswith("text_completion")
        ]
        new_tokens = sum(out.shape[0] * (out.shape[-1] - 4) for out in outputs)
        cumulative_latencies += latencies
        cumulative_output += new_tokens
        ((_, requests, duration_sum, *_),) = found[A.METRIC_REQUEST_DURATION]
        ((_, values, latency_sum, *_),) = found[A.METRIC_INTER_TOKEN_LATENCY]
        (output,) = [row for row in found[A.METRIC_TOKEN_USAGE] if ("gen_ai.token.type", "output") in row[0]]
        if delta:
            assert (requests, values) == (2, 14), collection
            assert latency_sum == pytest.approx(sum(latencies), rel=1e-9)
            assert duration_sum == pytest.approx(sum(durations), rel=1e-9)
            assert output[1:3] == (2, new_tokens)
        else:
            assert (requests, values) == (2 * collection, 14 * collection), collection
            assert latency_sum == pytest.approx(sum(cumulative_latencies), rel=1e-9)
            assert output[1:3] == (2 * collection, cumulative_output)


# --- the floor and the newest SDK alike (CI runs this file on both) ---------------------------------------


@pytest.mark.parametrize("with_meter_provider", [True, False])
def test_instrument_is_quiet_and_one_call_gives_every_span_and_histogram(
    with_meter_provider, instrument, traced, gpt2, caplog
):
    """With and without a MeterProvider: instrument() logs nothing, and one generate() gives its request
    span, its step spans and (with one) every histogram."""
    import logging

    provider, exporter = traced
    reader = InMemoryMetricReader()
    options = {"tracer_provider": provider}
    if with_meter_provider:
        options["meter_provider"] = MeterProvider(metric_readers=[reader])
    with caplog.at_level(logging.DEBUG):
        instrument(**options)
        (output,) = run_generate(gpt2)
        drain_emitter()
    noisy = [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]
    assert not noisy, [r.getMessage() for r in noisy]
    request, steps = _request_and_steps(exporter)
    assert request.attributes[A.GEN_AI_USAGE_OUTPUT_TOKENS] == output.shape[-1] - 4 == NEW_TOKENS
    assert [s.name for s in steps] == [A.STEP_SPAN_PREFILL] + [A.STEP_SPAN_DECODE] * (NEW_TOKENS - 1)
    if with_meter_provider:
        found = points(reader)
        assert set(found) == {
            A.METRIC_REQUEST_DURATION,
            A.METRIC_CLIENT_OPERATION_DURATION,
            A.METRIC_TIME_TO_FIRST_TOKEN,
            A.METRIC_TIME_PER_OUTPUT_TOKEN,
            A.METRIC_TOKEN_USAGE,
            A.METRIC_INTER_TOKEN_LATENCY,
        }
        ((_, values, *_),) = found[A.METRIC_INTER_TOKEN_LATENCY]
        assert values == NEW_TOKENS - 1


def test_four_threads_of_three_calls_count_twelve(instrument, traced, gpt2):
    import threading

    provider, exporter = traced
    reader = InMemoryMetricReader()
    instrument(tracer_provider=provider, meter_provider=MeterProvider(metric_readers=[reader]))
    errors = []

    def worker():
        try:
            run_generate(gpt2, calls=3)
        except BaseException as error:  # pragma: no cover - reported below
            errors.append(error)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    drain_emitter()
    found = points(reader)
    ((_, requests, *_),) = found[A.METRIC_REQUEST_DURATION]
    ((_, values, *_),) = found[A.METRIC_INTER_TOKEN_LATENCY]
    assert (requests, values) == (12, 12 * (NEW_TOKENS - 1))
    spans = exporter.get_finished_spans()
    requests_spans = [s for s in spans if s.name.startswith("text_completion")]
    assert len(requests_spans) == 12 and len({s.context.trace_id for s in requests_spans}) == 12
    assert len(spans) == 12 * (NEW_TOKENS + 1)
