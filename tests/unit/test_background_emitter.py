"""The background emitter on its own, no model: a full queue drops and counts."""

from __future__ import annotations

import threading
import time


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
