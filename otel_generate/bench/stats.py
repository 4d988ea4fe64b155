"""The bench's summaries: one sample per measured run, medians with their interquartile ranges.

Every median the bench reports comes with the interquartile range of the same values: the 25th
and 75th percentiles, by linear interpolation between closest ranks (numpy's default, through
:func:`otel_generate.stats.percentile`). The range says how far apart the runs were; a median
whose runs spread widely is not worth a third digit.
"""

from __future__ import annotations

import math
import statistics
from typing import Any, Dict, List, Optional, Sequence, Tuple

from otel_generate.stats import percentile


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


def _present(values: Sequence[Optional[float]]) -> List[float]:
    return [float(v) for v in values if v is not None]


def median_of(values: Sequence[Optional[float]]) -> Optional[float]:
    """Median of the non-``None`` values, ``None`` when there are none."""
    present = _present(values)
    return statistics.median(present) if present else None


def iqr_of(values: Sequence[Optional[float]]) -> Optional[List[float]]:
    """``[25th percentile, 75th percentile]`` of the non-``None`` values, ``None`` when there are none.

    Linear interpolation between closest ranks (numpy's default); one value gives ``[v, v]``.
    The values keep their unit.
    """
    present = _present(values)
    if not present:
        return None
    return [percentile(present, 25), percentile(present, 75)]


def with_iqr(result: Dict[str, Any], name: str, values: Sequence[Optional[float]]) -> None:
    """Set ``result["median_<name>"]`` and ``result["iqr_<name>"]`` from ``values``."""
    result[f"median_{name}"] = median_of(values)
    result[f"iqr_{name}"] = iqr_of(values)


#: The confidence the bench's intervals aim for; fewer than 6 values cannot reach it (:func:`median_rank`).
CONFIDENCE = 0.95


def median_rank(count: int, confidence: float = CONFIDENCE) -> Tuple[int, float]:
    """The order statistics that bound a distribution-free confidence interval of the median of ``count``
    values: ``(k, achieved)``, the interval being the ``k``-th smallest to the ``k``-th largest value.

    Whatever the distribution, each value falls below the true median with probability 1/2, so the
    interval misses it with probability ``2 * P(B <= k - 1)``, ``B`` binomial (``count``, 1/2): the
    interval of the sign test. ``k`` is the largest rank whose interval covers the median with
    probability ``confidence`` or more; when even the smallest and largest values do not reach it
    (fewer than 6 values for 95 %), ``k`` is 1 and ``achieved`` says how far they do (3 values: 0.75).
    One value gives no interval: ``(1, 0.0)``.

    Raises:
        ValueError: ``count`` below 1, or ``confidence`` outside (0, 1).
    """
    if count < 1:
        raise ValueError(f"a confidence interval of the median needs at least one value, got {count}")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be between 0 and 1, got {confidence!r}")
    below = 0  # P(B <= k - 1), summed as k grows
    k, achieved = 1, 1.0 - 2 * 0.5**count
    for rank in range(1, (count + 1) // 2 + 1):
        below += math.comb(count, rank - 1) / 2**count
        coverage = 1.0 - 2 * below
        if coverage < confidence:
            break
        k, achieved = rank, coverage
    return k, max(achieved, 0.0)


def median_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> Tuple[List[float], float]:
    """``([low, high], achieved)``: the distribution-free confidence interval of the median of ``values``
    (:func:`median_rank`: the ``k``-th smallest and ``k``-th largest value) and the confidence it has.

    Raises:
        ValueError: no values.
    """
    ordered = sorted(float(v) for v in values)
    k, achieved = median_rank(len(ordered), confidence)
    return [ordered[k - 1], ordered[-k]], achieved


def median_iqr_text(
    median: Optional[float], iqr: Optional[Sequence[float]], fmt: str, scale: float = 1.0, unit: str = ""
) -> str:
    """``"1.234 ms (IQR 1.200 to 1.300 ms)"``; ``"n/a"`` without a value (the summaries' format)."""
    if median is None:
        return "n/a"
    unit = f" {unit}" if unit else ""
    text = f"{format(median * scale, fmt)}{unit}"
    if iqr is not None:
        text += f" (IQR {format(iqr[0] * scale, fmt)} to {format(iqr[1] * scale, fmt)}{unit})"
    return text


def summarize(samples: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """Medians and interquartile ranges over the samples (elapsed s, tokens/s, TTFT ms, TPOT ms).

    Each ``median_X`` has an ``iqr_X``: ``[25th, 75th percentile]`` of the same values, same unit.
    ``median_tokens_per_s`` is the median of the per-run rates (not total tokens / median time).

    Raises:
        ValueError: on no samples.
    """
    if not samples:
        raise ValueError("no samples to summarize: at least one measured run is needed")
    columns = {
        "elapsed_s": [s["elapsed_s"] for s in samples],
        "tokens_per_s": [s["tokens_per_s"] for s in samples],
        "time_to_first_token_ms": [s.get("time_to_first_token_ms") for s in samples],
        "time_per_output_token_ms": [s.get("time_per_output_token_ms") for s in samples],
    }
    result: Dict[str, Any] = {}
    for name, values in columns.items():
        with_iqr(result, name, values)
    return result


def per_token_index(samples: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Step latencies grouped by token index, with the median and quartiles at each index.

    A step's token index is the index (from 0) of the first token it appended to each sequence:
    the running sum of ``step_tokens`` before it. Runs that stopped early (EOS) simply have no
    value at the later indices, so ``runs`` can shrink along the curve.

    Returns:
        one entry per token index that any run reached, ascending:
        ``{"token_index", "runs", "median_ms", "q1_ms", "q3_ms"}`` (milliseconds).
    """
    by_index: Dict[int, List[float]] = {}
    for sample in samples:
        latencies = sample.get("step_latencies_ms") or []
        tokens = sample.get("step_tokens") or [1] * len(latencies)
        index = 0
        for latency, count in zip(latencies, tokens):
            by_index.setdefault(index, []).append(float(latency))
            index += int(count)
    rows = []
    for index in sorted(by_index):
        values = by_index[index]
        rows.append(
            {
                "token_index": index,
                "runs": len(values),
                "median_ms": statistics.median(values),
                "q1_ms": percentile(values, 25),
                "q3_ms": percentile(values, 75),
            }
        )
    return rows
