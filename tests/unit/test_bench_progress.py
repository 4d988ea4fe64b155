"""The bench's progress line (otel_generate/bench/progress.py) and its warnings said at once: what is shown,
where, and when; --dry-run. No model is built here (tests/integration/test_bench_progress.py runs the bench)."""

from __future__ import annotations

import io
import os
import re

import pytest

from otel_generate.bench import monitor as bench_monitor
from otel_generate.bench import progress as bench_progress
from otel_generate.bench import runner as bench_runner
from otel_generate.bench.config import BenchConfig
from otel_generate.bench.progress import Progress, wanted
from tests.helpers.bench import run_cli


class _Stream(io.StringIO):
    def __init__(self, terminal: bool) -> None:
        super().__init__()
        self.terminal = terminal

    def isatty(self) -> bool:
        return self.terminal


@pytest.mark.parametrize(
    "progress, quiet, terminal, shown",
    [
        (False, False, True, True),  # a terminal: shown
        (False, False, False, False),  # a pipe or a file: not shown
        (True, False, False, True),  # --progress: shown anywhere
        (False, True, True, False),  # --quiet: never
        (True, True, True, False),
    ],
)
def test_progress_is_shown_on_a_terminal_or_when_asked_never_when_quiet(progress, quiet, terminal, shown):
    assert wanted(progress, quiet, _Stream(terminal)) is shown


def test_without_a_terminal_progress_is_whole_lines_with_the_phase_the_count_and_the_time_left():
    stream = _Stream(terminal=False)
    shown = Progress(enabled=True, stream=stream)
    shown.begin(6, "set-up (torch, transformers, the model)")
    shown.phase("warmup")
    shown.advance(2)
    shown.say("WARNING: something to know at once")
    shown.phase("measured runs")
    shown.advance(4)
    shown.close()
    text = stream.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert lines[0] == "otel-generate bench: set-up (torch, transformers, the model): 0/6 runs [00:00 elapsed, ? left]"
    assert lines[1].startswith("otel-generate bench: warmup: 0/6 runs [")
    assert "WARNING: something to know at once" in lines
    assert re.fullmatch(r"otel-generate bench: measured runs: 6/6 runs \[\d\d:\d\d elapsed, 00:00 left\]", lines[-1])
    assert len(lines) == len(set(lines))  # no line twice (tqdm redraws the last one when it closes)


def test_on_a_terminal_progress_is_redrawn_in_place():
    stream = _Stream(terminal=True)
    shown = Progress(enabled=True, stream=stream)
    shown.begin(3, "pairs")
    shown.advance(3)
    shown.close()
    text = stream.getvalue()
    assert text.startswith("\rotel-generate bench: pairs: 0/3 runs |")
    assert "3/3 runs" in text and text.endswith("\n")


def test_disabled_progress_shows_nothing_but_still_says_warnings():
    stream = _Stream(terminal=False)
    hidden = Progress(enabled=False, stream=stream)
    hidden.begin(3, "pairs")
    hidden.phase("pairs")
    hidden.advance(3)
    hidden.say("WARNING: busy")
    hidden.close()
    assert stream.getvalue() == "WARNING: busy\n"


def test_the_progress_line_starts_no_thread():
    import threading

    before = set(threading.enumerate())
    shown = Progress(enabled=True, stream=_Stream(terminal=False))
    shown.begin(2, "pairs")
    shown.advance(1)
    assert set(threading.enumerate()) == before  # tqdm's monitor thread stays off
    shown.close()


def test_a_busy_machine_is_said_at_the_first_busy_reading_once(monkeypatch):
    loads = iter([(0.2, 0, 0), (5.0, 0, 0), (6.0, 0, 0), (7.0, 0, 0)])
    monkeypatch.setattr(os, "getloadavg", lambda: next(loads))
    said = []
    watched = bench_monitor.LoadMonitor(own_threads=1, cores=2, on_busy=said.append)
    watched.read("start")
    assert said == []
    watched.read("after warmup")
    assert len(said) == 1 and said[0].startswith("WARNING: the machine is busy: 1-minute load average 5.00 at after")
    watched.read("run 1")
    watched.read("end")
    assert len(said) == 1  # once; the report still names the worst reading
    assert "the machine was busy: 1-minute load average 7.00 at end" in watched.report()["warning"]


def test_a_busy_machine_at_the_start_is_said_before_the_model_is_built(monkeypatch, capsys):
    monkeypatch.setattr(os, "getloadavg", lambda: (9.0, 9.0, 9.0))

    class Unbuilt(Exception):
        pass

    def no_model(*args, **kwargs):
        raise Unbuilt

    monkeypatch.setattr(bench_runner, "Runner", no_model)
    with pytest.raises(Unbuilt):
        run_cli("--runs", "1")
    err = capsys.readouterr().err
    assert err.startswith("WARNING: the machine is busy: 1-minute load average 9.00 at start")


def test_progress_and_quiet_together_exit_2(capsys):
    assert run_cli("--progress", "--quiet") == 2
    assert "not allowed with argument" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, expected",
    [
        ([], "2 warmup and 5 measured runs (7 generate() calls)"),
        (["--compare", "--runs", "3"], "then --compare: 2 x (2 + 3) pairs (25 generate() calls)"),
        (["--continuous-batching", "--runs", "4", "--warmup", "1"], "1 warmup and 4 measured pairs of waves of 16"),
        (
            ["--instructions", "--configurations", "all-step-spans,unsampled"],
            "--instructions: 4 processes under callgrind (all-step-spans, unsampled;",
        ),
        # no device is looked for: a CUDA command is checked on a machine without one
        (["--device", "cuda", "--dtype", "bfloat16", "--compare"], "device cuda"),
    ],
)
def test_dry_run_checks_the_options_says_what_would_run_and_runs_nothing(monkeypatch, capsys, argv, expected):
    def nothing_runs(*args, **kwargs):
        raise AssertionError("--dry-run ran the bench")

    monkeypatch.setattr(bench_runner, "Runner", nothing_runs)
    monkeypatch.setattr("otel_generate.bench.cli.run", nothing_runs)
    assert run_cli(*argv, "--dry-run") == 0
    out = capsys.readouterr().out
    assert out.startswith("otel-generate bench --dry-run: the options are valid; nothing was run")
    assert expected in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--runs", "0"], "--runs must be at least 1"),
        (["--instructions", "--configurations", "nope"], "unknown 'nope'"),
        (["--model-config", "/nonexistent/config.json"], "/nonexistent/config.json"),
    ],
)
def test_dry_run_refuses_what_the_bench_refuses(capsys, argv, message):
    assert run_cli(*argv, "--dry-run") == 2
    assert message in capsys.readouterr().err


def test_runs_in_all_counts_every_generate_call():
    assert bench_runner.runs_in_all(BenchConfig(warmup=2, runs=5)) == 7
    # --compare: two sets (instrument() per run, instrumented once) of warmup + runs pairs, two calls each
    assert bench_runner.runs_in_all(BenchConfig(warmup=2, runs=3, compare=True)) == 5 + 2 * 2 * 5


def test_the_interval_without_a_terminal_keeps_logs_short():
    assert bench_progress.LINE_INTERVAL_S >= 1.0
