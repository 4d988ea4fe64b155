"""``TokenLatencyProfiler``: per-token latencies as Python numbers, no tracing backend needed."""

from __future__ import annotations

import json
import threading
from typing import Any, Dict, List, Optional

from otel_generate import instrumentor
from otel_generate.record import GenerationRecord
from otel_generate.stats import Latency

#: Kept importable here: the open profilers of the current context (see :mod:`otel_generate.instrumentor`).
active_profilers = instrumentor.active_profilers


class TokenLatencyProfiler:
    """Records every ``generate()`` call made inside its ``with`` block, in this thread or task.

    Usage::

        with TokenLatencyProfiler() as prof:
            model.generate(**inputs, max_new_tokens=32)
        prof.summary()["time_per_output_token_s"]["p50"]

    Works with only ``opentelemetry-api`` installed (no SDK, no exporter): if the instrumentation
    is not on, entering the first profiler turns it on and leaving the last one turns it off
    again. Profilers are context-local: one opened in another thread never sees this thread's
    requests. A request made inside nested profilers is recorded by each of them.

    Attributes:
        records: one :class:`~otel_generate.record.GenerationRecord` per request, in completion order.
    """

    def __init__(self) -> None:
        self.records: List[GenerationRecord] = []
        self._records_lock = threading.Lock()
        self._open = False
        self._auto = False

    def __enter__(self) -> "TokenLatencyProfiler":
        if self._open:
            raise RuntimeError("this TokenLatencyProfiler is already open; create a new one to nest")
        self._auto = instrumentor.acquire_for_profiler()
        self._open = True
        instrumentor.open_profiler(self)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        instrumentor.close_profiler(self)
        self._open = False
        # requests accounted on the background emitter (continuous batching) reach the records first
        telemetry = instrumentor.GenerateInstrumentor().telemetry
        if telemetry is not None and telemetry.emitter is not None:
            telemetry.emitter.drain()
        if self._auto:
            self._auto = False
            instrumentor.release_for_profiler()

    def _add(self, record: GenerationRecord) -> None:
        with self._records_lock:
            self.records.append(record)

    def summary(self) -> Dict[str, Any]:
        """Count, mean, p50, p90 and p99 (seconds) of time to first token and time per output token.

        Returns:
            ``{"requests": int, "time_to_first_token_s": {...}, "time_per_output_token_s": {...},
            "input_tokens": int, "output_tokens": int}`` where each ``{...}`` is
            :meth:`otel_generate.stats.Latency.to_dict`.
        """
        records = list(self.records)
        return {
            "requests": len(records),
            "time_to_first_token_s": Latency.from_values([r.time_to_first_token_s for r in records]).to_dict(),
            "time_per_output_token_s": Latency.from_values([r.time_per_output_token_s for r in records]).to_dict(),
            "input_tokens": sum(r.input_tokens or 0 for r in records),
            "output_tokens": sum(r.output_tokens or 0 for r in records),
        }

    def to_dict(self) -> Dict[str, Any]:
        """The summary plus every request: TTFT (s), step latencies (s), tokens per step, input/output tokens."""
        return {
            "summary": self.summary(),
            "requests": [
                {
                    "model": r.model,
                    "strategy": r.strategy,
                    "device": r.device,
                    "synchronized": r.synchronized,
                    "duration_s": r.duration_s,
                    "time_to_first_token_s": r.time_to_first_token_s,
                    "time_per_output_token_s": r.time_per_output_token_s,
                    "step_latencies_s": r.step_latencies_s,
                    "step_tokens": r.step_tokens,
                    "input_tokens": r.input_tokens,
                    "output_tokens": r.output_tokens,
                    "error_type": r.error_type,
                    "incomplete": r.incomplete,
                }
                for r in list(self.records)
            ],
        }

    def to_json(self, path: Optional[str] = None) -> str:
        """The :meth:`to_dict` document as JSON; also written to ``path`` when given."""
        text = json.dumps(self.to_dict(), indent=2)
        if path is not None:
            with open(path, "w", encoding="utf-8") as handle:
                handle.write(text + "\n")
        return text
