"""Summaries of latency samples: every sample kept, percentiles described, nothing invented."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) by linear interpolation between closest ranks (numpy's default).

    Raises:
        ValueError: on an empty sequence, a NaN sample, or ``q`` outside 0..100.
    """
    if not values:
        raise ValueError("percentile of no samples is undefined")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be within 0..100, got {q}")
    ordered = sorted(values)
    if any(math.isnan(v) for v in ordered):
        raise ValueError("samples contain NaN")
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True)
class Latency:
    """Latency samples in seconds with their count, mean and p50/p90/p99 (seconds)."""

    values: List[float] = field(default_factory=list)

    @classmethod
    def from_values(cls, values: Sequence[Optional[float]]) -> "Latency":
        """Keep every non-``None`` sample, in order."""
        return cls([float(v) for v in values if v is not None])

    @property
    def count(self) -> int:
        return len(self.values)

    @property
    def mean(self) -> Optional[float]:
        return sum(self.values) / len(self.values) if self.values else None

    def p(self, q: float) -> Optional[float]:
        return percentile(self.values, q) if self.values else None

    def to_dict(self) -> Dict[str, Optional[float]]:
        """``{"count", "mean", "p50", "p90", "p99"}``, seconds (``None`` where there are no samples)."""
        return {"count": self.count, "mean": self.mean, "p50": self.p(50), "p90": self.p(90), "p99": self.p(99)}
