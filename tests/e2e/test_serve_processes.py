"""``transformers serve`` under ``opentelemetry-instrument``, read back from an OTLP receiver: one trace from the
``openai`` client's span through FastAPI's ``POST`` span to the request span and its steps, across processes.

transformers 5.25 and newer run the model in a process of its own (``spawn``), fed by a queue, behind one API
server or several (``--api-server-count``); up to 5.24 the model runs on a thread of the server. The server
exports over OTLP/gRPC to :class:`tests.helpers.otlp_receiver.OTLPReceiver` with the SDK's defaults (the batch
span processor's 5 s delay, metrics every 60 s), so what arrives after the server was stopped arrived through
the flush on ``SIGTERM``. The ``process`` resource detector names each span's process: the request span must
come from the model's process (on 5.25 a child of the API server, or of the supervisor of several).

The client is the ``openai`` package with OpenTelemetry's OpenAI instrumentation
(``opentelemetry-instrumentation-openai-v2``: a ``chat {model}`` CLIENT span per call) in this process, its
spans exported to the same receiver. openai 3.x sends through httpx2, which no OpenTelemetry instrumentation
patches, so the client injects ``traceparent`` with an httpx2 request hook, as docs/serving.md shows.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Any, Dict, List

import pytest

from otel_generate import attributes as A

pytestmark = pytest.mark.slow

pytest.importorskip("transformers.cli.serving.utils", reason="this transformers has no OpenAI-compatible serve")
for _module in ("fastapi", "uvicorn", "openai", "httpx2", "opentelemetry.instrumentation.fastapi", "accelerate"):
    pytest.importorskip(_module, reason=f"transformers serve tests need {_module} (the [test] extra)")
pytest.importorskip(
    "opentelemetry.instrumentation.openai_v2", reason="the openai client's span needs the [openai-client] extra"
)

import transformers.cli.serving.utils as serving_utils  # noqa: E402

from tests.helpers import serve_command_environment  # noqa: E402
from tests.helpers.otlp_receiver import GRPC, OTLPReceiver, any_value, attributes  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("serve_demo", ROOT / "examples" / "serve_demo.py")
serve_demo = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(serve_demo)

#: transformers 5.25+: the model in a process of its own (``EngineClient``), several API servers possible.
MODEL_PROCESS = not hasattr(serving_utils, "InferenceThread")
CB_FLAGS = ["--continuous-batching", "--cb-num-blocks", "16", "--cb-max-batch-tokens", "64"]
MODES = ["plain", "continuous_batching"]
MAX_TOKENS = 6
CHUNKS_BEFORE_STOP = 3
CHAT = "POST /v1/chat/completions"
REQUEST_PREFIX = A.OPERATION_TEXT_COMPLETION + " "


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return serve_demo.build_model_dir(str(tmp_path_factory.mktemp("tiny-serve")))


@pytest.fixture
def receiver():
    with OTLPReceiver() as running:
        yield running


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(model_dir, receiver, mode, log_path, api_servers=1):
    """``opentelemetry-instrument transformers serve`` exporting to ``receiver``; ``(process, base_url)``."""
    bin_dir = pathlib.Path(sys.executable).parent
    port = _free_port()
    command = [str(bin_dir / "opentelemetry-instrument"), str(bin_dir / "transformers"), "serve", model_dir]
    command += ["--host", "127.0.0.1", "--port", str(port), "--device", "cpu", "--log-level", "warning"]
    command += CB_FLAGS if mode == "continuous_batching" else []
    command += ["--api-server-count", str(api_servers)] if api_servers > 1 else []
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(
        OTEL_SERVICE_NAME="serve-e2e",
        OTEL_TRACES_EXPORTER="otlp",
        OTEL_METRICS_EXPORTER="otlp",
        OTEL_LOGS_EXPORTER="none",
        OTEL_EXPORTER_OTLP_PROTOCOL="grpc",
        OTEL_EXPORTER_OTLP_ENDPOINT=receiver.grpc_endpoint,
        # process.pid and process.parent_pid on each span, as docs/serving.md's server command sets them
        OTEL_EXPERIMENTAL_RESOURCE_DETECTORS=serve_command_environment()["OTEL_EXPERIMENTAL_RESOURCE_DETECTORS"],
        PYTHONUNBUFFERED="1",
        PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}",
    )
    log = open(log_path, "w")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(ROOT))
    log.close()
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"the server exited with {process.returncode}: {pathlib.Path(log_path).read_text()}")
        try:
            with urllib.request.urlopen(f"{base_url}/health", timeout=1) as response:
                if response.status == 200:
                    return process, base_url
        except (urllib.error.URLError, ConnectionError, OSError):
            time.sleep(0.2)
    process.kill()
    raise AssertionError(f"the server did not answer within 300 s: {pathlib.Path(log_path).read_text()}")


def stop_server(process, log_path, timeout_s=60):
    """SIGTERM, as `kill` or Kubernetes sends it; the exit status."""
    process.send_signal(signal.SIGTERM)
    try:
        return process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        tail = pathlib.Path(log_path).read_text()[-3000:]
        raise AssertionError(f"the server did not stop on SIGTERM: {tail}") from None


class Client:
    """The ``openai`` client with the OpenAI instrumentation, its spans exported to ``receiver``."""

    def __init__(self, receiver, base_url, model):
        import httpx2
        import openai
        from opentelemetry import propagate
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.instrumentation.openai_v2 import OpenAIInstrumentor
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        self.provider = TracerProvider(resource=Resource.create({"service.name": "openai-client"}))
        self.provider.add_span_processor(
            BatchSpanProcessor(OTLPSpanExporter(endpoint=receiver.grpc_endpoint, insecure=True))
        )
        self.instrumentor = OpenAIInstrumentor()
        self.instrumentor.instrument(tracer_provider=self.provider)

        def inject_trace_context(request):  # the span current while openai sends: its `chat` span
            propagate.inject(request.headers)

        http_client = httpx2.Client(event_hooks={"request": [inject_trace_context]}, timeout=120)
        self.openai = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, http_client=http_client)
        self.model = model

    def chat(self, prompt, stream=False, stop_after=None, max_tokens=MAX_TOKENS) -> Dict[str, Any]:
        """One chat completion; ``{"id", "usage", "finish_reason", "chunks"}`` as the client received them."""
        options = dict(model=self.model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens)
        options["temperature"] = 0
        if not stream:
            response = self.openai.chat.completions.create(**options)
            return {
                "id": response.id,
                "usage": response.usage.completion_tokens,
                "finish_reason": response.choices[0].finish_reason,
            }
        chunks = []
        response = self.openai.chat.completions.create(**options, stream=True, stream_options={"include_usage": True})
        try:
            for chunk in response:
                chunks.append(chunk)
                if stop_after is not None and len(chunks) >= stop_after:
                    break
        finally:
            response.close()
        usage = [c.usage.completion_tokens for c in chunks if c.usage is not None]
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        return {
            "id": chunks[0].id,
            "usage": usage[0] if usage else None,
            "finish_reason": finish[0] if finish else None,
            "chunks": chunks,
        }

    def close(self):
        self.provider.force_flush()
        self.instrumentor.uninstrument()
        self.provider.shutdown()


def received_spans(receiver) -> List[Dict[str, Any]]:
    spans = []
    for resource, _scope, span in receiver.spans(GRPC):
        resource_attributes = {key: value for key, (_, value) in attributes(resource.attributes).items()}
        spans.append(
            {
                "name": span.name,
                "trace_id": span.trace_id.hex(),
                "span_id": span.span_id.hex(),
                "parent_id": span.parent_span_id.hex() or None,
                "kind": span.kind,
                "status": span.status.code,
                "start_ns": span.start_time_unix_nano,
                "end_ns": span.end_time_unix_nano,
                "attributes": {kv.key: _plain(any_value(kv.value)) for kv in span.attributes},
                "service": resource_attributes.get("service.name"),
                "pid": resource_attributes.get("process.pid"),
                "parent_pid": resource_attributes.get("process.parent_pid"),
            }
        )
    return spans


def _plain(decoded):
    kind, value = decoded
    return [_plain(v) for v in value] if kind == "array_value" else value


def wait_for(receiver, predicate, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while True:
        spans = received_spans(receiver)
        if predicate(spans) or time.monotonic() > deadline:
            return spans


def trace_of(spans, answered, client_span_name):
    """The spans of the request the client got ``answered`` for: its client span (the OpenAI instrumentation
    records the response's id on it), its POST span, its request span and the request span's steps."""
    (client,) = [
        s
        for s in spans
        if s["service"] == "openai-client"
        and s["name"] == client_span_name
        and s["attributes"].get("gen_ai.response.id") == answered["id"]
    ]
    mine = [s for s in spans if s["trace_id"] == client["trace_id"]]
    (post,) = [s for s in mine if s["name"] == CHAT]
    (request,) = [s for s in mine if s["name"].startswith(REQUEST_PREFIX)]
    steps = [s for s in mine if s["parent_id"] == request["span_id"]]
    return client, post, request, steps


def check_one_trace(spans, answered, model, server_pid, mode):
    """Client span -> POST -> request span (in the model's process) -> steps; counts as the client got them."""
    from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

    client, post, request, steps = trace_of(spans, answered, f"chat {model}")
    assert client["kind"] == Span.SPAN_KIND_CLIENT and client["parent_id"] is None
    assert post["parent_id"] == client["span_id"] and post["kind"] == Span.SPAN_KIND_SERVER
    assert request["parent_id"] == post["span_id"]
    attrs = request["attributes"]
    # greedy: a token per step, after the prompt's prefill (in chunks when batched with others: 0 tokens each)
    assert (
        attrs[A.GEN_AI_USAGE_OUTPUT_TOKENS]
        == answered["usage"]
        == sum(s["attributes"][A.GENERATE_STEP_TOKENS] for s in steps)
    )
    names = [s["name"] for s in sorted(steps, key=lambda s: s["attributes"][A.GENERATE_STEP_INDEX])]
    prefills = names.count(A.STEP_SPAN_PREFILL)
    assert prefills >= 1 and names == [A.STEP_SPAN_PREFILL] * prefills + [A.STEP_SPAN_DECODE] * (answered["usage"] - 1)
    assert attrs[A.GEN_AI_RESPONSE_FINISH_REASONS] == [answered["finish_reason"]]
    assert request["status"] == Status.STATUS_CODE_UNSET
    if MODEL_PROCESS or mode == "continuous_batching":  # the thread-based serve of 5.24 names only CB requests
        assert attrs[A.GEN_AI_RESPONSE_ID] == answered["id"]
    if MODEL_PROCESS:  # the model's own process: a child of the API server (or of the supervisor of several)
        assert request["pid"] != post["pid"] and request["pid"] == steps[0]["pid"]
        assert request["parent_pid"] == (post["pid"] if server_pid == post["pid"] else server_pid)
    else:
        assert request["pid"] == post["pid"] == server_pid
    return request


@pytest.mark.parametrize("mode", MODES)
def test_the_openai_clients_trace_crosses_into_the_model_process_and_sigterm_loses_nothing(
    mode, model_dir, receiver, tmp_path
):
    from opentelemetry.proto.trace.v1.trace_pb2 import Status

    log = tmp_path / "serve.log"
    process, base_url = start_server(model_dir, receiver, mode, log)
    client = Client(receiver, base_url, model_dir)
    try:
        started = time.monotonic()
        cancelled = client.chat("abc", stream=True, stop_after=CHUNKS_BEFORE_STOP, max_tokens=400)
        streamed = client.chat("abc", stream=True)
        answered = client.chat("Hello")  # the last response: SIGTERM right after it
        elapsed = time.monotonic() - started
    finally:
        status = stop_server(process, log)
        client.close()
    assert status == -signal.SIGTERM, log.read_text()[-3000:]  # uvicorn re-raises it once the app is down
    # nothing more can come: what is here came before the processes exited
    spans = received_spans(receiver)
    requests = [s for s in spans if s["name"].startswith(REQUEST_PREFIX)]
    assert len(requests) == 3, (log.read_text()[-3000:], sorted(s["name"] for s in spans))

    for result in (streamed, answered):
        request = check_one_trace(spans, result, model_dir, process.pid, mode)
        if mode == "continuous_batching":
            assert request["attributes"][A.GENERATE_TIME_IN_QUEUE] >= 0
    streamed_attrs = check_one_trace(spans, streamed, model_dir, process.pid, mode)["attributes"]
    assert streamed_attrs[A.GEN_AI_REQUEST_STREAM] is True
    first_chunk = streamed_attrs[A.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK]
    assert 0 < first_chunk < elapsed

    # the client that closed its stream after 3 chunks (the first carries the role only): cancelled, not an error
    (request,) = [s for s in requests if A.FINISH_REASON_CANCELLED in s["attributes"][A.GEN_AI_RESPONSE_FINISH_REASONS]]
    if MODEL_PROCESS or mode == "continuous_batching":
        assert request["attributes"][A.GEN_AI_RESPONSE_ID] == cancelled["id"]
    attrs = request["attributes"]
    assert attrs[A.GEN_AI_RESPONSE_FINISH_REASONS] == [A.FINISH_REASON_CANCELLED]
    assert request["status"] == Status.STATUS_CODE_UNSET and A.ERROR_TYPE not in attrs
    tokens_received = [c for c in cancelled["chunks"] if c.choices and c.choices[0].delta.content]
    assert len(tokens_received) == CHUNKS_BEFORE_STOP - 1
    assert len(tokens_received) <= attrs[A.GEN_AI_USAGE_OUTPUT_TOKENS] < 400
    (post,) = [s for s in spans if s["span_id"] == request["parent_id"]]
    assert post["name"] == CHAT
    if MODEL_PROCESS:
        assert request["pid"] != post["pid"]

    # the metrics of the model's process were flushed too (the SDK exports them every 60 s otherwise)
    durations = [
        point
        for resource, _scope, metric in receiver.metrics(GRPC)
        if metric.name == A.METRIC_REQUEST_DURATION
        for point in metric.histogram.data_points
        if any(kv.key == "process.pid" and kv.value.int_value == request["pid"] for kv in resource.attributes)
    ]
    assert sum(point.count for point in durations) >= 2


@pytest.mark.skipif(not MODEL_PROCESS, reason="transformers up to 5.24 serves from one process (no --api-server-count)")
@pytest.mark.parametrize("mode", MODES)
def test_two_api_servers_and_four_concurrent_clients_each_request_in_its_own_trace(mode, model_dir, receiver, tmp_path):
    log = tmp_path / "serve.log"
    process, base_url = start_server(model_dir, receiver, mode, log, api_servers=2)
    client = Client(receiver, base_url, model_dir)
    prompts = ["Hello", "abc", "hi there", "xyz"]
    answers: Dict[str, Dict[str, Any]] = {}
    errors: List[BaseException] = []

    def ask(prompt):
        try:
            answers[prompt] = client.chat(prompt)
        except BaseException as exc:  # reported below
            errors.append(exc)

    try:
        threads = [threading.Thread(target=ask, args=(prompt,)) for prompt in prompts]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        stop_server(process, log)
        client.close()
    assert not errors, errors
    spans = wait_for(receiver, lambda found: True, timeout_s=0)
    requests = [s for s in spans if s["name"].startswith(REQUEST_PREFIX)]
    assert len(requests) == len(prompts), (log.read_text()[-3000:], sorted(s["name"] for s in spans))
    traces = set()
    for prompt in prompts:
        request = check_one_trace(spans, answers[prompt], model_dir, process.pid, mode)
        traces.add(request["trace_id"])
    # none crossed: four traces, one request span in each, all from the one model's process
    assert len(traces) == len(prompts)
    assert len({s["pid"] for s in requests}) == 1
    posts = [s for s in spans if s["name"] == CHAT]
    assert len(posts) == len(prompts) and all(s["parent_pid"] == process.pid for s in posts)
