"""How much of the instrumentation's per-step cost on a GPU is the device synchronization.

    python benchmarks/gpu_sync_split.py [DEVICE] [ROUNDS]      # defaults: cuda 40

The default tiny GPT-2 (random weights), prompt 4, 128 new tokens, greedy, EOS off. ``ROUNDS``
interleaved rounds (the order rotated each round) of three arms, each one ``generate()`` timed
between two device synchronizations:

- ``plain``: not instrumented;
- ``sync on``: instrumented with ``synchronize=True`` (the default);
- ``sync off``: instrumented with ``synchronize=False``.

Each instrumented run is between ``instrument()`` and ``uninstrument()`` (outside its timer), with
an SDK ``TracerProvider`` (``BatchSpanProcessor``, a discarding exporter) and an SDK
``MeterProvider``, both flushed after the run, outside its timer. Printed: each arm's median and
IQR (milliseconds), each instrumented arm minus ``plain`` per step, paired within a round
(microseconds), ``sync on`` minus ``sync off`` the same way, and, on CUDA, the synchronize call
alone on an idle device (20 x 1,000 calls). Results: BENCHMARKS.md, "GPU check".
"""

# ruff: noqa: E402  (the imports after the --help check: torch's takes seconds, the help none)
from __future__ import annotations

import sys

USAGE = "usage: gpu_sync_split.py [DEVICE] [ROUNDS >= 4]"

if __name__ == "__main__" and sys.argv[1:2] in (["-h"], ["--help"]):
    print(f"{USAGE}\n\n{__doc__}")
    sys.exit(0)

import gc
import statistics
import time

import torch
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from otel_generate import GenerateInstrumentor, clock
from otel_generate.bench.exporters import make_exporters
from otel_generate.bench.models import build_model

NEW_TOKENS = 128
ARMS = ("plain", "sync on", "sync off")


def main() -> int:
    if len(sys.argv) > 3:
        raise SystemExit(USAGE)
    device = sys.argv[1] if len(sys.argv) > 1 else "cuda"
    try:
        rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 40
    except ValueError:
        raise SystemExit(f"{USAGE}: ROUNDS {sys.argv[2]!r} is not an integer") from None
    if rounds < 4:
        raise SystemExit(USAGE)
    cuda = device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        raise SystemExit("CUDA is not available; pass cpu to check the script")
    synchronize = clock.synchronizer_for([torch.device(device)])  # None on CPU
    model = build_model("gpt2").to(device)
    ids = torch.tensor([[5, 6, 7, 8]], device=device)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    exporter, reader = make_exporters("discard")
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(BatchSpanProcessor(exporter))
    meter_provider = MeterProvider(metric_readers=[reader])

    def run(arm: str) -> float:
        instrumentor = None
        if arm != "plain":
            instrumentor = GenerateInstrumentor()
            instrumentor.instrument(
                tracer_provider=tracer_provider, meter_provider=meter_provider, synchronize=arm == "sync on"
            )
        try:
            out, elapsed = clock.timed_call(
                lambda: model.generate(
                    **inputs, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0
                ),
                synchronize,
            )
        finally:
            if instrumentor is not None:
                instrumentor.uninstrument()
                tracer_provider.force_flush()
                meter_provider.force_flush()
        if out.shape[-1] != ids.shape[-1] + NEW_TOKENS:
            raise SystemExit(f"{arm}: {out.shape[-1] - ids.shape[-1]} new tokens, expected {NEW_TOKENS}")
        return elapsed

    for arm in ARMS * 3:  # warm-up
        run(arm)
    times = {arm: [] for arm in ARMS}
    gc.collect()
    gc.disable()
    try:
        for r in range(rounds):
            for arm in ARMS[r % 3 :] + ARMS[: r % 3]:
                times[arm].append(run(arm))
    finally:
        gc.enable()

    name = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"device {device} ({name}), {rounds} rounds, {NEW_TOKENS} new tokens")
    # (quartiles by statistics.quantiles' default method, as in the recorded runs; the bench's own
    # tables use otel_generate.bench.stats.iqr_of, which interpolates otherwise)
    for arm in ARMS:
        q = statistics.quantiles(times[arm], n=4)
        median = statistics.median(times[arm])
        print(f"  {arm:<9} median {median * 1e3:8.3f} ms  IQR {q[0] * 1e3:8.3f} to {q[2] * 1e3:8.3f} ms")

    def paired(label: str, a: str, b: str) -> None:
        per_step = [(x - y) / NEW_TOKENS * 1e6 for x, y in zip(times[a], times[b])]
        q = statistics.quantiles(per_step, n=4)
        print(
            f"  {label}, per step, paired: median {statistics.median(per_step):+.1f} us "
            f"(IQR {q[0]:+.1f} to {q[2]:+.1f})"
        )

    paired("sync on - plain", "sync on", "plain")
    paired("sync off - plain", "sync off", "plain")
    paired("sync on - sync off", "sync on", "sync off")
    if cuda:
        for label, fn in (
            ("torch.cuda.synchronize() on an idle device", torch.cuda.synchronize),
            ("the instrumentation's synchronize (clock.synchronizer_for)", synchronize),
            ("torch._C._cuda_synchronize()", torch._C._cuda_synchronize),
        ):
            for _ in range(1000):
                fn()
            samples = []
            for _ in range(20):
                start = time.perf_counter()
                for _ in range(1000):
                    fn()
                samples.append((time.perf_counter() - start) / 1000 * 1e6)
            print(f"  {label}: median {statistics.median(samples):.2f} us a call (20 x 1000)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
