"""Progress of a bench on stderr: the phase, the runs done out of the total, and the time left.

``otel-generate bench`` runs for minutes (``--compare --runs 50``: two sets of pairs after the
measured runs; ``--instructions``: processes under valgrind). :class:`Progress` shows where it is,
with tqdm (a dependency of transformers, and of the ``bench`` extra):

* on a terminal, one line redrawn in place: ``otel-generate bench: <phase>: 12/96 runs |███ | [00:04<00:27]``;
* elsewhere (``--progress`` with stderr a pipe or a file: CI logs), the same text as whole lines,
  at most one every :data:`LINE_INTERVAL_S` seconds and at every change of phase, so a log holds no
  carriage returns.

It is shown when stderr is a terminal or ``--progress`` is given, and never with ``--quiet``
(:func:`wanted`). It is drawn between runs, outside every timer, and starts no thread (tqdm's
monitor thread is off). :meth:`Progress.say` prints a line at once, above the progress line,
whether progress is shown or not: a busy machine found at the start is reported then, not only
with the warnings at the end.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Dict, Optional, TextIO

#: The prefix of every progress line.
PREFIX = "otel-generate bench"
#: Without a terminal, at most one progress line this often (seconds), plus one at each change of phase.
LINE_INTERVAL_S = 5.0
#: On a terminal, the line is redrawn at most this often (seconds).
TERMINAL_INTERVAL_S = 0.1
#: The line's width, and the screen's height, on a terminal that reports no size.
DEFAULT_WIDTH = 100
DEFAULT_HEIGHT = 24


def _width(stream: TextIO) -> int:
    """The terminal's width in columns (0 where it reports none, as a fresh pseudo-terminal does)."""
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):
        return 0


def wanted(progress: bool, quiet: bool, stream: Optional[TextIO] = None) -> bool:
    """Whether to show progress: never with ``quiet``; with ``progress``; else when ``stream``
    (default stderr) is a terminal."""
    if quiet:
        return False
    if progress:
        return True
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty()) if callable(isatty) else False
    except ValueError:  # a closed stream
        return False


class _Lines:
    """A stream for tqdm that turns its in-place redraws (``"\\r" + text``) into whole lines,
    dropping a line equal to the one before it (the redraw tqdm makes when it closes)."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.encoding = getattr(stream, "encoding", None) or "utf-8"
        self._last = ""

    def write(self, text: str) -> int:
        line = text.replace("\r", "").rstrip()
        if line and line != self._last:
            self.stream.write(line + "\n")
            self._last = line
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:
        return False


class Progress:
    """The progress line of one bench. Nothing is shown unless ``enabled``; :meth:`say` always prints.

    :meth:`begin` starts it with the total (runs, or processes for ``--instructions``) and the first
    phase; :meth:`phase` names the next phase; :meth:`advance` counts runs done; :meth:`close` ends
    it (the line stays). The time left is tqdm's estimate from the rate of the runs so far.
    """

    def __init__(self, enabled: bool = False, stream: Optional[TextIO] = None) -> None:
        self.enabled = enabled
        self.stream = sys.stderr if stream is None else stream
        self._bar: Any = None
        self._setting_up = False  # begun, no phase named since: the clock restarts at the first phase

    def _runs_begin(self) -> None:
        """The set-up (imports, the model) is over: count the time and the rate from here."""
        if self._setting_up:
            self._setting_up = False
            self._bar.reset(total=self._bar.total)

    def begin(self, total: int, phase: str, unit: str = "runs") -> None:
        """Show the progress line at once: ``phase``, 0 of ``total`` ``unit`` done."""
        if not self.enabled:
            return
        self.close()
        from tqdm import tqdm

        class _Bar(tqdm):  # type: ignore[misc,valid-type]
            monitor_interval = 0  # no monitor thread: nothing wakes up during a timed run

        terminal = wanted(False, False, self.stream)
        # a terminal that reports no size (0 x 0, as a fresh pseudo-terminal does) would hide the line
        sized: Dict[str, Any] = (
            {"dynamic_ncols": True} if _width(self.stream) > 0 else {"ncols": DEFAULT_WIDTH, "nrows": DEFAULT_HEIGHT}
        )
        self._bar = _Bar(
            total=total,
            desc=f"{PREFIX}: {phase}",
            unit=unit,
            file=self.stream if terminal else _Lines(self.stream),
            mininterval=TERMINAL_INTERVAL_S if terminal else LINE_INTERVAL_S,
            miniters=1,
            **sized,
            bar_format=(
                "{desc}: {n_fmt}/{total_fmt} {unit} |{bar}| [{elapsed}<{remaining}]"
                if terminal
                else "{desc}: {n_fmt}/{total_fmt} {unit} [{elapsed} elapsed, {remaining} left]"
            ),
            leave=True,
            smoothing=0,  # the time left from the mean rate since the runs began
        )
        self._bar.refresh()
        self._setting_up = True

    def phase(self, name: str) -> None:
        """Name the phase now running (shown at once)."""
        if self._bar is not None:
            self._runs_begin()
            self._bar.set_description_str(f"{PREFIX}: {name}", refresh=True)

    def advance(self, done: int = 1) -> None:
        """``done`` more runs (or processes) finished."""
        if self._bar is not None:
            self._runs_begin()
            self._bar.update(done)

    def say(self, text: str) -> None:
        """Print ``text`` as a line of its own at once, above the progress line if one is shown."""
        if self._bar is not None:
            self._bar.write(text, file=self.stream)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        """End the progress line (it stays on screen); nothing when none is shown."""
        bar, self._bar = self._bar, None
        if bar is not None:
            bar.close()
