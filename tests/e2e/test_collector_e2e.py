"""The real Collector built from collector/builder-config.yaml, and collector/local.sh itself.

* The built Collector holds exactly the components the repository's configurations name, and
  validates each of them (``otelcol validate``); Jaeger reports the pinned version.
* ``collector/local.sh up`` and ``down`` with both binaries built: each completes in under 30 s,
  ``up`` prints the four ``NAME=value`` lines, and after ``down`` none of the processes is left
  and the ports are free again.
* The scale tier (``collector/local.sh up --scale``: one agent, two tail-sampling gateways, Jaeger):
  two processes send 50 requests through the agent. In Jaeger every trace is complete: one
  application span and one request span per trace whatever the sampling decision, and step spans
  either all (every one the process produced, each once, under its request span) or none. The
  traces with an error or a slow request are kept; every trace is kept exactly when one of the
  gateway's policies (read from collector/gateway.yaml, evaluated here on the spans the processes
  recorded themselves, the probabilistic one with the processor's own hash of the trace id) says so.

Skips (or, with ``OTEL_GENERATE_REQUIRE_BACKENDS=1`` / ``CI=true``, fails) without Go or prometheus.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from fractions import Fraction
from pathlib import Path

import pytest
import yaml

from otel_generate import attributes as A
from tests.e2e.test_collector_tier import CONFIGS, GATEWAY, ottl
from tests.e2e.test_otlp_export import NEW_TOKENS, run_app
from tests.helpers.local_stack import (
    BUILD_SH,
    LOCAL_SH,
    build,
    deprecation_warnings,
    jaeger_traces,
    local_sh,
    local_stack,
    parent_id,
    parse_lines,
    require_executable,
    span_tags,
    wait_for,
)

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
MANIFEST = REPO / "collector" / "builder-config.yaml"
WORKER = Path(__file__).resolve().parents[1] / "helpers" / "scale_worker.py"
SECTIONS = ("receivers", "processors", "exporters", "connectors", "extensions")
STEP_NAMES = (A.STEP_SPAN_PREFILL, A.STEP_SPAN_DECODE)
#: What the page of a Jaeger binary built without UI assets says (cmd/query/app/ui/placeholder).
PLACEHOLDER = "This is not the Jaeger UI you are looking for"


@pytest.fixture(scope="module")
def binaries():
    return build()


# =============================================================================================
# The built binaries
# =============================================================================================


def _config_components(config: dict) -> dict:
    return {section: {name.split("/")[0] for name in config.get(section) or {}} for section in SECTIONS}


def test_built_collector_has_exactly_the_components_the_configs_name(binaries):
    used = {section: set() for section in SECTIONS}
    for path in CONFIGS.values():
        for section, names in _config_components(yaml.safe_load(path.read_text())).items():
            used[section] |= names
    listed = yaml.safe_load(
        subprocess.run([binaries["OTELCOL"], "components"], capture_output=True, text=True, check=True).stdout
    )
    built = {section: {c["name"] for c in listed.get(section) or []} for section in SECTIONS}
    # the OTLP/gRPC exporter's module also registers its deprecated alias `otlp`: the configs use otlp_grpc
    assert built["exporters"] - used["exporters"] <= {"otlp"}
    built["exporters"] &= used["exporters"] | {"otlp_grpc"}
    assert built == used
    # one Collector release for every module of the manifest
    manifest = yaml.safe_load(MANIFEST.read_text())
    versions = {
        entry["gomod"].split()[1] for section in SECTIONS for entry in manifest.get(section) or [] if "gomod" in entry
    }
    assert versions == {f"v{manifest['dist']['version']}"}
    assert listed["buildinfo"]["version"] == manifest["dist"]["version"]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_built_collector_validates_each_configuration(binaries, name):
    result = subprocess.run(
        [binaries["OTELCOL"], "validate", f"--config={CONFIGS[name]}"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    # (a deprecated alias passes validation; the running Collectors' logs are checked below)


def test_jaeger_reports_the_version_the_compose_image_pins(binaries):
    result = subprocess.run([binaries["JAEGER"], "version"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    reported = json.loads(result.stdout.strip().splitlines()[-1] if result.stdout.strip() else result.stderr)
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    tag = compose["services"]["jaeger"]["image"].rsplit(":", 1)[1]
    assert reported["gitVersion"] == f"v{tag}"


# =============================================================================================
# local.sh up / down
# =============================================================================================


def _listening(url: str) -> bool:
    host, port = url.rsplit("/", 1)[-1].rsplit(":", 1) if "//" in url else url.rsplit(":", 1)
    with socket.socket() as sock:
        sock.settimeout(1)
        return sock.connect_ex((host, int(port))) == 0


def _running(pid: int) -> bool:
    """The process exists and has not exited (a zombie, dead but not yet reaped by its parent,
    here PID 1 once local.sh has returned, does not count)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _pids(state: Path) -> list:
    return [int(p.read_text().split()[0]) for p in state.glob("*/*.pid")]


def test_local_sh_up_and_down_each_take_under_30_s_and_leave_nothing(binaries, tmp_path):
    require_executable("prometheus", "apt-get install prometheus (Debian's package, 2.42)")
    env = dict(os.environ, OTEL_GENERATE_LOCAL_STATE=str(tmp_path / "state"))
    start = time.monotonic()
    up = subprocess.run([str(LOCAL_SH), "up"], capture_output=True, text=True, timeout=120, env=env)
    up_s = time.monotonic() - start
    try:
        assert up.returncode == 0, up.stderr
        endpoints = parse_lines(up.stdout)
        # next to JAEGER_UI: what that page is, and (on stderr) how to get the UI when it is the placeholder
        served = endpoints.pop("JAEGER_UI_SERVED")
        assert served in ("placeholder", "jaeger-ui")
        with urllib.request.urlopen(endpoints["JAEGER_UI"] + "/", timeout=10) as response:
            page = response.read().decode(errors="replace")
        assert (PLACEHOLDER in page) == (served == "placeholder")
        if served == "placeholder":
            assert "OTEL_GENERATE_JAEGER_UI_ASSETS" in up.stderr and "docker compose" in up.stderr
        assert set(endpoints) == {"OTLP_GRPC_ENDPOINT", "OTLP_HTTP_ENDPOINT", "JAEGER_UI", "PROMETHEUS_URL"}
        assert all(value.startswith("http://127.0.0.1:") for value in endpoints.values())
        assert all(_listening(value) for value in endpoints.values())
        pids = _pids(tmp_path / "state")
        assert len(pids) == 3  # jaeger, otel-collector, prometheus
        assert all(_running(pid) for pid in pids)
        # the Collector started without warning of a deprecated component name (an alias)
        log = (tmp_path / "state" / "single" / "otel-collector.log").read_text()
        assert "deprecated" not in log.lower(), log
        # a second `up` refuses (the tier is up) and starts nothing
        again = subprocess.run([str(LOCAL_SH), "up"], capture_output=True, text=True, timeout=60, env=env)
        assert again.returncode != 0 and "already up" in again.stderr
    finally:
        start = time.monotonic()
        stopped = subprocess.run([str(LOCAL_SH), "down"], capture_output=True, text=True, timeout=120, env=env)
        down_s = time.monotonic() - start
    assert stopped.returncode == 0, stopped.stderr
    assert up_s < 30, f"up took {up_s:.1f} s"
    assert down_s < 30, f"down took {down_s:.1f} s"
    assert not any(_running(pid) for pid in pids), "a process up started is still running"
    assert not list((tmp_path / "state").glob("*/*.pid"))
    assert not any(_listening(value) for value in endpoints.values()), "a port is still taken"


def test_traces_outlive_down_and_up_and_up_fresh_clears_them(binaries, tmp_path):
    """Jaeger stores on disk (Badger, in the tier's state folder): `down` then `up` keeps the
    traces of the previous run; `up --fresh` starts from an empty store."""
    require_executable("prometheus", "apt-get install prometheus (Debian's package, 2.42)")
    state = tmp_path / "state"
    service = "otel-generate-e2e-durable"

    def up(*args):
        result = local_sh("up", *args, state=state, timeout=120)
        assert result.returncode == 0, result.stderr
        return parse_lines(result.stdout)

    def traces(stack):
        return {t["traceID"]: len(t["spans"]) for t in jaeger_traces(stack["JAEGER_UI"], service)}

    try:
        stack = up()
        proc = run_app(
            {
                "OTEL_SERVICE_NAME": service,
                "OTEL_TRACES_EXPORTER": "otlp",
                "OTEL_METRICS_EXPORTER": "none",
                "OTEL_LOGS_EXPORTER": "none",
                "OTEL_EXPORTER_OTLP_ENDPOINT": stack["OTLP_GRPC_ENDPOINT"],
            }
        )
        assert proc.returncode == 0, proc.stderr
        first = wait_for(lambda: {t: n for t, n in traces(stack).items() if n == 2 + NEW_TOKENS}, 60)
        assert len(first) == 1, traces(stack)
        assert (state / "single" / "jaeger-data").is_dir()

        assert local_sh("down", state=state, timeout=60).returncode == 0
        stack = up()
        assert traces(stack) == first, "the trace of the previous run is gone after down and up"

        assert local_sh("down", state=state, timeout=60).returncode == 0
        stack = up("--fresh")
        assert traces(stack) == {}, "up --fresh kept the previous traces"
    finally:
        assert local_sh("down", state=state, timeout=60).returncode == 0


# =============================================================================================
# local.sh: every missing prerequisite, at once and at the start
# =============================================================================================


def _bare_path(tmp_path: Path, *keep: str) -> str:
    """A PATH folder with links to only the given commands (and what bash and the scripts need)."""
    folder = tmp_path / "bin"
    folder.mkdir()
    for name in ("bash", "env", "sed", "cat", "head", "tr", "sha256sum", "cut", "dirname", "mkdir", "rm", "ls", *keep):
        found = shutil.which(name)
        if found:
            (folder / name).symlink_to(found)
    return str(folder)


def test_up_without_prometheus_fails_at_once_naming_it(binaries, tmp_path):
    env = dict(os.environ, PATH=_bare_path(tmp_path, "curl", "setsid", "go", "flock"))
    env.pop("PROMETHEUS", None)
    env["OTEL_GENERATE_LOCAL_STATE"] = str(tmp_path / "state")
    start = time.monotonic()
    result = subprocess.run([str(LOCAL_SH), "up"], capture_output=True, text=True, timeout=60, env=env)
    elapsed = time.monotonic() - start
    assert result.returncode == 1, result
    assert "prometheus not found" in result.stderr and "apt-get install prometheus" in result.stderr
    assert elapsed < 5, f"took {elapsed:.1f} s"
    assert not list((tmp_path / "state").glob("*/*.pid")), "it started something"


def test_up_names_every_missing_prerequisite_at_once_before_building(tmp_path):
    """No Go, no prometheus, no curl, binaries not built (an empty cache), a port taken: one
    run names all of them, and neither builds nor waits on a build lock."""
    env = dict(os.environ, PATH=_bare_path(tmp_path), OTEL_GENERATE_CACHE=str(tmp_path / "empty-cache"))
    env.pop("PROMETHEUS", None)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env["PROMETHEUS_PORT"] = str(port)
        start = time.monotonic()
        result = subprocess.run([str(LOCAL_SH), "up"], capture_output=True, text=True, timeout=60, env=env)
        elapsed = time.monotonic() - start
    assert result.returncode == 1, result
    for needle in ("go not found", "prometheus not found", "curl not found", f"port 127.0.0.1:{port} is in use"):
        assert needle in result.stderr, (needle, result.stderr)
    assert "PROMETHEUS_PORT" in result.stderr  # the variable that moves the port
    assert elapsed < 5, f"took {elapsed:.1f} s"
    assert not (tmp_path / "empty-cache" / "build.lock").exists(), "it went on to the build"


def test_a_port_in_use_names_the_port_and_the_variable_that_moves_it(binaries, tmp_path):
    require_executable("prometheus", "apt-get install prometheus (Debian's package, 2.42)")
    env = dict(os.environ, OTEL_GENERATE_LOCAL_STATE=str(tmp_path / "state"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for tier, variable in (((), "JAEGER_UI_PORT"), (("--scale",), "GATEWAY_2_PORT")):
            result = subprocess.run(
                [str(LOCAL_SH), "up", *tier],
                capture_output=True,
                text=True,
                timeout=60,
                env={**env, variable: str(port)},
            )
            assert result.returncode == 1, result
            assert f"port 127.0.0.1:{port} is in use: free it, or set {variable} to a free port" in result.stderr
            assert not list((tmp_path / "state").glob("*/*.pid")), "it started something"


def test_build_says_when_it_waits_on_another_builds_lock(binaries, tmp_path):
    """collector/build.sh with the lock held elsewhere and a binary missing: it says it waits."""
    cache = tmp_path / "cache"
    cache.mkdir()
    lock = subprocess.Popen(["flock", str(cache / "build.lock"), "sleep", "60"])
    waiting = None
    try:
        # until the other process holds the lock (else this build.sh would take it and build)
        held = wait_for(
            lambda: subprocess.run(["flock", "-n", str(cache / "build.lock"), "true"]).returncode != 0, 10, 0.05
        )
        assert held
        waiting = subprocess.Popen(
            [str(BUILD_SH)],
            env=dict(os.environ, OTEL_GENERATE_CACHE=str(cache)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            # its own process group: build.sh waits in a child `flock`, which holds the pipes open
            start_new_session=True,
        )
        line = waiting.stderr.readline()
        assert "waiting for another collector/build.sh" in line and "build.lock" in line, line
    finally:
        if waiting is not None:
            os.killpg(waiting.pid, signal.SIGKILL)
            waiting.communicate(timeout=30)
        lock.kill()
        lock.wait(timeout=10)


# =============================================================================================
# The scale tier
# =============================================================================================

REQUESTS = 50
SERVICE = "otel-generate-e2e-scale"
#: kinds of some requests (index → kind); the others are "normal"
SPECIAL = {3: "error", 17: "error", 30: "error", 8: "slow_first_token", 21: "slow_decode", 1: "slow_request"}


def _fnv1a_64(data: bytes) -> int:
    value = 0xCBF29CE484222325
    for byte in data:
        value = ((value ^ byte) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return value


def _probabilistic_keeps(policy: dict, trace_id: str) -> bool:
    """The tail-sampling processor's probabilistic policy (processor/tailsamplingprocessor,
    internal/sampling/probabilistic.go): FNV-1a 64 of the salt then the 16 trace-id bytes, kept when
    at most ``MaxUint64 * percentage / 100``."""
    salt = policy.get("hash_salt") or "default-hash-seed"
    threshold = int(Fraction(2**64 - 1) * Fraction(policy["sampling_percentage"] / 100))
    return _fnv1a_64(salt.encode() + bytes.fromhex(trace_id)) <= threshold


def _kept_by(policies: list, spans: list) -> list:
    """The names of the gateway policies that sample a trace of ``spans`` (the worker's records)."""
    kept = []
    for policy in policies:
        kind, config = policy["type"], policy[policy["type"]]
        if kind == "status_code":
            assert config["status_codes"] == ["ERROR"]
            hit = any(s["error"] for s in spans)
        elif kind == "latency":
            duration_ns = max(s["end_time_unix_nano"] for s in spans) - min(s["start_time_unix_nano"] for s in spans)
            hit = duration_ns // 1_000_000 > config["threshold_ms"]  # Go's Duration.Milliseconds() truncates
        elif kind == "ottl_condition":
            hit = any(ottl(condition, span) for condition in config["span"] for span in spans)
        elif kind == "probabilistic":
            hit = _probabilistic_keeps(config, spans[0]["trace_id"])
        else:
            raise AssertionError(f"policy type {kind} not modelled by this test")
        if hit:
            kept.append(policy["name"])
    return kept


def _run_workers(endpoint: str, gateway: dict) -> dict:
    policies = {p["name"]: p for p in gateway["processors"]["tail_sampling"]["policies"]}
    latency_s = policies["slow-requests"]["latency"]["threshold_ms"] / 1e3
    commands = []
    for worker in range(2):  # two processes: requests 0, 2, 4, ... and 1, 3, 5, ...
        command = [sys.executable, str(WORKER), "--endpoint", endpoint, "--service", SERVICE]
        command += ["--request-sleep", str(latency_s + 1.0)]
        for index in range(worker, REQUESTS, 2):
            command += ["--request", f"{index}:{SPECIAL.get(index, 'normal')}"]
        commands.append(command)
    processes = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for c in commands]
    results = {"requests": [], "spans": []}
    for process in processes:
        out, err = process.communicate(timeout=600)
        assert process.returncode == 0, err[-5000:]
        document = json.loads(out)
        results["requests"] += document["requests"]
        results["spans"] += document["spans"]
    return results


def test_scale_tier_keeps_traces_whole_and_samples_by_the_gateway_policies():
    gateway = yaml.safe_load(GATEWAY.read_text())
    tail = gateway["processors"]["tail_sampling"]
    decision_wait_s = int(str(tail["decision_wait"]).rstrip("s"))
    with local_stack("--scale") as stack:
        assert set(stack) == {"OTLP_GRPC_ENDPOINT", "OTLP_HTTP_ENDPOINT", "JAEGER_UI", "JAEGER_UI_SERVED"}
        # the agent and the gateways run their configs without a deprecated component name
        assert not deprecation_warnings("scale")
        sent = _run_workers(stack["OTLP_GRPC_ENDPOINT"], gateway)
        finished = time.monotonic()
        requests = {r["trace_id"]: r for r in sent["requests"]}
        assert len(requests) == REQUESTS, "one trace per request"
        produced = {}
        for span in sent["spans"]:
            produced.setdefault(span["trace_id"], []).append(span)
        expected = {trace_id: _kept_by(tail["policies"], produced[trace_id]) for trace_id in requests}

        def steps_of(trace):
            return [s for s in trace["spans"] if s["operationName"] in STEP_NAMES]

        def settled():
            traces = {t["traceID"]: t for t in jaeger_traces(stack["JAEGER_UI"], SERVICE)}
            complete = len(traces) == REQUESTS and all(
                len(traces[t]["spans"]) >= len(produced[t]) for t in requests if expected[t]
            )
            return traces if complete else None

        wait_for(settled, decision_wait_s + 90, 1.0)
        # past the decision for every trace, plus the gateways' batch and Jaeger's: late step spans
        # of a trace that was not kept would be here by now
        time.sleep(max(0.0, decision_wait_s + 5 - (time.monotonic() - finished)))
        traces = {t["traceID"]: t for t in jaeger_traces(stack["JAEGER_UI"], SERVICE)}

    assert set(traces) == set(requests), f"{len(traces)} traces in Jaeger for {REQUESTS} requests"
    kept = set()
    for trace_id, trace in traces.items():
        mine = {s["span_id"]: s for s in produced[trace_id]}
        spans = trace["spans"]
        ids = [s["spanID"] for s in spans]
        assert len(ids) == len(set(ids)), f"trace {trace_id}: a span delivered twice"
        assert set(ids) <= set(mine), f"trace {trace_id}: spans the process did not produce"
        (app,) = [s for s in spans if s["operationName"] == "handle_request"]
        (request,) = [s for s in spans if s["operationName"].startswith(A.OPERATION_TEXT_COMPLETION + " ")]
        assert parent_id(request) == app["spanID"]
        steps = steps_of(trace)
        produced_steps = {i for i, s in mine.items() if s["name"] in STEP_NAMES}
        # no orphan step span: each hangs under the request span of its own trace
        assert all(parent_id(s) == request["spanID"] for s in steps), f"trace {trace_id}: orphan step span"
        # no split: a trace has all of its step spans or none
        assert {s["spanID"] for s in steps} in (set(), produced_steps), (
            f"trace {trace_id}: {len(steps)} of {len(produced_steps)} step spans"
        )
        if steps:
            kept.add(trace_id)
        tags = span_tags(request)
        assert tags[A.GENERATE_STEPS] == len(produced_steps)
        if requests[trace_id]["output_tokens"] is not None:
            assert tags[A.GEN_AI_USAGE_OUTPUT_TOKENS] == requests[trace_id]["output_tokens"] == len(produced_steps)

    # what must be kept is kept: every error and every slow request, by the policy meant for it
    by_kind = {}
    for trace_id, request in requests.items():
        by_kind.setdefault(request["kind"], []).append(trace_id)
    must = {"error": "errors", "slow_request": "slow-requests", "slow_first_token": "slow-first-token"}
    must["slow_decode"] = "slow-decode-step"
    for kind, policy in must.items():
        assert by_kind[kind], kind
        for trace_id in by_kind[kind]:
            assert policy in expected[trace_id], f"{kind} trace {trace_id} not matched by policy {policy}"
            assert trace_id in kept, f"{kind} trace {trace_id} was not kept"
    # and every other trace follows the rule: kept exactly when a policy samples it
    wrong = {t: expected[t] for t in requests if bool(expected[t]) != (t in kept)}
    assert not wrong, f"traces whose sampling differs from collector/gateway.yaml's policies: {wrong}"
    normal_kept = [t for t in by_kind["normal"] if t in kept]
    assert len(normal_kept) < len(by_kind["normal"]), "the normal traces are sampled, not all kept"
