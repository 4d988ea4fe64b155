"""``otel-generate bench --continuous-batching``: what tracing costs a continuous-batching server.

The workload is one persistent ``ContinuousBatchingManager`` (``init_continuous_batching()`` and
``start()`` once, so that each run does not pay the manager's setup and teardown), sized for the
workload (16-token pages, room for every request at once, the whole prefill in one batch step),
and one **run** is one wave: ``--requests`` prompts of ``--prompt-tokens`` random ids submitted
at once with ``add_request``, greedy, ``--new-tokens`` each (EOS off unless ``--eos``), timed from
the first submission to the last finished output (``time.perf_counter``, synchronized before
and after on an accelerator). Its batch steps are the manager's ``current_batch`` count over the
run.

Plain and instrumented runs alternate, A B A B, ``--runs`` pairs after ``--warmup`` pairs, on the
same manager and prompts: plain is the manager with no hook of this package (uninstrumented),
instrumented is ``GenerateInstrumentor().instrument()`` with an SDK ``TracerProvider`` +
``BatchSpanProcessor`` + the ``--exporter`` and an SDK ``MeterProvider`` (``max_step_spans`` from
``--max-step-spans``; 0 keeps the request spans and metrics only). The hooks are installed and
removed outside the timers. The request spans are built on the instrumentation's background
emitter while the wave runs (competing with the scheduler thread, so that is inside the timer);
what is left when the wave ends is finished by ``tracer_provider.force_flush()`` (which drains
the emitter, then the span processor) and ``meter_provider.force_flush()``, timed apart and
charged to that run, as ``--compare`` does for ``generate()``.

Reported, each as a median with its interquartile range: plain and instrumented throughput
(generated tokens per second), the paired ratio instrumented / plain (caller-visible, and with the
deferred work), and the added time per batch step in microseconds ((instrumented [+ deferred] -
plain) / the plain run's batch steps).
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from otel_generate.bench.common import ORDER, InstrumentedSide, begin, document_head, finish, interleave, torch_threads
from otel_generate.bench.config import BenchConfig, BenchUsageError
from otel_generate.bench.monitor import LoadMonitor
from otel_generate.bench.progress import Progress
from otel_generate.bench.stats import median_iqr_text, with_iqr
from otel_generate.bench.workload import build_bench_model, check_lengths, make_inputs, max_positions, resolve_eos
from otel_generate.clock import synchronizer_for

#: Tokens per page of the manager's cache.
PAGE_SIZE = 16
#: How long one wave may take before the bench gives up, seconds.
WAVE_TIMEOUT_S = 600.0


def cache_config(requests: int, prompt_tokens: int, new_tokens: int) -> Dict[str, int]:
    """``ContinuousBatchingConfig`` sizes for the workload: every request's pages at once (plus 4
    spare), and a batch large enough to prefill every prompt in one step (at least 64 tokens)."""
    pages = requests * math.ceil((prompt_tokens + new_tokens) / PAGE_SIZE) + 4
    return {"num_blocks": pages, "max_batch_tokens": max(64, requests * prompt_tokens), "page_size": PAGE_SIZE}


def check_supported(model: Any) -> None:
    """Raise :class:`~otel_generate.bench.config.BenchUsageError` unless this transformers' continuous
    batching can be run and instrumented.

    The check is the instrumentor's own (:func:`otel_generate.instrumentor.missing_hooks`, from its
    patch table), the one that decides whether continuous batching is instrumented.
    """
    try:
        from transformers.generation.continuous_batching import continuous_api
    except ImportError:
        raise BenchUsageError(
            "--continuous-batching needs transformers' continuous batching (transformers 5.17 or newer)"
        ) from None
    from otel_generate.instrumentor import missing_hooks

    missing = missing_hooks(continuous_api)
    if missing or not callable(getattr(model, "init_continuous_batching", None)):
        raise BenchUsageError(
            "--continuous-batching: this transformers' continuous batching cannot be instrumented "
            f"(missing {', '.join(missing) or 'init_continuous_batching'}; transformers 5.17 or newer)"
        )


class _Waves:
    """The persistent manager and the one wave of requests every run submits."""

    def __init__(self, config: BenchConfig, device: str, clock: Callable[[], float]) -> None:
        self.config = config
        self.clock = clock
        self.model = build_bench_model(config, device)
        check_supported(self.model)
        from transformers import ContinuousBatchingConfig, GenerationConfig

        check_lengths(config.prompt_tokens, config.new_tokens, max_positions(self.model))
        self.eos = resolve_eos(config, self.model)
        inputs = make_inputs(self.model, config.requests, config.prompt_tokens, config.seed)
        self.prompts: List[List[int]] = inputs["input_ids"].tolist()
        pad = getattr(self.model.generation_config, "pad_token_id", None)
        self.generation_config = GenerationConfig(
            max_new_tokens=config.new_tokens,
            do_sample=False,
            num_beams=1,
            eos_token_id=list(self.eos) if self.eos else -1,  # -1: no EOS (None would fall back to the model's)
            pad_token_id=pad,
        )
        self.sizes = cache_config(config.requests, config.prompt_tokens, config.new_tokens)
        self.manager = self.model.init_continuous_batching(
            generation_config=self.generation_config,
            continuous_batching_config=ContinuousBatchingConfig(**self.sizes),
        )
        self.synchronize = synchronizer_for(device)
        self.started = False

    def start(self) -> None:
        self.manager.start()
        self.started = True
        deadline = time.monotonic() + WAVE_TIMEOUT_S
        while not hasattr(self.manager, "current_batch"):  # set by the scheduler thread once its loop starts
            if not self.manager.is_running() or time.monotonic() > deadline:
                raise RuntimeError("the continuous-batching manager did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        if self.started:
            self.manager.stop(block=True, timeout=60)
            self.started = False
        self.manager.destroy()

    def wave(self) -> Tuple[List[List[int]], float, int]:
        """One run: ``(generated tokens per prompt, seconds, batch steps)``."""
        manager = self.manager
        eos = self.generation_config.eos_token_id
        if self.synchronize is not None:
            self.synchronize()
        steps_before = manager.current_batch
        start = self.clock()
        ids = [
            manager.add_request(prompt, max_new_tokens=self.config.new_tokens, eos_token_id=eos)
            for prompt in self.prompts
        ]
        pending = set(ids)
        outputs: Dict[str, Any] = {}
        deadline = time.monotonic() + WAVE_TIMEOUT_S
        while pending:
            output = manager.get_result(timeout=1.0)
            if output is None:
                if not manager.is_running() or time.monotonic() > deadline:
                    raise RuntimeError("the continuous-batching manager stopped or stalled during a bench run")
                continue
            if output.request_id in pending and output.is_finished():
                if output.error is not None:
                    raise RuntimeError(f"bench request {output.request_id} failed: {output.error}")
                pending.discard(output.request_id)
                outputs[output.request_id] = output
        if self.synchronize is not None:
            self.synchronize()
        elapsed = self.clock() - start
        steps = manager.current_batch - steps_before
        if not elapsed > 0:
            raise ValueError(f"elapsed time must be positive, got {elapsed!r} s: the clock did not advance")
        return [list(outputs[rid].generated_tokens) for rid in ids], elapsed, steps


def compare_waves(
    waves: _Waves, monitor: Optional[LoadMonitor] = None, progress: Optional[Progress] = None
) -> Dict[str, Any]:
    """Plain vs instrumented waves, interleaved A B A B (see the module docstring)."""
    config = waves.config
    side = InstrumentedSide(config, waves.clock, max_queue_size=1 << 16)
    plain_steps: List[int] = []
    instr_steps: List[int] = []
    tokens: List[int] = []
    per_request_tokens: List[int] = []
    identical = [True]

    def timed() -> Tuple[Tuple[List[List[int]], int], float]:
        outputs, elapsed, steps = waves.wave()
        return (outputs, steps), elapsed

    def record(a: Tuple[List[List[int]], int], elapsed_a: float, b: Tuple[List[List[int]], int]) -> None:
        (out_a, steps_a), (out_b, steps_b) = a, b
        identical[0] = identical[0] and out_a == out_b
        plain_steps.append(steps_a)
        instr_steps.append(steps_b)
        tokens.append(sum(len(t) for t in out_a))
        per_request_tokens[:] = [len(t) for t in out_a]

    waves.start()
    try:
        pairs = interleave(side, timed, config, record, monitor, progress=progress, phase="continuous batching, pairs")
    finally:
        waves.stop()
        side.shutdown()
    plain_s, instr_s, deferred = pairs.plain_s, pairs.instrumented_s, pairs.deferred_s
    ratios, ratios_deferred = pairs.ratios()
    added, added_deferred = pairs.added_us_per_step(plain_steps)
    result: Dict[str, Any] = {
        "pairs": config.runs,
        "order": ORDER,
        "plain": "the manager with no hook of this package (uninstrumented)",
        "instrumented": side.description,
        "deferred": (
            "after each instrumented run, outside its timer: tracer_provider.force_flush() (drains the background "
            "emitter, then the span processor) and meter_provider.force_flush(), each timed; charged to that run"
        ),
        "exporter": config.exporter,
        **pairs.timings(),
        "plain_batch_steps": plain_steps,
        "instrumented_batch_steps": instr_steps,
        "tokens": tokens,
        "plain_tokens_per_s": [n / s for n, s in zip(tokens, plain_s)],
        "instrumented_tokens_per_s": [n / s for n, s in zip(tokens, instr_s)],
        "instrumented_tokens_per_s_with_deferred": [n / (s + d) for n, s, d in zip(tokens, instr_s, deferred)],
        "paired_ratios": ratios,
        "paired_ratios_with_deferred": ratios_deferred,
        "added_us_per_batch_step": added,
        "added_us_per_batch_step_with_deferred": added_deferred,
    }
    for name, key in (
        ("plain_elapsed_s", "plain_elapsed_s"),
        ("instrumented_elapsed_s", "instrumented_elapsed_s"),
        ("instrumented_deferred_s", "instrumented_deferred_s"),
        ("plain_tokens_per_s", "plain_tokens_per_s"),
        ("instrumented_tokens_per_s", "instrumented_tokens_per_s"),
        ("instrumented_tokens_per_s_with_deferred", "instrumented_tokens_per_s_with_deferred"),
        ("paired_ratio", "paired_ratios"),
        ("paired_ratio_with_deferred", "paired_ratios_with_deferred"),
        ("added_us_per_batch_step", "added_us_per_batch_step"),
        ("added_us_per_batch_step_with_deferred", "added_us_per_batch_step_with_deferred"),
        ("plain_batch_steps", "plain_batch_steps"),
    ):
        with_iqr(result, name, result[key])
    result.update(
        {
            "spans_exported": pairs.spans_exported,
            "max_step_spans": side.max_step_spans,
            "step_spans": side.policy,
            "spans_expected": side.spans_expected(per_request_tokens * config.runs),
            "exported_bytes": pairs.exported_bytes_total,  # warmup included, as this key always counted
            "flushes_complete": side.flushes_complete,
            "outputs_identical": identical[0],
        }
    )
    return result


def run(
    config: BenchConfig, clock: Callable[[], float] = time.perf_counter, progress: Optional[Progress] = None
) -> Dict[str, Any]:
    """Validate, build, then :func:`compare_waves`; return the result document (nothing is written here).

    Raises:
        BenchUsageError: invalid input, or a transformers without instrumentable continuous batching.
    """
    # progress: each run is one wave; warmup pairs and measured pairs
    monitor, device = begin(config, uninstrumented=True, progress=progress, runs=2 * (config.warmup + config.runs))
    with torch_threads(config.threads):
        import torch

        waves = _Waves(config, device, clock)
        compared = compare_waves(waves, monitor, progress)
        result: Dict[str, Any] = {"mode": "continuous_batching", **document_head(config, device, waves.model)}
        result.update(
            {
                "requests": config.requests,
                "prompt_tokens": config.prompt_tokens,
                "new_tokens_requested": config.new_tokens,
                "warmup": config.warmup,
                "runs": config.runs,
                "threads": torch.get_num_threads(),
                "seed": config.seed,
                "eos_token_id": waves.eos,
                "continuous_batching_config": dict(waves.sizes),
                "synchronize": f"{device} synchronize before and after each run"
                if waves.synchronize is not None
                else "none needed (cpu: eager work has finished when ops return)",
                "timer": "time.perf_counter from the first add_request to the last finished output of a wave",
                "compare": compared,
            }
        )
        return finish(result, monitor, compared["flushes_complete"])


def summary_text(result: Dict[str, Any]) -> str:
    """The report of a ``--continuous-batching`` result (every median with its IQR); the warnings are
    counted in it, and printed on stderr by the command line."""
    cmp = result["compare"]

    def m(name: str, fmt: str, scale: float = 1.0, unit: str = "") -> str:
        return median_iqr_text(cmp[f"median_{name}"], cmp[f"iqr_{name}"], fmt, scale, unit)

    sizes = result["continuous_batching_config"]
    lines = [
        f"otel-generate bench --continuous-batching: {result['model']}",
        f"  device {result['device']}, {result['dtype']}, {result['threads']} thread(s), "
        f"{result['parameters']:,} parameters",
        f"  {result['requests']} requests per run, submitted at once: prompt {result['prompt_tokens']} tokens, "
        f"{result['new_tokens_requested']} new tokens requested (EOS {'on' if result['eos_token_id'] else 'off'}); "
        f"cache {sizes['num_blocks']} pages of {sizes['page_size']}, {sizes['max_batch_tokens']} tokens per batch",
        f"  {cmp['pairs']} pairs after {result['warmup']} warmup pairs, plain / instrumented interleaved A B A B, "
        f"exporter {cmp['exporter']}, max_step_spans {cmp['max_step_spans']}, step spans {cmp['step_spans']}",
        f"  batch steps per run  median {m('plain_batch_steps', '.0f')}",
        f"    plain         median {m('plain_elapsed_s', '.3f', 1e3, 'ms')}, "
        f"{m('plain_tokens_per_s', '.1f', unit='tokens/s')}",
        f"    instrumented  median {m('instrumented_elapsed_s', '.3f', 1e3, 'ms')} caller-visible, "
        f"{m('instrumented_tokens_per_s', '.1f', unit='tokens/s')}; "
        f"+ {m('instrumented_deferred_s', '.3f', 1e3, 'ms')} deferred (flush after the run)",
        f"    paired ratio instrumented/plain: caller-visible {m('paired_ratio', '.4f')}, "
        f"with deferred work {m('paired_ratio_with_deferred', '.4f')}",
        f"    added per batch step: caller-visible {m('added_us_per_batch_step', '.1f', unit='us')}, "
        f"with deferred work {m('added_us_per_batch_step_with_deferred', '.1f', unit='us')}",
        f"    spans exported {cmp['spans_exported']} (expected {cmp['spans_expected']}); "
        f"outputs identical: {cmp['outputs_identical']}",
    ]
    if result.get("warnings"):
        lines.append(
            f"  {len(result['warnings'])} warning(s), on stderr and in the JSON's warnings: "
            "the figures above are less trustworthy"
        )
    return "\n".join(lines)
