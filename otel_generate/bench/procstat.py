"""CPU time of processes and threads, read from Linux's ``/proc``, for the serving bench.

A process's CPU time is ``utime + stime`` of ``/proc/<pid>/stat`` (all its threads, not its children); a
thread's is the same fields of ``/proc/<pid>/task/<tid>/stat``; both in clock ticks
(``os.sysconf("SC_CLK_TCK")``, usually 100 a second: a resolution of 10 ms), returned in seconds. A
thread is found by its operating-system name (``/proc/<pid>/task/<tid>/comm``, at most 15 bytes): the
instrumentation's background emitter names itself ``otel_generate-e``
(:data:`otel_generate.background.WORKER_NAME`). Where ``/proc`` is missing (not Linux) or the process
is gone, the readers return ``None``.
"""

from __future__ import annotations

import os
from typing import List, Optional

from otel_generate.background import WORKER_NAME

#: The emitter thread's name as the operating system shows it (Linux keeps 15 bytes).
EMITTER_COMM = WORKER_NAME.encode()[:15].decode()


def _ticks() -> float:
    try:
        return float(os.sysconf("SC_CLK_TCK"))
    except (AttributeError, ValueError, OSError):
        return 100.0


def _stat_fields(path: str) -> Optional[List[str]]:
    """The fields of a ``stat`` file after the command name (field 3 onwards), or ``None``."""
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            text = handle.read()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()


def _cpu_s(path: str) -> Optional[float]:
    fields = _stat_fields(path)
    if fields is None:
        return None
    return (int(fields[11]) + int(fields[12])) / _ticks()  # fields 14 and 15: utime, stime


def process_cpu_s(pid: int) -> Optional[float]:
    """CPU seconds process ``pid`` has used (all its threads), or ``None``."""
    return _cpu_s(f"/proc/{pid}/stat")


def thread_cpu_s(pid: int, tid: int) -> Optional[float]:
    """CPU seconds thread ``tid`` of process ``pid`` has used, or ``None``."""
    return _cpu_s(f"/proc/{pid}/task/{tid}/stat")


def find_threads(pid: int, comm: str = EMITTER_COMM) -> List[int]:
    """The ids of the threads of process ``pid`` named ``comm`` in the operating system, in id order."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    found = []
    for tid in sorted(tasks, key=int):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm", encoding="utf-8", errors="replace") as handle:
                if handle.read().strip() == comm:
                    found.append(int(tid))
        except OSError:
            continue
    return found


def find_thread(pid: int, comm: str = EMITTER_COMM) -> Optional[int]:
    """The id of the first thread of process ``pid`` named ``comm`` (the instrumentation runs one emitter per
    process), or ``None``."""
    found = find_threads(pid, comm)
    return found[0] if found else None


def children(pid: int) -> List[int]:
    """The ids of process ``pid``'s children (from every ``/proc/<n>/stat``'s parent field)."""
    found = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for entry in entries:
        if not entry.isdigit():
            continue
        fields = _stat_fields(f"/proc/{entry}/stat")
        if fields is not None and int(fields[1]) == pid:  # field 4: ppid
            found.append(int(entry))
    return sorted(found)


def command_line(pid: int) -> List[str]:
    """Process ``pid``'s arguments (``/proc/<pid>/cmdline``); empty where unknown."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            raw = handle.read()
    except OSError:
        return []
    return [part.decode("utf-8", "replace") for part in raw.split(b"\0") if part]
