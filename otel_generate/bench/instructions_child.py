"""The process ``otel-generate bench --instructions`` runs under valgrind (``python -m`` this module).

It reads the spec the parent (:mod:`otel_generate.bench.instructions`) wrote, then for each
configuration: sets it up once, warms up, runs ``--calls-low`` and ``--calls-high`` calls (each
part followed by a flush), and marks the borders between parts with ``os.getloadavg()``
(:data:`~otel_generate.bench.instructions.MARKER`, where callgrind dumps). It writes the part
labels, each configuration's steps, spans and output check, and the versions and model to the
spec's ``result`` path.
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
from otel_generate.bench.instructions import CONFIGURATIONS, PROVIDERS_ONLY, span_processor, start_counting
from otel_generate.bench.workload import Runner, model_description, sequences_of
from otel_generate.options import STEP_SPANS_NONE, STEP_SPANS_SLOW


def main(spec_path: str) -> None:
    """Run the configurations of the spec at ``spec_path`` and write what the parent needs to its ``result`` path."""
    with open(spec_path, encoding="utf-8") as handle:
        spec = json.load(handle)
    config = BenchConfig(**spec["config"])
    import torch

    torch.set_num_threads(config.threads)
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased

    from otel_generate import GenerateInstrumentor

    runner = Runner(config, "cpu")
    labels: List[str] = []

    def mark(label: str) -> None:
        """Ends the part ``label`` (callgrind dumps what was counted since the last mark)."""
        labels.append(label)
        os.getloadavg()

    reference = None
    runs: Dict[str, Any] = {}
    for name in spec["configurations"]:
        _, options, sampled = CONFIGURATIONS[name]
        instrumentor = tracer_provider = meter_provider = exporter = None
        if options is not None or name in PROVIDERS_ONLY:
            exporter, reader = make_exporters(config.exporter)
            tracer_provider = TracerProvider() if sampled else TracerProvider(sampler=ParentBased(ALWAYS_OFF))
            tracer_provider.add_span_processor(span_processor(exporter))
            meter_provider = MeterProvider(metric_readers=[reader])
        if options is not None:
            instrumentor = GenerateInstrumentor()
            instrumentor.instrument(
                tracer_provider=tracer_provider, meter_provider=meter_provider, skip_dep_check=True, **options
            )

        def flush(tracer_provider: Any = tracer_provider, meter_provider: Any = meter_provider) -> None:
            if tracer_provider is not None:
                tracer_provider.force_flush()
                meter_provider.force_flush()

        identical = True
        output = None
        for _ in range(config.warmup):
            output = runner.generate()
        flush()
        spans_before = exporter.spans if exporter is not None else 0
        gc.collect()
        start_counting()  # (imports, set-up and warmup were not counted)
        mark(f"{name} setup")
        for part, calls in (("low", config.calls_low), ("high", config.calls_high)):
            for _ in range(calls):
                output = runner.generate()
            flush()
            mark(f"{name} {part}")
            sequences = sequences_of(output)
            if reference is None:
                reference = sequences
            identical = identical and bool(torch.equal(sequences, reference))
            gc.collect()
            mark(f"{name} gc after {part}")
        steps = max(runner.counts(output))
        calls_made = config.calls_low + config.calls_high
        spans = ((exporter.spans - spans_before) / calls_made) if exporter is not None else 0
        if options is None or not sampled:
            expected: Optional[int] = 0
        elif options.get("max_step_spans") == 0 or options.get("step_spans") == STEP_SPANS_NONE:
            expected = 1
        elif options.get("step_spans") == STEP_SPANS_SLOW:
            expected = None
        else:
            expected = 1 + steps
        runs[name] = {
            "steps": steps,
            "spans_per_call": spans,
            "spans_expected_per_call": expected,
            "outputs_identical": identical,
            # (compared with plain's by the parent: each configuration runs in a process of its own)
            "sequences": sequences.tolist(),
        }
        if instrumentor is not None:
            instrumentor.uninstrument()
        if tracer_provider is not None:
            tracer_provider.shutdown()
            meter_provider.shutdown()
        gc.collect()
        mark(f"{name} teardown")
        print(f"  {name}: done", file=sys.stderr, flush=True)
    result = {
        "labels": labels,
        "configurations": spec["configurations"],
        "runs": runs,
        "versions": versions(),
        "model": model_description(config, runner.model),
        "parameters": int(sum(p.numel() for p in runner.model.parameters())),
    }
    with open(spec["result"], "w", encoding="utf-8") as handle:
        json.dump(result, handle)


if __name__ == "__main__":  # the process under valgrind
    main(sys.argv[1])
