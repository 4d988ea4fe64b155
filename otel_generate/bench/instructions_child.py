"""The process ``otel-generate bench --instructions`` runs under valgrind (``python -m`` this module).

It reads the spec the parent (:mod:`otel_generate.bench.instructions`) wrote, then for its one
configuration: sets it up once, warms up with ``--warmup`` pairs, turns callgrind's counting on,
and runs ``--pairs`` pairs of a plain call (under ``suppress_instrumentation()``) and an
instrumented call, marking the border after each call with ``os.getloadavg()``
(:data:`~otel_generate.bench.instructions.MARKER`, where callgrind dumps). The spec's ``view``
says where the flushes go: ``"all"`` (every thread counted) flushes the providers after each call,
inside its dump; ``"caller"`` flushes between pairs, in a dump that is not read. It writes the dump
labels, the steps, spans and output check, and the versions and model to the spec's ``result``
path.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from typing import Any, Dict, List, Optional

from otel_generate.bench.config import BenchConfig
from otel_generate.bench.environment import versions
from otel_generate.bench.exporters import make_exporters
from otel_generate.bench.instructions import CONFIGURATIONS, span_processor, start_counting
from otel_generate.bench.workload import Runner, model_description, sequences_of
from otel_generate.options import STEP_SPANS_NONE, STEP_SPANS_SLOW


def expected_spans(options: Dict[str, Any], sampled: bool, steps: int) -> Optional[int]:
    """Spans one instrumented call should export: none unsampled; the request span alone without
    step spans; ``None`` (not predictable) under the ``slow`` policy; else one per step too."""
    if not sampled:
        return 0
    if options.get("max_step_spans") == 0 or options.get("step_spans") == STEP_SPANS_NONE:
        return 1
    if options.get("step_spans") == STEP_SPANS_SLOW:
        return None
    return 1 + steps


def main(spec_path: str) -> None:
    """Run the configuration of the spec at ``spec_path`` and write what the parent needs to its ``result`` path."""
    with open(spec_path, encoding="utf-8") as handle:
        spec = json.load(handle)
    config = BenchConfig(**spec["config"])
    (name,) = spec["configurations"]
    every_thread = spec["view"] == "all"
    import torch

    torch.set_num_threads(config.threads)
    from opentelemetry.instrumentation.utils import suppress_instrumentation
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased

    from otel_generate import GenerateInstrumentor

    _, options, sampled = CONFIGURATIONS[name]
    runner = Runner(config, "cpu")
    exporter, reader = make_exporters(config.exporter)
    tracer_provider = TracerProvider() if sampled else TracerProvider(sampler=ParentBased(ALWAYS_OFF))
    tracer_provider.add_span_processor(span_processor(exporter))
    meter_provider = MeterProvider(metric_readers=[reader])
    instrumentor = GenerateInstrumentor()
    instrumentor.instrument(
        tracer_provider=tracer_provider, meter_provider=meter_provider, skip_dep_check=True, **options
    )
    labels: List[str] = []

    def mark(label: str) -> None:
        """Ends the dump ``label`` (callgrind dumps what was counted since the last mark)."""
        labels.append(label)
        os.getloadavg()

    def flush() -> None:
        tracer_provider.force_flush()  # drains the background emitter first, then the span processor
        meter_provider.force_flush()

    def plain() -> Any:
        with suppress_instrumentation():
            return runner.generate()

    for _ in range(config.warmup):
        plain()
        runner.generate()
    flush()
    gc.collect()
    gc.disable()  # collected between pairs, outside the counted dumps
    start_counting()  # (imports, set-up and warmup were not counted)
    mark(f"{name} setup")
    spans_before = exporter.spans
    identical = True
    output = None
    for pair in range(config.pairs):
        reference = plain()
        if every_thread:
            flush()
        mark(f"{name} plain {pair}")
        output = runner.generate()
        if every_thread:
            flush()
        mark(f"{name} instrumented {pair}")
        flush()
        gc.collect()
        mark(f"{name} between {pair}")
        identical = identical and bool(torch.equal(sequences_of(output), sequences_of(reference)))
    gc.enable()
    steps = max(runner.counts(output))
    spans = (exporter.spans - spans_before) / config.pairs
    instrumentor.uninstrument()
    tracer_provider.shutdown()
    meter_provider.shutdown()
    mark(f"{name} teardown")
    result = {
        "labels": labels,
        "configurations": [name],
        "runs": {
            name: {
                "steps": steps,
                "spans_per_call": spans,
                "spans_expected_per_call": expected_spans(options, sampled, steps),
                "outputs_identical": identical,
            }
        },
        "versions": versions(),
        "model": model_description(config, runner.model),
        "parameters": int(sum(p.numel() for p in runner.model.parameters())),
    }
    with open(spec["result"], "w", encoding="utf-8") as handle:
        json.dump(result, handle)
    print(f"  {name} ({spec['view']}): done", file=sys.stderr, flush=True)


if __name__ == "__main__":  # the process under valgrind
    main(sys.argv[1])
