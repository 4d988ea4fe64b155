"""Instructions the per-step hook adds to transformers' stopping-criteria call, counted by callgrind.

    python benchmarks/callgrind_step_list.py [CALLS]

Counts, per call, three lists holding the same ``[MaxLengthCriteria]`` (what greedy decoding with
EOS off holds) on a ``(1, 10)`` LongTensor, ``CALLS`` calls (default 1,024) inside one
``operator.call`` (``--collect-atstart=no --toggle-collect=_operator_call``: only those calls are
counted, after 1,024 uncounted ones):

- ``plain``: transformers' ``StoppingCriteriaList``;
- ``call``: a :class:`~otel_generate.integrations.step_hook.RecordingCriteriaList` on its plain
  path (lengths implied, as in transformers' own greedy loop) that calls
  ``StoppingCriteriaList.__call__`` (what it does where the installed code is not the code it
  knows, and what ``callgrind_own_code.py`` counts: its counting wrapper around that call makes
  the code unknown);
- ``inline``: the same list running that call's code in its own frame
  (:func:`~otel_generate.integrations.step_hook.criteria_call_known`).

Each list runs in a valgrind process of its own, started the same way. Prints each count per call
and what ``call`` and ``inline`` add over ``plain``; the difference of the two is what the inline
path saves on every step, which ``callgrind_own_code.py``'s count does not see. Needs valgrind on
Linux.
"""

from __future__ import annotations

import operator
import os
import re
import subprocess
import sys

VARIANTS = ("plain", "call", "inline")


def child(variant: str, calls: int) -> None:
    import time

    import torch
    from transformers.generation.stopping_criteria import MaxLengthCriteria, StoppingCriteriaList

    from otel_generate.integrations import step_hook

    ids = torch.zeros((1, 10), dtype=torch.long)
    criteria = [MaxLengthCriteria(max_length=1 << 30)]
    recorder = step_hook.StepRecorder(None, time.perf_counter_ns, 0, 10, lambda *a: None, one_token_steps=True)
    recording = step_hook.RecordingCriteriaList(criteria, recorder)
    if not step_hook.criteria_call_known():
        raise SystemExit("the installed StoppingCriteriaList.__call__ is not the code the inline path repeats")
    if variant == "call":
        recording._inline = None
    target = StoppingCriteriaList(criteria) if variant == "plain" else recording

    def run() -> None:
        for _ in range(calls):
            target(ids, None)

    run()
    recorder.times_ns.clear()
    operator.call(run)
    if variant != "plain" and len(recorder.times_ns) != calls:
        raise SystemExit(f"{variant}: {len(recorder.times_ns)} steps recorded, {calls} expected")


def count(variant: str, calls: int) -> int:
    """Run :func:`child` under callgrind; the instructions counted inside ``operator.call``."""
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", PYTHONHASHSEED="0")
    done = subprocess.run(
        [
            "valgrind",
            "--tool=callgrind",
            "--collect-atstart=no",
            "--toggle-collect=_operator_call",
            "--callgrind-out-file=/dev/null",
            sys.executable,
            os.path.abspath(__file__),
            "--child",
            variant,
            str(calls),
        ],
        env=env,
        capture_output=True,
        text=True,
    )
    found = re.search(r"Collected : (\d+)", done.stderr)
    if done.returncode != 0 or found is None:
        raise SystemExit(f"{variant}: valgrind exited {done.returncode}\n{done.stderr[-2000:]}{done.stdout[-2000:]}")
    return int(found.group(1))


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], int(sys.argv[3]))
        return 0
    calls = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
    if calls < 1:
        raise SystemExit("CALLS must be at least 1")
    per_call = {variant: count(variant, calls) / calls for variant in VARIANTS}
    plain = per_call["plain"]
    for variant in VARIANTS:
        added = "" if variant == "plain" else f"  (+{per_call[variant] - plain:,.1f} over plain)"
        print(f"{variant:7s} {per_call[variant]:12,.1f} instructions per call{added}")
    print(f"the inline path saves {per_call['call'] - per_call['inline']:,.1f} instructions per step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
