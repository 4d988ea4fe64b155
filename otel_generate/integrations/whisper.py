"""Producer detail: Whisper's long-form windows and temperature fallback.

``WhisperGenerationMixin.generate`` (``transformers/models/whisper/generation_whisper.py``) calls
``generate_with_fallback`` once per 30-second window; that calls the base ``generate()`` once
per temperature attempt, and ``_need_fallback`` once per row of each attempt to decide whether
its result is kept. Both helpers are hooked when that module is imported (a wrapt post-import
hook), so each inner loop of the request knows its window, attempt, temperature and kept rows.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Dict, List, Optional, Tuple

from otel_generate import attributes as A
from otel_generate import emit
from otel_generate._faults import log_fault_once
from otel_generate._patch import Patches
from otel_generate.integrations.generate_loop import _ACTIVE, Call, Loop

MODULE = "transformers.models.whisper.generation_whisper"
#: Seconds of audio per ``seek`` frame: ``time_precision`` (0.02 s) / ``input_stride`` (2).
SECONDS_PER_FRAME = 0.01


def install(patches: Patches, telemetry: emit.Telemetry) -> None:
    """Hook Whisper's helpers now if the module is imported, else when it is."""

    def on_import(module: Any) -> None:
        if not telemetry.active:
            return
        mixin = getattr(module, "WhisperGenerationMixin", None)
        if mixin is None:
            return
        try:
            patches.replace(mixin, "generate_with_fallback", make_generate_with_fallback, telemetry)
            patches.replace(mixin, "_need_fallback", make_need_fallback, telemetry)
        except Exception as fault:
            log_fault_once("whisper hook install", fault)

    patches.on_import(MODULE, on_import)


def _active_call() -> Optional[Call]:
    frame = _ACTIVE.get()
    if isinstance(frame, Loop):
        return frame.call
    return frame if isinstance(frame, Call) else None


def make_generate_with_fallback(original: Callable, telemetry: emit.Telemetry) -> Callable:
    """One window: its index, where it starts, the rows it decodes and the temperatures to try."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def generate_with_fallback(self, *args, **kwargs):
        call = _active_call() if telemetry.active else None
        if call is not None:
            try:
                bound = signature.bind(self, *args, **kwargs).arguments
                seek = bound.get("seek")
                rows = bound.get("batch_idx_map")
                previous = call.whisper
                call.whisper = {
                    "index": previous["index"] + 1 if previous is not None else 0,
                    "seek": [int(s) for s in seek.tolist()] if hasattr(seek, "tolist") else [],
                    "rows": [int(r) for r in rows] if rows is not None else [],
                    "temperatures": list(bound.get("temperatures") or ()),
                    "attempts": [],
                }
            except Exception as fault:
                log_fault_once("whisper window capture", fault)
        return original(self, *args, **kwargs)

    return generate_with_fallback


def make_need_fallback(original: Callable, telemetry: emit.Telemetry) -> Callable:
    """Per row of the attempt just decoded: ``(needs_fallback, should_skip)``."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def _need_fallback(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        call = _active_call() if telemetry.active else None
        if call is not None and call.whisper is not None and call.whisper["attempts"]:
            try:
                row = int(signature.bind(self, *args, **kwargs).arguments["index"])
                needs, skip = result
                call.whisper["attempts"][-1].whisper_decisions[row] = (bool(needs), bool(skip))
            except Exception as fault:
                log_fault_once("whisper fallback capture", fault)
        return result

    return _need_fallback


def open_attempt(call: Call, loop: Loop) -> None:
    """Make ``loop`` the next attempt of the call's current window (called when the loop opens)."""
    window = call.whisper
    if window is None or loop.implicit:
        return
    loop.whisper = window
    loop.whisper_attempt = len(window["attempts"])
    loop.whisper_decisions = {}
    window["attempts"].append(loop)


def attempt_attributes(loop: Loop) -> Tuple[Dict[str, Any], Optional[set]]:
    """The grouping-span attributes of one attempt, and the positions (rows of the attempt's own
    batch) whose result was kept, or ``None`` when the loop is not a Whisper attempt."""
    window = loop.whisper
    if window is None:
        return {}, None
    attempt = loop.whisper_attempt
    last = attempt >= len(window["temperatures"]) - 1
    rows: List[int] = list(window["rows"])  # original rows decoded by attempt 0
    for earlier in window["attempts"][:attempt]:  # rows that needed a fallback go on to the next attempt
        rows = [r for i, r in enumerate(rows) if earlier.whisper_decisions.get(i, (False, False))[0]]
    kept = set()
    for position in range(len(rows)):
        needs, skip = loop.whisper_decisions.get(position, (False, False))
        if (last or not needs) and not skip:
            kept.add(position)
    seek = window["seek"]
    attributes = {
        A.GENERATE_WINDOW_INDEX: window["index"],
        A.GENERATE_WINDOW_START: min(seek) * SECONDS_PER_FRAME if seek else 0.0,
        A.GENERATE_ATTEMPT_INDEX: attempt,
        A.GENERATE_ATTEMPT_KEPT: bool(kept),
        A.GENERATE_ATTEMPT_ROWS: rows,
        A.GENERATE_ATTEMPT_KEPT_ROWS: [rows[i] for i in sorted(kept)],
    }
    if loop.temperature is not None:
        attributes[A.GENERATE_ATTEMPT_TEMPERATURE] = loop.temperature
    return attributes, kept
