"""The ``generate()`` bench: the measured runs, ``--compare``, the result document and its report.

``otel-generate bench`` times ``generate()`` on a device and keeps every sample:

* the model is built (or loaded) and placed on the device **before** warmup; warmup runs are
  not measured;
* each measured run times one complete ``generate()`` call (prompt processing plus
  continuation) with :func:`otel_generate.clock.timed_call`: synchronize, read the clock, call,
  synchronize, read the clock (``time.perf_counter``, seconds);
* greedy decoding, KV cache on, an explicit attention mask, EOS disabled unless ``--eos``;
* new tokens are counted from the returned tensor with
  :func:`otel_generate.tokens.count_new_tokens` (per sequence, minus the prompt, up to and
  including the first EOS, never padding), so a model that stops early reports its real count;
* time to first token and time per output token come from the instrumentation itself
  (:class:`otel_generate.TokenLatencyProfiler` around the measured runs: the per-step hook is
  on in those runs, so they are *profiled* runs, not plain ones);
* every median comes with its interquartile range (:mod:`otel_generate.bench.stats`);
* the machine's load average is read before, between and after the runs, and a busy machine
  is reported (:class:`~otel_generate.bench.monitor.LoadMonitor`).

``--compare`` measures the instrumentation's cost in runs of its own: plain ``generate()``
(the original ``GenerationMixin.generate``, uninstrumented) and instrumented ``generate()``
(SDK ``TracerProvider`` with a ``BatchSpanProcessor`` and the ``--exporter``, SDK
``MeterProvider``) run interleaved A B A B on the same inputs. After each instrumented call the
work it deferred (the span processor's export, the metric collection) is finished outside any
timer and charged to that call, so it reports two paired ratios: the caller-visible one and
the one including deferred work. Its report ends with one conclusion (:func:`conclusion`): the
steady state's caller-visible added time per step and ratio, each with a confidence interval.

The workload is a :class:`~otel_generate.bench.workload.Runner`: a model, its inputs and the one
call each run times. The A/B loop and the instrumented side are shared with the
continuous-batching bench (``--continuous-batching --requests N``: waves of requests on one
persistent manager, :mod:`otel_generate.bench.continuous`) in :mod:`otel_generate.bench.common`.
``--instructions`` is :mod:`otel_generate.bench.instructions`; :func:`otel_generate.bench.cli.run`
picks the mode.

Units: ``*_s`` keys are seconds, ``*_ms`` milliseconds, ``*_us`` microseconds.

Errors: invalid input raises :class:`~otel_generate.bench.config.BenchUsageError` (a ``ValueError``);
the CLI turns it into a message on stderr and exit status 2, before anything is written.
"""

from __future__ import annotations

import gc
import time
from typing import Any, Callable, Dict, List, Optional

from otel_generate.bench.common import ORDER, InstrumentedSide, begin, document_head, finish, interleave, torch_threads
from otel_generate.bench.config import BenchConfig
from otel_generate.bench.monitor import LoadMonitor
from otel_generate.bench.progress import Progress
from otel_generate.bench.stats import make_sample, median_interval, median_iqr_text, summarize, with_iqr
from otel_generate.bench.workload import Runner, sequences_of

#: Keys every bench JSON document has (``samples`` entries have at least :data:`SAMPLE_KEYS`).
RESULT_KEYS = (
    "versions",
    "device",
    "dtype",
    "parameters",
    "prompt_tokens",
    "new_tokens_requested",
    "batch_size",
    "warmup",
    "runs",
    "threads",
    "samples",
    "median_elapsed_s",
    "median_tokens_per_s",
    "median_time_to_first_token_ms",
    "median_time_per_output_token_ms",
)
#: The interquartile range of each median in :data:`RESULT_KEYS`: ``[25th, 75th percentile]``, same unit.
IQR_KEYS = (
    "iqr_elapsed_s",
    "iqr_tokens_per_s",
    "iqr_time_to_first_token_ms",
    "iqr_time_per_output_token_ms",
)
SAMPLE_KEYS = ("elapsed_s", "new_tokens", "tokens_per_s")
VERSION_KEYS = ("python", "torch", "transformers", "otel_generate")

MEASURED_RUNS = (
    "profiled runs: generate() inside a TokenLatencyProfiler, so the instrumentation's per-step hook "
    "(and its device synchronization) is on; spans only if a global SDK tracer provider is set"
)


def _flush_global_tracer_provider() -> None:
    """Finish the span export a global SDK tracer provider deferred (e.g. under ``opentelemetry-instrument``)."""
    from opentelemetry import trace

    flush = getattr(trace.get_tracer_provider(), "force_flush", None)
    if callable(flush):
        flush()


def measure(
    runner: Runner, monitor: Optional[LoadMonitor] = None, progress: Optional[Progress] = None
) -> List[Dict[str, Any]]:
    """Warmup, then ``runs`` measured runs under a :class:`~otel_generate.TokenLatencyProfiler`.

    These are *profiled* runs (:data:`MEASURED_RUNS`), the ones the headline medians describe.
    After each run, outside the timer, a global SDK tracer provider (if one is set) is flushed
    so that no span export lands in the next run's timer, ``monitor`` reads the load and
    ``progress`` counts the run.

    Returns one sample per measured run: :func:`~otel_generate.bench.stats.make_sample` plus the
    instrumentation's ``time_to_first_token_ms``, ``time_per_output_token_ms``,
    ``step_latencies_ms`` and ``step_tokens`` (milliseconds; tokens per sequence each step appended).
    """
    from otel_generate import TokenLatencyProfiler

    config = runner.config
    progress = progress if progress is not None else Progress()
    samples: List[Dict[str, Any]] = []
    with TokenLatencyProfiler() as profiler:
        if config.warmup:
            progress.phase("warmup")
        for _ in range(config.warmup):
            runner.generate()
            progress.advance()
        _flush_global_tracer_provider()
        progress.phase("measured runs")
        if monitor is not None:
            monitor.read("after warmup")
        for run in range(config.runs):
            before = len(profiler.records)
            gc.collect()
            output, elapsed = runner.timed()
            _flush_global_tracer_provider()
            sample = make_sample(elapsed, runner.counts(output))
            new_records = profiler.records[before:]
            record = new_records[-1] if new_records else None
            if record is not None:
                sample["time_to_first_token_ms"] = _ms(record.time_to_first_token_s)
                sample["time_per_output_token_ms"] = _ms(record.time_per_output_token_s)
                sample["step_latencies_ms"] = [lat * 1e3 for lat in record.step_latencies_s]
                sample["step_tokens"] = list(record.step_tokens)
            else:  # the instrumentation did not see the call (should not happen)
                sample["time_to_first_token_ms"] = None
                sample["time_per_output_token_ms"] = None
                sample["step_latencies_ms"] = []
                sample["step_tokens"] = []
            samples.append(sample)
            if monitor is not None:
                monitor.read(f"run {run + 1}")
            progress.advance()
    return samples


def _ms(seconds: Optional[float]) -> Optional[float]:
    return None if seconds is None else seconds * 1e3


def compare(
    runner: Runner, monitor: Optional[LoadMonitor] = None, progress: Optional[Progress] = None
) -> Dict[str, Any]:
    """Plain vs instrumented ``generate()``, interleaved A B A B; ``runs`` pairs after ``warmup`` pairs.

    These runs are separate from the measured (profiled) runs of the headline. Plain is the
    original ``GenerationMixin.generate`` (the instrumentor is uninstrumented, so no wrapper
    runs at all); instrumented is ``GenerateInstrumentor().instrument()`` (with
    ``max_step_spans=--max-step-spans`` when given) with an SDK ``TracerProvider`` +
    ``BatchSpanProcessor`` + the ``--exporter`` and an SDK ``MeterProvider`` (see
    :func:`make_exporters`). Instrumenting and uninstrumenting happen outside the timer;
    ``gc.collect()`` runs before every timed call on both sides.

    Deferred work: right after each instrumented timed call, outside any timer and before the
    next run, ``tracer_provider.force_flush()`` (the batch processor exports the call's spans
    on its thread; with ``otlp-encode`` that is the encoding) and then
    ``meter_provider.force_flush()`` (the metric collection, and its encoding) run, each timed
    with the same clock. Their sum is charged to that call: ``paired_ratios_with_deferred`` =
    (instrumented + deferred) / plain. The metric flush is periodic in a real deployment (every
    export interval, not every request), so charging one per request is an upper bound.

    Returns:
        per pair (lists): ``plain_elapsed_s``, ``instrumented_elapsed_s``,
        ``deferred_trace_flush_s``, ``deferred_metric_flush_s``, ``instrumented_deferred_s``
        (their sum), ``paired_ratios`` (instrumented / plain, caller-visible),
        ``paired_ratios_with_deferred``, ``steps`` (decode steps per run), ``added_us_per_step``
        and ``added_us_per_step_with_deferred`` ((instrumented [+ deferred] - plain) / steps,
        microseconds), ``plain_tokens_per_s``, ``spans_exported_after_each_flush`` (cumulative);
        for each of those a ``median_X`` and an ``iqr_X`` (``[25th, 75th percentile]``);
        ``spans_exported`` / ``spans_expected``, ``exported_bytes`` / ``exported_metric_bytes``
        (``otlp-encode``: serialized OTLP bytes; ``discard``: ``None``), ``flushes_complete``,
        ``outputs_identical`` and descriptions of both paths.

    Both ways of instrumenting are run, one after the other, ``runs`` pairs each: first
    ``instrument()`` / ``uninstrument()`` around every instrumented run (the top level of the
    result), then an instrumentor set up once and kept for all its instrumented runs, whose plain
    runs go through the installed wrappers under ``suppress_instrumentation()``
    (``instrument_once``, the same keys). The first charges every request with being the first
    after ``instrument()``; the second never does. ``conclusion`` (:func:`conclusion`) is the one
    figure to quote, from the second: the steady state of an application.

    Raises:
        BenchUsageError: generate() is already instrumented (e.g. under ``opentelemetry-instrument``),
            so no plain path exists in this process.
    """
    config = runner.config
    result = _compare_pairs(
        runner, InstrumentedSide(config, runner.clock), monitor, "pair", progress, "compare, instrument() per run"
    )
    result["instrument_once"] = _compare_pairs(
        runner,
        InstrumentedSide(config, runner.clock, once=True),
        monitor,
        "instrument-once pair",
        progress,
        "compare, instrumented once",
    )
    result["conclusion"] = conclusion(result["instrument_once"])
    return result


#: What the conclusion of ``--compare`` quotes, and from which pairs.
CONCLUSION_FIGURE = "steady state, caller-visible"
CONCLUSION_INTERVAL = (
    "distribution-free confidence interval of the median over the pairs (the sign test's: the k-th smallest "
    "to the k-th largest pair, k the largest rank that covers the median with the confidence given)"
)
NOT_RESOLVED = "not resolved on this machine"


def conclusion(block: Dict[str, Any]) -> Dict[str, Any]:
    """The one figure of ``--compare``, from the pairs of ``block`` (``compare.instrument_once``, the
    steady state): the median over the pairs of the caller-visible added time per decode step and of
    the paired ratio, each with the confidence interval of its median
    (:func:`~otel_generate.bench.stats.median_interval`).

    Both intervals take the same ranks of the same pairs, and a pair's added time is above zero
    exactly when its ratio is above one, so the two agree: ``resolved`` is false when the interval of
    the added time holds zero (the ratio's then holds one), or when there is one pair (no interval).
    ``text`` is the line the report ends with.
    """
    added, achieved = median_interval(block["added_us_per_step"])
    ratio, _ = median_interval(block["paired_ratios"])
    resolved = achieved > 0 and not added[0] <= 0 <= added[1]
    result: Dict[str, Any] = {
        "figure": CONCLUSION_FIGURE,
        "pairs": len(block["added_us_per_step"]),
        "added_us_per_step": block["median_added_us_per_step"],
        "added_us_per_step_interval": added,
        "ratio": block["median_paired_ratio"],
        "ratio_interval": ratio,
        "confidence": achieved,
        "interval": CONCLUSION_INTERVAL,
        "resolved": resolved,
    }
    result["text"] = conclusion_text(result)
    return result


def conclusion_text(c: Dict[str, Any]) -> str:
    """``conclusion (steady state, caller-visible, 30 pairs): added 7.0 us per decode step (95 % CI -3.1 to
    20.4 us), ratio 1.0060 (95 % CI 0.9970 to 1.0180): not resolved on this machine`` (the last clause only
    when not resolved)."""
    head = f"conclusion ({c['figure']}, {c['pairs']} pair{'s' if c['pairs'] != 1 else ''}): "
    if c["confidence"] > 0:
        ci = f"{c['confidence'] * 100:.3g} % CI"
        low, high = c["added_us_per_step_interval"]
        r_low, r_high = c["ratio_interval"]
        text = (
            f"added {c['added_us_per_step']:.1f} us per decode step ({ci} {low:.1f} to {high:.1f} us), "
            f"ratio {c['ratio']:.4f} ({ci} {r_low:.4f} to {r_high:.4f})"
        )
    else:
        text = f"added {c['added_us_per_step']:.1f} us per decode step, ratio {c['ratio']:.4f} (one pair: no interval)"
    return head + text + ("" if c["resolved"] else f": {NOT_RESOLVED}")


def runs_in_all(config: BenchConfig) -> int:
    """The ``generate()`` calls a bench of ``config`` makes: warmup and measured runs, and with
    ``--compare`` two sets of ``warmup + runs`` pairs (the progress line's total)."""
    runs = config.warmup + config.runs
    return runs + (2 * 2 * runs if config.compare else 0)


def _compare_pairs(
    runner: Runner,
    side: InstrumentedSide,
    monitor: Optional[LoadMonitor],
    label: str,
    progress: Optional[Progress] = None,
    phase: str = "compare",
) -> Dict[str, Any]:
    import torch

    config = runner.config
    steps: List[int] = []
    plain_rates: List[float] = []
    identical = [True]

    def record(out_a: Any, elapsed_a: float, out_b: Any) -> None:
        seq_a, seq_b = sequences_of(out_a), sequences_of(out_b)
        identical[0] = identical[0] and seq_a.shape == seq_b.shape and bool(torch.equal(seq_a, seq_b))
        counts_a = runner.counts(out_a)
        # decode steps = loop iterations = the longest sequence's new tokens (greedy: 1 token/step)
        steps.append(max(counts_a))
        plain_rates.append(sum(counts_a) / elapsed_a)

    try:
        pairs = interleave(side, runner.timed, config, record, monitor, label, progress, phase)
    finally:
        side.shutdown()
    ratios, ratios_deferred = pairs.ratios()
    added, added_deferred = pairs.added_us_per_step(steps)
    result: Dict[str, Any] = {
        "pairs": config.runs,
        "order": ORDER,
        "runs": "runs of their own, separate from the measured (profiled) runs of the headline",
        "plain": "GenerationMixin.generate uninstrumented (the original function; no wrapper runs)"
        if not side.once
        else "GenerationMixin.generate instrumented but under suppress_instrumentation() (the wrappers pass through)",
        "instrument": "once, kept for every instrumented run" if side.once else "instrument() / uninstrument() per run",
        "instrumented": side.description,
        "deferred": (
            "after each instrumented call, outside its timer and before the next run: "
            "tracer_provider.force_flush() then meter_provider.force_flush(), each timed; charged to that call"
        ),
        "exporter": config.exporter,
        **pairs.timings(),
        "paired_ratios": ratios,
        "paired_ratios_with_deferred": ratios_deferred,
        "steps": steps,
        "added_us_per_step": added,
        "added_us_per_step_with_deferred": added_deferred,
        "plain_tokens_per_s": plain_rates,
    }
    for name, values in (
        ("paired_ratio", ratios),
        ("paired_ratio_with_deferred", ratios_deferred),
        ("added_us_per_step", added),
        ("added_us_per_step_with_deferred", added_deferred),
        ("plain_elapsed_s", pairs.plain_s),
        ("instrumented_elapsed_s", pairs.instrumented_s),
        ("instrumented_deferred_s", pairs.deferred_s),
        ("plain_tokens_per_s", plain_rates),
    ):
        with_iqr(result, name, values)
    result.update(
        {
            "spans_exported": pairs.spans_exported,
            "spans_exported_after_each_flush": pairs.spans_exported_after,
            "max_step_spans": side.max_step_spans,
            "step_spans": side.policy,
            "sampler": side.sampler,
            "spans_expected": side.spans_expected(steps),
            "exported_bytes": pairs.exported_bytes,
            "exported_metric_bytes": pairs.exported_metric_bytes,
            "flushes_complete": side.flushes_complete,
            "outputs_identical": identical[0],
        }
    )
    return result


# --------------------------------------------------------------------------------------------
# The whole run
# --------------------------------------------------------------------------------------------


def run(
    config: BenchConfig, clock: Callable[[], float] = time.perf_counter, progress: Optional[Progress] = None
) -> Dict[str, Any]:
    """Validate, build, warm up, measure (and compare); return the result document.

    Nothing is written here (see :func:`otel_generate.bench.cli.main_bench`). ``torch``'s CPU
    thread count is set to ``config.threads`` for the run and restored afterwards. The load
    average is read throughout (:class:`~otel_generate.bench.monitor.LoadMonitor`); ``warnings``
    lists what makes the numbers less trustworthy (a busy machine, a flush that timed out).
    ``progress`` shows the phase and the runs done (:func:`runs_in_all` in all).
    The other modes have their own ``run`` (:func:`otel_generate.bench.continuous.run`,
    :func:`otel_generate.bench.instructions.run`); :func:`otel_generate.bench.cli.run` picks the mode.

    Raises:
        BenchUsageError: invalid input (see :meth:`BenchConfig.validate`,
            :func:`~otel_generate.bench.config.resolve_device`,
            :func:`~otel_generate.bench.workload.check_lengths`, :func:`~otel_generate.bench.workload.resolve_eos`).
        ValueError: a timed call whose clock did not advance.
    """
    monitor, device = begin(config, uninstrumented=config.compare, progress=progress, runs=runs_in_all(config))
    with torch_threads(config.threads):
        import torch

        runner = Runner(config, device, clock=clock)
        samples = measure(runner, monitor, progress)
        result: Dict[str, Any] = document_head(config, device, runner.model)
        result.update(
            {
                "prompt_tokens": config.prompt_tokens,
                "new_tokens_requested": config.new_tokens,
                "batch_size": config.batch_size,
                "warmup": config.warmup,
                "runs": config.runs,
                "threads": torch.get_num_threads(),
                "seed": config.seed,
                "eos_token_id": runner.eos,
                "synchronize": f"{device} synchronize before each clock read"
                if runner.synchronize is not None
                else "none needed (cpu: eager work has finished when ops return)",
                "timer": "time.perf_counter around one complete generate(), synchronized before and after",
                "measured_runs": MEASURED_RUNS,
                "samples": samples,
            }
        )
        result.update(summarize(samples))
        if config.compare:
            result["compare"] = compare(runner, monitor, progress)
        return finish(result, monitor, not config.compare or result["compare"]["flushes_complete"])


# --------------------------------------------------------------------------------------------
# The report
# --------------------------------------------------------------------------------------------


def _pairs_lines(title: str, block: Dict[str, Any]) -> List[str]:
    """One set of ``--compare`` pairs: the plain runs' median for scale, then what each pair measured
    (instrumented against the plain run beside it) as a median over the pairs with its IQR.

    The instrumented runs' own median is left out: it comes from other runs than the plain median,
    and on a noisy machine its quotient with it can be far from the median of the paired ratios.
    """

    def m(name: str, fmt: str, scale: float = 1.0, unit: str = "") -> str:
        return median_iqr_text(block[f"median_{name}"], block[f"iqr_{name}"], fmt, scale, unit)

    byte_text = ""
    if block.get("exported_bytes") is not None:
        byte_text = f", {block['exported_bytes']:,} OTLP bytes encoded and discarded"
        if block.get("exported_metric_bytes") is not None:
            byte_text += f" (+{block['exported_metric_bytes']:,} of metrics)"
    return [
        f"  compare, {title}: {block['pairs']} pairs of runs of their own (not the measured runs above), "
        f"plain then instrumented, A B A B, exporter {block['exporter']}",
        f"    plain generate()  median {m('plain_elapsed_s', '.3f', 1e3, 'ms')}, "
        f"{m('plain_tokens_per_s', '.1f', unit='tokens/s')}",
        "    each pair, instrumented against the plain run beside it; the median over the pairs "
        "(IQR: how far the pairs spread)",
        f"      added per step  caller-visible {m('added_us_per_step', '.1f', unit='us')}, "
        f"with deferred work {m('added_us_per_step_with_deferred', '.1f', unit='us')}",
        f"      ratio           caller-visible {m('paired_ratio', '.4f')}, "
        f"with deferred work {m('paired_ratio_with_deferred', '.4f')}",
        f"      deferred work   {m('instrumented_deferred_s', '.3f', 1e3, 'ms')} per instrumented call "
        "(span and metric flush after it, outside its timer)",
        f"    spans exported {block['spans_exported']} (expected {block['spans_expected']}){byte_text}; "
        f"outputs identical: {block['outputs_identical']}",
    ]


def summary_text(result: Dict[str, Any], per_run: bool = False) -> str:
    """The report of a ``generate()`` result (every median with its IQR); with ``--compare`` the
    steady-state pairs (``per_run``: also those that instrument around each run) and, last, the
    conclusion. Warnings are not in it: the command line prints them on stderr."""
    samples = result["samples"]
    elapsed = [s["elapsed_s"] for s in samples]
    rates = [s["tokens_per_s"] for s in samples]
    tokens = sorted({s["new_tokens"] for s in samples})
    lines: List[str] = []

    def r(name: str, fmt: str, scale: float = 1.0, unit: str = "") -> str:
        return median_iqr_text(result[f"median_{name}"], result[f"iqr_{name}"], fmt, scale, unit)

    lines += [
        f"otel-generate bench: {result['model']}",
        f"  device {result['device']}, {result['dtype']}, {result['threads']} thread(s), "
        f"{result['parameters']:,} parameters",
        f"  prompt {result['prompt_tokens']} tokens x batch {result['batch_size']}, "
        f"{result['new_tokens_requested']} new tokens requested (EOS {'on' if result['eos_token_id'] else 'off'}), "
        f"warmup {result['warmup']}, runs {result['runs']}",
        f"  measured runs ({len(samples)}, profiled: per-step hook on, for TTFT and TPOT); "
        f"new tokens per run: {', '.join(map(str, tokens))}",
        f"  elapsed      median {r('elapsed_s', '.3f', 1e3, 'ms')} "
        f"(min {min(elapsed) * 1e3:.3f}, max {max(elapsed) * 1e3:.3f})",
        f"  tokens/s     median {r('tokens_per_s', '.1f')} (min {min(rates):.1f}, max {max(rates):.1f})",
        f"  time to first token    median {r('time_to_first_token_ms', '.3f', unit='ms')}",
        f"  time per output token  median {r('time_per_output_token_ms', '.3f', unit='ms')}",
    ]
    cmp = result.get("compare")
    if cmp:
        blocks = [("instrument() before and uninstrument() after each instrumented run", cmp)] if per_run else []
        once = cmp.get("instrument_once")
        if once:
            blocks.append(("the instrumentor set up once and kept (steady state)", once))
        for title, block in blocks:
            lines += _pairs_lines(title, block)
    if result.get("warnings"):
        lines.append(
            f"  {len(result['warnings'])} warning(s), on stderr and in the JSON's warnings: "
            "the figures above are less trustworthy"
        )
    if cmp and "conclusion" in cmp:
        lines.append(cmp["conclusion"]["text"])
    return "\n".join(lines)
