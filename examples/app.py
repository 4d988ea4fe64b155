"""The main job: generate under an application span and print per-token timing.

Run it under the OpenTelemetry auto-instrumentation (spans on the console)::

    OTEL_SERVICE_NAME=otel-generate-demo opentelemetry-instrument \
        --traces_exporter console --metrics_exporter none --logs_exporter none \
        python examples/app.py

By default it builds a small random-weight GPT-2-architecture model locally (no download);
``--model PATH`` loads a local checkpoint directory instead (``from_pretrained``, local files only).
It prints the continuation token ids, the time to first token and the time per output token
(milliseconds), as measured by the instrumentation.
"""

from __future__ import annotations

import argparse
import sys

import torch
from opentelemetry import trace

from otel_generate import TokenLatencyProfiler
from otel_generate.bench.models import ARCHITECTURES, build_model, load_model


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="local checkpoint directory (default: build a random-weight model)")
    parser.add_argument("--architecture", choices=ARCHITECTURES, default="gpt2", help="built model's architecture")
    parser.add_argument("--prompt", default="OpenTelemetry traces every decode step", help="prompt text (with --model)")
    parser.add_argument("--prompt-tokens", type=int, default=4, help="random prompt length for the built model")
    parser.add_argument("--new-tokens", type=int, default=8, help="max_new_tokens")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (default 1, so the thread count is never an implicit variable)",
    )
    args = parser.parse_args(argv)
    if args.prompt_tokens < 1 or args.new_tokens < 1:
        parser.error("--prompt-tokens and --new-tokens must be at least 1")
    if args.threads < 1:
        parser.error("--threads must be at least 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    tokenizer = None
    if args.model:
        try:
            model, tokenizer = load_model(args.model)
        except (FileNotFoundError, OSError, ValueError) as exc:
            print(f"error: cannot load --model {args.model!r}: {exc}", file=sys.stderr)
            return 2
    else:
        model = build_model(args.architecture, seed=args.seed)
    torch.manual_seed(args.seed)
    if tokenizer is not None:
        inputs = dict(tokenizer(args.prompt, return_tensors="pt"))
    if tokenizer is None or inputs["input_ids"].shape[-1] == 0:
        tokenizer = None
        ids = torch.randint(1, model.config.vocab_size - 1, (1, args.prompt_tokens))
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    inputs = {k: v.to(model.device) for k, v in inputs.items()}

    tracer = trace.get_tracer("examples.app")
    with tracer.start_as_current_span("handle_request"), TokenLatencyProfiler() as profiler:
        # tokenizer=: what content capture decodes the message text with (docs/content-capture.md)
        extra = {"tokenizer": tokenizer} if tokenizer is not None else {}
        output = model.generate(**inputs, max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=None, **extra)

    prompt_width = 0 if model.config.is_encoder_decoder else inputs["input_ids"].shape[-1]
    continuation = output[0, prompt_width:].tolist()
    record = profiler.records[-1]
    print(f"continuation tokens: {continuation}")
    if tokenizer is not None:
        print(f"continuation text: {tokenizer.decode(continuation, skip_special_tokens=True)!r}")
    print(f"time to first token: {record.time_to_first_token_s * 1e3:.3f} ms")
    tpot = record.time_per_output_token_s
    print(
        f"time per output token: {tpot * 1e3:.3f} ms" if tpot is not None else "time per output token: n/a (one token)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
