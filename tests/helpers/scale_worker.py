"""One sending process of tests/e2e/test_collector_e2e.py's scale-tier test (not a test module).

Instruments a tiny random-weight GPT-2 with this package, exports spans over OTLP/gRPC to
``--endpoint`` (the agent of ``collector/local.sh up --scale``) and runs one request per
``--request INDEX:KIND``, each under its own application span ``handle_request`` (a new trace):

* ``normal``: plain greedy generate();
* ``error``: a stopping criterion raises at the third step, so generate() fails;
* ``slow_first_token``: a logits processor sleeps ``--first-token-sleep`` s in the first step;
* ``slow_decode``: it sleeps ``--decode-sleep`` s in the third step;
* ``slow_request``: the application span sleeps ``--request-sleep`` s before generate().

A second span processor keeps every span in memory: after the last request the worker prints
one JSON document with, per request, its index, kind, trace id and output token count, and every
span it produced (ids, parent, name, scope, start/end in ns, status), so the test can work out
independently which traces the gateways' tail sampling must keep.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

from otel_generate import GenerateInstrumentor
from otel_generate.bench.models import build_model

PROMPT_TOKENS = 5
NEW_TOKENS = 6


class SleepAtStep(LogitsProcessor):
    def __init__(self, step: int, seconds: float) -> None:
        self.step, self.seconds, self.calls = step, seconds, 0

    def __call__(self, input_ids, scores):
        if self.calls == self.step:
            time.sleep(self.seconds)
        self.calls += 1
        return scores


class FailAtStep(StoppingCriteria):
    def __init__(self, step: int) -> None:
        self.step, self.calls = step, 0

    def __call__(self, input_ids, scores, **kwargs):
        self.calls += 1
        if self.calls == self.step:
            raise RuntimeError("injected failure (scale-tier test)")
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--service", required=True)
    parser.add_argument("--request", action="append", default=[], help="INDEX:KIND")
    parser.add_argument("--first-token-sleep", type=float, default=1.5)
    parser.add_argument("--decode-sleep", type=float, default=0.5)
    parser.add_argument("--request-sleep", type=float, default=21.0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": args.service}))
    provider.add_span_processor(
        BatchSpanProcessor(OTLPSpanExporter(endpoint=args.endpoint, insecure=True), schedule_delay_millis=200)
    )
    provider.add_span_processor(SimpleSpanProcessor(memory))
    GenerateInstrumentor().instrument(tracer_provider=provider)
    tracer = provider.get_tracer("tests.scale_worker")
    model = build_model("gpt2", seed=0)
    generator = torch.Generator().manual_seed(1)

    requests = []
    for item in args.request:
        index, kind = item.split(":")
        ids = torch.randint(1, model.config.vocab_size - 1, (1, PROMPT_TOKENS), generator=generator)
        kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False)
        kwargs["eos_token_id"] = None
        if kind == "error":
            kwargs["stopping_criteria"] = StoppingCriteriaList([FailAtStep(3)])
        elif kind == "slow_first_token":
            kwargs["logits_processor"] = LogitsProcessorList([SleepAtStep(0, args.first_token_sleep)])
        elif kind == "slow_decode":
            kwargs["logits_processor"] = LogitsProcessorList([SleepAtStep(2, args.decode_sleep)])
        elif kind not in ("normal", "slow_request"):
            parser.error(f"unknown kind {kind!r}")
        output_tokens = None
        with tracer.start_as_current_span("handle_request") as span:
            if kind == "slow_request":
                time.sleep(args.request_sleep)
            try:
                output = model.generate(**kwargs)
                output_tokens = output.shape[-1] - PROMPT_TOKENS
            except RuntimeError:
                if kind != "error":
                    raise
        requests.append(
            {
                "index": int(index),
                "kind": kind,
                "trace_id": format(span.get_span_context().trace_id, "032x"),
                "output_tokens": output_tokens,
            }
        )
    provider.force_flush()
    spans = [
        {
            "trace_id": format(s.context.trace_id, "032x"),
            "span_id": format(s.context.span_id, "016x"),
            "parent_id": format(s.parent.span_id, "016x") if s.parent is not None else None,
            "name": s.name,
            "scope_name": s.instrumentation_scope.name,
            "start_time_unix_nano": s.start_time,
            "end_time_unix_nano": s.end_time,
            "error": s.status.status_code == StatusCode.ERROR,
        }
        for s in memory.get_finished_spans()
    ]
    provider.shutdown()
    json.dump({"requests": requests, "spans": spans}, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
