"""Instructions the instrumentation's own code runs per ``generate()`` call, the originals it calls left out.

    python benchmarks/callgrind_own_code.py CONFIG N [steady]

CONFIG is ``unsampled`` (``ALWAYS_OFF``), ``step-spans-off`` (``ALWAYS_ON``, ``max_step_spans=0``)
or ``sampled`` (``ALWAYS_ON``, every step a span), or ``step-spans-off-eos``: ``step-spans-off``
with the model's EOS id (no row ends early, but the criteria hold ``EosTokenCriteria`` and each
step's ``is_done`` is kept, as in production); a ``BatchSpanProcessor`` with a discarding
exporter and an SDK ``MeterProvider`` with an ``InMemoryMetricReader`` either way. The default
tiny GPT-2, prompt 4, 128 new tokens, greedy, EOS off, one thread, ``PYTHONHASHSEED=0``.

How: callgrind counts only while collection is on, and ``--toggle-collect=FUNCTION`` flips it on
the outermost entry to and exit from ``FUNCTION`` only: an entry while ``FUNCTION`` is already
running further up the stack flips nothing (so one pair of toggles cannot count a hook that runs
inside the original another hook calls). Two pairs are used:

- the ``GenerationMixin.generate`` hook is entered through ``operator.call`` (C ``_operator_call``:
  on) and calls transformers' ``generate`` through ``itertools.starmap`` (C ``starmap_next``: off
  until it returns);
- the hooks transformers' ``generate`` reaches (``_prepare_generated_length``,
  ``_get_stopping_criteria``, ``_prepare_cache_for_generation``, every step's
  ``RecordingCriteriaList.__call__``, and ``_get_candidate_generator``, which greedy decoding
  does not reach) are entered through ``itertools.filterfalse``
  (C ``filterfalse_next``: on) and call their originals (and ``StoppingCriteriaList.__call__``)
  through ``itertools.dropwhile`` (C ``dropwhile_next``: off).

The step list is counted on the path that calls ``StoppingCriteriaList.__call__`` (through the
off-wrapper), not on the path that runs that call's code in its own frame
(:func:`otel_generate.integrations.step_hook.criteria_call_known`, taken in a real process), whose
tensor work could not be told apart from the hook's: ``callgrind_step_list.py`` counts what the
inline path saves per step, to subtract from this count per step (128 a call).

Nothing else in a ``generate()`` call uses these four, so the count is the hooks' own work: the
request's set-up, every step's recording, the accounting, the derivation and the emission (span
and metrics), with the Python calls into them. The wrappers that switch collection off run partly
while it is on; what they cost is counted once more, around a function that does nothing
(the same wrappers, 1,000 times each), and subtracted per original called. Printed: the raw
count, the wrappers' share and what is left, per call. Not counted: work the instrumentation
causes outside its hooks (``force_flush``'s export on the processor's thread, allocator and
garbage-collector effects on the model's own code), which the difference method of
``otel-generate bench --instructions`` includes, with its run-to-run spread.

After ``callgrind_workload.WARMUP_CALLS`` warm-up calls (20: by then the interpreter has
specialized the once-per-request code), ``gc.collect()`` and ``gc.disable()`` (a collection's cost
would land in whichever code allocates when its threshold is crossed, in or out of the hooks,
differently in every process); then N calls are counted and the count per call printed. The count does not
depend on other processes, nor much on N (no process start or set-up is in it). Needs valgrind
(``callgrind_control``) on Linux.
"""

from __future__ import annotations

import functools
import gc
import json
import operator
import os
import random
import sys
from itertools import accumulate, cycle, dropwhile, filterfalse, starmap

import callgrind_toggled  # noqa: E402  (benchmarks/, the script's own folder)
import callgrind_workload  # noqa: E402

CONFIGS = ("unsampled", "step-spans-off", "sampled", "step-spans-off-eos")
#: the optional third argument: every clock read of the instrumentation reads :func:`steady_clock`
STEADY = "steady"
TOGGLES = (
    "--toggle-collect=_operator_call",
    "--toggle-collect=starmap_next",
    "--toggle-collect=filterfalse_next",
    "--toggle-collect=dropwhile_next",
)
HOOK_FACTORIES = (
    "make_prepare_generated_length",
    "make_get_stopping_criteria",
    "make_get_candidate_generator",
    "make_prepare_cache_for_generation",
)
#: originals called through each kind of off-wrapper during the counted calls
CALLS = {"outer": 0, "inner": 0}
CALIBRATION_CALLS = 1000


def counted(function):
    """``function`` run with collection flipped on (entered through ``_operator_call``)."""

    @functools.wraps(function)  # the hooks read the original's signature through __wrapped__
    def enter(*args, **kwargs):
        return operator.call(function, *args, **kwargs)

    return enter


def not_counted(function):
    """``function`` run with collection flipped off (entered through ``starmap_next``)."""

    @functools.wraps(function)
    def enter(*args, **kwargs):
        CALLS["outer"] += 1
        return next(starmap(lambda: function(*args, **kwargs), [()]))

    return enter


def counted_inner(function):
    """``function``, reached inside a ``not_counted`` original, run with collection flipped on
    (entered through ``filterfalse_next``)."""

    @functools.wraps(function)
    def enter(*args, **kwargs):
        out = []
        next(filterfalse(lambda _: out.append(function(*args, **kwargs)), (0,)))
        return out[0]

    return enter


def not_counted_inner(function):
    """``function`` called from a ``counted_inner`` hook, run with collection flipped off (entered
    through ``dropwhile_next``)."""

    @functools.wraps(function)
    def enter(*args, **kwargs):
        CALLS["inner"] += 1
        out = []
        next(dropwhile(lambda _: out.append(function(*args, **kwargs)), (0,)))
        return out[0]

    return enter


def steady_clock():
    """A monotonic clock that ticks the same in every run: a C iterator (``itertools.accumulate``
    over a cycle of 131 gaps of 0.8 to 1.9 ms, drawn once with seed 0), read in place of
    ``time.perf_counter_ns`` by every clock read of the instrumentation. The gaps are those of the
    tiny GPT-2's decode steps on this machine outside valgrind (0.84 to 1.84 ms, median 1.5 ms): all
    in the first bucket of the latency histograms, as on a GPU, where under valgrind the steps take
    tenths of a second and fall into buckets that change from run to run."""
    rng = random.Random(0)
    gaps = [rng.randrange(800_000, 1_900_000) for _ in range(131)]
    return accumulate(cycle(gaps), initial=10**12).__next__


def child(config: str, n: int, folder: str) -> None:
    if config in ("outer", "inner"):  # calibration: an off-wrapper around nothing, entered as in a hook
        if config == "outer":
            wrapped = counted(not_counted(lambda: None))
        else:
            wrapped = counted_inner(not_counted_inner(lambda: None))
        gc.collect()
        gc.disable()
        callgrind_toggled.counted_stretch(folder, lambda: [wrapped() for _ in range(n)])
        return
    from transformers.generation.stopping_criteria import StoppingCriteriaList

    from otel_generate.integrations import generate_loop, step_hook

    make_generate = generate_loop.make_generate
    generate_loop.make_generate = lambda original, telemetry: counted(make_generate(not_counted(original), telemetry))

    def inner_factory(make):
        return lambda original, telemetry: counted_inner(make(not_counted_inner(original), telemetry))

    for name in HOOK_FACTORIES:  # each hook counted, the original it calls not
        setattr(generate_loop, name, inner_factory(getattr(generate_loop, name)))
    step_hook.RecordingCriteriaList.__call__ = counted_inner(step_hook.RecordingCriteriaList.__call__)
    StoppingCriteriaList.__call__ = not_counted_inner(StoppingCriteriaList.__call__)
    # the list calls StoppingCriteriaList.__call__ (the wrapper above), never runs its code inline,
    # which would count that code as the hook's (see the module docstring): a wrapper is not the known code
    if step_hook.criteria_call_known():
        raise SystemExit("StoppingCriteriaList.__call__ wrapped, yet taken for the known code")

    config, _, clock_kind = config.partition(":")
    if clock_kind == STEADY:
        from otel_generate import clock

        clock.monotonic_ns = steady_clock()
    call = callgrind_workload.calls_for(config)  # (its warm-up calls)
    gc.collect()
    gc.disable()  # a collection would land in whichever code allocates when the threshold is crossed
    CALLS.update(outer=0, inner=0)
    callgrind_toggled.counted_stretch(folder, lambda: [call() for _ in range(n)])
    with open(os.path.join(folder, "calls.json"), "w", encoding="utf-8") as handle:
        json.dump(CALLS, handle)


def main() -> int:
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2], int(sys.argv[3]), sys.argv[4])
        return 0
    if (
        len(sys.argv) not in (3, 4)
        or sys.argv[1] not in CONFIGS
        or not sys.argv[2].isdigit()
        or int(sys.argv[2]) < 1
        or sys.argv[3:] not in ([], [STEADY])
    ):
        raise SystemExit(f"usage: callgrind_own_code.py {{{','.join(CONFIGS)}}} N [{STEADY}] (N >= 1)")
    config, n = sys.argv[1], int(sys.argv[2])
    child_config = f"{config}:{STEADY}" if sys.argv[3:] else config
    each = {}
    for kind in CALLS:  # what one off-wrapper of each kind counts, around nothing
        counted_wrappers = callgrind_toggled.count(__file__, (kind, str(CALIBRATION_CALLS)), TOGGLES)
        each[kind] = None if counted_wrappers is None else counted_wrappers / CALIBRATION_CALLS

    def read(folder: str) -> tuple:
        with open(os.path.join(folder, "calls.json"), encoding="utf-8") as handle:
            return callgrind_toggled.collected(folder), json.load(handle)

    collected, calls = callgrind_toggled.run_stretch(__file__, (child_config, str(n)), TOGGLES, read)
    if collected is None or None in each.values():
        print(config, n, "unknown")
        return 1
    wrappers = sum(each[kind] * calls[kind] for kind in CALLS)
    print(
        f"{child_config}: {(collected - wrappers) / n:,.0f} instructions per call in the instrumentation's own hooks "
        f"({n} calls; counted {collected / n:,.0f}, less {wrappers / n:,.0f} for the off-wrappers: "
        + ", ".join(f"{calls[kind] / n:,.0f} {kind} at {each[kind]:,.0f}" for kind in CALLS)
        + " per call)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
