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
    assert "queue is full" in caplog.text
