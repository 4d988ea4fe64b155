"""``--plot``: the per-token latency of the measured runs."""

from __future__ import annotations

from typing import Any, Dict

from otel_generate.bench.harness import BenchUsageError


def plot_latencies(result: Dict[str, Any], path: str) -> None:
    """Write a PNG of the per-token latency of the measured runs (matplotlib's Agg canvas).

    x: token index in the continuation (of the step's first token), y: step latency in
    milliseconds; one line per run; the first token (the prefill step) is marked.

    Raises:
        BenchUsageError: matplotlib is not installed.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise BenchUsageError("--plot needs matplotlib, which is not installed: pip install matplotlib (the package's [plot] extra)") from None

    figure = Figure(figsize=(8, 4.5), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot(1, 1, 1)
    first_marked = False
    many = len(result["samples"]) > 8
    for run, sample in enumerate(result["samples"]):
        latencies = sample.get("step_latencies_ms") or []
        tokens = sample.get("step_tokens") or [1] * len(latencies)
        if not latencies:
            continue
        index, xs = 0, []
        for count in tokens:
            xs.append(index)
            index += count
        label = (f"measured runs ({len(result['samples'])})" if run == 0 else None) if many else f"run {run + 1}"
        axes.plot(xs, latencies, linewidth=1, alpha=0.8, label=label)
        axes.plot(
            [xs[0]], [latencies[0]], linestyle="none", marker="o", color="red", markersize=7,
            label=None if first_marked else "first token (prefill)",
        )
        first_marked = True
    axes.set_xlabel("token index")
    axes.set_ylabel("latency (ms)")
    axes.set_title(
        f"per-token latency: {result.get('model', '')}\n{result['device']}, {result['dtype']}, "
        f"{result['threads']} thread(s), batch {result['batch_size']}, prompt {result['prompt_tokens']} tokens",
        fontsize=9,
    )
    axes.set_ylim(bottom=0)
    axes.grid(True, alpha=0.3)
    axes.legend(fontsize=8, loc="upper right")
    figure.tight_layout()
    figure.savefig(path, format="png")
