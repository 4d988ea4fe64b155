"""Background emission: the telemetry of finished requests built on a worker thread.

A producer that must not spend time on spans (the continuous-batching scheduler thread, or a
``generate()`` caller with background emission on) hands each finished request to a
:class:`BackgroundEmitter`: a bounded queue and one daemon thread that runs
:func:`otel_generate.emit.finish` for it. The worker yields the interpreter lock between jobs
(and every few spans inside one), so it runs while the producer waits on the device.

Bounded: at most ``max_pending`` requests wait; a request that finds the queue full is not
emitted, and :attr:`BackgroundEmitter.dropped` counts it (a warning is logged once).

Drained first: ``uninstrument()``, the SDK's ``TracerProvider.force_flush``/``shutdown`` and
``MeterProvider.force_flush``/``shutdown`` (hooked by :func:`make_draining`, rows of
:data:`otel_generate.instrumentor.PATCHES` installed when an emitter starts; that covers the pool-worker exit flush of
:mod:`otel_generate._lifecycle`, which calls ``shutdown()``) wait for the queue to empty, at most
their timeout. Interpreter exit too: the SDK registers its exit-time ``shutdown`` when a provider
is created, bound before the hooks exist, so each emitter registers an ``atexit`` drain of its
own, which runs before the providers' (``atexit`` runs the last registered first). Once stopped
(``uninstrument()``), an emitter runs what is still handed to it (a request that was in flight)
on the caller's thread, so nothing is lost.
"""

from __future__ import annotations

import atexit
import collections
import functools
import os
import threading
import time
import weakref
from typing import Callable, Deque, Optional

from otel_generate._faults import Fault, log_fault_once

#: Requests waiting at most, by default.
DEFAULT_MAX_PENDING = 1024
#: How long a drain waits at most when the caller gives no timeout, seconds.
DEFAULT_DRAIN_TIMEOUT_S = 30.0


class BackgroundEmitter:
    """A bounded queue of jobs and one daemon worker thread that runs them in order.

    Args:
        max_pending: at most this many jobs wait; :meth:`submit` refuses more (never blocks).
    """

    def __init__(self, max_pending: int = DEFAULT_MAX_PENDING) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be at least 1, got {max_pending}")
        self.max_pending = max_pending
        self.dropped = 0
        self._jobs: Deque[Callable[[], None]] = collections.deque()
        self._busy = False
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._idle = threading.Condition(self._lock)
        self._thread: Optional[threading.Thread] = None
        self._pid = os.getpid()
        self._stopped = False
        reference = weakref.ref(self)

        def drain_at_exit() -> None:  # registered after the providers' own exit-time shutdown: runs first
            emitter = reference()
            if emitter is not None:
                emitter.drain()

        atexit.register(drain_at_exit)

    def submit(self, job: Callable[[], None]) -> bool:
        """Queue ``job`` (a callable without arguments); False when the queue was full (counted).

        After :meth:`stop`, the job runs at once on the caller's thread (a request that was in
        flight when the instrumentation was turned off is still emitted).
        """
        with self._lock:
            if os.getpid() != self._pid:  # a forked child: the parent's worker and jobs are not ours
                self._jobs.clear()
                self._thread, self._busy, self._pid = None, False, os.getpid()
            stopped = self._stopped
            full = not stopped and len(self._jobs) >= self.max_pending
            if full:
                self.dropped += 1
            elif not stopped:
                self._jobs.append(job)
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="otel_generate-emitter", daemon=True)
                    self._thread.start()
                self._wake.notify()
                return True
        if stopped:
            try:
                job()
            except Exception as fault:
                log_fault_once(Fault.BACKGROUND_EMISSION, fault)
            return True
        log_fault_once(
            Fault.BACKGROUND_EMISSION,
            RuntimeError(
                f"the background emitter's queue is full ({self.max_pending} requests); requests are dropped and "
                "counted"
            ),
        )
        return False

    def pending(self) -> int:
        with self._lock:
            return len(self._jobs) + (1 if self._busy else 0)

    def drain(self, timeout_s: Optional[float] = None) -> bool:
        """Wait until every queued job ran, at most ``timeout_s`` seconds; True when it did."""
        deadline = time.monotonic() + (DEFAULT_DRAIN_TIMEOUT_S if timeout_s is None else timeout_s)
        with self._lock:
            if self._thread is threading.current_thread():
                return not self._jobs  # a job that flushes the provider must not wait for itself
            while self._jobs or self._busy:
                left = deadline - time.monotonic()
                if left <= 0 or self._thread is None or not self._thread.is_alive():
                    return False
                self._idle.wait(left)
            return True

    def stop(self, timeout_s: Optional[float] = None) -> bool:
        """Drain, then refuse new jobs."""
        drained = self.drain(timeout_s)
        with self._lock:
            self._stopped = True
            self._wake.notify_all()
        return drained

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._jobs and not self._stopped:
                    self._wake.wait()
                if not self._jobs:
                    return
                job = self._jobs.popleft()
                self._busy = True
            try:
                job()
            except Exception as fault:  # a job never kills the worker
                log_fault_once(Fault.BACKGROUND_EMISSION, fault)
            finally:
                with self._lock:
                    self._busy = False
                    if not self._jobs:
                        self._idle.notify_all()
            time.sleep(0)  # yield the interpreter lock to the producer


def _timeout_s(args: tuple, kwargs: dict) -> Optional[float]:
    millis = kwargs.get("timeout_millis", args[0] if args else None)
    return None if millis is None else float(millis) / 1000.0


def make_draining(original: Callable, emitter: BackgroundEmitter) -> Callable:
    """A provider's ``force_flush``/``shutdown`` that first waits for the emitter's queue."""

    @functools.wraps(original)
    def draining(self, *args, **kwargs):
        emitter.drain(_timeout_s(args, kwargs))
        return original(self, *args, **kwargs)

    return draining
