"""Opt-in content capture: prompt and completion text on the request span
and in the ``gen_ai.client.inference.operation.details`` event, step token ids and log-probabilities
on the step spans, and pipelines carrying the same request span.

Expected texts are built here from the output tensors with :func:`chars_of` (the character-level
tokenizer's vocabulary read directly), not with the code under test."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch
import transformers
import wrapt
from opentelemetry.instrumentation.utils import unwrap
from opentelemetry.sdk._logs import LoggerProvider
from opentelemetry.sdk._logs.export import SimpleLogRecordProcessor
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.generation.utils import GenerationMixin

import otel_generate
from otel_generate import GenerateInstrumentor, content
from otel_generate import attributes as A
from otel_generate.bench.models import EOS_TOKEN_ID, PAD_TOKEN_ID, build_model
from tests.helpers import CHARS, char_tokenizer, prompt, request_spans, step_spans, uninstrumented_generate

try:
    from opentelemetry.sdk._logs.export import InMemoryLogRecordExporter as _InMemoryLogExporter
except ImportError:  # opentelemetry-sdk < 1.39
    from opentelemetry.sdk._logs.export import InMemoryLogExporter as _InMemoryLogExporter

ENV_VARS = (content.ENV_CAPTURE_MESSAGE_CONTENT, content.ENV_CAPTURE_STEP_TOKEN_IDS, content.ENV_CAPTURE_STEP_LOGPROBS)
MESSAGES = (A.GEN_AI_INPUT_MESSAGES, A.GEN_AI_OUTPUT_MESSAGES)
STEP_CONTENT = (A.GENERATE_STEP_TOKEN_IDS, A.GENERATE_STEP_LOGPROBS)


#: The package's own source folder: a hook's code lives below it (a substring test on
#: "otel_generate" also matched transformers' own files in a venv inside a clone of that name).
PACKAGE_DIR = os.path.dirname(os.path.abspath(otel_generate.__file__)) + os.sep


def hooked(owner, name):
    """Whether ``owner.name`` is one of this package's hooks (its code, or under a compiler shell)."""
    function = owner.__dict__[name]
    for _ in range(3):
        code = getattr(function, "__code__", None)
        if code is not None and os.path.abspath(code.co_filename).startswith(PACKAGE_DIR):
            return True
        function = getattr(function, "__wrapped__", None)
        if function is None:
            return False
    return False


FINISH_REASONS = {"stop", "length", "content_filter", "tool_call", "error"}  # gen-ai-output-messages.json


@pytest.fixture(autouse=True)
def no_content_env(monkeypatch):
    for name in ENV_VARS:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def log_exporter():
    return _InMemoryLogExporter()


@pytest.fixture
def logger_provider(log_exporter):
    provider = LoggerProvider()
    provider.add_log_record_processor(SimpleLogRecordProcessor(log_exporter))
    return provider


@pytest.fixture
def instrument(tracer_provider, meter_provider, logger_provider):
    """``instrument(**options)`` with the in-memory providers; uninstrumented in teardown."""
    instrumentor = GenerateInstrumentor()

    def start(**options):
        instrumentor.instrument(
            tracer_provider=tracer_provider, meter_provider=meter_provider, logger_provider=logger_provider, **options
        )
        return instrumentor

    yield start
    instrumentor.uninstrument()


def events(log_exporter):
    """The exported log records (the record itself, whatever the SDK wraps it in)."""
    return [getattr(item, "log_record", item) for item in log_exporter.get_finished_logs()]


def plain(value):
    """A structured log attribute (tuples, the SDK's read-only mappings) as lists and dicts."""
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if hasattr(value, "items"):
        return {k: plain(v) for k, v in value.items()}
    return value


def chars_of(ids):
    """Text of token ids under the char tokenizer, skipping PAD and EOS (what
    decode(skip_special_tokens=True) must give)."""
    out = []
    for token in ids:
        token = int(token)
        if token in (PAD_TOKEN_ID, EOS_TOKEN_ID):
            continue
        out.append(CHARS[token - 1] if 1 <= token <= len(CHARS) else f"<x{token}>")
    return "".join(out)


def continuation(row, prompt_length):
    """The real continuation of a returned row: up to and including its first EOS."""
    new = [int(t) for t in row[prompt_length:]]
    return new[: new.index(EOS_TOKEN_ID) + 1] if EOS_TOKEN_ID in new else new


def check_input_shape(messages):
    """gen-ai-input-messages.json (semantic conventions v1.41): ChatMessage with role and TextPart parts."""
    assert isinstance(messages, list) and messages
    for message in messages:
        assert set(message) == {"role", "parts"} and message["role"] == "user"
        for part in message["parts"]:
            assert set(part) == {"type", "content"} and part["type"] == "text" and isinstance(part["content"], str)


def check_output_shape(messages):
    """gen-ai-output-messages.json: OutputMessage with role, parts and a finish_reason."""
    assert isinstance(messages, list) and messages
    for message in messages:
        assert set(message) == {"role", "parts", "finish_reason"} and message["role"] == "assistant"
        assert message["finish_reason"] in FINISH_REASONS
        for part in message["parts"]:
            assert set(part) == {"type", "content"} and part["type"] == "text" and isinstance(part["content"], str)


def texts(messages):
    return [part["content"] for message in messages for part in message["parts"]]


def span_messages(span):
    """(input, output) messages parsed from the span's JSON strings (``None`` where absent)."""
    return tuple(json.loads(span.attributes[name]) if name in span.attributes else None for name in MESSAGES)


def assert_no_content_anywhere(span_exporter, log_exporter):
    for span in span_exporter.get_finished_spans():
        assert not set(span.attributes) & set(MESSAGES + STEP_CONTENT), span.name
    for record in events(log_exporter):
        assert not set(record.attributes or {}) & set(MESSAGES)


def text_pipeline(model, tokenizer=None, task="text-generation"):
    return transformers.pipeline(task, model=model, tokenizer=tokenizer or char_tokenizer())


def encode(text):
    ids = torch.tensor([[CHARS.index(c) + 1 for c in text]])
    return ids, torch.ones_like(ids)


# --- off by default -------------------------------------------------------------------------------


def test_unset_captures_nothing_anywhere(instrument, span_exporter, log_exporter, gpt2):
    instrument()
    out = text_pipeline(gpt2)("abcd", max_new_tokens=4, do_sample=False)
    ids, mask = encode("abcd")
    gpt2.generate(ids, attention_mask=mask, max_new_tokens=4, tokenizer=char_tokenizer())
    assert out[0]["generated_text"].startswith("abcd")
    assert len(request_spans(span_exporter)) == 2
    assert_no_content_anywhere(span_exporter, log_exporter)
    assert events(log_exporter) == []  # no event either: it is part of the opt-in
    # nothing of content capture is installed: the pipeline and the logits processors are untouched
    from transformers.pipelines.base import Pipeline

    assert not hooked(Pipeline, "forward")
    assert not hooked(GenerationMixin, "_get_logits_processor")


def test_capture_off_runs_no_content_code_per_step(instrument, span_exporter, gpt2, count_recorders, monkeypatch):
    """With content off, the only per-step call is the step hook's, as before; with log-probabilities
    on, one processor call per step is added and nothing else."""
    from otel_generate.integrations import generate_content

    calls = {"processor": 0, "fill": 0}
    processor_call, fill = generate_content.StepLogprobs.__call__, generate_content.fill_request

    def counting_processor(self, *a, **k):
        calls["processor"] += 1
        return processor_call(self, *a, **k)

    def counting_fill(*a, **k):
        calls["fill"] += 1
        return fill(*a, **k)

    monkeypatch.setattr(generate_content.StepLogprobs, "__call__", counting_processor)
    monkeypatch.setattr(generate_content, "fill_request", counting_fill)
    ids, mask = prompt(seed=40)
    instrumentor = instrument()
    gpt2.generate(ids, attention_mask=mask, max_new_tokens=6, eos_token_id=None, tokenizer=char_tokenizer())
    assert count_recorders["call"] == 6
    assert calls == {"processor": 0, "fill": 0}

    instrumentor.uninstrument()
    instrument(capture_step_logprobs=True, capture_message_content=True)
    gpt2.generate(ids, attention_mask=mask, max_new_tokens=6, eos_token_id=None, tokenizer=char_tokenizer())
    assert count_recorders["call"] == 12  # the step hook is the same
    assert calls == {"processor": 6, "fill": 1}


# --- modes ----------------------------------------------------------------------------------------


def test_span_only_pipeline_puts_prompt_and_completion_on_the_request_span(
    instrument, span_exporter, log_exporter, gpt2, monkeypatch
):
    monkeypatch.setenv(content.ENV_CAPTURE_MESSAGE_CONTENT, "SPAN_ONLY")
    instrument()
    ids, mask = encode("abcd")
    expected = uninstrumented_generate(gpt2, ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    expected_text = chars_of(continuation(expected[0], 4))

    result = text_pipeline(gpt2)("abcd", max_new_tokens=6, do_sample=False)

    (request,) = request_spans(span_exporter)
    inputs, outputs = span_messages(request)
    check_input_shape(inputs)
    check_output_shape(outputs)
    assert texts(inputs) == ["abcd"]
    assert texts(outputs) == [expected_text]
    assert result[0]["generated_text"] == "abcd" + expected_text  # the pipeline's own text agrees
    assert [m["finish_reason"] for m in outputs] == list(request.attributes[A.GEN_AI_RESPONSE_FINISH_REASONS])
    assert events(log_exporter) == []
    # the JSON strings are compact (no whitespace between tokens) and keep the text verbatim
    assert request.attributes[A.GEN_AI_INPUT_MESSAGES] == '[{"role":"user","parts":[{"type":"text","content":"abcd"}]}]'


def test_event_only_emits_the_details_event_and_nothing_on_the_span(
    instrument, span_exporter, log_exporter, gpt2, monkeypatch
):
    monkeypatch.setenv(content.ENV_CAPTURE_MESSAGE_CONTENT, "event_only")
    instrument()
    text_pipeline(gpt2)("abcd", max_new_tokens=5, do_sample=False)
    (request,) = request_spans(span_exporter)
    assert not set(request.attributes) & set(MESSAGES)
    (event,) = events(log_exporter)
    assert event.event_name == A.EVENT_INFERENCE_OPERATION_DETAILS
    # in the request span's context, at its end
    assert (event.trace_id, event.span_id) == (request.context.trace_id, request.context.span_id)
    assert event.timestamp == request.end_time
    attrs = event.attributes
    for name in (
        A.GEN_AI_OPERATION_NAME,
        A.GEN_AI_PROVIDER_NAME,
        A.GEN_AI_REQUEST_MODEL,
        A.GEN_AI_USAGE_INPUT_TOKENS,
        A.GEN_AI_USAGE_OUTPUT_TOKENS,
        A.GEN_AI_REQUEST_MAX_TOKENS,
    ):
        assert attrs[name] == request.attributes[name], name
    assert tuple(attrs[A.GEN_AI_RESPONSE_FINISH_REASONS]) == request.attributes[A.GEN_AI_RESPONSE_FINISH_REASONS]
    inputs, outputs = plain(attrs[A.GEN_AI_INPUT_MESSAGES]), plain(attrs[A.GEN_AI_OUTPUT_MESSAGES])
    check_input_shape(inputs)
    check_output_shape(outputs)
    assert texts(inputs) == ["abcd"]
    steps = step_spans(span_exporter, request)
    assert len(steps) == request.attributes[A.GENERATE_STEPS] > 0
    # no step content unless asked for
    assert not any(set(step.attributes) & set(STEP_CONTENT) for step in steps)


def test_span_and_event_carry_the_same_messages(instrument, span_exporter, log_exporter, gpt2, monkeypatch):
    monkeypatch.setenv(content.ENV_CAPTURE_MESSAGE_CONTENT, "Span_And_Event")
    instrument()
    ids, mask = encode("abcd")
    out = gpt2.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, tokenizer=char_tokenizer())
    (request,) = request_spans(span_exporter)
    (event,) = events(log_exporter)
    inputs, outputs = span_messages(request)
    assert inputs == plain(event.attributes[A.GEN_AI_INPUT_MESSAGES])
    assert outputs == plain(event.attributes[A.GEN_AI_OUTPUT_MESSAGES])
    assert texts(outputs) == [chars_of(continuation(out[0], 4))]


def test_unsampled_request_still_emits_its_event(meter_provider, logger_provider, log_exporter, gpt2, monkeypatch):
    """Events are independent of trace sampling (the conventions: "independently from traces");
    an unsampled request gets no span content and no per-step work."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF

    from otel_generate.integrations import generate_content

    monkeypatch.setenv(content.ENV_CAPTURE_MESSAGE_CONTENT, "SPAN_AND_EVENT")
    processor_calls = []
    monkeypatch.setattr(generate_content.StepLogprobs, "__call__", lambda self, i, s: processor_calls.append(1) or s)
    instrumentor = GenerateInstrumentor()
    instrumentor.instrument(
        tracer_provider=TracerProvider(sampler=ALWAYS_OFF),
        meter_provider=meter_provider,
        logger_provider=logger_provider,
        capture_step_logprobs=True,
    )
    try:
        ids, mask = encode("abc")
        out = gpt2.generate(ids, attention_mask=mask, max_new_tokens=3, tokenizer=char_tokenizer())
    finally:
        instrumentor.uninstrument()
    (event,) = events(log_exporter)
    assert texts(plain(event.attributes[A.GEN_AI_INPUT_MESSAGES])) == ["abc"]
    assert texts(plain(event.attributes[A.GEN_AI_OUTPUT_MESSAGES])) == [chars_of(continuation(out[0], 3))]
    assert processor_calls == []


@pytest.mark.parametrize(
    "value, on_span",
    [("true", True), (" TRUE ", True), ("false", False), ("False", False), ("NO_CONTENT", False), ("", False)],
)
def test_true_and_false(instrument, span_exporter, log_exporter, gpt2, monkeypatch, value, on_span):
    """``true`` is SPAN_ONLY, ``false`` and the empty string NO_CONTENT; neither emits an event."""
    monkeypatch.setenv(content.ENV_CAPTURE_MESSAGE_CONTENT, value)
    instrument()
    ids, mask = encode("abc")
    gpt2.generate(ids, attention_mask=mask, max_new_tokens=3, tokenizer=char_tokenizer())
    (request,) = request_spans(span_exporter)
    assert (A.GEN_AI_INPUT_MESSAGES in request.attributes) is on_span
    assert (A.GEN_AI_OUTPUT_MESSAGES in request.attributes) is on_span
    assert events(log_exporter) == []


def test_unparsable_value_warns_once_and_captures_nothing(
    instrument, span_exporter, log_exporter, gpt2, monkeypatch, caplog
):
    monkeypatch.setenv(content.ENV_CAPTURE_MESSAGE_CONTENT, "span-only-please")
    ids, mask = encode("abc")
    with caplog.at_level(logging.WARNING, logger="otel_generate"):
        instrumentor = instrument()
        gpt2.generate(ids, attention_mask=mask, max_new_tokens=3, tokenizer=char_tokenizer())
        instrumentor.uninstrument()
        instrument()  # read again: still one warning
        gpt2.generate(ids, attention_mask=mask, max_new_tokens=3, tokenizer=char_tokenizer())
    warnings = [r for r in caplog.records if content.ENV_CAPTURE_MESSAGE_CONTENT in r.getMessage()]
    assert len(warnings) == 1
    assert "span-only-please" in warnings[0].getMessage() and "SPAN_ONLY" in warnings[0].getMessage()
    assert len(request_spans(span_exporter)) == 2
    assert_no_content_anywhere(span_exporter, log_exporter)
    assert events(log_exporter) == []


def test_keyword_wins_over_the_environment_and_is_validated(
    instrument, span_exporter, gpt2, monkeypatch, tracer_provider
):
    monkeypatch.setenv(content.ENV_CAPTURE_MESSAGE_CONTENT, "SPAN_ONLY")
    ids, mask = encode("abc")
    instrumentor = instrument(capture_message_content=False)
    gpt2.generate(ids, attention_mask=mask, max_new_tokens=2, tokenizer=char_tokenizer())
    instrumentor.uninstrument()
    monkeypatch.setenv(content.ENV_CAPTURE_MESSAGE_CONTENT, "false")
    instrument(capture_message_content="span_only")
    gpt2.generate(ids, attention_mask=mask, max_new_tokens=2, tokenizer=char_tokenizer())
    off, on = sorted(request_spans(span_exporter), key=lambda s: s.start_time)
    assert not set(off.attributes) & set(MESSAGES)
    assert texts(span_messages(on)[0]) == ["abc"]

    fresh = GenerateInstrumentor()
    fresh.uninstrument()
    with pytest.raises(ValueError, match="SPAN_AND_EVENT.*'spans'"):
        fresh.instrument(tracer_provider=tracer_provider, capture_message_content="spans")
    with pytest.raises(TypeError, match="capture_message_content"):
        fresh.instrument(tracer_provider=tracer_provider, capture_message_content=1)
    with pytest.raises(TypeError, match="capture_step_logprobs must be a bool"):
        fresh.instrument(tracer_provider=tracer_provider, capture_step_logprobs="yes")
    with pytest.raises(TypeError, match="logger_provider"):
        fresh.instrument(tracer_provider=tracer_provider, logger_provider=object())
    with pytest.raises(TypeError, match="capture_content"):  # unknown keywords still raise
        fresh.instrument(tracer_provider=tracer_provider, capture_content=True)
    assert not fresh.is_instrumented_by_opentelemetry


# --- where the text comes from --------------------------------------------------------------------


def test_generate_with_tokenizer_is_captured_and_without_one_nothing_is(
    instrument, span_exporter, log_exporter, gpt2, monkeypatch
):
    monkeypatch.setenv(content.ENV_CAPTURE_MESSAGE_CONTENT, "SPAN_AND_EVENT")
    instrument()
    ids, mask = encode("hello")
    with_tokenizer = gpt2.generate(ids, attention_mask=mask, max_new_tokens=4, tokenizer=char_tokenizer())
    gpt2.generate(ids, attention_mask=mask, max_new_tokens=4)  # no tokenizer: no text
    first, second = sorted(request_spans(span_exporter), key=lambda s: s.start_time)
    inputs, outputs = span_messages(first)
    assert texts(inputs) == ["hello"]
    assert texts(outputs) == [chars_of(continuation(with_tokenizer[0], 5))]
    assert not set(second.attributes) & set(MESSAGES)
    # the event is still emitted for the second request (operation details), without messages
    by_span = {e.span_id: e for e in events(log_exporter)}
    assert set(by_span) == {first.context.span_id, second.context.span_id}
    assert not set(by_span[second.context.span_id].attributes) & set(MESSAGES)
    assert by_span[second.context.span_id].attributes[A.GEN_AI_USAGE_INPUT_TOKENS] == 5


def test_capture_on_without_a_tokenizer_warns_once(instrument, span_exporter, gpt2, monkeypatch, caplog):
    from otel_generate.integrations import generate_content

    monkeypatch.setattr(generate_content, "_no_tokenizer_warned", False)
    monkeypatch.setenv(content.ENV_CAPTURE_MESSAGE_CONTENT, "SPAN_ONLY")
    instrument()
    ids, mask = encode("hello")
    with caplog.at_level(logging.WARNING, logger="otel_generate"):
        gpt2.generate(ids, attention_mask=mask, max_new_tokens=3)  # no tokenizer
        gpt2.generate(ids, attention_mask=mask, max_new_tokens=3)  # again: no second warning
        with_tokenizer = gpt2.generate(ids, attention_mask=mask, max_new_tokens=3, tokenizer=char_tokenizer())
    warnings = [r for r in caplog.records if "no tokenizer=" in r.getMessage()]
    assert len(warnings) == 1
    assert warnings[0].levelno == logging.WARNING
    assert "SPAN_ONLY" in warnings[0].getMessage() and "tokenizer=tokenizer" in warnings[0].getMessage()
    # the warned-about requests carry no text; the one with a tokenizer does
    spans = sorted(request_spans(span_exporter), key=lambda s: s.start_time)
    assert [bool(set(s.attributes) & set(MESSAGES)) for s in spans] == [False, False, True]
    assert texts(span_messages(spans[2])[1]) == [chars_of(continuation(with_tokenizer[0], 5))]


def test_capture_off_without_a_tokenizer_does_not_warn(instrument, gpt2, monkeypatch, caplog):
    from otel_generate.integrations import generate_content

    monkeypatch.setattr(generate_content, "_no_tokenizer_warned", False)
    instrument()
    ids, mask = encode("hello")
    with caplog.at_level(logging.WARNING, logger="otel_generate"):
        gpt2.generate(ids, attention_mask=mask, max_new_tokens=3)
    assert not [r for r in caplog.records if "no tokenizer=" in r.getMessage()]


def test_batch_of_two_prompts_has_no_padding_text(instrument, span_exporter, gpt2, monkeypatch):
    monkeypatch.setenv(content.ENV_CAPTURE_MESSAGE_CONTENT, "SPAN_ONLY")
    instrument()
    tokenizer = char_tokenizer()
    tokenizer.padding_side = "left"
    batch = tokenizer(["abcd", "ab"], padding=True, return_tensors="pt")
    assert batch["input_ids"][1, :2].tolist() == [PAD_TOKEN_ID, PAD_TOKEN_ID]
    out = gpt2.generate(**batch, max_new_tokens=5, do_sample=False, tokenizer=tokenizer)
    # the attention mask decides what is padding, even where the masked ids are ordinary characters
    ids, mask = encode("zzab")
    mask[0, :2] = 0
    gpt2.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False, tokenizer=tokenizer)
    # without a mask, the pad id is padding (as transformers infers the mask), here an ordinary character
    z = CHARS.index("z") + 1
    padded = torch.tensor([[1, 2, 3, 4], [z, z, 1, 2]])
    gpt2.generate(padded, max_new_tokens=2, do_sample=False, pad_token_id=z, tokenizer=tokenizer)
    batched, masked, unmasked = sorted(request_spans(span_exporter), key=lambda s: s.start_time)
    inputs, outputs = span_messages(batched)
    assert texts(inputs) == ["abcd", "ab"]
    assert texts(outputs) == [chars_of(continuation(row, 4)) for row in out]
    assert len(outputs) == 2
    assert texts(span_messages(masked)[0]) == ["ab"]
    assert texts(span_messages(unmasked)[0]) == ["abcd", "ab"]


def test_pipeline_batch_is_one_request_with_two_messages(instrument, span_exporter, gpt2, monkeypatch):
    monkeypatch.setenv(content.ENV_CAPTURE_MESSAGE_CONTENT, "SPAN_ONLY")
    instrument()
    results = text_pipeline(gpt2)(["abcd", "ab"], max_new_tokens=4, do_sample=False, batch_size=2)
    (request,) = request_spans(span_exporter)
    inputs, outputs = span_messages(request)
    assert texts(inputs) == ["abcd", "ab"]
    assert texts(outputs) == [results[0][0]["generated_text"][4:], results[1][0]["generated_text"][2:]]


def test_pipeline_over_a_generator_is_captured_while_iterating(instrument, span_exporter, gpt2, monkeypatch):
    """A generator input makes the pipeline lazy: generate() runs after __call__ returned."""
    monkeypatch.setenv(content.ENV_CAPTURE_MESSAGE_CONTENT, "SPAN_ONLY")
    instrument()
    lazy = text_pipeline(gpt2)((p for p in ["abc", "cab"]), max_new_tokens=3, do_sample=False)
    results = list(lazy)
    spans = sorted(request_spans(span_exporter), key=lambda s: s.start_time)
    assert [texts(span_messages(s)[0]) for s in spans] == [["abc"], ["cab"]]
    assert [texts(span_messages(s)[1]) for s in spans] == [[r[0]["generated_text"][3:]] for r in results]


def test_num_return_sequences_gives_one_output_message_each(instrument, span_exporter, gpt2, monkeypatch):
    monkeypatch.setenv(content.ENV_CAPTURE_MESSAGE_CONTENT, "SPAN_ONLY")
    instrument()
    torch.manual_seed(3)
    results = text_pipeline(gpt2)("abcd", max_new_tokens=6, do_sample=True, num_return_sequences=2)
    ids, mask = encode("abcd")
    torch.manual_seed(4)
    out = gpt2.generate(
        ids, attention_mask=mask, max_new_tokens=6, do_sample=True, num_return_sequences=2, tokenizer=char_tokenizer()
    )
    piped, direct = sorted(request_spans(span_exporter), key=lambda s: s.start_time)
    inputs, outputs = span_messages(piped)
    assert texts(inputs) == ["abcd"]
    check_output_shape(outputs)
    assert texts(outputs) == [r["generated_text"][4:] for r in results] and len(outputs) == 2
    inputs, outputs = span_messages(direct)
    assert texts(outputs) == [chars_of(continuation(row, 4)) for row in out]
    assert [m["finish_reason"] for m in outputs] == list(direct.attributes[A.GEN_AI_RESPONSE_FINISH_REASONS])


def test_stopped_rows_have_stop_and_full_rows_length(instrument, span_exporter, gpt2, monkeypatch):
    """Row 0 ends on EOS at its third token; row 1 runs out of budget. The pad id is an ordinary
    character here ("z", never generated otherwise), so text after a row's end would show."""
    monkeypatch.setenv(content.ENV_CAPTURE_MESSAGE_CONTENT, "SPAN_ONLY")
    instrument()
    z = CHARS.index("z") + 1

    class EosForRow0(LogitsProcessor):
        def __call__(self, input_ids, scores):
            scores = scores.clone()
            scores[:, [EOS_TOKEN_ID, z]] = -float("inf")
            if input_ids.shape[-1] - 3 == 2:
                scores[0, :] = -float("inf")
                scores[0, EOS_TOKEN_ID] = 0.0
            return scores

    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    out = gpt2.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=5,
        do_sample=False,
        pad_token_id=z,
        logits_processor=LogitsProcessorList([EosForRow0()]),
        tokenizer=char_tokenizer(),
    )
    assert out[0, 5].item() == EOS_TOKEN_ID and out[0, 6:].tolist() == [z, z]  # padding after the end
    (request,) = request_spans(span_exporter)
    outputs = span_messages(request)[1]
    assert [m["finish_reason"] for m in outputs] == ["stop", "length"]
    assert texts(outputs) == [chars_of(out[0, 3:5]), chars_of(out[1, 3:])]
    assert len(texts(outputs)[0]) == 2 and "z" not in texts(outputs)[0]


def test_failed_request_keeps_its_prompt(instrument, span_exporter, gpt2, monkeypatch):
    monkeypatch.setenv(content.ENV_CAPTURE_MESSAGE_CONTENT, "SPAN_ONLY")
    instrument()

    class Boom(LogitsProcessor):
        def __call__(self, input_ids, scores):
            raise RuntimeError("boom")

    ids, mask = encode("abc")
    with pytest.raises(RuntimeError, match="boom"):
        gpt2.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=3,
            logits_processor=LogitsProcessorList([Boom()]),
            tokenizer=char_tokenizer(),
        )
    (request,) = request_spans(span_exporter)
    inputs, outputs = span_messages(request)
    assert texts(inputs) == ["abc"] and outputs is None


def test_a_failing_tokenizer_is_logged_once_and_generation_goes_on(
    instrument, span_exporter, gpt2, monkeypatch, caplog
):
    from otel_generate import _faults

    monkeypatch.setenv(content.ENV_CAPTURE_MESSAGE_CONTENT, "SPAN_ONLY")
    monkeypatch.setattr(_faults, "_logged_kinds", set())
    instrument()
    tokenizer = char_tokenizer()

    def broken_decode(*args, **kwargs):
        raise RuntimeError("decode broke")

    tokenizer.decode = broken_decode
    ids, mask = prompt(seed=41)
    expected = uninstrumented_generate(gpt2, ids, attention_mask=mask, max_new_tokens=3, eos_token_id=None)
    with caplog.at_level(logging.WARNING, logger="otel_generate"):
        for _ in range(2):
            out = gpt2.generate(ids, attention_mask=mask, max_new_tokens=3, eos_token_id=None, tokenizer=tokenizer)
            assert torch.equal(out, expected)
    assert len([r for r in caplog.records if "content capture" in r.getMessage()]) == 1
    spans = request_spans(span_exporter)
    assert len(spans) == 2
    for span in spans:
        assert not set(span.attributes) & set(MESSAGES)
        assert span.attributes[A.GEN_AI_USAGE_OUTPUT_TOKENS] == 3
        assert A.GENERATE_STEPS_INCOMPLETE not in span.attributes


# --- step token ids and log-probabilities ---------------------------------------------------------


def expected_logprobs(out, prompt_length):
    """log_softmax of each step's processed scores, at the token each returned row got at that step."""
    return [
        torch.log_softmax(scores.float(), dim=-1)
        .gather(-1, out.sequences[:, prompt_length + i, None])
        .squeeze(-1)
        .tolist()
        for i, scores in enumerate(out.scores)
    ]


@pytest.mark.parametrize("sampling", [False, True], ids=["greedy", "sample"])
def test_step_token_ids_and_logprobs(instrument, span_exporter, gpt2, sampling, monkeypatch):
    import weakref

    from otel_generate.integrations import generate_content

    made = []
    init = generate_content.StepLogprobs.__init__

    def remembering_init(self):
        init(self)
        made.append(weakref.ref(self))

    monkeypatch.setattr(generate_content.StepLogprobs, "__init__", remembering_init)
    instrument(capture_step_logprobs=True)
    ids, mask = prompt(batch=2, length=4, seed=42)
    torch.manual_seed(5)
    extra = (
        dict(do_sample=True, top_k=7, temperature=0.7, num_return_sequences=2) if sampling else dict(do_sample=False)
    )
    out = gpt2.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=6,
        eos_token_id=None,
        output_scores=True,
        return_dict_in_generate=True,
        **extra,
    )
    (request,) = request_spans(span_exporter)
    steps = step_spans(span_exporter, request)
    assert len(steps) == 6 == len(out.scores)
    rows = out.sequences.shape[0]
    assert rows == (4 if sampling else 2)
    logprobs = expected_logprobs(out, 4)
    for i, step in enumerate(steps):
        assert list(step.attributes[A.GENERATE_STEP_TOKEN_IDS]) == out.sequences[:, 4 + i].tolist()
        assert list(step.attributes[A.GENERATE_STEP_LOGPROBS]) == pytest.approx(logprobs[i], abs=1e-5)
        assert all(v <= 0.0 for v in step.attributes[A.GENERATE_STEP_LOGPROBS])
    # no message content came with it
    assert not set(request.attributes) & set(MESSAGES)
    # one processor for the request, gone with generate() (it held a scores tensor): no cycle keeps it
    assert len(made) == 1 and made[0]() is None


class EndRow0At(LogitsProcessor):
    """Row 0 gets EOS as its ``at``-th new token (0-based); EOS nowhere else."""

    def __init__(self, prompt_length, at):
        self.prompt_length, self.at = prompt_length, at

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        scores[:, EOS_TOKEN_ID] = -float("inf")
        if input_ids.shape[-1] - self.prompt_length == self.at:
            scores[0, :] = -float("inf")
            scores[0, EOS_TOKEN_ID] = 0.0
        return scores


def test_step_logprobs_of_rows_stopped_early_and_encoder_decoder(instrument, span_exporter, t5):
    """T5 (decoder start token first), row 0 ending on EOS at its second token: every step's ids
    are the tensor's, the finished row's padding included, with that padding's log-probability."""
    instrument(capture_step_logprobs=True)
    ids, mask = prompt(batch=2, length=5, seed=43)
    out = t5.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=5,
        do_sample=False,
        output_scores=True,
        return_dict_in_generate=True,
        logits_processor=LogitsProcessorList([EndRow0At(1, 1)]),
    )
    assert out.sequences[0, 2].item() == EOS_TOKEN_ID and out.sequences[0, 3:].tolist() == [PAD_TOKEN_ID] * 3
    (request,) = request_spans(span_exporter)
    steps = step_spans(span_exporter, request)
    assert len(steps) == len(out.scores) == 5
    logprobs = expected_logprobs(out, 1)
    assert logprobs[1][0] == 0.0  # the forced EOS had probability 1
    for i, step in enumerate(steps):
        assert list(step.attributes[A.GENERATE_STEP_TOKEN_IDS]) == out.sequences[:, 1 + i].tolist()
        assert list(step.attributes[A.GENERATE_STEP_LOGPROBS]) == pytest.approx(logprobs[i], abs=1e-5)


def test_token_ids_only_and_strategies_without_logprobs(instrument, span_exporter, gpt2, monkeypatch):
    monkeypatch.setenv(content.ENV_CAPTURE_STEP_TOKEN_IDS, "true")
    instrumentor = instrument()
    ids, mask = prompt(seed=44)
    out = gpt2.generate(ids, attention_mask=mask, max_new_tokens=4, eos_token_id=None)
    (request,) = request_spans(span_exporter)
    for i, step in enumerate(step_spans(span_exporter, request)):
        assert list(step.attributes[A.GENERATE_STEP_TOKEN_IDS]) == out[:, 4 + i].tolist()
        assert A.GENERATE_STEP_LOGPROBS not in step.attributes
    assert not hooked(GenerationMixin, "_get_logits_processor")
    instrumentor.uninstrument()
    span_exporter.clear()

    # beam search: ids of the returned beams, no log-probabilities (beams are re-ranked after scoring)
    instrument(capture_step_logprobs=True)
    beams = gpt2.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=4,
        eos_token_id=None,
        num_beams=3,
        num_return_sequences=2,
        do_sample=False,
    )
    (request,) = request_spans(span_exporter)
    steps = step_spans(span_exporter, request)
    assert len(steps) == 4
    for i, step in enumerate(steps):
        assert list(step.attributes[A.GENERATE_STEP_TOKEN_IDS]) == beams[:, 4 + i].tolist()
        assert A.GENERATE_STEP_LOGPROBS not in step.attributes


def test_step_content_is_off_by_default_and_respects_the_span_cap(instrument, span_exporter, gpt2, monkeypatch):
    ids, mask = prompt(seed=45)
    instrumentor = instrument()
    gpt2.generate(ids, attention_mask=mask, max_new_tokens=3, eos_token_id=None)
    assert not any(set(s.attributes) & set(STEP_CONTENT) for s in span_exporter.get_finished_spans())
    instrumentor.uninstrument()
    span_exporter.clear()
    monkeypatch.setenv(content.ENV_CAPTURE_STEP_LOGPROBS, "true")
    instrument(max_step_spans=2)
    out = gpt2.generate(ids, attention_mask=mask, max_new_tokens=5, eos_token_id=None)
    (request,) = request_spans(span_exporter)
    steps = step_spans(span_exporter, request)
    assert [list(s.attributes[A.GENERATE_STEP_TOKEN_IDS]) for s in steps] == [out[:, 4].tolist(), out[:, 5].tolist()]
    assert all(len(s.attributes[A.GENERATE_STEP_LOGPROBS]) == 1 for s in steps)


def test_uninstrument_removes_the_content_wrappers(instrument, gpt2):
    from transformers.pipelines.base import Pipeline

    instrumentor = instrument(capture_message_content=True, capture_step_logprobs=True)
    assert hooked(Pipeline, "forward")
    assert hooked(GenerationMixin, "_get_logits_processor")
    instrumentor.uninstrument()
    assert not hooked(Pipeline, "forward")
    assert not hooked(GenerationMixin, "_get_logits_processor")


def test_pipelines_are_patched_when_imported_not_imported_by_instrument():
    """instrument() does not import transformers.pipelines (about a second); the wrapper is
    installed when the application imports it, and uninstrument() before that leaves it alone."""
    import subprocess
    import sys

    script = """
import os, sys
os.environ["OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"] = "SPAN_ONLY"
import otel_generate
from otel_generate import GenerateInstrumentor
PACKAGE_DIR = os.path.dirname(os.path.abspath(otel_generate.__file__)) + os.sep
def ours(function):
    return os.path.abspath(function.__code__.co_filename).startswith(PACKAGE_DIR)
GenerateInstrumentor().instrument()
assert "transformers.pipelines.base" not in sys.modules
GenerateInstrumentor().uninstrument()
GenerateInstrumentor().instrument()
from transformers import pipeline  # noqa: F401  (the import that installs the wrapper)
from transformers.pipelines.base import Pipeline
print(ours(Pipeline.__dict__["forward"]))
GenerateInstrumentor().uninstrument()
print(ours(Pipeline.__dict__["forward"]))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "False"]


# --- pipelines under another instrumentation's span -----------------------------------------------

HAS_TEXT2TEXT = hasattr(transformers, "Text2TextGenerationPipeline")  # removed in transformers 5


class ForeignPipelineInstrumentation:
    """What OpenLLMetry's transformers instrumentation does: a wrapt wrapper on the pipeline class's
    ``__call__`` that starts a span around the whole call."""

    def __init__(self, tracer_provider, cls_name):
        self.tracer = tracer_provider.get_tracer("foreign.transformers")
        self.cls_name = cls_name
        self.span_name = f"transformers_{cls_name}.call"

    def __enter__(self):
        def wrapper(wrapped, instance, args, kwargs):
            with self.tracer.start_as_current_span(self.span_name):
                return wrapped(*args, **kwargs)

        wrapt.wrap_function_wrapper("transformers", f"{self.cls_name}.__call__", wrapper)
        return self

    def __exit__(self, *exc):
        unwrap(getattr(transformers, self.cls_name), "__call__")


PIPELINE_CASES = [
    pytest.param("text-generation", "gpt2", "TextGenerationPipeline", id="text-generation-gpt2"),
    pytest.param("text-generation", "llama", "TextGenerationPipeline", id="text-generation-llama"),
    pytest.param(
        "text2text-generation",
        "t5",
        "Text2TextGenerationPipeline",
        id="text2text-generation-t5",
        marks=pytest.mark.skipif(not HAS_TEXT2TEXT, reason="transformers 5 removed this pipeline task"),
    ),
    pytest.param(
        "summarization",
        "t5",
        "SummarizationPipeline",
        id="summarization-t5",
        marks=pytest.mark.skipif(not HAS_TEXT2TEXT, reason="transformers 5 removed this pipeline task"),
    ),
]


@pytest.mark.parametrize("capture", [None, "SPAN_ONLY"], ids=["content-off", "content-on"])
@pytest.mark.parametrize("task, architecture, cls_name", PIPELINE_CASES)
def test_pipeline_request_nests_under_a_foreign_pipeline_span(
    instrument, span_exporter, tracer_provider, monkeypatch, request, task, architecture, cls_name, capture
):
    if capture:
        monkeypatch.setenv(content.ENV_CAPTURE_MESSAGE_CONTENT, capture)
    model = request.getfixturevalue(architecture)
    instrument()
    pipe = text_pipeline(model, task=task)
    with ForeignPipelineInstrumentation(tracer_provider, cls_name) as foreign:
        result = pipe("abcd", max_new_tokens=4, do_sample=False)
    spans = span_exporter.get_finished_spans()
    (outer,) = [s for s in spans if s.name == foreign.span_name]
    (completion,) = request_spans(span_exporter)  # exactly one request span
    assert completion.parent is not None and completion.parent.span_id == outer.context.span_id
    assert completion.context.trace_id == outer.context.trace_id
    steps = step_spans(span_exporter, completion)
    # nothing else: the foreign span, the request span and its steps
    assert len(spans) == 2 + len(steps)
    assert len(steps) == completion.attributes[A.GENERATE_STEPS]
    assert completion.attributes[A.GEN_AI_USAGE_INPUT_TOKENS] == 4
    if capture:
        inputs, outputs = span_messages(completion)
        assert texts(inputs) == ["abcd"]
        generated = list(result[0].values())[0]
        assert texts(outputs) == [generated[4:] if task == "text-generation" else generated]
    else:
        assert not set(completion.attributes) & set(MESSAGES)


def test_llama_pipeline_with_a_chat_template_and_bounded_length(instrument, span_exporter, monkeypatch):
    """A tokenizer with a model_max_length and a chat template: a chat input is templated by the
    pipeline; the captured prompt is the templated text the model saw (special tokens skipped)."""
    monkeypatch.setenv(content.ENV_CAPTURE_MESSAGE_CONTENT, "SPAN_ONLY")
    instrument()
    tokenizer = char_tokenizer()
    tokenizer.model_max_length = 64
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}.{% endfor %}"
    llama = build_model("llama", seed=1)
    result = transformers.pipeline("text-generation", model=llama, tokenizer=tokenizer)(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}, {"role": "user", "content": "ok"}],
        max_new_tokens=3,
        do_sample=False,
    )
    (request,) = request_spans(span_exporter)
    inputs, outputs = span_messages(request)
    assert texts(inputs) == ["hi.yo.ok."]
    assert texts(outputs) == [result[0]["generated_text"][-1]["content"]]


def test_content_capture_example_runs_and_captures_with_its_tokenizer():
    """examples/content_capture.py: the captured messages hold the prompt and the completion the
    returned tokens decode to; without tokenizer= nothing is captured and one warning says why."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    example = Path(__file__).resolve().parents[2] / "examples" / "content_capture.py"
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    done = subprocess.run(
        [sys.executable, str(example), "--prompt", "abc def", "--new-tokens", "6"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = dict(line.split(": ", 1) for line in done.stdout.splitlines() if ": " in line)
    (user,) = json.loads(lines[A.GEN_AI_INPUT_MESSAGES])
    (assistant,) = json.loads(lines[A.GEN_AI_OUTPUT_MESSAGES])
    assert user["parts"] == [{"type": "text", "content": "abc def"}]
    completion = json.loads(lines["completion decoded from the returned tokens"])
    assert assistant["parts"] == [{"type": "text", "content": completion}]
    assert assistant["finish_reason"] == "length"
    assert lines["without tokenizer="] == "captured attributes []"
    assert done.stderr.count("no tokenizer=") == 1
