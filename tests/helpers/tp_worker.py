"""One rank of ``torchrun --nproc-per-node N tests/helpers/tp_worker.py OUT_DIR MODEL_DIR [options]`` (see
tests/e2e/test_tensor_parallel.py): loads the saved tiny Llama, sharded with ``tp_plan="auto"`` or whole,
makes one ``generate()`` call and writes what its own in-memory exporters hold to
``OUT_DIR/rank<RANK>.json``:

``{"rank", "world_size", "prompt_tokens", "new_tokens", "sequences", "spans": [...], "metrics": {name: count}}``

``new_tokens`` is read off the returned tensor (its width minus the prompt's), ``metrics`` sums the
histogram points' counts per metric name. Options: ``--tp`` (shard with ``tp_plan="auto"``),
``--own-prompt`` (each rank a prompt of its own length: 3 + rank tokens), ``--mode MODE`` (the
``tensor_parallel_spans`` keyword; the environment variable works the same way).
"""

from __future__ import annotations

import argparse
import json
import pathlib


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("model_dir")
    parser.add_argument("--tp", action="store_true")
    parser.add_argument("--own-prompt", action="store_true")
    parser.add_argument("--mode", default=None)
    parser.add_argument("--new-tokens", type=int, default=6)
    args = parser.parse_args()

    import torch
    import torch.distributed as dist
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from transformers import AutoModelForCausalLM

    from otel_generate import GenerateInstrumentor

    exporter, reader = InMemorySpanExporter(), InMemoryMetricReader()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    options = {} if args.mode is None else {"tensor_parallel_spans": args.mode}
    GenerateInstrumentor().instrument(
        tracer_provider=tracer_provider, meter_provider=MeterProvider(metric_readers=[reader]), **options
    )

    if args.tp:
        model = AutoModelForCausalLM.from_pretrained(args.model_dir, tp_plan="auto")
    else:
        dist.init_process_group("gloo")
        model = AutoModelForCausalLM.from_pretrained(args.model_dir)
    model.eval()
    rank, world = dist.get_rank(), dist.get_world_size()
    length = 3 + rank if args.own_prompt else 4
    ids = torch.arange(5, 5 + length).unsqueeze(0)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=args.new_tokens,
        min_new_tokens=args.new_tokens,  # no early EOS: every new token is real output
        do_sample=False,
    )
    tracer_provider.force_flush()

    spans = [
        {
            "name": span.name,
            "trace_id": span.context.trace_id,
            "span_id": span.context.span_id,
            "parent_id": span.parent.span_id if span.parent is not None else None,
            "attributes": {key: (list(v) if isinstance(v, tuple) else v) for key, v in span.attributes.items()},
        }
        for span in exporter.get_finished_spans()
    ]
    metrics = {}
    data = reader.get_metrics_data()
    for resource in data.resource_metrics if data is not None else ():
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                points = getattr(metric.data, "data_points", ())
                metrics[metric.name] = metrics.get(metric.name, 0) + sum(getattr(p, "count", 0) for p in points)
    result = {
        "rank": rank,
        "world_size": world,
        "prompt_tokens": length,
        "new_tokens": int(out.shape[-1]) - length,
        "sequences": out.tolist(),
        "spans": spans,
        "metrics": metrics,
    }
    path = pathlib.Path(args.out_dir) / f"rank{rank}.json"
    path.write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
