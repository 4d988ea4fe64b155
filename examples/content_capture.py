"""Content capture, runnable: the prompt and completion text on the request span.

    python examples/content_capture.py

Nothing is downloaded: it writes a tiny random-weight Llama and a character-level tokenizer
(``examples/serve_demo.py``) to a temporary directory and loads both. It instruments with
``capture_message_content="SPAN_ONLY"`` and an in-memory span exporter, then:

1. calls ``generate(..., tokenizer=tokenizer)``: the request span carries
   ``gen_ai.input.messages`` and ``gen_ai.output.messages`` (JSON strings), printed below next to
   the text the returned tokens decode to;
2. calls ``generate(...)`` without ``tokenizer=``: no text can be captured (token ids are not
   text), and the logger ``otel_generate`` says so once, as a warning on stderr.

In your application: set ``OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=SPAN_ONLY`` (or pass
``capture_message_content=``) and pass the tokenizer you already have to ``generate()``; a
``pipeline`` call needs nothing more. docs/content-capture.md has the modes and what is captured.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import sys
import tempfile
from pathlib import Path

import torch
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from transformers import AutoModelForCausalLM, AutoTokenizer

from otel_generate import GenerateInstrumentor

INPUT_MESSAGES = "gen_ai.input.messages"
OUTPUT_MESSAGES = "gen_ai.output.messages"


def _serve_demo():
    spec = importlib.util.spec_from_file_location("serve_demo", Path(__file__).with_name("serve_demo.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def request_span(exporter: InMemorySpanExporter):
    """The one request span (``text_completion {model}``) among the finished spans (steps too)."""
    (span,) = [s for s in exporter.get_finished_spans() if s.name.startswith("text_completion ")]
    return span


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", default="Hello, traces!")
    parser.add_argument("--new-tokens", type=int, default=8)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    GenerateInstrumentor().instrument(tracer_provider=provider, capture_message_content="SPAN_ONLY")

    with tempfile.TemporaryDirectory() as folder:
        _serve_demo().build_model_dir(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).eval()
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    encoded = tokenizer(args.prompt, return_tensors="pt")
    inputs = {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}
    prompt_length = inputs["input_ids"].shape[-1]

    # 1. with the tokenizer: the text is captured
    output = model.generate(
        **inputs, max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=None, tokenizer=tokenizer
    )
    completion = tokenizer.decode(output[0, prompt_length:], skip_special_tokens=True)
    provider.force_flush()  # the spans are built on a background thread: wait for them
    span = request_span(exporter)
    print(f"request span: {span.name}")
    print(f"{INPUT_MESSAGES}: {span.attributes[INPUT_MESSAGES]}")
    print(f"{OUTPUT_MESSAGES}: {span.attributes[OUTPUT_MESSAGES]}")
    print(f"completion decoded from the returned tokens: {json.dumps(completion)}")

    # 2. without it: nothing captured, one warning from the logger otel_generate
    exporter.clear()
    model.generate(**inputs, max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=None)
    provider.force_flush()
    span = request_span(exporter)
    captured = sorted(set(span.attributes) & {INPUT_MESSAGES, OUTPUT_MESSAGES})
    print(f"without tokenizer=: captured attributes {captured}")
    GenerateInstrumentor().uninstrument()
    provider.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
