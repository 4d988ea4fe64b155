"""Microbenchmark of the continuous-batching hooks' cost per batch step, on stand-in objects (no model).

Once per batch step, transformers' scheduler thread runs ``ContinuousBatchingManager._generation_loop_body``
and hands the step's outputs to ``OutputRouter.deliver_batch``; the instrumentation wraps both
(:mod:`otel_generate.integrations.continuous_batching`). This times those two wrappers around
originals that do nothing but what the wrappers look at (the body moves ``current_batch`` on and
delivers a list of outputs), with a timed request in flight, so every step is logged: one clock
read at the end of the step, one log entry for the step, one for the delivery. The background
emitter is absent, so nothing is ever derived: only the scheduler thread's side is measured.

    python benchmarks/cb_step_hook.py                       # timings, JSON on stdout
    python benchmarks/cb_step_hook.py --repeats 200 --steps 2000
    python benchmarks/cb_step_hook.py --callgrind 2000 --callgrind 20000   # instructions per step

Modes: ``sync`` (the batch's ``requests_in_batch`` list, as on CPU) and ``async`` (two I/O pairs,
as CUDA's asynchronous batching: each step launches one batch and updates the previous one).
Timings: nanoseconds per step, median over ``--repeats`` of ``--steps`` back-to-back steps, the
plain originals and the wrapped ones alternating in every repeat, garbage collection off while
timing; ``added`` is the median of the paired differences. ``--callgrind N`` (given twice, with
two counts) runs the wrapped steps under valgrind's callgrind, one process per count, with the
conventions of ``otel-generate bench --instructions`` (:mod:`otel_generate.bench.instructions`:
counting turned on by the process itself after its set-up and warm-up, a dump at the marker
call after the steps, BLAS and OpenMP on one thread, string hashing fixed), and prints
``(Ir(N2) - Ir(N1)) / (N2 - N1)`` instructions per step (needs valgrind and ``callgrind_control``).
The JSON on stdout also holds the versions and the machine (:mod:`otel_generate.bench.environment`).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types
from typing import Any, Callable, Dict, List, Tuple

from otel_generate.bench import instructions as counting
from otel_generate.bench.environment import machine, versions
from otel_generate.integrations import continuous_batching as CB


class _Future:
    """A batch entry as the hooks read it: ``state.request_id`` and ``has_new_token``."""

    def __init__(self, request_id: str) -> None:
        self.state = types.SimpleNamespace(request_id=request_id)
        self.has_new_token = True


class _Output:
    def __init__(self, request_id: str) -> None:
        self.request_id = request_id


def _stand_ins(mode: str, batch_size: int) -> Tuple[Any, Any, Callable, Callable]:
    """(manager, router, the plain body, the plain deliver_batch): classes whose methods do only
    what the hooks look at."""
    batch = [_Future(f"req_{i}") for i in range(batch_size)]
    outputs = [_Output(f"req_{i}") for i in range(batch_size)]
    if mode == "sync":
        io = types.SimpleNamespace(requests_in_batch=batch)
    else:
        pair = types.SimpleNamespace(host_io=types.SimpleNamespace(requests_in_batch=batch))
        other = types.SimpleNamespace(host_io=types.SimpleNamespace(requests_in_batch=list(batch)))
        io = types.SimpleNamespace(io_pairs=[pair, other], current_pair=0)

    class Router:
        def deliver_batch(self, outputs):
            return None

    class Manager:
        def __init__(self) -> None:
            self.current_batch = 0
            self.batch_processor = types.SimpleNamespace(inputs_and_outputs=io)
            self.output_router = Router()
            self.model = types.SimpleNamespace(name_or_path="stand-in", device="cpu")
            self.generation_config = types.SimpleNamespace()

        def _generation_loop_body(self, batch_processor=None, bootstrapping=False):
            self.current_batch += 1
            self.output_router.deliver_batch(outputs)

    manager = Manager()
    return manager, manager.output_router, Manager._generation_loop_body, Router.deliver_batch


def _telemetry() -> Any:
    """What the scheduler-thread hooks read of the telemetry: on, and no background emitter."""
    return types.SimpleNamespace(active=True, emitter=None)


def _instrumented(mode: str, batch_size: int) -> Tuple[Any, Any]:
    """(manager, state): the stand-in manager with the two hooks installed and one timed request in flight."""
    manager, router, body, deliver = _stand_ins(mode, batch_size)
    telemetry = _telemetry()
    wrapped_body = CB.make_generation_loop_body(body, telemetry)
    wrapped_deliver = CB.make_deliver_batch(deliver, telemetry)
    type(manager)._generation_loop_body = wrapped_body
    type(router).deliver_batch = wrapped_deliver
    state = CB.state_of(manager, telemetry)
    state.records["req_0"] = object()  # a request in flight: deliveries are logged
    state.collect = True  # ... and timed: batch steps are logged
    return manager, state


def _plain(mode: str, batch_size: int) -> Any:
    manager, _, _, _ = _stand_ins(mode, batch_size)
    return manager


def _run(manager: Any, steps: int) -> float:
    """Nanoseconds per step over ``steps`` back-to-back steps (called as transformers' loop calls the body)."""
    body = manager._generation_loop_body
    processor = manager.batch_processor
    perf = time.perf_counter_ns
    start = perf()
    for _ in range(steps):
        body(processor, bootstrapping=False)
    return (perf() - start) / steps


def _clear(state: Any) -> None:
    state.steps.clear()
    state.delivered.clear()


def timings(mode: str, batch_size: int, repeats: int, steps: int) -> Dict[str, Any]:
    plain = _plain(mode, batch_size)
    manager, state = _instrumented(mode, batch_size)
    plain_ns: List[float] = []
    hooked_ns: List[float] = []
    for _ in range(5):  # warm-up
        _run(plain, steps)
        _run(manager, steps)
        _clear(state)
    gc.disable()
    try:
        for _ in range(repeats):
            plain_ns.append(_run(plain, steps))
            hooked_ns.append(_run(manager, steps))
            _clear(state)
    finally:
        gc.enable()
    added = [b - a for a, b in zip(plain_ns, hooked_ns)]
    return {
        "mode": mode,
        "batch_size": batch_size,
        "plain_ns": round(statistics.median(plain_ns), 1),
        "hooked_ns": round(statistics.median(hooked_ns), 1),
        "added_ns": round(statistics.median(added), 1),
        "added_iqr_ns": [round(q, 1) for q in statistics.quantiles(added, n=4)[::2]],
    }


# --- instruction counts -------------------------------------------------------------------------------


def _child(mode: str, batch_size: int, steps: int) -> None:
    """Under valgrind: set up and warm up uncounted, count ``steps`` wrapped steps, mark the end."""
    manager, state = _instrumented(mode, batch_size)
    for _ in range(3):
        _run(manager, 1000)
        _clear(state)
    gc.disable()
    counting.start_counting()
    _run(manager, steps)
    os.getloadavg()  # the marker: callgrind dumps what was counted since counting started


def instructions(mode: str, batch_size: int, steps: int) -> int:
    """Instructions callgrind counts over ``steps`` wrapped steps (plus the fixed cost of starting to count)."""
    with tempfile.TemporaryDirectory() as folder:
        prefix = os.path.join(folder, "callgrind.out")
        command = [
            "valgrind",
            "--tool=callgrind",
            "--instr-atstart=no",
            f"--dump-before={counting.MARKER}",
            f"--callgrind-out-file={prefix}",
            f"--log-file={os.path.join(folder, 'valgrind.log')}",
            sys.executable,
            os.path.abspath(__file__),
            "--child",
            mode,
            str(batch_size),
            str(steps),
        ]
        env = dict(os.environ, **counting.SINGLE_THREAD_ENV, **counting.HASH_SEED_ENV)
        env[counting.COUNT_SWITCH_ENV] = "1"
        subprocess.run(command, env=env, check=True)
        dumps = counting.read_dumps(prefix)
    if 1 not in dumps:
        raise RuntimeError(f"callgrind wrote no dump at the marker (dumps {sorted(dumps)})")
    return dumps[1]


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", nargs="+", default=["sync", "async"], choices=["sync", "async"])
    parser.add_argument("--batch-size", type=int, default=8, help="requests in each batch step")
    parser.add_argument("--repeats", type=int, default=100)
    parser.add_argument("--steps", type=int, default=2000, help="batch steps per repeat")
    parser.add_argument("--callgrind", type=int, action="append", help="count instructions (give two counts)")
    args = parser.parse_args()
    results = []
    for mode in args.modes:
        if args.callgrind:
            if len(args.callgrind) != 2:
                parser.error("--callgrind takes two counts, e.g. --callgrind 2000 --callgrind 20000")
            low, high = sorted(args.callgrind)
            counts = {n: instructions(mode, args.batch_size, n) for n in (low, high)}
            per_step = (counts[high] - counts[low]) / (high - low)
            results.append({"mode": mode, "instructions": counts, "instructions_per_step": round(per_step, 1)})
        else:
            results.append(timings(mode, args.batch_size, args.repeats, args.steps))
        print(json.dumps(results[-1]), file=sys.stderr)
    json.dump({"versions": versions(), "machine": machine("cpu"), "results": results}, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
