"""Background emission: the telemetry of finished requests built on a worker thread.

A producer that must not spend time on spans (a ``generate()`` caller, by default, or the
continuous-batching scheduler thread) hands each finished request to a :class:`BackgroundEmitter`
(:func:`otel_generate.emit.hand_over`): a bounded queue and one daemon thread that runs its
:class:`otel_generate.emit.Emission` (the step spans, the request span's attributes and end, the
histograms, the content event, through the public OpenTelemetry API). The worker yields the
interpreter lock between jobs (and every few spans inside one), so it runs while the producer
waits on the device.

Bounded, never blocking: at most ``max_pending`` requests wait. A request that finds the queue full
is not emitted; it is counted (:attr:`BackgroundEmitter.dropped`, and the ``on_drop`` callback:
the ``generate.emitter.dropped_requests`` counter), and a warning says so at once, then at most
once per :data:`DROP_LOG_INTERVAL_S` with the count since the last one (and once more when the
emitter drains at exit).

Drained first, one signal at a time: ``uninstrument()``, :func:`otel_generate.force_flush`, the
exit flush of :mod:`otel_generate._lifecycle`, and the ``force_flush``/``shutdown`` of the tracer,
meter and logger providers this package emits to (wrapped by :func:`make_draining`: the
``"emitter"`` rows of :data:`otel_generate.instrumentor.PATCHES`; another provider of the same
class is not touched). A tracer provider's flush waits for the worker to build the spans of every
request handed over before it. A meter or logger provider's flush does not wait for spans: it
records the metrics (or emits the content event) of every request queued before it at once, on
its own thread (:meth:`BackgroundEmitter.drain` with a ``signal``; each request's part runs once,
whichever thread gets to it first), and waits only for jobs that have no such part (continuous
batching's). A flush given a timeout spends at most half of it on the drain
(:data:`DRAIN_SHARE`): the provider keeps the rest for its own export.

A flush on the worker thread itself (a span processor, an exporter or a callback that flushes),
or on a thread a flush of ours started after draining, never waits for the queue: it flushes what
is already recorded and returns (:data:`_SKIP_DRAIN`).

Interpreter exit: a provider registers its exit-time ``shutdown`` when it is created, usually
before the emitter exists, so each emitter registers an ``atexit`` drain of its own, which runs
before the providers' (``atexit`` runs the last registered first), and registers it again when it
meets a provider set after it (:meth:`BackgroundEmitter.drain_at_exit_before_providers`).
Once stopped (``uninstrument()``), an emitter runs what is still handed to it (a request that was
in flight) on the caller's thread, so nothing is lost.

The worker thread is named :data:`WORKER_NAME` in Python and, on Linux, in the operating system
(:func:`name_native_thread`), so that its CPU time can be told apart from outside the process.
"""

from __future__ import annotations

import atexit
import collections
import contextvars
import functools
import inspect
import logging
import os
import sys
import threading
import time
import weakref
from typing import Any, Callable, Deque, Optional

from otel_generate._faults import LOGGER_NAME, Fault, log_fault_once

_LOG = logging.getLogger(LOGGER_NAME)

#: Requests waiting at most, by default.
DEFAULT_MAX_PENDING = 1024
#: How long a drain waits at most when the caller gives no timeout, seconds.
DEFAULT_DRAIN_TIMEOUT_S = 30.0
#: While requests are dropped, a warning at most this often (seconds), with the count since the last.
DROP_LOG_INTERVAL_S = 60.0
#: The share of a flush's timeout that the drain may use; the provider keeps the rest for its own export.
DRAIN_SHARE = 0.5
#: The signals a drain may be asked for: the spans (the worker builds them: wait for it), or one
#: part of every queued request that the flushing thread runs itself.
SPANS, METRICS, LOGS = "traces", "metrics", "logs"

#: True on the worker thread, and on the threads a flush starts once it has drained: a provider's
#: flush there goes straight to the provider (waiting for the queue would wait for itself, or
#: twice).
_SKIP_DRAIN: "contextvars.ContextVar[bool]" = contextvars.ContextVar("otel_generate_skip_drain", default=False)


def drained_context() -> contextvars.Context:
    """A copy of the current context in which the providers' flushes do not drain again: run a
    flush in it (``context.run``) on another thread after the drain it needed."""
    context = contextvars.copy_context()
    context.run(_SKIP_DRAIN.set, True)
    return context


def draining_skipped() -> bool:
    """Whether a flush on this thread must not wait for the queue (see :data:`_SKIP_DRAIN`)."""
    return _SKIP_DRAIN.get()


#: The worker thread's name, in Python and (its first 15 bytes, ``otel_generate-e``) in the operating system.
WORKER_NAME = "otel_generate-emitter"
#: Linux's ``prctl`` option that names the calling thread (``PR_SET_NAME``).
_PR_SET_NAME = 15


def name_native_thread(name: str) -> None:
    """Name the calling thread in the operating system too, so that ``top -H``, ``ps -L`` and
    ``/proc/<pid>/task/<tid>/comm`` tell it apart (and what CPU it used): on Linux, ``prctl(PR_SET_NAME)``
    with the first 15 bytes of ``name``, as CPython does itself from 3.14. Elsewhere nothing; never raises."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL(None).prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode("utf-8")[:15]), 0, 0, 0)
    except Exception:  # no libc symbol, a sandbox refusing the call: the name is a convenience
        pass


class BackgroundEmitter:
    """A bounded queue of jobs and one daemon worker thread that runs them in order.

    Args:
        max_pending: at most this many jobs wait; :meth:`submit` refuses more (never blocks).
        on_drop: called with no argument for each job refused (the dropped-requests counter);
            its own faults are logged once.
        before_submit: called on the submitting thread before each job is queued (the
            instrumentor wraps the flush of a provider set after ``instrument()``, so that the
            provider's own ``force_flush`` drains the job once ``generate()`` has returned); its
            faults are logged once.

    A job that cannot be handed to the worker (its thread cannot start: the interpreter is
    shutting down, or no thread can be created) runs on the submitting thread instead.
    """

    def __init__(
        self,
        max_pending: int = DEFAULT_MAX_PENDING,
        on_drop: Optional[Callable[[], None]] = None,
        before_submit: Optional[Callable[[], None]] = None,
    ) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be at least 1, got {max_pending}")
        self.max_pending = max_pending
        self.dropped = 0
        self.on_drop = on_drop
        self.before_submit = before_submit
        self._unreported = 0  # dropped since the last warning
        self._last_report: Optional[float] = None  # time.monotonic() of the last warning
        self._last_undrained: Optional[float] = None  # ... of the last warning of a drain run out of time
        self._jobs: Deque[Callable[[], None]] = collections.deque()
        self._busy: Optional[Callable[[], None]] = None  # the job the worker is running
        self._queued = 0  # jobs queued so far; a drain waits for those queued before it, not later ones
        self._done = 0  # of them, run
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._idle = threading.Condition(self._lock)
        self._thread: Optional[threading.Thread] = None
        self._pid = os.getpid()
        _EMITTERS.add(self)
        self._stopped = False
        reference = weakref.ref(self)

        def drain_at_exit() -> None:  # registered after the providers' own exit-time shutdown: runs first
            emitter = reference()
            if emitter is not None:
                if not emitter.drain():
                    emitter.report_undrained("at exit")
                emitter.report_drops(final=True)

        self._drain_at_exit = drain_at_exit
        atexit.register(drain_at_exit)

    def submit(self, job: Callable[[], None]) -> bool:
        """Queue ``job`` (a callable without arguments); False when the queue was full (counted).

        After :meth:`stop`, or when the worker thread cannot start, the job runs at once on the
        caller's thread (a request that was in flight when the instrumentation was turned off is
        still emitted).
        """
        if self.before_submit is not None:
            _run_logged(self.before_submit)
        with self._lock:
            if os.getpid() != self._pid:  # a forked child (without the fork hook): not ours
                self._forget_parent()
            stopped = self._stopped
            full = not stopped and len(self._jobs) >= self.max_pending
            if full:
                self.dropped += 1
                self._unreported += 1
            elif not stopped:
                thread = self._thread
                if thread is None or not thread.is_alive():
                    stopped = not self._start_worker()
            if not full and not stopped:
                self._jobs.append(job)
                self._queued += 1
                self._wake.notify()
                return True
        if stopped:
            _run_logged(job)
            return True
        if self.on_drop is not None:
            _run_logged(self.on_drop)
        self.report_drops()
        return False

    def _start_worker(self) -> bool:
        """Start the worker thread (the lock held); False, logged once, when it cannot start."""
        thread = threading.Thread(target=self._run, name=WORKER_NAME, daemon=True)
        try:
            thread.start()
        except Exception as fault:  # RuntimeError: at interpreter shutdown, or no thread can be created
            self._thread = None
            log_fault_once(Fault.BACKGROUND_EMISSION, fault)
            return False
        self._thread = thread
        return True

    def report_undrained(self, when: str) -> None:
        """The warning for requests a drain left behind (its time ran out): their telemetry is
        not emitted by then (it is later, while the providers live on), and at exit never. At
        most once per :data:`DROP_LOG_INTERVAL_S`, but always at exit."""
        left, now = self.pending(), time.monotonic()
        with self._lock:
            last = self._last_undrained
            if not left or (when != "at exit" and last is not None and now - last < DROP_LOG_INTERVAL_S):
                return
            self._last_undrained = now
        if left:
            _LOG.warning(
                "otel_generate: the background emitter still held %d finished request(s) %s: their telemetry was "
                "not emitted in time%s",
                left,
                when,
                " and is lost" if when == "at exit" else " (it follows when the worker gets to it)",
            )

    def report_drops(self, final: bool = False) -> None:
        """The warning for the requests dropped since the last one: at once for the first, then at
        most once per :data:`DROP_LOG_INTERVAL_S`; ``final`` (at exit) says what is left unsaid."""
        now = time.monotonic()
        with self._lock:
            count = self._unreported
            due = self._last_report is None or now - self._last_report >= DROP_LOG_INTERVAL_S
            if not count or not (due or final):
                return
            self._unreported, self._last_report = 0, now
            total = self.dropped
        _LOG.warning(
            "otel_generate: the background emitter's queue was full (%d requests waiting): the telemetry of %d "
            "finished request(s) was dropped (%d in all in this process; counted in generate.emitter.dropped_requests)",
            self.max_pending,
            count,
            total,
        )

    def drain_at_exit_before_providers(self) -> None:
        """Register the exit-time drain again: a provider created after this emitter registered its
        own exit-time ``shutdown`` (bound when registered, so not the wrapped one) after the drain,
        and ``atexit`` runs the last registered first. Draining twice is harmless."""
        atexit.unregister(self._drain_at_exit)
        atexit.register(self._drain_at_exit)

    def _forget_parent(self) -> None:
        """In a forked child: the parent's worker thread does not exist here and its jobs are the
        parent's to emit (the parent still holds them); a lock another parent thread held at the
        fork would never be released."""
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._idle = threading.Condition(self._lock)
        self._jobs.clear()
        self._thread, self._busy, self._pid = None, None, os.getpid()
        self._queued = self._done = 0
        # the child's own drops are its own to count and report, at once for the first
        self.dropped, self._unreported, self._last_report = 0, 0, None

    def pending(self) -> int:
        with self._lock:
            return len(self._jobs) + (1 if self._busy is not None else 0)

    def on_worker(self) -> bool:
        """Whether the calling thread is this emitter's worker."""
        return self._thread is threading.current_thread()

    def drain(self, timeout_s: Optional[float] = None, signal: str = SPANS) -> bool:
        """Emit what was handed over before this call (not what is handed over while it waits), at
        most ``timeout_s`` seconds (default :data:`DEFAULT_DRAIN_TIMEOUT_S`); True when it all was.

        ``signal``: :data:`SPANS` (everything: wait for the worker), or :data:`METRICS` /
        :data:`LOGS`: run that part of every queued request on this thread now (a job's
        ``run_part(signal)``), and wait for the worker only for jobs without parts. On the worker
        itself (or where :func:`draining_skipped`) nothing is waited for: the parts are run, and
        the answer is whether nothing was left queued.
        """
        deadline = time.monotonic() + (DEFAULT_DRAIN_TIMEOUT_S if timeout_s is None else timeout_s)
        skip = draining_skipped() or self.on_worker()
        if signal != SPANS:
            return self._drain_part(signal, deadline, skip)
        with self._lock:
            if skip:
                return not self._jobs  # a job that flushes the provider must not wait for itself
            return self._wait_until(self._queued, deadline)

    def _wait_until(self, target: int, deadline: float) -> bool:
        """Wait (the lock held) until the first ``target`` jobs queued have run, at most until ``deadline``."""
        while self._done < target:
            left = deadline - time.monotonic()
            if left <= 0 or self._thread is None or not self._thread.is_alive():
                return False
            self._idle.wait(left)
        return True

    def _drain_part(self, signal: str, deadline: float, skip: bool) -> bool:
        with self._lock:
            jobs = ([self._busy] if self._busy is not None else []) + list(self._jobs)
            first = self._done + 1  # the number of the first of them (jobs run in order)
        opaque = 0  # the number of the last job without parts: the worker must run it
        for number, job in enumerate(jobs, first):
            run_part = getattr(job, "run_part", None)
            if run_part is None:
                opaque = number
                continue
            if time.monotonic() >= deadline:
                return False
            _run_logged(functools.partial(run_part, signal))
        if not opaque:
            return True
        with self._lock:
            if skip:
                return self._done >= opaque
            return self._wait_until(opaque, deadline)

    def stop(self, timeout_s: Optional[float] = None) -> bool:
        """Drain, then refuse new jobs."""
        drained = self.drain(timeout_s)
        with self._lock:
            self._stopped = True
            self._wake.notify_all()
        return drained

    def _run(self) -> None:
        _SKIP_DRAIN.set(True)  # (this thread's own context) a flush from a job never waits for the queue
        name_native_thread(WORKER_NAME)
        while True:
            with self._lock:
                while not self._jobs and not self._stopped:
                    self._wake.wait()
                if not self._jobs:
                    return
                job = self._busy = self._jobs.popleft()
            try:
                job()
            except Exception as fault:  # a job never kills the worker
                log_fault_once(Fault.BACKGROUND_EMISSION, fault)
            finally:
                with self._lock:
                    self._busy = None
                    self._done += 1
                    self._idle.notify_all()
            time.sleep(0)  # yield the interpreter lock to the producer


def _run_logged(function: Callable[[], None]) -> None:
    """Call ``function``; a fault in it is logged once, never raised into the caller."""
    try:
        function()
    except Exception as fault:
        log_fault_once(Fault.BACKGROUND_EMISSION, fault)


#: every emitter alive: each forgets its parent's jobs and locks in a forked child
_EMITTERS: "weakref.WeakSet[BackgroundEmitter]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for emitter in list(_EMITTERS):
        try:
            emitter._forget_parent()
        except Exception:  # pragma: no cover - never break a fork
            pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _timeout_s(args: tuple, kwargs: dict) -> Optional[float]:
    millis = kwargs.get("timeout_millis", args[0] if args else None)
    return None if millis is None else float(millis) / 1000.0


def _default_timeout_s(original: Callable) -> Optional[float]:
    """The default of ``original``'s ``timeout_millis`` parameter, in seconds (``None``: it has none):
    a flush called without a timeout is bounded by it (``MeterProvider.force_flush``: 10 s)."""
    try:
        parameter = inspect.signature(original).parameters.get("timeout_millis")
    except (TypeError, ValueError):  # a callable without a signature to read
        return None
    default = None if parameter is None else parameter.default
    if isinstance(default, (int, float)) and not isinstance(default, bool) and default > 0:
        return float(default) / 1000.0
    return None


def make_draining(original: Callable, emitter: BackgroundEmitter, signal: str, ours: Callable[[Any], bool]) -> Callable:
    """A provider class's ``force_flush``/``shutdown`` that, for a provider this package emits to
    (``ours(provider)``), first drains the emitter's ``signal``, then runs the provider's own. Any
    other provider of the class gets the original call and nothing else.

    A call that gives ``timeout_millis`` keeps to it in all: the drain uses at most
    :data:`DRAIN_SHARE` of it and the provider's own call gets what is left (never less than
    the rest of the share); a call that gives none keeps to the method's default ``timeout_millis``
    the same way. A ``force_flush`` that says it finished (``True``) says ``False`` when the drain
    did not; the requests left are emitted later."""
    default_s = _default_timeout_s(original)

    @functools.wraps(original)
    def draining(self, *args, **kwargs):
        if draining_skipped() or not ours(self):
            return original(self, *args, **kwargs)
        timeout_s = _timeout_s(args, kwargs)
        if timeout_s is None:
            timeout_s = default_s
        started = time.monotonic()
        drained = emitter.drain(None if timeout_s is None else timeout_s * DRAIN_SHARE, signal)
        if not drained:
            emitter.report_undrained(f"when {type(self).__name__}.{original.__name__} was called")
        if timeout_s is not None:
            left_s = max(timeout_s - (time.monotonic() - started), timeout_s * (1.0 - DRAIN_SHARE))
            left_millis = max(int(left_s * 1000.0), 1 if timeout_s > 0 else 0)
            if args:
                args = (left_millis,) + tuple(args[1:])
            else:
                kwargs = dict(kwargs, timeout_millis=left_millis)
        result = original(self, *args, **kwargs)
        return False if result is True and not drained else result

    return draining
