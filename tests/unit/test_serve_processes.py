"""``transformers serve`` 5.25+ (an engine process fed by a queue), without transformers: the trace context
carried with a queued request, the model's process reading it back, and the self-check of the serve rows
of the patch table on stand-in modules.

The real processes, with the real transformers, are in tests/e2e/test_serve_processes.py.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import queue
import sys
import types
from multiprocessing.reduction import ForkingPickler

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from otel_generate._patch import Patches
from otel_generate.instrumentor import ENGINE, PATCHES, SERVE, SERVER, _install_module
from otel_generate.integrations import _carrier, serve
from otel_generate.integrations._routing import response_id

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
TRACE_ID = 0x0AF7651916CD43DD8448EB211C80319C


def _telemetry():
    return types.SimpleNamespace(active=True, content=None, emitter=None)


def _through_a_queue(obj):
    """What the model's process reads of ``obj`` after a ``multiprocessing`` queue pickled it."""
    return ForkingPickler.loads(bytes(ForkingPickler.dumps(obj)))


def test_the_carried_context_survives_the_queue_and_leaves_the_arguments_as_they_were():
    settings = {"max_new_tokens": 6, "do_sample": False}
    carried = _carrier.carrying(settings, {"traceparent": TRACEPARENT, _carrier.RESPONSE_ID: "chatcmpl-1"})
    function_args = _carrier.carrying((1, "two"), {"traceparent": TRACEPARENT})
    message = ("generate", 7, {"input_ids": [[1, 2]]}, carried, True)
    arrived = _through_a_queue(message)
    assert arrived == message and arrived[3] == settings and type(arrived[3]) is _carrier.CarryingDict
    assert _through_a_queue(function_args) == (1, "two") and isinstance(_through_a_queue(function_args), tuple)
    carrier = _carrier.carrier_of(arrived)
    assert carrier == {"traceparent": TRACEPARENT, "response_id": "chatcmpl-1"}
    context = _carrier.context_of(carrier, serve.RESPONSE_ID_KEY)
    parent = trace.get_current_span(context).get_span_context()
    assert (parent.trace_id, parent.span_id, parent.is_remote) == (
        TRACE_ID,
        0xB7AD6B7169203331,
        True,
    )
    assert response_id(context) == "chatcmpl-1"
    # what transformers' code does with it: a plain dict and tuple for every purpose
    assert {**arrived[3]} == settings and arrived[3].pop("max_new_tokens") == 6
    assert _carrier.carrier_of(("cancel", 7)) is None
    assert _carrier.carrying(settings, {}) is settings  # nothing to carry: the argument itself


def test_the_api_server_hook_carries_the_submitters_span_and_the_clients_id():
    sent = []

    async def _send_request(self, method, args, streamer=None):
        sent.append((method, args, streamer))
        return "done"

    hooked = serve.make_send_request(_send_request, _telemetry())
    provider = TracerProvider()
    scope = {"type": "http", "state": {"request_id": "req-42"}}

    async def handler():
        token = serve._SCOPE.set(scope)  # what the RequestIdMiddleware hook does for the request
        try:
            with provider.get_tracer("t").start_as_current_span("POST /v1/chat/completions") as span:
                await hooked(None, "generate", args=({"input_ids": [1]}, {"max_new_tokens": 3}))
                await hooked(None, "submit", (print, (1,)))
                return span.get_span_context()
        finally:
            serve._SCOPE.reset(token)

    post = asyncio.run(handler())
    (method, (inputs, settings), _), (_, (function, function_args), _) = sent
    assert method == "generate" and inputs == {"input_ids": [1]} and settings == {"max_new_tokens": 3}
    assert function is print and function_args == (1,)
    for carried in (settings, function_args):
        carrier = getattr(carried, _carrier.ATTRIBUTE)
        assert carrier["traceparent"] == f"00-{post.trace_id:032x}-{post.span_id:016x}-{int(post.trace_flags):02x}"
        assert carrier[_carrier.RESPONSE_ID] == "req-42"


def test_the_model_process_reads_each_request_in_its_context_and_its_thread_runs_it_there():
    requests = queue.Queue()
    reader = serve.RequestsWithContext(requests, _telemetry())
    carried = _carrier.carrying({}, {"traceparent": TRACEPARENT, _carrier.RESPONSE_ID: "req-1"})
    requests.put(_through_a_queue(("generate", 1, {}, carried, False)))
    requests.put(("cancel", 1))
    runner_queue = serve.QueueWithContext(queue.Queue(), _telemetry())
    seen = []

    def generate_tokens(model, processor):
        span = trace.get_current_span().get_span_context()
        seen.append((span.trace_id, response_id()))

    method, request_id, *_ = reader.get()  # the engine loop's requests.get(): the request's context is current
    assert trace.get_current_span().get_span_context().trace_id == TRACE_ID
    runner_queue.put((request_id, generate_tokens, (), False))  # GenerateRunner.generate queues its closure
    assert reader.get() == ("cancel", 1)  # the next message: the previous context is gone
    assert trace.get_current_span().get_span_context().trace_id == 0 and response_id() is None
    _, function, args, _ = runner_queue.get()  # the runner's thread
    function(None, None, *args)
    assert seen == [(TRACE_ID, "req-1")]
    assert runner_queue.qsize() == 0  # the rest is the queue's own


def test_run_engine_keeps_its_name_for_spawn_and_reads_its_requests_in_context(monkeypatch):
    monkeypatch.setattr(serve, "flush_on_signals", lambda: None)
    got = []

    def run_engine(load, generation_state, requests, results, writer, report_progress, log_level):
        got.append(requests)

    run_engine.__qualname__ = "EngineClient.run_engine"
    replacement = serve.make_run_engine(staticmethod(run_engine), _telemetry())
    assert isinstance(replacement, staticmethod)
    function = replacement.__func__
    assert (function.__qualname__, function.__module__) == (run_engine.__qualname__, run_engine.__module__)
    function(None, None, "the queue", [], None, False, 20)
    (wrapped,) = got
    assert isinstance(wrapped, serve.RequestsWithContext) and wrapped._requests == "the queue"


def _serve_modules(engine_client):
    """Stand-ins of transformers 5.25's serving modules, with ``engine_client`` as their ``EngineClient``."""

    class RequestIdMiddleware:
        async def __call__(self, scope, receive, send):
            return None

    class GenerateRunner:
        def __init__(self, model, processor, send_results):
            self.queue = queue.Queue()

    def build_server(model_manager, *handlers, enable_cors=False):
        return None

    utils = types.ModuleType(SERVE)
    vars(utils).update(RequestIdMiddleware=RequestIdMiddleware, GenerateRunner=GenerateRunner)
    engine = types.ModuleType(ENGINE)
    engine.EngineClient = engine_client
    server = types.ModuleType(SERVER)
    server.build_server = build_server
    return {SERVE: utils, ENGINE: engine, SERVER: server}


def _install_serve(modules, monkeypatch, caplog):
    """Install the serve rows on the stand-ins as their imports would (server last: it imports the others)."""
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    patches = Patches()
    with caplog.at_level(logging.INFO, logger="otel_generate"):
        for name in (SERVE, ENGINE, SERVER):
            _install_module(patches, _telemetry(), name, tuple(r for r in PATCHES if r.module == name), modules[name])
    return patches, [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_missing_serve_point_gives_one_warning_and_the_rest_is_installed(monkeypatch, caplog):
    class EngineClient:  # transformers "5.26": run_engine is gone
        async def _send_request(self, method, args, streamer=None):
            return None

    modules = _serve_modules(EngineClient)
    patches, warnings = _install_serve(modules, monkeypatch, caplog)
    version = importlib.metadata.version("transformers")
    assert [(r.getMessage(), r.exc_info) for r in warnings] == [
        (
            f"otel_generate: transformers {version}: `transformers serve` requests will not be traced: "
            "`EngineClient.run_engine` not found",
            None,
        )
    ]
    utils, server = modules[SERVE], modules[SERVER]
    assert set(patches.installed()) == {
        (utils.RequestIdMiddleware, "__call__"),
        (utils.GenerateRunner, "__init__"),
        (EngineClient, "_send_request"),
        (server, "build_server"),
    }
    patches.restore_all()


def test_a_serve_point_whose_signature_changed_is_left_alone_with_one_warning(monkeypatch, caplog):
    class EngineClient:
        async def _send_request(self, method, args, streamer=None):
            return None

        @staticmethod
        def run_engine(load, generation_state, request_queue, results, writer, report_progress, log_level):
            return None

    original = vars(EngineClient)["run_engine"]
    patches, warnings = _install_serve(_serve_modules(EngineClient), monkeypatch, caplog)
    (warning,) = warnings
    assert warning.getMessage().endswith(
        "`transformers serve` requests will not be traced: `EngineClient.run_engine` has no parameter `requests`"
    )
    assert vars(EngineClient)["run_engine"] is original and not patches.is_installed(EngineClient, "run_engine")
    assert patches.is_installed(EngineClient, "_send_request")
    patches.restore_all()


def test_the_thread_based_serve_of_5_24_needs_no_engine_points(monkeypatch, caplog):
    class InferenceThread:
        def submit(self, fn, *args, **kwargs):
            return fn(*args, **kwargs)

        def async_submit(self, fn, *args, **kwargs):
            return fn(*args, **kwargs)

    utils = types.ModuleType(SERVE)
    utils.InferenceThread = InferenceThread
    server = types.ModuleType(SERVER)
    server.build_server = lambda *args, **kwargs: None
    engine = types.ModuleType(ENGINE)  # 5.24's model_manager: no EngineClient
    patches, warnings = _install_serve({SERVE: utils, ENGINE: engine, SERVER: server}, monkeypatch, caplog)
    assert warnings == []
    assert patches.is_installed(InferenceThread, "submit") and patches.is_installed(InferenceThread, "async_submit")
    patches.restore_all()


def test_a_model_process_flushes_on_sigterm_then_ends_as_the_signal_would(monkeypatch):
    flushed, previous_calls, installed = [], [], {}
    monkeypatch.setattr(serve._lifecycle, "flush_in_use", lambda reason: flushed.append(reason) or True)
    monkeypatch.setattr(serve.signal, "getsignal", lambda number: installed.get(number, serve.signal.SIG_DFL))
    monkeypatch.setattr(serve.signal, "signal", lambda number, handler: installed.__setitem__(number, handler))
    killed = []
    monkeypatch.setattr(serve.os, "kill", lambda pid, number: killed.append(number))
    installed[serve.signal.SIGINT] = serve.signal.SIG_IGN  # transformers' model's process ignores Ctrl-C
    serve.flush_on_signals()
    serve.flush_on_signals()  # once: a second call does not wrap the handler again
    assert installed[serve.signal.SIGINT] is serve.signal.SIG_IGN
    handler = installed[serve.signal.SIGTERM]
    assert handler.func is serve._flush_then and handler.args == (serve.signal.SIG_DFL,)
    handler(serve.signal.SIGTERM, None)
    assert len(flushed) == 1 and flushed[0].startswith("on SIGTERM in process ")
    assert installed[serve.signal.SIGTERM] is serve.signal.SIG_DFL and killed == [serve.signal.SIGTERM]
    installed[serve.signal.SIGTERM] = lambda number, frame: previous_calls.append(number)  # an app's own handler
    serve.flush_on_signals()
    installed[serve.signal.SIGTERM](serve.signal.SIGTERM, None)
    assert previous_calls == [serve.signal.SIGTERM] and len(flushed) == 2


def test_nothing_is_attached_while_the_instrumentation_is_off():
    telemetry = _telemetry()
    telemetry.active = False
    requests = queue.Queue()
    requests.put(("generate", 1, {}, _carrier.carrying({}, {"traceparent": TRACEPARENT}), False))
    before = otel_context.get_current()
    serve.RequestsWithContext(requests, telemetry).get()
    assert otel_context.get_current() == before
