"""OTLP-encoded size of the spans one ``generate()`` call emits: the inputs of docs/scaling.md.

One greedy ``generate()`` on a tiny random-weight GPT-2 (``otel_generate.bench.models.build_model``,
CPU), instrumented with an SDK ``TracerProvider`` and an in-memory exporter, so the spans are the
ones this package emits: a request span ``text_completion {model}`` and one step span per decode
step (``prefill``, then ``decode``). Token ids are random; EOS is disabled, so exactly
``--new-tokens`` steps run. The model's ``name_or_path`` is set to ``--model-name`` because a real
model id is longer than a class name and is written twice on the request span (name and
``gen_ai.request.model``).

Sizes are those of the protobuf message an OTLP exporter sends (``ExportTraceServiceRequest``,
built by ``opentelemetry.exporter.otlp.proto.common.trace_encoder.encode_spans``, the encoder of
the SDK's OTLP/gRPC and OTLP/HTTP exporters), in bytes, uncompressed unless said:

* ``request_span_alone``, ``step_span_alone``: one span in its own export request, so with its
  resource (``service.name`` and the SDK's ``telemetry.sdk.*``) and scope: the worst case;
* ``per_step_span_in_batch``, ``per_request_span_in_batch``: what one more span adds to an export
  request that already carries others of the same resource and scope, as the batch span
  processor sends them: the figure to multiply by a span rate;
* ``whole_request``: the request span and all its step spans in one export request, and
  ``whole_request_gzip``, the same gzip-compressed (the Collector's OTLP exporter compresses with
  gzip by default; random ids and timestamps compress little).

    python benchmarks/span_sizes.py                 # JSON on stdout, a markdown table on stderr
    python benchmarks/span_sizes.py --new-tokens 512 --model-name my-org/my-model
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
from typing import Any, Dict

DEFAULT_PROMPT_TOKENS = 128
DEFAULT_NEW_TOKENS = 256
DEFAULT_MODEL_NAME = "meta-llama/Llama-3.1-8B-Instruct"
DEFAULT_SERVICE_NAME = "llm-server"


def measure(
    prompt_tokens: int = DEFAULT_PROMPT_TOKENS,
    new_tokens: int = DEFAULT_NEW_TOKENS,
    model_name: str = DEFAULT_MODEL_NAME,
    service_name: str = DEFAULT_SERVICE_NAME,
) -> Dict[str, Any]:
    """Run one instrumented ``generate()`` and return the encoded sizes (bytes) described above.

    Raises:
        ValueError: if ``prompt_tokens`` or ``new_tokens`` is below 1.
        RuntimeError: if the spans emitted are not one request span and ``new_tokens`` step spans.
    """
    if prompt_tokens < 1 or new_tokens < 1:
        raise ValueError(f"prompt_tokens and new_tokens must be >= 1, got {prompt_tokens} and {new_tokens}")
    import torch
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from otel_generate import GenerateInstrumentor
    from otel_generate import attributes as A
    from otel_generate.bench.models import VOCAB_SIZE, build_model

    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    model = build_model("gpt2", seed=0, max_positions=prompt_tokens + new_tokens)
    model.config._name_or_path = model_name
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(1, VOCAB_SIZE - 1, (1, prompt_tokens), generator=generator)

    instrumentor = GenerateInstrumentor()
    # outlier_factor: no step is flagged an outlier, so the sizes never depend on how busy the
    # machine was (a flagged step carries one more attribute, about 8 bytes)
    instrumentor.instrument(tracer_provider=provider, max_step_spans=new_tokens, outlier_factor=1e9)
    try:
        model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,
        )
    finally:
        instrumentor.uninstrument()
        provider.shutdown()

    spans = exporter.get_finished_spans()
    steps = [s for s in spans if s.name in (A.STEP_SPAN_PREFILL, A.STEP_SPAN_DECODE)]
    requests = [s for s in spans if s.attributes.get(A.GEN_AI_OPERATION_NAME) == A.OPERATION_TEXT_COMPLETION]
    if len(requests) != 1 or len(steps) != new_tokens or len(spans) != new_tokens + 1:
        raise RuntimeError(
            f"expected 1 request span and {new_tokens} step spans, got {len(requests)} and {len(steps)} of {len(spans)}"
        )

    def size(batch) -> int:
        return encode_spans(batch).ByteSize()

    whole = encode_spans(spans).SerializeToString()
    return {
        "prompt_tokens": prompt_tokens,
        "new_tokens": new_tokens,
        "model_name": model_name,
        "request_span_alone": size(requests),
        "step_span_alone": int(statistics.median(size([s]) for s in steps)),
        "per_step_span_in_batch": round((size(spans) - size(requests)) / len(steps), 1),
        "per_request_span_in_batch": size(spans) - size(steps),
        "whole_request": len(whole),
        "whole_request_gzip": len(gzip.compress(whole)),
    }


def markdown(result: Dict[str, Any]) -> str:
    """The table docs/scaling.md shows (bytes)."""
    rows = [
        ("request span, alone in an export request", result["request_span_alone"]),
        ("step span, alone in an export request (median)", result["step_span_alone"]),
        ("request span, in a batch", result["per_request_span_in_batch"]),
        ("step span, in a batch", result["per_step_span_in_batch"]),
        (f"whole request ({result['new_tokens']} step spans), one export request", result["whole_request"]),
        ("the same, gzip", result["whole_request_gzip"]),
    ]
    lines = ["| OTLP-encoded | bytes |", "|---|---:|"]
    lines += [f"| {label} | {value:,.0f} |" for label, value in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=DEFAULT_PROMPT_TOKENS)
    parser.add_argument("--new-tokens", type=int, default=DEFAULT_NEW_TOKENS)
    parser.add_argument("--model-name", default=DEFAULT_MODEL_NAME)
    args = parser.parse_args(argv)
    result = measure(args.prompt_tokens, args.new_tokens, args.model_name)
    json.dump(result, sys.stdout, indent=2)
    print(file=sys.stdout)
    print(markdown(result), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
