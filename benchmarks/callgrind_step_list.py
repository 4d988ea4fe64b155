"""Instructions the per-step hook adds to transformers' stopping-criteria call, counted by callgrind.

    python benchmarks/callgrind_step_list.py [CALLS] [--eos]

Counts, per call, four lists holding the same ``[MaxLengthCriteria]`` (what greedy decoding with
EOS off holds; with ``--eos``, ``[MaxLengthCriteria, EosTokenCriteria]``, what it holds with an
EOS, and the recorder keeps each step's ``is_done``) on a ``(1, 10)`` LongTensor, ``CALLS`` calls
(default 1,024) inside one ``operator.call`` each (``--collect-atstart=no
--toggle-collect=_operator_call --dump-after=_operator_call``: only those calls are counted, one
dump each, after as many uncounted ones):

- ``plain``: transformers' ``StoppingCriteriaList``;
- ``recorder``: a :class:`~otel_generate.integrations.step_hook.RecordingCriteriaList` that calls
  ``StoppingCriteriaList.__call__`` and then its :class:`~otel_generate.integrations.step_hook.StepRecorder`
  (the path where a step waits for a device or calls a callback; with an EOS, every step's path
  before commit the ``--eos`` option came with);
- ``call``: a :class:`~otel_generate.integrations.step_hook.RecordingCriteriaList` on its plain
  path (lengths implied, as in transformers' own greedy loop) that calls
  ``StoppingCriteriaList.__call__``: what it does where the installed code is not the code it
  knows, and what ``callgrind_own_code.py`` counts (its counting wrapper is not that code);
- ``inline``: the same list running that call's code in its own frame
  (:func:`~otel_generate.integrations.step_hook.criteria_call_known`).

All three run in one valgrind process, in turn, three rounds: separate processes differ by a few
hundred instructions per call with their memory layout (CPython's attribute cache is indexed by
the addresses of names), more than the difference measured. Prints, per round, the plain list's
count per call, what ``call`` and ``inline`` add, and their difference: what the inline path
saves on every step, which ``callgrind_own_code.py``'s count does not see. Needs valgrind on Linux.
"""

from __future__ import annotations

import operator
import os
import sys

import callgrind_toggled  # noqa: E402  (benchmarks/, the script's own folder)

VARIANTS = ("plain", "recorder", "call", "inline")
ROUNDS = 3


def child(calls: int, eos: bool) -> None:
    import time

    import torch
    from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, StoppingCriteriaList

    from otel_generate.integrations import step_hook

    ids = torch.zeros((1, 10), dtype=torch.long)
    criteria = [MaxLengthCriteria(max_length=1 << 30)]
    if eos:  # an EOS id the ids never hold: no row ends
        criteria.append(EosTokenCriteria(eos_token_id=1))
    if not step_hook.criteria_call_known():
        raise SystemExit("the installed StoppingCriteriaList.__call__ is not the code the inline path repeats")

    def target(variant: str):
        if variant == "plain":
            return StoppingCriteriaList(criteria), None
        recorder = step_hook.StepRecorder(
            None, time.perf_counter_ns, 0, 10, lambda *a: None, keep_done=eos, one_token_steps=True
        )
        recording = step_hook.RecordingCriteriaList(criteria, recorder)
        if variant == "recorder":
            recording._inline = recording._plain = None
        elif variant == "call":
            recording._inline = None
        elif recording._inline is None:
            raise SystemExit("the inline path is not taken")
        return recording, recorder

    for _ in range(ROUNDS):
        for variant in VARIANTS:  # one dump each (--dump-after=_operator_call), in this order
            listed, recorder = target(variant)

            def run(listed=listed) -> None:
                for _ in range(calls):
                    listed(ids, None)

            run()  # uncounted warm-up
            if recorder is not None:
                recorder.times_ns.clear()
                recorder.lengths.clear()
                recorder.done.clear()
            operator.call(run)
            if recorder is not None and len(recorder.times_ns) != calls:
                raise SystemExit(f"{variant}: {len(recorder.times_ns)} steps recorded, {calls} expected")
            if recorder is not None and len(recorder.done) != (calls if eos else 0):
                raise SystemExit(f"{variant}: {len(recorder.done)} is_done kept, {calls if eos else 0} expected")


def counts(calls: int, eos: bool) -> list:
    """Run :func:`child` under callgrind; the instructions of each counted stretch, in order."""
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", PYTHONHASHSEED="0")
    child_args = (str(calls), "--eos") if eos else (str(calls),)
    totals = callgrind_toggled.operator_call_totals(__file__, child_args, ("--dump-after=_operator_call",), env)
    found = [total for total in totals if total > 0]
    if len(found) != ROUNDS * len(VARIANTS):
        raise SystemExit(f"{len(found)} counted stretches found, {ROUNDS * len(VARIANTS)} expected")
    return found


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(int(sys.argv[2]), sys.argv[3:4] == ["--eos"])
        return 0
    args = sys.argv[1:]
    eos = "--eos" in args
    rest = [arg for arg in args if arg != "--eos"]
    if len(rest) > 1 or (rest and not rest[0].isdigit()):
        raise SystemExit("usage: callgrind_step_list.py [CALLS] [--eos]")
    calls = int(rest[0]) if rest else 1024
    if calls < 1:
        raise SystemExit("CALLS must be at least 1")
    found = counts(calls, eos)
    per_call = {variant: [] for variant in VARIANTS}
    for index, total in enumerate(found):
        per_call[VARIANTS[index % len(VARIANTS)]].append(total / calls)
    for round_ in range(ROUNDS):
        plain, recorder, call, inline = (per_call[variant][round_] for variant in VARIANTS)
        print(
            f"round {round_ + 1}: plain {plain:,.1f}  recorder +{recorder - plain:,.1f}  call +{call - plain:,.1f}"
            f"  inline +{inline - plain:,.1f}  (the inline path saves {call - inline:,.1f} a step,"
            f" {recorder - inline:,.1f} against the recorder's call)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
