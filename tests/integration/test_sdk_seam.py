"""The seam with the application's own OpenTelemetry SDK: what background emission (the default)
shows the SDK is what synchronous emission shows it.

Each case sets up the SDK as an application or another library would, and compares with what the
same SDK gives without this package or with ``background_emission=False``: the caller's context on
every span (baggage, a value a processor or a sampler reads), flushes and shutdowns of the providers
this package emits to only, the SDK's timeouts and return values kept, the content event drained
like spans and metrics, and no flush that waits for itself. Expected values come from the returned
tensors and the application's own set-up, never from another code path of this package.
"""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch
from opentelemetry import baggage, trace
from opentelemetry import context as otel_context
from opentelemetry.processor.baggage import ALLOW_ALL_BAGGAGE_KEYS, BaggageSpanProcessor
from opentelemetry.sdk.metrics import Histogram, MeterProvider
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    MetricExporter,
    MetricExportResult,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import Decision, Sampler, SamplingResult

import otel_generate
from otel_generate import attributes as A
from tests.helpers import prompt

#: a case about the background emitter's queue: background emission only (the test's ``emission`` mode,
#: tests/integration/conftest.py, runs every other case in both modes)
BACKGROUND_ONLY = pytest.mark.parametrize("emission", ["background"])
SCOPE = "otel_generate"
#: the application's own context key, read by its processor and its sampler
TENANT_KEY = otel_context.create_key("app.tenant")


def sdk_version():
    """The installed opentelemetry-sdk's (major, minor)."""
    from importlib.metadata import version

    return tuple(int(part) for part in version("opentelemetry-sdk").split(".")[:2])


def ours(spans):
    return [s for s in spans if s.instrumentation_scope is not None and s.instrumentation_scope.name == SCOPE]


def two_calls_model(gpt2):
    """A model whose own ``generate()`` runs two decoding loops (two ``inner_generate`` spans)."""
    import transformers

    class Drafted(transformers.GPT2LMHeadModel):
        def generate(self, *args, **kwargs):
            first = super().generate(*args, **kwargs)
            return super().generate(first, max_new_tokens=2, eos_token_id=None)

    model = Drafted(gpt2.config).eval()
    model.load_state_dict(gpt2.state_dict())
    return model


class AppProcessor(SpanProcessor):
    """An application's processor: it has nothing queued, so its flush succeeds (SDK 1.37's base class
    answers ``None`` to ``force_flush``, which makes the provider's flush say ``False``)."""

    def force_flush(self, timeout_millis=30_000):
        return True


class ReadsContext(AppProcessor):
    """An application's processor: copies a value of the parent context onto each span as it starts."""

    def on_start(self, span, parent_context=None):
        value = otel_context.get_value(TENANT_KEY, parent_context)
        if value is not None:
            span.set_attribute("app.tenant", value)


class TenantSampler(Sampler):
    """An application's sampler: records, and notes the context value it saw (``none`` when none)."""

    def should_sample(self, parent_context, trace_id, name, kind=None, attributes=None, links=None, trace_state=None):
        seen = otel_context.get_value(TENANT_KEY, parent_context)
        parent = trace.get_current_span(parent_context).get_span_context()
        return SamplingResult(
            Decision.RECORD_AND_SAMPLE,
            {"sampler.saw": seen or "none"},
            parent.trace_state if parent.is_valid else None,
        )

    def get_description(self):
        return "TenantSampler"


class Baggage(BaggageSpanProcessor):
    """``BaggageSpanProcessor``, whose 0.58b0 release has no ``force_flush`` of its own."""

    def force_flush(self, timeout_millis=30_000):
        return True


def context_provider():
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=TenantSampler())
    provider.add_span_processor(Baggage(ALLOW_ALL_BAGGAGE_KEYS))
    provider.add_span_processor(ReadsContext())
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


def callers_context(tenant="acme", session="s-42"):
    context = baggage.set_baggage("tenant.id", tenant)
    context = baggage.set_baggage("session.id", session, context)
    return otel_context.set_value(TENANT_KEY, tenant, context)


def assert_in_callers_context(spans, tenant="acme", session="s-42"):
    for span in spans:
        attributes = span.attributes
        assert attributes.get("tenant.id") == tenant, span.name
        assert attributes.get("session.id") == session, span.name
        assert attributes.get("app.tenant") == tenant, span.name
        assert attributes.get("sampler.saw") == tenant, span.name


# --- 1. the caller's context --------------------------------------------------------------------------


def test_every_span_of_a_request_is_built_in_the_callers_context(instrument, gpt2):
    """``BaggageSpanProcessor`` with two entries, and the application's own processor and sampler
    reading a context value: the request span, both inner-call spans and every step span."""
    provider, exporter = context_provider()
    instrument(tracer_provider=provider)
    model = two_calls_model(gpt2)
    ids, mask = prompt(length=4, seed=5)
    token = otel_context.attach(callers_context())
    try:
        out = model.generate(ids, attention_mask=mask, max_new_tokens=3, eos_token_id=None)
    finally:
        otel_context.detach(token)
    assert provider.force_flush()
    spans = ours(exporter.get_finished_spans())
    generated = out.shape[-1] - ids.shape[-1]
    assert generated == 5
    names = sorted(s.name for s in spans)
    assert names.count(A.SPAN_INNER_GENERATE) == 2
    assert names.count(A.STEP_SPAN_PREFILL) + names.count(A.STEP_SPAN_DECODE) == generated
    assert len(spans) == 1 + 2 + generated
    assert_in_callers_context(spans)


def test_a_request_that_raised_is_built_in_the_callers_context(instrument, gpt2):
    from transformers import StoppingCriteria, StoppingCriteriaList

    class BreaksAtThirdStep(StoppingCriteria):
        calls = 0

        def __call__(self, input_ids, scores, **kwargs):
            BreaksAtThirdStep.calls += 1
            if BreaksAtThirdStep.calls == 3:
                raise RuntimeError("stop here")
            return torch.zeros((input_ids.shape[0],), dtype=torch.bool)

    provider, exporter = context_provider()
    instrument(tracer_provider=provider)
    ids, mask = prompt(length=4, seed=6)
    token = otel_context.attach(callers_context("globex", "s-7"))
    try:
        with pytest.raises(RuntimeError, match="stop here"):
            gpt2.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=8,
                eos_token_id=None,
                stopping_criteria=StoppingCriteriaList([BreaksAtThirdStep()]),
            )
    finally:
        otel_context.detach(token)
    assert provider.force_flush()
    spans = ours(exporter.get_finished_spans())
    (request,) = [s for s in spans if s.name.startswith("text_completion")]
    assert request.attributes[A.ERROR_TYPE] == "RuntimeError"
    assert len(spans) == 1 + 2  # the two steps that ended before the criterion raised
    assert_in_callers_context(spans, "globex", "s-7")


def test_every_metric_and_the_event_are_recorded_in_the_callers_context(instrument, gpt2, monkeypatch):
    """The context handed to ``record(..., context=)`` and to the content event is the caller's, with
    the request span in it: an exemplar filter or a log processor that reads it sees the baggage."""
    import otel_generate.emit as emit_module

    contexts = {"metrics": [], "event": []}
    real_metrics, real_event = emit_module._record_metrics, emit_module._emit_details_event

    def metrics(instruments, span, request, summary, base_context=None, *rest):
        contexts["metrics"].append((base_context, span))
        return real_metrics(instruments, span, request, summary, base_context, *rest)

    def event(logger, span, request, summary, context=None, *rest):
        contexts["event"].append((context, span))
        return real_event(logger, span, request, summary, context, *rest)

    monkeypatch.setattr(emit_module, "_record_metrics", metrics)
    monkeypatch.setattr(emit_module, "_emit_details_event", event)
    logger_provider, events = _event_pipeline()
    provider, exporter = context_provider()
    instrument(
        tracer_provider=provider,
        meter_provider=MeterProvider(),
        logger_provider=logger_provider,
        capture_message_content="EVENT_ONLY",
    )
    ids, mask = prompt(length=4, seed=8)
    token = otel_context.attach(callers_context())
    try:
        gpt2.generate(ids, attention_mask=mask, max_new_tokens=3, eos_token_id=None)
    finally:
        otel_context.detach(token)
    assert otel_generate.force_flush(10.0)
    ((metric_context, span),) = contexts["metrics"]
    ((event_context, _),) = contexts["event"]
    for context in (metric_context, event_context):
        assert dict(baggage.get_all(context)) == {"tenant.id": "acme", "session.id": "s-42"}
        assert otel_context.get_value(TENANT_KEY, context) == "acme"
    (event,) = events.get_finished_logs()
    record = getattr(event, "log_record", event)
    assert record.span_id == span.get_span_context().span_id  # in the request span's context


# --- 2. only our providers ----------------------------------------------------------------------------


class Gate(AppProcessor):
    """Blocks the thread that ends a span of this package while closed: holds the emitter's worker, so
    that a backlog builds up behind it. ``per_span_s``: a slow processor's cost for every span."""

    def __init__(self, per_span_s=0.0):
        self.open = threading.Event()
        self.open.set()
        self.per_span_s = per_span_s

    def on_end(self, span):
        if span.instrumentation_scope is not None and span.instrumentation_scope.name == SCOPE:
            self.open.wait(60)
            if self.per_span_s:
                time.sleep(self.per_span_s)


class Collected(MetricExporter):
    """A metric exporter that keeps what each export hands it (what an OTLP exporter would send)."""

    def __init__(self):
        super().__init__(preferred_temporality={Histogram: AggregationTemporality.CUMULATIVE})
        self.exports = []

    def export(self, metrics_data, timeout_millis=10_000, **kwargs):
        self.exports.append(metrics_data)
        return MetricExportResult.SUCCESS

    def force_flush(self, timeout_millis=10_000):
        return True

    def shutdown(self, timeout_millis=30_000, **kwargs):
        pass


def point(metrics_data, name, **wanted):
    found = []
    for resource in metrics_data.resource_metrics:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                if metric.name == name:
                    for data in metric.data.data_points:
                        if all(data.attributes.get(k) == v for k, v in wanted.items()):
                            found.append(data)
    return found


def backlog(model, gate, telemetry, requests):
    """Hold the worker on the first request's spans, then make ``requests`` more: the queue holds
    them all. Returns the new tokens of every call, in order."""
    gate.open.clear()
    ids, mask = prompt(length=4, seed=9)
    tokens = []
    for _ in range(requests + 1):
        out = model.generate(ids, attention_mask=mask, max_new_tokens=4, eos_token_id=None)
        tokens.append(out.shape[-1] - ids.shape[-1])
    deadline = time.monotonic() + 10
    while telemetry.emitter.pending() < requests + 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert telemetry.emitter.pending() == requests + 1  # the first is on the worker, held by the gate
    return tokens


@BACKGROUND_ONLY
def test_another_provider_of_the_same_class_flushes_and_shuts_down_on_time(instrument, gpt2, caplog):
    """Two tracer and two meter providers, one pair given to ``instrument()`` with a backlog of 60
    requests: the other pair (another library's pipeline) flushes and shuts down exactly as without
    this package: on time, with the SDK's own answers, and no line of ours."""
    gate = Gate()
    our_tracer = TracerProvider()
    our_tracer.add_span_processor(gate)
    our_spans = InMemorySpanExporter()
    our_tracer.add_span_processor(SimpleSpanProcessor(our_spans))
    our_meter = MeterProvider()
    their_spans, their_metrics = InMemorySpanExporter(), Collected()
    their_tracer = TracerProvider()
    their_tracer.add_span_processor(SimpleSpanProcessor(their_spans))
    their_meter = MeterProvider(
        metric_readers=[PeriodicExportingMetricReader(their_metrics, export_interval_millis=86_400_000)]
    )
    their_counter = their_meter.get_meter("their.library").create_counter("their.requests")
    # what the SDK gives them without this package
    without = (their_tracer.force_flush(100), their_meter.force_flush(100))
    instrumentor = instrument(tracer_provider=our_tracer, meter_provider=our_meter)
    tokens = backlog(gpt2, gate, instrumentor.telemetry, 60)
    their_tracer.get_tracer("their.library").start_span("their work").end()
    their_counter.add(3)
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="otel_generate"):
        started = time.monotonic()
        flushed = their_tracer.force_flush(100)
        assert time.monotonic() - started < 0.15
        started = time.monotonic()
        metered = their_meter.force_flush(100)
        assert time.monotonic() - started < 0.15
        assert (flushed, metered) == without == (True, True)
        started = time.monotonic()
        their_tracer.shutdown()
        assert time.monotonic() - started < 0.2
        started = time.monotonic()
        their_meter.shutdown()
        assert time.monotonic() - started < 0.2
    assert [r for r in caplog.records if r.name == "otel_generate"] == []
    assert [s.name for s in their_spans.get_finished_spans()] == ["their work"]
    (counted,) = point(their_metrics.exports[-1], "their.requests")
    assert counted.value == 3
    assert instrumentor.telemetry.emitter.pending() == 61  # ours still held: theirs did not wait for it
    gate.open.set()
    assert our_tracer.force_flush()
    requests = [s for s in our_spans.get_finished_spans() if s.name.startswith("text_completion")]
    assert len(requests) == len(tokens) == 61


class SlowProcessor(AppProcessor):
    """1 ms a span of this package, as a processor that does real work on each span would take."""

    def on_end(self, span):
        if span.instrumentation_scope is not None and span.instrumentation_scope.name == SCOPE:
            time.sleep(0.001)


@BACKGROUND_ONLY
@pytest.mark.parametrize("call", ["force_flush", "shutdown"])
def test_a_meter_provider_flush_with_a_backlog_keeps_the_sdks_contract(call, instrument, gpt2):
    """A backlog of 55 requests behind a 1 ms-per-span processor: the meter provider's
    ``force_flush(200 ms)`` returns a bool and ``shutdown(200 ms)`` never raises, and the export
    holds every request handed over before the call (the SDK alone would export everything
    recorded); the spans follow, and the tracer provider's shutdown exports every one."""
    gate = Gate(per_span_s=0.001)
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(gate)
    spans = InMemorySpanExporter()
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    collected = Collected()
    meter_provider = MeterProvider(
        metric_readers=[PeriodicExportingMetricReader(collected, export_interval_millis=86_400_000)]
    )
    instrumentor = instrument(tracer_provider=tracer_provider, meter_provider=meter_provider)
    tokens = backlog(gpt2, gate, instrumentor.telemetry, 55)
    gate.open.set()  # the worker runs again, 1 ms a span: about 0.3 s of spans left
    started = time.monotonic()
    if call == "force_flush":
        result = meter_provider.force_flush(timeout_millis=200)
        assert result is True
    else:
        assert meter_provider.shutdown(timeout_millis=200) is None
    assert time.monotonic() - started < 0.4
    data = collected.exports[-1]
    (durations,) = point(data, A.METRIC_REQUEST_DURATION)
    assert durations.count == len(tokens) == 56
    (output,) = point(data, A.METRIC_TOKEN_USAGE, **{A.GEN_AI_TOKEN_TYPE: A.TOKEN_TYPE_OUTPUT})
    assert output.sum == sum(tokens)
    (inter_token,) = point(data, A.METRIC_INTER_TOKEN_LATENCY)
    assert inter_token.count == sum(n - 1 for n in tokens)  # every decode step of every request
    tracer_provider.shutdown()  # takes no timeout: waits for the emitter (at most 30 s), then exports
    requests = [s for s in spans.get_finished_spans() if s.name.startswith("text_completion")]
    steps = [s for s in spans.get_finished_spans() if s.name in (A.STEP_SPAN_PREFILL, A.STEP_SPAN_DECODE)]
    assert len(requests) == 56 and len(steps) == sum(tokens)


@BACKGROUND_ONLY
def test_a_tracer_provider_shutdown_waits_for_the_emitter_at_most_its_bound(instrument, gpt2, monkeypatch, caplog):
    from otel_generate import background

    monkeypatch.setattr(background, "DEFAULT_DRAIN_TIMEOUT_S", 0.3)
    gate = Gate()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(gate)
    instrumentor = instrument(tracer_provider=tracer_provider, meter_provider=MeterProvider())
    backlog(gpt2, gate, instrumentor.telemetry, 3)
    started = time.monotonic()
    try:
        tracer_provider.shutdown()
        waited = time.monotonic() - started
    finally:
        gate.open.set()
    assert 0.3 <= waited < 1.0
    assert "still held 4 finished request(s) when TracerProvider.shutdown was called" in caplog.text


# --- 4. the content event is drained like spans and metrics ------------------------------------------


def _log_exporter():
    try:
        from opentelemetry.sdk._logs.export import InMemoryLogRecordExporter as Exporter
    except ImportError:  # opentelemetry-sdk < 1.39
        from opentelemetry.sdk._logs.export import InMemoryLogExporter as Exporter
    return Exporter()


def _event_pipeline():
    """A logger provider that exports only when flushed (as a batch processor with a long delay does)."""
    from opentelemetry.sdk._logs import LoggerProvider
    from opentelemetry.sdk._logs.export import BatchLogRecordProcessor

    exporter = _log_exporter()
    provider = LoggerProvider()
    provider.add_log_record_processor(BatchLogRecordProcessor(exporter, schedule_delay_millis=86_400_000))
    return provider, exporter


@pytest.mark.parametrize("flush", ["logger provider", "otel_generate.force_flush", "logger provider shutdown"])
def test_the_content_event_is_out_after_each_flush(flush, instrument, gpt2):
    logger_provider, events = _event_pipeline()
    tracer_provider = TracerProvider()
    instrument(
        tracer_provider=tracer_provider,
        meter_provider=MeterProvider(),
        logger_provider=logger_provider,
        capture_message_content="EVENT_ONLY",
    )
    ids, mask = prompt(length=4, seed=10)
    out = gpt2.generate(ids, attention_mask=mask, max_new_tokens=3, eos_token_id=None)
    if flush == "logger provider":
        assert logger_provider.force_flush() is True
    elif flush == "otel_generate.force_flush":
        assert otel_generate.force_flush(10.0) is True
    else:
        logger_provider.shutdown()
    (event,) = events.get_finished_logs()
    record = getattr(event, "log_record", event)
    assert record.event_name == A.EVENT_INFERENCE_OPERATION_DETAILS
    assert record.attributes[A.GEN_AI_USAGE_OUTPUT_TOKENS] == out.shape[-1] - ids.shape[-1] == 3


# --- 5. a flush from the emitter's own thread -----------------------------------------------------------


def test_a_flush_from_a_span_processor_returns_at_once_and_a_request_made_there_is_emitted(instrument, gpt2):
    """A processor whose ``on_end`` flushes (``otel_generate.force_flush()``, the provider's own) and,
    once, runs ``generate()``: with background emission that is the emitter's thread. The flushes
    return within 100 ms; the request made there is emitted like any other."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    waits, nested = [], []

    class FlushesOnEnd(AppProcessor):
        def on_end(self, span):
            if span.name != A.STEP_SPAN_PREFILL or len(waits) >= 2:
                return
            started = time.monotonic()
            otel_generate.force_flush(30.0)
            waits.append(time.monotonic() - started)
            started = time.monotonic()
            provider.force_flush()
            waits.append(time.monotonic() - started)
            ids, mask = prompt(length=3, seed=12)
            nested.append(gpt2.generate(ids, attention_mask=mask, max_new_tokens=2, eos_token_id=None))

    provider.add_span_processor(FlushesOnEnd())
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    instrument(tracer_provider=provider, meter_provider=MeterProvider())
    ids, mask = prompt(length=4, seed=11)
    out = gpt2.generate(ids, attention_mask=mask, max_new_tokens=3, eos_token_id=None)
    assert provider.force_flush()
    assert len(waits) == 2 and max(waits) < 0.1, waits
    requests = [s for s in exporter.get_finished_spans() if s.name.startswith("text_completion")]
    outputs = sorted(s.attributes[A.GEN_AI_USAGE_OUTPUT_TOKENS] for s in requests)
    assert outputs == sorted([out.shape[-1] - ids.shape[-1], nested[0].shape[-1] - 3]) == [2, 3]


# --- 6. OpenTelemetry's off switch ------------------------------------------------------------------------


def test_a_meter_provider_that_gives_no_op_meters_is_not_timed_for(instrument, gpt2, monkeypatch, caplog):
    """The SDK's providers with ``OTEL_SDK_DISABLED=true`` hand out no-op tracers and meters: a call
    reads the clock twice (start and end), installs no step hook and never waits for the device."""
    from otel_generate import clock

    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    reads, synced = [], []
    real_clock = clock.monotonic_ns
    monkeypatch.setattr(clock, "devices_of", lambda model: ["cuda:0"])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))
    monkeypatch.setattr(clock, "monotonic_ns", lambda: reads.append(1) or real_clock())
    tracer_provider, meter_provider = TracerProvider(), MeterProvider()
    with caplog.at_level(logging.INFO, logger="otel_generate"):
        instrument(tracer_provider=tracer_provider, meter_provider=meter_provider)
    (said,) = [r for r in caplog.records if r.name == "otel_generate"]
    assert said.levelno == logging.INFO and "OTEL_SDK_DISABLED=true" in said.getMessage()
    ids, mask = prompt(length=4, seed=13)
    out = gpt2.generate(ids, attention_mask=mask, max_new_tokens=32, eos_token_id=None)
    assert len(reads) <= 2 and synced == []
    with otel_generate.TokenLatencyProfiler() as profiler:  # a latency API asks for the figures: timed
        again = gpt2.generate(ids, attention_mask=mask, max_new_tokens=32, eos_token_id=None)
    assert torch.equal(out, again)
    (record,) = profiler.records
    assert len(record.step_latencies_s) == 32 and len(synced) == 1 + 32 + 1
    from opentelemetry.instrumentation.utils import suppress_instrumentation

    with suppress_instrumentation():
        expected = gpt2.generate(ids, attention_mask=mask, max_new_tokens=32, eos_token_id=None)
    assert torch.equal(out, expected)


def test_continuous_batching_requests_each_carry_their_submitters_context(instrument, llama):
    """Two threads submit to one ``ContinuousBatchingManager`` under different baggage: each
    request's span and every one of its step spans (built on the emitter's thread from the
    scheduler's logs) carry its own submitter's baggage and context value, never the other's."""
    capi = pytest.importorskip(
        "transformers.generation.continuous_batching.continuous_api",
        reason="this transformers has no continuous batching",
    )
    from otel_generate.instrumentor import missing_hooks

    if missing_hooks(capi):
        pytest.skip(f"continuous batching without {missing_hooks(capi)}: not instrumented")
    from transformers import ContinuousBatchingConfig, GenerationConfig

    provider, exporter = context_provider()
    instrument(tracer_provider=provider)
    config = GenerationConfig(max_new_tokens=5, eos_token_id=None, do_sample=False)
    cb = ContinuousBatchingConfig(num_blocks=16, max_batch_tokens=64, page_size=16)
    manager = llama.init_continuous_batching(generation_config=config, continuous_batching_config=cb)
    ids, errors = {}, []
    barrier = threading.Barrier(2)

    def submitter(tenant, prompt):
        token = otel_context.attach(callers_context(tenant, f"session-{tenant}"))
        try:
            barrier.wait(timeout=30)
            request_id = manager.add_request(prompt, max_new_tokens=5)
            for output in manager.request_id_iter(request_id):
                if output.is_finished():
                    ids[tenant] = (request_id, len(output.generated_tokens))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            otel_context.detach(token)

    manager.start()
    try:
        threads = [threading.Thread(target=submitter, args=args) for args in (("acme", [5, 6, 7]), ("globex", [9, 8]))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
    finally:
        manager.stop(block=True, timeout=30)
        llama.destroy_cached_continuous_batching_manager()
    assert not errors and set(ids) == {"acme", "globex"}
    assert provider.force_flush()
    spans = ours(exporter.get_finished_spans())
    for tenant, (request_id, generated) in ids.items():
        (request,) = [s for s in spans if s.attributes.get(A.GEN_AI_RESPONSE_ID) == request_id]
        steps = [s for s in spans if s.parent is not None and s.parent.span_id == request.context.span_id]
        assert generated == 5 and len(steps) == generated
        assert_in_callers_context([request, *steps], tenant, f"session-{tenant}")


# --- exemplars: what the application's own view and filter keep -------------------------------------------


@pytest.mark.parametrize("exemplar_filter", ["always_on", "trace_based"])
@pytest.mark.parametrize("aggregation", ["finer buckets", "exponential"])
def test_inter_token_exemplars_are_those_of_every_value_recorded_in_the_request_span(
    exemplar_filter, aggregation, instrument, gpt2
):
    """An application's ``View`` on ``generate.inter_token_latency`` (other bucket boundaries, or an
    exponential histogram) and its exemplar filter: the exemplars kept are those the same SDK keeps
    when the application records every inter-token value itself with the request span in the
    context, on a histogram of its own with the same view: the same values, each linked to its
    request span (the exponential histogram's reservoir picks at random: as many, each linked to a
    request span)."""
    from opentelemetry.sdk.metrics import AlwaysOnExemplarFilter, TraceBasedExemplarFilter
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.metrics.view import (
        ExplicitBucketHistogramAggregation,
        ExponentialBucketHistogramAggregation,
        View,
    )

    def chosen():
        if aggregation == "finer buckets":
            return ExplicitBucketHistogramAggregation([0.0005 * i for i in range(1, 60)])
        return ExponentialBucketHistogramAggregation()

    names = (A.METRIC_INTER_TOKEN_LATENCY, "app.inter_token_latency")
    reader = InMemoryMetricReader()
    meter_provider = MeterProvider(
        metric_readers=[reader],
        views=[View(instrument_name=name, aggregation=chosen()) for name in names],
        exemplar_filter=AlwaysOnExemplarFilter() if exemplar_filter == "always_on" else TraceBasedExemplarFilter(),
    )
    spans = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    instrument(tracer_provider=tracer_provider, meter_provider=meter_provider)
    theirs = meter_provider.get_meter("app").create_histogram(names[1], unit="s")
    recorded, requests = 0, set()
    for seed in range(3):
        ids, mask = prompt(length=4, seed=20 + seed)
        out = gpt2.generate(ids, attention_mask=mask, max_new_tokens=24, eos_token_id=None)
        assert tracer_provider.force_flush()
        (request,) = [s for s in ours(spans.get_finished_spans()) if s.name.startswith("text_completion")][-1:]
        values = list(request.attributes[A.GENERATE_STEP_LATENCIES])[1:]  # one token a step: every decode step
        assert len(values) == out.shape[-1] - ids.shape[-1] - 1 == 23
        in_request = trace.set_span_in_context(trace.NonRecordingSpan(request.get_span_context()))
        for value in values:
            theirs.record(
                value, {A.GEN_AI_REQUEST_MODEL: request.attributes[A.GEN_AI_REQUEST_MODEL]}, context=in_request
            )
        recorded += len(values)
        requests.add(request.context.span_id)
    data = reader.get_metrics_data()

    def exemplars(name):
        (found,) = [
            d
            for r in data.resource_metrics
            for s in r.scope_metrics
            for m in s.metrics
            if m.name == name
            for d in m.data.data_points
        ]
        assert found.count == recorded
        return sorted((e.value, e.span_id) for e in found.exemplars)

    expected, found = exemplars(names[1]), exemplars(names[0])
    assert expected and {span_id for _, span_id in expected} <= requests
    if aggregation == "exponential":
        # as many as the SDK keeps: its reservoir of 20 full. Before 1.45 the SDK's random reservoir
        # (SimpleFixedSizeExemplarReservoir) can leave its last slot empty, at random, on either side
        full = {20} if sdk_version() >= (1, 45) else {19, 20}
        assert len(found) in full and len(expected) in full
        assert {span_id for _, span_id in found} <= requests
    else:
        assert found == expected
