"""Instructions the instrumentation's own code runs per ``generate()`` call, the originals it calls left out.

    python benchmarks/callgrind_own_code.py CONFIG N

CONFIG is ``unsampled`` (``ALWAYS_OFF``), ``step-spans-off`` (``ALWAYS_ON``, ``max_step_spans=0``)
or ``sampled`` (``ALWAYS_ON``, every step a span); a ``BatchSpanProcessor`` with a discarding
exporter and an SDK ``MeterProvider`` with an ``InMemoryMetricReader`` either way. The default
tiny GPT-2, prompt 4, 128 new tokens, greedy, EOS off, one thread, ``PYTHONHASHSEED=0``.

How: callgrind counts only while collection is on, and ``--toggle-collect=FUNCTION`` flips it on
every entry to and exit from ``FUNCTION``. Each hook the instrumentor installs on
``GenerationMixin`` (``generate``, ``_prepare_generated_length``, ``_get_stopping_criteria``,
``_get_candidate_generator``, ``_prepare_cache_for_generation``) and the per-step
``RecordingCriteriaList.__call__`` is entered through ``operator.call`` (C ``_operator_call``:
on), and the original each one calls is entered through ``itertools.starmap`` (C
``starmap_next``: off again until it returns). Nothing else in a ``generate()`` call uses either,
so the count is the hooks' own work: the request's set-up, every step's recording, the accounting,
the derivation and the emission (span and metrics), with the Python calls into them. Not counted:
work the instrumentation causes outside its hooks (``force_flush``'s export on the processor's
thread, allocator and garbage-collector effects on the model's own code), which the difference
method of ``otel-generate bench --instructions`` includes, with its run-to-run spread.

After 3 warm-up calls, ``gc.collect()`` and ``gc.disable()`` (a collection's cost would land in
whichever code allocates when its threshold is crossed, in or out of the hooks, differently in
every process); then N calls are counted and the count per call printed. The count does not
depend on other processes, nor much on N (no process start or set-up is in it). Needs valgrind
(``callgrind_control``) on Linux.
"""

from __future__ import annotations

import functools
import gc
import operator
import sys
from itertools import starmap

import callgrind_toggled  # noqa: E402  (benchmarks/, the script's own folder)
import callgrind_workload  # noqa: E402

CONFIGS = ("unsampled", "step-spans-off", "sampled")
HOOK_FACTORIES = (
    "make_generate",
    "make_prepare_generated_length",
    "make_get_stopping_criteria",
    "make_get_candidate_generator",
    "make_prepare_cache_for_generation",
)


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
        return next(starmap(lambda: function(*args, **kwargs), [()]))

    return enter


def child(config: str, n: int, folder: str) -> None:
    from transformers.generation.stopping_criteria import StoppingCriteriaList

    from otel_generate.integrations import generate_loop, step_hook

    def counting_factory(make):
        def factory(original, telemetry):
            return counted(make(not_counted(original), telemetry))

        return factory

    for name in HOOK_FACTORIES:  # each hook counted, the original it calls not
        setattr(generate_loop, name, counting_factory(getattr(generate_loop, name)))
    step_hook.RecordingCriteriaList.__call__ = counted(step_hook.RecordingCriteriaList.__call__)
    StoppingCriteriaList.__call__ = not_counted(StoppingCriteriaList.__call__)

    options = {"max_step_spans": 0} if config == "step-spans-off" else {}
    call = callgrind_workload.tiny_gpt2_calls(config != "unsampled", options)  # (3 warm-up calls)
    gc.collect()
    gc.disable()  # a collection would land in whichever code allocates when the threshold is crossed
    callgrind_toggled.counted_stretch(folder, lambda: [call() for _ in range(n)])


def main() -> int:
    if sys.argv[1] == "--child":
        child(sys.argv[2], int(sys.argv[3]), sys.argv[4])
        return 0
    config, n = sys.argv[1], int(sys.argv[2])
    if config not in CONFIGS or n < 1:
        raise SystemExit(f"usage: callgrind_own_code.py {{{','.join(CONFIGS)}}} N (N >= 1)")
    toggles = ("--toggle-collect=_operator_call", "--toggle-collect=starmap_next")
    collected = callgrind_toggled.count(__file__, (config, str(n)), toggles)
    if collected is None:
        print(config, n, "unknown")
        return 1
    print(f"{config}: {collected / n:,.0f} instructions per call in the instrumentation's own hooks ({n} calls)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
