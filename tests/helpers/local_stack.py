"""The real backends of the end-to-end tests, started through ``collector/local.sh``.

``collector/local.sh up`` (Jaeger, the Collector with ``collector/otel-collector.yaml``,
Prometheus) or ``up --scale`` (Jaeger, the agent and two gateways) builds the binaries once
(``collector/build.sh``: Go and the Go module proxy), starts the processes on loopback and prints
``NAME=value`` lines; ``down`` stops what this clone's ``up`` started. :func:`local_stack` wraps
that for a fixture.

A missing prerequisite (Go to build the binaries, Debian's ``prometheus``, ``chromium``) skips
the test and says how to get it, except where backends are required: with
``OTEL_GENERATE_REQUIRE_BACKENDS=1`` (``.ci/run`` sets it) or ``CI=true`` it is a failure.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LOCAL_SH = REPO / "collector" / "local.sh"
BUILD_SH = REPO / "collector" / "build.sh"
#: collector/build.sh's exit status when Go is missing.
NO_GO = 3
#: Bound on `local.sh up` (a first build on 2 cores takes minutes; a built one starts in seconds).
UP_TIMEOUT_S = 1800
DOWN_TIMEOUT_S = 60


def backends_required() -> bool:
    return os.environ.get("OTEL_GENERATE_REQUIRE_BACKENDS") == "1" or os.environ.get("CI", "").lower() == "true"


def missing(reason: str) -> None:
    """Skip for ``reason``, or fail where backends are required."""
    if backends_required():
        pytest.fail(f"{reason} (backends are required here: OTEL_GENERATE_REQUIRE_BACKENDS=1 or CI=true)")
    pytest.skip(reason)


def require_executable(name: str, how: str) -> str:
    path = shutil.which(name)
    if path is None:
        missing(f"{name} not found: {how}")
    return path


def parse_lines(stdout: str) -> dict:
    """``NAME=value`` lines → dict (other lines ignored)."""
    out = {}
    for line in stdout.splitlines():
        name, sep, value = line.partition("=")
        if sep and name.isidentifier() and name.isupper():
            out[name] = value
    return out


def build() -> dict:
    """Build (or find) the binaries: ``{"OTELCOL": path, "JAEGER": path}``."""
    result = subprocess.run([str(BUILD_SH)], capture_output=True, text=True, timeout=UP_TIMEOUT_S)
    if result.returncode == NO_GO:
        missing(
            "Go is not installed: collector/build.sh needs Go 1.26 and the Go module proxy "
            "to build the Collector and Jaeger"
        )
    assert result.returncode == 0, f"collector/build.sh failed:\n{result.stderr[-5000:]}"
    return parse_lines(result.stdout)


def local_sh(*args: str, state: Path | None = None, timeout: float = UP_TIMEOUT_S) -> subprocess.CompletedProcess:
    """``collector/local.sh *args``, with its state folder ``state`` when given."""
    env = dict(os.environ)
    if state is not None:
        env["OTEL_GENERATE_LOCAL_STATE"] = str(state)
    return subprocess.run([str(LOCAL_SH), *args], capture_output=True, text=True, timeout=timeout, env=env)


def down(state: Path | None = None) -> subprocess.CompletedProcess:
    return local_sh("down", state=state, timeout=DOWN_TIMEOUT_S)


@contextlib.contextmanager
def local_stack(*args: str, state: Path | None = None, fresh: bool = True):
    """``collector/local.sh up *args`` → the printed endpoints; ``down`` on the way out.

    ``fresh``: ``up --fresh``, an empty Jaeger (its storage is on disk and outlives ``down``), so
    that a test counts only its own traces. ``state``: the state folder (default local.sh's).
    """
    build()
    if "--scale" not in args:
        require_executable("prometheus", "apt-get install prometheus (Debian's package, 2.42)")
    up_args = [*args, "--fresh"] if fresh else list(args)
    result = local_sh("up", *up_args, state=state)
    try:
        assert result.returncode == 0, f"collector/local.sh up {' '.join(up_args)} failed:\n{result.stderr[-5000:]}"
        yield parse_lines(result.stdout)
    finally:
        stopped = down(state)
        assert stopped.returncode == 0, stopped.stderr


#: the variables of collector/ports.sh that move the single tier's ports (`local.sh up`)
SINGLE_PORT_VARS = (
    "COLLECTOR_GRPC_PORT",
    "COLLECTOR_HTTP_PORT",
    "COLLECTOR_PROMETHEUS_PORT",
    "JAEGER_OTLP_PORT",
    "JAEGER_UI_PORT",
    "JAEGER_QUERY_GRPC_PORT",
    "PROMETHEUS_PORT",
)


def free_ports(count: int) -> list:
    """``count`` loopback ports free now (each bound once by the system's choice, then released)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def state_dir(clone: Path = REPO) -> Path:
    """Where ``collector/local.sh`` of ``clone`` keeps its pid files, logs and Jaeger's storage (one
    folder per tier): ``$OTEL_GENERATE_LOCAL_STATE``, else the clone's own folder under the build
    cache (``collector/state.sh``)."""
    if os.environ.get("OTEL_GENERATE_LOCAL_STATE"):
        return Path(os.environ["OTEL_GENERATE_LOCAL_STATE"])
    cache = os.environ.get("OTEL_GENERATE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "otel-generate"
    )
    real = os.path.realpath(clone)
    return Path(cache) / "local" / f"{os.path.basename(real)}-{hashlib.sha256(real.encode()).hexdigest()[:12]}"


def deprecation_warnings(tier: str) -> list:
    """Lines of the tier's Collector logs that warn of a deprecated name (an alias in a config)."""
    lines = []
    for log in sorted((state_dir() / tier).glob("otel-*.log")):
        lines += [line for line in log.read_text(errors="replace").splitlines() if "deprecated" in line.lower()]
    return lines


def get_json(url: str, params: dict | None = None):
    if params:
        url += "?" + urllib.parse.urlencode(params)
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.load(response)


def jaeger_traces(jaeger_ui: str, service: str, limit: int = 1000) -> list:
    """Every trace of ``service`` in Jaeger (query API ``/api/traces``), as Jaeger's JSON."""
    try:
        data = get_json(f"{jaeger_ui}/api/traces", {"service": service, "limit": limit, "lookback": "1h"})
    except urllib.error.HTTPError as exc:
        if exc.code == 404:  # service not seen yet
            return []
        raise
    return data["data"] or []


def wait_for(check, timeout_s: float, interval_s: float = 0.5):
    """Call ``check()`` until it returns something truthy (returned) or ``timeout_s`` passes (the
    last value is returned)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval_s)


def span_tags(span: dict) -> dict:
    """Jaeger's ``tags`` list → ``{key: value}``."""
    return {tag["key"]: tag["value"] for tag in span.get("tags", [])}


def parent_id(span: dict):
    for ref in span.get("references", []):
        if ref["refType"] == "CHILD_OF":
            return ref["spanID"]
    return None
