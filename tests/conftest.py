"""Shared fixtures: an in-memory span exporter and metric reader, the instrumentor set up and torn down,
and tiny random-weight models (no network)."""

from __future__ import annotations

import json

import pytest
import torch
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from otel_generate import GenerateInstrumentor
from otel_generate import attributes as A
from otel_generate.bench.models import build_model


@pytest.fixture
def span_exporter():
    return InMemorySpanExporter()


@pytest.fixture
def tracer_provider(span_exporter):
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(span_exporter))
    return provider


@pytest.fixture
def metric_reader():
    return InMemoryMetricReader()


@pytest.fixture
def meter_provider(metric_reader):
    return MeterProvider(metric_readers=[metric_reader])


@pytest.fixture
def instrumented(tracer_provider, meter_provider):
    """Instrument in setup, uninstrument in teardown (also when the test failed)."""
    instrumentor = GenerateInstrumentor()
    instrumentor.instrument(tracer_provider=tracer_provider, meter_provider=meter_provider)
    yield instrumentor
    instrumentor.uninstrument()


@pytest.fixture
def instrument():
    """``instrument(**options)`` with any options, returning the instrumentor; uninstrumented at teardown."""
    instrumentor = GenerateInstrumentor()

    def start(**options):
        instrumentor.instrument(**options)
        return instrumentor

    yield start
    if instrumentor.is_instrumented_by_opentelemetry:
        instrumentor.uninstrument()


@pytest.fixture
def count_recorders(monkeypatch):
    """Count StepRecorder constructions ("init") and step hook calls ("call")."""
    calls = {"init": 0, "call": 0}
    from otel_generate.integrations import step_hook as _recorder

    init, call = _recorder.StepRecorder.__init__, _recorder.StepRecorder.__call__

    def counting_init(self, *a, **k):
        calls["init"] += 1
        init(self, *a, **k)

    def counting_call(self, *a, **k):
        calls["call"] += 1
        return call(self, *a, **k)

    monkeypatch.setattr(_recorder.StepRecorder, "__init__", counting_init)
    monkeypatch.setattr(_recorder.StepRecorder, "__call__", counting_call)
    return calls


@pytest.fixture(scope="session")
def gpt2():
    return build_model("gpt2", seed=0)


@pytest.fixture(scope="session")
def llama():
    return build_model("llama", seed=0)


@pytest.fixture(scope="session")
def t5():
    return build_model("t5", seed=0)


#: Characters of :func:`char_tokenizer`, ids 1..len(CHARS); 0 is padding and 127 EOS, as in the built models.
CHARS = "abcdefghijklmnopqrstuvwxyz .,!?"


def char_tokenizer():
    """A character-level ``PreTrainedTokenizerFast`` over the built models' 128 ids, built locally.

    ``"a"`` is id 1 ... ``"?"`` id 31, ``<pad>`` 0, ``</s>`` 127 (the built models' PAD and EOS);
    the other ids are ``<xN>`` placeholders. Decoding joins the characters with no separator.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, **{c: i for i, c in enumerate(CHARS, start=1)}}
    vocab.update({f"<x{i}>": i for i in range(len(vocab), 127)})
    vocab["</s>"] = 127
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<x100>"))
    backend.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", unk_token="<x100>")


@pytest.fixture(scope="session")
def tokenizer():
    return char_tokenizer()


def contract_table(heading):
    """``{attribute: type}`` of the table under ``heading`` (e.g. ``"## Request span"``) in docs/contract.md."""
    import pathlib
    import re

    text = (pathlib.Path(__file__).resolve().parent.parent / "docs" / "contract.md").read_text()
    section = text.split("\n" + heading + "\n", 1)[1].split("\n## ", 1)[0]
    table = {}
    for line in section.splitlines():
        match = re.match(r"^\|\s*`([^`]+)`\s*\|\s*([^|]+?)\s*\|", line)
        if match:
            table[match.group(1)] = match.group(2)
    return table


def request_spans(exporter):
    return [s for s in exporter.get_finished_spans() if s.name.startswith(A.OPERATION_TEXT_COMPLETION + " ")]


def only_request(exporter):
    spans = request_spans(exporter)
    assert len(spans) == 1, [s.name for s in exporter.get_finished_spans()]
    return spans[0]


def step_spans(exporter, request=None):
    steps = [s for s in exporter.get_finished_spans() if s.name in (A.STEP_SPAN_PREFILL, A.STEP_SPAN_DECODE)]
    if request is not None:
        steps = [s for s in steps if s.parent is not None and s.parent.span_id == request.context.span_id]
    return sorted(steps, key=lambda s: s.attributes[A.GENERATE_STEP_INDEX])


def prompt(batch=1, length=4, seed=0, low=1, high=126):
    """Random prompt ids avoiding PAD (0) and EOS (127) of the built models."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(low, high, (batch, length), generator=generator)
    return ids, torch.ones_like(ids)


def uninstrumented_generate(model, *args, **kwargs):
    """The model's own ``generate()`` with instrumentation suppressed: every hook of this package
    calls straight through (nested calls included: an assistant's, a Whisper window's)."""
    from opentelemetry.instrumentation.utils import suppress_instrumentation

    with suppress_instrumentation():
        return type(model).generate(model, *args, **kwargs)


def console_spans(text):
    """Every span object the SDK's ConsoleSpanExporter printed in ``text``, in order (other output is skipped)."""
    decoder, spans, index = json.JSONDecoder(), [], 0
    while (start := text.find("{", index)) >= 0:
        try:
            obj, index = decoder.raw_decode(text, start)
        except json.JSONDecodeError:
            index = start + 1
            continue
        if isinstance(obj, dict) and "context" in obj and "name" in obj:
            spans.append(obj)
    return spans
