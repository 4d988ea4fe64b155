"""Where the instrumentation's own instructions go: a count per piece of its code, per ``generate()`` call.

    python benchmarks/callgrind_pieces.py CONFIG SET N

CONFIG as in ``callgrind_own_code.py`` (``unsampled``, ``step-spans-off``, ``sampled``; the same
workload: the default tiny GPT-2, 128 new tokens, EOS off, one thread). SET names the pieces
counted, none of which runs inside another of the same set:

- ``hooks``: ``Call.__init__`` (the request's set-up, its span started), ``Call.open_loop``,
  ``Loop.close``, ``generate_loop.finish`` (accounting, derivation, emission), the four set-up
  hooks of ``GenerationMixin`` and every step's ``RecordingCriteriaList.__call__``;
- ``finish``: inside those, ``emit.start_request_span``, ``clock.devices_of``,
  ``Loop.recording_criteria``, ``account_call``, ``derive``, ``emit._annotate``, the SDK
  ``Span.end``, ``emit._record_metrics``, ``Call.release``, ``ranks.placement`` and the set-up
  bookkeeping (``setup_started``/``setup_done``).

How: each piece is entered through ``operator.call`` (callgrind ``--toggle-collect=_operator_call``:
collection on for its outermost entry), the originals a hook calls through ``itertools.starmap``
(``starmap_next``: off), and callgrind dumps after each ``_operator_call``
(``--dump-after``), so every entry of a piece lands in a dump of its own; the names are
recorded in the same order. Printed per call: each piece's instructions, how many times it ran
and its mean, and ``wrapper``: what the counting wrappers themselves add to one entry of a piece
that calls an original (``RecordingCriteriaList.__call__``, the set-up hooks; counted around a
function that does nothing), to subtract from those pieces' means. The rest of the hooks' work
(the ``generate`` hook's own lines around these pieces) is ``callgrind_own_code.py``'s total
minus the sum. Needs valgrind on Linux.
"""

from __future__ import annotations

import functools
import gc
import json
import operator
import os
import sys
from collections import defaultdict
from typing import Callable, List

import callgrind_toggled  # noqa: E402  (benchmarks/, the script's own folder)
import callgrind_workload  # noqa: E402
from callgrind_own_code import CONFIGS, not_counted  # noqa: E402

SETS = ("hooks", "finish")
SETUP_HOOKS = (
    "make_prepare_generated_length",
    "make_get_stopping_criteria",
    "make_get_candidate_generator",
    "make_prepare_cache_for_generation",
)
CALIBRATION_CALLS = 200
NAMES: List[str] = []


def counted(name: str, function: Callable) -> Callable:
    """``function`` entered through ``_operator_call`` (collection on), its entry named ``name``."""

    @functools.wraps(function)
    def enter(*args, **kwargs):
        NAMES.append(name)
        return operator.call(function, *args, **kwargs)

    return enter


def install(pieces: str) -> None:
    from opentelemetry.sdk.trace import Span
    from transformers.generation.stopping_criteria import StoppingCriteriaList

    from otel_generate import clock, emit, ranks
    from otel_generate.integrations import generate_loop, loop_state, step_hook

    def patch(owner, attribute: str, name: str) -> None:
        setattr(owner, attribute, counted(name, getattr(owner, attribute)))

    if pieces == "hooks":
        patch(loop_state.Call, "__init__", "Call.__init__")
        patch(loop_state.Call, "open_loop", "Call.open_loop")
        patch(loop_state.Loop, "close", "Loop.close")
        patch(generate_loop, "finish", "finish")
        for hook in SETUP_HOOKS:
            make = getattr(generate_loop, hook)
            setattr(
                generate_loop,
                hook,
                lambda original, telemetry, make=make, hook=hook: counted(hook, make(not_counted(original), telemetry)),
            )
        patch(step_hook.RecordingCriteriaList, "__call__", "step (RecordingCriteriaList.__call__)")
        StoppingCriteriaList.__call__ = not_counted(StoppingCriteriaList.__call__)
        if step_hook.criteria_call_known():  # (a wrapper is not the known code: the call path is counted)
            raise SystemExit("StoppingCriteriaList.__call__ wrapped, yet taken for the known code")
        return
    patch(emit, "start_request_span", "emit.start_request_span")
    patch(clock, "devices_of", "clock.devices_of")
    patch(loop_state.Loop, "recording_criteria", "Loop.recording_criteria")
    patch(generate_loop, "account_call", "account_call")
    patch(emit, "derive", "derive")
    patch(emit, "_annotate", "emit._annotate")
    patch(Span, "end", "Span.end (SDK)")
    patch(emit, "_record_metrics", "emit._record_metrics")
    patch(loop_state.Call, "release", "Call.release")
    patch(ranks, "placement", "ranks.placement")
    patch(generate_loop, "setup_started", "setup_started")
    patch(generate_loop, "setup_done", "setup_done")


def child(config: str, pieces: str, n: int, folder: str) -> None:
    if config == "calibrate":  # the wrappers of a piece that calls an original, around nothing
        wrapped = counted("wrapper", not_counted(lambda: None))
        gc.collect()
        gc.disable()
        callgrind_toggled.counted_stretch(folder, lambda: [wrapped() for _ in range(n)])
    else:
        install(pieces)
        call = callgrind_workload.calls_for(config)  # (its warm-up calls)
        gc.collect()
        gc.disable()
        del NAMES[:]
        callgrind_toggled.counted_stretch(folder, lambda: [call() for _ in range(n)])
    with open(os.path.join(folder, "names.json"), "w", encoding="utf-8") as handle:
        json.dump(NAMES, handle)


def run(config: str, pieces: str, n: int) -> List[tuple]:
    """``[(name, instructions)]`` of every counted entry, in order."""
    from otel_generate.bench.instructions import read_dumps

    def read(folder: str) -> tuple:
        with open(os.path.join(folder, "names.json"), encoding="utf-8") as handle:
            return json.load(handle), read_dumps(os.path.join(folder, "callgrind.out"))

    toggles = ("--toggle-collect=_operator_call", "--toggle-collect=starmap_next", "--dump-after=_operator_call")
    names, dumps = callgrind_toggled.run_stretch(__file__, (config, pieces, str(n)), toggles, read)
    counts = [dumps[number] for number in sorted(dumps)]
    if len(counts) != len(names):
        raise SystemExit(f"{len(counts)} dumps for {len(names)} entries: a piece ran inside another")
    return list(zip(names, counts))


def main() -> int:
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
        return 0
    if (
        len(sys.argv) != 4
        or sys.argv[1] not in CONFIGS
        or sys.argv[2] not in SETS
        or not sys.argv[3].isdigit()
        or int(sys.argv[3]) < 1
    ):
        raise SystemExit(f"usage: callgrind_pieces.py {{{','.join(CONFIGS)}}} {{{','.join(SETS)}}} N (N >= 1)")
    config, pieces, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    wrapper = sum(count for _, count in run("calibrate", "-", CALIBRATION_CALLS)) / CALIBRATION_CALLS
    total, runs = defaultdict(int), defaultdict(int)
    for name, count in run(config, pieces, n):
        total[name] += count
        runs[name] += 1
    print(f"{config}, {pieces}: instructions per generate() call ({n} calls)")
    for name in sorted(total, key=total.__getitem__, reverse=True):
        print(f"  {name:40s} {total[name] / n:12,.0f}   {runs[name] / n:5.0f} x {total[name] / runs[name]:10,.0f}")
    print(f"  {'sum':40s} {sum(total.values()) / n:12,.0f}")
    print(f"  wrapper of a piece that calls an original: {wrapper:,.0f} per entry (included above)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
