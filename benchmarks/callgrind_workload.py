"""The workload the per-call callgrind scripts count (``callgrind_per_call.py``, ``callgrind_own_code.py``).

The default tiny GPT-2 (random weights, seed 0), prompt 4, 128 new tokens, greedy, EOS off (or,
``eos``, the model's own EOS id, which its 128 greedy tokens from this prompt never hold), one
torch thread; an SDK ``TracerProvider`` (``ALWAYS_ON`` or ``ALWAYS_OFF``) with a
``BatchSpanProcessor`` and a discarding exporter, and an SDK ``MeterProvider`` with an
``InMemoryMetricReader``.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

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


def tiny_gpt2_calls(sampled: bool, instrument: Optional[Dict[str, Any]], eos: bool = False) -> Callable[[], None]:
    """One ``generate()`` call followed by ``tracer_provider.force_flush()`` (so the export it
    causes is counted), as a function; ``instrument``: the ``instrument()`` options, or ``None``
    for plain ``generate()``; ``eos``: generate with the model's EOS id (``EosTokenCriteria`` in
    the criteria, as in production), else with none. Runs :data:`WARMUP_CALLS` warm-up calls and
    collects the metrics once before returning. Raises ``SystemExit`` when a call does not
    generate :data:`NEW_TOKENS` tokens."""
    import torch
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON

    from otel_generate import GenerateInstrumentor
    from otel_generate.bench.models import EOS_TOKEN_ID, build_model

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

    eos_token_id = EOS_TOKEN_ID if eos else None

    def call() -> Any:
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, eos_token_id=eos_token_id, do_sample=False
        )
        tracer_provider.force_flush()
        return out

    for _ in range(WARMUP_CALLS):
        out = call()
    if out.shape[-1] - ids.shape[-1] != NEW_TOKENS or (eos and EOS_TOKEN_ID in out[0, ids.shape[-1] :].tolist()):
        raise SystemExit(f"the workload generated {out.shape[-1] - ids.shape[-1]} tokens, {NEW_TOKENS} expected")
    reader.get_metrics_data()
    return call


#: the configurations the callgrind scripts name: (sampled, ``instrument()`` options or ``None``
#: for plain ``generate()``, the model's EOS id on)
CONFIGURATIONS: Dict[str, Tuple[bool, Optional[Dict[str, Any]], bool]] = {
    "plain": (True, None, False),
    "plain-eos": (True, None, True),
    "unsampled": (False, {}, False),  # ALWAYS_OFF
    "sampled": (True, {}, False),  # ALWAYS_ON, every step a span
    "step-spans-off": (True, {"max_step_spans": 0}, False),
    "step-spans-off-eos": (True, {"max_step_spans": 0}, True),
}


def calls_for(config: str) -> Callable[[], None]:
    """:func:`tiny_gpt2_calls` for a name of :data:`CONFIGURATIONS`. Raises ``KeyError`` for another."""
    sampled, instrument, eos = CONFIGURATIONS[config]
    return tiny_gpt2_calls(sampled, instrument, eos)
