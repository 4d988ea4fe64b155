"""Instructions per ``generate()`` call, counted by valgrind's callgrind around the measured calls only.

    python benchmarks/callgrind_per_call.py CONFIG N

CONFIG is ``plain`` (not instrumented), ``sampled`` or ``unsampled`` (``TracerProvider`` with
``ALWAYS_ON`` / ``ALWAYS_OFF``; a ``BatchSpanProcessor`` with a discarding exporter and an SDK
``MeterProvider`` with an ``InMemoryMetricReader`` either way), or ``plain-eos``: ``plain`` with
the model's EOS id (``callgrind_workload.tiny_gpt2_calls``' ``eos``). The default tiny GPT-2,
prompt 4, 128 new tokens, greedy, EOS off, one thread. The script starts itself under
``valgrind --tool=callgrind --instr-atstart=no`` (imports and set-up run uninstrumented, fast),
waits for ``callgrind_workload.WARMUP_CALLS`` warm-up calls, turns instrumentation on with
``callgrind_control -i on``, lets the child make N calls (each followed by
``tracer_provider.force_flush()``, so the span export it causes is counted), turns it off and
prints ``CONFIG N instructions``. Per call: run N=2 and N=6 and take (Ir(6) - Ir(2)) / 4. Needs
valgrind (``callgrind_control``) on Linux.
"""

from __future__ import annotations

import sys

import callgrind_toggled  # noqa: E402  (benchmarks/, the script's own folder)
import callgrind_workload  # noqa: E402


def child(config: str, n: int, folder: str) -> None:
    call = callgrind_workload.calls_for(config)  # (its warm-up calls)
    callgrind_toggled.counted_stretch(folder, lambda: [call() for _ in range(n)])


def main() -> int:
    if sys.argv[1] == "--child":
        child(sys.argv[2], int(sys.argv[3]), sys.argv[4])
        return 0
    config, n = sys.argv[1], int(sys.argv[2])
    if config not in ("plain", "plain-eos", "sampled", "unsampled"):
        raise SystemExit("CONFIG must be plain, plain-eos, sampled or unsampled")
    collected = callgrind_toggled.count(__file__, (config, str(n)))
    print(config, n, collected if collected is not None else "unknown")
    return 0


if __name__ == "__main__":
    sys.exit(main())
