"""A real third-party OTLP backend: Arize Phoenix, on loopback, receives the example's trace.

``phoenix serve`` (``pip install arize-phoenix``, in its own environment: it brings its own web
stack) is started by the test with a temporary working directory, on 127.0.0.1 and free ports.
``examples/app.py`` runs under ``opentelemetry-instrument`` exporting OTLP to it, once over
HTTP/protobuf (``/v1/traces`` on its web port) and once over gRPC; the spans are read back from
Phoenix's REST API (``GET /v1/projects/default/spans``) and checked: the same tree, names and
attributes (with their JSON types) as on the wire. Phoenix takes no metrics, so metrics export is
off here.

The trace in a real browser: headless Chromium (Debian's ``chromium``) opens Phoenix's page of
the example's trace, runs its JavaScript, and the rendered page (``--dump-dom``) must name the
application span, the request span and, in order, its ``prefill`` and every ``decode`` step; the
screenshot of that page is kept as a test artifact, ``phoenix-trace.png`` in
``$OTEL_GENERATE_ARTIFACTS`` (default ``test-artifacts/`` at the repository root; that is how
``docs/images/phoenix-trace.png`` was made).

Through the local stack: ``collector/local.sh up --ui phoenix`` starts Phoenix next to the Collector,
which exports the traces it receives to Phoenix as well as to Jaeger; the example sends to the
Collector, and its trace is read back from Phoenix (the same tree) and from Jaeger; ``down`` stops
Phoenix and names it.

Where to find Phoenix: ``OTEL_GENERATE_PHOENIX_BIN`` (the ``phoenix`` executable; ``.ci/run``
sets it), else ``phoenix`` on ``PATH``; Chromium: ``OTEL_GENERATE_CHROMIUM``, else ``chromium``
on ``PATH``. Without one of them the tests skip and say why, except where backends are required
(``OTEL_GENERATE_REQUIRE_BACKENDS=1``, which ``.ci/run`` sets, or ``CI=true``): there they fail.
A Phoenix that is there but does not start is a failure.
"""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from datetime import datetime
from pathlib import Path

import pytest

from otel_generate import attributes as A
from tests.e2e.test_otlp_export import (
    CONDITIONAL,
    NEW_TOKENS,
    PROMPT_TOKENS,
    REQUEST_CONTRACT,
    STEP_CONDITIONAL,
    STEP_CONTRACT,
    printed,
    run_app,
)
from tests.helpers.local_stack import (
    LOCAL_SH,
    SINGLE_PORT_VARS,
    UP_TIMEOUT_S,
    build,
    free_ports,
    jaeger_traces,
    missing,
    parse_lines,
    require_executable,
    wait_for,
)
from tests.helpers.otlp_receiver import GRPC, HTTP

pytestmark = pytest.mark.slow

SERVICE_NAME = "otel-generate-phoenix"
#: Bounds (seconds) for loops waiting on Phoenix; reached only when something is broken.
STARTUP_TIMEOUT_S = 180
INGEST_TIMEOUT_S = 60

_JSON_TYPES = {"string": str, "int": int, "double": float, "bool": bool}


def _phoenix_executable():
    configured = os.environ.get("OTEL_GENERATE_PHOENIX_BIN")
    if configured:
        if not Path(configured).is_file():
            pytest.fail(f"OTEL_GENERATE_PHOENIX_BIN={configured!r} is not a file")
        return configured
    return shutil.which("phoenix")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _get_json(url: str):
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.load(response)


def _spans(base_url: str) -> list:
    """Every span of Phoenix's project ``default``, through its REST API."""
    spans, cursor = [], None
    for _ in range(100):  # pages of 1000: far more than any test writes
        url = f"{base_url}/v1/projects/default/spans?limit=1000"
        if cursor:
            url += f"&cursor={cursor}"
        page = _get_json(url)
        spans.extend(page["data"])
        cursor = page.get("next_cursor")
        if not cursor:
            break
    return spans


class Phoenix:
    """A ``phoenix serve`` process on 127.0.0.1 with its own working directory."""

    def __init__(self, executable: str, workdir: Path) -> None:
        self.http_port = _free_port()
        self.grpc_port = _free_port()
        self.log_path = workdir / "phoenix.log"
        env = dict(os.environ)
        env.update(
            PHOENIX_WORKING_DIR=str(workdir / "data"),
            PHOENIX_HOST="127.0.0.1",
            PHOENIX_PORT=str(self.http_port),
            PHOENIX_GRPC_PORT=str(self.grpc_port),
            PHOENIX_TELEMETRY_ENABLED="false",
        )
        self._log = open(self.log_path, "wb")
        self.process = subprocess.Popen(
            [executable, "serve"], env=env, stdout=self._log, stderr=subprocess.STDOUT, cwd=workdir
        )

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def endpoint(self, protocol: str) -> str:
        port = self.grpc_port if protocol == GRPC else self.http_port
        return f"http://127.0.0.1:{port}"

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                pytest.fail(f"phoenix serve exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.base_url}/healthz", timeout=5) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        pytest.fail(f"phoenix serve not ready after {STARTUP_TIMEOUT_S} s:\n{self.log_tail()}")

    def spans(self) -> list:
        return _spans(self.base_url)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        self._log.close()


@pytest.fixture(scope="module")
def phoenix(tmp_path_factory):
    executable = _phoenix_executable()
    if executable is None:
        missing(
            "Arize Phoenix not found: set OTEL_GENERATE_PHOENIX_BIN to the `phoenix` executable of a "
            "separate environment with `pip install arize-phoenix` (.ci/run does), or put `phoenix` on PATH"
        )
    server = Phoenix(executable, tmp_path_factory.mktemp("phoenix"))
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def _new_trace(phoenix, before: set, expected_spans: int) -> list:
    """Spans of the one trace that appeared since ``before``, once all ``expected_spans`` are stored
    (``phoenix``: a :class:`Phoenix`, or the base URL of one)."""
    deadline = time.monotonic() + INGEST_TIMEOUT_S
    while True:
        found = _spans(phoenix) if isinstance(phoenix, str) else phoenix.spans()
        spans = [s for s in found if s["context"]["trace_id"] not in before]
        if len(spans) >= expected_spans or time.monotonic() > deadline:
            return spans
        time.sleep(0.5)


def _when(timestamp: str) -> datetime:
    return datetime.fromisoformat(timestamp)


def _check_types(attrs: dict, contract: dict, required: set) -> None:
    ours = {key: value for key, value in attrs.items() if key in contract}
    missing = required - set(ours)
    assert not missing, f"contract attributes missing in Phoenix: {missing}"
    for key, value in ours.items():
        kind = contract[key]
        if kind.endswith("[]"):
            item = {"string[]": str, "int[]": int, "double[]": float}[kind]
            assert isinstance(value, list) and value and all(type(v) is item for v in value), (key, value)
        else:
            expected = _JSON_TYPES[kind]
            assert type(value) is expected, f"{key}: {value!r} is {type(value).__name__}, docs/contract.md says {kind}"


REPO = Path(__file__).resolve().parents[2]
#: Chromium's flags for a headless run on a machine without a network: no sandbox (root), no GPU,
#: no background connections, a new empty profile each time.
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--no-first-run",
    "--disable-quic",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--hide-scrollbars",
    "--window-size=1400,800",
    # time for the page's scripts to fetch the trace and draw it
    "--virtual-time-budget=15000",
)


def _chromium() -> str:
    return os.environ.get("OTEL_GENERATE_CHROMIUM") or require_executable(
        "chromium", "apt-get install chromium (Debian's package)"
    )


def _browse(url: str, *args: str, profile: Path) -> subprocess.CompletedProcess:
    """Chromium, headless, on ``url`` with ``args`` (``--dump-dom``, ``--screenshot=...``)."""
    return subprocess.run(
        [_chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args, url],
        capture_output=True,
        text=True,
        timeout=180,
    )


def _trace_url(phoenix: Phoenix, trace_id: str, span_node_id: str) -> str:
    (project,) = [p for p in _get_json(f"{phoenix.base_url}/v1/projects")["data"] if p["name"] == "default"]
    return f"{phoenix.base_url}/projects/{project['id']}/traces/{trace_id}?selectedSpanNodeId={span_node_id}"


def _page_text(dom: str) -> str:
    """The text a person reads on the rendered page: no scripts, styles or tags, spaces collapsed."""
    text = re.sub(r"<(script|style)\b.*?</\1>", " ", dom, flags=re.S | re.I)
    text = html.unescape(re.sub(r"<[^>]+>", " ", text))
    return re.sub(r"\s+", " ", text)


def _artifacts() -> Path:
    folder = Path(os.environ.get("OTEL_GENERATE_ARTIFACTS") or REPO / "test-artifacts")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _screenshot(phoenix: Phoenix, trace_id: str, span_node_id: str, target: Path, profile: Path) -> None:
    shot = _browse(_trace_url(phoenix, trace_id, span_node_id), f"--screenshot={target}", profile=profile)
    assert shot.returncode == 0, shot.stderr[-3000:]
    data = target.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 20_000, "a blank page compresses to a few kB"  # a rendered trace view does not


@pytest.mark.parametrize("protocol", [HTTP, GRPC])
def test_phoenix_stores_the_same_span_tree(phoenix, protocol, tmp_path):
    before = {s["context"]["trace_id"] for s in phoenix.spans()}
    proc = run_app(
        {
            "OTEL_SERVICE_NAME": SERVICE_NAME,
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_METRICS_EXPORTER": "none",  # Phoenix stores traces only
            "OTEL_LOGS_EXPORTER": "none",
            "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
            "OTEL_EXPORTER_OTLP_ENDPOINT": phoenix.endpoint(protocol),
        }
    )
    assert proc.returncode == 0, proc.stderr
    assert "Failed to export" not in proc.stderr, proc.stderr
    out = printed(proc.stdout)

    spans = _new_trace(phoenix, before, 2 + NEW_TOKENS)
    assert len({s["context"]["trace_id"] for s in spans}) == 1, "one new trace"
    assert len(spans) == 2 + NEW_TOKENS, phoenix.log_tail()

    (app_span,) = [s for s in spans if s["name"] == "handle_request"]
    (request,) = [s for s in spans if s["name"].startswith(A.OPERATION_TEXT_COMPLETION + " ")]
    steps = sorted(
        (s for s in spans if s["name"] in (A.STEP_SPAN_PREFILL, A.STEP_SPAN_DECODE)),
        key=lambda s: s["attributes"][A.GENERATE_STEP_INDEX],
    )
    assert app_span["parent_id"] is None
    assert request["parent_id"] == app_span["context"]["span_id"]
    assert request["name"] == f"{A.OPERATION_TEXT_COMPLETION} {request['attributes'][A.GEN_AI_REQUEST_MODEL]}"
    assert [s["name"] for s in steps] == [A.STEP_SPAN_PREFILL] + [A.STEP_SPAN_DECODE] * (NEW_TOKENS - 1)
    assert all(s["parent_id"] == request["context"]["span_id"] for s in steps)

    attrs = request["attributes"]
    # Phoenix reads the GenAI conventions: an LLM span with its token counts, model and finish reason
    assert request["span_kind"] == "LLM"
    assert attrs["llm.token_count.prompt"] == attrs[A.GEN_AI_USAGE_INPUT_TOKENS]
    assert attrs["llm.token_count.completion"] == attrs[A.GEN_AI_USAGE_OUTPUT_TOKENS]
    assert attrs["llm.token_count.total"] == attrs[A.GEN_AI_USAGE_INPUT_TOKENS] + attrs[A.GEN_AI_USAGE_OUTPUT_TOKENS]
    assert attrs["llm.model_name"] == attrs[A.GEN_AI_REQUEST_MODEL]
    _check_types(attrs, REQUEST_CONTRACT, set(REQUEST_CONTRACT) - CONDITIONAL)
    assert attrs[A.GEN_AI_USAGE_INPUT_TOKENS] == PROMPT_TOKENS
    assert attrs[A.GEN_AI_USAGE_OUTPUT_TOKENS] == len(out["continuation"]) == NEW_TOKENS
    assert attrs[A.GENERATE_STEPS] == NEW_TOKENS
    assert attrs[A.GEN_AI_RESPONSE_FINISH_REASONS] == [A.FINISH_REASON_LENGTH]
    assert attrs[A.GENERATE_TIME_TO_FIRST_TOKEN] * 1e3 == pytest.approx(out["ttft_ms"], abs=6e-4)
    for index, step in enumerate(steps):
        _check_types(step["attributes"], STEP_CONTRACT, set(STEP_CONTRACT) - STEP_CONDITIONAL)
        assert step["attributes"][A.GENERATE_STEP_INDEX] == index
        assert step["attributes"][A.GENERATE_TOKEN_INDEX] == index
        assert "generate.step.phase" not in step["attributes"]  # the span name says the phase

    # times (Phoenix keeps microseconds): steps inside the request span, the request inside the app's
    assert _when(app_span["start_time"]) <= _when(request["start_time"])
    assert _when(request["end_time"]) <= _when(app_span["end_time"])
    for step in steps:
        assert _when(request["start_time"]) <= _when(step["start_time"]) <= _when(step["end_time"])
        assert _when(step["end_time"]) <= _when(request["end_time"])


def test_phoenix_shows_the_example_trace_in_a_real_browser(phoenix, tmp_path):
    """examples/app.py's trace, as a person sees it: Phoenix's trace page rendered by Chromium."""
    before = {s["context"]["trace_id"] for s in phoenix.spans()}
    proc = run_app(
        {
            "OTEL_SERVICE_NAME": SERVICE_NAME,
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_METRICS_EXPORTER": "none",
            "OTEL_LOGS_EXPORTER": "none",
            "OTEL_EXPORTER_OTLP_PROTOCOL": HTTP,
            "OTEL_EXPORTER_OTLP_ENDPOINT": phoenix.endpoint(HTTP),
        }
    )
    assert proc.returncode == 0, proc.stderr
    spans = _new_trace(phoenix, before, 2 + NEW_TOKENS)
    assert len(spans) == 2 + NEW_TOKENS, phoenix.log_tail()
    (request,) = [s for s in spans if s["name"].startswith(A.OPERATION_TEXT_COMPLETION + " ")]
    trace_id = request["context"]["trace_id"]
    url = _trace_url(phoenix, trace_id, request["id"])

    dom = _browse(url, "--dump-dom", profile=tmp_path / "profile-dom")
    assert dom.returncode == 0, dom.stderr[-3000:]
    text = _page_text(dom.stdout)
    # the trace view: its id, then the span tree in order, each name with its duration
    assert f"Trace {trace_id}" in text, text[:3000]
    tree = text[text.index(f"Trace {trace_id}") :]
    names = re.findall(
        r"(?<![\w-])(handle_request|" + re.escape(request["name"]) + r"|prefill|decode) \d+(?:\.\d+)?\s?m?s", tree
    )
    steps = [A.STEP_SPAN_PREFILL] + [A.STEP_SPAN_DECODE] * (NEW_TOKENS - 1)
    assert names[: 2 + NEW_TOKENS] == ["handle_request", request["name"], *steps], (names, tree[:2000])
    # the selected span's panel: the request span, with its token counts among its attributes
    assert tree.count(request["name"]) >= 2, tree[:3000]

    target = _artifacts() / "phoenix-trace.png"
    _screenshot(phoenix, trace_id, request["id"], target, profile=tmp_path / "profile-shot")


# =============================================================================================
# collector/local.sh up --ui phoenix: Phoenix next to the Collector, which sends it the traces
# =============================================================================================


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


def test_local_sh_up_ui_phoenix_shows_what_the_collector_receives_and_down_stops_it(tmp_path):
    """``collector/local.sh up --ui phoenix``: the application sends to the Collector as always; the
    trace is in Phoenix (read back through its REST API, the same tree) and in Jaeger; ``down`` stops
    Phoenix with the rest and names it."""
    executable = _phoenix_executable()
    if executable is None:
        missing(
            "Arize Phoenix not found: set OTEL_GENERATE_PHOENIX_BIN to the `phoenix` executable of a "
            "separate environment with `pip install arize-phoenix` (.ci/run does), or put `phoenix` on PATH"
        )
    build()
    require_executable("prometheus", "apt-get install prometheus (Debian's package, 2.42)")
    variables = (*SINGLE_PORT_VARS, "PHOENIX_UI_PORT", "PHOENIX_OTLP_GRPC_PORT")
    ports = dict(zip(variables, free_ports(len(variables))))
    env = dict(os.environ, OTEL_GENERATE_PHOENIX_BIN=executable, OTEL_GENERATE_LOCAL_STATE=str(tmp_path / "state"))
    env.update({name: str(port) for name, port in ports.items()})
    service = "otel-generate-phoenix-via-collector"
    up = subprocess.run(
        [str(LOCAL_SH), "up", "--ui", "phoenix"], capture_output=True, text=True, env=env, timeout=UP_TIMEOUT_S
    )
    try:
        assert up.returncode == 0, up.stderr[-5000:]
        stack = parse_lines(up.stdout)
        assert stack["PHOENIX_UI"] == f"http://127.0.0.1:{ports['PHOENIX_UI_PORT']}"
        assert _answers(stack["PHOENIX_UI"] + "/healthz")
        before = {s["context"]["trace_id"] for s in _spans(stack["PHOENIX_UI"])}
        proc = run_app(
            {
                "OTEL_SERVICE_NAME": service,
                "OTEL_TRACES_EXPORTER": "otlp",
                "OTEL_METRICS_EXPORTER": "none",
                "OTEL_LOGS_EXPORTER": "none",
                "OTEL_EXPORTER_OTLP_ENDPOINT": stack["OTLP_GRPC_ENDPOINT"],  # the Collector
            }
        )
        assert proc.returncode == 0, proc.stderr
        spans = _new_trace(stack["PHOENIX_UI"], before, 2 + NEW_TOKENS)
        assert len(spans) == 2 + NEW_TOKENS, [s["name"] for s in spans]
        (app_span,) = [s for s in spans if s["name"] == "handle_request"]
        (request,) = [s for s in spans if s["name"].startswith(A.OPERATION_TEXT_COMPLETION + " ")]
        steps = sorted(
            (s for s in spans if s["name"] in (A.STEP_SPAN_PREFILL, A.STEP_SPAN_DECODE)),
            key=lambda s: s["attributes"][A.GENERATE_STEP_INDEX],
        )
        assert request["parent_id"] == app_span["context"]["span_id"]
        assert [s["name"] for s in steps] == [A.STEP_SPAN_PREFILL] + [A.STEP_SPAN_DECODE] * (NEW_TOKENS - 1)
        assert all(s["parent_id"] == request["context"]["span_id"] for s in steps)
        assert request["span_kind"] == "LLM"
        assert request["attributes"][A.GEN_AI_USAGE_OUTPUT_TOKENS] == NEW_TOKENS
        # the same trace in Jaeger: the Collector sends to both
        trace_id = request["context"]["trace_id"]
        in_jaeger = wait_for(
            lambda: [t for t in jaeger_traces(stack["JAEGER_UI"], service) if t["traceID"] == trace_id], 60
        )
        assert len(in_jaeger) == 1 and len(in_jaeger[0]["spans"]) == 2 + NEW_TOKENS
    finally:
        down = subprocess.run([str(LOCAL_SH), "down"], capture_output=True, text=True, env=env, timeout=120)
    assert down.returncode == 0, down.stderr
    phoenix_ports = f"{ports['PHOENIX_UI_PORT']} {ports['PHOENIX_OTLP_GRPC_PORT']}"
    assert re.search(rf"^stopped phoenix \(pid \d+, ports {phoenix_ports}\) of the single tier", down.stdout, re.M), (
        down.stdout
    )
    assert not _answers(f"http://127.0.0.1:{ports['PHOENIX_UI_PORT']}/healthz"), "Phoenix still answers after down"
