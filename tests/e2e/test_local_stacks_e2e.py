"""Stacks of ``collector/local.sh`` side by side: each clone manages its own.

Two clones (each a copy of the repository's ``collector/`` folder in a temporary folder of its own:
``local.sh`` keys its state on the folder above ``collector/``) run ``local.sh up`` with no
``OTEL_GENERATE_LOCAL_STATE``, on ports of their own (the variables of ``collector/ports.sh``). Then:

* ``status`` lists both stacks, each with its clone, its processes' pids and its ports;
* ``down`` in the first clone stops the first stack only, and prints each process it stopped (name,
  pid, ports); the second clone's Jaeger, Collector and Prometheus still answer;
* ``down --all`` stops every stack of the user and says so.

The build cache is a temporary folder holding links to the built binaries, so the stacks of the user's
other work are not "every stack" here. Also: the overlay ``collector/phoenix.yaml`` that
``up --ui phoenix`` adds to the Collector's configuration (Phoenix itself: tests/e2e/test_phoenix.py),
and what ``up --ui phoenix`` says when Phoenix is not installed.

The stacks need Go (the binaries) and Debian's ``prometheus``: without them these tests skip, saying
why, or fail where backends are required (``OTEL_GENERATE_REQUIRE_BACKENDS=1``, ``CI=true``).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.helpers.local_stack import SINGLE_PORT_VARS, build, free_ports, parse_lines, require_executable

REPO = Path(__file__).resolve().parents[2]
COLLECTOR = REPO / "collector"
COMPONENTS = {"jaeger", "otel-collector", "prometheus"}
#: a line of `down`: "stopped NAME (pid N, ports P P P) of the TIER tier of CLONE"
STOPPED = re.compile(r"^stopped (\S+) \(pid (\d+), ports ([\d ]+)\) of the (single|scale) tier of (.+)$", re.M)


def _answers(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


def _linked_cache(binaries: dict, cache: Path) -> Path:
    """A build cache of its own with links to the built binaries' folders: build.sh finds them there."""
    cache.mkdir()
    for path in binaries.values():
        folder = Path(path).parent
        (cache / folder.name).symlink_to(folder)
    return cache


class Clone:
    """A clone for local.sh: ``collector/`` copied into ``root``; its ports; its environment."""

    def __init__(self, root: Path, cache: Path, ports: list) -> None:
        root.mkdir()
        shutil.copytree(COLLECTOR, root / "collector", ignore=shutil.ignore_patterns("__pycache__"))
        self.root = root.resolve()
        self.ports = dict(zip(SINGLE_PORT_VARS, ports))
        self.env = {k: v for k, v in os.environ.items() if k != "OTEL_GENERATE_LOCAL_STATE"}
        self.env.update(OTEL_GENERATE_CACHE=str(cache), **{k: str(v) for k, v in self.ports.items()})

    def local_sh(self, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(self.root / "collector" / "local.sh"), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=self.env,
            cwd=self.root,
        )

    def pids(self) -> dict:
        """The pid files of the clone's single tier, wherever local.sh put its state: {name: pid}."""
        found = {}
        for pidfile in (Path(self.env["OTEL_GENERATE_CACHE"]) / "local").glob("*/single/*.pid"):
            if (pidfile.parent / "clone").read_text().strip() == str(self.root):
                found[pidfile.stem] = int(pidfile.read_text().split()[0])
        return found

    def answering(self) -> dict:
        """Each of its processes' checks: every port open, Jaeger's API and Prometheus ready."""
        return {
            **{var: _answers(port) for var, port in self.ports.items()},
            "jaeger api": _http_ok(f"http://127.0.0.1:{self.ports['JAEGER_UI_PORT']}/api/services"),
            "prometheus ready": _http_ok(f"http://127.0.0.1:{self.ports['PROMETHEUS_PORT']}/-/ready"),
        }


def _stopped(stdout: str) -> dict:
    return {
        name: {"pid": int(pid), "ports": [int(p) for p in ports.split()], "tier": tier, "clone": clone}
        for name, pid, ports, tier, clone in STOPPED.findall(stdout)
    }


def _component_ports(clone: Clone) -> dict:
    p = clone.ports
    return {
        "jaeger": [p["JAEGER_OTLP_PORT"], p["JAEGER_UI_PORT"], p["JAEGER_QUERY_GRPC_PORT"]],
        "otel-collector": [p["COLLECTOR_GRPC_PORT"], p["COLLECTOR_HTTP_PORT"], p["COLLECTOR_PROMETHEUS_PORT"]],
        "prometheus": [p["PROMETHEUS_PORT"]],
    }


@pytest.mark.slow
def test_down_in_one_clone_leaves_the_other_clones_stack_running(tmp_path):
    binaries = build()
    require_executable("prometheus", "apt-get install prometheus (Debian's package, 2.42)")
    cache = _linked_cache(binaries, tmp_path / "cache")
    ports = free_ports(2 * len(SINGLE_PORT_VARS))
    first = Clone(tmp_path / "first", cache, ports[: len(SINGLE_PORT_VARS)])
    second = Clone(tmp_path / "second", cache, ports[len(SINGLE_PORT_VARS) :])
    try:
        for clone in (first, second):
            up = clone.local_sh("up")
            assert up.returncode == 0, up.stderr
            endpoints = parse_lines(up.stdout)
            assert endpoints["OTLP_GRPC_ENDPOINT"] == f"http://127.0.0.1:{clone.ports['COLLECTOR_GRPC_PORT']}"
            assert str(clone.root) in up.stderr  # "the single tier of <clone> is up"
        assert all(first.answering().values()) and all(second.answering().values())
        first_pids, second_pids = first.pids(), second.pids()
        assert set(first_pids) == set(second_pids) == COMPONENTS
        # each clone's state is its own folder (no OTEL_GENERATE_LOCAL_STATE)
        states = {p.parent.parent for p in (cache / "local").glob("*/single/*.pid")}
        assert len(states) == 2, states

        # status, from either clone: both stacks, with their clone, pids and ports
        status = first.local_sh("status")
        assert status.returncode == 0, status.stderr
        assert f"{first.root} (this clone): the single tier" in status.stdout, status.stdout
        assert f"{second.root}: the single tier" in status.stdout, status.stdout
        for clone, pids in ((first, first_pids), (second, second_pids)):
            section = status.stdout.split(f"{clone.root}", 1)[1].split("\n/", 1)[0]
            for name, ports in _component_ports(clone).items():
                assert re.search(rf"{name}\s+pid {pids[name]}\s+ports {' '.join(map(str, ports))}\b", section), (
                    name,
                    section,
                )

        # down in the first clone: its stack only, each process named with its pid and ports
        down = first.local_sh("down")
        assert down.returncode == 0, down.stderr
        stopped = _stopped(down.stdout)
        assert set(stopped) == COMPONENTS, down.stdout
        for name, ports in _component_ports(first).items():
            assert stopped[name] == {
                "pid": first_pids[name],
                "ports": ports,
                "tier": "single",
                "clone": str(first.root),
            }
        assert "still running, started by other clones: 1 tier(s)" in down.stdout, down.stdout
        assert not any(first.answering().values()), first.answering()
        assert all(second.answering().values()), second.answering()
        assert second.pids() == second_pids

        again = first.local_sh("down")
        assert again.returncode == 0 and f"nothing to stop: no stack of this clone ({first.root})" in again.stdout

        # down --all, from the first clone: every stack of the user, which it says
        everything = first.local_sh("down", "--all")
        assert everything.returncode == 0, everything.stderr
        assert "stopping every stack of this user" in everything.stdout
        stopped = _stopped(everything.stdout)
        assert set(stopped) == COMPONENTS and {s["clone"] for s in stopped.values()} == {str(second.root)}
        assert {name: s["pid"] for name, s in stopped.items()} == second_pids
        assert not any(second.answering().values()), second.answering()
        assert first.local_sh("status").stdout == "no stack of this user is running\n"
    finally:
        for clone in (first, second):
            clone.local_sh("down")


def test_up_ui_phoenix_without_phoenix_says_how_to_install_it_and_starts_nothing(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "OTEL_GENERATE_PHOENIX_BIN"}
    # a PATH without phoenix: the folders of what local.sh needs, none with a phoenix in it
    folders = {
        str(Path(shutil.which(name)).parent) for name in ("bash", "sed", "sha256sum", "curl") if shutil.which(name)
    }
    env.update(PATH=":".join(f for f in folders if not (Path(f) / "phoenix").exists()))
    env["OTEL_GENERATE_LOCAL_STATE"] = str(tmp_path / "state")
    result = subprocess.run(
        [str(COLLECTOR / "local.sh"), "up", "--ui", "phoenix"], capture_output=True, text=True, env=env, timeout=60
    )
    assert result.returncode == 1, result
    assert "Arize Phoenix not found (for --ui phoenix)" in result.stderr, result.stderr
    assert "pip install arize-phoenix" in result.stderr and "OTEL_GENERATE_PHOENIX_BIN=" in result.stderr
    assert not list((tmp_path / "state").glob("*/*.pid")), "it started something"

    env["OTEL_GENERATE_PHOENIX_BIN"] = str(tmp_path / "no-such-phoenix")
    result = subprocess.run(
        [str(COLLECTOR / "local.sh"), "up", "--ui=phoenix"], capture_output=True, text=True, env=env, timeout=60
    )
    assert result.returncode == 1
    assert f"OTEL_GENERATE_PHOENIX_BIN={tmp_path / 'no-such-phoenix'} is not an executable file" in result.stderr


def test_phoenix_overlay_adds_phoenix_to_the_collectors_traces_exporters_only():
    base = yaml.safe_load((COLLECTOR / "otel-collector.yaml").read_text())
    overlay = yaml.safe_load((COLLECTOR / "phoenix.yaml").read_text())
    traces = base["service"]["pipelines"]["traces"]["exporters"]
    # lists are replaced when the Collector merges two --config files: the overlay repeats the base's
    assert overlay["service"]["pipelines"] == {"traces": {"exporters": [*traces, "otlp_grpc/phoenix"]}}
    assert set(overlay["exporters"]) == {"otlp_grpc/phoenix"}
    assert overlay["exporters"]["otlp_grpc/phoenix"]["tls"] == {"insecure": True}
    (default,) = re.findall(r"PHOENIX_OTLP_GRPC_PORT:-(\d+)", (COLLECTOR / "ports.sh").read_text())
    assert overlay["exporters"]["otlp_grpc/phoenix"]["endpoint"] == f"127.0.0.1:{default}"


@pytest.mark.slow
def test_the_built_collector_validates_the_configuration_with_phoenix():
    binaries = build()
    result = subprocess.run(
        [
            binaries["OTELCOL"],
            "validate",
            f"--config={COLLECTOR / 'otel-collector.yaml'}",
            f"--config={COLLECTOR / 'phoenix.yaml'}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
