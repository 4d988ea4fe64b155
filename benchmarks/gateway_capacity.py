"""One gateway's capacity, offered rate × 1, × 2, × 4, ...: the figures and plot of docs/scaling.md.

For each rate, from ``--start`` doubling up to ``--stop`` (or until the gateway refuses spans):
``collector/local.sh down``, ``collector/local.sh up --scale --fresh`` (a new gateway, an empty
Jaeger), then ``collector/loadtest.sh --rate RATE --seconds S`` into one gateway. Writes

* ``--table`` (markdown): the machine, the versions, the command, the date, one row per rate and
  the figures derived from them: the memory a held trace costs (the slope of the gateway's peak
  RSS over the traces it held at the peak, least squares over the runs) and the CPU a span costs;
* ``--plot`` (PNG, matplotlib): spans taken in and exported per second, and the gateway's peak
  RSS and CPU, against the offered rate;
* ``--json``: every run's lines and details.

    python benchmarks/gateway_capacity.py        # about 2 min a rate; the stack must not be up

(With ``OTEL_GENERATE_LOCAL_STATE`` and the port variables of collector/ports.sh it runs a stack of
its own, beside another one on the default ports.)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOCAL_SH = REPO / "collector" / "local.sh"
LOADTEST_SH = REPO / "collector" / "loadtest.sh"
NAMES = (
    "SENT",
    "ACCEPTED",
    "REFUSED",
    "EXPORTED_TO_JAEGER",
    "IN_JAEGER",
    "GATEWAY_CPU_PERCENT",
    "GATEWAY_RSS_MB",
    "HELD_TRACES_PEAK",
)


def run(command: list, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, **kwargs)


def one_rate(rate: int, seconds: float, extra: list) -> dict:
    down = run([str(LOCAL_SH), "down"], timeout=120)
    assert down.returncode == 0, down.stderr
    up = run([str(LOCAL_SH), "up", "--scale", "--fresh"], timeout=1800)
    assert up.returncode == 0, up.stderr
    with tempfile.NamedTemporaryFile(suffix=".json") as details:
        result = run(
            [str(LOADTEST_SH), "--rate", str(rate), "--seconds", str(seconds), "--json", details.name, *extra],
            timeout=1800,
            env=dict(os.environ, PYTHON=sys.executable),
        )
        lines = {}
        for line in result.stdout.splitlines():
            name, _, value = line.partition("=")
            if name in NAMES:
                lines[name] = float(value)
        detail = json.loads(Path(details.name).read_text() or "{}") if result.returncode in (0, 1) else {}
    assert set(lines) == set(NAMES), f"rate {rate}: {result.stdout}\n{result.stderr[-3000:]}"
    print(f"rate {rate}: {lines}", file=sys.stderr)
    print(result.stderr.strip().splitlines()[-1], file=sys.stderr)
    return {
        "rate": rate,
        "seconds": seconds,
        "lines": lines,
        "details": detail,
        "exit": result.returncode,
        "machine": machine(),
        "date": datetime.date.today().isoformat(),
    }


def fit_slope(xs: list, ys: list) -> float:
    """Least-squares slope of ys over xs."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def versions() -> str:
    build = (REPO / "collector" / "build.sh").read_text()
    jaeger = [line.split("=")[1].split()[0] for line in build.splitlines() if line.startswith("JAEGER_VERSION=")][0]
    ocb = [line.split("=")[1].split()[0] for line in build.splitlines() if line.startswith("OCB_VERSION=")][0]
    return f"Collector {ocb} (tail_sampling num_shards 1), Jaeger {jaeger} (Badger), Python {platform.python_version()}"


def machine() -> str:
    model = ""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
            break
    load = os.getloadavg()
    return f"{os.cpu_count()} cores ({model}), load average {load[0]:.1f} at the end (a machine shared with other work)"


def table(runs: list, command: str) -> str:
    rows = [
        "| asked spans/s | sent spans/s | ACCEPTED | REFUSED | EXPORTED_TO_JAEGER | IN_JAEGER |"
        " GATEWAY_CPU_PERCENT | GATEWAY_RSS_MB | HELD_TRACES_PEAK |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        v = r["lines"]
        sent_rate = r["details"].get("offered_rate", v["SENT"] / r["seconds"])
        rows.append(
            f"| {r['rate']:,} | {sent_rate:,.0f} | {v['ACCEPTED']:,.0f} | {v['REFUSED']:,.0f} |"
            f" {v['EXPORTED_TO_JAEGER']:,.0f} | {v['IN_JAEGER']:,.0f} | {v['GATEWAY_CPU_PERCENT']:.1f} |"
            f" {v['GATEWAY_RSS_MB']:,.0f} | {v['HELD_TRACES_PEAK']:,.0f} |"
        )
    held = [r["lines"]["HELD_TRACES_PEAK"] for r in runs]
    rss = [r["lines"]["GATEWAY_RSS_MB"] for r in runs]
    per_trace_mib = fit_slope(held, rss)
    spans_per_trace = runs[0]["details"].get("spans_per_trace", {}).get("normal", 0)
    # CPU per span: the slope of CPU over the rate sent, over the runs where the sender kept up
    kept_up = [r for r in runs if r["details"].get("offered_rate", 0) >= 0.95 * r["rate"]]
    cpu_slope = fit_slope(
        [r["details"]["offered_rate"] for r in kept_up], [r["lines"]["GATEWAY_CPU_PERCENT"] for r in kept_up]
    )
    top = max(runs, key=lambda r: r["lines"]["ACCEPTED"])
    lines = [
        f"Machine: {runs[-1].get('machine') or machine()}. Versions: {versions()}."
        f" Date: {runs[-1].get('date') or datetime.date.today().isoformat()}.",
        f"Command, per rate: `collector/local.sh up --scale --fresh`, then `{command}`"
        " (into otel-gateway-1: gzip, 10 requests in flight, about 512 spans a request, traces of"
        f" {spans_per_trace} spans, 1 % errors, 1 % with a slow step; decision_wait 10 s).",
        "",
        *rows,
        "",
        f"Memory per held trace (slope of GATEWAY_RSS_MB over HELD_TRACES_PEAK): {per_trace_mib * 1024:,.0f} KiB"
        f" per trace of {spans_per_trace} spans, {per_trace_mib * 2**20 / max(spans_per_trace, 1):,.0f} bytes per"
        " held span.",
        f"CPU per span taken in (slope of GATEWAY_CPU_PERCENT over the rate sent, where the sender kept up):"
        f" {cpu_slope * 1e4:.1f} µs; 70 % of a core at that cost: {70 / cpu_slope:,.0f} spans/s.",
        f"Most taken in: {top['lines']['ACCEPTED'] / top['seconds']:,.0f} spans/s (asked {top['rate']:,}), at"
        f" {top['lines']['GATEWAY_CPU_PERCENT']:.1f} % of a core; REFUSED stayed"
        f" {'0' if all(r['lines']['REFUSED'] == 0 for r in runs) else 'above 0 in some runs'}.",
        f"In one line: one gateway kept up with its sender up to {kept_up[-1]['details']['offered_rate']:,.0f}"
        f" spans/s at {kept_up[-1]['lines']['GATEWAY_CPU_PERCENT']:.0f} % of a core; asked for more, it took in at"
        f" most {top['lines']['ACCEPTED'] / top['seconds']:,.0f} spans/s and slowed its sender rather than refuse,"
        " its memory growing with the traces it held for their decision.",
    ]
    return "\n".join(lines)


def plot(runs: list, target: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    asked = [r["rate"] for r in runs]
    taken = [r["lines"]["ACCEPTED"] / r["seconds"] for r in runs]
    exported = [r["lines"]["EXPORTED_TO_JAEGER"] / r["seconds"] for r in runs]
    rss = [r["lines"]["GATEWAY_RSS_MB"] for r in runs]
    cpu = [r["lines"]["GATEWAY_CPU_PERCENT"] for r in runs]
    held = [r["lines"]["HELD_TRACES_PEAK"] for r in runs]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    left.plot(asked, asked, ":", color="grey", label="offered = asked")
    left.plot(asked, taken, "o-", label="taken in (ACCEPTED / s)")
    left.plot(asked, exported, "s-", label="exported to Jaeger / s")
    left.set_xscale("log", base=2)
    left.set_yscale("log", base=2)
    left.set_xticks(asked, [f"{a // 1000}k" for a in asked])
    left.set_xlabel("asked rate, spans/s")
    left.set_ylabel("spans/s")
    left.set_title("Throughput of one gateway")
    left.legend()
    left.grid(True, which="both", alpha=0.3)
    right.plot(asked, rss, "o-", color="tab:red", label="peak RSS, MiB (labels: traces held at the peak)")
    right.set_xscale("log", base=2)
    right.set_xticks(asked, [f"{a // 1000}k" for a in asked])
    right.set_xlabel("asked rate, spans/s")
    right.set_ylabel("MiB")
    for x, y, h in zip(asked, rss, held):
        right.annotate(f"{h:,.0f}", (x, y), textcoords="offset points", xytext=(-12, 8), fontsize=7)
    twin = right.twinx()
    twin.plot(asked, cpu, "s--", color="tab:green", label="CPU, % of one core")
    twin.set_ylabel("% of one core")
    right.set_title("Memory and CPU of one gateway (decision_wait 10 s)")
    handles = right.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
    right.legend(handles, [h.get_label() for h in handles], loc="upper left")
    right.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    target.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(target, dpi=110)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--start", type=int, default=2000)
    parser.add_argument("--stop", type=int, default=256_000)
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--table", type=Path, default=REPO / "docs" / "images" / "gateway-capacity.md")
    parser.add_argument("--plot", type=Path, default=REPO / "docs" / "images" / "gateway-capacity.png")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--from-json", type=Path, help="redo the table and plot of a saved --json, running nothing")
    args, extra = parser.parse_known_args(argv)
    if args.from_json:
        runs = json.loads(args.from_json.read_text())
        command = f"collector/loadtest.sh --rate RATE --seconds {runs[0]['seconds']:g}"
        args.table.write_text(table(runs, command) + "\n")
        plot(runs, args.plot)
        print(args.table.read_text())
        return 0
    runs = []
    rate = args.start
    try:
        while rate <= args.stop:
            try:
                runs.append(one_rate(rate, args.seconds, extra))
            except AssertionError as error:  # once more, on a new stack
                print(f"rate {rate} failed, once more: {str(error)[-2000:]}", file=sys.stderr)
                runs.append(one_rate(rate, args.seconds, extra))
            if runs[-1]["lines"]["REFUSED"] > 0:
                break
            rate *= 2
    finally:
        run([str(LOCAL_SH), "down"], timeout=120)
    command = f"collector/loadtest.sh --rate RATE --seconds {args.seconds:g} {' '.join(extra)}".strip()
    text = table(runs, command)
    args.table.write_text(text + "\n")
    plot(runs, args.plot)
    if args.json:
        args.json.write_text(json.dumps(runs, indent=2))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
