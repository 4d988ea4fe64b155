"""``otel-generate bench --instructions``: instruction counts under valgrind's callgrind.

The full run is slow (valgrind runs the program about 50 times slower) and is skipped where
valgrind is not installed; ``.ci/run`` installs it. What needs neither valgrind nor a model (bad inputs,
the configurations, the difference method) is in tests/unit/test_bench_instructions_config.py.
"""

from __future__ import annotations

import json
import shutil

import pytest

from tests.helpers.bench import run_cli


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("valgrind") is None, reason="valgrind is not installed (.ci/run installs it)")
def test_instructions_counts_what_the_instrumentation_adds(tmp_path, capsys):
    out = tmp_path / "instructions.json"
    # the three configurations of the cost targets, each in two processes (the caller's thread, all threads)
    configurations = ["all-step-spans", "step-spans-none", "unsampled"]
    argv = ["--instructions", "--new-tokens", "16", "--warmup", "2", "--pairs", "4"]
    argv += ["--configurations", ",".join(configurations)]
    assert run_cli(*argv, "--output", str(out), "--progress") == 0
    doc = json.loads(out.read_text())
    rows = {row["configuration"]: row for row in doc["configurations"]}
    assert list(rows) == configurations
    for name, row in rows.items():
        # a 16-token call of the tiny GPT-2 executes tens of millions of instructions, on the caller's thread
        assert row["plain_per_call"] > 1e7 and row["caller_plain_per_call"] > 1e7 and row["steps_per_call"] == 16
        assert row["outputs_identical"] is True and row["pairs"] == row["caller_pairs"] == 4
        if row["spans_expected_per_call"] is not None:
            assert row["spans_per_call"] == row["spans_expected_per_call"], name
        assert row["added_percent"] == pytest.approx(100 * row["added_per_call"] / row["plain_per_call"])
        # every thread: the request's spans and metrics are built (each record() alone is tens of thousands)
        assert row["added_per_call"] > 1e6, name
        # the caller's thread pays less than every thread: the background emitter builds them
        assert row["caller_added_per_call"] < row["added_per_call"], name
    assert rows["all-step-spans"]["spans_per_call"] == 17 and rows["unsampled"]["spans_per_call"] == 0
    captured = capsys.readouterr()
    report = captured.out  # on stdout; the progress on stderr
    assert "instructions are not time" in report and "the caller's thread" in report and "all-step-spans" in report
    # --progress: the processes done, from the parent (each configuration twice, one per thread view: 6)
    progress = [line for line in captured.err.splitlines() if line.startswith("otel-generate bench: callgrind")]
    assert progress[0].startswith("otel-generate bench: callgrind, one process per configuration and thread view: 0/6")
    assert " 6/6 processes [" in progress[-1], progress
