"""The core contract: one request span per generate() call, one child span per decode step, exact attributes."""

from __future__ import annotations

import threading

import pytest
import torch
import transformers
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.instrumentation.utils import suppress_instrumentation
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF
from opentelemetry.trace import SpanKind, StatusCode
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList
from transformers.generation.utils import GenerationMixin

from otel_generate import GenerateInstrumentor
from otel_generate import attributes as A
from otel_generate.bench.models import EOS_TOKEN_ID, PAD_TOKEN_ID
from otel_generate.tokens import count_new_tokens
from tests.helpers import only_request, prompt, request_spans, step_spans, uninstrumented_generate


class CountCalls(StoppingCriteria):
    """A user stopping criterion that counts decoding iterations and never stops anything."""

    def __init__(self):
        self.calls = 0

    def __call__(self, input_ids, scores, **kwargs):
        self.calls += 1
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


class ForceAt(LogitsProcessor):
    """Row ``row`` gets ``token`` at continuation position ``at`` (0-based); ``forbid`` ids never elsewhere."""

    def __init__(self, prompt_length, row, at, token=EOS_TOKEN_ID, forbid=(EOS_TOKEN_ID,)):
        self.prompt_length, self.row, self.at, self.token, self.forbid = prompt_length, row, at, token, list(forbid)

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        scores[:, self.forbid] = -float("inf")
        if input_ids.shape[-1] - self.prompt_length == self.at:
            scores[self.row, :] = -float("inf")
            scores[self.row, self.token] = 0.0
        return scores


class StopRowAfter(StoppingCriteria):
    """A user criterion that stops row ``row`` once it has ``after`` new tokens, and no other row."""

    def __init__(self, prompt_length, after, row=0):
        self.prompt_length, self.after, self.row = prompt_length, after, row

    def __call__(self, input_ids, scores, **kwargs):
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool)
        done[self.row] = input_ids.shape[-1] - self.prompt_length >= self.after
        return done


# --- the cases ---------------------------------------------------------------------------


def test_tiny_gpt2_four_token_prompt_eight_new_tokens(instrumented, span_exporter, gpt2):
    ids, mask = prompt(length=4)
    out = gpt2.generate(ids, attention_mask=mask, max_new_tokens=8, eos_token_id=None, do_sample=False)

    request = only_request(span_exporter)
    steps = step_spans(span_exporter, request)
    assert request.name == f"text_completion {type(gpt2).__name__}"
    assert request.kind is SpanKind.INTERNAL
    assert len(step_spans(span_exporter)) == len(steps) == 8
    assert [s.name for s in steps] == ["prefill"] + ["decode"] * 7
    attrs = request.attributes
    assert attrs[A.GEN_AI_OPERATION_NAME] == "text_completion"
    assert attrs[A.GEN_AI_PROVIDER_NAME] == "transformers"
    assert attrs[A.GEN_AI_REQUEST_MODEL] == type(gpt2).__name__
    assert attrs[A.GEN_AI_USAGE_INPUT_TOKENS] == 4
    assert attrs[A.GEN_AI_USAGE_OUTPUT_TOKENS] == out.shape[-1] - 4 == 8
    assert attrs[A.GEN_AI_RESPONSE_FINISH_REASONS] == ("length",)
    assert attrs[A.GEN_AI_REQUEST_MAX_TOKENS] == 8
    assert attrs[A.GENERATE_STEPS] == 8
    assert attrs[A.GENERATE_BATCH_SIZE] == 1
    assert attrs[A.GENERATE_NUM_BEAMS] == 1
    assert attrs[A.GENERATE_STRATEGY] == "greedy"
    assert attrs[A.GENERATE_DEVICE] == "cpu"
    assert attrs[A.GENERATE_SYNCHRONIZED] is True
    assert A.GEN_AI_REQUEST_TEMPERATURE not in attrs  # greedy: no sampling parameters
    assert A.GEN_AI_REQUEST_CHOICE_COUNT not in attrs

    latencies = [s.attributes[A.GENERATE_STEP_LATENCY] for s in steps]
    assert attrs[A.GENERATE_TIME_TO_FIRST_TOKEN] == latencies[0]
    assert attrs[A.GENERATE_TIME_PER_OUTPUT_TOKEN] == pytest.approx(sum(latencies[1:]) / 7)
    for index, step in enumerate(steps):
        assert step.kind is SpanKind.INTERNAL
        assert step.attributes[A.GENERATE_STEP_INDEX] == index
        assert step.attributes[A.GENERATE_TOKEN_INDEX] == index
        assert step.attributes[A.GENERATE_STEP_TOKENS] == 1
        assert "generate.step.phase" not in step.attributes  # the name says the phase
        assert step.context.trace_id == request.context.trace_id
        # the span's own duration is the recorded latency
        assert (step.end_time - step.start_time) / 1e9 == pytest.approx(latencies[index], abs=1e-6)
    # contiguous, inside the request span
    assert steps[0].start_time >= request.start_time
    for before, after in zip(steps, steps[1:]):
        assert after.start_time == before.end_time
    assert steps[-1].end_time <= request.end_time


@pytest.mark.parametrize("length", [10, 1000])
def test_short_and_long_prompts_count_only_continuation(instrumented, span_exporter, gpt2, length):
    ids, mask = prompt(length=length, seed=length)
    out = gpt2.generate(ids, attention_mask=mask, max_new_tokens=32, eos_token_id=None)
    request = only_request(span_exporter)
    assert out.shape[-1] - length == 32
    assert request.attributes[A.GEN_AI_USAGE_OUTPUT_TOKENS] == 32
    assert request.attributes[A.GEN_AI_USAGE_INPUT_TOKENS] == length
    assert len(step_spans(span_exporter, request)) == 32


def test_left_padded_batch_with_early_eos(instrumented, span_exporter, gpt2):
    ids, _ = prompt(batch=2, length=6, seed=3)
    mask = torch.ones_like(ids)
    ids[0, :3] = PAD_TOKEN_ID  # row 0: 3 real tokens, left padded
    mask[0, :3] = 0
    force = ForceAt(prompt_length=6, row=0, at=2)  # row 0's third token is EOS
    out = gpt2.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=10,
        do_sample=False,
        logits_processor=LogitsProcessorList([force]),
        pad_token_id=PAD_TOKEN_ID,
        eos_token_id=EOS_TOKEN_ID,
    )
    continuation = out[:, 6:]
    assert continuation[0, 2].item() == EOS_TOKEN_ID and (continuation[0, 3:] == PAD_TOKEN_ID).all()
    assert EOS_TOKEN_ID not in continuation[1].tolist()

    request = only_request(span_exporter)
    attrs = request.attributes
    assert attrs[A.GEN_AI_USAGE_INPUT_TOKENS] == 9
    assert attrs[A.GEN_AI_USAGE_OUTPUT_TOKENS] == 13
    assert attrs[A.GEN_AI_RESPONSE_FINISH_REASONS] == ("stop", "length")
    assert attrs[A.GENERATE_BATCH_SIZE] == 2
    assert len(step_spans(span_exporter, request)) == 10


def test_beam_search_same_sequences_and_one_span_per_iteration(instrumented, span_exporter, gpt2):
    ids, mask = prompt(length=5, seed=4)
    kwargs = dict(attention_mask=mask, max_new_tokens=6, num_beams=4, num_return_sequences=2, eos_token_id=None)
    expected_counter, counter = CountCalls(), CountCalls()
    expected = uninstrumented_generate(gpt2, ids, stopping_criteria=StoppingCriteriaList([expected_counter]), **kwargs)
    out = gpt2.generate(ids, stopping_criteria=StoppingCriteriaList([counter]), **kwargs)
    assert torch.equal(out, expected)

    request = only_request(span_exporter)
    attrs = request.attributes
    assert attrs[A.GENERATE_STRATEGY] == "beam_search"
    assert attrs[A.GENERATE_NUM_BEAMS] == 4
    assert attrs[A.GEN_AI_REQUEST_CHOICE_COUNT] == 2
    assert len(attrs[A.GEN_AI_RESPONSE_FINISH_REASONS]) == 2
    assert attrs[A.GEN_AI_USAGE_OUTPUT_TOKENS] == sum(count_new_tokens(out, 5, None, PAD_TOKEN_ID)) == 12
    assert counter.calls == expected_counter.calls
    assert len(step_spans(span_exporter, request)) == attrs[A.GENERATE_STEPS] == counter.calls


def _repetitive_prompt(model):
    ids, mask = prompt(length=6, seed=0)
    first = uninstrumented_generate(model, ids, attention_mask=mask, max_new_tokens=12, eos_token_id=None)
    text = torch.cat([ids, first[:, 6:], ids, first[:, 6:12]], dim=1)
    return text, torch.ones_like(text)


class NoEos(LogitsProcessor):
    def __call__(self, input_ids, scores):
        scores = scores.clone()
        scores[:, EOS_TOKEN_ID] = -float("inf")
        return scores


def test_prompt_lookup_steps_with_several_tokens_add_up(instrumented, span_exporter, gpt2):
    ids, mask = _repetitive_prompt(gpt2)
    # transformers 4.46's prompt lookup needs an EOS id: keep one, and forbid it
    kwargs = dict(attention_mask=mask, max_new_tokens=20, logits_processor=LogitsProcessorList([NoEos()]))
    expected = uninstrumented_generate(gpt2, ids, prompt_lookup_num_tokens=5, **kwargs)
    out = gpt2.generate(ids, prompt_lookup_num_tokens=5, **kwargs)
    assert torch.equal(out, expected)

    request = only_request(span_exporter)
    steps = step_spans(span_exporter, request)
    tokens = [s.attributes[A.GENERATE_STEP_TOKENS] for s in steps]
    assert request.attributes[A.GENERATE_STRATEGY] == "assisted"
    assert max(tokens) > 1
    assert sum(tokens) == request.attributes[A.GEN_AI_USAGE_OUTPUT_TOKENS] == out.shape[-1] - ids.shape[-1]
    assert len(steps) < 20
    indices = [s.attributes[A.GENERATE_TOKEN_INDEX] for s in steps]
    assert indices == [sum(tokens[:i]) for i in range(len(tokens))]
    latencies = [s.attributes[A.GENERATE_STEP_LATENCY] for s in steps]
    assert request.attributes[A.GENERATE_TIME_PER_OUTPUT_TOKEN] == pytest.approx(sum(latencies[1:]) / sum(tokens[1:]))


def test_request_span_is_child_of_the_application_span(instrumented, span_exporter, tracer_provider, gpt2):
    tracer = tracer_provider.get_tracer("app")
    ids, mask = prompt()
    with tracer.start_as_current_span("handle_request") as app_span:
        gpt2.generate(ids, attention_mask=mask, max_new_tokens=3, eos_token_id=None)
    request = only_request(span_exporter)
    assert request.parent.span_id == app_span.get_span_context().span_id
    assert request.context.trace_id == app_span.get_span_context().trace_id
    for step in step_spans(span_exporter):
        assert step.parent.span_id == request.context.span_id  # siblings, never a chain


def test_bad_argument_same_exception_and_error_span(instrumented, span_exporter, gpt2):
    ids, mask = prompt()
    with pytest.raises(Exception) as expected:
        uninstrumented_generate(gpt2, ids, attention_mask=mask, max_new_tokens=-1)
    with pytest.raises(type(expected.value)) as raised:
        gpt2.generate(ids, attention_mask=mask, max_new_tokens=-1)
    assert str(raised.value) == str(expected.value)

    request = only_request(span_exporter)
    assert request.status.status_code is StatusCode.ERROR
    assert request.attributes[A.ERROR_TYPE] == type(expected.value).__name__
    assert any(event.name == "exception" for event in request.events)


def test_exception_mid_generation_keeps_completed_steps(instrumented, span_exporter, gpt2):
    class Boom(RuntimeError):
        pass

    class RaiseAt(LogitsProcessor):
        def __call__(self, input_ids, scores):
            if input_ids.shape[-1] - 4 == 3:
                raise Boom("user processor failed")
            return scores

    ids, mask = prompt()
    with pytest.raises(Boom, match="user processor failed"):
        gpt2.generate(ids, attention_mask=mask, max_new_tokens=8, logits_processor=LogitsProcessorList([RaiseAt()]))
    request = only_request(span_exporter)
    assert request.status.status_code is StatusCode.ERROR
    assert request.attributes[A.ERROR_TYPE].endswith("Boom")
    assert len(step_spans(span_exporter, request)) == 3 == request.attributes[A.GENERATE_STEPS]


def test_instrument_twice_then_uninstrument(tracer_provider, span_exporter, gpt2):
    original = GenerationMixin.__dict__["generate"]
    instrumentor = GenerateInstrumentor()
    instrumentor.instrument(tracer_provider=tracer_provider)
    try:
        instrumentor.instrument(tracer_provider=tracer_provider)
        GenerateInstrumentor().instrument(tracer_provider=tracer_provider)
        ids, mask = prompt()
        gpt2.generate(ids, attention_mask=mask, max_new_tokens=2, eos_token_id=None)
        gpt2.generate(ids, attention_mask=mask, max_new_tokens=2, eos_token_id=None)
        assert len(request_spans(span_exporter)) == 2
        assert len(step_spans(span_exporter)) == 4
    finally:
        instrumentor.uninstrument()
    assert GenerationMixin.__dict__["generate"] is original
    for name in ("_prepare_generated_length", "_get_stopping_criteria"):
        assert not hasattr(GenerationMixin.__dict__[name], "_self_wrapper")
    span_exporter.clear()
    gpt2.generate(ids, attention_mask=mask, max_new_tokens=2, eos_token_id=None)
    assert span_exporter.get_finished_spans() == ()


# --- every decoding path: same outputs as uninstrumented ----------------------------------------------


def test_sampling_same_tokens_with_same_seed(instrumented, span_exporter, gpt2):
    ids, mask = prompt(batch=2, length=5, seed=7)
    kwargs = dict(
        attention_mask=mask, max_new_tokens=10, do_sample=True, temperature=0.7, top_p=0.9, top_k=20, eos_token_id=None
    )
    torch.manual_seed(123)
    expected = uninstrumented_generate(gpt2, ids, **kwargs)
    torch.manual_seed(123)
    out = gpt2.generate(ids, **kwargs)
    assert torch.equal(out, expected)
    attrs = only_request(span_exporter).attributes
    assert attrs[A.GENERATE_STRATEGY] == "sample"
    assert attrs[A.GEN_AI_REQUEST_TEMPERATURE] == pytest.approx(0.7)
    assert attrs[A.GEN_AI_REQUEST_TOP_P] == pytest.approx(0.9)
    assert attrs[A.GEN_AI_REQUEST_TOP_K] == 20
    assert attrs[A.GEN_AI_USAGE_OUTPUT_TOKENS] == 20


def test_beam_sample_and_num_return_sequences(instrumented, span_exporter, gpt2):
    ids, mask = prompt(length=4, seed=8)
    kwargs = dict(
        attention_mask=mask, max_new_tokens=5, num_beams=3, do_sample=True, num_return_sequences=3, eos_token_id=None
    )
    torch.manual_seed(5)
    expected = uninstrumented_generate(gpt2, ids, **kwargs)
    torch.manual_seed(5)
    out = gpt2.generate(ids, **kwargs)
    assert torch.equal(out, expected)
    attrs = only_request(span_exporter).attributes
    assert attrs[A.GENERATE_STRATEGY] == "beam_sample"
    assert attrs[A.GEN_AI_USAGE_OUTPUT_TOKENS] == 15
    assert attrs[A.GEN_AI_RESPONSE_FINISH_REASONS] == ("length",) * 3


def test_encoder_decoder_t5(instrumented, span_exporter, t5):
    ids, mask = prompt(batch=2, length=7, seed=9)
    expected = uninstrumented_generate(t5, ids, attention_mask=mask, max_new_tokens=6, eos_token_id=None)
    out = t5.generate(ids, attention_mask=mask, max_new_tokens=6, eos_token_id=None)
    assert torch.equal(out, expected)
    request = only_request(span_exporter)
    # the decoder start token leads every output row and was not generated
    assert out.shape[-1] == 1 + 6
    assert request.attributes[A.GEN_AI_USAGE_OUTPUT_TOKENS] == 12
    assert request.attributes[A.GEN_AI_USAGE_INPUT_TOKENS] == 14
    assert request.attributes[A.GEN_AI_REQUEST_MODEL] == "T5ForConditionalGeneration"
    steps = step_spans(span_exporter, request)
    assert len(steps) == 6 and steps[0].attributes[A.GENERATE_TOKEN_INDEX] == 0


def test_llama_left_padded_batch_same_output(instrumented, span_exporter, llama):
    ids, _ = prompt(batch=3, length=5, seed=10)
    mask = torch.ones_like(ids)
    ids[1, :2], mask[1, :2] = PAD_TOKEN_ID, 0
    ids[2, :4], mask[2, :4] = PAD_TOKEN_ID, 0
    expected = uninstrumented_generate(llama, ids, attention_mask=mask, max_new_tokens=4, eos_token_id=None)
    out = llama.generate(ids, attention_mask=mask, max_new_tokens=4, eos_token_id=None)
    assert torch.equal(out, expected)
    attrs = only_request(span_exporter).attributes
    assert attrs[A.GEN_AI_USAGE_INPUT_TOKENS] == 15 - 2 - 4
    assert attrs[A.GEN_AI_USAGE_OUTPUT_TOKENS] == 12


def test_return_dict_with_scores_unchanged(instrumented, span_exporter, gpt2):
    ids, mask = prompt(length=4, seed=11)
    kwargs = dict(
        attention_mask=mask, max_new_tokens=5, return_dict_in_generate=True, output_scores=True, eos_token_id=None
    )
    expected = uninstrumented_generate(gpt2, ids, **kwargs)
    out = gpt2.generate(ids, **kwargs)
    assert type(out) is type(expected)
    assert torch.equal(out.sequences, expected.sequences)
    assert len(out.scores) == len(expected.scores) == 5
    assert all(torch.equal(a, b) for a, b in zip(out.scores, expected.scores))
    assert set(out.keys()) == set(expected.keys())
    assert only_request(span_exporter).attributes[A.GEN_AI_USAGE_OUTPUT_TOKENS] == 5


def test_user_criterion_stopping_one_row_keeps_stopping_only_that_row(instrumented, span_exporter, gpt2):
    class Double(LogitsProcessor):
        def __call__(self, input_ids, scores):
            return scores * 2

    ids, mask = prompt(batch=2, length=4, seed=12)
    kwargs = dict(
        attention_mask=mask,
        max_new_tokens=8,
        pad_token_id=PAD_TOKEN_ID,
        eos_token_id=EOS_TOKEN_ID,
        logits_processor=LogitsProcessorList([Double()]),
    )
    expected = uninstrumented_generate(
        gpt2, ids, stopping_criteria=StoppingCriteriaList([StopRowAfter(4, 3)]), **kwargs
    )
    out = gpt2.generate(ids, stopping_criteria=StoppingCriteriaList([StopRowAfter(4, 3)]), **kwargs)
    assert torch.equal(out, expected)
    assert (out[0, 4 + 3 :] == PAD_TOKEN_ID).all() and out.shape[-1] == 12  # row 1 ran on
    attrs = only_request(span_exporter).attributes
    reference = count_new_tokens(out, 4, EOS_TOKEN_ID, PAD_TOKEN_ID)
    assert attrs[A.GEN_AI_USAGE_OUTPUT_TOKENS] == sum(reference)
    assert reference[0] == 3


def test_text_streamer(instrumented, span_exporter, gpt2, capsys):
    class Tokenizer:
        def decode(self, ids, **kwargs):
            return " ".join(f"t{int(i)}" for i in ids)

    ids, mask = prompt(seed=13)
    expected = uninstrumented_generate(gpt2, ids, attention_mask=mask, max_new_tokens=4, eos_token_id=None)
    out = gpt2.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=4,
        eos_token_id=None,
        streamer=transformers.TextStreamer(Tokenizer(), skip_prompt=True),
    )
    assert torch.equal(out, expected)
    printed = capsys.readouterr().out.split()
    assert printed == [f"t{t}" for t in out[0, 4:].tolist()]
    assert only_request(span_exporter).attributes[A.GEN_AI_USAGE_OUTPUT_TOKENS] == 4


def test_text_iterator_streamer_worker_keeps_callers_trace(instrumented, span_exporter, tracer_provider, gpt2):
    """docs/production.md's streaming pattern: run generate in a thread under a copy of the caller's context."""
    import contextvars

    class Tokenizer:
        def decode(self, ids, **kwargs):
            return "".join(f"<{int(i)}>" for i in ids)

    ids, mask = prompt(seed=14)
    streamer = transformers.TextIteratorStreamer(Tokenizer(), skip_prompt=True)
    tracer = tracer_provider.get_tracer("app")
    results = {}
    with tracer.start_as_current_span("handle_request") as app_span:
        ctx = contextvars.copy_context()
        worker = threading.Thread(
            target=lambda: results.setdefault(
                "out",
                ctx.run(
                    gpt2.generate, ids, attention_mask=mask, max_new_tokens=5, eos_token_id=None, streamer=streamer
                ),
            )
        )
        worker.start()
        text = "".join(streamer)
        worker.join()
    out = results["out"]
    assert text == "".join(f"<{t}>" for t in out[0, 4:].tolist())
    request = only_request(span_exporter)
    assert request.parent.span_id == app_span.get_span_context().span_id
    assert len(step_spans(span_exporter, request)) == 5


def test_model_overriding_generate_and_calling_super_gives_one_span(instrumented, span_exporter, gpt2):
    class MyModel(type(gpt2)):
        def generate(self, *args, **kwargs):
            kwargs.setdefault("max_new_tokens", 3)
            return super().generate(*args, **kwargs)

    model = MyModel(gpt2.config).eval()
    ids, mask = prompt()
    model.generate(ids, attention_mask=mask, eos_token_id=None)
    request = only_request(span_exporter)
    assert request.attributes[A.GEN_AI_USAGE_OUTPUT_TOKENS] == 3
    assert len(step_spans(span_exporter)) == 3


def test_assistant_model_generate_is_not_a_request_of_its_own(instrumented, span_exporter, gpt2):
    from otel_generate.bench.models import build_model

    assistant = build_model("gpt2", seed=1)
    ids, mask = prompt(seed=15)
    expected = uninstrumented_generate(
        gpt2, ids, attention_mask=mask, max_new_tokens=6, eos_token_id=None, assistant_model=assistant
    )
    out = gpt2.generate(ids, attention_mask=mask, max_new_tokens=6, eos_token_id=None, assistant_model=assistant)
    assert torch.equal(out, expected)
    request = only_request(span_exporter)
    steps = step_spans(span_exporter, request)
    assert request.attributes[A.GENERATE_STRATEGY] == "assisted"
    assert (
        sum(s.attributes[A.GENERATE_STEP_TOKENS] for s in steps)
        == 6
        == request.attributes[A.GEN_AI_USAGE_OUTPUT_TOKENS]
    )
    assert len(step_spans(span_exporter)) == len(steps)


def test_pipeline_gives_one_request_span(instrumented, span_exporter, gpt2):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(gpt2.config.vocab_size)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="w1"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="w1", pad_token="w0", eos_token=f"w{EOS_TOKEN_ID}"
    )
    pipe = transformers.pipeline("text-generation", model=gpt2, tokenizer=tokenizer)
    pipe("w5 w6 w7", max_new_tokens=4, do_sample=False, eos_token_id=None)
    request = only_request(span_exporter)
    assert request.attributes[A.GEN_AI_USAGE_INPUT_TOKENS] == 3
    assert request.attributes[A.GEN_AI_USAGE_OUTPUT_TOKENS] == 4


# --- off means off, faults never break generate() ---------------------------------------------------


def test_not_sampled_does_no_step_work(span_exporter, count_recorders, gpt2):
    provider = TracerProvider(sampler=ALWAYS_OFF)
    provider.add_span_processor(SimpleSpanProcessor(span_exporter))
    instrumentor = GenerateInstrumentor()
    instrumentor.instrument(tracer_provider=provider)
    try:
        ids, mask = prompt()
        gpt2.generate(ids, attention_mask=mask, max_new_tokens=4, eos_token_id=None)
    finally:
        instrumentor.uninstrument()
    assert count_recorders == {"init": 0, "call": 0}
    assert span_exporter.get_finished_spans() == ()


def test_not_sampled_times_steps_for_the_metrics_only(span_exporter, count_recorders, gpt2, monkeypatch):
    """With a meter provider, an unsampled request runs the step hook (its latencies feed the
    histograms) but builds nothing else: no span, no attributes, no record."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from otel_generate import emit

    annotated = []
    monkeypatch.setattr(emit, "_annotate", lambda *a, **k: annotated.append(1))
    reader = InMemoryMetricReader()
    provider = TracerProvider(sampler=ALWAYS_OFF)
    provider.add_span_processor(SimpleSpanProcessor(span_exporter))
    instrumentor = GenerateInstrumentor()
    instrumentor.instrument(tracer_provider=provider, meter_provider=MeterProvider(metric_readers=[reader]))
    try:
        ids, mask = prompt()
        gpt2.generate(ids, attention_mask=mask, max_new_tokens=4, eos_token_id=None)
    finally:
        instrumentor.uninstrument()
    assert count_recorders == {"init": 1, "call": 4}
    assert span_exporter.get_finished_spans() == ()
    assert annotated == []
    names = {
        metric.name: metric.data.data_points[0].count
        for rm in reader.get_metrics_data().resource_metrics
        for sm in rm.scope_metrics
        for metric in sm.metrics
        if metric.name != A.METRIC_TOKEN_USAGE
    }
    assert names == {
        A.METRIC_REQUEST_DURATION: 1,
        A.METRIC_CLIENT_OPERATION_DURATION: 1,
        A.METRIC_TIME_TO_FIRST_TOKEN: 1,
        A.METRIC_TIME_PER_OUTPUT_TOKEN: 1,
        A.METRIC_INTER_TOKEN_LATENCY: 3,
    }


def test_suppressed_does_no_step_work(instrumented, span_exporter, count_recorders, gpt2):
    ids, mask = prompt()
    with suppress_instrumentation():
        out = gpt2.generate(ids, attention_mask=mask, max_new_tokens=4, eos_token_id=None)
    assert out.shape[-1] == 8
    assert count_recorders == {"init": 0, "call": 0}
    assert span_exporter.get_finished_spans() == ()
    gpt2.generate(ids, attention_mask=mask, max_new_tokens=4, eos_token_id=None)  # sanity: counted when on
    assert count_recorders == {"init": 1, "call": 4}


def test_cpu_never_calls_cuda(instrumented, span_exporter, gpt2, monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("a CUDA function was called on the CPU path")

    monkeypatch.setattr(torch.cuda, "synchronize", fail)
    monkeypatch.setattr(torch.cuda, "is_available", fail)
    ids, mask = prompt()
    gpt2.generate(ids, attention_mask=mask, max_new_tokens=3, eos_token_id=None)
    assert only_request(span_exporter).attributes[A.GENERATE_STEPS] == 3


def test_accelerator_steps_synchronize_before_every_clock_read(instrumented, span_exporter, gpt2, monkeypatch):
    """With the model reported on cuda:0 (faked), each step is: synchronize, then read the clock."""
    from otel_generate import clock

    events = []
    real_clock = clock.monotonic_ns
    monkeypatch.setattr(clock, "devices_of", lambda model: ["cuda:0"])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append(("sync", str(device))))

    def recording_clock():
        events.append(("clock", None))
        return real_clock()

    monkeypatch.setattr(clock, "monotonic_ns", recording_clock)
    ids, mask = prompt()
    gpt2.generate(ids, attention_mask=mask, max_new_tokens=3, eos_token_id=None)
    kinds = [kind for kind, _ in events]
    # start: sync + clock; 3 steps: sync + clock each; end: sync + clock
    assert kinds == ["sync", "clock"] * 5
    assert all(device == "cuda:0" for kind, device in events if kind == "sync")
    request = only_request(span_exporter)
    assert request.attributes[A.GENERATE_SYNCHRONIZED] is True
    assert request.attributes[A.GENERATE_DEVICE] == "cuda:0"


def test_synchronize_can_be_switched_off(span_exporter, tracer_provider, gpt2, monkeypatch):
    from otel_generate import clock

    synced = []
    monkeypatch.setattr(clock, "devices_of", lambda model: ["cuda:0"])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))
    monkeypatch.setenv("OTEL_GENERATE_SYNCHRONIZE", "false")
    instrumentor = GenerateInstrumentor()
    instrumentor.instrument(tracer_provider=tracer_provider)
    try:
        ids, mask = prompt()
        gpt2.generate(ids, attention_mask=mask, max_new_tokens=3, eos_token_id=None)
    finally:
        instrumentor.uninstrument()
    assert synced == []
    assert only_request(span_exporter).attributes[A.GENERATE_SYNCHRONIZED] is False


@pytest.mark.parametrize("eos", [None, EOS_TOKEN_ID], ids=["list-records-itself", "recorder-keeps-is-done"])
def test_fault_in_step_hook_is_logged_once_and_generation_goes_on(
    instrumented, span_exporter, gpt2, monkeypatch, caplog, eos
):
    from otel_generate import _faults, clock

    ids, mask = prompt(seed=16)
    expected = uninstrumented_generate(gpt2, ids, attention_mask=mask, max_new_tokens=5, eos_token_id=eos)
    real = clock.monotonic_ns
    reads = {"n": 0}

    def flaky_clock():
        reads["n"] += 1
        if reads["n"] == 3:  # start, step 0, then fails at step 1
            raise OSError("clock went away")
        return real()

    monkeypatch.setattr(clock, "monotonic_ns", flaky_clock)
    monkeypatch.setattr(_faults, "_logged_kinds", set())
    with caplog.at_level("WARNING", logger="otel_generate"):
        out = gpt2.generate(ids, attention_mask=mask, max_new_tokens=5, eos_token_id=eos)
        out2 = gpt2.generate(ids, attention_mask=mask, max_new_tokens=5, eos_token_id=eos)
    assert torch.equal(out, expected) and torch.equal(out2, expected) and expected.shape[-1] == ids.shape[-1] + 5
    assert len([r for r in caplog.records if "step hook" in r.getMessage()]) == 1
    first = request_spans(span_exporter)[0]
    assert first.attributes[A.GENERATE_STEPS_INCOMPLETE] is True
    assert len(step_spans(span_exporter, first)) == 1


@pytest.fixture
def recording_lists(monkeypatch):
    """Every ``RecordingCriteriaList`` built while the test runs, in order."""
    from otel_generate.integrations import step_hook

    lists = []
    init = step_hook.RecordingCriteriaList.__init__

    def keep(self, criteria, recorder):
        init(self, criteria, recorder)
        lists.append(self)

    monkeypatch.setattr(step_hook.RecordingCriteriaList, "__init__", keep)
    return lists


def test_rows_may_end_apart_only_with_a_criterion_that_stops_rows_one_by_one():
    from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, MaxTimeCriteria

    from otel_generate.integrations.step_hook import rows_may_end_apart

    class Budget(MaxLengthCriteria):  # a subclass may stop rows one by one
        pass

    assert not rows_may_end_apart([MaxLengthCriteria(8), MaxTimeCriteria(5.0)])
    assert rows_may_end_apart([MaxLengthCriteria(8), EosTokenCriteria(EOS_TOKEN_ID)])
    assert rows_may_end_apart([Budget(8)]) and rows_may_end_apart([MaxLengthCriteria(8), CountCalls()])


def test_a_step_is_recorded_by_the_list_itself_keeping_is_done_only_when_a_row_may_stop_early(
    instrumented, span_exporter, gpt2, recording_lists
):
    lists = recording_lists
    ids, mask = prompt(seed=17, batch=2)
    # with the EOS, row 0 ends at its third new token, two steps before row 1
    force = LogitsProcessorList([ForceAt(ids.shape[-1], row=0, at=2)])
    outputs = [
        gpt2.generate(ids, attention_mask=mask, max_new_tokens=6, eos_token_id=eos, pad_token_id=PAD_TOKEN_ID, **kwargs)
        for eos, kwargs in ((None, {}), (EOS_TOKEN_ID, {"logits_processor": force}))
    ]
    plain, keeping = lists
    assert plain._plain is not None and plain.recorder.done == []
    # greedy: transformers' own loop appends one token a step, so the plain path reads no length
    assert plain.recorder.implied_lengths and plain.recorder.lengths == []
    # with an EOS the list keeps each step's is_done too, still without the recorder's call
    assert keeping._plain is not None and keeping.recorder.implied_lengths
    steps = keeping.recorder.step_lengths()
    assert len(keeping.recorder.done) == len(steps) == len(keeping.recorder.times_ns) > 0
    for length, done in zip(steps, keeping.recorder.done):  # what the criteria said at that step
        expected_done = StoppingCriteriaList(list(keeping))(outputs[1][:, :length], None)
        assert done.dtype == torch.bool and done.tolist() == expected_done.tolist()
    assert [done[0].item() for done in keeping.recorder.done].index(True) == 2
    for output, criteria, span in zip(outputs, lists, request_spans(span_exporter)):
        steps = output.shape[-1] - ids.shape[-1]
        assert criteria.recorder.step_lengths() == list(range(ids.shape[-1] + 1, output.shape[-1] + 1))
        assert len(step_spans(span_exporter, span)) == steps == span.attributes[A.GENERATE_STEPS]
        expected = count_new_tokens(output, ids.shape[-1], EOS_TOKEN_ID if criteria is keeping else None, PAD_TOKEN_ID)
        assert span.attributes[A.GEN_AI_USAGE_OUTPUT_TOKENS] == sum(expected)


def test_a_model_with_its_own_sample_loop_has_its_lengths_read(
    instrumented, span_exporter, gpt2, monkeypatch, recording_lists
):
    """Only transformers' own ``_sample`` is known to append one token per step: a model class that
    overrides it (here a pass-through) gets its lengths read, not implied."""
    from transformers.generation.utils import GenerationMixin

    lists = recording_lists

    def _sample(self, *args, **kwargs):
        return GenerationMixin._sample(self, *args, **kwargs)

    monkeypatch.setattr(type(gpt2), "_sample", _sample, raising=False)
    ids, mask = prompt(seed=5)
    output = gpt2.generate(ids, attention_mask=mask, max_new_tokens=4, eos_token_id=None)
    (criteria,) = lists
    assert criteria._plain is not None and not criteria.recorder.implied_lengths
    assert criteria.recorder.lengths == list(range(ids.shape[-1] + 1, output.shape[-1] + 1))
    (span,) = request_spans(span_exporter)
    assert span.attributes[A.GEN_AI_USAGE_OUTPUT_TOKENS] == ids.shape[0] * (output.shape[-1] - ids.shape[-1])


def test_no_span_leaks_into_context_after_generate(instrumented, gpt2):
    ids, mask = prompt()
    before = trace.get_current_span()
    gpt2.generate(ids, attention_mask=mask, max_new_tokens=2, eos_token_id=None)
    assert trace.get_current_span() is before
    assert otel_context.get_current() == otel_context.get_current()


# --- regressions found by trying to break it -------------------------------------------------------


def test_model_calling_super_prepare_generated_length_positionally(instrumented, span_exporter, gpt2):
    """transformers' own ParakeetForTDT / VoxtralRealtime override it and call super() positionally."""

    class Positional(type(gpt2)):
        def _prepare_generated_length(
            self,
            generation_config,
            has_default_max_length,
            has_default_min_length,
            model_input_name,
            input_ids_length,
            inputs_tensor,
        ):
            return super()._prepare_generated_length(
                generation_config,
                has_default_max_length,
                has_default_min_length,
                model_input_name,
                input_ids_length,
                inputs_tensor,
            )

    model = Positional(gpt2.config).eval()
    ids, mask = prompt(length=4)
    model.generate(ids, attention_mask=mask, max_new_tokens=6, eos_token_id=None)
    request = only_request(span_exporter)
    assert request.attributes[A.GEN_AI_USAGE_INPUT_TOKENS] == 4
    assert request.attributes[A.GEN_AI_USAGE_OUTPUT_TOKENS] == 6
    assert [s.attributes[A.GENERATE_STEP_TOKENS] for s in step_spans(span_exporter, request)] == [1] * 6
    assert A.GENERATE_STEPS_INCOMPLETE not in request.attributes


def test_a_real_generated_pad_token_is_output(instrumented, span_exporter, gpt2):
    """The last token of a row that ran to max_new_tokens happens to be the pad id: it was generated."""
    ids, mask = prompt(batch=2, length=4, seed=40)
    out = gpt2.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=5,
        pad_token_id=PAD_TOKEN_ID,
        eos_token_id=EOS_TOKEN_ID,
        logits_processor=LogitsProcessorList([ForceAt(4, 0, 4, PAD_TOKEN_ID, forbid=(EOS_TOKEN_ID, PAD_TOKEN_ID))]),
    )
    assert out[0, -1].item() == PAD_TOKEN_ID and out.shape[-1] == 9
    attrs = only_request(span_exporter).attributes
    assert attrs[A.GEN_AI_USAGE_OUTPUT_TOKENS] == 10
    assert attrs[A.GEN_AI_RESPONSE_FINISH_REASONS] == ("length", "length")


def test_row_stopped_by_a_criterion_with_pad_equal_to_eos(instrumented, span_exporter, gpt2):
    """GPT-2 style pad == EOS: the padding after a row a user criterion stopped is not an EOS it generated."""
    ids, mask = prompt(batch=2, length=4, seed=41)
    kwargs = dict(
        attention_mask=mask,
        max_new_tokens=6,
        pad_token_id=EOS_TOKEN_ID,
        eos_token_id=EOS_TOKEN_ID,
        logits_processor=LogitsProcessorList([NoEos()]),
    )
    expected = uninstrumented_generate(
        gpt2, ids, stopping_criteria=StoppingCriteriaList([StopRowAfter(4, 2)]), **kwargs
    )
    out = gpt2.generate(ids, stopping_criteria=StoppingCriteriaList([StopRowAfter(4, 2)]), **kwargs)
    assert torch.equal(out, expected)
    assert out[0, 4:6].tolist() != [EOS_TOKEN_ID] * 2 and (out[0, 6:] == EOS_TOKEN_ID).all()
    attrs = only_request(span_exporter).attributes
    assert attrs[A.GEN_AI_USAGE_OUTPUT_TOKENS] == 2 + 6
    assert attrs[A.GEN_AI_RESPONSE_FINISH_REASONS] == ("stop", "length")


def test_another_models_generate_inside_a_request_is_its_own_request(instrumented, span_exporter, gpt2):
    from otel_generate.bench.models import build_model

    guard = build_model("gpt2", seed=2)
    calls = []

    class Guard(LogitsProcessor):
        def __call__(self, input_ids, scores):
            if input_ids.shape[-1] == 5:  # once, at the second step
                guard.generate(
                    input_ids,
                    attention_mask=torch.ones_like(input_ids),
                    max_new_tokens=2,
                    eos_token_id=None,
                    per_token_latency_callback=lambda i, s: calls.append(i),
                )
            return scores

    ids, mask = prompt(length=4)
    gpt2.generate(
        ids, attention_mask=mask, max_new_tokens=3, eos_token_id=None, logits_processor=LogitsProcessorList([Guard()])
    )
    outer, inner = sorted(request_spans(span_exporter), key=lambda s: s.start_time)
    assert inner.parent.span_id == outer.context.span_id
    assert inner.attributes[A.GEN_AI_USAGE_OUTPUT_TOKENS] == 2 and outer.attributes[A.GEN_AI_USAGE_OUTPUT_TOKENS] == 3
    assert len(step_spans(span_exporter, inner)) == 2 and len(step_spans(span_exporter, outer)) == 3
    assert calls == [0, 1]


def test_pixel_inputs_are_not_counted_as_tokens(instrumented, span_exporter):
    """A vision encoder-decoder's pixel_values have no prompt tokens; the continuation still counts."""
    enc = transformers.ViTConfig(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, image_size=32, patch_size=8
    )
    dec = transformers.GPT2Config(
        vocab_size=128,
        n_embd=16,
        n_layer=1,
        n_head=2,
        add_cross_attention=True,
        is_decoder=True,
        bos_token_id=1,
        eos_token_id=EOS_TOKEN_ID,
    )
    config = transformers.VisionEncoderDecoderConfig.from_encoder_decoder_configs(enc, dec)
    config.decoder_start_token_id, config.pad_token_id, config.eos_token_id = 1, PAD_TOKEN_ID, EOS_TOKEN_ID
    torch.manual_seed(0)
    model = transformers.VisionEncoderDecoderModel(config).eval()
    out = model.generate(pixel_values=torch.randn(2, 3, 32, 32), max_new_tokens=3, eos_token_id=None)
    attrs = only_request(span_exporter).attributes
    assert A.GEN_AI_USAGE_INPUT_TOKENS not in attrs
    assert attrs[A.GENERATE_BATCH_SIZE] == 2
    assert attrs[A.GEN_AI_USAGE_OUTPUT_TOKENS] == 2 * (out.shape[-1] - 1) == 6


def test_inputs_embeds_positions_are_input_tokens(instrumented, span_exporter, gpt2):
    ids, mask = prompt(length=4)
    gpt2.generate(
        inputs_embeds=gpt2.get_input_embeddings()(ids), attention_mask=mask, max_new_tokens=2, eos_token_id=None
    )
    attrs = only_request(span_exporter).attributes
    assert attrs[A.GEN_AI_USAGE_INPUT_TOKENS] == 4
    assert attrs[A.GEN_AI_USAGE_OUTPUT_TOKENS] == 2


def test_unknown_device_type_is_timed_unsynchronized(instrumented, span_exporter, gpt2, monkeypatch):
    from otel_generate import clock

    monkeypatch.setattr(clock, "devices_of", lambda model: ["hpu:0"])
    ids, mask = prompt()
    out = gpt2.generate(ids, attention_mask=mask, max_new_tokens=3, eos_token_id=None)
    attrs = only_request(span_exporter).attributes
    assert out.shape[-1] == 7 and attrs[A.GEN_AI_USAGE_OUTPUT_TOKENS] == 3
    assert attrs[A.GENERATE_SYNCHRONIZED] is False and attrs[A.GENERATE_DEVICE] == "hpu:0"
    assert len(step_spans(span_exporter)) == 3


# --- every patch point on one screen (otel_generate.instrumentor.PATCHES) --------------------------------------

_ABSENT = object()


def _table_targets(providers=None):
    """``(owner, attribute) -> what owner.__dict__ holds now`` for every row of ``PATCHES`` whose module this
    transformers has (4.46 has no continuous batching or serve), subclasses included for ``Class+`` rows, plus
    the ``__init_subclass__`` such a row adds to its class; for the rows of the providers in use, the class of
    each provider in ``providers`` (role -> provider) that defines the attribute."""
    import importlib

    from otel_generate.instrumentor import MODULE_LEVEL, PATCHES, PROVIDERS, SUBCLASSES, _subclasses

    modules = {}
    for row in PATCHES:
        if row.module == PROVIDERS:
            continue
        try:
            modules[row.module] = importlib.import_module(row.module)
        except ImportError:
            continue
    found = {}
    for row in PATCHES:
        if row.module == PROVIDERS:
            provider = (providers or {}).get(row.owner)
            if provider is not None:
                owner = next(k for k in type(provider).__mro__ if row.attribute in vars(k))
                found[(owner, row.attribute)] = vars(owner)[row.attribute]
            continue
        module = modules.get(row.module)
        if module is None:
            continue
        owner = module if row.owner == MODULE_LEVEL else getattr(module, row.owner.rstrip(SUBCLASSES), None)
        if owner is None:
            continue
        owners = [owner]
        if row.owner.endswith(SUBCLASSES):
            found[(owner, "__init_subclass__")] = vars(owner).get("__init_subclass__", _ABSENT)
            owners = [cls for cls in _subclasses(owner) if callable(vars(cls).get(row.attribute))]
        for cls in owners:
            found[(cls, row.attribute)] = vars(cls).get(row.attribute, _ABSENT)
    return found


def test_the_patch_table_names_the_loop_hooks_and_factories_that_exist():
    from otel_generate.instrumentor import GENERATION, PATCHES, _factory
    from otel_generate.integrations import generate_loop

    mixin_rows = [r for r in PATCHES if r.module == GENERATION and r.owner == "GenerationMixin" and r.when == "always"]
    assert {r.attribute: _factory(r.factory) for r in mixin_rows if r.factory.startswith("generate_loop.")} == {
        "generate": generate_loop.make_generate,
        "_prepare_generated_length": generate_loop.make_prepare_generated_length,
        "_get_stopping_criteria": generate_loop.make_get_stopping_criteria,
        "_get_candidate_generator": generate_loop.make_get_candidate_generator,
        "_prepare_cache_for_generation": generate_loop.make_prepare_cache_for_generation,
    }
    # without these three there are no step spans (a warning says so, tests/unit/test_patch_table.py)
    assert {r.attribute for r in mixin_rows if r.required} == {
        "generate",
        "_prepare_generated_length",
        "_get_stopping_criteria",
    }
    for row in PATCHES:
        factory = _factory(row.factory)
        assert callable(factory) and factory.__name__ == row.factory.rpartition(".")[2], row


def test_uninstrument_restores_every_target_of_the_patch_table(tracer_provider, meter_provider):
    from otel_generate.instrumentor import METER_PROVIDER, TRACER_PROVIDER

    providers = {TRACER_PROVIDER: tracer_provider, METER_PROVIDER: meter_provider}
    instrumentor = GenerateInstrumentor()
    assert not instrumentor.is_instrumented_by_opentelemetry
    before = _table_targets(providers)
    # every row's condition on: content capture, step log-probabilities, the background emitter
    instrumentor.instrument(
        tracer_provider=tracer_provider,
        meter_provider=meter_provider,
        capture_message_content="SPAN_ONLY",
        capture_step_logprobs=True,
        background_emission=True,
    )
    try:
        during = _table_targets(providers)
        installed = set(instrumentor._patches.installed())
    finally:
        instrumentor.uninstrument()
    after = _table_targets(providers)
    assert during.keys() == before.keys()
    changed = {key for key in before if during[key] is not before[key]}
    # every target this transformers defines was patched, and nothing outside the table
    assert changed == {key for key, value in before.items() if value is not _ABSENT or key[1] == "__init_subclass__"}
    assert installed == changed
    assert (GenerationMixin, "generate") in changed and (GenerationMixin, "__init_subclass__") in changed
    assert any(owner.__name__ == "TracerProvider" for owner, _ in changed)  # the drain hooks too
    # and after uninstrument() every one of them is the original object again
    assert {key: value for key, value in after.items() if value is not before[key]} == {}


# --- the plain step path calls StoppingCriteriaList, then appends ------------------------------------


def _recording_list(criteria, one_token_steps=True):
    import time

    from otel_generate.integrations.step_hook import RecordingCriteriaList, StepRecorder

    recorder = StepRecorder(None, time.perf_counter_ns, 0, 3, lambda *a: None, one_token_steps=one_token_steps)
    return RecordingCriteriaList(criteria, recorder)


def test_greedy_decoding_takes_the_plain_path_and_records_every_step(instrumented, gpt2, recording_lists):
    lists = recording_lists
    ids, mask = prompt(seed=3)
    output = gpt2.generate(ids, attention_mask=mask, max_new_tokens=5, eos_token_id=None)
    (criteria,) = lists
    assert criteria._plain is not None
    assert len(criteria.recorder.times_ns) == output.shape[-1] - ids.shape[-1] == 5


def test_the_plain_path_returns_what_the_list_returns_and_passes_keywords_on():
    from transformers.generation.stopping_criteria import MaxLengthCriteria

    seen = []

    class Budget(MaxLengthCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            seen.append(kwargs)
            return super().__call__(input_ids, scores, **kwargs)

    criteria = [MaxLengthCriteria(max_length=4)]
    recording = _recording_list(criteria)
    assert recording._plain is not None
    for length in (3, 4, 6):
        ids = torch.zeros((2, length), dtype=torch.long)
        expected = StoppingCriteriaList(criteria)(ids, None)
        got = recording(ids, None)
        assert got.dtype == expected.dtype == torch.bool and torch.equal(got, expected)
    assert len(recording.recorder.times_ns) == 3
    recording = _recording_list([Budget(max_length=4)])
    recording(torch.zeros((1, 4), dtype=torch.long), None, extra=1)
    assert seen == [{"extra": 1}] and len(recording.recorder.times_ns) == 1


def test_a_criterion_that_raises_raises_through_the_list_unrecorded():
    class Broken(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            raise RuntimeError("criterion broke")

    recording = _recording_list([Broken()])
    assert recording._plain is not None
    with pytest.raises(RuntimeError, match="criterion broke"):
        recording(torch.zeros((1, 4), dtype=torch.long), None)
    assert recording.recorder.times_ns == [] and recording.recorder.fault is None


def test_a_fault_on_the_plain_path_stops_the_list_and_its_copies():
    """A copy of the list (``deepcopy``) feeds the same recorder through the same step appends: a
    fault in one stops both, every later call still returns the criteria's answer, and the recorder
    keeps what it held before the fault."""
    import copy

    from transformers.generation.stopping_criteria import MaxLengthCriteria

    recording = _recording_list([MaxLengthCriteria(max_length=5)])
    twin = copy.deepcopy(recording)
    assert recording._plain is not None and twin._plain is recording._plain and twin.recorder is recording.recorder
    ids = torch.zeros((2, 4), dtype=torch.long)
    recording(ids, None)
    twin(ids, None)
    assert len(recording.recorder.times_ns) == 2

    def broken():
        raise OSError("clock went away")

    recording._plain[1] = broken
    assert recording(ids, None).tolist() == [False, False]
    assert isinstance(recording.recorder.fault, OSError)
    for listed in (recording, twin):
        assert listed(torch.zeros((2, 5), dtype=torch.long), None).tolist() == [True, True]
    assert len(recording.recorder.times_ns) == 2 and recording.recorder.step_lengths() == [4, 5]


def test_a_patch_of_the_criteria_call_is_followed_from_the_next_step(
    instrumented, span_exporter, gpt2, monkeypatch, recording_lists
):
    """A replacement of ``StoppingCriteriaList.__call__`` (another instrumentation, a user's patch)
    is called as transformers would call it, also by a list built before the patch: here one that
    stops every row at once."""

    lists = recording_lists
    ids, mask = prompt(seed=11)
    first = gpt2.generate(ids, attention_mask=mask, max_new_tokens=8, eos_token_id=None)
    assert first.shape[-1] - ids.shape[-1] == 8

    def stop_now(self, input_ids, scores, **kwargs):
        return torch.ones((input_ids.shape[0],), dtype=torch.bool, device=input_ids.device)

    monkeypatch.setattr(StoppingCriteriaList, "__call__", stop_now)
    second = gpt2.generate(ids, attention_mask=mask, max_new_tokens=8, eos_token_id=None)
    expected = uninstrumented_generate(gpt2, ids, attention_mask=mask, max_new_tokens=8, eos_token_id=None)
    assert torch.equal(second, expected) and second.shape[-1] - ids.shape[-1] == 1
    assert lists[0](torch.zeros((2, 3), dtype=torch.long), None).tolist() == [True, True]  # built before it
    outputs = [span.attributes[A.GEN_AI_USAGE_OUTPUT_TOKENS] for span in request_spans(span_exporter)]
    assert outputs == [8, 1]
