"""The background emitter on its own, no model: a full queue drops and counts."""

from __future__ import annotations

import sys
import threading
import time

import pytest


def test_a_full_background_queue_drops_and_counts(caplog):
    from otel_generate.background import BackgroundEmitter

    release = threading.Event()
    emitter = BackgroundEmitter(max_pending=2)
    ran = []
    assert emitter.submit(release.wait)  # the worker takes it and blocks
    while emitter.pending() and emitter._jobs:
        time.sleep(0.001)
    assert emitter.submit(lambda: ran.append(1)) and emitter.submit(lambda: ran.append(2))
    assert not emitter.submit(lambda: ran.append(3))  # full
    assert emitter.dropped == 1
    release.set()
    assert emitter.drain(5.0)
    assert ran == [1, 2]
    assert "queue was full" in caplog.text


def _blocked(emitter):
    """Occupy the worker with a job that waits for the returned event."""
    release = threading.Event()
    assert emitter.submit(release.wait)
    while emitter._jobs:
        time.sleep(0.001)
    return release


def test_drops_are_counted_by_the_callback_and_warned_at_most_once_an_interval(caplog, monkeypatch):
    import logging

    from otel_generate import background

    now = [1000.0]
    monkeypatch.setattr(background.time, "monotonic", lambda: now[0])
    counted = []
    emitter = background.BackgroundEmitter(max_pending=1, on_drop=lambda: counted.append(1))
    release = _blocked(emitter)
    assert emitter.submit(lambda: None)  # the one waiting place
    with caplog.at_level(logging.WARNING, logger="otel_generate"):
        for _ in range(5):
            assert not emitter.submit(lambda: None)
        now[0] += background.DROP_LOG_INTERVAL_S - 1  # within the interval: counted, not said
        assert not emitter.submit(lambda: None)
        now[0] += 1  # the interval is over: the next drop says how many since the last warning
        assert not emitter.submit(lambda: None)
        assert not emitter.submit(lambda: None)
        emitter.report_drops(final=True)  # at exit: what is left unsaid
    messages = [r.getMessage() for r in caplog.records if r.name == "otel_generate"]
    assert len(counted) == emitter.dropped == 8
    assert len(messages) == 3
    assert "the telemetry of 1 finished request(s) was dropped (1 in all" in messages[0]
    assert "the telemetry of 6 finished request(s) was dropped (7 in all" in messages[1]
    assert "the telemetry of 1 finished request(s) was dropped (8 in all" in messages[2]
    release.set()
    assert emitter.drain(5.0)


def test_a_drop_never_waits_for_the_worker():
    from otel_generate.background import BackgroundEmitter

    emitter = BackgroundEmitter(max_pending=1)
    release = _blocked(emitter)
    assert emitter.submit(lambda: None)
    started = time.monotonic()
    assert not emitter.submit(lambda: None)
    assert time.monotonic() - started < 1.0  # the worker is still blocked: the caller did not wait for it
    release.set()
    assert emitter.drain(5.0)


def test_a_failing_drop_counter_is_logged_and_the_caller_goes_on(caplog):
    from otel_generate import _faults
    from otel_generate.background import BackgroundEmitter

    _faults._logged_kinds.discard(_faults.Fault.BACKGROUND_EMISSION)

    def broken():
        raise RuntimeError("no meter")

    emitter = BackgroundEmitter(max_pending=1, on_drop=broken)
    release = _blocked(emitter)
    assert emitter.submit(lambda: None)
    assert not emitter.submit(lambda: None)
    assert "background emission failed" in caplog.text and "no meter" in caplog.text
    release.set()
    assert emitter.drain(5.0)


def test_a_forked_child_starts_with_an_empty_queue_and_free_locks():
    import json
    import os

    from otel_generate.background import BackgroundEmitter

    emitter = BackgroundEmitter(max_pending=4)
    release = _blocked(emitter)
    assert emitter.submit(lambda: None)
    emitter._lock.acquire()  # as if a parent thread held it at the fork
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            ran = []
            result = {"pending": emitter.pending(), "submitted": emitter.submit(lambda: ran.append(1))}
            result["drained"] = emitter.drain(5.0)
            result["ran"] = ran
            os.write(write, json.dumps(result).encode())
        finally:
            os._exit(0)
    emitter._lock.release()
    os.close(write)
    with os.fdopen(read) as pipe:
        child = json.loads(pipe.read())
    os.waitpid(pid, 0)
    assert child == {"pending": 0, "submitted": True, "drained": True, "ran": [1]}
    release.set()
    assert emitter.drain(5.0) and emitter.pending() == 0  # the parent still emits its own


def test_force_flush_drains_then_flushes_any_provider_with_force_flush():
    from otel_generate import _lifecycle
    from otel_generate.background import BackgroundEmitter

    order = []

    class Provider:  # not the SDK's: only a public force_flush
        def __init__(self, name):
            self.name = name

        def force_flush(self, timeout_millis=30_000):
            order.append(self.name)
            return True

    emitter = BackgroundEmitter()
    release = _blocked(emitter)
    emitter.submit(lambda: order.append("emitted"))
    threading.Timer(0.2, release.set).start()
    _lifecycle.enable(Provider("traces"), Provider("metrics"), drain=emitter.drain)
    try:
        assert _lifecycle.force_flush(10.0) is True
    finally:
        _lifecycle.disable()
    assert order[0] == "emitted" and sorted(order[1:]) == ["metrics", "traces"]
    for bad in (0, -1, "3", None, True):
        try:
            _lifecycle.force_flush(bad)
        except ValueError as error:
            assert "timeout_s must be a positive number" in str(error)
        else:
            raise AssertionError(f"force_flush({bad!r}) did not raise")


@pytest.mark.parametrize("answer", ["False", "raises"])
@pytest.mark.parametrize("signal", ["traces", "metrics", "logs"])
def test_force_flush_is_false_when_a_providers_own_flush_says_it_did_not_finish(signal, answer, caplog):
    """``otel_generate.force_flush()`` is True only when all three signals are out: a provider whose
    ``force_flush`` answers ``False`` (a span processor that could not export) or raises (the SDK's
    ``MeterProvider`` when a reader fails) makes it False, as the provider's own flush would say."""
    from otel_generate import _lifecycle

    class Provider:
        def __init__(self, fails):
            self.fails = fails

        def force_flush(self, timeout_millis=30_000):
            if not self.fails:
                return True
            if answer == "raises":
                raise RuntimeError("a metric reader failed")
            return False

    providers = {name: Provider(name == signal) for name in ("traces", "metrics", "logs")}
    _lifecycle.enable(providers["traces"], providers["metrics"], logs=True, logger_provider=providers["logs"])
    try:
        assert providers[signal].force_flush() is False if answer == "False" else True
        assert _lifecycle.force_flush(5.0) is False
    finally:
        _lifecycle.disable()


def test_a_worker_that_cannot_start_runs_the_job_on_the_caller_and_starts_next_time(monkeypatch, caplog):
    from otel_generate import _faults
    from otel_generate.background import BackgroundEmitter

    _faults._logged_kinds.discard(_faults.Fault.BACKGROUND_EMISSION)
    original = threading.Thread.start
    failures = [1]

    def start(self):
        if self.name == "otel_generate-emitter" and failures:
            failures.pop()
            raise RuntimeError("can't start new thread")
        return original(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    emitter = BackgroundEmitter()
    ran = []
    assert emitter.submit(lambda: ran.append(threading.current_thread().name))  # must not raise
    assert ran == [threading.current_thread().name]  # emitted on the caller's thread, not lost
    assert "can't start new thread" in caplog.text
    assert emitter.submit(lambda: ran.append(threading.current_thread().name))  # the worker starts now
    assert emitter.drain(5.0)
    assert ran[1] == "otel_generate-emitter"


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_worker_is_started_again():
    from otel_generate.background import BackgroundEmitter

    emitter = BackgroundEmitter()

    def fatal():
        raise SystemExit  # a BaseException: ends the worker thread

    assert emitter.submit(fatal)
    emitter._thread.join(5.0)
    assert not emitter._thread.is_alive()
    ran = []
    assert emitter.submit(lambda: ran.append(1))
    assert emitter.drain(5.0) and ran == [1]


def test_a_drain_waits_for_the_jobs_queued_before_it_not_for_later_ones():
    from otel_generate.background import BackgroundEmitter

    emitter = BackgroundEmitter()
    release = _blocked(emitter)
    ran = []
    emitter.submit(lambda: ran.append("before"))
    result = []
    waiter = threading.Thread(target=lambda: result.append(emitter.drain(10.0)))
    waiter.start()
    time.sleep(0.05)

    jobs = [0]

    def steady():  # a steady load: each job queues another while the drain waits
        jobs[0] += 1
        if jobs[0] < 200:
            time.sleep(0.01)
            emitter.submit(steady)

    emitter.submit(steady)
    release.set()
    waiter.join(10.0)
    assert result == [True] and "before" in ran
    assert emitter.pending() > 0  # it returned while later jobs still ran: it did not wait for an empty queue
    assert emitter.drain(10.0)


def test_a_wrapped_flush_splits_its_timeout_and_reports_an_unfinished_drain(caplog):
    from otel_generate.background import DRAIN_SHARE, BackgroundEmitter, make_draining

    emitter = BackgroundEmitter()
    release = _blocked(emitter)
    emitter.submit(lambda: None)
    given = []

    class Provider:
        def force_flush(self, timeout_millis=30_000):
            given.append(timeout_millis)
            return True

    flush = make_draining(Provider.force_flush, emitter, "traces", lambda provider: True)
    started = time.monotonic()
    assert flush(Provider(), timeout_millis=300) is False  # its own flush finished, the drain did not
    assert time.monotonic() - started < 0.6
    # the drain waited its share (150 ms) and no more; the provider got the rest, never less
    assert 300 * (1 - DRAIN_SHARE) <= given[0] <= 300 * (1 - DRAIN_SHARE) + 20
    assert flush(Provider(), 300) is False and 150 <= given[1] <= 170  # positional too
    assert "still held 2 finished request(s)" in caplog.text
    assert caplog.text.count("still held") == 1  # at most once an interval
    release.set()
    assert flush(Provider(), timeout_millis=5000) is True and given[2] > 4000


@pytest.mark.parametrize("signal", ["traces", "metrics"])
def test_a_wrapped_flush_called_without_a_timeout_keeps_to_the_providers_default(signal):
    """``provider.force_flush()`` with no argument is bounded by the SDK's default ``timeout_millis``
    (10 s for ``MeterProvider.force_flush``, 30 s for ``shutdown``): the drain takes at most its share
    of that default, not a bound of its own on top of it. A job without parts (continuous
    batching's) is waited for even by a meter flush."""
    from otel_generate.background import BackgroundEmitter, make_draining

    emitter = BackgroundEmitter()
    release = _blocked(emitter)
    given = []

    class Provider:
        def force_flush(self, timeout_millis=300):
            given.append(timeout_millis)
            return True

    flush = make_draining(Provider.force_flush, emitter, signal, lambda provider: True)
    timer = threading.Timer(2.0, release.set)
    timer.start()
    try:
        started = time.monotonic()
        assert flush(Provider()) is False  # the drain did not finish within its share of 300 ms
        waited = time.monotonic() - started
    finally:
        release.set()
        timer.cancel()
    assert waited < 1.0, waited
    assert 300 * 0.5 <= given[0] <= 300
    assert emitter.drain(5.0)


def test_a_provider_that_is_not_ours_flushes_as_without_the_emitter(caplog):
    from otel_generate.background import BackgroundEmitter, make_draining

    emitter = BackgroundEmitter()
    release = _blocked(emitter)
    emitter.submit(lambda: None)
    given = []

    class Provider:
        def force_flush(self, timeout_millis=30_000):
            given.append(timeout_millis)
            return "its own answer"

    ours, theirs = Provider(), Provider()
    flush = make_draining(Provider.force_flush, emitter, "traces", lambda provider: provider is ours)
    started = time.monotonic()
    assert flush(theirs, timeout_millis=100) == "its own answer" and given == [100]
    assert flush(theirs) == "its own answer" and given == [100, 30_000]
    assert time.monotonic() - started < 0.05  # the blocked queue was not waited for
    assert "still held" not in caplog.text
    release.set()
    assert emitter.drain(5.0)


def test_an_exit_drain_that_runs_out_of_time_says_what_is_lost(caplog, monkeypatch):
    from otel_generate import background

    monkeypatch.setattr(background, "DEFAULT_DRAIN_TIMEOUT_S", 0.2)
    emitter = background.BackgroundEmitter()
    release = _blocked(emitter)
    emitter.submit(lambda: None)
    emitter.submit(lambda: None)
    emitter._drain_at_exit()
    assert (
        "still held 3 finished request(s) at exit: their telemetry was not emitted in time and is lost" in caplog.text
    )
    release.set()
    assert emitter.drain(5.0)


def test_a_forked_childs_own_drops_are_warned_at_once_and_counted_from_zero():
    import json
    import os

    from otel_generate import background

    emitter = background.BackgroundEmitter(max_pending=1)
    release = _blocked(emitter)
    assert emitter.submit(lambda: None)
    assert not emitter.submit(lambda: None)  # the parent's drop, warned now
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            import io
            import logging

            log = io.StringIO()
            handler = logging.StreamHandler(log)
            logging.getLogger("otel_generate").addHandler(handler)
            child_release = _blocked(emitter)
            emitter.submit(lambda: None)
            emitter.submit(lambda: None)  # the child's own drop
            child_release.set()
            emitter.drain(5.0)
            os.write(write, json.dumps({"dropped": emitter.dropped, "log": log.getvalue()}).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        child = json.loads(pipe.read())
    os.waitpid(pid, 0)
    assert child["dropped"] == 1
    assert "the telemetry of 1 finished request(s) was dropped (1 in all in this process" in child["log"]
    release.set()
    assert emitter.drain(5.0)


def test_force_flush_of_a_provider_with_shutdown_only_is_quiet(caplog):
    import logging

    from otel_generate import _lifecycle

    class OnlyShutdown:  # nothing to flush; its shutdown is for the exit, not for force_flush
        stopped = False

        def shutdown(self):
            self.stopped = True

    provider = OnlyShutdown()
    _lifecycle.enable(provider, provider)
    try:
        with caplog.at_level(logging.WARNING, logger="otel_generate"):
            assert _lifecycle.force_flush(2.0) is True
    finally:
        _lifecycle.disable()
    assert not provider.stopped
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread names are read from /proc")
def test_the_worker_is_named_in_the_operating_system_so_its_cpu_time_can_be_read_from_outside():
    from otel_generate.background import WORKER_NAME, BackgroundEmitter

    emitter = BackgroundEmitter()
    native = []
    assert emitter.submit(lambda: native.append(threading.get_native_id()))
    assert emitter.drain(5.0)
    (tid,) = native
    assert tid != threading.get_native_id()
    with open(f"/proc/self/task/{tid}/comm", encoding="utf-8") as handle:
        assert handle.read().strip() == WORKER_NAME.encode()[:15].decode() == "otel_generate-e"
    with open(f"/proc/self/task/{threading.get_native_id()}/comm", encoding="utf-8") as handle:
        assert handle.read().strip() != "otel_generate-e"  # only the worker was renamed
    emitter.stop(5.0)
