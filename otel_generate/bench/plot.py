"""``--plot``: the per-token latency of the measured runs as one median curve and its interquartile band.

The file format follows the path's extension: ``.png``, ``.svg`` or ``.pdf`` (matplotlib's Agg,
SVG and PDF backends). Any other extension is refused before anything runs, so a ``.jpg`` never
receives PNG bytes.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Optional

from otel_generate.bench.stats import per_token_index

#: Extension (lower case, without the dot) -> the ``format`` handed to ``Figure.savefig``.
PLOT_FORMATS = {"png": "png", "svg": "svg", "pdf": "pdf"}

MATPLOTLIB_MISSING = (
    "--plot needs matplotlib, which is not installed: pip install matplotlib (the package's [plot] extra)"
)


def plot_format(path: str) -> Optional[str]:
    """The format to write ``path`` in, from its extension (case-insensitive); ``None`` if unsupported."""
    extension = os.path.splitext(path)[1].lower().lstrip(".")
    return PLOT_FORMATS.get(extension)


def plot_latencies(result: Dict[str, Any], path: str, fmt: Optional[str] = None) -> None:
    """Write the per-token latency plot of ``result["samples"]`` to ``path``.

    x: token index in the continuation (of each step's first token); y: step latency in
    milliseconds. Drawn: the median over the measured runs at each token index (a line), the
    25th-75th percentile band around it (shaded), and the first token, the prefill step (prompt
    processing plus the first token), marked with its median and interquartile range as a red
    point with an error bar. The data are :func:`otel_generate.bench.stats.per_token_index`.

    Args:
        fmt: ``png``, ``svg`` or ``pdf``; default: from ``path``'s extension (a temporary file
            written before an atomic rename passes the format of the final path).

    Raises:
        ValueError: no supported format (see :data:`PLOT_FORMATS`).
        ImportError: matplotlib is not installed.
    """
    fmt = fmt or plot_format(path)
    if fmt not in PLOT_FORMATS.values():
        raise ValueError(f"unsupported plot format for {path!r}; use one of .{', .'.join(PLOT_FORMATS)}")
    if result.get("mode") == "serve":
        plot_serving(result, path, fmt)
        return
    from matplotlib.figure import Figure

    rows = per_token_index(result["samples"])
    figure = Figure(figsize=(8, 4.5), dpi=100)  # a Figure without pyplot: no GUI backend, no global state
    axes = figure.add_subplot(1, 1, 1)
    runs = len(result["samples"])
    if rows:
        xs = [r["token_index"] for r in rows]
        axes.fill_between(
            xs,
            [r["q1_ms"] for r in rows],
            [r["q3_ms"] for r in rows],
            alpha=0.3,
            linewidth=0,
            label="interquartile range (25th-75th percentile)",
        )
        axes.plot(xs, [r["median_ms"] for r in rows], linewidth=1.5, label=f"median of {runs} measured run(s)")
        first = rows[0]
        axes.errorbar(
            [first["token_index"]],
            [first["median_ms"]],
            yerr=[[first["median_ms"] - first["q1_ms"]], [first["q3_ms"] - first["median_ms"]]],
            linestyle="none",
            marker="o",
            color="red",
            markersize=7,
            capsize=3,
            label="first token: prefill (median, IQR)",
        )
    axes.set_xlabel("token index")
    axes.set_ylabel("step latency (ms)")
    axes.set_title(
        f"per-token latency: {result.get('model', '')}\n{result['device']}, {result['dtype']}, "
        f"{result['threads']} thread(s), batch {result['batch_size']}, prompt {result['prompt_tokens']} tokens",
        fontsize=9,
    )
    axes.set_ylim(bottom=0)
    axes.grid(True, alpha=0.3)
    if rows:
        axes.legend(fontsize=8, loc="upper right")
    figure.tight_layout()
    figure.savefig(path, format=fmt)


#: ``--serve``'s panels: (title, y label, ((figure, line label), ...)).
SERVING_PANELS = (
    ("throughput", "tokens/s", (("tokens_per_s", ""),)),
    ("time to first token", "ms", (("ttft_p50_ms", "p50"), ("ttft_p99_ms", "p99"))),
    ("inter-token latency", "ms", (("itl_p50_ms", "p50"), ("itl_p99_ms", "p99"))),
)
SIDE_STYLES = {"plain": ("tab:blue", "o"), "instrumented": ("tab:orange", "s")}


def plot_serving(result: Dict[str, Any], path: str, fmt: str) -> None:
    """``--serve``'s plot: per offered load (x), plain and instrumented side by side, the median over the
    rounds with its interquartile range as an error bar, of throughput, time to first token (p50, p99) and
    inter-token latency (p50, p99); the median paired ratio instrumented / plain under each load."""
    from matplotlib.figure import Figure

    levels = result["levels"]
    labels = [lv["label"] + (f"\n{lv['offered_rps']:.1f}/s" if lv.get("offered_rps") else "") for lv in levels]
    figure = Figure(figsize=(13, 4.5), dpi=100)
    for column, (title, unit, lines) in enumerate(SERVING_PANELS):
        axes = figure.add_subplot(1, len(SERVING_PANELS), column + 1)
        for offset_line, (name, line) in enumerate(lines):
            for side_index, side in enumerate(("plain", "instrumented")):
                color, marker = SIDE_STYLES[side]
                xs, ys, low, high = [], [], [], []
                for x, level in enumerate(levels):
                    values = level[side]
                    median, iqr = values.get(f"median_{name}"), values.get(f"iqr_{name}")
                    if median is None:
                        continue
                    xs.append(x + (side_index - 0.5) * 0.2 + offset_line * 0.05)
                    ys.append(median)
                    low.append(median - iqr[0])
                    high.append(iqr[1] - median)
                if xs:
                    axes.errorbar(
                        xs,
                        ys,
                        yerr=[low, high],
                        linestyle="none" if not line else ("-" if line == "p99" else ":"),
                        marker=marker,
                        color=color,
                        alpha=1.0 if line != "p50" else 0.6,
                        capsize=3,
                        label=f"{side} {line}".strip(),
                    )
        if column == 0:
            for x, level in enumerate(levels):
                ratio = level["ratios"].get("median_tokens_per_s")
                if ratio is not None:
                    axes.annotate(
                        f"{ratio:.2f}x", (x, 0), xytext=(0, 4), textcoords="offset points", ha="center", fontsize=8
                    )
        axes.set_xticks(range(len(levels)))
        axes.set_xticklabels(labels, fontsize=8)
        axes.set_title(title, fontsize=10)
        axes.set_ylabel(unit)
        axes.set_ylim(bottom=0)
        axes.grid(True, alpha=0.3)
        axes.legend(fontsize=7, loc="best")
    variant = "in-process" if result.get("variant") == "in_process" else "HTTP"
    figure.suptitle(
        f"--serve ({variant}, {result.get('batching')} batching): {result.get('model', '')}, {result['device']}, "
        f"{result['concurrency']} in flight at saturation\nmedian and IQR of {result['runs']} pair(s) of rounds; "
        "under the throughput: the median ratio instrumented / plain",
        fontsize=9,
    )
    figure.tight_layout()
    figure.savefig(path, format=fmt)
