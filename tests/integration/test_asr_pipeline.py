"""``pipeline("automatic-speech-recognition", ...)`` on Whisper: one request span per ``generate()``
call the pipeline makes, nested under the current span, and (content capture on) the transcribed
text in ``gen_ai.output.messages``.

Everything is built offline: the random-weight Whisper of :func:`tiny_models.whisper`, a default
``WhisperFeatureExtractor()`` and a Whisper tokenizer read from a ``vocab.json`` and an empty
``merges.txt`` written here (:func:`write_whisper_vocabulary`). The vocabulary has Whisper's
multilingual id layout, so every id the model can emit has a token: regular id ``i`` (below 50257)
is the token ``"Ġw{i}"``, which decodes to ``" w{i}"``; 50257..50363 are the special tokens
(``<|endoftext|>``, ``<|startoftranscript|>``, 99 language slots, ..., ``<|notimestamps|>``) and
50364..51864 the timestamps ``<|0.00|>``..``<|30.00|>``. Expected texts are computed from token ids
with that rule (:func:`text_of`), not with the tokenizer.

How many ``generate()`` calls a pipeline call makes (and so how many request spans):

* a clip of at most 30 s: one;
* a longer clip without ``chunk_length_s``: one (Whisper's own sequential long-form transcription
  runs its 30-second windows inside that call; each window is an ``inner_generate`` span of the
  one request span);
* ``chunk_length_s=30``: the pipeline cuts the audio into 30 s chunks overlapping by
  ``chunk_length_s / 6`` = 5 s on each side (a new chunk every 20 s) and runs ``forward``, hence
  ``model.generate()``, once per batch of ``batch_size`` chunks: one request span per batch, as for
  the text pipelines (a 50 s clip is 2 chunks: 2 spans at ``batch_size=1``, 1 span of batch size 2
  at ``batch_size=2``).
"""

from __future__ import annotations

import contextlib
import json
import math

import numpy as np
import pytest
import torch
import transformers
from opentelemetry.instrumentation.utils import suppress_instrumentation
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.generation.utils import GenerationMixin

from otel_generate import GenerateInstrumentor, content
from otel_generate import attributes as A
from tests.helpers import request_spans, step_spans, tiny_models

EOS, SOT, NO_TIMESTAMPS = tiny_models.WHISPER_EOS, tiny_models.WHISPER_SOT, tiny_models.WHISPER_NO_TIMESTAMPS
SAMPLING_RATE = 16000
MAX_NEW_TOKENS = 8
REQUEST_NAME = "text_completion WhisperForConditionalGeneration"
#: Whisper's special tokens from <|endoftext|> (50257) to <|notimestamps|> (50363), in id order.
SPECIAL_TOKENS = (
    ["<|endoftext|>", "<|startoftranscript|>"]
    + [f"<|lang{i}|>" for i in range(99)]
    + ["<|translate|>", "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nocaptions|>", "<|notimestamps|>"]
)
TIMESTAMPS = 1501  # <|0.00|> .. <|30.00|>, every 0.02 s
VOCAB_SIZE = 51865  # tiny_models.whisper()'s, Whisper's multilingual one


def timestamp(seconds):
    """The id of the timestamp token ``<|seconds|>``."""
    return NO_TIMESTAMPS + 1 + round(seconds / 0.02)


def write_whisper_vocabulary(directory):
    """``vocab.json`` with Whisper's multilingual id layout (see the module docstring) and a
    ``merges.txt`` without merges: the smallest files a Whisper tokenizer loads from."""
    vocab = {f"\u0120w{i}": i for i in range(EOS)}  # "\u0120" is the byte-level space
    vocab.update({token: EOS + i for i, token in enumerate(SPECIAL_TOKENS)})
    vocab.update({"<|%.2f|>" % (i * 0.02): NO_TIMESTAMPS + 1 + i for i in range(TIMESTAMPS)})
    assert (vocab["<|startoftranscript|>"], vocab["<|notimestamps|>"], vocab["<|0.00|>"]) == (SOT, NO_TIMESTAMPS, 50364)
    assert len(vocab) == len(set(vocab.values())) == VOCAB_SIZE
    (directory / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    (directory / "merges.txt").write_text("#version: 0.2\n", encoding="utf-8")
    return directory


def whisper_tokenizer(directory, class_name="WhisperTokenizer"):
    """A Whisper tokenizer from the files of :func:`write_whisper_vocabulary`, with 50257..50363 marked
    special (``decode(skip_special_tokens=True)`` and the pipeline's ``_decode_asr`` skip them;
    timestamps are the ids after the last special one) and ``<|endoftext|>`` as padding, as in
    OpenAI's checkpoints (the pipeline needs a pad token to batch)."""
    tokenizer = getattr(transformers, class_name).from_pretrained(str(directory))
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS, "pad_token": "<|endoftext|>"})
    assert tokenizer.all_special_ids[-1] == NO_TIMESTAMPS and tokenizer.pad_token_id == EOS
    return tokenizer


def text_of(ids):
    """What Whisper's decoding gives for ``ids`` under this vocabulary: regular ids only, each " w{id}"."""
    return "".join(f" w{int(i)}" for i in ids if int(i) < EOS)


class ForcedTranscript(LogitsProcessor):
    """Makes every decoding loop emit ``script`` (then EOS): the token at each position is the
    script's, whatever the random weights say. The position is the number of tokens after the last
    ``<|startoftranscript|>`` outside the special range (the decoder prompt is SOT and special tokens)."""

    def __init__(self, script):
        self.script = list(script) + [EOS]

    def __call__(self, input_ids, scores):
        forced = torch.full_like(scores, -math.inf)
        for row, ids in enumerate(input_ids.tolist()):
            start = len(ids) - ids[::-1].index(SOT)
            position = sum(1 for t in ids[start:] if not EOS <= t <= NO_TIMESTAMPS)
            forced[row, self.script[min(position, len(self.script) - 1)]] = 0.0
        return forced


def audio(seconds, seed=0):
    """Random audio at 16 kHz, float32, as a (samples,) numpy array."""
    return (np.random.default_rng(seed).standard_normal(int(seconds * SAMPLING_RATE)) * 0.1).astype(np.float32)


@pytest.fixture(scope="module")
def vocabulary(tmp_path_factory):
    return write_whisper_vocabulary(tmp_path_factory.mktemp("whisper_tokenizer"))


@pytest.fixture(scope="module")
def tokenizer(vocabulary):
    return whisper_tokenizer(vocabulary)


@pytest.fixture(scope="module")
def whisper():
    return tiny_models.whisper()


@pytest.fixture(autouse=True)
def no_content_env(monkeypatch):
    monkeypatch.delenv(content.ENV_CAPTURE_MESSAGE_CONTENT, raising=False)


@pytest.fixture
def instrument(tracer_provider, meter_provider):
    """``instrument(**options)`` with the in-memory providers; uninstrumented in teardown."""
    instrumentor = GenerateInstrumentor()

    def start(**options):
        instrumentor.instrument(tracer_provider=tracer_provider, meter_provider=meter_provider, **options)

    yield start
    instrumentor.uninstrument()


def asr(model, tokenizer):
    return transformers.pipeline(
        "automatic-speech-recognition",
        model=model,
        tokenizer=tokenizer,
        feature_extractor=transformers.WhisperFeatureExtractor(),
    )


@contextlib.contextmanager
def recording_generate(model):
    """Record, per ``model.generate()`` call the pipeline makes, the id tensor it returned (the
    pipeline calls ``self.model.generate``; this instance attribute goes through the class's, hooked or
    not, and is removed afterwards)."""
    returned = []

    def generate(*args, **kwargs):
        out = type(model).generate(model, *args, **kwargs)
        returned.append((out if torch.is_tensor(out) else out["sequences"]).clone())
        return out

    model.generate = generate
    try:
        yield returned
    finally:
        del model.generate


def new_tokens(row, width):
    """Tokens a decoding loop generated in ``row`` after its ``width``-token decoder prompt: up to and
    including the first EOS (padding after it is not generated)."""
    new = [int(t) for t in row[width:]]
    return new.index(EOS) + 1 if EOS in new else len(new)


@contextlib.contextmanager
def counting_inner_loops():
    """Tokens generated by each base ``GenerationMixin.generate`` (one per Whisper window and attempt),
    read from its own output; run only with instrumentation suppressed."""
    counts = []
    original = GenerationMixin.__dict__["generate"]

    def counting(self, *args, **kwargs):
        width = kwargs["decoder_input_ids"].shape[-1]
        out = original(self, *args, **kwargs)
        sequences = out if torch.is_tensor(out) else out.sequences
        counts.append(sum(new_tokens(row, width) for row in sequences.tolist()))
        return out

    GenerationMixin.generate = counting
    try:
        yield counts
    finally:
        GenerationMixin.generate = original


def reference(pipe, clip, **kwargs):
    """The pipeline's output with instrumentation suppressed, the ids each of its generate() calls
    returned, and the tokens each inner decoding loop generated."""
    with suppress_instrumentation(), counting_inner_loops() as counts, recording_generate(pipe.model) as returned:
        out = pipe(clip.copy(), **kwargs)
    return out, returned, counts


def transcribe(pipe, tracer_provider, clip, **kwargs):
    """The pipeline's output under an application span, with the ids each generate() call returned."""
    with recording_generate(pipe.model) as returned:
        with tracer_provider.get_tracer("app").start_as_current_span("transcribe") as app:
            out = pipe(clip.copy(), **kwargs)
    return out, returned, app


def output_texts(span):
    return [
        part["content"]
        for message in json.loads(span.attributes[A.GEN_AI_OUTPUT_MESSAGES])
        for part in message["parts"]
    ]


def check_requests(span_exporter, app, calls, generated=None):
    """``calls`` request spans, each a child of ``app``, in call order, with their inner spans and steps
    inside them; with ``generated`` (tokens per inner loop, in order, over all calls), output tokens
    that add up to it."""
    requests = sorted(request_spans(span_exporter), key=lambda s: s.start_time)
    assert len(requests) == calls, [s.name for s in span_exporter.get_finished_spans()]
    for request in requests:
        assert request.name == REQUEST_NAME
        assert request.parent is not None and request.parent.span_id == app.get_span_context().span_id
        assert request.context.trace_id == app.get_span_context().trace_id
        assert request.attributes[A.GEN_AI_USAGE_OUTPUT_TOKENS] > 0
        assert request.attributes[A.GEN_AI_REQUEST_MODEL] == "WhisperForConditionalGeneration"
        inner = [
            s
            for s in span_exporter.get_finished_spans()
            if s.name == A.SPAN_INNER_GENERATE and s.parent.span_id == request.context.span_id
        ]
        parents = {request.context.span_id} | {s.context.span_id for s in inner}
        steps = [s for s in step_spans(span_exporter) if s.parent.span_id in parents]
        assert len(steps) == request.attributes[A.GENERATE_STEPS] > 0
        assert sum(s.name == A.STEP_SPAN_PREFILL for s in steps) == max(len(inner), 1)  # one per decoding loop
    if generated is not None:
        assert sum(r.attributes[A.GEN_AI_USAGE_OUTPUT_TOKENS] for r in requests) == sum(generated)
    return requests


# --- spans ---------------------------------------------------------------------------------------


def test_short_clip_is_one_request_span_under_the_current_span(
    instrumented, span_exporter, tracer_provider, whisper, tokenizer
):
    pipe = asr(whisper, tokenizer)
    clip = audio(2.0)
    kwargs = dict(generate_kwargs={"max_new_tokens": MAX_NEW_TOKENS})
    expected, expected_ids, generated = reference(pipe, clip, **kwargs)
    assert len(expected_ids) == 1 and sum(generated) > 0

    out, returned, app = transcribe(pipe, tracer_provider, clip, **kwargs)
    assert out == expected  # instrumentation changes nothing the pipeline returns
    assert len(returned) == 1 and torch.equal(returned[0], expected_ids[0])
    assert out["text"] == text_of(returned[0][0])  # the tokenizer files give the pipeline this text
    assert len(tokenizer) == whisper.config.vocab_size
    (request,) = check_requests(span_exporter, app, calls=1, generated=generated)
    assert request.attributes[A.GENERATE_BATCH_SIZE] == 1
    assert not set(request.attributes) & {A.GEN_AI_INPUT_MESSAGES, A.GEN_AI_OUTPUT_MESSAGES}  # content is opt-in


@pytest.mark.parametrize("batch_size", [1, 2])
def test_chunked_long_clip_is_one_request_span_per_pipeline_batch(
    instrumented, span_exporter, tracer_provider, whisper, tokenizer, batch_size
):
    """50 s with ``chunk_length_s=30``: chunks start every 30 - 2 * 5 = 20 s, the one at 20 s reaches
    the end, so 2 chunks, and one generate() call (one request span) per batch of them."""
    pipe = asr(whisper, tokenizer)
    clip = audio(50.0, seed=1)
    chunks = 2
    kwargs = dict(chunk_length_s=30, batch_size=batch_size, generate_kwargs={"max_new_tokens": MAX_NEW_TOKENS})
    expected, expected_ids, generated = reference(pipe, clip, **kwargs)
    batches = math.ceil(chunks / batch_size)
    assert len(expected_ids) == batches and sum(int(ids.shape[0]) for ids in expected_ids) == chunks

    out, returned, app = transcribe(pipe, tracer_provider, clip, **kwargs)
    assert out == expected
    assert len(returned) == batches and all(torch.equal(a, b) for a, b in zip(returned, expected_ids))
    requests = check_requests(span_exporter, app, calls=batches, generated=generated)
    assert [r.attributes[A.GENERATE_BATCH_SIZE] for r in requests] == [int(ids.shape[0]) for ids in returned]


def test_long_form_with_timestamps_is_one_request_span(
    instrumented, span_exporter, tracer_provider, whisper, tokenizer
):
    """50 s with ``return_timestamps=True`` and no ``chunk_length_s``: the pipeline hands all the
    features to one generate() call, and Whisper decodes its 30-second windows inside it."""
    pipe = asr(whisper, tokenizer)
    clip = audio(50.0, seed=2)
    kwargs = dict(return_timestamps=True, generate_kwargs={"max_new_tokens": MAX_NEW_TOKENS})
    expected, expected_ids, generated = reference(pipe, clip, **kwargs)
    assert len(expected_ids) == 1 and len(generated) > 1  # one call, several windows

    out, returned, app = transcribe(pipe, tracer_provider, clip, **kwargs)
    assert out == expected and out["chunks"]
    assert len(returned) == 1 and torch.equal(returned[0], expected_ids[0])
    (request,) = check_requests(span_exporter, app, calls=1, generated=generated)
    inner = [s for s in span_exporter.get_finished_spans() if s.name == A.SPAN_INNER_GENERATE]
    assert len(inner) == len(generated)
    assert all(s.parent.span_id == request.context.span_id for s in inner)


# --- content capture -----------------------------------------------------------------------------


#: One window's transcript (then EOS): a segment from <|0.00|> to <|30.00|>, then text after it.
DROPPED_TAIL = [timestamp(0.0), 100, 101, timestamp(30.0), timestamp(30.0), 102, 103]

CONTENT_CASES = {
    "short": (2.0, dict()),
    "short-timestamps": (2.0, dict(return_timestamps=True)),
    # one window whose last timestamp pair is <|30.00|>, the window's end: Whisper keeps the segment
    # before it and drops the text after it (it would start the next window, but the clip has ended).
    # The text is what the call returned, not all that its one decoding loop generated.
    "short-timestamps-dropped-tail": (2.0, dict(return_timestamps=True, generate_kwargs={"script": DROPPED_TAIL})),
    # transformers 5 adds return_segments=True: generate() returns a plain dict
    "short-timestamps-language": (2.0, dict(return_timestamps=True, return_language=True)),
    "long-form-timestamps": (50.0, dict(return_timestamps=True)),
    "chunked": (50.0, dict(chunk_length_s=30, batch_size=2)),
}


#: (case, how content capture is turned on, tokenizer class); on transformers 5 WhisperTokenizerFast
#: is another name of WhisperTokenizer, on 4.x they are the Python and the tokenizers-backed classes.
CONTENT_RUNS = [(case, "keyword", "WhisperTokenizer") for case in CONTENT_CASES] + [
    ("short", "env", "WhisperTokenizerFast"),
    ("long-form-timestamps", "env", "WhisperTokenizerFast"),
]


@pytest.mark.parametrize("case,how,tokenizer_class", CONTENT_RUNS, ids=["-".join(run) for run in CONTENT_RUNS])
def test_content_capture_puts_the_transcription_in_output_messages(
    instrument, span_exporter, tracer_provider, whisper, vocabulary, monkeypatch, case, how, tokenizer_class
):
    """``capture_message_content="SPAN_ONLY"`` (or the environment variable): each request span's
    ``gen_ai.output.messages`` holds the text of what its generate() call returned, which for a
    single call is the pipeline's own text."""
    if how == "env":
        monkeypatch.setenv(content.ENV_CAPTURE_MESSAGE_CONTENT, "SPAN_ONLY")
        instrument()
    else:
        instrument(capture_message_content="SPAN_ONLY")
    seconds, kwargs = CONTENT_CASES[case]
    kwargs = dict(kwargs, generate_kwargs=dict(kwargs.get("generate_kwargs", {"max_new_tokens": MAX_NEW_TOKENS})))
    script = kwargs["generate_kwargs"].pop("script", None)
    if script is not None:
        kwargs["generate_kwargs"]["logits_processor"] = LogitsProcessorList([ForcedTranscript(script)])
    pipe = asr(whisper, whisper_tokenizer(vocabulary, tokenizer_class))
    clip = audio(seconds, seed=25)
    expected, _, _ = reference(pipe, clip, **kwargs)

    out, returned, app = transcribe(pipe, tracer_provider, clip, **kwargs)
    assert out == expected
    requests = check_requests(span_exporter, app, calls=len(returned))
    if script is not None:  # one decoding loop generated the script and EOS; the call returned the first segment
        assert out["text"] == " w100 w101"
        assert [r.attributes[A.GEN_AI_USAGE_OUTPUT_TOKENS] for r in requests] == [len(script) + 1]
        assert not [s for s in span_exporter.get_finished_spans() if s.name == A.SPAN_INNER_GENERATE]
    for request, ids in zip(requests, returned):
        # one assistant message per row of what that generate() call returned, with its text
        messages = json.loads(request.attributes[A.GEN_AI_OUTPUT_MESSAGES])
        assert [m["role"] for m in messages] == ["assistant"] * int(ids.shape[0])
        assert all(m["finish_reason"] in ("stop", "length") for m in messages)
        assert output_texts(request) == [text_of(row) for row in ids]
        assert A.GEN_AI_INPUT_MESSAGES not in request.attributes  # audio features are not a text prompt
    # one generate() call of one row: its text is the pipeline's
    if len(returned) == 1 and int(returned[0].shape[0]) == 1:
        (request,) = requests
        assert [text.strip() for text in output_texts(request)] == [out["text"].strip()]
        assert out["text"].strip()
    else:  # chunks: the pipeline merges the chunks' texts over their overlaps
        words = {word for request in requests for text in output_texts(request) for word in text.split()}
        assert out["text"].split() and set(out["text"].split()) <= words
