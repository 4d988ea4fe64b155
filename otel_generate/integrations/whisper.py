"""Producer detail: Whisper's long-form windows and temperature fallback.

``WhisperGenerationMixin.generate`` (``transformers/models/whisper/generation_whisper.py``) calls
``generate_with_fallback`` once per 30-second window; that calls the base ``generate()`` once
per temperature attempt, and ``_need_fallback`` once per row of each attempt to decide whether
its result is kept. Both helpers are hooked when that module is imported (a wrapt post-import
hook): the window is a :class:`Window` attached to the call (``Call.window``), which each inner
loop opened meanwhile joins as its next attempt, so the accounting (:mod:`.accounting`) gets each
loop's window, attempt, temperature and kept rows from it without naming this module.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Dict, List, Optional, Tuple

from otel_generate import attributes as A
from otel_generate._faults import Fault, log_fault_once
from otel_generate.integrations._routing import active_call
from otel_generate.integrations.loop_state import Loop
from otel_generate.telemetry import Telemetry

#: Seconds of audio per ``seek`` frame: ``time_precision`` (0.02 s) / ``input_stride`` (2).
SECONDS_PER_FRAME = 0.01


def make_generate_with_fallback(original: Callable, telemetry: Telemetry) -> Callable:
    """One window: its index, where it starts, the rows it decodes and the temperatures to try."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def generate_with_fallback(self, *args, **kwargs):
        call = active_call() if telemetry.active else None
        if call is not None:
            try:
                bound = signature.bind(self, *args, **kwargs).arguments
                seek = bound.get("seek")
                rows = bound.get("batch_idx_map")
                previous = call.window
                call.window = Window(
                    index=previous.index + 1 if isinstance(previous, Window) else 0,
                    seek=[int(s) for s in seek.tolist()] if hasattr(seek, "tolist") else [],
                    rows=[int(r) for r in rows] if rows is not None else [],
                    temperatures=list(bound.get("temperatures") or ()),
                )
            except Exception as fault:
                log_fault_once(Fault.WHISPER_WINDOW_CAPTURE, fault)
        return original(self, *args, **kwargs)

    return generate_with_fallback


def make_need_fallback(original: Callable, telemetry: Telemetry) -> Callable:
    """Per row of the attempt just decoded: ``(needs_fallback, should_skip)``."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def _need_fallback(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        call = active_call() if telemetry.active else None
        window = call.window if call is not None else None
        if isinstance(window, Window) and window.attempts:
            try:
                row = int(signature.bind(self, *args, **kwargs).arguments["index"])
                needs, skip = result
                window.decisions[-1][row] = (bool(needs), bool(skip))
            except Exception as fault:
                log_fault_once(Fault.WHISPER_FALLBACK_CAPTURE, fault)
        return result

    return _need_fallback


class Window:
    """One 30-second window of a Whisper call (a :class:`~.loop_state.Window`, as ``Call.window``):
    its decoding loops are its temperature attempts (``Loop.window`` is the window).

    Attributes:
        index: the window's index in the call, from 0.
        seek: per decoded row, where the window starts (frames of :data:`SECONDS_PER_FRAME`).
        rows: the original batch rows attempt 0 decodes.
        temperatures: the temperatures to try, one per attempt.
        attempts: the loops of the attempts so far.
        decisions: per attempt, position (row of the attempt's batch) -> ``(needs_fallback, should_skip)``.
    """

    def __init__(self, index: int, seek: List[int], rows: List[int], temperatures: List[float]) -> None:
        self.index = index
        self.seek = seek
        self.rows = rows
        self.temperatures = temperatures
        self.attempts: List[Loop] = []
        self.decisions: List[Dict[int, Tuple[bool, bool]]] = []

    def on_open(self, loop: Loop) -> None:
        """Make ``loop`` the next attempt of this window (called when a loop of the call opens)."""
        loop.window = self
        self.attempts.append(loop)
        self.decisions.append({})

    def attributes(self, loop: Loop) -> Tuple[Dict[str, Any], Optional[set]]:
        """The grouping-span attributes of one attempt, and the positions (rows of the attempt's own
        batch) whose result was kept."""
        attempt = next(number for number, other in enumerate(self.attempts) if other is loop)
        last = attempt >= len(self.temperatures) - 1
        rows: List[int] = list(self.rows)  # original rows decoded by attempt 0
        for decisions in self.decisions[:attempt]:  # rows that needed a fallback go on to the next attempt
            rows = [r for i, r in enumerate(rows) if decisions.get(i, (False, False))[0]]
        decisions = self.decisions[attempt]
        kept = set()
        for position in range(len(rows)):
            needs, skip = decisions.get(position, (False, False))
            if (last or not needs) and not skip:
                kept.add(position)
        seek = self.seek
        attributes = {
            A.GENERATE_WINDOW_INDEX: self.index,
            A.GENERATE_WINDOW_START: min(seek) * SECONDS_PER_FRAME if seek else 0.0,
            A.GENERATE_ATTEMPT_INDEX: attempt,
            A.GENERATE_ATTEMPT_KEPT: bool(kept),
            A.GENERATE_ATTEMPT_ROWS: rows,
            A.GENERATE_ATTEMPT_KEPT_ROWS: [rows[i] for i in sorted(kept)],
        }
        if loop.temperature is not None:
            attributes[A.GENERATE_ATTEMPT_TEMPERATURE] = loop.temperature
        return attributes, kept
