"""Checks that need a CUDA device (marked ``gpu``; skipped where ``torch.cuda.is_available()`` is false).

Run them with ``tests/gpu/run_gpu_checks.sh`` (or ``python -m pytest -m gpu tests/gpu -s``). They
use a random-weight Llama-architecture model of about 1.1B parameters in bfloat16 (the shape of
TinyLlama-1.1B; nothing is downloaded):

* the synchronization really happens per step: ``torch.cuda.synchronize`` is called right before
  every clock read of the instrumentation (the request's start, each step boundary, the end; the
  first of them in the request's set-up), and each step latency the instrumentation reports
  agrees within 5 % with a CUDA-event timing of the same step (events recorded by a user
  stopping criterion, which transformers calls right before the instrumentation's own
  criterion; step 0's start event inside the instrumentation's first synchronize, right before
  it reads the start clock), after instrumented warm-up calls;
* the step latencies add up to the request span's duration within 2 %;
* ``otel-generate bench`` on CUDA synchronizes around every timed call;
* ``synchronize="events"``: the device-time step latencies agree with a reference timed with CUDA
  events and a synchronize per step (events recorded by a user stopping criterion, which
  transformers calls right before the instrumentation's own), within 2 % per step from step 1 on
  and 1 % in sum; without the reference's waits, no ``torch.cuda.synchronize`` at all;
* energy (NVML, the ``energy`` extra; these fail without it): the energy per output token on the
  request span agrees with NVML's counter read around the whole call (after a synchronize on each
  side) within 5 %, at batch 1 and 8, with ``synchronize=True`` and ``"events"``, and under
  ``generate_batch`` (the sum of the requests' shares against the counter around the call).

Each test prints its measurements (``-s`` shows them).
"""

from __future__ import annotations

import gc
import sys

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from otel_generate import TokenLatencyProfiler, clock
from otel_generate import attributes as A
from otel_generate.integrations import loop_state

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

#: A Llama-architecture config of about 1.1B parameters (TinyLlama-1.1B's shape), random weights.
LLAMA_1B_CONFIG = {
    "model_type": "llama",
    "vocab_size": 32000,
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 22,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}

PROMPT_TOKENS = 128
NEW_TOKENS = 32
STEP_TOLERANCE = 0.05  # step latency vs CUDA events, relative
SPAN_TOLERANCE = 0.02  # sum of step latencies vs request span duration, relative
EVENTS_STEP_TOLERANCE = 0.02  # synchronize="events": device step latency vs the synchronized reference, relative
EVENTS_SUM_TOLERANCE = 0.01  # ... their sums (steps 1 on)
ENERGY_TOLERANCE = 0.05  # energy per output token vs NVML around the call, relative


@pytest.fixture(scope="module")
def llama_1b():
    import transformers

    from otel_generate.bench.models import dtype_keyword

    data = dict(LLAMA_1B_CONFIG)
    config = transformers.AutoConfig.for_model(data.pop("model_type"), **data)
    torch.manual_seed(0)
    with torch.device("cuda"):  # initialised on the GPU, in bfloat16
        model = transformers.AutoModelForCausalLM.from_config(config, **{dtype_keyword(): torch.bfloat16})
    model = model.to(device="cuda", dtype=torch.bfloat16).eval()
    print(
        f"\nmodel: LlamaForCausalLM, {sum(p.numel() for p in model.parameters()) / 1e9:.3f}B parameters, "
        f"bfloat16, {torch.cuda.get_device_name()}"
    )
    return model


def prompt(model, batch=1, length=PROMPT_TOKENS, seed=0):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, model.config.vocab_size, (batch, length), generator=generator).to(model.device)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def generate(model, inputs, **kwargs):
    return model.generate(
        **inputs, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0, **kwargs
    )


class CudaEventMarks(StoppingCriteria):
    """Records a CUDA timing event at every step boundary (transformers calls user criteria first)."""

    def __init__(self):
        self.events = []

    def __call__(self, input_ids, scores, **kwargs):
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self.events.append(event)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _running_in(code) -> bool:
    """Whether a frame of ``code`` is on the calling thread's stack."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


def test_step_latencies_agree_with_cuda_events_of_the_same_steps(llama_1b, monkeypatch):
    inputs = prompt(llama_1b)
    order = []  # "sync" and "clock" as the instrumentation did them during the measured call
    first_sync_in_setup = []
    real_synchronize = torch.cuda.synchronize
    real_clock = clock.monotonic_ns
    start = torch.cuda.Event(enable_timing=True)

    def counting_synchronize(*args, **kwargs):
        result = real_synchronize(*args, **kwargs)
        order.append("sync")
        if len(order) == 1:
            # the instrumentation's wait before it reads the request's start clock (only
            # torch.cuda.reset_peak_memory_stats between them): step 0's event starts where its
            # clock reading does (the device is idle, the event fires now)
            first_sync_in_setup.append(_running_in(loop_state.Call.__init__.__code__))
            start.record()
        return result

    def ordered_clock():
        order.append("clock")
        return real_clock()

    marks = CudaEventMarks()
    with TokenLatencyProfiler() as profiler:
        # warm-up, instrumented like the measured call: kernels, allocator, and the instrumentation's
        # first use in the process (1.4 to 2.2 ms of set-up before the start clock, once; BENCHMARKS.md)
        for _ in range(2):
            generate(llama_1b, inputs)
        with monkeypatch.context() as patch:
            patch.setattr(torch.cuda, "synchronize", counting_synchronize)
            patch.setattr(clock, "monotonic_ns", ordered_clock)  # read by the request and its step recorder
            gc.collect()
            gc.disable()
            try:
                real_synchronize()
                out = generate(llama_1b, inputs, stopping_criteria=StoppingCriteriaList([marks]))
                real_synchronize()
            finally:
                gc.enable()
    record = profiler.records[-1]
    assert out.shape[-1] - PROMPT_TOKENS == NEW_TOKENS
    assert record.synchronized and record.device == "cuda:0"
    assert len(record.step_latencies_s) == len(marks.events) == NEW_TOKENS
    # the instrumentation waited for the device at the start, at every step boundary and at the end,
    # each time right before it read the clock: the start, one read per step, the end
    assert first_sync_in_setup == [True]
    assert order.count("clock") >= NEW_TOKENS + 2
    assert all(i > 0 and order[i - 1] == "sync" for i, event in enumerate(order) if event == "clock"), order

    bounds = [start] + marks.events
    event_ms = [a.elapsed_time(b) for a, b in zip(bounds, bounds[1:])]
    host_ms = [s * 1e3 for s in record.step_latencies_s]
    print(f"\n{'step':>4} {'instrumentation ms':>19} {'CUDA events ms':>15} {'difference':>11}")
    bad = []
    for i, (h, e) in enumerate(zip(host_ms, event_ms)):
        rel = (h - e) / e
        print(f"{i:>4} {h:>19.3f} {e:>15.3f} {rel:>+10.2%}")
        if abs(rel) > STEP_TOLERANCE:
            bad.append((i, h, e))
    print(f"sum: instrumentation {sum(host_ms):.3f} ms, CUDA events {sum(event_ms):.3f} ms")
    assert not bad, f"steps off by more than {STEP_TOLERANCE:.0%} from CUDA events: {bad}"


def test_step_latencies_add_up_to_the_request_span(llama_1b, instrumented, span_exporter):
    inputs = prompt(llama_1b)
    generate(llama_1b, inputs)  # warmup
    span_exporter.clear()
    gc.collect()
    out = generate(llama_1b, inputs)
    assert out.shape[-1] - PROMPT_TOKENS == NEW_TOKENS
    spans = span_exporter.get_finished_spans()
    request = next(s for s in spans if s.name.startswith(A.OPERATION_TEXT_COMPLETION + " "))
    steps = [s for s in spans if s.name in (A.STEP_SPAN_PREFILL, A.STEP_SPAN_DECODE)]
    assert request.attributes[A.GENERATE_SYNCHRONIZED] is True
    assert request.attributes[A.GENERATE_DEVICE] == "cuda:0"
    assert len(steps) == NEW_TOKENS
    duration_ms = (request.end_time - request.start_time) / 1e6
    step_sum_ms = sum(s.attributes[A.GENERATE_STEP_LATENCY] for s in steps) * 1e3
    rel = (duration_ms - step_sum_ms) / duration_ms
    print(
        f"\nrequest span {duration_ms:.3f} ms, sum of {len(steps)} step latencies {step_sum_ms:.3f} ms, "
        f"difference {rel:+.2%}"
    )
    assert abs(rel) <= SPAN_TOLERANCE


def test_bench_on_cuda_synchronizes_around_every_timed_call(monkeypatch):
    from otel_generate.bench import runner as bench_runner
    from otel_generate.bench.config import BenchConfig

    calls = []
    real_synchronize = torch.cuda.synchronize
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: (calls.append(a), real_synchronize(*a, **k)))
    result = bench_runner.run(BenchConfig(device="cuda", new_tokens=8, warmup=1, runs=2))
    assert result["device"].startswith("cuda") and result["machine"]["gpu"]
    assert [s["new_tokens"] for s in result["samples"]] == [8, 8]
    # per measured run: 2 by the harness (before and after), and the instrumentation's per step
    assert len(calls) >= 2 * (2 + 8)
    print(
        f"\nbench on {result['machine']['gpu']}: median {result['median_tokens_per_s']:.1f} tokens/s, "
        f"TTFT {result['median_time_to_first_token_ms']:.3f} ms, "
        f"TPOT {result['median_time_per_output_token_ms']:.3f} ms"
    )


# --- synchronize="events" --------------------------------------------------------------------------


class SynchronizedEventMarks(StoppingCriteria):
    """The reference: a CUDA timing event at every step boundary, then a synchronize."""

    def __init__(self):
        self.events = []

    def __call__(self, input_ids, scores, **kwargs):
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        torch.cuda.synchronize()
        self.events.append(event)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _request(span_exporter):
    (request,) = [s for s in span_exporter.get_finished_spans() if s.name.startswith(A.OPERATION_TEXT_COMPLETION)]
    return request


def test_events_mode_device_times_agree_with_events_and_a_synchronize_per_step(
    llama_1b, instrument, tracer_provider, span_exporter, monkeypatch
):
    inputs = prompt(llama_1b)
    instrument(tracer_provider=tracer_provider, synchronize="events", measure_energy=False)
    for _ in range(2):  # warm-up, instrumented like the measured calls
        generate(llama_1b, inputs)
    span_exporter.clear()
    marks = SynchronizedEventMarks()
    gc.collect()
    out = generate(llama_1b, inputs, stopping_criteria=StoppingCriteriaList([marks]))
    assert out.shape[-1] - PROMPT_TOKENS == NEW_TOKENS
    attrs = _request(span_exporter).attributes
    assert attrs[A.GENERATE_CLOCK] == A.CLOCK_DEVICE and attrs[A.GENERATE_SYNCHRONIZED] is True
    device_ms = [s * 1e3 for s in attrs[A.GENERATE_STEP_LATENCIES]]
    reference_ms = [a.elapsed_time(b) for a, b in zip(marks.events, marks.events[1:])]  # steps 1 on
    assert len(device_ms) == len(marks.events) == NEW_TOKENS
    print(f"\n{'step':>4} {'events mode ms':>15} {'reference ms':>13} {'difference':>11}")
    bad = []
    for i, (d, r) in enumerate(zip(device_ms[1:], reference_ms), start=1):
        rel = (d - r) / r
        print(f"{i:>4} {d:>15.4f} {r:>13.4f} {rel:>+10.3%}")
        if abs(rel) > EVENTS_STEP_TOLERANCE:
            bad.append((i, d, r))
    total = (sum(device_ms[1:]) - sum(reference_ms)) / sum(reference_ms)
    print(
        f"sum from step 1: events mode {sum(device_ms[1:]):.3f} ms, reference {sum(reference_ms):.3f} ms ({total:+.3%})"
    )
    assert not bad, f"steps off by more than {EVENTS_STEP_TOLERANCE:.0%}: {bad}"
    assert abs(total) <= EVENTS_SUM_TOLERANCE

    # without the reference's waits: the host runs ahead, and the instrumentation never synchronizes
    calls = []
    real_synchronize = torch.cuda.synchronize
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: (calls.append(a), real_synchronize(*a, **k)))
    span_exporter.clear()
    generate(llama_1b, inputs)
    assert calls == []
    request = _request(span_exporter)
    device_sum_ms = sum(request.attributes[A.GENERATE_STEP_LATENCIES]) * 1e3
    duration_ms = (request.end_time - request.start_time) / 1e6
    print(
        f"no reference: request span {duration_ms:.3f} ms, sum of device step latencies {device_sum_ms:.3f} ms "
        f"({(device_sum_ms - duration_ms) / duration_ms:+.2%})"
    )


# --- energy (NVML) -------------------------------------------------------------------------------------


def nvml_counter():
    """NVML's total-energy counter of the current CUDA device (millijoules), read directly."""
    try:
        import pynvml
    except ImportError:
        pytest.fail("nvidia-ml-py is not installed: pip install -e '.[energy]' (the energy checks need NVML)")
    pynvml.nvmlInit()
    uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
    handle = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else "GPU-" + uuid)
    return lambda: pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)


@pytest.mark.parametrize("synchronize", [True, "events"])
@pytest.mark.parametrize("batch", [1, 8])
def test_energy_per_token_agrees_with_nvml_around_the_call(
    llama_1b, batch, synchronize, instrument, tracer_provider, span_exporter
):
    read = nvml_counter()
    instrument(tracer_provider=tracer_provider, synchronize=synchronize)
    inputs = prompt(llama_1b, batch=batch)
    generate(llama_1b, inputs)  # warm-up
    span_exporter.clear()
    torch.cuda.synchronize()
    before = read()
    out = generate(llama_1b, inputs)
    torch.cuda.synchronize()
    after = read()
    tokens = batch * NEW_TOKENS
    assert out.shape == (batch, PROMPT_TOKENS + NEW_TOKENS)
    request = _request(span_exporter)
    attrs = request.attributes
    assert attrs[A.GEN_AI_USAGE_OUTPUT_TOKENS] == tokens
    nvml_per_token = (after - before) / 1000 / tokens
    per_token = attrs[A.GENERATE_ENERGY_PER_OUTPUT_TOKEN]
    rel = (per_token - nvml_per_token) / nvml_per_token
    steps = [s for s in span_exporter.get_finished_spans() if A.GENERATE_STEP_ENERGY in s.attributes]
    step_sum = sum(s.attributes[A.GENERATE_STEP_ENERGY] for s in steps)
    print(
        f"\nbatch {batch}, synchronize={synchronize!r}: request {attrs[A.GENERATE_ENERGY]:.3f} J, "
        f"{per_token * 1e3:.3f} mJ/token; NVML around the call {(after - before) / 1000:.3f} J, "
        f"{nvml_per_token * 1e3:.3f} mJ/token ({rel:+.2%}); steps with an energy {len(steps)}/{NEW_TOKENS}"
        + (f", their sum {step_sum:.3f} J" if steps else "")
        + (
            f"; prefill {attrs[A.GENERATE_ENERGY_PREFILL]:.3f} J, decode {attrs.get(A.GENERATE_ENERGY_DECODE, 0):.3f} J"
            if A.GENERATE_ENERGY_PREFILL in attrs
            else ""
        )
    )
    assert abs(rel) <= ENERGY_TOLERANCE
    if len(steps) == NEW_TOKENS:  # every step has an energy: the split is given and adds up to the steps'
        split = attrs[A.GENERATE_ENERGY_PREFILL] + attrs[A.GENERATE_ENERGY_DECODE]
        assert split == pytest.approx(step_sum, rel=1e-9)
        assert attrs[A.GENERATE_ENERGY_PER_TOTAL_TOKEN] == pytest.approx(
            attrs[A.GENERATE_ENERGY] / (batch * PROMPT_TOKENS + tokens), rel=1e-9
        )


@pytest.mark.parametrize("batch", [1, 8])
def test_energy_per_token_under_generate_batch_agrees_with_nvml_around_the_call(
    llama_1b, batch, instrument, tracer_provider, span_exporter
):
    from transformers import ContinuousBatchingConfig, GenerationConfig

    read = nvml_counter()
    instrument(tracer_provider=tracer_provider)
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, eos_token_id=None, do_sample=False, pad_token_id=0)
    batching = ContinuousBatchingConfig(num_blocks=512, max_batch_tokens=2048, page_size=16)
    prompts = prompt(llama_1b, batch=batch)["input_ids"].tolist()

    def run():
        outputs = llama_1b.generate_batch(
            inputs=prompts, generation_config=config, continuous_batching_config=batching, persistent_manager=True
        )
        tracer_provider.force_flush()  # the emitter's spans
        return outputs

    try:
        run()  # warm-up: the manager, its cache and graphs, kept for the measured call
        span_exporter.clear()
        torch.cuda.synchronize()
        before = read()
        outputs = run()
        torch.cuda.synchronize()
        after = read()
    finally:
        llama_1b.destroy_cached_continuous_batching_manager()
    tokens = sum(len(output.generated_tokens) for output in outputs.values())
    assert tokens == batch * NEW_TOKENS
    requests = [s for s in span_exporter.get_finished_spans() if s.name.startswith(A.OPERATION_TEXT_COMPLETION)]
    assert len(requests) == batch
    energy_j = sum(r.attributes[A.GENERATE_ENERGY] for r in requests)
    nvml_j = (after - before) / 1000
    rel = (energy_j / tokens - nvml_j / tokens) / (nvml_j / tokens)
    print(
        f"\ngenerate_batch, batch {batch}: requests' shares {energy_j:.3f} J, {energy_j / tokens * 1e3:.3f} mJ/token; "
        f"NVML around the call {nvml_j:.3f} J, {nvml_j / tokens * 1e3:.3f} mJ/token ({rel:+.2%})"
    )
    assert abs(rel) <= ENERGY_TOLERANCE
