"""Instructions of each ``generate()`` call, one callgrind dump per call, in one process.

    python benchmarks/callgrind_each_call.py CONFIG N [--delay-ms MS]

CONFIG is ``plain`` (no SDK, not instrumented), ``plain-sdk`` (the SDK providers set up, not
instrumented), ``unsampled`` (``ParentBased(ALWAYS_OFF)``), ``step-spans-off`` (``ALWAYS_ON``,
``max_step_spans=0``) or ``sampled`` (``ALWAYS_ON``, every step a span). The providers are those
of ``otel-generate bench --instructions`` (an SDK ``TracerProvider`` + ``BatchSpanProcessor`` with
a discarding exporter, an SDK ``MeterProvider`` + ``InMemoryMetricReader``); the processor's
``schedule_delay_millis`` is ``--delay-ms`` (default: the bench's one day; 5000 is the SDK's
default). The workload is the bench's default (tiny GPT-2, prompt 4, 128 new tokens, greedy, EOS
off, one thread, ``PYTHONHASHSEED=0``).

The script starts itself under ``valgrind --tool=callgrind --dump-before=getloadavg``; the child
sets up, makes one warm-up call, collects garbage, then makes N calls with ``os.getloadavg()``
after each, so each call lands in a dump of its own. It prints each call's instructions (all
threads) and the garbage collections (per generation) each call triggered: where the difference
method of the bench gives one figure per configuration, this shows the spread and drift from one
call to the next. Needs valgrind on Linux.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile

from otel_generate.bench import instructions

CONFIGS = ("plain", "plain-sdk", "unsampled", "step-spans-off", "sampled")


def child(config: str, n: int, delay_ms: int) -> None:
    import torch
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased

    from otel_generate import GenerateInstrumentor
    from otel_generate.bench.config import BenchConfig
    from otel_generate.bench.exporters import make_exporters
    from otel_generate.bench.workload import Runner

    torch.set_num_threads(1)
    runner = Runner(BenchConfig(new_tokens=128, instructions=True), "cpu")
    if config != "plain":
        exporter, reader = make_exporters("discard")
        tracer_provider = TracerProvider(sampler=ParentBased(ALWAYS_OFF)) if config == "unsampled" else TracerProvider()
        tracer_provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=delay_ms))
        meter_provider = MeterProvider(metric_readers=[reader])
        if config != "plain-sdk":
            options = {"max_step_spans": 0} if config == "step-spans-off" else {}
            GenerateInstrumentor().instrument(
                tracer_provider=tracer_provider, meter_provider=meter_provider, skip_dep_check=True, **options
            )
    runner.generate()
    gc.collect()
    collections = []
    os.getloadavg()  # the border: what came before is the first dump
    for _ in range(n):
        before = [entry["collections"] for entry in gc.get_stats()]
        runner.generate()
        after = [entry["collections"] for entry in gc.get_stats()]
        os.getloadavg()
        collections.append([b - a for a, b in zip(before, after)])
    print(json.dumps(collections))


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", choices=CONFIGS)
    parser.add_argument("n", type=int)
    parser.add_argument("--delay-ms", type=int, default=86_400_000)
    args = parser.parse_args()
    if args.n < 1:
        parser.error("N must be at least 1")
    env = dict(os.environ, **instructions.SINGLE_THREAD_ENV, **instructions.HASH_SEED_ENV)
    with tempfile.TemporaryDirectory() as folder:
        prefix = os.path.join(folder, "callgrind.out")
        done = subprocess.run(
            [
                "valgrind",
                "--tool=callgrind",
                "--dump-before=getloadavg",
                f"--callgrind-out-file={prefix}",
                f"--log-file={os.path.join(folder, 'valgrind.log')}",
                sys.executable,
                os.path.abspath(__file__),
                "--child",
                args.config,
                str(args.n),
                str(args.delay_ms),
            ],
            env=env,
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            sys.stderr.write(done.stderr)
            return done.returncode
        collections = json.loads(done.stdout.strip().splitlines()[-1])
        counts = instructions.read_dumps(prefix)
    # dump 1: start, imports, set-up, warm-up; dump k + 1: call k
    for call in range(1, args.n + 1):
        print(f"{args.config} call {call}: {counts[call + 1]:,} instructions, collections {collections[call - 1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
