"""The bench's summaries: one sample per measured run, and the medians over them."""

from __future__ import annotations

import statistics
from typing import Any, Dict, Optional, Sequence


def make_sample(elapsed_s: float, new_tokens_per_sequence: Sequence[int]) -> Dict[str, Any]:
    """One measured run: ``{"elapsed_s", "new_tokens", "tokens_per_s", "new_tokens_per_sequence"}``.

    ``new_tokens`` is the sum over the returned sequences; ``tokens_per_s = new_tokens / elapsed_s``.

    Raises:
        ValueError: a non-positive elapsed time, no sequences, or a negative count.
    """
    if not elapsed_s > 0:
        raise ValueError(f"elapsed_s must be positive, got {elapsed_s!r}")
    counts = [int(c) for c in new_tokens_per_sequence]
    if not counts:
        raise ValueError("a sample needs the new-token count of at least one sequence")
    if any(c < 0 for c in counts):
        raise ValueError(f"new-token counts cannot be negative, got {counts}")
    total = sum(counts)
    return {
        "elapsed_s": float(elapsed_s),
        "new_tokens": total,
        "tokens_per_s": total / elapsed_s,
        "new_tokens_per_sequence": counts,
    }


def median_of(values: Sequence[Optional[float]]) -> Optional[float]:
    """Median of the non-``None`` values, ``None`` when there are none."""
    present = [float(v) for v in values if v is not None]
    return statistics.median(present) if present else None


def summarize(samples: Sequence[Dict[str, Any]]) -> Dict[str, Optional[float]]:
    """Medians over the samples (elapsed s, tokens/s, TTFT ms, TPOT ms).

    ``median_tokens_per_s`` is the median of the per-run rates (not total tokens / median time).

    Raises:
        ValueError: on no samples.
    """
    if not samples:
        raise ValueError("no samples to summarize: at least one measured run is needed")
    return {
        "median_elapsed_s": median_of([s["elapsed_s"] for s in samples]),
        "median_tokens_per_s": median_of([s["tokens_per_s"] for s in samples]),
        "median_time_to_first_token_ms": median_of([s.get("time_to_first_token_ms") for s in samples]),
        "median_time_per_output_token_ms": median_of([s.get("time_per_output_token_ms") for s in samples]),
    }
