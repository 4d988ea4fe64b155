"""``transformers serve``: each HTTP request's ``generate()`` in the trace of that HTTP request.

**transformers 5.25 and newer** (``cli/serving/model_manager.py``): the model runs in a process of
its own, started with ``multiprocessing``'s ``spawn``, and one API server (or several,
``--api-server-count``) answers HTTP. A handler hands its request to ``EngineClient._send_request``,
which puts it on the requests queue; the model's process takes it off in ``EngineClient.run_engine``
and hands it to its runner (``GenerateRunner``: ``generate()`` on one thread of its own;
``CBGenerateRunner``: continuous batching's ``add_request``). The hooks, when their modules are
imported (nothing is imported here):

* ``EngineClient._send_request`` (API server): the W3C ``traceparent``/``tracestate`` of the span
  current there (FastAPI's ``POST`` server span) and the id the client receives go **with the
  request**, on its last argument (:mod:`._carrier`), not through a global.
* ``RequestIdMiddleware.__call__`` (API server): notes the ASGI scope its request runs in, where
  transformers writes the id it answers with (``scope["state"]["request_id"]``).
* ``EngineClient.run_engine`` (the model's process): its requests queue is read through
  :class:`RequestsWithContext`, which attaches each request's carried context (its remote parent
  and its response id, :data:`~._routing.RESPONSE_ID_KEY`) while the runner takes it: continuous
  batching's ``add_request`` runs then, and takes its parent there. It also makes the process flush
  its telemetry when it is stopped by a signal (:func:`flush_on_signals`).
* ``GenerateRunner.__init__`` (the model's process): the runner's own queue, which feeds its
  ``generate()`` thread, runs each function in the context current where it was queued
  (:class:`QueueWithContext`).

The model's process is instrumented the way the server is: under ``opentelemetry-instrument``, a
``spawn`` child starts a fresh interpreter from the server's environment, whose ``PYTHONPATH`` brings
the agent's ``sitecustomize`` back, which configures the SDK from the same ``OTEL_*`` variables and
instruments (``tests/e2e/test_serve_processes.py`` checks the request span comes from that process).
An API server instrumented in code (``instrument()``) cannot hand its providers to a process it
spawns: that process is then not traced, and runs its requests unchanged.

**transformers up to 5.24**: ``transformers serve`` runs every ``model.generate()`` on one
long-lived inference thread (``transformers.cli.serving.utils.InferenceThread``): the request
handler, on the server's event loop, hands it a function with ``submit``/``async_submit`` and
awaits the result. The inference thread's OpenTelemetry context is not the handler's: it is
empty (in-process, the request span is a root of its own trace), or, under
``opentelemetry-instrument`` with the threading instrumentation, the context of the HTTP request
that happened to start the thread (every later request's span lands in the first one's trace).
Hook: ``InferenceThread.submit`` and ``async_submit`` capture the OpenTelemetry context current in
the handler (the HTTP server span of that request) and run the function under it on the inference
thread. Only the OpenTelemetry context travels, not the handler's other context variables.
With ``--continuous-batching`` the handler calls ``add_request`` itself, in its own context:
:mod:`.continuous_batching` takes the parent there, and nothing serve-specific is needed.

Shutdown (every release): on ``SIGTERM`` (``kill``, Kubernetes ending a pod) or ``SIGINT``,
uvicorn shuts the app down gracefully and then re-raises the signal with its default handler,
which ends the process without the SDK's exit flush: the spans still queued in the batch span
processor (up to its 5 s schedule delay) were lost. Hook (when
``transformers.cli.serving.server`` is imported): the app ``build_server`` returns gets a
lifespan that, after transformers' own shutdown, force-flushes the providers the
instrumentation uses, bounded by the exporter's timeout
(:func:`otel_generate._lifecycle.flush_in_use`). The model's process of 5.25 is stopped with
``SIGTERM`` (by its API server, or by the supervisor of several); :func:`flush_on_signals`
flushes there before the signal ends it.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import os
import signal
from typing import Any, Callable, Optional, Tuple

from opentelemetry import context as otel_context

from otel_generate import _lifecycle
from otel_generate._faults import Fault, log_fault_once
from otel_generate.integrations import _carrier
from otel_generate.integrations._routing import RESPONSE_ID_KEY
from otel_generate.telemetry import Telemetry


def in_context(function: Callable, context: Any) -> Callable:
    """``function`` run under the OpenTelemetry ``context`` (attached, then detached), whatever thread calls it."""

    @functools.wraps(function)
    def run(*args: Any, **kwargs: Any) -> Any:
        token = otel_context.attach(context)
        try:
            return function(*args, **kwargs)
        finally:
            otel_context.detach(token)

    return run


def make_submit(original: Callable, telemetry: Telemetry) -> Callable:
    """``InferenceThread.submit``/``async_submit(fn, *args, **kwargs)``: ``fn`` runs in the submitter's context."""

    @functools.wraps(original)
    def submit(self, *args, **kwargs):
        if telemetry.active and args and callable(args[0]):
            try:
                args = (in_context(args[0], otel_context.get_current()),) + args[1:]
            except Exception as fault:
                log_fault_once(Fault.SERVE_CONTEXT_CAPTURE, fault)
        return original(self, *args, **kwargs)

    return submit


def make_build_server(original: Callable, telemetry: Telemetry) -> Callable:
    """``build_server(...)``: the app it returns flushes telemetry when its lifespan ends."""

    @functools.wraps(original)
    def build_server(*args, **kwargs):
        app = original(*args, **kwargs)
        if telemetry.active:
            try:
                flush_when_lifespan_ends(app)
            except Exception as fault:
                log_fault_once(Fault.SERVE_SHUTDOWN_FLUSH_INSTALL, fault)
        return app

    return build_server


def flush_when_lifespan_ends(app: Any) -> None:
    """Wrap the Starlette/FastAPI ``app``'s lifespan: after it ends (the app's own shutdown
    first), force-flush the providers the instrumentation uses, at most the exporter's timeout."""
    router = app.router
    lifespan = router.lifespan_context

    @contextlib.asynccontextmanager
    async def flushing_lifespan(app: Any):
        try:
            async with lifespan(app) as state:
                yield state
        finally:
            _lifecycle.flush_in_use("at the server's shutdown")

    router.lifespan_context = flushing_lifespan


# --- transformers 5.25 and newer: API servers and the model's process ------------------------------

#: The ASGI scope of the HTTP request the current task serves (``RequestIdMiddleware``), else ``None``.
_SCOPE: contextvars.ContextVar[Any] = contextvars.ContextVar("otel_generate_serve_scope", default=None)

#: What each hook reads of its function's arguments: the hooks check these parameters exist when
#: they are installed (``instrumentor``'s self-check), and read them by name or position.
SEND_REQUEST_ARGUMENT = "args"
RUN_ENGINE_ARGUMENT = "requests"


def _argument_index(function: Callable, name: str) -> int:
    """The position of parameter ``name`` in ``function``'s signature, ``self`` included."""
    return list(inspect.signature(function).parameters).index(name)


def _replace_argument(args: tuple, kwargs: dict, index: int, name: str, replace: Callable[[Any], Any]) -> Tuple:
    if name in kwargs:
        kwargs = dict(kwargs)
        kwargs[name] = replace(kwargs[name])
    elif index < len(args):
        args = args[:index] + (replace(args[index]),) + args[index + 1 :]
    return args, kwargs


def _response_id() -> Optional[str]:
    scope = _SCOPE.get()
    state = scope.get("state") if isinstance(scope, dict) else None
    value = state.get("request_id") if isinstance(state, dict) else None
    return value if isinstance(value, str) else None


def _with_carrier(arguments: Any) -> Any:
    """The request's arguments (``args`` of ``_send_request``), its last one carrying the context."""
    if not isinstance(arguments, tuple) or not arguments:
        return arguments
    carrier = _carrier.current_carrier(_response_id())
    return arguments[:-1] + (_carrier.carrying(arguments[-1], carrier),)


def make_send_request(original: Callable, telemetry: Telemetry) -> Callable:
    """``EngineClient._send_request(method, args, streamer=None)`` (API server): the request's last
    argument carries the submitter's trace context and the client's response id."""
    index = _argument_index(original, SEND_REQUEST_ARGUMENT)

    @functools.wraps(original)
    async def _send_request(*args, **kwargs):
        if telemetry.active:
            try:
                args, kwargs = _replace_argument(args, kwargs, index, SEND_REQUEST_ARGUMENT, _with_carrier)
            except Exception as fault:
                log_fault_once(Fault.SERVE_CONTEXT_CAPTURE, fault)
        return await original(*args, **kwargs)

    return _send_request


def make_request_id_middleware(original: Callable, telemetry: Telemetry) -> Callable:
    """``RequestIdMiddleware.__call__(scope, receive, send)`` (API server): the request's handlers
    find its scope, where transformers writes the id the client receives."""

    @functools.wraps(original)
    async def __call__(self, scope, *args, **kwargs):
        if not telemetry.active:
            return await original(self, scope, *args, **kwargs)
        token = _SCOPE.set(scope)
        try:
            return await original(self, scope, *args, **kwargs)
        finally:
            _SCOPE.reset(token)

    return __call__


class RequestsWithContext:
    """The model's process's requests queue, read in each request's carried context: :meth:`get`
    attaches the context of the request it returns (its remote parent, its response id) until the
    next :meth:`get`, while the runner takes the request; everything else is the queue's."""

    def __init__(self, requests: Any, telemetry: Telemetry) -> None:
        self._requests = requests
        self._telemetry = telemetry
        self._token: Any = None

    def get(self, *args: Any, **kwargs: Any) -> Any:
        self._detach()
        message = self._requests.get(*args, **kwargs)
        if self._telemetry.active:
            try:
                carrier = _carrier.carrier_of(message)
                if carrier is not None:
                    self._token = otel_context.attach(_carrier.context_of(carrier, RESPONSE_ID_KEY))
            except Exception as fault:
                log_fault_once(Fault.SERVE_CONTEXT_CAPTURE, fault)
        return message

    def _detach(self) -> None:
        token, self._token = self._token, None
        if token is not None:
            try:
                otel_context.detach(token)
            except Exception as fault:  # pragma: no cover - a context attached and not detached in between
                log_fault_once(Fault.CONTEXT_DETACH, fault)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._requests, name)


def make_run_engine(original: Any, telemetry: Telemetry) -> Any:
    """``EngineClient.run_engine`` (a static method; what the model's process runs): its requests
    are read in their carried context, and the process flushes its telemetry on ``SIGTERM``.

    The replacement keeps the original's name and module, so that the server's ``spawn`` pickles it
    by the same reference (``EngineClient.run_engine``) whichever process resolves it."""
    function = original.__func__ if isinstance(original, staticmethod) else original
    index = _argument_index(function, RUN_ENGINE_ARGUMENT)

    @functools.wraps(function)
    def run_engine(*args, **kwargs):
        if telemetry.active:
            try:
                args, kwargs = _replace_argument(
                    args, kwargs, index, RUN_ENGINE_ARGUMENT, lambda queue: RequestsWithContext(queue, telemetry)
                )
                flush_on_signals()
            except Exception as fault:
                log_fault_once(Fault.SERVE_CONTEXT_CAPTURE, fault)
        return function(*args, **kwargs)

    return staticmethod(run_engine) if isinstance(original, staticmethod) else run_engine


class QueueWithContext:
    """A ``GenerateRunner``'s queue of ``(request id, function, args, stream)``: :meth:`put` makes
    the function run, on the runner's thread, in the OpenTelemetry context current where it was
    queued (the request's, attached by :class:`RequestsWithContext`); everything else is the queue's."""

    def __init__(self, queue: Any, telemetry: Telemetry) -> None:
        self._queue = queue
        self._telemetry = telemetry

    def put(self, item: Any, *args: Any, **kwargs: Any) -> Any:
        if self._telemetry.active and isinstance(item, tuple) and len(item) > 1 and callable(item[1]):
            try:
                item = (item[0], in_context(item[1], otel_context.get_current())) + item[2:]
            except Exception as fault:
                log_fault_once(Fault.SERVE_CONTEXT_CAPTURE, fault)
        return self._queue.put(item, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._queue, name)


def make_runner_init(original: Callable, telemetry: Telemetry) -> Callable:
    """``GenerateRunner.__init__`` (the model's process): its queue runs each function in the
    context it was queued in. The runner's thread, already waiting on the queue, reads the same one."""

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if telemetry.active:
            try:
                self.queue = QueueWithContext(self.queue, telemetry)
            except Exception as fault:
                log_fault_once(Fault.SERVE_CONTEXT_CAPTURE, fault)

    return __init__


#: Signals after which the model's process flushes before it ends (``SIGINT`` only where it is not ignored:
#: transformers' model's process ignores it and leaves Ctrl-C to the server, which stops it with ``SIGTERM``).
FLUSH_SIGNALS = ("SIGTERM", "SIGINT")


def flush_on_signals() -> None:
    """In this process (its main thread), flush the telemetry on :data:`FLUSH_SIGNALS`, then let
    the handler that was there run (the default one ends the process by the same signal)."""
    for name in FLUSH_SIGNALS:
        number = getattr(signal, name, None)
        if number is None:
            continue
        previous = signal.getsignal(number)
        if previous in (signal.SIG_IGN, None) or getattr(previous, "_otel_generate_flush", False):
            continue
        handler = functools.partial(_flush_then, previous)
        handler._otel_generate_flush = True  # type: ignore[attr-defined]
        signal.signal(number, handler)


def _flush_then(previous: Any, number: int, frame: Any) -> None:
    name = signal.Signals(number).name
    _lifecycle.flush_in_use(f"on {name} in process {os.getpid()}")
    if callable(previous):
        previous(number, frame)
        return
    signal.signal(number, signal.SIG_DFL)  # end the process as the signal would have
    os.kill(os.getpid(), number)
