"""Count the instructions of one marked stretch of a child process under valgrind's callgrind.

Shared by the benchmark scripts that measure a per-call or per-step cost by the difference method
(``callgrind_per_call.py``, ``cb_step_hook.py``). The child runs under ``valgrind --tool=callgrind
--instr-atstart=no`` (imports and set-up uninstrumented, fast), prepares, calls ``signal(folder,
"ready")`` and waits for ``"go"``; the parent turns instrumentation on with ``callgrind_control``; the
child runs the measured work, signals ``"done"`` and waits for ``"stop"``, after which the parent
turns instrumentation off again and reads the count callgrind logs. BLAS and OpenMP run on one
thread, so that idle threads do not spin, and string hashing is fixed (``PYTHONHASHSEED=0``).
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional, Sequence, TypeVar

T = TypeVar("T")


def signal(folder: str, name: str) -> None:
    """Mark ``name`` reached (a file in ``folder``)."""
    open(os.path.join(folder, name), "w").close()


def wait(folder: str, name: str, poll_s: float = 0.01) -> None:
    """Wait until the other process marked ``name``."""
    while not os.path.exists(os.path.join(folder, name)):
        time.sleep(poll_s)


def counted_stretch(folder: str, work: Callable[[], None]) -> None:
    """In the child: mark ``"ready"``, wait for ``"go"``, run ``work`` (what is counted), mark
    ``"done"`` and wait for ``"stop"`` (the parent has turned counting off by then)."""
    signal(folder, "ready")
    wait(folder, "go")
    work()
    signal(folder, "done")
    wait(folder, "stop")


def count(script: str, child_args: Sequence[str], valgrind_args: Sequence[str] = ()) -> Optional[int]:
    """Run ``python script --child *child_args FOLDER`` under callgrind and return the instructions
    counted between the child's ``"ready"``/``"go"`` and its ``"done"`` (``None`` when callgrind's
    log names no count); ``valgrind_args`` are added to callgrind's options (``--toggle-collect``).
    Raises ``subprocess.CalledProcessError`` when ``callgrind_control`` fails."""
    return run_stretch(script, child_args, valgrind_args, collected)


def collected(folder: str) -> Optional[int]:
    """The count callgrind's log in ``folder`` names (``None`` when it names none)."""
    with open(os.path.join(folder, "valgrind.log"), encoding="utf-8") as handle:
        found = re.search(r"Collected : (\d+)", handle.read())
    return int(found.group(1)) if found else None


def run_stretch(script: str, child_args: Sequence[str], valgrind_args: Sequence[str], read: Callable[[str], T]) -> T:
    """:func:`count`'s run, returning ``read(FOLDER)`` once valgrind has exited: FOLDER holds
    callgrind's log (``valgrind.log``), its output (``callgrind.out``, ``callgrind.out.N`` for
    numbered dumps) and whatever the child wrote there."""
    with tempfile.TemporaryDirectory() as folder:
        log = os.path.join(folder, "valgrind.log")
        valgrind = subprocess.Popen(
            [
                "valgrind",
                "--tool=callgrind",
                "--instr-atstart=no",
                f"--callgrind-out-file={os.path.join(folder, 'callgrind.out')}",
                f"--log-file={log}",
                *valgrind_args,
                sys.executable,
                os.path.abspath(script),
                "--child",
                *child_args,
                folder,
            ],
            env=dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", PYTHONHASHSEED="0"),
        )
        wait(folder, "ready")
        subprocess.run(["callgrind_control", "-i", "on", str(valgrind.pid)], check=True, capture_output=True)
        signal(folder, "go")
        wait(folder, "done")
        subprocess.run(["callgrind_control", "-i", "off", str(valgrind.pid)], check=True, capture_output=True)
        signal(folder, "stop")
        valgrind.wait()
        return read(folder)


def operator_call_totals(
    script: str, child_args: Sequence[str], valgrind_args: Sequence[str], env: Dict[str, str]
) -> List[int]:
    """Run ``script --child *child_args`` under callgrind counting only inside ``operator.call``
    (``--collect-atstart=no --toggle-collect=_operator_call``, then ``valgrind_args``, such as
    ``--dump-after=_operator_call`` or ``--separate-threads=yes``), with ``env``; the total of each
    output file, in the order of its number (a dump's ``.N``, a thread's ``-NN``). Raises
    ``SystemExit`` with valgrind's output when it fails."""
    with tempfile.TemporaryDirectory() as folder:
        done = subprocess.run(
            [
                "valgrind",
                "--tool=callgrind",
                "--collect-atstart=no",
                "--toggle-collect=_operator_call",
                *valgrind_args,
                f"--callgrind-out-file={os.path.join(folder, 'callgrind.out')}",
                sys.executable,
                os.path.abspath(script),
                "--child",
                *child_args,
            ],
            env=env,
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            raise SystemExit(f"valgrind exited {done.returncode}\n{done.stderr[-2000:]}{done.stdout[-2000:]}")
        totals = []
        paths = glob.glob(os.path.join(folder, "callgrind.out*"))
        for path in sorted(paths, key=lambda p: int(re.sub(r"\D", "", os.path.basename(p)) or 0)):
            with open(path, encoding="utf-8", errors="replace") as handle:
                found = re.search(r"^(?:summary|totals): (\d+)", handle.read(), re.M)
            if found is not None:
                totals.append(int(found.group(1)))
    return totals
