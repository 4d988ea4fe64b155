"""The user's ``generate(streamer=...)``, timed: when the first generated tokens were handed over,
and how long the streamer's own calls took (they run inside the decoding loop's steps)."""

from __future__ import annotations

from typing import Any, Optional

import wrapt

from otel_generate import clock


class _TimedStreamer(wrapt.ObjectProxy):
    """The user's streamer, with its calls timed (it is the same object to transformers and to
    ``isinstance``). transformers' first ``put`` is the prompt (or the decoder start tokens); the
    first ``put`` after it carries the first generated tokens.

    Attributes (monotonic nanoseconds):
        _self_first_chunk_ns: when the first ``put`` of generated tokens started, or ``None``.
        _self_inside_ns: the time spent inside the streamer's ``put`` and ``end``.
    """

    def __init__(self, streamer: Any) -> None:
        super().__init__(streamer)
        self._self_puts = 0
        self._self_first_chunk_ns: Optional[int] = None
        self._self_inside_ns = 0

    def put(self, value: Any) -> Any:
        started = clock.monotonic_ns()
        self._self_puts += 1
        if self._self_puts == 2:
            self._self_first_chunk_ns = started
        try:
            return self.__wrapped__.put(value)
        finally:
            self._self_inside_ns += clock.monotonic_ns() - started

    def end(self) -> Any:
        started = clock.monotonic_ns()
        try:
            return self.__wrapped__.end()
        finally:
            self._self_inside_ns += clock.monotonic_ns() - started
