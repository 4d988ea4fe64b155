"""What each way of timing a step costs on a GPU: ``synchronize="events"`` against ``"wait"`` and
against no instrumentation, paired.

    python benchmarks/gpu_events.py [DEVICE] [ROUNDS] [MODEL_CONFIG.json DTYPE NEW_TOKENS]

Defaults: ``cuda``, 30 rounds, the default tiny GPT-2 (random weights), prompt 4, 128 new tokens.
With ``MODEL_CONFIG.json`` (a transformers config as JSON with its ``model_type``, e.g. the
1.1B-parameter Llama that tests/gpu/run_gpu_checks.sh writes): that model with random weights in
``DTYPE`` (``bfloat16``, ``float32``), prompt 128, ``NEW_TOKENS`` new tokens. Greedy, EOS off.

``ROUNDS`` interleaved rounds (the order rotated each round) of these arms, each one
``generate()`` timed between two device synchronizations:

- ``plain``: not instrumented;
- ``wait``: instrumented, ``synchronize=True`` (the default), ``measure_energy=False``;
- ``events``: instrumented, ``synchronize="events"``, ``measure_energy=False``;
- ``events+energy``: ``synchronize="events"`` with NVML's energy readings (when NVML is there:
  one wait before the start reading, none per step).

Each instrumented run is between ``instrument()`` and ``uninstrument()`` (outside its timer), with
an SDK ``TracerProvider`` (``BatchSpanProcessor``, a discarding exporter) and an SDK
``MeterProvider``, both flushed after the run, outside its timer. Printed: each arm's median and
IQR (milliseconds), each instrumented arm against ``plain`` as a median paired ratio and per step
(microseconds), and ``events`` against ``wait`` per step. On CPU the events mode falls back to
today's (it says so once): the script then only checks itself. Results: BENCHMARKS.md.
"""

# ruff: noqa: E402  (the imports after the --help check: torch's takes seconds, the help none)
from __future__ import annotations

import sys

USAGE = "usage: gpu_events.py [DEVICE] [ROUNDS >= 4] [MODEL_CONFIG.json DTYPE NEW_TOKENS]"

if __name__ == "__main__" and sys.argv[1:] in (["-h"], ["--help"]):
    print(USAGE + "\n\n" + __doc__)
    sys.exit(0)

import gc
import json
import statistics

import torch
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from otel_generate import GenerateInstrumentor, clock
from otel_generate.bench.exporters import make_exporters
from otel_generate.bench.models import build_model, dtype_keyword

ARMS = ("plain", "wait", "events", "events+energy")
OPTIONS = {
    "wait": dict(synchronize=True, measure_energy=False),
    "events": dict(synchronize="events", measure_energy=False),
    "events+energy": dict(synchronize="events", measure_energy=True),
}


def load(device: str, config_path: str, dtype: str):
    import transformers

    with open(config_path) as handle:
        data = json.load(handle)
    config = transformers.AutoConfig.for_model(data.pop("model_type"), **data)
    torch.manual_seed(0)
    kind = getattr(torch, dtype)
    with torch.device(device):  # initialised where it runs
        model = transformers.AutoModelForCausalLM.from_config(config, **{dtype_keyword(): kind})
    return model.to(device=device, dtype=kind).eval()


def main() -> int:
    args = sys.argv[1:]
    if len(args) not in (0, 1, 2, 5):
        raise SystemExit(USAGE)
    device = args[0] if args else "cuda"
    try:
        rounds = int(args[1]) if len(args) > 1 else 30
        new_tokens = int(args[4]) if len(args) == 5 else 128
    except ValueError:
        raise SystemExit(USAGE) from None
    if rounds < 4:
        raise SystemExit(USAGE)
    cuda = device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        raise SystemExit("CUDA is not available; pass cpu to check the script")
    synchronize = clock.synchronizer_for([torch.device(device)])  # None on CPU
    if len(args) == 5:
        model = load(device, args[2], args[3])
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(3, model.config.vocab_size, (1, 128), generator=generator).to(device)
        name = f"{type(model).__name__} {sum(p.numel() for p in model.parameters()) / 1e9:.3f}B {args[3]}"
    else:
        model = build_model("gpt2").to(device)
        ids = torch.tensor([[5, 6, 7, 8]], device=device)
        name = "tiny GPT-2"
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    exporter, reader = make_exporters("discard")
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(BatchSpanProcessor(exporter))
    meter_provider = MeterProvider(metric_readers=[reader])

    def run(arm: str) -> float:
        instrumentor = None
        if arm != "plain":
            instrumentor = GenerateInstrumentor()
            instrumentor.instrument(tracer_provider=tracer_provider, meter_provider=meter_provider, **OPTIONS[arm])
        try:
            out, elapsed = clock.timed_call(
                lambda: model.generate(
                    **inputs, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
                ),
                synchronize,
            )
        finally:
            if instrumentor is not None:
                instrumentor.uninstrument()
                tracer_provider.force_flush()
                meter_provider.force_flush()
        if out.shape[-1] != ids.shape[-1] + new_tokens:
            raise SystemExit(f"{arm}: {out.shape[-1] - ids.shape[-1]} new tokens, expected {new_tokens}")
        return elapsed

    for arm in ARMS * 2:  # warm-up
        run(arm)
    times = {arm: [] for arm in ARMS}
    gc.collect()
    gc.disable()
    try:
        for r in range(rounds):
            shift = r % len(ARMS)
            for arm in ARMS[shift:] + ARMS[:shift]:
                times[arm].append(run(arm))
    finally:
        gc.enable()

    where = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"device {device} ({where}), model {name}, {rounds} rounds, {new_tokens} new tokens")
    for arm in ARMS:
        q = statistics.quantiles(times[arm], n=4)
        median = statistics.median(times[arm])
        print(f"  {arm:<14} median {median * 1e3:9.3f} ms  IQR {q[0] * 1e3:9.3f} to {q[2] * 1e3:9.3f} ms")

    def paired(a: str, b: str) -> None:
        ratios = [x / y for x, y in zip(times[a], times[b])]
        per_step = [(x - y) / new_tokens * 1e6 for x, y in zip(times[a], times[b])]
        q, qs = statistics.quantiles(ratios, n=4), statistics.quantiles(per_step, n=4)
        print(
            f"  {a} / {b}, paired: median ratio {statistics.median(ratios):.4f} (IQR {q[0]:.4f} to {q[2]:.4f}); "
            f"per step {statistics.median(per_step):+.1f} us (IQR {qs[0]:+.1f} to {qs[2]:+.1f})"
        )

    for arm in ARMS[1:]:
        paired(arm, "plain")
    paired("events", "wait")
    return 0


if __name__ == "__main__":
    sys.exit(main())
