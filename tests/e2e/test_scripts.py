"""The scripts a user runs: each answers ``--help``, and ``collector/build.sh`` says how long it builds.

* ``--help`` on every script (the executable ``.sh`` files of collector/ and tests/, every
  ``benchmarks/*.py``): exit status 0, the usage on stdout, and named in it every option the script
  accepts (the ``--options`` of its ``case`` arms, or of its ``argparse`` parser) and every environment
  variable it reads (``${NAME:-...}`` in the script and in the files it sources; ``os.environ`` and
  ``os.getenv`` in Python), so that a new option or variable without help fails here. It starts
  nothing: stand-ins for ``go``, ``prometheus``, ``phoenix``, ``curl``, ... on ``PATH`` record any call,
  and the cache, state and output folders it is given stay absent. It uses under a second of CPU time
  (CPU time, not wall time, so that other work on a shared machine does not fail it).
* ``collector/build.sh`` with an empty cache and a stand-in ``go`` that takes seconds per step (the
  builder it installs writes a stand-in Collector, ``go build`` a stand-in Jaeger): it says first what
  it will build and how long that took on the machine of BENCHMARKS.md (the figures of that page's
  table), then prints a line with the time so far at least every ``OTEL_GENERATE_BUILD_PROGRESS_S``
  seconds while ``go`` runs, and at the end where the binaries are cached. Stopping it stops ``go``.
"""

from __future__ import annotations

import os
import re
import resource
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BUILD_SH = REPO / "collector" / "build.sh"
LOCAL_SH = REPO / "collector" / "local.sh"
#: programs a script could start work with; on PATH as stand-ins that record the call
STARTERS = ("go", "prometheus", "promtool", "phoenix", "curl", "setsid", "flock", "nvidia-smi", "valgrind", "docker")


def _scripts() -> list:
    shell = [
        path
        for folder in ("collector", "tests")
        for path in sorted((REPO / folder).rglob("*.sh"))
        if os.access(path, os.X_OK)
    ]
    return shell + sorted((REPO / "benchmarks").glob("*.py"))


SCRIPTS = _scripts()


def _sourced(script: Path) -> list:
    """The files a shell script sources from its own folder (``. "$HERE/ports.sh"``)."""
    return [script.parent / name for name in re.findall(r'^\s*\.\s+"\$HERE/([\w.]+)"', script.read_text(), re.M)]


def environment_variables(script: Path) -> set:
    """The environment variables a script reads: ``${NAME:-default}`` (shell, its sourced files too) or
    ``os.environ.get("NAME")``, ``os.environ["NAME"]``, ``os.getenv("NAME")`` (Python)."""
    if script.suffix == ".py":
        text = script.read_text()
        return set(re.findall(r"""os\.(?:environ\.get\(|environ\[|getenv\()\s*["']([A-Z][A-Z0-9_]*)["']""", text))
    names = set()
    for path in [script, *_sourced(script)]:
        names |= set(re.findall(r"\$\{([A-Z][A-Z0-9_]*):?[-=]", path.read_text()))
    return names


def options(script: Path) -> set:
    """The ``--options`` a script accepts: those of its ``case`` arms (shell) or of ``add_argument`` (Python)."""
    text = script.read_text()
    if script.suffix == ".py":
        calls = re.findall(r"add_argument\(([^)]*)\)", text)
        return {name for call in calls for name in re.findall(r"""["'](--[\w-]+)["']""", call)}
    arms = re.findall(r'^\s*((?:"?-[\w-]+(?:=\*)?"?|"")(?:\s*\|\s*(?:"?-[\w-]+(?:=\*)?"?|""))*)\)', text, re.M)
    return {name for arm in arms for name in re.findall(r"--[\w-]+", arm)}


def _stand_ins(folder: Path, log: Path) -> Path:
    folder.mkdir()
    for name in STARTERS:
        path = folder / name
        path.write_text(f'#!/bin/sh\necho "{name} $*" >>"{log}"\n')
        path.chmod(0o755)
    return folder


def test_the_scripts_were_found():
    names = {str(path.relative_to(REPO)) for path in SCRIPTS}
    assert {
        "collector/local.sh",
        "collector/build.sh",
        "collector/loadtest.sh",
        "tests/gpu/run_gpu_checks.sh",
        "benchmarks/gateway_capacity.py",
    } <= names, names
    # the other shell files of collector/ are sourced by a script, not run
    for path in (REPO / "collector").glob("*.sh"):
        if path not in SCRIPTS:
            assert any(path in _sourced(script) for script in SCRIPTS), f"{path.name}: neither run nor sourced"


def test_the_checks_read_what_the_scripts_say():
    """The extraction above, on the scripts the issue names: a broken pattern would make the help test vacuous."""
    assert {"OTEL_GENERATE_LOCAL_STATE", "PROMETHEUS", "OTEL_GENERATE_PHOENIX_BIN", "JAEGER_UI_PORT"} <= (
        environment_variables(LOCAL_SH)
    )
    assert {"OTEL_GENERATE_CACHE", "OTEL_GENERATE_BUILD_PROGRESS_S"} <= environment_variables(BUILD_SH)
    assert {"--scale", "--fresh", "--ui", "--all"} <= options(LOCAL_SH)
    assert {"--rate", "--seconds", "--steps", "--compression"} <= options(REPO / "collector" / "loadtest.sh")
    assert {"--repeats", "--calls"} <= options(REPO / "benchmarks" / "step_hook.py")


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: str(path.relative_to(REPO)))
def test_help_names_every_option_and_variable_and_starts_nothing(script, tmp_path):
    log = tmp_path / "started.log"
    bin_dir = _stand_ins(tmp_path / "bin", log)
    work = tmp_path / "work"
    work.mkdir()
    env = dict(
        os.environ,
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        PYTHONPATH=str(REPO),
        OTEL_GENERATE_CACHE=str(tmp_path / "cache"),
        OTEL_GENERATE_LOCAL_STATE=str(tmp_path / "state"),
        OUT=str(tmp_path / "out"),
        PYTHON=str(bin_dir / "go"),  # an interpreter that would record its call
    )
    command = [sys.executable, str(script)] if script.suffix == ".py" else [str(script)]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    done = subprocess.run([*command, "--help"], capture_output=True, text=True, cwd=work, env=env, timeout=60)
    wall_s = time.monotonic() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)

    assert done.returncode == 0, done.stderr
    text = done.stdout
    assert len(text.splitlines()) >= 5, text
    assert "usage" in text.lower() or str(script.relative_to(REPO)) in text, text[:500]
    missing_options = sorted(name for name in options(script) if name not in text)
    assert not missing_options, f"options missing from {script.name} --help: {missing_options}"
    missing_variables = sorted(name for name in environment_variables(script) if name not in text)
    assert not missing_variables, f"environment variables missing from {script.name} --help: {missing_variables}"
    # it started nothing
    assert not log.exists(), log.read_text()
    for folder in ("cache", "state", "out"):
        assert not (tmp_path / folder).exists(), f"--help wrote {folder}"
    assert not any(work.iterdir()), list(work.iterdir())
    assert cpu_s < 1.0, f"--help took {cpu_s:.2f} s of CPU"
    assert wall_s < 30, f"--help took {wall_s:.1f} s"


def test_local_sh_help_gives_the_commands_and_what_moves_the_state():
    text = subprocess.run([str(LOCAL_SH), "--help"], capture_output=True, text=True, timeout=60, check=True).stdout
    for needle in (
        "local.sh up",
        "--scale",
        "--fresh",
        "--ui phoenix",
        "local.sh down",
        "down --all",
        "local.sh status",
    ):
        assert needle in text, needle
    assert "OTEL_GENERATE_LOCAL_STATE" in text and "PROMETHEUS" in text
    # a subcommand's --help is the help too, and starts nothing
    again = subprocess.run([str(LOCAL_SH), "up", "--help"], capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and again.stdout == text


def test_build_sh_refuses_an_unknown_option_and_a_bad_interval(tmp_path):
    env = dict(os.environ, OTEL_GENERATE_CACHE=str(tmp_path / "cache"))
    bad = subprocess.run([str(BUILD_SH), "--bogus"], capture_output=True, text=True, env=env, timeout=60)
    assert bad.returncode == 2 and "unknown option --bogus" in bad.stderr
    env["OTEL_GENERATE_BUILD_PROGRESS_S"] = "0"
    bad = subprocess.run([str(BUILD_SH)], capture_output=True, text=True, env=env, timeout=60)
    assert bad.returncode == 2 and "OTEL_GENERATE_BUILD_PROGRESS_S=0" in bad.stderr
    assert not (tmp_path / "cache").exists()


# =============================================================================================
# collector/build.sh: what it builds, how long, progress, where
# =============================================================================================

#: a stand-in for `go`: each call sleeps FAKE_GO_S, then `go install` writes a stand-in builder
#: (which sleeps too and writes a stand-in Collector where its manifest's output_path says) and
#: `go build -o PATH` a stand-in Jaeger; its pid goes to FAKE_GO_PIDS
FAKE_GO = textwrap.dedent(
    """\
    #!/usr/bin/env bash
    set -eu
    echo $$ >>"$FAKE_GO_PIDS"
    sleep "$FAKE_GO_S"
    case $1 in
    install)
        mkdir -p "$GOBIN"
        cat >"$GOBIN/builder" <<'BUILDER'
    #!/usr/bin/env bash
    set -eu
    echo $$ >>"$FAKE_GO_PIDS"
    out=$(sed -n 's/^  output_path: *//p' "${1#--config=}")
    sleep "$FAKE_GO_S"
    printf '#!/bin/sh\\necho "buildinfo: a stand-in"\\n' >"$out/otelcol-otel-generate"
    chmod +x "$out/otelcol-otel-generate"
    BUILDER
        chmod +x "$GOBIN/builder"
        ;;
    build)
        while (($#)); do
            if [[ $1 == -o ]]; then printf '#!/bin/sh\\n' >"$2" && chmod +x "$2"; fi
            shift
        done
        ;;
    esac
    """
)


def _benchmarks_build_times() -> dict:
    """BENCHMARKS.md's table: the wall time of `collector/build.sh` for each binary from nothing."""
    text = (REPO / "BENCHMARKS.md").read_text()
    return {
        name: int(seconds)
        for name, seconds in re.findall(
            r"^\| `collector/build.sh`, (the Collector|Jaeger) from nothing \| (\d+) s \|$", text, re.M
        )
    }


def _build_sh_constant(name: str) -> int:
    (value,) = re.findall(rf"^{name}=(\d+)$", BUILD_SH.read_text(), re.M)
    return int(value)


def test_build_sh_quotes_the_build_times_of_benchmarks_md():
    times = _benchmarks_build_times()
    assert times == {
        "the Collector": _build_sh_constant("COLLECTOR_BUILD_S"),
        "Jaeger": _build_sh_constant("JAEGER_BUILD_S"),
    }


def test_build_sh_reports_at_least_every_30_s_by_default():
    (default,) = re.findall(r"\$\{OTEL_GENERATE_BUILD_PROGRESS_S:-(\d+)\}", BUILD_SH.read_text())
    assert 1 <= int(default) <= 30


def _fake_go_env(tmp_path: Path, step_s: float, progress_s: int) -> dict:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    go = bin_dir / "go"
    go.write_text(FAKE_GO)
    go.chmod(0o755)
    return dict(
        os.environ,
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        OTEL_GENERATE_CACHE=str(tmp_path / "cache"),
        OTEL_GENERATE_BUILD_PROGRESS_S=str(progress_s),
        FAKE_GO_S=str(step_s),
        FAKE_GO_PIDS=str(tmp_path / "go.pids"),
    )


def test_build_sh_says_what_and_how_long_then_a_line_every_interval_then_where(tmp_path):
    progress_s, step_s = 2, 4
    env = _fake_go_env(tmp_path, step_s, progress_s)
    process = subprocess.Popen(
        [str(BUILD_SH)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, bufsize=1
    )
    lines = []  # (seconds since start, line) of stderr, as they arrive
    start = time.monotonic()
    for line in process.stderr:
        lines.append((time.monotonic() - start, line.rstrip("\n")))
    stdout = process.stdout.read()
    assert process.wait(timeout=60) == 0, "\n".join(line for _, line in lines)
    text = "\n".join(line for _, line in lines)

    # first: what, and how long on the machine of BENCHMARKS.md
    times = _benchmarks_build_times()
    first = lines[0][1]
    assert "the Collector and Jaeger" in first, first
    assert f"{times['the Collector']} s and {times['Jaeger']} s" in first and "BENCHMARKS.md" in first, first
    assert f"every {progress_s} s" in first, first
    # while the stand-in go runs (three calls of step_s each): a line at least every progress_s
    # (slack for the script's half-second polling and a busy machine)
    gaps = [later - earlier for (earlier, _), (later, _) in zip(lines, lines[1:])]
    assert max(gaps) <= progress_s + 2, (gaps, text)
    assert lines[-1][0] >= 3 * step_s - 1, text  # the stand-in's steps did take their time
    for what, steps in (("the Collector", 2), ("Jaeger", 1)):  # the builder's install and its run; go build
        elapsed = [
            int(s)
            for s in re.findall(rf"^build\.sh: {what}(?: \(installing its builder\))?: (\d+) s so far", text, re.M)
        ]
        assert len(elapsed) >= steps * (step_s // progress_s - 1), (what, text)  # each step restarts the count
        assert elapsed == sorted(elapsed), elapsed
    assert re.search(r"so far \(it took 465 s on a 2-core machine\)", text), text
    # last: where the binaries are
    binaries = dict(line.split("=", 1) for line in stdout.splitlines())
    cache = tmp_path / "cache"
    assert lines[-1][1].startswith(f"build.sh: the binaries are cached in {cache}"), lines[-1]
    assert binaries["OTELCOL"] in lines[-1][1] and binaries["JAEGER"] in lines[-1][1]
    assert all(Path(path).is_file() and Path(path).parent.parent == cache for path in binaries.values())

    # a second run finds them: no build, no progress
    again = subprocess.run([str(BUILD_SH)], capture_output=True, text=True, env=env, timeout=60)
    assert again.returncode == 0 and again.stdout == stdout and again.stderr == ""


def _running(pid: int) -> bool:
    """The process exists and has not exited (a zombie not yet reaped does not count)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_stopping_build_sh_stops_go(tmp_path):
    env = _fake_go_env(tmp_path, step_s=60, progress_s=1)
    process = subprocess.Popen([str(BUILD_SH)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        for line in process.stderr:
            if "s so far" in line:
                break
        (go_pid,) = [int(pid) for pid in (tmp_path / "go.pids").read_text().split()]
        os.kill(go_pid, 0)  # running
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) != 0
        deadline = time.monotonic() + 10
        while _running(go_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _running(go_pid), "go still runs after build.sh was stopped"
    finally:
        if process.poll() is None:
            process.kill()
        process.communicate(timeout=30)
