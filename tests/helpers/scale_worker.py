"""One sending process of the end-to-end tests against ``collector/local.sh`` (not a test module):
tests/e2e/test_collector_e2e.py's scale-tier test and tests/e2e/test_restarts_e2e.py.

Instruments a tiny random-weight GPT-2 with this package, exports spans over OTLP/gRPC to
``--endpoint`` (the agent of ``collector/local.sh up --scale``, or the Collector of ``up``) with
the SDK's ``BatchSpanProcessor`` and ``OTLPSpanExporter`` (their timeout and queue from the
standard ``OTEL_*`` variables), and runs one request per ``--request INDEX:KIND``, each under its
own application span ``handle_request`` (a new trace), ``--pause`` seconds apart:

* ``normal``: plain greedy generate();
* ``error``: a stopping criterion raises at the third step, so generate() fails;
* ``slow_first_token``: a logits processor sleeps ``--first-token-sleep`` s in the first step;
* ``slow_decode``: it sleeps ``--decode-sleep`` s in the third step;
* ``slow_request``: the application span sleeps ``--request-sleep`` s before generate().

A second span processor keeps every span in memory: after the last request the worker prints
one JSON document with, per request, its index, kind, trace id and output token count, and every
span it produced (ids, parent, name, scope, start/end in ns, status), so the test can work out
independently which traces the gateways' tail sampling must keep. After each request it prints
``done INDEX`` on stderr, so that a test can restart a backend while requests go on.

With ``--metrics`` it also exports metrics (this package's histograms) to the same endpoint every
second, as ``opentelemetry-instrument`` would with ``OTEL_METRIC_EXPORT_INTERVAL=1000``, and turns
on the SDK's own metrics (``OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED=true``): the JSON document then
also has ``sdk``, the spans the SDK's exporter counted as exported (``otel.sdk.exporter.span.exported``)
and as failed (the same counter with ``error.type``), and the spans its batch processor dropped
(``otel.sdk.processor.span.processed`` with ``error.type``), read in the process.
"""

from __future__ import annotations

import argparse
import json
import os
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
    parser.add_argument("--pause", type=float, default=0.0, help="seconds between requests")
    parser.add_argument("--metrics", action="store_true", help="export metrics too; count the SDK's own")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    resource = Resource.create({"service.name": args.service})
    meter_provider = sdk_reader = None
    if args.metrics:
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import InMemoryMetricReader, PeriodicExportingMetricReader

        os.environ["OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED"] = "true"
        sdk_reader = InMemoryMetricReader()
        exporting = PeriodicExportingMetricReader(
            OTLPMetricExporter(endpoint=args.endpoint, insecure=True), export_interval_millis=1000
        )
        meter_provider = MeterProvider(resource=resource, metric_readers=[exporting, sdk_reader])
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(
        BatchSpanProcessor(
            OTLPSpanExporter(endpoint=args.endpoint, insecure=True, meter_provider=meter_provider),
            schedule_delay_millis=200,
            meter_provider=meter_provider,
        )
    )
    provider.add_span_processor(SimpleSpanProcessor(memory))
    GenerateInstrumentor().instrument(tracer_provider=provider, meter_provider=meter_provider)
    tracer = provider.get_tracer("tests.scale_worker")
    model = build_model("gpt2", seed=0)
    generator = torch.Generator().manual_seed(1)

    requests = []
    for number, item in enumerate(args.request):
        if number and args.pause:
            time.sleep(args.pause)
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
        print(f"done {index}", file=sys.stderr, flush=True)
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
    document = {"requests": requests, "spans": spans}
    if meter_provider is not None:
        document["sdk"] = sdk_counts(sdk_reader)
        meter_provider.shutdown()
    json.dump(document, sys.stdout)
    return 0


def sdk_counts(reader) -> dict:
    """The SDK's own span counters: ``{"exported": n, "export_failed": {error.type: n},
    "processor_dropped": {error.type: n}}``."""
    counts = {"exported": 0, "export_failed": {}, "processor_dropped": {}}
    data = reader.get_metrics_data()
    for resource_metrics in data.resource_metrics if data else []:
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                for point in getattr(metric.data, "data_points", []):
                    error = point.attributes.get("error.type")
                    if metric.name == "otel.sdk.exporter.span.exported":
                        if error is None:
                            counts["exported"] += point.value
                        else:
                            counts["export_failed"][error] = counts["export_failed"].get(error, 0) + point.value
                    elif metric.name == "otel.sdk.processor.span.processed" and error is not None:
                        counts["processor_dropped"][error] = counts["processor_dropped"].get(error, 0) + point.value
    return counts


if __name__ == "__main__":
    sys.exit(main())
