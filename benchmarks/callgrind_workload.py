"""The workload the per-call callgrind scripts count (``callgrind_per_call.py``, ``callgrind_own_code.py``).

The default tiny GPT-2 (random weights, seed 0), prompt 4, 128 new tokens, greedy, EOS off, one
torch thread; an SDK ``TracerProvider`` (``ALWAYS_ON`` or ``ALWAYS_OFF``) with a
``BatchSpanProcessor`` and a discarding exporter, and an SDK ``MeterProvider`` with an
``InMemoryMetricReader``.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional

NEW_TOKENS = 128
#: Calls made before :func:`tiny_gpt2_calls` returns. CPython 3.11 specializes a function's code
#: only after it has run a number of times (it is quickened on its 8th call, and its instructions
#: specialize some executions later): the instrumentation's once-per-request code runs
#: unspecialized for a process's first requests, while the model's per-step code is warm after one
#: call. With 3 warm-up calls the counts of ``callgrind_own_code.py`` held about 140,000 a call of
#: that warm-up (step spans off, 1,615,983 against 1,474,359 after 20, 1,479,826 after 60 and
#: 1,475,454 after 200; BENCHMARKS.md, issue 18 session 18): a one-time cost of a process, not of
#: each request, like the set-up.
WARMUP_CALLS = 20


def tiny_gpt2_calls(sampled: bool, instrument: Optional[Dict[str, Any]]) -> Callable[[], None]:
    """One ``generate()`` call followed by ``tracer_provider.force_flush()`` (so the export it
    causes is counted), as a function; ``instrument``: the ``instrument()`` options, or ``None``
    for plain ``generate()``. Runs :data:`WARMUP_CALLS` warm-up calls and collects the metrics once before returning."""
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

    for _ in range(WARMUP_CALLS):
        call()
    reader.get_metrics_data()
    return call
