"""The workload the per-call callgrind scripts count (``callgrind_per_call.py``, ``callgrind_own_code.py``).

The default tiny GPT-2 (random weights, seed 0), prompt 4, 128 new tokens, greedy, EOS off, one
torch thread; an SDK ``TracerProvider`` (``ALWAYS_ON`` or ``ALWAYS_OFF``) with a
``BatchSpanProcessor`` and a discarding exporter, and an SDK ``MeterProvider`` with an
``InMemoryMetricReader``.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional

NEW_TOKENS = 128


def tiny_gpt2_calls(sampled: bool, instrument: Optional[Dict[str, Any]]) -> Callable[[], None]:
    """One ``generate()`` call followed by ``tracer_provider.force_flush()`` (so the export it
    causes is counted), as a function; ``instrument``: the ``instrument()`` options, or ``None``
    for plain ``generate()``. Runs 3 warm-up calls and collects the metrics once before returning."""
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
    tracer_provider = TracerProvider(sampler=ALWAYS_ON if sampled else ALWAYS_OFF)
    tracer_provider.add_span_processor(
        BatchSpanProcessor(Discard(), schedule_delay_millis=600_000, max_queue_size=1 << 16)
    )
    reader = InMemoryMetricReader()
    meter_provider = MeterProvider(metric_readers=[reader])
    if instrument is not None:
        GenerateInstrumentor().instrument(
            tracer_provider=tracer_provider, meter_provider=meter_provider, skip_dep_check=True, **instrument
        )
    ids = torch.randint(1, 126, (1, 4), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)

    def call() -> None:
        model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, eos_token_id=None, do_sample=False)
        tracer_provider.force_flush()

    for _ in range(3):
        call()
    reader.get_metrics_data()
    return call
