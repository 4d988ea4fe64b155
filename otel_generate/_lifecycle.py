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
  series; the parent still exports its own). This reaches into the SDK's storage
  (``_measurement_consumer._reader_storages``, ``_ViewInstrumentMatch._attributes_aggregation``):
  no public SDK call resets an instrument; a provider without that storage (not the SDK's) is
  left alone, and a failure is logged once. Other libraries' instruments are not touched.
* the child has recorded nothing yet: the exit flush above runs only in a process that finished
  at least one request of its own since it started (or since the fork). A child that generated
  nothing (a ``DataLoader`` worker) exports nothing at exit and never waits on an exporter.

The SDK's ``BatchSpanProcessor`` (and ``BatchLogRecordProcessor``) clears its inherited queue in a
forked child itself (its own after-fork hook, opentelemetry-sdk 1.45.1); this package's
background emitter drops the parent's jobs too (:mod:`otel_generate.background`).

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
from typing import Any, Iterable, List, Optional, Tuple

from opentelemetry import metrics, trace

from otel_generate._faults import LOGGER_NAME

_LOG = logging.getLogger(LOGGER_NAME)

#: Default of the OTLP exporters' timeout (seconds), the bound when no variable sets one.
DEFAULT_EXPORT_TIMEOUT_S = 10.0
_TIMEOUT_VARIABLES = {
    "spans": ("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "OTEL_EXPORTER_OTLP_TIMEOUT"),
    "metrics": ("OTEL_EXPORTER_OTLP_METRICS_TIMEOUT", "OTEL_EXPORTER_OTLP_TIMEOUT"),
}
#: ``multiprocessing.util.Finalize`` priority: >= 0 runs in the first pass of the exit
#: finalizers, before a worker joins children of its own.
EXIT_PRIORITY = 10

_lock = threading.Lock()
#: (tracer_provider, meter_provider) given to instrument() while it is on; None when off.
_providers: Optional[Tuple[Any, Any]] = None
_hooks_installed = False  # inherited by forked children, like the hooks themselves
_finalizer: Any = None
_finalizer_pid: Optional[int] = None
_warned: set = set()
#: this package's metric instruments (as ``instrument()`` created them): what a forked child resets
_instruments: List[Any] = []
#: whether this process finished a request of its own, so its exit flush has work: set by
#: :func:`otel_generate.emit.finish`, reset in a forked child
recorded = False


class _AfterForkToken:
    """A long-lived object for ``multiprocessing.util.register_after_fork`` (which keeps a weak reference)."""


_AFTER_FORK_TOKEN = _AfterForkToken()


def enable(tracer_provider: Any = None, meter_provider: Any = None, instruments: Iterable[Any] = ()) -> None:
    """Turn the exit flush on (``GenerateInstrumentor.instrument()`` calls it).

    Args:
        tracer_provider, meter_provider: the providers given to ``instrument()``, or ``None``
            for the global ones (looked up when the flush runs).
        instruments: this package's metric instruments, whose inherited aggregations a forked
            child drops (kept after ``uninstrument()``: their data still sits in the SDK).
    """
    global _providers, _hooks_installed
    with _lock:
        _providers = (tracer_provider, meter_provider)
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
    global _providers
    with _lock:
        _providers = None


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


#: How many times :func:`forget_inherited_metrics` ran in this process: the only code that removes
#: an SDK aggregation (the SDK never does), so what :mod:`otel_generate.fast_metrics` resolved
#: while this count was the same still holds.
metrics_forgotten = 0


def forget_inherited_metrics(instruments: Iterable[Any]) -> int:
    """Drop what ``instruments`` aggregated so far in every reader of their SDK ``MeterProvider``
    (in a forked child: the parent's measurements). Returns how many series were dropped.

    Instruments of another provider than the SDK's (the API's no-op, a proxy never set) have no
    such storage and are skipped. The series' locks are replaced first: a parent thread may have
    held one at the fork, and in the child nothing else runs yet.
    """
    global metrics_forgotten
    metrics_forgotten += 1
    dropped = 0
    for instrument in instruments:
        real = getattr(instrument, "_real_instrument", instrument)  # the API's proxy forwards to this
        consumer = getattr(real, "_measurement_consumer", None)
        storages = getattr(consumer, "_reader_storages", None)
        if not storages:
            continue
        for storage in list(storages.values()):
            for match in storage._instrument_view_instrument_matches.get(real, ()):
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
    providers = _providers
    if providers is None or os.getpid() != _finalizer_pid or not recorded:
        return  # off, another process's finalizer, or nothing of ours to send: never wait on an exporter
    try:
        flush(*providers, reason=f"on the way out of process {os.getpid()}")
    except Exception:  # pragma: no cover - never break an exit
        pass


def flush_in_use(reason: str) -> bool:
    """Force-flush the providers the instrumentation uses, bounded like :func:`flush`; the
    providers stay usable. Does nothing (returns ``True``) while the instrumentation is off.

    For a server about to be ended by a signal it re-raises after its own graceful shutdown
    (uvicorn does so with ``SIGTERM`` and ``SIGINT``): that ends the process without the SDK's
    exit flush. Never raises.
    """
    providers = _providers
    if providers is None:
        return True
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


def flush(tracer_provider: Any = None, meter_provider: Any = None, reason: str = "", shutdown: bool = True) -> bool:
    """Shut the providers down as a process on its way out does, waiting at most the exporter's timeout.

    ``shutdown()`` exports what is queued and stops the providers, exactly what the SDK's own
    exit handler does at a normal exit (after this it finds them shut down and returns at
    once, instead of waiting on a stuck exporter a second time). It runs in a daemon thread per
    provider; a provider without ``shutdown()`` is force-flushed instead.

    Args:
        tracer_provider, meter_provider: providers to flush; ``None`` means the global one.
            A provider with neither method (the API's no-op and proxy providers) is skipped.
        reason: words for the warning, e.g. ``"on the way out of process 123"``.
        shutdown: ``False`` force-flushes instead (``force_flush()``: the providers stay usable),
            for a process that may go on after the flush.

    Returns:
        ``True`` when every provider finished within its bound (:func:`export_timeout_s`);
        ``False`` otherwise, after one warning. Never raises.
    """
    targets = (
        ("spans", tracer_provider if tracer_provider is not None else trace.get_tracer_provider()),
        ("metrics", meter_provider if meter_provider is not None else metrics.get_meter_provider()),
    )
    started = time.monotonic()
    running: List[Tuple[str, float, threading.Thread]] = []
    for signal, provider in targets:
        if not callable(getattr(provider, "shutdown", None)) and not callable(getattr(provider, "force_flush", None)):
            continue
        bound = export_timeout_s(signal)
        thread = threading.Thread(
            target=_run_flush,
            args=(signal, provider, bound, shutdown),
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
            "otel_generate: flushing %s did not finish (%s, the exporter's timeout); what was still queued is lost",
            reason or "telemetry",
            ", ".join(late),
        )
        return False
    return True


def _run_flush(signal: str, provider: Any, bound_s: float, shut_down: bool = True) -> None:
    try:
        shutdown = getattr(provider, "shutdown", None) if shut_down else None
        if callable(shutdown):
            try:
                shutdown(timeout_millis=bound_s * 1000)  # MeterProvider takes a bound
            except TypeError:
                shutdown()  # TracerProvider does not
        else:
            provider.force_flush(timeout_millis=int(bound_s * 1000))
    except Exception as exc:  # an exporter's fault is logged, never raised into an exiting worker
        _warn_once(
            ("flush", signal, type(exc)), "otel_generate: flushing %s failed (%s: %s)", signal, type(exc).__name__, exc
        )
