"""The load monitor: the machine's load average read throughout a bench, and whether it was busy."""

from __future__ import annotations

import math
import os
import time
from typing import Any, Callable, Dict, List, Optional

#: A load average above this many runnable tasks per core (besides the bench's own) is "busy".
LOAD_PER_CORE_LIMIT = 0.5


def process_age_s() -> Optional[float]:
    """Seconds since this process started (``/proc/self/stat`` and ``/proc/uptime``); ``None`` where unknown."""
    try:
        with open("/proc/self/stat", encoding="utf-8") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime", encoding="utf-8") as handle:
            uptime = float(handle.read().split()[0])
        return max(0.0, uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))  # field 22: starttime, in ticks
    except (OSError, ValueError, IndexError, AttributeError):
        return None


class LoadMonitor:
    """Readings of the machine's load average during a bench, and whether it was busy.

    Each :meth:`read` takes ``os.getloadavg()`` (the 1-, 5- and 15-minute averages of runnable
    and uninterruptible tasks, machine-wide). The bench reads it before the model is built,
    after the warmup, after every measured run and every ``--compare`` pair (outside the
    timers), and at the end.

    The bench's own threads count too: while it runs, it keeps up to ``own_threads`` threads
    runnable (``--threads``, the torch threads; the span processor's thread works while the
    calling thread waits for it). The 1-minute average approaches a constant load ``n`` as
    ``n (1 - exp(-t / 60 s))`` after ``t`` seconds, so each reading subtracts that estimate,
    with ``t`` the age of this process (the bench counts as busy from its start; from the first
    reading where ``/proc`` is missing). The machine was **busy** when, at any reading, the load
    left, divided by the number of cores (``os.cpu_count()``), was above
    :data:`LOAD_PER_CORE_LIMIT` (0.5). The 1-minute average lags: a neighbour that starts
    seconds before the end shows up only in part. Where ``os.getloadavg`` does not exist, there
    are no readings and no verdict.

    ``on_busy``, when given, is called with the warning's text at the first reading that finds the
    machine busy, so that it is said at once (the bench prints it on stderr), not only in the report.
    """

    def __init__(
        self,
        own_threads: int,
        cores: Optional[int] = None,
        clock: Callable[[], float] = time.monotonic,
        on_busy: Optional[Callable[[str], None]] = None,
    ):
        self.on_busy = on_busy
        self._told = False
        self.own_threads = int(own_threads)
        self.cores = int(cores or os.cpu_count() or 1)
        self.clock = clock
        age = process_age_s()
        self.age_from = "process start" if age is not None else "first reading"
        self._origin = clock() - (age or 0.0)
        self.readings: List[Dict[str, Any]] = []

    def read(self, at: str) -> None:
        """Take one reading, labelled ``at`` (e.g. ``"start"``, ``"run 3"``, ``"pair 7"``, ``"end"``)."""
        try:
            one, five, fifteen = os.getloadavg()
        except (AttributeError, OSError):
            return
        busy_s = self.clock() - self._origin
        own = self.own_threads * (1.0 - math.exp(-busy_s / 60.0))
        reading = {
            "at": at,
            "bench_age_s": busy_s,
            "load_1m": one,
            "load_5m": five,
            "load_15m": fifteen,
            "own_estimate": own,
            "other_per_core": max(0.0, one - own) / self.cores,
        }
        self.readings.append(reading)
        if self.on_busy is not None and not self._told and reading["other_per_core"] > LOAD_PER_CORE_LIMIT:
            self._told = True
            self.on_busy(f"WARNING: {self.busy_text(reading, now=True)}")

    def busy_text(self, reading: Dict[str, Any], now: bool = False) -> str:
        """What a busy ``reading`` means for the timings (``now``: said while the bench runs)."""
        return (
            f"the machine {'is' if now else 'was'} busy: 1-minute load average {reading['load_1m']:.2f} at "
            f"{reading['at']} on "
            f"{self.cores} core(s) is {reading['other_per_core']:.2f} per core besides this bench's own "
            f"(estimated {reading['own_estimate']:.2f}), above {LOAD_PER_CORE_LIMIT} per core; "
            f"the timings are likely noisy, rerun on a quiet machine"
        )

    def report(self) -> Dict[str, Any]:
        """The ``load`` section of the JSON: every reading, the worst one and the verdict."""
        worst = max(self.readings, key=lambda r: r["other_per_core"], default=None)
        busy = None if worst is None else worst["other_per_core"] > LOAD_PER_CORE_LIMIT
        warning = None
        if busy:
            warning = self.busy_text(worst)
        return {
            "source": "os.getloadavg() (1-, 5-, 15-minute averages), read outside the timers",
            "cores": self.cores,
            "limit_per_core": LOAD_PER_CORE_LIMIT,
            "own_threads": self.own_threads,
            "own_estimate_formula": f"own_threads * (1 - exp(-t / 60 s)), t = seconds since {self.age_from}",
            "readings": list(self.readings),
            "max_other_per_core": None if worst is None else worst["other_per_core"],
            "busy": busy,
            "warning": warning,
        }
