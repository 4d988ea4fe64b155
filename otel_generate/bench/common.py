"""What the ``generate()`` bench (``--compare``) and the continuous-batching bench share.

* :class:`InstrumentedSide`: SDK providers with the ``--exporter`` and the ``instrument()``
  options, one instrumented call timed and the work it deferred finished outside its timer;
* :func:`interleave`: the A/B loop, plain then instrumented per pair, ``--runs`` pairs after
  ``--warmup`` pairs, into :class:`Pairs` (per-pair seconds, spans and bytes exported);
* the paired figures (:meth:`Pairs.ratios`, :meth:`Pairs.added_us_per_step`), with
  :func:`otel_generate.bench.stats.with_iqr` for their medians and interquartile ranges;
* the frame of the result document: :func:`begin` (validate, load monitor, device),
  :func:`torch_threads`, :func:`document_head` and :func:`finish` (load, warnings).

Units: ``*_s`` seconds, ``*_us`` microseconds.
"""

from __future__ import annotations

import datetime as _dt
import gc
import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from otel_generate.bench.config import BenchConfig, BenchUsageError, resolve_device
from otel_generate.bench.environment import machine, versions
from otel_generate.bench.exporters import make_exporters
from otel_generate.bench.monitor import LoadMonitor
from otel_generate.bench.progress import Progress
from otel_generate.bench.workload import model_description
from otel_generate.options import ENV_STEP_SPANS, STEP_SPANS_ALL, STEP_SPANS_NONE


def check_uninstrumented() -> None:
    """Raise :class:`BenchUsageError` when ``generate()`` is already instrumented in this process."""
    from otel_generate import GenerateInstrumentor

    if GenerateInstrumentor().is_instrumented_by_opentelemetry:
        raise BenchUsageError(
            "--compare needs generate() uninstrumented to time the plain path; do not run it under "
            "opentelemetry-instrument or while GenerateInstrumentor().instrument() is active"
        )


class InstrumentedSide:
    """The instrumented side of a plain-vs-instrumented comparison (``--compare``, ``--continuous-batching``).

    SDK providers with the ``--exporter`` (a ``TracerProvider`` + ``BatchSpanProcessor``, a
    ``MeterProvider``; see :func:`make_exporters`) and the ``instrument()`` options the config asks
    for (``--max-step-spans``, ``--step-spans``, ``--background-emission``). :meth:`run` times one
    call instrumented and then finishes the work it deferred, outside its timer.

    ``once=False`` (today's way): each :meth:`run` instruments, times the call and uninstruments,
    so every timed call is the first after ``instrument()``. ``once=True``: ``instrument()`` runs
    here, once, and the instrumentor is kept for every run until :meth:`shutdown`; the plain runs
    it is compared with (:meth:`plain`) then run under ``suppress_instrumentation()``, the
    installed wrappers only passing the call through.

    Raises:
        BenchUsageError: generate() is already instrumented (e.g. under ``opentelemetry-instrument``),
            so no plain path exists in this process.
    """

    def __init__(
        self,
        config: BenchConfig,
        clock: Callable[[], float],
        max_queue_size: Optional[int] = None,
        once: bool = False,
    ) -> None:
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON

        from otel_generate import GenerateInstrumentor
        from otel_generate.options import DEFAULT_MAX_STEP_SPANS, ENV_MAX_STEP_SPANS, env_int

        check_uninstrumented()
        self.clock = clock
        self.instrumentor = GenerateInstrumentor()
        self.exporter, self.metric_reader = make_exporters(config.exporter)
        self.sampler = config.sampler
        self.tracer_provider = TracerProvider(sampler=ALWAYS_OFF if config.sampler == "always_off" else ALWAYS_ON)
        queue = {} if max_queue_size is None else {"max_queue_size": max_queue_size}
        self.tracer_provider.add_span_processor(BatchSpanProcessor(self.exporter, **queue))
        self.meter_provider = MeterProvider(metric_readers=[self.metric_reader])
        self.options: Dict[str, Any] = dict(
            tracer_provider=self.tracer_provider, meter_provider=self.meter_provider, skip_dep_check=True
        )
        if config.max_step_spans is not None:
            self.options["max_step_spans"] = config.max_step_spans
        if config.step_spans is not None:
            self.options["step_spans"] = config.step_spans
        if config.background_emission is not None:
            self.options["background_emission"] = config.background_emission
        #: what instrument() uses: the option, else its environment variable or default
        self.max_step_spans = (
            config.max_step_spans
            if config.max_step_spans is not None
            else env_int(ENV_MAX_STEP_SPANS, DEFAULT_MAX_STEP_SPANS)
        )
        self.policy = (
            config.step_spans or os.environ.get(ENV_STEP_SPANS, STEP_SPANS_ALL).strip().lower() or STEP_SPANS_ALL
        )
        self.flushes_complete = True
        self.description = (
            "GenerateInstrumentor().instrument(tracer_provider=SDK TracerProvider + BatchSpanProcessor + "
            + (
                "discarding SpanExporter, meter_provider=SDK MeterProvider + InMemoryMetricReader"
                if config.exporter == "discard"
                else "SpanExporter that encodes OTLP protobuf and discards the bytes, meter_provider=SDK "
                "MeterProvider + PeriodicExportingMetricReader whose exporter encodes OTLP protobuf and discards "
                "the bytes"
            )
            + (f", max_step_spans={config.max_step_spans}" if config.max_step_spans is not None else "")
            + (f", step_spans={config.step_spans!r}" if config.step_spans is not None else "")
            + (f", background_emission={config.background_emission}" if config.background_emission is not None else "")
            + ")"
            + (", sampler=ALWAYS_OFF: every request unsampled" if config.sampler == "always_off" else "")
            + (
                ", once, kept for every instrumented run"
                if once
                else ", before each instrumented run; uninstrument() after it"
            )
        )
        self.once = once
        if once:
            self.instrumentor.instrument(**self.options)

    def plain(self, timed: Callable[[], Any]) -> Any:
        """``gc.collect()``, then ``timed()`` uninstrumented; with ``once``, under ``suppress_instrumentation()``."""
        gc.collect()
        if not self.once:
            return timed()
        from opentelemetry.instrumentation.utils import suppress_instrumentation

        with suppress_instrumentation():
            return timed()

    def run(self, timed: Callable[[], Any]) -> Tuple[Any, float, float]:
        """``instrument()``, ``gc.collect()``, ``timed()`` (the call, which times itself), then the
        work it deferred, outside its timer: ``tracer_provider.force_flush()`` (drains the background
        emitter, then the span processor; with ``otlp-encode`` that is the encoding) and
        ``meter_provider.force_flush()`` (the metric collection), each timed; ``uninstrument()``.

        With ``once``, the instrumentor set up in the constructor is used and kept.

        Returns:
            ``(timed()'s result, trace flush seconds, metric flush seconds)``.
        """
        if not self.once:
            self.instrumentor.instrument(**self.options)
        try:
            gc.collect()
            result = timed()
            start = self.clock()
            traced = self.tracer_provider.force_flush()
            middle = self.clock()
            metered = self.meter_provider.force_flush()
            end = self.clock()
        finally:
            if not self.once:
                self.instrumentor.uninstrument()
        self.flushes_complete = self.flushes_complete and traced is not False and metered is not False
        return result, middle - start, end - middle

    def spans_expected(self, tokens_per_request: Sequence[int]) -> Optional[int]:
        """Spans the requests should export: each a request span and one span per step (at most
        ``max_step_spans``; one prefill step, then one per further token), unless the step-span
        policy emits none (``none``) or only some (``slow``: not predictable, ``None``); none at all
        when the sampler keeps no trace (``always_off``)."""
        if self.sampler == "always_off":
            return 0
        if self.policy == STEP_SPANS_ALL:
            return sum(1 + min(n, self.max_step_spans) for n in tokens_per_request)
        if self.policy == STEP_SPANS_NONE:
            return len(tokens_per_request)
        return None

    def shutdown(self) -> None:
        if self.once and self.instrumentor.is_instrumented_by_opentelemetry:
            self.instrumentor.uninstrument()
        self.tracer_provider.shutdown()
        self.meter_provider.shutdown()


#: The ``order`` of every A/B result.
ORDER = "A B A B (plain, then instrumented, per pair); deferred work finished after each B, untimed by A or B"


@dataclass
class Pairs:
    """What :func:`interleave` measured: one entry per pair, seconds; spans and bytes after the warmup."""

    plain_s: List[float] = field(default_factory=list)
    instrumented_s: List[float] = field(default_factory=list)
    trace_flush_s: List[float] = field(default_factory=list)
    metric_flush_s: List[float] = field(default_factory=list)
    spans_exported_after: List[int] = field(default_factory=list)  # cumulative, after each pair's flush
    spans_exported: int = 0
    exported_bytes: Optional[int] = None  # otlp-encode: span bytes of the pairs; discard: None
    exported_bytes_total: Optional[int] = None  # the same, warmup included
    exported_metric_bytes: Optional[int] = None

    @property
    def deferred_s(self) -> List[float]:
        """Per pair: the instrumented call's deferred work, trace flush + metric flush."""
        return [t + m for t, m in zip(self.trace_flush_s, self.metric_flush_s)]

    def timings(self) -> Dict[str, List[float]]:
        """The per-pair seconds under their result keys."""
        return {
            "plain_elapsed_s": self.plain_s,
            "instrumented_elapsed_s": self.instrumented_s,
            "deferred_trace_flush_s": self.trace_flush_s,
            "deferred_metric_flush_s": self.metric_flush_s,
            "instrumented_deferred_s": self.deferred_s,
        }

    def ratios(self) -> Tuple[List[float], List[float]]:
        """``(instrumented / plain, (instrumented + deferred) / plain)`` per pair."""
        a, b, d = self.plain_s, self.instrumented_s, self.deferred_s
        return [y / x for x, y in zip(a, b)], [(y + z) / x for x, y, z in zip(a, b, d)]

    def added_us_per_step(self, steps: Sequence[int]) -> Tuple[List[float], List[float]]:
        """``((instrumented - plain) / steps, (instrumented + deferred - plain) / steps)`` per pair, microseconds."""
        a, b, d = self.plain_s, self.instrumented_s, self.deferred_s
        return (
            [(y - x) / n * 1e6 for x, y, n in zip(a, b, steps)],
            [(y + z - x) / n * 1e6 for x, y, z, n in zip(a, b, d, steps)],
        )


def interleave(
    side: InstrumentedSide,
    timed: Callable[[], Tuple[Any, float]],
    config: BenchConfig,
    record: Callable[[Any, float, Any], None],
    monitor: Optional[LoadMonitor] = None,
    label: str = "pair",
    progress: Optional[Progress] = None,
    phase: str = "pairs",
) -> Pairs:
    """Plain vs instrumented, interleaved A B A B: ``config.warmup`` pairs, then ``config.runs`` pairs.

    ``timed()`` makes one timed call and returns ``(its output, seconds)``; plain is
    :meth:`InstrumentedSide.plain`, instrumented :meth:`InstrumentedSide.run` (which finishes the
    deferred work outside the timer). After each measured pair ``record(plain output, plain
    seconds, instrumented output)`` runs, then ``monitor`` reads the load (``"{label} {n}"``) and
    ``progress`` counts two runs done (the phase is ``"{phase}, warmup"``, then ``phase``).
    The side is left as it is: the caller shuts it down.
    """
    progress = progress if progress is not None else Progress()
    exporter, metric_reader = side.exporter, side.metric_reader
    if config.warmup:
        progress.phase(f"{phase}, warmup")
    for _ in range(config.warmup):
        side.plain(timed)
        side.run(timed)
        progress.advance(2)
    progress.phase(phase)
    spans_before = exporter.spans
    bytes_before = exporter.bytes
    metric_exporter = getattr(metric_reader, "exporter", None)
    metric_bytes_before = metric_exporter.bytes if metric_exporter is not None else None
    side.flushes_complete = True
    pairs = Pairs()
    for pair in range(config.runs):
        out_a, elapsed_a = side.plain(timed)
        (out_b, elapsed_b), flush_trace, flush_metric = side.run(timed)
        pairs.spans_exported_after.append(exporter.spans - spans_before)
        pairs.plain_s.append(elapsed_a)
        pairs.instrumented_s.append(elapsed_b)
        pairs.trace_flush_s.append(flush_trace)
        pairs.metric_flush_s.append(flush_metric)
        record(out_a, elapsed_a, out_b)
        if monitor is not None:
            monitor.read(f"{label} {pair + 1}")
        progress.advance(2)
    pairs.spans_exported = exporter.spans - spans_before
    pairs.exported_bytes_total = exporter.bytes
    pairs.exported_bytes = None if exporter.bytes is None else exporter.bytes - bytes_before
    if metric_exporter is not None:
        pairs.exported_metric_bytes = metric_exporter.bytes - metric_bytes_before
    return pairs


# --------------------------------------------------------------------------------------------
# The frame of a result document
# --------------------------------------------------------------------------------------------


def begin(
    config: BenchConfig, uninstrumented: bool, progress: Optional[Progress] = None, runs: int = 0
) -> Tuple[LoadMonitor, str]:
    """Validate, show ``progress`` (``runs`` in all, phase "set-up"), start the load monitor (first
    reading ``"start"``; a busy machine is said at once through ``progress``), resolve the device;
    with ``uninstrumented``, refuse a process where ``generate()`` is already instrumented.

    Raises:
        BenchUsageError: invalid input, no CUDA for ``--device cuda``, or generate() instrumented.
    """
    config.validate()
    progress = progress if progress is not None else Progress()
    progress.begin(runs, "set-up (torch, transformers, the model)")
    monitor = LoadMonitor(own_threads=config.threads, on_busy=progress.say)
    monitor.read("start")
    device = resolve_device(config.device)
    if uninstrumented:
        check_uninstrumented()
    return monitor, device


@contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """``torch.set_num_threads(threads)`` for the block; the previous count is restored after it."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def document_head(config: BenchConfig, device: str, model: Any) -> Dict[str, Any]:
    """The keys every timed bench document starts with: versions, date, command, environment,
    machine, model, device, dtype, parameters."""
    return {
        "versions": versions(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": list(config.argv),
        # settings the instrumentation reads from the environment (e.g. OTEL_GENERATE_MAX_STEP_SPANS)
        "environment": {k: v for k, v in sorted(os.environ.items()) if k.startswith("OTEL_GENERATE_")},
        "machine": machine(device),
        "model": model_description(config, model),
        "device": str(model.device),
        "dtype": config.dtype,
        "parameters": int(sum(p.numel() for p in model.parameters())),
    }


def finish(result: Dict[str, Any], monitor: LoadMonitor, flushes_complete: bool) -> Dict[str, Any]:
    """The last reading (``"end"``), the ``load`` section and the ``warnings`` (a busy machine, a
    flush that timed out); returns ``result``."""
    monitor.read("end")
    result["load"] = monitor.report()
    warnings = [result["load"]["warning"]] if result["load"]["warning"] else []
    if not flushes_complete:
        warnings.append("a flush of deferred work timed out: some deferred work was not charged to its run")
    result["warnings"] = warnings
    return result
