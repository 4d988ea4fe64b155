"""``transformers serve``, with and without ``--continuous-batching``: each HTTP request's
``text_completion`` span is a child of that request's HTTP server span.

The server runs on 127.0.0.1 (an ephemeral port) with the local model and tokenizer that
``examples/serve_demo.py`` writes (nothing is downloaded):

* in this process (``Serve(non_blocking=True)``, transformers' own test hook, up to 5.24) with FastAPI
  instrumented and ``GenerateInstrumentor().instrument()``. transformers 5.25 and newer run the model in
  a spawned process of its own, which an instrumentation turned on in code cannot reach: those tests skip
  there, and tests/e2e/test_serve_processes.py covers the same cases across the processes;
* as ``opentelemetry-instrument transformers serve ...`` (FastAPI, threading and this package all
  instrumented by the agent; OTLP to :class:`tests.helpers.otlp_receiver.OTLPReceiver`), on every release:
  up to 5.24, before this package carried the submitter's context, every request after the first
  landed in the first one's trace; from 5.25, the request spans come from the model's process.

Each run sends two requests at the same time (the subprocess one first sends one alone, so that the
inference thread is started by another request), each inside a client span of its own trace
(``serve_demo.send_concurrent``), whose ``traceparent`` it sends.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import SpanKind

from otel_generate import attributes as A
from tests.helpers import request_spans, step_spans
from tests.helpers.otlp_receiver import GRPC, OTLPReceiver, any_value

serving_utils = pytest.importorskip(
    "transformers.cli.serving.utils", reason="this transformers has no OpenAI-compatible serve"
)
for _module in ("fastapi", "uvicorn", "openai", "opentelemetry.instrumentation.fastapi", "accelerate"):
    pytest.importorskip(_module, reason=f"transformers serve tests need {_module} (the [test] extra)")

#: Up to 5.24 the model runs in the server's process (an inference thread), which a test can serve in-process.
IN_PROCESS = hasattr(serving_utils, "InferenceThread")
in_process_only = pytest.mark.skipif(
    not IN_PROCESS,
    reason="transformers 5.25+ runs the model in a spawned process that instrument() in this process cannot "
    "reach; tests/e2e/test_serve_processes.py covers these cases across the processes",
)
#: The client's spans: recorded (valid trace ids to send), not exported.
CLIENT_TRACER = TracerProvider().get_tracer("tests.integration.test_serve")

ROOT = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("serve_demo", ROOT / "examples" / "serve_demo.py")
serve_demo = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(serve_demo)

#: "Hello" stops early on EOS with this model; "abc" runs to max_tokens: two different lengths.
PROMPTS = ("Hello", "abc")
MAX_TOKENS = 6
#: Keep transformers serve on the CPU with a cache for the tiny model (the default one is sized from memory).
CB_OPTIONS = dict(continuous_batching=True, cb_num_blocks=16, cb_max_batch_tokens=64)
CB_FLAGS = ["--continuous-batching", "--cb-num-blocks", "16", "--cb-max-batch-tokens", "64"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return serve_demo.build_model_dir(str(tmp_path_factory.mktemp("tiny-serve")))


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(url, deadline_s, process=None, log_path=None):
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise AssertionError(f"the server exited with {process.returncode} (its output: {log_path})")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=1) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, OSError):
            time.sleep(0.1)
    raise AssertionError(f"{url}/health did not answer within {deadline_s} s")


def check_request_trees(results, spans):
    """Each result's trace: client's span -> POST server span -> text_completion -> steps, counts as answered.

    ``spans``: dicts with ``name``, ``trace_id``, ``span_id``, ``parent_id`` (ints) and ``attributes``.
    """
    assert len({r["trace_id"] for r in results}) == len(results)
    for result in results:
        trace_id, client_span = int(result["trace_id"], 16), int(result["parent_span_id"], 16)
        mine = [s for s in spans if s["trace_id"] == trace_id]
        (server,) = [s for s in mine if s["name"] == "POST /v1/completions"]
        (request,) = [s for s in mine if s["name"].startswith(A.OPERATION_TEXT_COMPLETION + " ")]
        assert server["parent_id"] == client_span
        assert request["parent_id"] == server["span_id"]
        steps = [s for s in mine if s["parent_id"] == request["span_id"]]
        usage = result["response"]["usage"]
        attrs = request["attributes"]
        assert attrs[A.GEN_AI_USAGE_INPUT_TOKENS] == usage["prompt_tokens"] == len(result["prompt"])
        assert attrs[A.GEN_AI_USAGE_OUTPUT_TOKENS] == usage["completion_tokens"]
        assert len(steps) == attrs[A.GENERATE_STEPS] == usage["completion_tokens"]  # greedy: one token per step
        assert sorted(s["name"] for s in steps) == ["decode"] * (len(steps) - 1) + ["prefill"]
        finish = result["response"]["choices"][0]["finish_reason"]
        assert list(attrs[A.GEN_AI_RESPONSE_FINISH_REASONS]) == [finish]
    # every text_completion span is in one of the clients' traces: none landed in another request's
    traces = {int(r["trace_id"], 16) for r in results}
    assert {s["trace_id"] for s in spans if s["name"].startswith(A.OPERATION_TEXT_COMPLETION + " ")} == traces


def expected_completion(model_dir, prompt):
    """The text greedy ``generate()`` continues ``prompt`` with, uninstrumented, as the server decodes it."""
    import torch
    from opentelemetry.instrumentation.utils import suppress_instrumentation
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = torch.tensor([tokenizer(prompt)["input_ids"]])
    with suppress_instrumentation():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def _sdk_span(span):
    return {
        "name": span.name,
        "trace_id": span.context.trace_id,
        "span_id": span.context.span_id,
        "parent_id": span.parent.span_id if span.parent is not None else None,
        "attributes": dict(span.attributes),
        "kind": span.kind,
    }


@in_process_only
@pytest.mark.parametrize("mode", ["plain", "continuous_batching"])
def test_in_process_serve_puts_each_request_under_its_http_span(
    mode, model_dir, instrumented, tracer_provider, span_exporter, monkeypatch
):
    import fastapi
    from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor
    from transformers.cli.serve import Serve
    from transformers.cli.serving import server

    # FastAPIInstrumentor replaces fastapi.FastAPI; transformers' server module imported the name
    # earlier in this test process, so it is pointed at the instrumented class too
    FastAPIInstrumentor().instrument(tracer_provider=tracer_provider)
    monkeypatch.setattr(server, "FastAPI", fastapi.FastAPI)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    serve = None
    try:
        options = dict(
            force_model=model_dir, host="127.0.0.1", port=port, non_blocking=True, device="cpu", log_level="error"
        )
        serve = Serve(**options, **(CB_OPTIONS if mode == "continuous_batching" else {}))
        wait_healthy(url, 120)
        span_exporter.clear()
        results = serve_demo.send_concurrent(url, PROMPTS, MAX_TOKENS, CLIENT_TRACER)
    finally:
        if serve is not None:
            serve.kill_server()
        FastAPIInstrumentor().uninstrument()
    tracer_provider.force_flush()

    spans = [_sdk_span(s) for s in span_exporter.get_finished_spans()]
    check_request_trees(results, spans)
    for result in results:  # what the server answered is what uninstrumented greedy generate() gives
        assert result["response"]["choices"][0]["text"] == expected_completion(model_dir, result["prompt"])
    assert all(s["kind"] == SpanKind.SERVER for s in spans if s["name"] == "POST /v1/completions")
    requests = {s.context.trace_id: s for s in request_spans(span_exporter)}
    for result in results:
        request = requests[int(result["trace_id"], 16)]
        assert len(step_spans(span_exporter, request)) == result["response"]["usage"]["completion_tokens"]
        if mode == "continuous_batching":  # the serve request id is the continuous-batching request's id
            assert request.attributes[A.GEN_AI_RESPONSE_ID] == result["response"]["id"]
            assert request.attributes[A.GENERATE_TIME_IN_QUEUE] >= 0


def start_instrumented_serve(model_dir, port, mode, receiver, log_path, **env_vars):
    """``opentelemetry-instrument ... transformers serve`` on 127.0.0.1:``port``, OTLP/gRPC to ``receiver``,
    output to ``log_path``; ``env_vars`` are added to the environment (no other ``OTEL_*``)."""
    bin_dir = pathlib.Path(sys.executable).parent
    command = [
        str(bin_dir / "opentelemetry-instrument"),
        str(bin_dir / "transformers"),
        "serve",
        model_dir,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--device",
        "cpu",
        *(CB_FLAGS if mode == "continuous_batching" else []),
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(
        OTEL_SERVICE_NAME="serve-test",
        OTEL_TRACES_EXPORTER="otlp",
        OTEL_METRICS_EXPORTER="none",
        OTEL_LOGS_EXPORTER="none",
        OTEL_EXPORTER_OTLP_PROTOCOL="grpc",
        OTEL_EXPORTER_OTLP_ENDPOINT=receiver.grpc_endpoint,
        PYTHONUNBUFFERED="1",
        PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}",
        **env_vars,
    )
    with open(log_path, "w") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, text=True, env=env, cwd=str(ROOT))


def received_span_records(receiver):
    return [
        {
            "name": span.name,
            "trace_id": int.from_bytes(span.trace_id, "big"),
            "span_id": int.from_bytes(span.span_id, "big"),
            "parent_id": int.from_bytes(span.parent_span_id, "big") if span.parent_span_id else None,
            "attributes": {kv.key: _plain(any_value(kv.value)) for kv in span.attributes},
        }
        for _resource, _scope, span in receiver.spans(GRPC)
    ]


def _plain(decoded):
    kind, value = decoded
    return [_plain(v) for v in value] if kind == "array_value" else value


def _stop(process, signal_number, timeout_s):
    process.send_signal(signal_number)
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@pytest.mark.parametrize("mode", ["plain", "continuous_batching"])
def test_opentelemetry_instrument_serve_puts_each_request_under_its_http_span(mode, model_dir, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    with OTLPReceiver() as receiver:
        process = start_instrumented_serve(model_dir, port, mode, receiver, log, OTEL_BSP_SCHEDULE_DELAY="100")
        try:
            wait_healthy(url, 240, process, log)
            # the first request starts the inference thread (plain mode) / the scheduler (continuous batching)
            results = serve_demo.send_concurrent(url, PROMPTS[:1], MAX_TOKENS, CLIENT_TRACER)
            results += serve_demo.send_concurrent(url, PROMPTS, MAX_TOKENS, CLIENT_TRACER)
        finally:
            _stop(process, signal.SIGTERM, 30)
        spans = received_span_records(receiver)
    assert spans, log.read_text()[-3000:]
    check_request_trees(results, spans)


@pytest.mark.parametrize("mode", ["plain", "continuous_batching"])
def test_sigterm_right_after_a_request_still_exports_its_spans(mode, model_dir, tmp_path):
    """uvicorn shuts the app down on SIGTERM and then re-raises the signal with its default
    handler, which ends the process without the SDK's exit flush: with the batch span processor's
    default 5 s delay, a request answered just before ``kill`` lost every span. The app's lifespan
    now force-flushes on the way down (and, from transformers 5.25, the model's process flushes
    before SIGTERM ends it)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    with OTLPReceiver() as receiver:
        process = start_instrumented_serve(model_dir, port, mode, receiver, log)  # the default 5 s batch delay
        try:
            wait_healthy(url, 240, process, log)
            results = serve_demo.send_concurrent(url, PROMPTS[:1], MAX_TOKENS, CLIENT_TRACER)
        finally:
            process.send_signal(signal.SIGTERM)  # at once: the batch processor has exported nothing yet
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        spans = received_span_records(receiver)
    assert process.returncode == -signal.SIGTERM, log.read_text()[
        -3000:
    ]  # the signal ended it, as uvicorn re-raises it
    requests = [s for s in spans if s["name"].startswith(A.OPERATION_TEXT_COMPLETION + " ")]
    assert len(requests) == 1, (log.read_text()[-3000:], [s["name"] for s in spans])
    (request,) = requests
    steps = [
        s
        for s in spans
        if s["parent_id"] == request["span_id"] and s["name"] in (A.STEP_SPAN_PREFILL, A.STEP_SPAN_DECODE)
    ]
    assert len(steps) == request["attributes"][A.GENERATE_STEPS] > 0
    assert request["attributes"][A.GEN_AI_USAGE_OUTPUT_TOKENS] == results[0]["response"]["usage"]["completion_tokens"]


# --- a client that goes away, time to first chunk -----------------------------------------------------

#: Chunks the client reads before it closes the stream (the user pressed Stop).
CHUNKS_BEFORE_STOP = 3


def _stream_chat(url, model_dir, max_tokens, stop_after=None):
    """Stream a chat completion with the ``openai`` client; close the stream after ``stop_after``
    chunks (``None``: read it all). Returns the chunks read."""
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    stream = client.chat.completions.create(
        model=model_dir,
        messages=[{"role": "user", "content": "abc"}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
    )
    chunks = []
    try:
        for chunk in stream:
            chunks.append(chunk)
            if stop_after is not None and len(chunks) >= stop_after:
                break
    finally:
        stream.close()
    return chunks


def _wait_for_request_spans(span_exporter, count, deadline_s=60.0):
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        spans = request_spans(span_exporter)
        if len(spans) >= count:
            return spans
        time.sleep(0.05)
    raise AssertionError(f"{count} request span(s) did not end within {deadline_s} s: {request_spans(span_exporter)}")


def _in_process_serve(model_dir, mode):
    from transformers.cli.serve import Serve

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    options = dict(force_model=model_dir, host="127.0.0.1", port=port, non_blocking=True, device="cpu")
    serve = Serve(**options, log_level="error", **(CB_OPTIONS if mode == "continuous_batching" else {}))
    wait_healthy(url, 120)
    return serve, url


@in_process_only
@pytest.mark.parametrize("mode", ["plain", "continuous_batching"])
def test_a_client_that_stops_a_stream_is_cancelled_not_an_error(mode, model_dir, instrumented, span_exporter):
    from opentelemetry.trace import StatusCode

    serve, url = _in_process_serve(model_dir, mode)
    try:
        span_exporter.clear()
        chunks = _stream_chat(url, model_dir, max_tokens=400, stop_after=CHUNKS_BEFORE_STOP)
        (span,) = _wait_for_request_spans(span_exporter, 1)
    finally:
        serve.kill_server()
    assert len(chunks) == CHUNKS_BEFORE_STOP
    attrs = span.attributes
    assert list(attrs[A.GEN_AI_RESPONSE_FINISH_REASONS]) == [A.FINISH_REASON_CANCELLED]
    assert span.status.status_code == StatusCode.UNSET
    assert A.ERROR_TYPE not in attrs
    assert not [event for event in span.events if event.name == "exception"]
    assert attrs[A.GEN_AI_REQUEST_STREAM] is True
    # the first chunk carries the role only; each later one the text of one token (a character of
    # this tokenizer): the tokens the server produced include every one the client received
    tokens_received = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(tokens_received) == CHUNKS_BEFORE_STOP - 1
    assert all(len(c.choices[0].delta.content) == 1 for c in tokens_received)
    assert attrs[A.GEN_AI_USAGE_OUTPUT_TOKENS] >= len(tokens_received)
    assert attrs[A.GEN_AI_USAGE_OUTPUT_TOKENS] < 400
    assert attrs[A.GEN_AI_USAGE_OUTPUT_TOKENS] == sum(
        s.attributes[A.GENERATE_STEP_TOKENS] for s in step_spans(span_exporter, span)
    )


@in_process_only
@pytest.mark.parametrize("mode", ["plain", "continuous_batching"])
def test_a_streamed_chat_completion_has_its_time_to_first_chunk(mode, model_dir, instrumented, span_exporter):
    serve, url = _in_process_serve(model_dir, mode)
    try:
        span_exporter.clear()
        started = time.monotonic()
        chunks = _stream_chat(url, model_dir, max_tokens=MAX_TOKENS)
        elapsed = time.monotonic() - started
        (span,) = _wait_for_request_spans(span_exporter, 1)
    finally:
        serve.kill_server()
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    attrs = span.attributes
    assert attrs[A.GEN_AI_REQUEST_STREAM] is True
    first_chunk = attrs[A.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK]
    duration = (span.end_time - span.start_time) / 1e9
    # handed over after the first step that produced a token started, before the request ended
    assert 0 < first_chunk <= duration < elapsed
    steps = step_spans(span_exporter, span)
    first_token_step = next(s for s in steps if s.attributes[A.GENERATE_STEP_TOKENS] > 0)
    assert first_chunk >= (first_token_step.start_time - span.start_time) / 1e9
    assert attrs[A.GEN_AI_USAGE_OUTPUT_TOKENS] >= len([c for c in chunks if c.choices and c.choices[0].delta.content])
