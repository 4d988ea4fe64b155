"""``collector/loadtest.sh`` against the real scale tier (``collector/local.sh up --scale``).

``collector/loadtest.sh --rate 2000 --seconds 20`` sends traces shaped like this package's (a
request span and 256 step spans each, 1 % errors, 1 % with a slow step) into one gateway and
prints exactly its eight ``NAME=value`` lines. Checked here: nothing is refused, every span sent
is accepted, what the gateways exported is what Jaeger holds, and, read back from Jaeger's API
independently of the script, every trace sent is there with its request span, and every trace
with step spans (kept by tail sampling) has all of them. The figures of docs/scaling.md come from
the same command at the rates it names (``benchmarks/gateway_capacity.py``).

Skips (or, with ``OTEL_GENERATE_REQUIRE_BACKENDS=1`` / ``CI=true``, fails) without Go.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from otel_generate import attributes as A
from tests.helpers.local_stack import jaeger_traces, local_stack, parse_lines, span_tags

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
LOADTEST_SH = REPO / "collector" / "loadtest.sh"
NAMES = [
    "SENT",
    "ACCEPTED",
    "REFUSED",
    "EXPORTED_TO_JAEGER",
    "IN_JAEGER",
    "GATEWAY_CPU_PERCENT",
    "GATEWAY_RSS_MB",
    "HELD_TRACES_PEAK",
]
STEP_NAMES = (A.STEP_SPAN_PREFILL, A.STEP_SPAN_DECODE)
RATE, SECONDS = 2000, 20


def _loadtest(*args: str, state: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, OTEL_GENERATE_LOCAL_STATE=str(state), PYTHON=sys.executable)
    return subprocess.run([str(LOADTEST_SH), *args], capture_output=True, text=True, timeout=900, env=env)


def test_loadtest_at_2000_spans_per_second_refuses_nothing_and_keeps_traces_whole(tmp_path):
    state = tmp_path / "state"
    service = "otel-generate-e2e-loadtest"
    with local_stack("--scale", state=state) as stack:
        result = _loadtest("--rate", str(RATE), "--seconds", str(SECONDS), "--service", service, state=state)
        assert result.returncode == 0, result.stderr[-5000:]
        names = [line.split("=", 1)[0] for line in result.stdout.splitlines()]
        assert names == NAMES, result.stdout  # exactly these lines, in this order
        figures = {name: float(value) for name, value in parse_lines(result.stdout).items()}
        traces = jaeger_traces(stack["JAEGER_UI"], service, limit=5000)

    assert figures["REFUSED"] == 0
    assert figures["ACCEPTED"] == figures["SENT"]
    assert abs(figures["SENT"] - RATE * SECONDS) <= 0.05 * RATE * SECONDS, figures
    assert figures["EXPORTED_TO_JAEGER"] == figures["IN_JAEGER"] == sum(len(t["spans"]) for t in traces)
    assert 0 < figures["GATEWAY_CPU_PERCENT"] < 200 and figures["GATEWAY_RSS_MB"] > 0
    assert figures["HELD_TRACES_PEAK"] > 0

    # every trace sent is in Jaeger; a trace with step spans has all of them (tail sampling keeps
    # or drops a trace whole), the request span always
    spans_per_trace = 1 + 256
    assert len(traces) * spans_per_trace >= figures["SENT"] * 0.95, len(traces)
    kept = 0
    for trace in traces:
        spans = trace["spans"]
        (request,) = [s for s in spans if s["operationName"].startswith(A.OPERATION_TEXT_COMPLETION + " ")]
        steps = [s for s in spans if s["operationName"] in STEP_NAMES]
        ids = [s["spanID"] for s in spans]
        assert len(ids) == len(set(ids)), "a span delivered twice"
        if steps:
            kept += 1
            assert len(steps) == span_tags(request)[A.GENERATE_STEPS], f"trace {trace['traceID']} is partial"
    # the errors and the slow steps (2 % of the traces) and 5 % of the rest are kept
    assert 0 < kept < len(traces)


def test_loadtest_without_the_scale_tier_says_so(tmp_path):
    result = _loadtest("--rate", "100", "--seconds", "1", state=tmp_path / "empty")
    assert result.returncode == 1
    assert "run collector/local.sh up --scale first" in result.stderr
    assert result.stdout == ""
    bad = _loadtest("--rate", "100", state=tmp_path / "empty")
    assert bad.returncode == 2 and "usage:" in bad.stderr
