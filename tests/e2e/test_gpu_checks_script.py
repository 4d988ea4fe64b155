"""``tests/gpu/run_gpu_checks.sh --dry-run``: the GPU checks' script, whose figures BENCHMARKS.md gives, runs
its steps on CPU with a tiny configuration (the ``gpu`` tests skip there), so that the command the page names
is known to run before a GPU is at hand."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_gpu_checks_script_runs_its_steps_on_cpu(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(PYTHON=sys.executable, OUT=str(tmp_path), PATH=f"{pathlib.Path(sys.executable).parent}:{env['PATH']}")
    done = subprocess.run(
        ["tests/gpu/run_gpu_checks.sh", "--dry-run"], capture_output=True, text=True, cwd=ROOT, env=env, timeout=1200
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "(dry run: 1)" in done.stdout
    assert "=== 1. pytest -m gpu tests/gpu ===" in done.stdout
    assert any(tmp_path.iterdir())  # its results are kept in OUT
