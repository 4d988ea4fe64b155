"""The serving bench's load and what it measured: offered loads, arrivals, per-request records, and the
figures of one measurement window and of many rounds.

Pure: no model, no HTTP, no clock of its own (the drivers in :mod:`otel_generate.bench.serve` and
:mod:`otel_generate.bench.serve_child` read ``time.perf_counter`` and hand the times in).

* **Offered load** (:class:`Level`): *saturation*, a closed loop with ``--concurrency`` requests always
  in flight (a request is sent the moment one finishes), or a **rate**, an open loop of Poisson
  arrivals (exponential gaps, :func:`poisson_arrivals`) at a fixed number of requests per second,
  given as a fraction of the saturation throughput (``--rates 0.5,0.7``) or absolutely
  (``--rates 20/s``): :func:`parse_rates`.
* **A request** (:class:`Record`): when it was sent, when each streamed token arrived, when it ended,
  how many tokens the server said it generated, and its error if it failed. Of the completed requests
  of a window, ``token_count_mismatches`` did not generate the tokens asked for and
  ``streamed_count_mismatches`` streamed a different number of tokens than they generated.
* **A window** (:func:`window_figures`): ``[start, end)`` of a round. Throughput counts what happened
  inside it (tokens received, requests completed); latencies are those of the requests *sent* inside
  it, every one followed to its end after the window (the drain): time to first token (sent to first
  token), inter-token latency (the gaps between a request's consecutive tokens), end-to-end; each as
  its 50th and 99th percentile (linear interpolation, :func:`otel_generate.stats.percentile`).
* **Rounds** (:func:`compare_levels`): for each level, the plain and instrumented rounds of each pair,
  every figure's median and interquartile range on each side, and the per-pair ratio instrumented /
  plain with its median and interquartile range (:func:`otel_generate.bench.stats.with_iqr`).

Units: ``*_s`` seconds, ``*_ms`` milliseconds, ``*_per_s`` per second; CPU figures are CPU seconds per
second of the window (1.0 = one core busy all the time).
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from otel_generate.bench.config import BenchUsageError
from otel_generate.bench.stats import with_iqr
from otel_generate.stats import percentile

#: How long the requests of a window may take to finish after it, seconds; the rest are cancelled (unfinished).
DRAIN_TIMEOUT_S = 60.0
#: How long a warmup may take, seconds.
WARMUP_TIMEOUT_S = 300.0
#: The drop warning of :mod:`otel_generate.background` in a server's log.
DROP_LINE = re.compile(r"the telemetry of (\d+) finished request\(s\) was dropped")
#: ``--rates none``: saturation only.
NO_RATES = "none"
#: The suffix of an absolute rate, requests per second (``--rates 20/s``).
PER_SECOND = "/s"
#: Fractions above this are refused: the queue would only grow.
MAX_FRACTION = 2.0

#: The figures of a window (see :func:`window_figures`) compared between plain and instrumented, per pair.
RATIO_FIGURES = (
    "tokens_per_s",
    "requests_per_s",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "itl_p50_ms",
    "itl_p99_ms",
    "e2e_p50_ms",
    "e2e_p99_ms",
)
#: Figures given per side only (their ratio means nothing, or one side has none).
SIDE_FIGURES = (
    "process_cpu",
    "emitter_cpu",
    "emitter_cpu_share",
    "server_cpu",
    "client_cpu",
)


@dataclass(frozen=True)
class Level:
    """One offered load: ``saturation`` (``concurrency`` in flight) or a Poisson ``rate``.

    ``fraction``: the rate as a fraction of the saturation throughput (``None`` when given in
    requests per second); ``rps``: requests per second, ``None`` until the fraction is resolved.
    """

    kind: str  # "saturation" | "rate"
    fraction: Optional[float] = None
    rps: Optional[float] = None

    @property
    def label(self) -> str:
        if self.kind == "saturation":
            return "saturation"
        if self.fraction is not None:
            return f"rate {self.fraction:g}x"
        return f"rate {self.rps:g}/s"

    def resolved(self, saturation_rps: float) -> "Level":
        """This level with its requests per second: a fraction of ``saturation_rps``."""
        if self.kind != "rate" or self.rps is not None:
            return self
        return Level("rate", self.fraction, self.fraction * saturation_rps)


def parse_rates(text: str) -> List[Level]:
    """``--rates``: comma-separated fractions of the saturation throughput (``0.5,0.7``), absolute rates in
    requests per second (``20/s``), or ``none`` (saturation only). The levels measured are saturation, then
    these, in the order given.

    Raises:
        BenchUsageError: a value that is neither, not positive, a fraction above :data:`MAX_FRACTION`, or twice.
    """
    levels = [Level("saturation")]
    text = text.strip()
    if text.lower() == NO_RATES:
        return levels
    seen = set()
    for part in text.split(","):
        item = part.strip()
        absolute = item.endswith(PER_SECOND)
        number = item[: -len(PER_SECOND)] if absolute else item
        try:
            value = float(number)
        except ValueError:
            raise BenchUsageError(
                f"--rates: {item!r} is not a fraction of the saturation throughput (e.g. 0.7), a rate in requests "
                f"per second (e.g. 20/s) or 'none'"
            ) from None
        if not math.isfinite(value) or value <= 0:
            raise BenchUsageError(f"--rates: {item!r} must be above 0")
        if not absolute and value > MAX_FRACTION:
            raise BenchUsageError(
                f"--rates: {item!r} is above {MAX_FRACTION:g} times the saturation throughput; the queue would "
                "only grow"
            )
        key = (absolute, value)
        if key in seen:
            raise BenchUsageError(f"--rates: {item!r} is given twice")
        seen.add(key)
        levels.append(Level("rate", None, value) if absolute else Level("rate", value, None))
    return levels


def poisson_arrivals(rate: float, start_s: float, end_s: float, seed: int) -> List[float]:
    """Arrival times in ``[start_s, end_s)`` of a Poisson process of ``rate`` per second: exponential gaps
    drawn by ``random.Random(seed)``, so that two rounds given the same seed offer the same arrivals."""
    if rate <= 0:
        raise ValueError(f"rate must be above 0, got {rate!r}")
    draw = random.Random(seed)
    times: List[float] = []
    now = start_s
    while True:
        now += draw.expovariate(rate)
        if now >= end_s:
            return times
        times.append(now)


def schedule(arrivals: Sequence[float], seconds: float) -> List[Tuple[float, str]]:
    """The open loop's events in time order: ``(time from the window's start, "send" | "start" | "end")``."""
    events = [(t, "send") for t in arrivals] + [(0.0, "start"), (seconds, "end")]
    order = {"start": 0, "send": 1, "end": 2}
    return sorted(events, key=lambda event: (event[0], order[event[1]]))


@dataclass
class Record:
    """One request as the load generator saw it (times from the driver's clock, seconds)."""

    sent: float
    token_times: List[float] = field(default_factory=list)  # when each streamed token arrived
    finished: Optional[float] = None  # when its stream ended (None: not by the end of the drain)
    tokens: Optional[int] = None  # tokens the server says it generated (usage), None if it never said
    error: Optional[str] = None


def _p(values: Sequence[float], q: float, scale: float = 1e3) -> Optional[float]:
    return percentile(values, q) * scale if values else None


def window_figures(
    records: Sequence[Record], start: float, end: float, requested_tokens: int, cpu: Optional[Dict[str, Any]] = None
) -> Dict[str, Any]:
    """The figures of the window ``[start, end)`` (see the module docstring).

    ``cpu``: ``{name: (CPU seconds at start, at end)}`` (``None`` where unknown) for ``process``,
    ``emitter``, ``server`` and ``client``; each becomes ``{name}_cpu`` in CPU seconds per second of the
    window, and ``emitter_cpu_share`` the emitter's share of ``process``'s.

    Raises:
        ValueError: an empty or reversed window.
    """
    duration = end - start
    if not duration > 0:
        raise ValueError(f"a window must last more than 0 s, got {duration!r}")
    sent = [r for r in records if start <= r.sent < end]
    completed = [r for r in sent if r.finished is not None and r.error is None]
    ttft = [r.token_times[0] - r.sent for r in sent if r.token_times]
    itl = [b - a for r in sent for a, b in zip(r.token_times, r.token_times[1:])]
    e2e = [r.finished - r.sent for r in completed]
    tokens_in = sum(1 for r in records for t in r.token_times if start <= t < end)
    completed_in = sum(1 for r in records if r.finished is not None and r.error is None and start <= r.finished < end)
    figures: Dict[str, Any] = {
        "start_s": start,
        "duration_s": duration,
        "requests_sent": len(sent),
        "requests_completed": len(completed),
        "requests_failed": sum(1 for r in sent if r.error is not None),
        "requests_unfinished": sum(1 for r in sent if r.finished is None and r.error is None),
        "token_count_mismatches": sum(1 for r in completed if r.tokens != requested_tokens),
        "streamed_count_mismatches": sum(
            1 for r in completed if r.tokens is not None and len(r.token_times) != r.tokens
        ),
        "tokens_in_window": tokens_in,
        "requests_completed_in_window": completed_in,
        "tokens_per_s": tokens_in / duration,
        "requests_per_s": completed_in / duration,
        "ttft_p50_ms": _p(ttft, 50),
        "ttft_p99_ms": _p(ttft, 99),
        "itl_p50_ms": _p(itl, 50),
        "itl_p99_ms": _p(itl, 99),
        "e2e_p50_ms": _p(e2e, 50),
        "e2e_p99_ms": _p(e2e, 99),
        "latency_samples": {"ttft": len(ttft), "itl": len(itl), "e2e": len(e2e)},
        "first_error": next((r.error for r in sent if r.error is not None), None),
    }
    readings = cpu or {}
    for name in ("process", "emitter", "server", "client"):
        pair = readings.get(name)
        figures[f"{name}_cpu"] = (pair[1] - pair[0]) / duration if pair is not None and None not in pair else None
    process, emitter = figures["process_cpu"], figures["emitter_cpu"]
    figures["emitter_cpu_share"] = emitter / process if emitter is not None and process else None
    return figures


def _ratios(plain: Sequence[Optional[float]], instrumented: Sequence[Optional[float]]) -> List[Optional[float]]:
    return [b / a if a is not None and b is not None and a > 0 else None for a, b in zip(plain, instrumented)]


def compare_levels(rounds: Sequence[Dict[str, Any]], levels: Sequence[Level]) -> List[Dict[str, Any]]:
    """Per level: the plain and instrumented rounds' figures in pair order, each side's median and
    interquartile range of every figure, and the per-pair ratios instrumented / plain of
    :data:`RATIO_FIGURES` with theirs.

    ``rounds``: dicts with ``level`` (index into ``levels``), ``pair``, ``side`` (``"plain"`` or
    ``"instrumented"``), ``figures`` (:func:`window_figures`) and, for instrumented rounds,
    ``dropped_requests`` (``None`` where unknown). A pair counts where both of its rounds exist.
    """
    out = []
    for index, level in enumerate(levels):
        mine = [r for r in rounds if r["level"] == index]
        by_pair: Dict[int, Dict[str, Dict[str, Any]]] = {}
        for r in mine:
            by_pair.setdefault(r["pair"], {})[r["side"]] = r
        pairs = [by_pair[p] for p in sorted(by_pair) if len(by_pair[p]) == 2]
        entry: Dict[str, Any] = {
            "level": level.kind,
            "label": level.label,
            "fraction": level.fraction,
            "offered_rps": level.rps,
            "pairs": len(pairs),
        }
        for side in ("plain", "instrumented"):
            values: Dict[str, Any] = {}
            for name in RATIO_FIGURES + SIDE_FIGURES:
                column = [p[side]["figures"][name] for p in pairs]
                values[name] = column
                with_iqr(values, name, column)
            entry[side] = values
        ratios: Dict[str, Any] = {}
        for name in RATIO_FIGURES:
            column = _ratios(entry["plain"][name], entry["instrumented"][name])
            ratios[name] = column
            with_iqr(ratios, name, column)
        entry["ratios"] = ratios
        dropped = [p["instrumented"].get("dropped_requests") for p in pairs]
        entry["dropped_requests"] = dropped
        entry["dropped_requests_total"] = None if None in dropped else sum(dropped)
        for key in ("requests_failed", "requests_unfinished", "token_count_mismatches", "streamed_count_mismatches"):
            entry[key] = sum(p[s]["figures"][key] for p in pairs for s in ("plain", "instrumented"))
        out.append(entry)
    return out
