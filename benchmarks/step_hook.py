"""Microbenchmark of the per-step hook: what the instrumentation adds to each decode step.

transformers calls ``stopping_criteria(input_ids, scores)`` once per decoding iteration; the
instrumentation replaces that ``StoppingCriteriaList`` by a
:class:`otel_generate.integrations.step_hook.RecordingCriteriaList` holding the same criteria, which hands
``input_ids`` and the ``is_done`` result to a :class:`otel_generate.integrations.step_hook.StepRecorder`.
What that adds to a step, beyond the device synchronization (``synchronize=None`` here, as on
CPU), is the difference between calling the two lists: the extra Python call and the
recorder's own work (a clock read, three list appends: time, length and the ``is_done`` tensor
kept for exact per-row token counts).

The two lists are called on the same realistic ``input_ids`` (``(batch, prompt + new_tokens)``
LongTensor) and ``scores`` (``(batch, vocab)`` float tensor), ``--calls`` times in a row per
repeat (a fresh recorder each repeat, as each ``generate()`` gets one), A then B in every
repeat, garbage collection off while timing (as ``timeit`` does). Reported: microseconds per
call, median over ``--repeats``, and the median of the paired differences (with - without),
which is the hook's cost per step.

    python benchmarks/step_hook.py                        # JSON on stdout, summary on stderr
    python benchmarks/step_hook.py --output hook.json --repeats 500 --calls 1000

Variants: ``eos_off`` (``[MaxLengthCriteria]``, what ``otel-generate bench`` runs: EOS disabled)
and ``eos_on`` (``[MaxLengthCriteria, EosTokenCriteria]``, transformers' default with an EOS id).
"""

# ruff: noqa: E402  (the imports after the --help check: torch's takes seconds, the help none)
from __future__ import annotations

import argparse
import sys


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Microbenchmark of the instrumentation's per-step hook.")
    parser.add_argument("--repeats", type=int, default=200, help="timed repeats per variant (default 200)")
    parser.add_argument("--calls", type=int, default=1000, help="calls (decode steps) per repeat (default 1000)")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--prompt-tokens", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=128, help="sets the input_ids width with --prompt-tokens")
    parser.add_argument("--vocab", type=int, default=128, help="width of scores (default 128, the tiny models')")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    parser.add_argument("--output", default="-", help="JSON destination ('-' = stdout, the default)")
    return parser


if __name__ == "__main__" and {"-h", "--help"} & set(sys.argv[1:]):
    _parser().parse_args()  # prints the help and exits

import gc
import json
import statistics
import time
from typing import Any, Dict, List, Optional, Sequence

import torch
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, StoppingCriteriaList

from otel_generate import clock
from otel_generate.bench.environment import machine, versions
from otel_generate.integrations.step_hook import RecordingCriteriaList, StepRecorder

TARGET_US = 5.0


def _faults(kind: str, exc: BaseException) -> None:  # a fault would make the numbers meaningless
    raise RuntimeError(f"the step recorder faulted during the benchmark ({kind}): {exc!r}") from exc


def _time_calls(fn: Any, args: tuple, calls: int) -> float:
    """Microseconds per call of ``fn(*args)`` over ``calls`` back-to-back calls."""
    perf = time.perf_counter_ns
    start = perf()
    for _ in range(calls):
        fn(*args)
    return (perf() - start) / calls / 1e3


def _recorder(prompt_length: int) -> StepRecorder:
    # keep_done: the heaviest variant (greedy/sample keep each step's is_done for exact counts)
    return StepRecorder(None, clock.monotonic_ns, clock.monotonic_ns(), prompt_length, _faults, keep_done=True)


def bench_variant(
    base: Sequence[Any], input_ids: torch.Tensor, scores: torch.Tensor, prompt_length: int, repeats: int, calls: int
) -> Dict[str, Any]:
    """Time ``StoppingCriteriaList(base)`` vs ``RecordingCriteriaList(base, StepRecorder)``.

    The latter is what the instrumentation puts in ``generate()`` in place of the former.
    Returns per-repeat microseconds per call for: ``without`` the recorder, ``with`` it, and
    ``recorder_alone`` (a direct ``StepRecorder.__call__``), their medians, and ``hook_us`` =
    the median of the paired differences (with - without).
    """
    without_list = StoppingCriteriaList(list(base))
    is_done = torch.zeros(input_ids.shape[0], dtype=torch.bool)
    without: List[float] = []
    with_: List[float] = []
    alone: List[float] = []
    recorded_calls = 0
    for _ in range(repeats):
        recorder = _recorder(prompt_length)
        with_list = RecordingCriteriaList(list(base), recorder)
        direct = _recorder(prompt_length)
        without.append(_time_calls(without_list, (input_ids, scores), calls))
        with_.append(_time_calls(with_list, (input_ids, scores), calls))
        alone.append(_time_calls(direct, (input_ids, is_done), calls))
        recorded_calls += len(recorder.times_ns)
        if recorder.fault is not None or direct.fault is not None or len(recorder.lengths) != calls:
            raise RuntimeError("the step recorder did not record every call")
    differences = [b - a for a, b in zip(without, with_)]
    return {
        "without_us": without,
        "with_us": with_,
        "recorder_alone_us": alone,
        "median_without_us": statistics.median(without),
        "median_with_us": statistics.median(with_),
        "median_recorder_alone_us": statistics.median(alone),
        "paired_difference_us": differences,
        "hook_us": statistics.median(differences),
        "recorded_calls": recorded_calls,
    }


def run(
    repeats: int = 200,
    calls: int = 1000,
    batch_size: int = 1,
    prompt_tokens: int = 4,
    new_tokens: int = 128,
    vocab: int = 128,
    threads: int = 1,
    seed: int = 0,
) -> Dict[str, Any]:
    """Run both variants; return the JSON document (see the module docstring).

    Raises:
        ValueError: a count below 1.
    """
    for name, value in (
        ("repeats", repeats),
        ("calls", calls),
        ("batch_size", batch_size),
        ("prompt_tokens", prompt_tokens),
        ("new_tokens", new_tokens),
        ("vocab", vocab),
        ("threads", threads),
    ):
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    generator = torch.Generator().manual_seed(seed)
    length = prompt_tokens + new_tokens
    input_ids = torch.randint(1, vocab - 1, (batch_size, length), generator=generator)
    scores = torch.randn(batch_size, vocab, generator=generator)
    max_length = length + 1  # never done: the steady state of a long generation
    eos = torch.tensor([vocab - 1])
    variants = {
        "eos_off": [MaxLengthCriteria(max_length=max_length)],
        "eos_on": [MaxLengthCriteria(max_length=max_length), EosTokenCriteria(eos_token_id=eos)],
    }
    gc_was_enabled = gc.isenabled()
    try:
        # warm the dispatcher and caches once, untimed
        for base in variants.values():
            bench_variant(base, input_ids, scores, prompt_tokens, 3, min(calls, 100))
        gc.disable()
        results = {
            name: bench_variant(base, input_ids, scores, prompt_tokens, repeats, calls)
            for name, base in variants.items()
        }
    finally:
        if gc_was_enabled:
            gc.enable()
        torch.set_num_threads(previous_threads)
    return {
        "benchmark": "step hook: StoppingCriteriaList vs RecordingCriteriaList with a StepRecorder (synchronize=None)",
        "unit": "microseconds per call (one call = one decode step)",
        "target_us": TARGET_US,
        "versions": versions(),
        "machine": machine("cpu"),
        "threads": threads,
        "repeats": repeats,
        "calls_per_repeat": calls,
        "input_ids_shape": list(input_ids.shape),
        "scores_shape": list(scores.shape),
        "variants": results,
        "hook_us": {name: r["hook_us"] for name, r in results.items()},
        "within_target": all(r["hook_us"] <= TARGET_US for r in results.values()),
    }


def summary(result: Dict[str, Any]) -> str:
    lines = [
        f"step hook microbenchmark: input_ids {tuple(result['input_ids_shape'])}, {result['threads']} thread(s), "
        f"{result['repeats']} repeats x {result['calls_per_repeat']} calls, medians in microseconds per step",
    ]
    for name, r in result["variants"].items():
        lines.append(
            f"  {name:8s} criteria without hook {r['median_without_us']:.3f}, with hook {r['median_with_us']:.3f}, "
            f"hook cost (median paired difference) {r['hook_us']:.3f} "
            f"[recorder call alone {r['median_recorder_alone_us']:.3f}]"
        )
    lines.append(f"  target <= {result['target_us']} us per step: {'met' if result['within_target'] else 'MISSED'}")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        result = run(
            args.repeats, args.calls, args.batch_size, args.prompt_tokens, args.new_tokens, args.vocab, args.threads
        )
    except ValueError as exc:
        parser.error(str(exc))
    text = json.dumps(result, indent=2)
    if args.output == "-":
        print(text)
    else:
        with open(args.output, "w", encoding="utf-8") as handle:
            handle.write(text + "\n")
    print(summary(result), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
