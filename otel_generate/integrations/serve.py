"""``transformers serve``: each HTTP request's ``generate()`` in the trace of that HTTP request.

Without ``--continuous-batching``, ``transformers serve`` runs every ``model.generate()`` on one
long-lived inference thread (``transformers.cli.serving.utils.InferenceThread``): the request
handler, on the server's event loop, hands it a function with ``submit``/``async_submit`` and
awaits the result. The inference thread's OpenTelemetry context is not the handler's: it is
empty (in-process, the request span is a root of its own trace), or, under
``opentelemetry-instrument`` with the threading instrumentation, the context of the HTTP request
that happened to start the thread (every later request's span lands in the first one's trace).

Hook (when that module is imported; nothing is imported here): ``InferenceThread.submit`` and
``async_submit`` capture the OpenTelemetry context current in the handler (the HTTP server span
of that request) and run the function under it on the inference thread. Only the OpenTelemetry
context travels, not the handler's other context variables.

With ``--continuous-batching`` the handler calls ``add_request`` itself, in its own context:
:mod:`.continuous_batching` takes the parent there, and nothing serve-specific is needed.

Shutdown (both modes): on ``SIGTERM`` (``kill``, Kubernetes ending a pod) or ``SIGINT``,
uvicorn shuts the app down gracefully and then re-raises the signal with its default handler,
which ends the process without the SDK's exit flush: the spans still queued in the batch span
processor (up to its 5 s schedule delay) were lost. Hook (when
``transformers.cli.serving.server`` is imported): the app ``build_server`` returns gets a
lifespan that, after transformers' own shutdown, force-flushes the providers the
instrumentation uses, bounded by the exporter's timeout
(:func:`otel_generate._lifecycle.flush_in_use`).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable

from opentelemetry import context as otel_context

from otel_generate import _lifecycle
from otel_generate._faults import Fault, log_fault_once
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
