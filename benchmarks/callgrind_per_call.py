"""Instructions per ``generate()`` call, counted by valgrind's callgrind around the measured calls only.

    python benchmarks/callgrind_per_call.py CONFIG N

CONFIG is ``plain`` (not instrumented), ``sampled`` or ``unsampled`` (``TracerProvider`` with
``ALWAYS_ON`` / ``ALWAYS_OFF``; a ``BatchSpanProcessor`` with a discarding exporter and an SDK
``MeterProvider`` with an ``InMemoryMetricReader`` either way). The default tiny GPT-2, prompt 4,
128 new tokens, greedy, EOS off, one thread. The script starts itself under
``valgrind --tool=callgrind --instr-atstart=no`` (imports and set-up run uninstrumented, fast),
waits for 3 warm-up calls, turns instrumentation on with ``callgrind_control -i on``, lets the
child make N calls (each followed by ``tracer_provider.force_flush()``, so the span export it
causes is counted), turns it off and prints ``CONFIG N instructions``. Per call: run N=2 and N=6
and take (Ir(6) - Ir(2)) / 4. Needs valgrind (``callgrind_control``) on Linux.
"""

from __future__ import annotations

import sys

import callgrind_toggled  # noqa: E402  (benchmarks/, the script's own folder)

NEW_TOKENS = 128


def child(config: str, n: int, folder: str) -> None:
    import torch
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON

    from otel_generate import GenerateInstrumentor
    from otel_generate.bench.models import build_model

    class Discard(SpanExporter):
        def export(self, spans):
            return SpanExportResult.SUCCESS

        def shutdown(self):
            pass

    torch.set_num_threads(1)
    model = build_model("gpt2", seed=0)
    tracer_provider = TracerProvider(sampler=ALWAYS_OFF if config == "unsampled" else ALWAYS_ON)
    tracer_provider.add_span_processor(
        BatchSpanProcessor(Discard(), schedule_delay_millis=600_000, max_queue_size=1 << 16)
    )
    reader = InMemoryMetricReader()
    meter_provider = MeterProvider(metric_readers=[reader])
    if config != "plain":
        GenerateInstrumentor().instrument(
            tracer_provider=tracer_provider, meter_provider=meter_provider, skip_dep_check=True
        )
    ids = torch.randint(1, 126, (1, 4), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)

    def call():
        model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, eos_token_id=None, do_sample=False)
        tracer_provider.force_flush()

    for _ in range(3):
        call()
    reader.get_metrics_data()
    callgrind_toggled.signal(folder, "ready")
    callgrind_toggled.wait(folder, "go")
    for _ in range(n):
        call()
    callgrind_toggled.signal(folder, "done")
    callgrind_toggled.wait(folder, "stop")


def main() -> int:
    if sys.argv[1] == "--child":
        child(sys.argv[2], int(sys.argv[3]), sys.argv[4])
        return 0
    config, n = sys.argv[1], int(sys.argv[2])
    if config not in ("plain", "sampled", "unsampled"):
        raise SystemExit("CONFIG must be plain, sampled or unsampled")
    collected = callgrind_toggled.count(__file__, (config, str(n)))
    print(config, n, collected if collected is not None else "unknown")
    return 0


if __name__ == "__main__":
    sys.exit(main())
