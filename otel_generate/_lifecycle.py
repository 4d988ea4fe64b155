"""Worker processes deliver their telemetry: a bounded flush on the way out of each worker.

A ``multiprocessing`` worker started by ``fork`` or ``forkserver`` (``Pool``,
``ProcessPoolExecutor``, a ``Process``) leaves through ``os._exit()``: ``atexit`` handlers,
the SDK's exit-time ``shutdown()`` among them, never run, and whatever its batch span processor
and periodic metric reader still hold is lost. A pool with ``maxtasksperchild`` loses every
span of every recycled worker that way.

While the instrumentation is on, this module makes each such worker flush, on its way out, the
tracer and meter providers the instrumentation uses (those passed to ``instrument()``, else the
global ones at the time of the flush):

* ``os.register_at_fork(after_in_child=...)`` runs in every forked child, and
  ``multiprocessing.util.register_after_fork`` after a ``multiprocessing`` child's bootstrap
  (which clears the finalizers a fork copied). Either registers a
  ``multiprocessing.util.Finalize(None, flush, exitpriority=...)`` in the child: a worker runs
  its finalizers right before ``os._exit()`` (and a normally exiting process from ``atexit``).
* ``instrument()`` called inside a ``multiprocessing`` child (a ``spawn`` worker under
  ``opentelemetry-instrument``, which instruments from ``sitecustomize``; a pool
  ``initializer``) registers the same finalizer there. A ``spawn`` worker also runs ``atexit``
  (it leaves through ``sys.exit()``), but the SDK's exit handler does not bound its wait.

The flush runs each provider's ``shutdown()`` (what the SDK's exit handler runs at a normal
exit; it exports what is queued) in a daemon thread and waits for it at most the exporter's
timeout: ``OTEL_EXPORTER_OTLP_TRACES_TIMEOUT`` (spans) or
``OTEL_EXPORTER_OTLP_METRICS_TIMEOUT`` (metrics), else ``OTEL_EXPORTER_OTLP_TIMEOUT``, else
10 seconds, read as the Python OTLP exporters read them (seconds). Both providers are flushed
at once, so a worker's exit is delayed by at most the larger of the two. The SDK does not
bound this itself: its batch processor exports every queued batch in turn, each up to the
exporter's timeout. When the bound is reached, the worker goes on exiting, one warning says
so, and what was still queued is lost; a ``spawn`` worker's own exit handler then finds the
providers shut down and does not wait on the stuck exporter again.

**A forked child exports only what it recorded.** A child started by ``fork`` (a
``multiprocessing`` worker, a ``torch.utils.data.DataLoader`` worker, a pre-fork server's worker,
a bare ``os.fork()``) inherits the parent's memory: the SDK's aggregations of this package's
histograms and the span processors' queues. Shutting its providers down would export the parent's
requests a second time (apache/airflow#73147, open-telemetry/opentelemetry-python#2767). So, in
every forked child, right after the fork:

* what this package's instruments aggregated is dropped (the child's own requests start new
  series; the parent still exports its own): :func:`forget_inherited_metrics`, the one function of
  this package that reads the SDK's storage, because no public call resets an instrument
  (open-telemetry/opentelemetry-python#2767). It checks every structure it would write before it
  writes any; a provider without that storage (the API's no-op) is left alone, and one with
  another layout is left alone and reported once. Other libraries' instruments are not touched.
* the child has recorded nothing yet: the exit flush above runs only in a process that finished
  at least one request of its own since it started (or since the fork). A child that generated
  nothing (a ``DataLoader`` worker) exports nothing at exit and never waits on an exporter.

The SDK's batch span processor clears its inherited queue in a forked child itself (its own
after-fork hook); this package's background emitter drops the parent's jobs too
(:mod:`otel_generate.background`).

Every flush here (the exit flush, :func:`flush_in_use`, :func:`force_flush`) first drains the
background emitter, so that the requests it still holds become spans and measurements before the
providers export.

A process killed by a signal it does not handle (``SIGKILL``; ``SIGTERM``, which
``Pool.terminate()`` and leaving a ``with Pool(...)`` block send to the workers still alive)
runs no finalizer: what it had queued is lost.

The fork hook cannot be unregistered: after ``uninstrument()`` it only drops the inherited
aggregations of this package's instruments.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.spawn
import multiprocessing.util
import os
import sys
import threading
import time
from typing import Any, Callable, Iterable, List, Optional, Tuple

from opentelemetry import metrics, trace

from otel_generate._faults import LOGGER_NAME
from otel_generate.background import DRAIN_SHARE, drained_context

_LOG = logging.getLogger(LOGGER_NAME)

#: Default of the OTLP exporters' timeout (seconds), the bound when no variable sets one.
DEFAULT_EXPORT_TIMEOUT_S = 10.0
_TIMEOUT_VARIABLES = {
    "spans": ("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "OTEL_EXPORTER_OTLP_TIMEOUT"),
    "metrics": ("OTEL_EXPORTER_OTLP_METRICS_TIMEOUT", "OTEL_EXPORTER_OTLP_TIMEOUT"),
    "logs": ("OTEL_EXPORTER_OTLP_LOGS_TIMEOUT", "OTEL_EXPORTER_OTLP_TIMEOUT"),
}
#: ``multiprocessing.util.Finalize`` priority: >= 0 runs in the first pass of the exit
#: finalizers, before a worker joins children of its own.
EXIT_PRIORITY = 10

_lock = threading.Lock()
#: (tracer_provider, meter_provider, logger_provider) given to instrument() while it is on (``None``
#: for a global one; the logger provider :data:`NOT_OURS` while no content event is emitted); None when off.
_providers: Optional[Tuple[Any, Any, Any]] = None
#: :data:`_providers`' logger provider while this package emits no event: it is not flushed
NOT_OURS: Any = object()
_hooks_installed = False  # inherited by forked children, like the hooks themselves
_finalizer: Any = None
_finalizer_pid: Optional[int] = None
_warned: set = set()
#: this package's metric instruments (as ``instrument()`` created them): what a forked child resets
_instruments: List[Any] = []
#: whether this process finished a request of its own, so its exit flush has work: set by
#: :class:`otel_generate.emit.Emission` and :func:`otel_generate.emit.hand_over`, reset in a forked child
recorded = False
#: ``drain(timeout_s) -> bool`` of the background emitter of the instrumentation in place (every
#: flush runs it first), or ``None``
_drain: Optional[Callable[[Optional[float]], bool]] = None


class _AfterForkToken:
    """A long-lived object for ``multiprocessing.util.register_after_fork`` (which keeps a weak reference)."""


_AFTER_FORK_TOKEN = _AfterForkToken()


def enable(
    tracer_provider: Any = None,
    meter_provider: Any = None,
    instruments: Iterable[Any] = (),
    drain: Optional[Callable[[Optional[float]], bool]] = None,
    logs: bool = False,
    logger_provider: Any = None,
) -> None:
    """Turn the exit flush on (``GenerateInstrumentor.instrument()`` calls it).

    Args:
        tracer_provider, meter_provider: the providers given to ``instrument()``, or ``None``
            for the global ones (looked up when the flush runs).
        instruments: this package's metric instruments, whose inherited aggregations a forked
            child drops (kept after ``uninstrument()``: their data still sits in the SDK).
        drain: the background emitter's ``drain(timeout_s)``, run before every flush.
        logs: the content event is emitted: the logger provider (``logger_provider``, ``None``
            for the global one) is flushed too.
    """
    global _providers, _hooks_installed, _drain
    with _lock:
        _providers = (tracer_provider, meter_provider, logger_provider if logs else NOT_OURS)
        _drain = drain
        for instrument in instruments:
            if not any(instrument is known for known in _instruments):
                _instruments.append(instrument)
        if not _hooks_installed:
            if hasattr(os, "register_at_fork"):
                os.register_at_fork(after_in_child=_after_fork_in_child)
            multiprocessing.util.register_after_fork(_AFTER_FORK_TOKEN, _after_multiprocessing_bootstrap)
            _hooks_installed = True
    if _in_worker():
        _arm()


def _in_worker() -> bool:
    """A ``multiprocessing`` child: running (``parent_process()``), or a ``spawn`` child still starting.

    ``opentelemetry-instrument`` instruments a ``spawn`` worker from ``sitecustomize``, before
    ``multiprocessing`` has bootstrapped it; its command line then carries
    ``--multiprocessing-fork`` (``multiprocessing.spawn.is_forking``). A spawn child's bootstrap
    keeps the finalizers registered that early.
    """
    if multiprocessing.parent_process() is not None:
        return True
    return multiprocessing.spawn.is_forking(getattr(sys, "argv", None) or [])


def disable() -> None:
    """Turn the exit flush off (``GenerateInstrumentor.uninstrument()`` calls it)."""
    global _providers, _drain
    with _lock:
        _providers = None
        _drain = None


def _after_fork_in_child() -> None:
    global _lock, recorded
    _lock = threading.Lock()  # another thread of the parent may have held it at the fork
    recorded = False  # the parent's requests are the parent's to export
    try:
        forget_inherited_metrics(_instruments)
    except Exception as fault:  # pragma: no cover - never break a fork
        _warn_once(
            ("fork reset", type(fault)), "otel_generate: dropping inherited metrics after fork failed (%s)", fault
        )
    _arm_if_enabled()


def forget_inherited_metrics(instruments: Iterable[Any]) -> int:
    """In a forked child, drop what ``instruments`` (this package's own) aggregated in every reader
    of their SDK meter provider: the parent's measurements, which the child would otherwise export
    again. Returns how many series were dropped.

    This works around open-telemetry/opentelemetry-python#2767: no public call resets an
    instrument, and a fork-pool worker re-exports its parent's requests without it. It is the one
    place this package reads the SDK's storage, and it writes nothing it has not checked first:
    the API's proxy instrument's ``_real_instrument``, the SDK instrument's
    ``_measurement_consumer._reader_storages``, each storage's ``_instrument_view_instrument_matches``
    and each match's ``_attributes_aggregation`` (a dict) and ``_lock``, as opentelemetry-sdk 1.37
    to 1.45 lay them out. An instrument without that storage (the API's no-op, a proxy whose
    provider was never set) has nothing to drop. Where a structure is not what it expects, it logs
    once and leaves that instrument's storage alone. Each series' lock is replaced before its dict
    is cleared: a parent thread may have held it at the fork, and in the child nothing else runs yet.
    """
    checked: list = []
    for instrument in instruments:
        real = getattr(instrument, "_real_instrument", instrument)  # the API's proxy forwards to this
        consumer = getattr(real, "_measurement_consumer", None)
        if consumer is None:
            continue  # not an SDK instrument: nothing aggregated here
        storages = getattr(consumer, "_reader_storages", None)
        matches: list = []
        layout_known = isinstance(storages, dict)
        for storage in storages.values() if layout_known else ():
            by_instrument = getattr(storage, "_instrument_view_instrument_matches", None)
            found = by_instrument.get(real, ()) if isinstance(by_instrument, dict) else None
            if not isinstance(found, (list, tuple)):
                layout_known = False
                break
            for match in found:
                series, lock = getattr(match, "_attributes_aggregation", None), getattr(match, "_lock", None)
                if not isinstance(series, dict) or not callable(getattr(lock, "acquire", None)):
                    layout_known = False
                    break
                matches.append(match)
        if not layout_known:
            _warn_once(
                ("fork reset layout", type(real)),
                "otel_generate: a forked child could not drop the metrics it inherited from its parent (the meter "
                "provider's storage of %s is not the OpenTelemetry SDK's as this package knows it); the parent's "
                "measurements of this package's instruments may be exported again by the child",
                type(real).__qualname__,
            )
            continue
        checked.extend(matches)
    dropped = 0
    for match in checked:
        match._lock = threading.Lock()
        dropped += len(match._attributes_aggregation)
        match._attributes_aggregation.clear()
    return dropped


def _after_multiprocessing_bootstrap(_token: Any) -> None:
    # multiprocessing's Process._bootstrap cleared the finalizers a fork copied (ours included)
    _arm_if_enabled()


def _arm_if_enabled() -> None:
    try:
        if _providers is not None:
            _arm()
    except Exception:  # pragma: no cover - never break a fork or a worker's start
        pass


def _arm() -> None:
    """Register the exit flush in this process, once."""
    global _finalizer, _finalizer_pid
    with _lock:
        pid = os.getpid()
        if _finalizer is not None and _finalizer_pid == pid and _finalizer.still_active():
            return
        _finalizer = multiprocessing.util.Finalize(None, _flush_at_exit, exitpriority=EXIT_PRIORITY)
        _finalizer_pid = pid


def _flush_at_exit() -> None:
    providers, drain = _providers, _drain
    if providers is None or os.getpid() != _finalizer_pid or not recorded:
        return  # off, another process's finalizer, or nothing of ours to send: never wait on an exporter
    _run_drain(drain, max(export_timeout_s("spans"), export_timeout_s("metrics")))
    try:
        flush(*providers, reason=f"on the way out of process {os.getpid()}")
    except Exception:  # pragma: no cover - never break an exit
        pass


def force_flush(timeout_s: float = 30.0) -> bool:
    """Emit what the background emitter still holds (at most half of ``timeout_s``), then
    force-flush the tracer, meter and (with the content event on) logger providers in use (those
    given to ``instrument()``, else the global ones) with the rest, within ``timeout_s`` seconds in
    all. For any provider with a ``force_flush`` method, the SDK's or another. True when all three
    signals finished in time and no provider's ``force_flush`` answered ``False`` or raised. Called
    on the emitter's own thread (from a span processor, say), it does not wait for the emitter's
    queue: it flushes what is recorded and returns. Never raises.

    Raises:
        ValueError: ``timeout_s`` is not a positive number.
    """
    if not isinstance(timeout_s, (int, float)) or isinstance(timeout_s, bool) or not timeout_s > 0:
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    deadline = time.monotonic() + timeout_s
    drain, providers = _drain, _providers
    drained = _run_drain(drain, timeout_s * DRAIN_SHARE if providers is not None else timeout_s)
    if providers is None:
        return drained
    try:
        left = max(timeout_s * (1.0 - DRAIN_SHARE), deadline - time.monotonic())
        return flush(*providers, reason="force_flush", shutdown=False, bound_s=left) and drained
    except Exception:  # pragma: no cover - never raise from a flush
        return False


def _run_drain(drain: Optional[Callable[[Optional[float]], bool]], timeout_s: Optional[float]) -> bool:
    if drain is None:
        return True
    try:
        return bool(drain(timeout_s))
    except Exception:  # pragma: no cover - never break a flush
        return False


def flush_in_use(reason: str) -> bool:
    """Drain the background emitter, then force-flush the providers the instrumentation uses,
    bounded like :func:`flush`; the providers stay usable. Does nothing (returns ``True``) while
    the instrumentation is off.

    For a server about to be ended by a signal it re-raises after its own graceful shutdown
    (uvicorn does so with ``SIGTERM`` and ``SIGINT``): that ends the process without the SDK's
    exit flush. Never raises.
    """
    providers, drain = _providers, _drain
    if providers is None:
        return True
    _run_drain(drain, max(export_timeout_s("spans"), export_timeout_s("metrics")))
    try:
        return flush(*providers, reason=reason, shutdown=False)
    except Exception:  # pragma: no cover - never break a shutdown
        return False


def _warn_once(key: Any, message: str, *args: Any) -> None:
    if key not in _warned:
        _warned.add(key)
        _LOG.warning(message, *args)


def export_timeout_s(signal: str) -> float:
    """The flush bound for ``signal`` (``"spans"`` or ``"metrics"``), in seconds.

    The first of the signal's ``OTEL_EXPORTER_OTLP_<SIGNAL>_TIMEOUT`` and
    ``OTEL_EXPORTER_OTLP_TIMEOUT`` that is set, read in seconds as the Python OTLP exporters read
    them; else :data:`DEFAULT_EXPORT_TIMEOUT_S`. A value that is not a positive number is
    reported once and skipped.
    """
    for variable in _TIMEOUT_VARIABLES[signal]:
        raw = os.environ.get(variable)
        if raw is None or not raw.strip():
            continue
        try:
            value = float(raw)
            if not value > 0 or value == float("inf"):
                raise ValueError
        except ValueError:
            _warn_once(
                (variable, raw),
                "otel_generate: %s=%r is not a positive number of seconds; ignored for the exit flush bound",
                variable,
                raw,
            )
            continue
        return value
    return DEFAULT_EXPORT_TIMEOUT_S


def flush(
    tracer_provider: Any = None,
    meter_provider: Any = None,
    logger_provider: Any = NOT_OURS,
    reason: str = "",
    shutdown: bool = True,
    bound_s: Optional[float] = None,
) -> bool:
    """Shut the providers down as a process on its way out does, waiting at most the exporter's timeout.

    ``shutdown()`` exports what is queued and stops the providers, exactly what the SDK's own
    exit handler does at a normal exit (after this it finds them shut down and returns at
    once, instead of waiting on a stuck exporter a second time). It runs in a daemon thread per
    provider; a provider without ``shutdown()`` is force-flushed instead.

    Args:
        tracer_provider, meter_provider, logger_provider: providers to flush; ``None`` means the
            global one; a logger provider :data:`NOT_OURS` is not flushed. A provider with neither
            method (the API's no-op and proxy providers) is skipped.
        reason: words for the warning, e.g. ``"on the way out of process 123"``.
        shutdown: ``False`` force-flushes instead (``force_flush()``: the providers stay usable),
            for a process that may go on after the flush.
        bound_s: the bound for both providers, instead of :func:`export_timeout_s`.

    Returns:
        ``True`` when every provider finished within its bound (:func:`export_timeout_s`) and
        none said it did not (a ``force_flush`` that answered ``False`` or raised); ``False``
        otherwise (a late provider after one warning). Never raises.
    """
    targets = [
        ("spans", tracer_provider if tracer_provider is not None else trace.get_tracer_provider()),
        ("metrics", meter_provider if meter_provider is not None else metrics.get_meter_provider()),
    ]
    if logger_provider is not NOT_OURS:
        if logger_provider is None:
            from opentelemetry import _logs

            logger_provider = _logs.get_logger_provider()
        targets.append(("logs", logger_provider))
    started = time.monotonic()
    running: List[Tuple[str, float, threading.Thread]] = []
    failed: List[str] = []  # the signals whose provider answered False or raised
    for signal, provider in targets:
        if not callable(getattr(provider, "shutdown", None)) and not callable(getattr(provider, "force_flush", None)):
            continue
        bound = export_timeout_s(signal) if bound_s is None else bound_s
        thread = threading.Thread(  # (in a context where the providers' flushes do not drain again)
            target=drained_context().run,
            args=(_run_flush, signal, provider, bound, shutdown, failed),
            name=f"otel_generate-flush-{signal}",
            daemon=True,
        )
        thread.start()
        running.append((signal, bound, thread))
    late = []
    for signal, bound, thread in running:
        thread.join(max(0.0, started + bound - time.monotonic()))
        if thread.is_alive():
            late.append(f"{signal} within {bound:g} s")
    if late:
        _LOG.warning(
            "otel_generate: flushing %s did not finish (%s, %s); what was still queued %s",
            reason or "telemetry",
            ", ".join(late),
            "the exporter's timeout" if bound_s is None else "the time given",
            "is lost" if shutdown else "is still queued in the provider",
        )
        return False
    return not failed


def _run_flush(
    signal: str, provider: Any, bound_s: float, shut_down: bool = True, failed: Optional[List[str]] = None
) -> None:
    """Shut ``provider`` down (or force-flush it); ``signal`` is appended to ``failed`` when its
    ``force_flush`` answered ``False`` or either call raised."""
    try:
        shutdown = getattr(provider, "shutdown", None) if shut_down else None
        if callable(shutdown):
            try:
                shutdown(timeout_millis=bound_s * 1000)  # MeterProvider takes a bound
            except TypeError:
                shutdown()  # TracerProvider does not
        else:
            force_flush = getattr(provider, "force_flush", None)
            if callable(force_flush):  # (a provider with shutdown() only has nothing to flush but stop)
                if force_flush(timeout_millis=int(bound_s * 1000)) is False and failed is not None:
                    failed.append(signal)
    except Exception as exc:  # an exporter's fault is logged, never raised into an exiting worker
        if failed is not None:
            failed.append(signal)
        _warn_once(
            ("flush", signal, type(exc)), "otel_generate: flushing %s failed (%s: %s)", signal, type(exc).__name__, exc
        )
