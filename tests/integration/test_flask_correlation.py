"""Correlation with the application's own spans: a Flask request handler calls generate().

``examples/flask_app.py`` runs on 127.0.0.1 (an ephemeral port, werkzeug's server in a thread),
instrumented by ``opentelemetry-instrumentation-flask``; the test sends a real HTTP request with a
W3C ``traceparent`` header and checks the trace: the client's span -> Flask's HTTP server span ->
``text_completion ...`` -> ``prefill``/``decode``, all in the client's trace.
"""

from __future__ import annotations

import importlib.util
import json
import random
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from opentelemetry.instrumentation.flask import FlaskInstrumentor
from opentelemetry.trace import SpanKind
from werkzeug.serving import make_server

from otel_generate import attributes as A
from tests.helpers import request_spans, step_spans

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "flask_app.py"


def _load_example():
    spec = importlib.util.spec_from_file_location("flask_app_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


flask_app = _load_example()


@pytest.fixture
def server(gpt2, instrumented, tracer_provider):
    """The example app served on 127.0.0.1:<ephemeral>; yields its base URL; stopped in teardown."""
    app = flask_app.create_app(gpt2, tracer_provider=tracer_provider)
    httpd = make_server("127.0.0.1", 0, app, threaded=False)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_port}"
    finally:
        # returns once the request in progress (and its server span) has finished
        httpd.shutdown()
        thread.join(timeout=10)
        httpd.server_close()
        FlaskInstrumentor().uninstrument_app(app)


def _get(url: str, headers=None):
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as error:
        return error.code, json.load(error)


def _status_code(span):
    # old and new HTTP semantic conventions, whichever the instrumentation emits
    return span.attributes.get("http.response.status_code", span.attributes.get("http.status_code"))


def test_http_server_span_is_the_parent_of_the_generate_span(server, span_exporter):
    rng = random.Random(7)
    client_trace_id, client_span_id = rng.getrandbits(128), rng.getrandbits(64)
    traceparent = f"00-{client_trace_id:032x}-{client_span_id:016x}-01"
    status, body = _get(f"{server}/generate?new_tokens=5&prompt_tokens=3&seed=1", {"traceparent": traceparent})
    assert status == 200, body

    spans = span_exporter.get_finished_spans()
    (http_span,) = [s for s in spans if s.kind == SpanKind.SERVER]
    (request,) = request_spans(span_exporter)
    steps = step_spans(span_exporter, request)

    # one trace, the client's: client -> HTTP server span -> text_completion -> steps
    assert {s.context.trace_id for s in spans} == {client_trace_id}
    assert body["trace_id"] == f"{client_trace_id:032x}"
    assert http_span.parent.span_id == client_span_id and http_span.parent.is_remote
    assert http_span.name == "GET /generate"
    assert http_span.attributes.get("http.route") == "/generate"
    assert _status_code(http_span) == 200
    assert request.parent.span_id == http_span.context.span_id
    assert request.name == f"{A.OPERATION_TEXT_COMPLETION} {request.attributes[A.GEN_AI_REQUEST_MODEL]}"
    assert len(spans) == 2 + len(steps)

    # the steps are the request's children, one per token the handler returned
    assert len(body["continuation"]) == 5
    assert [s.name for s in steps] == [A.STEP_SPAN_PREFILL] + [A.STEP_SPAN_DECODE] * 4
    assert all(s.parent.span_id == request.context.span_id for s in steps)
    assert request.attributes[A.GEN_AI_USAGE_OUTPUT_TOKENS] == len(body["continuation"])
    assert request.attributes[A.GEN_AI_USAGE_INPUT_TOKENS] == 3
    # the handler's profiler saw the same measurement as the span
    assert body["time_to_first_token_ms"] == pytest.approx(request.attributes[A.GENERATE_TIME_TO_FIRST_TOKEN] * 1e3)

    # nesting in time: steps inside the request, the request inside the HTTP span
    assert http_span.start_time <= request.start_time <= request.end_time <= http_span.end_time
    for step in steps:
        assert request.start_time <= step.start_time <= step.end_time <= request.end_time


def test_bad_request_is_rejected_before_generate(server, span_exporter):
    status, body = _get(f"{server}/generate?new_tokens=0")
    assert status == 400 and "new_tokens" in body["error"]
    spans = span_exporter.get_finished_spans()
    assert [s.kind for s in spans] == [SpanKind.SERVER]
    assert _status_code(spans[0]) == 400
    assert request_spans(span_exporter) == []
