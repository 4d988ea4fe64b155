"""Continuous batching (transformers 5.17+): one request span per request, in the trace of whoever
submitted it.

Every case runs the tiny random-weight Llama on the CPU with a small ``ContinuousBatchingConfig``
(the default one sizes its cache and static tensors from host memory: tens of seconds per call).
Expected values are computed from what transformers returned (the ``GenerationOutput``s, the
returned tensor) or from an uninstrumented run, never copied from a previous run. Spans are
matched to requests by ``gen_ai.response.id``, never by order: ``add_requests`` submits in
prefix-sharing order. Every manager started here is stopped in a ``finally``: its scheduler thread
is not a daemon.
"""

from __future__ import annotations

import logging
import threading

import pytest
import torch
from opentelemetry import trace
from opentelemetry.instrumentation.utils import suppress_instrumentation
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from otel_generate import GenerateInstrumentor
from otel_generate import attributes as A
from otel_generate.instrumentor import PATCHES, missing_hooks
from tests.helpers import request_spans, step_spans
from tests.integration.test_metrics_and_latency_apis import by_token_type, histograms

capi = pytest.importorskip(
    "transformers.generation.continuous_batching.continuous_api",
    reason="this transformers has no continuous batching",
)
from otel_generate.integrations import cb_derive  # noqa: E402
from otel_generate.integrations import continuous_batching as CB  # noqa: E402

if missing_hooks(capi):
    pytest.skip(f"continuous batching without {missing_hooks(capi)}: not instrumented", allow_module_level=True)

from transformers import ContinuousBatchingConfig, GenerationConfig  # noqa: E402

PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13]]


def small_config(**overrides):
    """A cache and batch sized for the tiny model (16 blocks of 16 tokens, 64 tokens per batch)."""
    return ContinuousBatchingConfig(**{"num_blocks": 16, "max_batch_tokens": 64, "page_size": 16, **overrides})


def greedy(max_new_tokens=6, **kwargs):
    return GenerationConfig(max_new_tokens=max_new_tokens, eos_token_id=None, do_sample=False, **kwargs)


def plain_generate_batch(model, inputs, generation_config, **kwargs):
    """``generate_batch`` with this package's hooks suppressed: what the user gets uninstrumented."""
    with suppress_instrumentation():
        outputs = model.generate_batch(
            inputs=inputs, generation_config=generation_config, continuous_batching_config=small_config(**kwargs)
        )
    return {rid: list(out.generated_tokens) for rid, out in outputs.items()}


def spans_by_id(exporter):
    """{gen_ai.response.id: request span}."""
    spans = request_spans(exporter)
    by_id = {span.attributes[A.GEN_AI_RESPONSE_ID]: span for span in spans}
    assert len(by_id) == len(spans)
    return by_id


@pytest.fixture
def llama(llama):
    yield llama
    # a test that failed half-way must not leave a cached manager on the shared model
    llama.destroy_cached_continuous_batching_manager()


# --- generate_batch ---------------------------------------------------------------------------------


def test_generate_batch_gives_one_request_span_per_request_under_the_application_span(
    instrumented, tracer_provider, span_exporter, metric_reader, llama
):
    plain = plain_generate_batch(llama, PROMPTS, greedy())
    tracer = tracer_provider.get_tracer("app")
    with tracer.start_as_current_span("app") as app:
        outputs = llama.generate_batch(
            inputs=PROMPTS, generation_config=greedy(), continuous_batching_config=small_config()
        )
    tracer_provider.force_flush()

    assert {rid: list(out.generated_tokens) for rid, out in outputs.items()} == plain  # outputs unchanged
    by_id = spans_by_id(span_exporter)
    assert set(by_id) == set(outputs)  # exactly one span per request
    for rid, output in outputs.items():
        span = by_id[rid]
        attrs = span.attributes
        assert span.parent.span_id == app.get_span_context().span_id
        assert span.context.trace_id == app.get_span_context().trace_id
        assert span.name == f"{A.OPERATION_TEXT_COMPLETION} {attrs[A.GEN_AI_REQUEST_MODEL]}"
        assert attrs[A.GEN_AI_USAGE_INPUT_TOKENS] == len(output.prompt_ids)
        assert attrs[A.GEN_AI_USAGE_OUTPUT_TOKENS] == len(output.generated_tokens) == 6
        assert attrs[A.GEN_AI_RESPONSE_FINISH_REASONS] == ("length",)
        assert attrs[A.GEN_AI_REQUEST_MAX_TOKENS] == 6
        assert attrs[A.GENERATE_STRATEGY] == A.STRATEGY_GREEDY
        assert attrs[A.GENERATE_DEVICE] == "cpu"
        assert attrs[A.GENERATE_SYNCHRONIZED] is True
        assert A.GEN_AI_REQUEST_TEMPERATURE not in attrs  # greedy: no sampling parameters
        steps = step_spans(span_exporter, span)
        assert attrs[A.GENERATE_STEPS] == len(steps) and attrs[A.GENERATE_STEP_SPANS_DROPPED] == 0
        # one prefill (the prompt fits in one batch step), then one decode per further token
        assert [s.name for s in steps] == ["prefill"] + ["decode"] * (len(output.generated_tokens) - 1)
        assert [s.attributes[A.GENERATE_TOKEN_INDEX] for s in steps] == list(range(len(steps)))
        assert all(s.attributes[A.GENERATE_STEP_TOKENS] == 1 for s in steps)
        # time line: submission (span start) <= queue <= first step <= ... <= span end
        queue = attrs[A.GENERATE_TIME_IN_QUEUE]
        assert queue >= 0
        assert steps[0].start_time == span.start_time + round(queue * 1e9)
        ttft = attrs[A.GENERATE_TIME_TO_FIRST_TOKEN]
        assert ttft == pytest.approx((steps[0].end_time - span.start_time) / 1e9, abs=2e-6)
        assert queue <= ttft
        for earlier, later in zip(steps, steps[1:]):
            assert earlier.end_time <= later.start_time
        assert span.start_time <= steps[0].start_time and steps[-1].end_time <= span.end_time
        for step in steps:
            assert step.attributes[A.GENERATE_STEP_LATENCY] == pytest.approx(
                (step.end_time - step.start_time) / 1e9, abs=2e-9
            )

    # generate.step.requests: a step shared by both requests is the same batch step in both: the same end
    # (the start of a request's first step is never before its submission)
    first, second = (step_spans(span_exporter, by_id[rid]) for rid in sorted(outputs))
    ends = {s.end_time: s for s in second}
    for step in first:
        shared = ends.get(step.end_time)
        assert step.attributes[A.GENERATE_STEP_REQUESTS] == (2 if shared is not None else 1)
        if shared is not None:
            assert shared.attributes[A.GENERATE_STEP_REQUESTS] == 2

    # metrics: the GenAI histograms once per request, recorded as generate() records them
    points = histograms(metric_reader)
    for name in (
        A.METRIC_TIME_TO_FIRST_TOKEN,
        A.METRIC_TIME_PER_OUTPUT_TOKEN,
        A.METRIC_REQUEST_DURATION,
        A.METRIC_CLIENT_OPERATION_DURATION,
    ):
        assert sum(p.count for p in points[name]) == 2, name
    ttfts = sorted(by_id[rid].attributes[A.GENERATE_TIME_TO_FIRST_TOKEN] for rid in outputs)
    assert sum(p.sum for p in points[A.METRIC_TIME_TO_FIRST_TOKEN]) == pytest.approx(sum(ttfts))
    usage = points[A.METRIC_TOKEN_USAGE]
    assert sum(p.sum for p in by_token_type(usage, "input")) == sum(len(o.prompt_ids) for o in outputs.values())
    assert sum(p.sum for p in by_token_type(usage, "output")) == sum(len(o.generated_tokens) for o in outputs.values())
    durations = points[A.METRIC_REQUEST_DURATION]
    assert sum(p.sum for p in durations) == pytest.approx(
        sum((by_id[rid].end_time - by_id[rid].start_time) / 1e9 for rid in outputs)
    )


def test_eos_gives_stop_for_that_request_only(instrumented, tracer_provider, span_exporter, llama):
    plain = plain_generate_batch(llama, PROMPTS, greedy())
    eos = plain["req_0"][2]  # a token request 0 generates third, and request 1 never generates
    assert eos not in plain["req_1"]
    config = GenerationConfig(max_new_tokens=6, eos_token_id=eos, do_sample=False)
    outputs = llama.generate_batch(inputs=PROMPTS, generation_config=config, continuous_batching_config=small_config())
    tracer_provider.force_flush()
    by_id = spans_by_id(span_exporter)
    stopped, full = by_id["req_0"].attributes, by_id["req_1"].attributes
    assert list(outputs["req_0"].generated_tokens) == plain["req_0"][:3]
    assert stopped[A.GEN_AI_USAGE_OUTPUT_TOKENS] == 3 and stopped[A.GEN_AI_RESPONSE_FINISH_REASONS] == ("stop",)
    assert stopped[A.GENERATE_STEPS] == 3
    assert full[A.GEN_AI_USAGE_OUTPUT_TOKENS] == 6 and full[A.GEN_AI_RESPONSE_FINISH_REASONS] == ("length",)


def test_chunked_prefill_gives_one_prefill_span_per_chunk(instrumented, tracer_provider, span_exporter, llama):
    plain = plain_generate_batch(llama, PROMPTS, greedy(), max_batch_tokens=4)
    outputs = llama.generate_batch(
        inputs=PROMPTS, generation_config=greedy(), continuous_batching_config=small_config(max_batch_tokens=4)
    )
    tracer_provider.force_flush()
    assert {rid: list(out.generated_tokens) for rid, out in outputs.items()} == plain
    by_id = spans_by_id(span_exporter)
    long_prompt = next(rid for rid, out in outputs.items() if len(out.prompt_ids) == 5)
    steps = step_spans(span_exporter, by_id[long_prompt])
    tokens = [s.attributes[A.GENERATE_STEP_TOKENS] for s in steps]
    first_token = tokens.index(1)
    assert first_token >= 1  # 5 prompt tokens in batches of at most 4: at least two prefill chunks
    assert tokens[:first_token] == [0] * first_token  # the chunks before the last produced no token
    assert [s.name for s in steps] == ["prefill"] * (first_token + 1) + ["decode"] * (len(steps) - first_token - 1)
    assert (
        sum(tokens)
        == len(outputs[long_prompt].generated_tokens)
        == by_id[long_prompt].attributes[A.GEN_AI_USAGE_OUTPUT_TOKENS]
    )
    assert by_id[long_prompt].attributes[A.GENERATE_TIME_TO_FIRST_TOKEN] == pytest.approx(
        (steps[first_token].end_time - by_id[long_prompt].start_time) / 1e9, abs=2e-6
    )


def test_step_span_cap_applies_per_request(tracer_provider, span_exporter, meter_provider, llama):
    instrumentor = GenerateInstrumentor()
    instrumentor.instrument(tracer_provider=tracer_provider, meter_provider=meter_provider, max_step_spans=2)
    try:
        outputs = llama.generate_batch(
            inputs=PROMPTS, generation_config=greedy(), continuous_batching_config=small_config()
        )
        tracer_provider.force_flush()
    finally:
        instrumentor.uninstrument()
    for rid, span in spans_by_id(span_exporter).items():
        steps = len(outputs[rid].generated_tokens)
        assert len(step_spans(span_exporter, span)) == 2
        assert span.attributes[A.GENERATE_STEPS] == steps
        assert span.attributes[A.GENERATE_STEP_SPANS_DROPPED] == steps - 2


def test_num_return_sequences_is_one_request_with_one_count_per_sequence(
    instrumented, tracer_provider, span_exporter, llama
):
    config = GenerationConfig(
        max_new_tokens=4,
        eos_token_id=None,
        do_sample=True,
        num_return_sequences=2,
        temperature=0.7,
        top_k=20,
        top_p=0.9,
    )
    outputs = llama.generate_batch(
        inputs=[[5, 6, 7, 8]], generation_config=config, continuous_batching_config=small_config()
    )
    tracer_provider.force_flush()
    assert set(outputs) == {"req_0", "req_0__child#0"}
    (span,) = request_spans(span_exporter)
    attrs = span.attributes
    assert attrs[A.GEN_AI_RESPONSE_ID] == "req_0"
    assert attrs[A.GEN_AI_REQUEST_CHOICE_COUNT] == 2
    assert attrs[A.GEN_AI_USAGE_INPUT_TOKENS] == 4
    assert attrs[A.GEN_AI_USAGE_OUTPUT_TOKENS] == sum(len(o.generated_tokens) for o in outputs.values()) == 8
    assert attrs[A.GEN_AI_RESPONSE_FINISH_REASONS] == ("length", "length")
    assert attrs[A.GENERATE_STRATEGY] == A.STRATEGY_SAMPLE
    assert (attrs[A.GEN_AI_REQUEST_TEMPERATURE], attrs[A.GEN_AI_REQUEST_TOP_K], attrs[A.GEN_AI_REQUEST_TOP_P]) == (
        pytest.approx(0.7),
        20.0,
        pytest.approx(0.9),
    )
    steps = step_spans(span_exporter, span)
    # both sequences decode in the same batch steps: one step span per token of a sequence
    assert sum(s.attributes[A.GENERATE_STEP_TOKENS] for s in steps) == 4
    assert attrs[A.GENERATE_STEPS] == len(steps)


# --- the manager API ----------------------------------------------------------------------------------


def test_manager_api_requests_from_two_threads_are_children_of_their_own_spans(
    instrumented, tracer_provider, span_exporter, llama
):
    plain = plain_generate_batch(llama, PROMPTS, greedy())
    plain_by_prompt = {tuple(p): plain[f"req_{i}"] for i, p in enumerate(PROMPTS)}
    tracer = tracer_provider.get_tracer("app")
    manager = llama.init_continuous_batching(generation_config=greedy(), continuous_batching_config=small_config())
    results, errors, app_spans = {}, [], {}
    barrier = threading.Barrier(2)

    def user(name, prompt):
        try:
            with tracer.start_as_current_span(f"app-{name}") as span:
                app_spans[name] = span.get_span_context()
                barrier.wait(timeout=30)
                request_id = manager.add_request(prompt, max_new_tokens=6)
                for output in manager.request_id_iter(request_id):
                    if output.is_finished():
                        results[name] = (request_id, output)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    manager.start()
    try:
        threads = [threading.Thread(target=user, args=(name, prompt)) for name, prompt in zip("ab", PROMPTS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
    finally:
        manager.stop(block=True, timeout=30)
    tracer_provider.force_flush()
    assert not errors and set(results) == {"a", "b"}

    by_id = spans_by_id(span_exporter)
    assert len(by_id) == 2
    for name, prompt in zip("ab", PROMPTS):
        request_id, output = results[name]
        span = by_id[request_id]
        assert span.parent.span_id == app_spans[name].span_id
        assert span.context.trace_id == app_spans[name].trace_id
        assert list(output.generated_tokens) == plain_by_prompt[tuple(prompt)]
        assert span.attributes[A.GEN_AI_USAGE_INPUT_TOKENS] == len(prompt)
        assert span.attributes[A.GEN_AI_USAGE_OUTPUT_TOKENS] == len(output.generated_tokens)
        assert span.attributes[A.GENERATE_STEPS] == len(step_spans(span_exporter, span)) == 6
    assert app_spans["a"].trace_id != app_spans["b"].trace_id


def test_context_manager_streaming_request(instrumented, tracer_provider, span_exporter, llama):
    tracer = tracer_provider.get_tracer("app")
    chunks = []
    with tracer.start_as_current_span("app") as app:
        with llama.continuous_batching_context_manager(
            generation_config=greedy(), continuous_batching_config=small_config()
        ) as manager:
            request_id = manager.add_request([5, 6, 7], max_new_tokens=4, streaming=True)
            for output in manager.request_id_iter(request_id):
                chunks.append(len(output.generated_tokens))
    tracer_provider.force_flush()
    (span,) = request_spans(span_exporter)
    assert span.parent.span_id == app.get_span_context().span_id
    assert span.attributes[A.GEN_AI_REQUEST_STREAM] is True
    assert span.attributes[A.GEN_AI_USAGE_OUTPUT_TOKENS] == chunks[-1] == 4
    assert span.attributes[A.GEN_AI_REQUEST_MAX_TOKENS] == 4


def test_cancelled_request_ends_with_finish_reason_cancelled(instrumented, tracer_provider, span_exporter, llama):
    manager = llama.init_continuous_batching(generation_config=greedy(), continuous_batching_config=small_config())
    manager.start()
    try:
        request_id = manager.add_request([5, 6, 7], max_new_tokens=200, streaming=True)
        seen = 0
        for output in manager.request_id_iter(request_id):
            seen = len(output.generated_tokens)
            if seen >= 2:
                manager.cancel_request(request_id)
                break
    finally:
        manager.stop(block=True, timeout=30)
    tracer_provider.force_flush()
    (span,) = request_spans(span_exporter)
    attrs = span.attributes
    assert attrs[A.GEN_AI_RESPONSE_ID] == request_id
    assert attrs[A.GEN_AI_RESPONSE_FINISH_REASONS] == (CB.FINISH_REASON_CANCELLED,)
    steps = step_spans(span_exporter, span)
    assert 2 <= attrs[A.GEN_AI_USAGE_OUTPUT_TOKENS] == sum(s.attributes[A.GENERATE_STEP_TOKENS] for s in steps) < 200


# --- generate(..., cache_implementation="paged") ------------------------------------------------------


def test_paged_generate_is_one_complete_request_span(instrumented, tracer_provider, span_exporter, llama):
    ids = torch.tensor([[5, 6, 7, 8, 9], [11, 12, 13, 14, 15]])
    kwargs = dict(max_new_tokens=6, eos_token_id=None, do_sample=False)
    with suppress_instrumentation():
        expected = type(llama).generate(llama, ids, attention_mask=torch.ones_like(ids), **kwargs)  # plain generate()
        plain_paged = llama.generate(
            ids, cache_implementation="paged", continuous_batching_config=small_config(), **kwargs
        )
    tracer = tracer_provider.get_tracer("app")
    with tracer.start_as_current_span("app") as app:
        output = llama.generate(ids, cache_implementation="paged", continuous_batching_config=small_config(), **kwargs)
    tracer_provider.force_flush()

    assert torch.equal(output, plain_paged) and torch.equal(output[0], expected)
    (span,) = request_spans(span_exporter)
    attrs = span.attributes
    assert span.parent.span_id == app.get_span_context().span_id
    new_tokens = output.shape[-1] - ids.shape[-1]
    assert attrs[A.GEN_AI_USAGE_INPUT_TOKENS] == ids.numel() == 10
    assert attrs[A.GEN_AI_USAGE_OUTPUT_TOKENS] == ids.shape[0] * new_tokens == 12
    assert attrs[A.GEN_AI_RESPONSE_FINISH_REASONS] == ("length", "length")
    assert attrs[A.GENERATE_BATCH_SIZE] == 2 and attrs[A.GEN_AI_REQUEST_MAX_TOKENS] == 6
    assert A.GENERATE_STEPS_INCOMPLETE not in attrs and A.GENERATE_STEPS_UNOBSERVED not in attrs
    assert A.GEN_AI_RESPONSE_ID not in attrs  # one generate() call, several continuous-batching requests
    steps = step_spans(span_exporter, span)
    assert attrs[A.GENERATE_STEPS] == len(steps) == new_tokens  # both rows share every batch step
    assert [s.name for s in steps] == ["prefill"] + ["decode"] * (new_tokens - 1)
    assert all(s.attributes[A.GENERATE_STEP_REQUESTS] == 2 for s in steps)
    assert 0 <= attrs[A.GENERATE_TIME_IN_QUEUE] <= attrs[A.GENERATE_TIME_TO_FIRST_TOKEN]
    assert span.start_time <= steps[0].start_time and steps[-1].end_time <= span.end_time


# --- off means off, faults -----------------------------------------------------------------------------


@pytest.mark.parametrize("metrics_on", [True, False], ids=["sdk-meter-provider", "no-meter-provider"])
def test_unsampled_requests_time_steps_only_for_the_metrics(
    metrics_on, span_exporter, meter_provider, metric_reader, llama, monkeypatch
):
    """Unsampled requests get no span; with an SDK meter provider their steps are still logged, for
    the latency histograms (every request, sampled or not); without one, nothing per step."""
    logged = []
    original = CB._log_step
    monkeypatch.setattr(CB, "_log_step", lambda *a, **k: (logged.append(1), original(*a, **k)))
    provider = TracerProvider(sampler=ALWAYS_OFF)
    provider.add_span_processor(SimpleSpanProcessor(span_exporter))
    instrumentor = GenerateInstrumentor()
    instrumentor.instrument(tracer_provider=provider, **({"meter_provider": meter_provider} if metrics_on else {}))
    try:
        outputs = llama.generate_batch(
            inputs=PROMPTS, generation_config=greedy(), continuous_batching_config=small_config()
        )
        provider.force_flush()
        instrumentor._telemetry.emitter.drain()
    finally:
        instrumentor.uninstrument()
    assert span_exporter.get_finished_spans() == ()
    points = histograms(metric_reader)
    if not metrics_on:
        assert logged == []  # the scheduler thread never logged a batch step
        assert points == {}
        return
    assert logged  # batch steps logged while the two requests ran
    generated = [len(o.generated_tokens) for o in outputs.values()]
    assert sum(p.count for p in points[A.METRIC_REQUEST_DURATION]) == 2
    assert sum(p.sum for p in by_token_type(points[A.METRIC_TOKEN_USAGE], "output")) == sum(generated)
    (ttft,) = points[A.METRIC_TIME_TO_FIRST_TOKEN]
    (tpot,) = points[A.METRIC_TIME_PER_OUTPUT_TOKEN]
    (itl,) = points[A.METRIC_INTER_TOKEN_LATENCY]
    (duration,) = points[A.METRIC_REQUEST_DURATION]
    assert ttft.count == 2 and tpot.count == 2 and 0 < ttft.sum < duration.sum
    assert itl.count == sum(n - 1 for n in generated)
    assert not any(p.exemplars for values in points.values() for p in values)


def test_unsampled_request_next_to_a_sampled_one(span_exporter, meter_provider, llama, monkeypatch):
    """An unsampled request shares batch steps with a sampled one: only the sampled one gets steps."""
    finished = []
    monkeypatch.setattr(CB.emit, "hand_over", lambda telemetry, span, request, *a, **k: finished.append(request))
    provider = TracerProvider(sampler=ParentBased(ALWAYS_OFF))
    provider.add_span_processor(SimpleSpanProcessor(span_exporter))
    instrumentor = GenerateInstrumentor()
    instrumentor.instrument(tracer_provider=provider)  # no meter provider: no metric needs the steps
    sampled = trace.set_span_in_context(NonRecordingSpan(SpanContext(1, 2, True, TraceFlags(TraceFlags.SAMPLED))))
    unsampled = trace.set_span_in_context(NonRecordingSpan(SpanContext(3, 4, True, TraceFlags(TraceFlags.DEFAULT))))
    manager = llama.init_continuous_batching(generation_config=greedy(), continuous_batching_config=small_config())
    try:
        from opentelemetry import context as otel_context

        ids = {}
        for name, context, prompt in (("sampled", sampled, PROMPTS[0]), ("unsampled", unsampled, PROMPTS[1])):
            token = otel_context.attach(context)
            try:
                ids[name] = manager.add_request(prompt, max_new_tokens=6)
            finally:
                otel_context.detach(token)
        manager.start()
        for request_id in ids.values():
            for _ in manager.request_id_iter(request_id):
                pass
    finally:
        manager.stop(block=True, timeout=30)
        provider.force_flush()
        instrumentor.uninstrument()
    by_id = {request.request_id: request for request in finished}
    assert set(by_id) == set(ids.values())
    timed, untimed = by_id[ids["sampled"]], by_id[ids["unsampled"]]
    assert timed.timed and len(timed.step_ends_ns) == 6 and timed.step_requests[0] == 2
    assert not untimed.timed and untimed.step_ends_ns == [] and untimed.output_tokens == 6


def test_a_fault_for_one_request_loses_no_other_span(
    instrumented, tracer_provider, span_exporter, llama, monkeypatch, caplog
):
    plain = plain_generate_batch(llama, PROMPTS, greedy())
    original = cb_derive.finish_reason

    def failing(output, eos):
        if output.request_id == "req_0":
            raise RuntimeError("injected accounting fault")
        return original(output, eos)

    monkeypatch.setattr(cb_derive, "finish_reason", failing)
    with caplog.at_level(logging.WARNING, logger="otel_generate"):
        outputs = llama.generate_batch(
            inputs=PROMPTS, generation_config=greedy(), continuous_batching_config=small_config()
        )
        tracer_provider.force_flush()
    assert {rid: list(out.generated_tokens) for rid, out in outputs.items()} == plain
    by_id = spans_by_id(span_exporter)
    assert set(by_id) == {"req_0", "req_1"}
    assert by_id["req_0"].attributes[A.GENERATE_STEPS_INCOMPLETE] is True  # ended, marked
    healthy = by_id["req_1"].attributes
    assert A.GENERATE_STEPS_INCOMPLETE not in healthy
    assert healthy[A.GEN_AI_USAGE_OUTPUT_TOKENS] == 6 and len(step_spans(span_exporter, by_id["req_1"])) == 6


def test_a_fault_on_the_scheduler_thread_never_stops_it(
    instrumented, tracer_provider, span_exporter, llama, monkeypatch
):
    plain = plain_generate_batch(llama, PROMPTS, greedy())
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("injected step-log fault")

    monkeypatch.setattr(CB, "_log_step", failing)
    outputs = llama.generate_batch(
        inputs=PROMPTS, generation_config=greedy(), continuous_batching_config=small_config()
    )
    tracer_provider.force_flush()
    assert calls  # the fault happened on every batch step ...
    assert {rid: list(out.generated_tokens) for rid, out in outputs.items()} == plain  # ... and generation went on
    by_id = spans_by_id(span_exporter)
    for rid, output in outputs.items():
        attrs = by_id[rid].attributes
        assert attrs[A.GEN_AI_USAGE_OUTPUT_TOKENS] == len(output.generated_tokens)
        assert attrs[A.GENERATE_STEPS_INCOMPLETE] is True  # the steps are missing, and the span says so


def test_uninstrument_removes_the_hooks(tracer_provider, span_exporter, llama):
    required = [(row.owner, row.attribute) for row in PATCHES if row.module == capi.__name__ and row.required]
    assert len(required) == 5
    originals = {(cls, name): vars(getattr(capi, cls))[name] for cls, name in required}
    instrumentor = GenerateInstrumentor()
    instrumentor.instrument(tracer_provider=tracer_provider)
    assert all(vars(getattr(capi, cls))[name] is not originals[(cls, name)] for cls, name in required)
    instrumentor.uninstrument()
    assert all(vars(getattr(capi, cls))[name] is originals[(cls, name)] for cls, name in required)
    llama.generate_batch(inputs=PROMPTS, generation_config=greedy(), continuous_batching_config=small_config())
    tracer_provider.force_flush()
    assert request_spans(span_exporter) == []


def test_token_latency_profiler_gets_continuous_batching_requests(llama):
    """With no SDK at all: the profiler's records are complete when its block ends."""
    from otel_generate import TokenLatencyProfiler

    with TokenLatencyProfiler() as profiler:
        outputs = llama.generate_batch(
            inputs=PROMPTS, generation_config=greedy(), continuous_batching_config=small_config()
        )
    assert not GenerateInstrumentor().is_instrumented_by_opentelemetry  # the profiler turned it on, then off
    records = sorted(profiler.records, key=lambda r: r.input_tokens)
    assert [r.input_tokens for r in records] == sorted(len(o.prompt_ids) for o in outputs.values())
    for record in records:
        assert record.output_tokens == 6 and len(record.step_latencies_s) == 6
        assert record.time_to_first_token_s >= record.step_latencies_s[0] > 0  # the queue time is in the first
