"""Where spans and metrics are built: one finished :class:`~otel_generate.request.Request` in,
telemetry out, whichever producer recorded it.

* :func:`start_request_span` starts the request span (``text_completion {model}``) when the
  request starts, so that sampling is decided before any per-step work and the application's
  own spans made during the request are its children.
* :func:`hand_over` is the one hand-over of a finished request, called once by each producer: it
  captures the caller's OpenTelemetry ``Context`` and either queues the request's
  :class:`Emission` on the background emitter or builds it at once (:func:`finish` builds at once).
* An :class:`Emission` ends the request: it derives the request's figures once
  (:func:`otel_generate.derive.derive`: only those that will be read), then sets the request
  attributes, builds the step spans (from the recorded timestamps with explicit start and end
  times, at most ``max_step_spans``), records the metrics (with the request span in the context
  handed to ``record()``, so exemplars point at it) and builds the
  :class:`~otel_generate.record.GenerationRecord` handed to profilers; with opt-in content capture
  (:mod:`otel_generate.content`), the messages on the span and/or the
  ``gen_ai.client.inference.operation.details`` event (a log record), and the step token ids and
  log-probabilities on the step spans. Everything is built on the request's captured context.

Names and buckets come from :mod:`otel_generate.attributes`; the figures (seconds) from the
:class:`~otel_generate.derive.Summary`. The telemetry context handed in is
:class:`otel_generate.telemetry.Telemetry`.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any, Dict, Optional, Sequence, Tuple

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from otel_generate import _lifecycle
from otel_generate import attributes as A
from otel_generate._faults import Fault, error_type, log_fault_once
from otel_generate.derive import Summary, derive
from otel_generate.record import GenerationRecord
from otel_generate.request import Request
from otel_generate.telemetry import Telemetry

#: On the background emitter, yield the interpreter lock after every this many step spans.
BACKGROUND_YIELD_EVERY = 16


def request_span_name(model: str) -> str:
    """``{gen_ai.operation.name} {gen_ai.request.model}``, as the GenAI span conventions name it."""
    return f"{A.OPERATION_TEXT_COMPLETION} {model}"


def start_request_span(telemetry: Telemetry, model: str, context: Any = None, start_time: Optional[int] = None) -> Any:
    """Start the request span of ``model`` (kind INTERNAL), a child of ``context`` (default: current).

    ``start_time`` is nanoseconds since the epoch (default: now).
    """
    name, attributes = _request_span_start(model)
    return telemetry.tracer.start_span(
        name, context=context, kind=SpanKind.INTERNAL, start_time=start_time, attributes=attributes
    )


#: model -> (span name, start attributes), for the first :data:`_METRIC_ATTRIBUTE_SETS` models: the
#: tracer copies the attributes it is given, so one dict serves every request of a model
_request_span_starts: Dict[str, Tuple[str, Dict[str, Any]]] = {}


def _request_span_start(model: str) -> Tuple[str, Dict[str, Any]]:
    found = _request_span_starts.get(model)
    if found is None:
        found = (
            request_span_name(model),
            {
                A.GEN_AI_OPERATION_NAME: A.OPERATION_TEXT_COMPLETION,
                A.GEN_AI_PROVIDER_NAME: A.PROVIDER_TRANSFORMERS,
                A.GEN_AI_REQUEST_MODEL: model,
                A.GEN_AI_RESPONSE_MODEL: model,
            },
        )
        if len(_request_span_starts) < _METRIC_ATTRIBUTE_SETS:
            _request_span_starts[model] = found
    return found


def hand_over(
    telemetry: Telemetry,
    span: Any,
    request: Request,
    profilers: Sequence[Any] = (),
    context: Any = None,
    need_record: bool = False,
    background: Optional[bool] = None,
) -> Tuple[Optional[GenerationRecord], bool]:
    """The one hand-over of a finished request: its telemetry is built now, or on the background
    emitter. Every producer calls it once per request.

    Args:
        telemetry, span, request, profilers, need_record: as :func:`finish`.
        context: the OpenTelemetry ``Context`` the request was made in, which every span, metric
            and event of the request is built on (so that a span processor or a sampler sees the
            caller's baggage and values, on whichever thread the spans are built); default: the
            current context, the caller's (captured here: it is one immutable object).
        background: build on the emitter (``None``: as the ``background_emission`` option says).
            Never for a request that raised (its traceback holds the caller's frames, which must
            not outlive the call), one a profiler or the caller waits for (``need_record``), or
            one handed over on the emitter's own thread (built there at once).

    Returns:
        ``(record, deferred)``: the record when built now and read (else ``None``), and whether the
        request was handed to the emitter (a full emitter drops it, counted and logged once).
    """
    if context is None:
        context = otel_context.get_current()
    emission = Emission(telemetry, span, request, context, profilers, need_record)
    emitter = telemetry.emitter
    if emitter is not None:
        if emitter.on_worker():  # (continuous batching's job, a request made from a span processor)
            emission.yield_every = BACKGROUND_YIELD_EVERY
        elif (
            (telemetry.options.background_emission if background is None else background)
            and not profilers
            and not need_record
            and request.error is None
        ):
            _lifecycle.recorded = True  # this process has telemetry of its own to flush at exit
            emission.yield_every = BACKGROUND_YIELD_EVERY
            emitter.submit(emission)
            return None, True
    return emission(), False


def finish(
    telemetry: Telemetry,
    span: Any,
    request: Request,
    profilers: Sequence[Any] = (),
    yield_every: int = 0,
    need_record: bool = False,
    context: Any = None,
) -> Optional[GenerationRecord]:
    """Turn a finished request into telemetry now, on this thread, then end ``span``; never raises.

    The metrics are recorded for every request, whether its span is sampled or not. An unsampled
    request (``span`` not recording) with no profiler and ``need_record`` false builds no
    attribute, no span and no record: only its metrics (and the opt-in content event).

    Args:
        telemetry: from ``instrument()`` (:class:`~otel_generate.telemetry.Telemetry`).
        span: the request span from :func:`start_request_span` (recording or not).
        request: the finished record (``end_ns`` set; ``error`` set when the request raised).
        profilers: :class:`~otel_generate.TokenLatencyProfiler` objects to hand the record to.
        yield_every: on a background thread, yield the interpreter lock after every this many
            step spans (0: never).
        need_record: build the record even when neither the span nor a profiler reads it
            (``track_token_latency``).
        context: the ``Context`` the request was made in (default: the current one).

    Returns:
        The :class:`GenerationRecord` given to profilers and callers; ``None`` when no one reads
        it (no profiler and ``need_record`` false) or building it failed (the fault is logged
        once; the span still ends).
    """
    if context is None:
        context = otel_context.get_current()
    emission = Emission(telemetry, span, request, context, profilers, need_record)
    emission.yield_every = yield_every
    return emission()


#: :attr:`Emission._summary` before the request's figures are derived
_UNDERIVED: Any = object()


class Emission:
    """One finished request's telemetry, built in three parts: the spans (the request span's
    attributes, the step spans, the request span's end), the metrics, and the opt-in content
    event. Called, it builds them all (on the background emitter, or at once). A flush of the
    meter or logger provider runs that signal's part of every queued request on its own thread
    first (:meth:`run_part`), so that it never waits for spans; each part runs once, whichever
    thread gets to it first, from figures derived once."""

    __slots__ = (
        "telemetry",
        "span",
        "request",
        "context",
        "profilers",
        "need_record",
        "yield_every",
        "_lock",
        "_summary",
        "_detailed",
        "_metrics_done",
        "_event_done",
    )

    def __init__(
        self,
        telemetry: Telemetry,
        span: Any,
        request: Request,
        context: Any,
        profilers: Sequence[Any] = (),
        need_record: bool = False,
    ) -> None:
        self.telemetry = telemetry
        self.span = span
        self.request = request
        self.context = context
        self.profilers = profilers
        self.need_record = need_record
        self.yield_every = 0
        self._lock = threading.RLock()  # (re-entrant: an exporter that flushes from inside a part)
        self._summary: Any = _UNDERIVED
        self._detailed = False
        self._metrics_done = False
        self._event_done = False

    def _derive(self) -> Optional[Summary]:
        """The request's figures, derived once (the lock held): only those that will be read."""
        with self._lock:
            if self._summary is not _UNDERIVED:
                return self._summary
            request, telemetry = self.request, self.telemetry
            recording = self.span.is_recording()
            detailed = recording or bool(self.profilers) or self.need_record
            inter_token = bool(telemetry.instruments) and request.metrics
            inter_token = inter_token and A.METRIC_INTER_TOKEN_LATENCY in telemetry.instruments
            try:
                summary: Optional[Summary] = derive(
                    request, telemetry.policy, steps=detailed, spans=recording, inter_token=inter_token
                )
            except Exception as fault:  # the step data is malformed: the request's own figures may still do
                request.incomplete = True
                log_fault_once(Fault.REQUEST_ACCOUNTING, fault)
                detailed = False
                try:
                    summary = derive(request)
                except Exception:
                    summary = None
            self._summary, self._detailed = summary, detailed
            return summary

    def run_part(self, signal: str) -> None:
        """The request's metrics (``"metrics"``) or content event (``"logs"``), unless already
        done; on any thread; never raises."""
        with self._lock:
            if signal == "metrics":
                if self._metrics_done:
                    return
                self._metrics_done = True
                instruments = self.telemetry.instruments
                summary = self._derive()
                if instruments and self.request.metrics and summary is not None:
                    try:  # every request, also one whose attributes faulted
                        _record_metrics(instruments, self.span, self.request, summary, self.context, self.yield_every)
                    except Exception as fault:
                        log_fault_once(Fault.METRICS, fault)
            elif signal == "logs":
                if self._event_done:
                    return
                self._event_done = True
                content = self.telemetry.content
                if content is not None and content.event_logger is not None:
                    try:
                        _emit_details_event(content.event_logger, self.span, self.request, self._derive(), self.context)
                    except Exception as fault:
                        log_fault_once(Fault.CONTENT_EVENT, fault)

    def __call__(self) -> Optional[GenerationRecord]:
        """Build everything not built yet, end the span, hand the record to the profilers."""
        _lifecycle.recorded = True  # this process has telemetry of its own to flush at exit
        telemetry, span, request, profilers = self.telemetry, self.span, self.request, self.profilers
        record = None
        summary = self._derive()
        if self._detailed and summary is not None:
            try:
                record = _annotate(
                    telemetry,
                    span,
                    request,
                    summary,
                    self.yield_every,
                    bool(profilers) or self.need_record,
                    self.context,
                )
            except Exception as fault:
                request.incomplete = True
                log_fault_once(Fault.REQUEST_ACCOUNTING, fault)
        self.run_part("logs")
        try:
            if request.incomplete and span.is_recording():
                span.set_attribute(A.GENERATE_STEPS_INCOMPLETE, True)
            end = request.end_ns
            span.end(end_time=request.wall_ns(end) if end is not None else None)
        except Exception as fault:
            log_fault_once(Fault.REQUEST_SPAN_END, fault)
        self.run_part("metrics")
        if record is not None:
            for profiler in profilers:
                try:
                    profiler._add(record)
                except Exception as fault:
                    log_fault_once(Fault.PROFILER, fault)
        return record


def _annotate(
    telemetry: Telemetry,
    span: Any,
    request: Request,
    summary: Summary,
    yield_every: int = 0,
    record: bool = True,
    context: Any = None,
) -> Optional[GenerationRecord]:
    """Set the request attributes and build the step spans (a recording span); return the record
    for the APIs when ``record`` (a profiler or the caller reads it), else ``None``. Reads the
    figures from ``summary`` only."""
    latencies_s = summary.step_latencies_s
    if span.is_recording():
        attrs: Dict[str, Any] = dict(request.parameters)
        _add_response_attributes(attrs, request, summary)
        if summary.streamer_s is not None:
            attrs[A.GENERATE_STREAMER_DURATION] = summary.streamer_s
        if request.request_id is not None:
            attrs[A.GEN_AI_RESPONSE_ID] = request.request_id
        if summary.time_in_queue_s is not None:
            attrs[A.GENERATE_TIME_IN_QUEUE] = summary.time_in_queue_s
        if request.discarded_output_tokens is not None:
            attrs[A.GENERATE_USAGE_DISCARDED_OUTPUT_TOKENS] = request.discarded_output_tokens
        for key, value in (  # each where known (the energy figures only with generate.energy)
            (A.GENERATE_MEMORY_PEAK_ALLOCATED, request.memory_peak_bytes),
            (A.GENERATE_KV_CACHE_SIZE, request.kv_cache_bytes),
            (A.GENERATE_ASSISTED_PROPOSED, request.candidates_proposed),
            (A.GENERATE_ASSISTED_ACCEPTED, request.candidates_accepted),
            (A.GENERATE_ASSISTED_ACCEPTANCE_RATE, summary.acceptance_rate),
            (A.GENERATE_ENERGY, summary.energy_j),
            (A.GENERATE_ENERGY_PER_OUTPUT_TOKEN, summary.energy_per_output_token_j),
            (A.GENERATE_ENERGY_PER_TOTAL_TOKEN, summary.energy_per_total_token_j),
            (A.GENERATE_ENERGY_PREFILL, summary.energy_prefill_j),
            (A.GENERATE_ENERGY_DECODE, summary.energy_decode_j),
        ):
            if value is not None:
                attrs[key] = value
        steps_unseen = summary.steps_unseen
        if request.timed:
            attrs[A.GENERATE_SYNCHRONIZED] = request.synchronized
            if request.clock is not None:
                attrs[A.GENERATE_CLOCK] = request.clock
            if request.device is not None:
                attrs[A.GENERATE_DEVICE] = request.device
            if request.unobserved is not None:
                attrs[A.GENERATE_STEPS_UNOBSERVED] = request.unobserved
            elif request.uninstrumented:
                attrs[A.GENERATE_STEPS_UNINSTRUMENTED] = True
            if not steps_unseen:
                attrs[A.GENERATE_STEPS] = len(summary.step_latencies_ns)
                attrs[A.GENERATE_STEP_SPANS_POLICY] = telemetry.policy.name
                if summary.reason is not None:
                    attrs[A.GENERATE_STEP_SPANS_REASON] = summary.reason
                attrs[A.GENERATE_STEP_SPANS_EMITTED] = summary.steps_emitted
                if latencies_s:
                    attrs[A.GENERATE_STEP_LATENCIES] = latencies_s[: telemetry.policy.max_step_spans]
                attrs[A.GENERATE_STEP_OUTLIERS] = len(summary.outliers)
            if summary.time_to_first_token_s is not None:
                attrs[A.GENERATE_TIME_TO_FIRST_TOKEN] = summary.time_to_first_token_s
            if summary.time_per_output_token_s is not None:
                attrs[A.GENERATE_TIME_PER_OUTPUT_TOKEN] = summary.time_per_output_token_s
        content = telemetry.content
        if content is not None and content.mode.on_span:
            if request.input_messages is not None:
                attrs[A.GEN_AI_INPUT_MESSAGES] = _json(request.input_messages)
            if request.output_messages is not None:
                attrs[A.GEN_AI_OUTPUT_MESSAGES] = _json(request.output_messages)
        if request.error is not None:
            attrs[A.ERROR_TYPE] = summary.error_type
            span.record_exception(request.error)
            span.set_status(Status(StatusCode.ERROR, f"{type(request.error).__name__}: {request.error}"))
        if not steps_unseen:
            attrs[A.GENERATE_STEP_SPANS_DROPPED] = len(summary.step_latencies_ns) - summary.step_spans
        span.set_attributes(attrs)
        _emit_steps(telemetry, span, request, summary, yield_every, context)
    if not record:
        return None
    return GenerationRecord(
        model=request.model,
        strategy=request.parameters.get(A.GENERATE_STRATEGY),
        device=request.device,
        synchronized=request.synchronized,
        duration_s=summary.duration_s,
        step_latencies_s=latencies_s,
        step_tokens=list(request.step_tokens),
        input_tokens=request.input_tokens,
        output_tokens=request.output_tokens,
        output_tokens_per_sequence=list(request.output_tokens_per_sequence),
        error_type=summary.error_type,
        incomplete=request.incomplete,
        time_to_first_token_s=summary.time_to_first_token_s,
        time_per_output_token_s=summary.time_per_output_token_s,
    )


def _emit_steps(
    telemetry: Telemetry, span: Any, request: Request, summary: Summary, yield_every: int = 0, context: Any = None
) -> None:
    """The inner-call spans (when the request ran several loops) and the first
    ``summary.step_spans`` step spans, each step a child of its inner-call span, else of the
    request span, all in the request's ``context`` (the caller's baggage and values). The hot
    loop of emission: everything it reads is bound to a local first."""
    emitted = summary.step_spans
    if not emitted and not request.calls:  # (no span to build: no parent context either)
        return
    tracer = telemetry.tracer
    wall_offset = request.start_wall_ns - request.start_ns
    parent = trace.set_span_in_context(span, context)
    parents = [parent] * emitted
    for call in request.calls:
        group = tracer.start_span(
            A.SPAN_INNER_GENERATE,
            context=parent,
            kind=SpanKind.INTERNAL,
            start_time=call.start_ns + wall_offset,
            attributes=call.attributes,
        )
        group.end(end_time=(call.end_ns if call.end_ns is not None else request.end_ns) + wall_offset)
        inner = trace.set_span_in_context(group, context)
        for index in range(call.first_step, min(call.first_step + call.steps, emitted)):
            parents[index] = inner
    if not emitted:
        return
    start_span = tracer.start_span
    internal = SpanKind.INTERNAL
    starts, ends = summary.step_starts_ns, summary.step_ends_ns
    latencies_s = summary.step_latencies_s
    outliers = summary.outliers
    tokens = request.step_tokens
    prefill = summary.prefill
    step_requests = request.step_requests
    token_ids = request.step_token_ids or ()  # opt-in content, one list per step
    logprobs = request.step_logprobs or ()
    energies = summary.step_energies_j
    extra = bool(step_requests is not None or token_ids or logprobs or outliers or energies is not None)
    INDEX, TOKEN, TOKENS, LATENCY = (
        A.GENERATE_STEP_INDEX,
        A.GENERATE_TOKEN_INDEX,
        A.GENERATE_STEP_TOKENS,
        A.GENERATE_STEP_LATENCY,
    )
    PREFILL, DECODE = A.STEP_SPAN_PREFILL, A.STEP_SPAN_DECODE
    token_index = 0
    for index in range(emitted):
        attributes = {INDEX: index, TOKEN: token_index, TOKENS: tokens[index], LATENCY: latencies_s[index]}
        if extra:
            if step_requests is not None:
                attributes[A.GENERATE_STEP_REQUESTS] = step_requests[index]
            if index in outliers:
                attributes[A.GENERATE_STEP_OUTLIER] = True
            if energies is not None:
                attributes[A.GENERATE_STEP_ENERGY] = energies[index]
            if index < len(token_ids) and token_ids[index]:
                attributes[A.GENERATE_STEP_TOKEN_IDS] = token_ids[index]
            if index < len(logprobs) and logprobs[index]:
                attributes[A.GENERATE_STEP_LOGPROBS] = logprobs[index]
        token_index += tokens[index]
        try:
            start_span(
                PREFILL if index in prefill else DECODE,
                context=parents[index],
                kind=internal,
                start_time=starts[index] + wall_offset,
                attributes=attributes,
            ).end(end_time=ends[index] + wall_offset)
        except Exception as fault:  # a span processor raised: the other steps and the metrics still go
            log_fault_once(Fault.STEP_SPAN_EXPORT, fault)
        if yield_every and index % yield_every == yield_every - 1:
            time.sleep(0)  # a background emitter lets the producer run


def _add_response_attributes(attrs: Dict[str, Any], request: Request, summary: Optional[Summary]) -> None:
    """The GenAI response attributes the request span and the details event share: token usage,
    finish reasons and time to first chunk (seconds), each only when known."""
    if request.input_tokens is not None:
        attrs[A.GEN_AI_USAGE_INPUT_TOKENS] = request.input_tokens
    if request.output_tokens is not None:
        attrs[A.GEN_AI_USAGE_OUTPUT_TOKENS] = request.output_tokens
    if request.finish_reasons is not None:
        attrs[A.GEN_AI_RESPONSE_FINISH_REASONS] = list(request.finish_reasons)
    if summary is not None and summary.time_to_first_chunk_s is not None:
        attrs[A.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK] = summary.time_to_first_chunk_s


def _json(messages: Any) -> str:
    """Messages as the JSON string a span attribute holds (compact, non-ASCII kept as is)."""
    return json.dumps(messages, ensure_ascii=False, separators=(",", ":"))


def _emit_details_event(
    logger: Any, span: Any, request: Request, summary: Optional[Summary], context: Any = None
) -> None:
    """The ``gen_ai.client.inference.operation.details`` event of one request, in the request span's
    context (built on the request's ``context``).

    Its attributes are the request's ``gen_ai.*`` attributes and ``error.type`` (as on the span),
    and the messages in structured form when they were captured (GenAI events page, semantic
    conventions v1.41). Needs ``opentelemetry-api`` >= 1.35 for ``LogRecord(event_name=...)`` and
    an SDK >= 1.37 to accept an API ``LogRecord``; on an older API the event is skipped (logged once).
    """
    from opentelemetry._logs import LogRecord

    attrs: Dict[str, Any] = {
        A.GEN_AI_OPERATION_NAME: A.OPERATION_TEXT_COMPLETION,
        A.GEN_AI_PROVIDER_NAME: A.PROVIDER_TRANSFORMERS,
        A.GEN_AI_REQUEST_MODEL: request.model,
        A.GEN_AI_RESPONSE_MODEL: request.model,
    }
    attrs.update((key, value) for key, value in request.parameters.items() if key.startswith("gen_ai."))
    _add_response_attributes(attrs, request, summary)
    if request.error is not None:
        attrs[A.ERROR_TYPE] = summary.error_type if summary is not None else error_type(request.error)
    if request.input_messages is not None:
        attrs[A.GEN_AI_INPUT_MESSAGES] = request.input_messages
    if request.output_messages is not None:
        attrs[A.GEN_AI_OUTPUT_MESSAGES] = request.output_messages
    end = request.end_ns
    try:
        record = LogRecord(
            timestamp=request.wall_ns(end) if end is not None else None,
            context=trace.set_span_in_context(span, context),
            attributes=attrs,
            event_name=A.EVENT_INFERENCE_OPERATION_DETAILS,
        )
    except TypeError as fault:  # opentelemetry-api < 1.35: no event_name, no context
        raise RuntimeError("the content event needs opentelemetry-api >= 1.35 and opentelemetry-sdk >= 1.37") from fault
    logger.emit(record)


#: (model, error type) -> :func:`_metric_attributes` (at most :data:`_METRIC_ATTRIBUTE_SETS` of them)
_metric_attribute_sets: Dict[Tuple[str, Optional[str]], tuple] = {}
_METRIC_ATTRIBUTE_SETS = 64


def _metric_attributes(model: str, error_type: Optional[str]) -> tuple:
    """``(base, input usage, output usage)``: the attributes of a request's histograms (operation,
    provider, model and, for a failed request, ``error.type``) and those of its two token usage
    values (``gen_ai.token.type`` added). The same dicts for every request of ``model`` with
    ``error_type`` (remembered for the first :data:`_METRIC_ATTRIBUTE_SETS` pairs): ``record()``
    reads its attributes and keeps no reference it changes."""
    found = _metric_attribute_sets.get((model, error_type))
    if found is not None:
        return found
    base = {
        A.GEN_AI_OPERATION_NAME: A.OPERATION_TEXT_COMPLETION,
        A.GEN_AI_PROVIDER_NAME: A.PROVIDER_TRANSFORMERS,
        A.GEN_AI_REQUEST_MODEL: model,
    }
    if error_type is not None:
        base[A.ERROR_TYPE] = error_type
    found = (
        base,
        {**base, A.GEN_AI_TOKEN_TYPE: A.TOKEN_TYPE_INPUT},
        {**base, A.GEN_AI_TOKEN_TYPE: A.TOKEN_TYPE_OUTPUT},
    )
    if len(_metric_attribute_sets) < _METRIC_ATTRIBUTE_SETS:
        _metric_attribute_sets[(model, error_type)] = found
    return found


def _record_metrics(
    instruments: Dict[str, Any],
    span: Any,
    request: Request,
    summary: Summary,
    base_context: Any = None,
    yield_every: int = 0,
) -> None:
    """The GenAI histograms and the inter-token latency histogram of one request, from its
    ``summary``, through the public ``Histogram.record(value, attributes, context=...)``.

    The context handed to ``record()`` is the request's ``base_context`` (the caller's) holding the
    request span when it is sampled, so exemplars point at it; an unsampled request's measurements
    are recorded under no span at all, so no exemplar points at a trace that was not kept. Nothing
    is attached to the thread's context. ``yield_every``: on a background thread, yield the
    interpreter lock after every this many inter-token values (0: never).
    """
    error = summary.error_type is not None
    base, input_usage, output_usage = _metric_attributes(request.model, summary.error_type)
    exemplar_span = span if span.get_span_context().trace_flags.sampled else trace.INVALID_SPAN
    context = trace.set_span_in_context(exemplar_span, base_context)
    duration_s = summary.duration_s
    instruments[A.METRIC_REQUEST_DURATION].record(duration_s, base, context=context)
    instruments[A.METRIC_CLIENT_OPERATION_DURATION].record(duration_s, base, context=context)
    # defined for successful responses only (GenAI metrics page); the inter-token latency alike
    if not error:
        if summary.time_to_first_token_s is not None:
            instruments[A.METRIC_TIME_TO_FIRST_TOKEN].record(summary.time_to_first_token_s, base, context=context)
        if summary.time_per_output_token_s is not None:
            instruments[A.METRIC_TIME_PER_OUTPUT_TOKEN].record(summary.time_per_output_token_s, base, context=context)
        energy = instruments.get(A.METRIC_ENERGY_PER_OUTPUT_TOKEN)
        if summary.energy_per_output_token_j is not None and energy is not None:
            energy.record(summary.energy_per_output_token_j, base, context=context)
    usage = instruments.get(A.METRIC_TOKEN_USAGE)
    if usage is not None:
        if request.input_tokens is not None:
            usage.record(request.input_tokens, input_usage, context=context)
        if request.output_tokens is not None:
            usage.record(request.output_tokens, output_usage, context=context)
    if not error and summary.time_per_output_token_s is not None:
        inter_token = instruments.get(A.METRIC_INTER_TOKEN_LATENCY)
        if inter_token is not None:
            record = inter_token.record
            # one value per decode step, as vLLM records it; each with the request span in its
            # context: which of them the application's reservoir keeps as exemplars is its own View's
            # and reservoir's choice, which no public call shows
            for index, value in enumerate(summary.inter_token_latencies_s):
                record(value, base, context=context)
                if yield_every and index % yield_every == yield_every - 1:
                    time.sleep(0)  # a background emitter lets the producer run
