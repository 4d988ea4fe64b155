"""What tests of every layer share: reading spans back (:func:`request_spans`, :func:`step_spans`,
:func:`console_spans`), the contract tables of docs/contract.md, prompts and the uninstrumented
``generate()``, and a character-level tokenizer.

Importing this package imports neither ``transformers`` nor ``torch``: the functions that need them
import them when called. The subprocess scripts and backends the tests drive live beside it:
tiny_models.py (random-weight models), otlp_receiver.py, local_stack.py, scale_worker.py and
tp_worker.py."""

from __future__ import annotations

import json

from otel_generate import attributes as A

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


def contract_table(heading):
    """``{attribute: type}`` of the table under ``heading`` (e.g. ``"## Request span"``) in docs/contract.md."""
    import pathlib
    import re

    text = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "contract.md").read_text()
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
    import torch

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


def serve_command_environment():
    """``{variable: value}`` that docs/serving.md's ``transformers serve`` command (the one of its
    "With the ``openai`` client" section) sets before ``opentelemetry-instrument``."""
    import pathlib
    import re
    import shlex

    text = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "serving.md").read_text()
    (block,) = [b for b in re.findall(r"^```bash\n(.*?)^```$", text, re.M | re.S) if "transformers serve /tmp/" in b]
    command = block[block.index("OTEL_") :].replace("\\\n", " ")
    words = shlex.split(command[: command.index("opentelemetry-instrument")])
    return dict(word.split("=", 1) for word in words)
