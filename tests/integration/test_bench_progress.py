"""``otel-generate bench`` shows its progress on stderr while it runs: the phase, the runs done of the total
and the time left, from the start; only on a terminal or with ``--progress``; never with ``--quiet``.
Each test runs the console script in a process of its own, as a user does."""

from __future__ import annotations

import json
import os
import pty
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

#: a progress line: "otel-generate bench: <phase>: <done>/<total> runs [...]"
PROGRESS = re.compile(r"otel-generate bench: (?P<phase>[^:]+(?:: [^:]+)?): (?P<done>\d+)/(?P<total>\d+) runs [\[|]")


def _script() -> str:
    script = shutil.which("otel-generate", path=str(Path(sys.executable).parent))
    assert script is not None, "the otel-generate console script is not installed (pip install -e .)"
    return script


def _env():
    env = dict(os.environ)
    env.pop("OTEL_TRACES_EXPORTER", None)
    return env


def test_compare_with_progress_prints_its_first_progress_line_within_5_s(tmp_path):
    out = tmp_path / "compare.json"
    command = [_script(), "bench", "--compare", "--runs", "3", "--progress", "--output", str(out)]
    started = time.monotonic()
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=_env())
    lines = []  # (seconds since the start, line)

    def read():
        for line in proc.stderr:
            lines.append((time.monotonic() - started, line.rstrip("\n")))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert proc.wait(timeout=600) == 0, "\n".join(line for _, line in lines)
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(timeout=60)
    progress = [(at, PROGRESS.match(line)) for at, line in lines if PROGRESS.match(line)]
    assert progress, "\n".join(line for _, line in lines)
    first_at, first = progress[0]
    assert first_at < 5.0, f"the first progress line came after {first_at:.1f} s"
    # 2 warmup + 3 measured runs, then two sets of (2 + 3) pairs: 25 generate() calls
    assert first["phase"].startswith("set-up") and (first["done"], first["total"]) == ("0", "25")
    phases = [m["phase"] for _, m in progress]
    for phase in ("warmup", "measured runs", "compare, instrument() per run", "compare, instrumented once"):
        assert phase in phases, phases
    done = [int(m["done"]) for _, m in progress]
    assert done == sorted(done) and done[-1] == 25
    # no carriage return in a pipe: whole lines, each with the time left
    assert all("\r" not in line for _, line in lines)
    assert all(" left]" in line for _, line in lines if PROGRESS.match(line))
    assert json.loads(out.read_text())["compare"]["pairs"] == 3


def test_without_a_terminal_and_without_progress_no_progress_line_is_printed():
    proc = subprocess.run(
        [_script(), "bench", "--runs", "1", "--warmup", "1", "--new-tokens", "2", "--output", "-"],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    assert not any(PROGRESS.match(line) for line in proc.stderr.splitlines()), proc.stderr
    assert "tokens/s" in proc.stderr  # the report is still printed (on stderr: --output - has stdout)
    assert json.loads(proc.stdout)["runs"] == 1


def _run_on_a_terminal(*argv: str) -> str:
    """Run the bench with stdout and stderr a pseudo-terminal; what it wrote there."""
    master, slave = pty.openpty()
    try:
        proc = subprocess.Popen([_script(), "bench", *argv], stderr=slave, stdout=slave, env=_env(), close_fds=True)
        os.close(slave)
        chunks = []
        while True:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # EIO: the process closed the terminal
                break
            if not chunk:
                break
            chunks.append(chunk)
        assert proc.wait(timeout=600) == 0
        return b"".join(chunks).decode("utf-8", "replace")
    finally:
        os.close(master)


def test_on_a_terminal_progress_is_shown_unasked_and_quiet_silences_it():
    argv = ("--runs", "2", "--warmup", "1", "--new-tokens", "2")
    shown = _run_on_a_terminal(*argv)
    assert "\rotel-generate bench: set-up (torch, transformers, the model): 0/3 runs |" in shown, shown
    assert "otel-generate bench: measured runs: 3/3 runs |" in shown, shown
    quiet = _run_on_a_terminal(*argv, "--quiet")
    assert "runs |" not in quiet and "set-up" not in quiet, quiet
    assert "tokens/s" in quiet  # the report is still printed
