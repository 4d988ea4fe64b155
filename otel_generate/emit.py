"""Where spans and metrics are built: one finished :class:`~otel_generate.request.Request` in,
telemetry out, whichever producer recorded it.

* :func:`start_request_span` starts the request span (``text_completion {model}``) when the
  request starts, so that sampling is decided before any per-step work and the application's
  own spans made during the request are its children.
* :func:`finish` ends it: the request attributes, the step spans (built from the recorded
  timestamps with explicit start and end times, at most ``max_step_spans``), the metrics
  (recorded while the request span is the current span, so exemplars point at it) and the
  :class:`~otel_generate.record.GenerationRecord` handed to profilers; with opt-in content
  capture (:mod:`otel_generate.content`), the messages on the span and/or the
  ``gen_ai.client.inference.operation.details`` event (a log record), and the step token ids and
  log-probabilities on the step spans.

Names and buckets come from :mod:`otel_generate.attributes`; durations are converted from the
record's nanoseconds here and nowhere else.
"""

from __future__ import annotations

import json
import os
import threading
import time
import weakref
from typing import Any, Callable, Collection, Dict, Optional, Sequence

from opentelemetry import context as otel_context
from opentelemetry import metrics, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from otel_generate import _lifecycle, clock
from otel_generate import attributes as A
from otel_generate._faults import error_type, log_fault_once
from otel_generate.fast_spans import fast_eligible
from otel_generate.record import GenerationRecord
from otel_generate.request import Request, seconds
from otel_generate.version import __version__

INSTRUMENTATION_NAME = "otel_generate"


class Telemetry:
    """What ``instrument()`` set up: the tracer, the metric instruments and the options.

    Attributes:
        tracer: the ``opentelemetry.trace.Tracer`` of this package.
        instruments: metric name -> histogram (empty: no metrics).
        synchronize: wait for the device before each clock read.
        max_step_spans: at most this many step spans per request.
        skip_candidate_calls: transformers < 4.47 calls the stopping criteria on assisted
            decoding's candidates too (not a step boundary).
        profilers: returns the :class:`~otel_generate.TokenLatencyProfiler` objects open in the
            current context.
        active: False once ``uninstrument()`` ran: a hook left behind in another tool's chain of
            wrappers then only calls its original.
        content: the opt-in content to capture (:class:`~otel_generate.content.ContentOptions`),
            or ``None`` when none is: then no content code runs at all.
        options: the resolved :class:`~otel_generate.options.Options`.
        emitter: the :class:`~otel_generate.background.BackgroundEmitter` (background emission,
            continuous batching), or ``None``.
        slow: the running distributions of the ``slow`` step-span policy, or ``None``.
    """

    def __init__(
        self,
        tracer: trace.Tracer,
        instruments: Optional[Dict[str, Any]],
        synchronize: bool,
        max_step_spans: int,
        skip_candidate_calls: bool,
        profilers: Callable[[], Sequence[Any]],
        content: Any = None,
        options: Any = None,
    ) -> None:
        from otel_generate.options import Options
        from otel_generate.policy import SlowRequests

        self.tracer = tracer
        self.instruments = instruments or {}
        self.synchronize = synchronize
        self.max_step_spans = max_step_spans
        self.skip_candidate_calls = skip_candidate_calls
        self.profilers = profilers
        self.active = True
        self.content = content
        self.options = (
            options if options is not None else Options(synchronize=synchronize, max_step_spans=max_step_spans)
        )
        self.emitter: Any = None
        self.slow = None
        self._metric_probe = self.instruments.get(A.METRIC_REQUEST_DURATION)
        #: requests still in their set-up (``generate()`` entered, the loop's hooks not all reached):
        #: call -> thread ident; ``uninstrument()`` waits for them (bounded) before removing the hooks
        self.setups: Dict[Any, int] = {}
        self.setups_changed = threading.Condition(threading.Lock())
        _TELEMETRIES.add(self)  # a forked child forgets the parent's other threads' set-ups
        from otel_generate.fast_metrics import FastHistogram
        from otel_generate.fast_spans import FastStepSpans

        #: builds step spans directly when that is exactly what the public API would give, else ``None``
        self.fast = FastStepSpans.for_tracer(tracer)
        #: metric name -> FastHistogram: records a request's many values where that gives exactly what
        #: the public record() would, else None
        #: (only the inter-token latency histogram: for a single value the public path costs less)
        itl = self.instruments.get(A.METRIC_INTER_TOKEN_LATENCY)
        self.fast_histograms = {A.METRIC_INTER_TOKEN_LATENCY: FastHistogram.for_instrument(itl)} if itl else {}
        if self.options.step_spans == A.POLICY_SLOW:
            self.slow = SlowRequests(
                self.options.slow_time_to_first_token,
                self.options.slow_time_per_output_token,
                self.options.slow_fraction,
            )

    def _after_fork_in_child(self) -> None:
        """In a forked child only the forking thread exists: the set-ups of the parent's other
        threads will never finish here (``uninstrument()`` would wait for them), and one of those
        threads may have held the set-up lock at the fork (every request would hang on it)."""
        me = threading.get_ident()
        self.setups = {call: thread for call, thread in list(self.setups.items()) if thread == me}
        self.setups_changed = threading.Condition(threading.Lock())

    def metrics_live(self) -> bool:
        """Whether a measurement recorded now reaches a meter provider that aggregates it (an SDK
        ``MeterProvider``): not the API's no-op provider, nor its proxy while no provider is set.
        Asked per request: a global provider may be set after ``instrument()``."""
        probe = self._metric_probe
        if probe is None:
            return False
        real = getattr(probe, "_real_instrument", probe)  # the API's proxy instrument forwards to this one
        return real is not None and not isinstance(real, metrics.NoOpHistogram)

    def start_emitter(self, patches: Any) -> Any:
        """The background emitter (created once), with the SDK providers draining it first."""
        if self.emitter is None:
            from otel_generate.background import BackgroundEmitter, install_drain_hooks

            self.emitter = BackgroundEmitter()
            install_drain_hooks(patches, self.emitter)
        return self.emitter

    def stop_emitter(self) -> None:
        if self.emitter is not None:
            self.emitter.stop()

    def emit(self, span: Any, request: Request, profilers: Sequence[Any] = ()) -> tuple:
        """:func:`finish` now, or on the background emitter when background emission is on (and no
        profiler waits for the record).

        Returns:
            ``(record, deferred)``: the record when built now (else ``None``), and whether the
            request was handed to the emitter (a full emitter drops it, counted and logged once).
        """
        emitter = self.emitter
        if emitter is not None and self.options.background_emission and not profilers:

            def job() -> None:
                finish(self, span, request, (), yield_every=BACKGROUND_YIELD_EVERY)
                request.error = None  # the traceback holds the caller's frames

            emitter.submit(job)
            return None, True
        return finish(self, span, request, profilers), False


#: On the background emitter, yield the interpreter lock after every this many step spans.
BACKGROUND_YIELD_EVERY = 16


def get_tracer(tracer_provider: Any = None) -> trace.Tracer:
    """This package's tracer, with the semantic-conventions :data:`~otel_generate.attributes.SCHEMA_URL`."""
    return trace.get_tracer(INSTRUMENTATION_NAME, __version__, tracer_provider, schema_url=A.SCHEMA_URL)


#: every :class:`Telemetry` alive (``instrument()`` makes one each time): reset in a forked child
_TELEMETRIES: "weakref.WeakSet[Telemetry]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for telemetry in list(_TELEMETRIES):
        try:
            telemetry._after_fork_in_child()
        except Exception as fault:  # pragma: no cover - never break a fork
            log_fault_once("request set-ups after fork", fault)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def create_instruments(meter_provider: Any = None) -> Dict[str, Any]:
    """The GenAI histograms, with the conventions' units and explicit bucket boundaries."""
    meter = metrics.get_meter(INSTRUMENTATION_NAME, __version__, meter_provider, schema_url=A.SCHEMA_URL)

    def histogram(name: str, unit: str, description: str, buckets: Collection[float]) -> Any:
        return meter.create_histogram(
            name, unit=unit, description=description, explicit_bucket_boundaries_advisory=list(buckets)
        )

    return {
        A.METRIC_TIME_TO_FIRST_TOKEN: histogram(
            A.METRIC_TIME_TO_FIRST_TOKEN,
            "s",
            "Time to generate the first token (prefill step).",
            A.BUCKETS_TIME_TO_FIRST_TOKEN_S,
        ),
        A.METRIC_TIME_PER_OUTPUT_TOKEN: histogram(
            A.METRIC_TIME_PER_OUTPUT_TOKEN,
            "s",
            "Time per output token after the first, per request (mean decode step).",
            A.BUCKETS_TIME_PER_OUTPUT_TOKEN_S,
        ),
        A.METRIC_REQUEST_DURATION: histogram(
            A.METRIC_REQUEST_DURATION,
            "s",
            "Duration of the request, as the model server sees it.",
            A.BUCKETS_REQUEST_DURATION_S,
        ),
        A.METRIC_CLIENT_OPERATION_DURATION: histogram(
            A.METRIC_CLIENT_OPERATION_DURATION,
            "s",
            "Duration of the generate() call, as its caller sees it.",
            A.BUCKETS_OPERATION_DURATION_S,
        ),
        A.METRIC_TOKEN_USAGE: histogram(
            A.METRIC_TOKEN_USAGE,
            "{token}",
            "Input and output tokens per request.",
            A.BUCKETS_TOKEN_USAGE,
        ),
        A.METRIC_INTER_TOKEN_LATENCY: histogram(
            A.METRIC_INTER_TOKEN_LATENCY,
            "s",
            "Time between two output tokens of a sequence: each decode step's latency divided by the "
            "tokens it produced per sequence (one observation per decode step).",
            A.BUCKETS_INTER_TOKEN_LATENCY_S,
        ),
    }


def get_event_logger(logger_provider: Any = None) -> Any:
    """This package's logs-API ``Logger`` (for the opt-in content event), with the
    :data:`~otel_generate.attributes.SCHEMA_URL`."""
    from opentelemetry import _logs

    return _logs.get_logger(INSTRUMENTATION_NAME, __version__, logger_provider, schema_url=A.SCHEMA_URL)


def request_span_name(model: str) -> str:
    """``{gen_ai.operation.name} {gen_ai.request.model}``, as the GenAI span conventions name it."""
    return f"{A.OPERATION_TEXT_COMPLETION} {model}"


def start_request_span(telemetry: Telemetry, model: str, context: Any = None, start_time: Optional[int] = None) -> Any:
    """Start the request span of ``model`` (kind INTERNAL), a child of ``context`` (default: current).

    ``start_time`` is nanoseconds since the epoch (default: now).
    """
    return telemetry.tracer.start_span(
        request_span_name(model),
        context=context,
        kind=SpanKind.INTERNAL,
        start_time=start_time,
        attributes={
            A.GEN_AI_OPERATION_NAME: A.OPERATION_TEXT_COMPLETION,
            A.GEN_AI_PROVIDER_NAME: A.PROVIDER_TRANSFORMERS,
            A.GEN_AI_REQUEST_MODEL: model,
            A.GEN_AI_RESPONSE_MODEL: model,
        },
    )


def finish(
    telemetry: Telemetry,
    span: Any,
    request: Request,
    profilers: Sequence[Any] = (),
    yield_every: int = 0,
    need_record: bool = False,
) -> Optional[GenerationRecord]:
    """Turn a finished request into telemetry, then end ``span``; never raises.

    The metrics are recorded for every request, whether its span is sampled or not. An unsampled
    request (``span`` not recording) with no profiler and ``need_record`` false builds no
    attribute, no span and no record: only its metrics (and the opt-in content event).

    Args:
        telemetry: from ``instrument()``.
        span: the request span from :func:`start_request_span` (recording or not).
        request: the finished record (``end_ns`` set; ``error`` set when the request raised).
        profilers: :class:`~otel_generate.TokenLatencyProfiler` objects to hand the record to.
        yield_every: on a background thread, yield the interpreter lock after every this many
            step spans (0: never).
        need_record: build the record even when neither the span nor a profiler reads it
            (``track_token_latency``).

    Returns:
        The :class:`GenerationRecord` given to profilers and callers; ``None`` when no one reads
        it (see above) or building it failed (the fault is logged once; the span still ends).
    """
    _lifecycle.recorded = True  # this process has telemetry of its own to flush at exit
    record = None
    recording = span.is_recording()
    if recording or profilers or need_record:
        try:
            record = _annotate(telemetry, span, request, yield_every)
        except Exception as fault:
            request.incomplete = True
            log_fault_once("request accounting", fault)
    content = telemetry.content
    if content is not None and content.event_logger is not None:
        try:
            _emit_details_event(content.event_logger, span, request)
        except Exception as fault:
            log_fault_once("content event", fault)
    try:
        if request.incomplete and recording:
            span.set_attribute(A.GENERATE_STEPS_INCOMPLETE, True)
        end = request.end_ns
        span.end(end_time=request.wall_ns(end) if end is not None else None)
    except Exception as fault:
        log_fault_once("request span end", fault)
    if telemetry.instruments and request.metrics:  # every request, also one whose attributes faulted
        try:
            _record_metrics(telemetry.instruments, span, request, record, telemetry.fast_histograms)
        except Exception as fault:
            log_fault_once("metrics", fault)
    if record is not None:
        for profiler in profilers:
            try:
                profiler._add(record)
            except Exception as fault:
                log_fault_once("profiler", fault)
    return record


def _annotate(telemetry: Telemetry, span: Any, request: Request, yield_every: int = 0) -> GenerationRecord:
    """Set the request attributes and build the step spans; return the record for the APIs."""
    latencies_ns = request.step_latencies_ns()
    latencies_s = [latency / clock.NS_PER_S for latency in latencies_ns]
    ttft_ns = request.time_to_first_token_ns()
    tpot_ns = request.time_per_output_token_ns()
    etype = error_type(request.error) if request.error is not None else None
    if span.is_recording():
        attrs: Dict[str, Any] = dict(request.parameters)
        _add_response_attributes(attrs, request)
        if request.streamer_ns is not None:
            attrs[A.GENERATE_STREAMER_DURATION] = request.streamer_ns / clock.NS_PER_S
        if request.request_id is not None:
            attrs[A.GEN_AI_RESPONSE_ID] = request.request_id
        if request.queue_ns is not None:
            attrs[A.GENERATE_TIME_IN_QUEUE] = request.queue_ns / clock.NS_PER_S
        if request.discarded_output_tokens is not None:
            attrs[A.GENERATE_USAGE_DISCARDED_OUTPUT_TOKENS] = request.discarded_output_tokens
        for key, value in (
            (A.GENERATE_MEMORY_PEAK_ALLOCATED, request.memory_peak_bytes),
            (A.GENERATE_KV_CACHE_SIZE, request.kv_cache_bytes),
            (A.GENERATE_ASSISTED_PROPOSED, request.candidates_proposed),
            (A.GENERATE_ASSISTED_ACCEPTED, request.candidates_accepted),
        ):
            if value is not None:
                attrs[key] = value
        if request.candidates_proposed and request.candidates_accepted is not None:
            attrs[A.GENERATE_ASSISTED_ACCEPTANCE_RATE] = request.candidates_accepted / request.candidates_proposed
        outliers: frozenset = frozenset()
        emit_steps = False
        # no step count at all: none could be seen, or uninstrument() ran before any was timed
        steps_unseen = request.unobserved is not None or (request.uninstrumented and not latencies_ns)
        if request.timed:
            attrs[A.GENERATE_SYNCHRONIZED] = request.synchronized
            if request.device is not None:
                attrs[A.GENERATE_DEVICE] = request.device
            if request.unobserved is not None:
                attrs[A.GENERATE_STEPS_UNOBSERVED] = request.unobserved
            elif request.uninstrumented:
                attrs[A.GENERATE_STEPS_UNINSTRUMENTED] = True
            if not steps_unseen:
                attrs[A.GENERATE_STEPS] = len(latencies_ns)
                emit_steps = _step_policy(telemetry, request, attrs, seconds(ttft_ns), seconds(tpot_ns))
                if latencies_s:
                    attrs[A.GENERATE_STEP_LATENCIES] = latencies_s[: telemetry.max_step_spans]
                outliers = _outliers(request, latencies_ns, telemetry.options.outlier_factor)
                attrs[A.GENERATE_STEP_OUTLIERS] = len(outliers)
            if ttft_ns is not None:
                attrs[A.GENERATE_TIME_TO_FIRST_TOKEN] = ttft_ns / clock.NS_PER_S
            if tpot_ns is not None:
                attrs[A.GENERATE_TIME_PER_OUTPUT_TOKEN] = tpot_ns / clock.NS_PER_S
        content = telemetry.content
        if content is not None and content.mode.on_span:
            if request.input_messages is not None:
                attrs[A.GEN_AI_INPUT_MESSAGES] = _json(request.input_messages)
            if request.output_messages is not None:
                attrs[A.GEN_AI_OUTPUT_MESSAGES] = _json(request.output_messages)
        if request.error is not None:
            attrs[A.ERROR_TYPE] = etype
            span.record_exception(request.error)
            span.set_status(Status(StatusCode.ERROR, f"{type(request.error).__name__}: {request.error}"))
        emitted = min(len(latencies_ns), telemetry.max_step_spans) if emit_steps else 0
        if not steps_unseen:
            attrs[A.GENERATE_STEP_SPANS_DROPPED] = len(latencies_ns) - emitted
        span.set_attributes(attrs)
        _emit_steps(telemetry, span, request, latencies_s, emitted, outliers, yield_every)
    duration = request.duration_ns()
    return GenerationRecord(
        model=request.model,
        strategy=request.parameters.get(A.GENERATE_STRATEGY),
        device=request.device,
        synchronized=request.synchronized,
        duration_s=seconds(duration) if duration is not None else 0.0,
        step_latencies_s=latencies_s,
        step_tokens=list(request.step_tokens),
        input_tokens=request.input_tokens,
        output_tokens=request.output_tokens,
        output_tokens_per_sequence=list(request.output_tokens_per_sequence),
        error_type=etype,
        incomplete=request.incomplete,
        time_to_first_token_s=seconds(ttft_ns),
        time_per_output_token_s=seconds(tpot_ns),
    )


def _step_policy(
    telemetry: Telemetry, request: Request, attrs: Dict[str, Any], ttft_s: Optional[float], tpot_s: Optional[float]
) -> bool:
    """Whether this request's steps become spans (the step-span policy); says so on the request span."""
    policy = telemetry.options.step_spans
    attrs[A.GENERATE_STEP_SPANS_POLICY] = policy
    if policy == A.POLICY_ALL:
        emit = True
    elif policy == A.POLICY_NONE:
        emit = False
    else:
        reason = telemetry.slow.reason(request.model, request.error is not None, ttft_s, tpot_s)
        emit = reason is not None
        if reason is not None:
            attrs[A.GENERATE_STEP_SPANS_REASON] = reason
    attrs[A.GENERATE_STEP_SPANS_EMITTED] = emit and telemetry.max_step_spans > 0 and bool(request.step_ends_ns)
    return emit


def _outliers(request: Request, latencies_ns: Sequence[int], factor: float) -> frozenset:
    """Decode steps slower than ``factor`` times the median decode step of the request."""
    prefill = request.prefill_indices()
    decode = [latency for index, latency in enumerate(latencies_ns) if index not in prefill]
    if len(decode) < 3:
        return frozenset()
    ordered = sorted(decode)
    middle = len(ordered) // 2
    median = ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2
    limit = factor * median
    if ordered[-1] <= limit:  # the common case: no outlier
        return frozenset()
    return frozenset(index for index, latency in enumerate(latencies_ns) if index not in prefill and latency > limit)


def _emit_steps(
    telemetry: Telemetry,
    span: Any,
    request: Request,
    latencies_s: Sequence[float],
    emitted: int,
    outliers: frozenset = frozenset(),
    yield_every: int = 0,
) -> None:
    """The inner-call spans (when the request ran several loops) and the first ``emitted`` step
    spans, each step a child of its inner-call span, else of the request span. The hot loop of
    emission: everything it reads is bound to a local first."""
    tracer = telemetry.tracer
    wall_offset = request.start_wall_ns - request.start_ns
    parent = trace.set_span_in_context(span)
    parents = [parent] * emitted
    parent_spans = [span.get_span_context()] * emitted
    for call in request.calls:
        group = tracer.start_span(
            A.SPAN_INNER_GENERATE,
            context=parent,
            kind=SpanKind.INTERNAL,
            start_time=call.start_ns + wall_offset,
            attributes=call.attributes,
        )
        group.end(end_time=(call.end_ns if call.end_ns is not None else request.end_ns) + wall_offset)
        context = trace.set_span_in_context(group)
        for index in range(call.first_step, min(call.first_step + call.steps, emitted)):
            parents[index] = context
            parent_spans[index] = group.get_span_context()
    if not emitted:
        return
    start_span = tracer.start_span
    internal = SpanKind.INTERNAL
    bounds = request.step_bounds_ns()
    tokens = request.step_tokens
    prefill = request.prefill_indices()
    step_requests = request.step_requests
    token_ids = request.step_token_ids or ()  # opt-in content, one list per step
    logprobs = request.step_logprobs or ()
    extra = bool(step_requests is not None or token_ids or logprobs or outliers)
    # the base attributes and the outlier flag are numbers: only the others need fast_eligible's check
    check = bool(step_requests is not None or token_ids or logprobs)
    INDEX, TOKEN, TOKENS, LATENCY = (
        A.GENERATE_STEP_INDEX,
        A.GENERATE_TOKEN_INDEX,
        A.GENERATE_STEP_TOKENS,
        A.GENERATE_STEP_LATENCY,
    )
    PREFILL, DECODE = A.STEP_SPAN_PREFILL, A.STEP_SPAN_DECODE
    fast = telemetry.fast
    fast_emit = fast.emit if fast is not None and fast.usable() else None
    token_index = 0
    for index in range(emitted):
        start, end = bounds[index]
        name = PREFILL if index in prefill else DECODE
        attributes = {INDEX: index, TOKEN: token_index, TOKENS: tokens[index], LATENCY: latencies_s[index]}
        if extra:
            if step_requests is not None:
                attributes[A.GENERATE_STEP_REQUESTS] = step_requests[index]
            if index in outliers:
                attributes[A.GENERATE_STEP_OUTLIER] = True
            if index < len(token_ids) and token_ids[index]:
                attributes[A.GENERATE_STEP_TOKEN_IDS] = token_ids[index]
            if index < len(logprobs) and logprobs[index]:
                attributes[A.GENERATE_STEP_LOGPROBS] = logprobs[index]
        token_index += tokens[index]
        try:
            fast_done = (
                fast_emit is not None
                and (not check or fast_eligible(attributes))
                and fast_emit(
                    parents[index], parent_spans[index], name, start + wall_offset, end + wall_offset, attributes
                )
            )
            if not fast_done:
                start_span(
                    name, context=parents[index], kind=internal, start_time=start + wall_offset, attributes=attributes
                ).end(end_time=end + wall_offset)
        except Exception as fault:  # a span processor raised: the other steps and the metrics still go
            log_fault_once("step span export", fault)
        if yield_every and index % yield_every == yield_every - 1:
            time.sleep(0)  # a background emitter lets the producer run


def _add_response_attributes(attrs: Dict[str, Any], request: Request) -> None:
    """The GenAI response attributes the request span and the details event share: token usage,
    finish reasons and time to first chunk (seconds), each only when known."""
    if request.input_tokens is not None:
        attrs[A.GEN_AI_USAGE_INPUT_TOKENS] = request.input_tokens
    if request.output_tokens is not None:
        attrs[A.GEN_AI_USAGE_OUTPUT_TOKENS] = request.output_tokens
    if request.finish_reasons is not None:
        attrs[A.GEN_AI_RESPONSE_FINISH_REASONS] = list(request.finish_reasons)
    if request.first_chunk_ns is not None:
        attrs[A.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK] = (request.first_chunk_ns - request.start_ns) / clock.NS_PER_S


def _json(messages: Any) -> str:
    """Messages as the JSON string a span attribute holds (compact, non-ASCII kept as is)."""
    return json.dumps(messages, ensure_ascii=False, separators=(",", ":"))


def _emit_details_event(logger: Any, span: Any, request: Request) -> None:
    """The ``gen_ai.client.inference.operation.details`` event of one request, in the request span's context.

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
    _add_response_attributes(attrs, request)
    if request.error is not None:
        attrs[A.ERROR_TYPE] = error_type(request.error)
    if request.input_messages is not None:
        attrs[A.GEN_AI_INPUT_MESSAGES] = request.input_messages
    if request.output_messages is not None:
        attrs[A.GEN_AI_OUTPUT_MESSAGES] = request.output_messages
    end = request.end_ns
    try:
        record = LogRecord(
            timestamp=request.wall_ns(end) if end is not None else None,
            context=trace.set_span_in_context(span),
            attributes=attrs,
            event_name=A.EVENT_INFERENCE_OPERATION_DETAILS,
        )
    except TypeError as fault:  # opentelemetry-api < 1.35: no event_name, no context
        raise RuntimeError("the content event needs opentelemetry-api >= 1.35 and opentelemetry-sdk >= 1.37") from fault
    logger.emit(record)


def _record_metrics(
    instruments: Dict[str, Any],
    span: Any,
    request: Request,
    record: Optional[GenerationRecord] = None,
    fast: Optional[Dict[str, Any]] = None,
) -> None:
    """The GenAI histograms and the inter-token latency histogram of one request.

    Figures come from ``record`` when it was built, else straight from ``request`` (an unsampled
    request: no list is built). Recorded while the request span is the current span when it is
    sampled, so exemplars point at it; an unsampled request's measurements are recorded under no
    span at all, so no exemplar points at a trace that was not kept. ``fast``: name ->
    :class:`~otel_generate.fast_metrics.FastHistogram` (or ``None``) of the instruments that may
    take the fast path, which gives exactly what ``record()`` would.
    """
    fast = fast or {}

    def record_values(name: str, values: Any, attributes: Dict[str, Any]) -> None:
        helper = fast.get(name)
        if helper is not None:
            helper.record_many(values, attributes)
        else:
            record_one = instruments[name].record
            for value in values:
                record_one(value, attributes)

    base = {
        A.GEN_AI_OPERATION_NAME: A.OPERATION_TEXT_COMPLETION,
        A.GEN_AI_PROVIDER_NAME: A.PROVIDER_TRANSFORMERS,
        A.GEN_AI_REQUEST_MODEL: request.model,
    }
    error = request.error is not None
    if error:
        base[A.ERROR_TYPE] = record.error_type if record is not None else error_type(request.error)
    if record is not None:
        duration_s: Optional[float] = record.duration_s
        ttft_s, tpot_s = record.time_to_first_token_s, record.time_per_output_token_s
    else:
        duration = request.duration_ns()
        duration_s = seconds(duration) if duration is not None else 0.0
        if error:
            ttft_s = tpot_s = None
        else:
            ttft_s = seconds(request.time_to_first_token_ns())
            tpot_s = seconds(request.time_per_output_token_ns())
    exemplar_span = span if span.get_span_context().trace_flags.sampled else trace.INVALID_SPAN
    token = otel_context.attach(trace.set_span_in_context(exemplar_span))
    try:
        record_values(A.METRIC_REQUEST_DURATION, (duration_s,), base)
        record_values(A.METRIC_CLIENT_OPERATION_DURATION, (duration_s,), base)
        # defined for successful responses only (GenAI metrics page); the inter-token latency alike
        if not error:
            if ttft_s is not None:
                record_values(A.METRIC_TIME_TO_FIRST_TOKEN, (ttft_s,), base)
            if tpot_s is not None:
                record_values(A.METRIC_TIME_PER_OUTPUT_TOKEN, (tpot_s,), base)
                if A.METRIC_INTER_TOKEN_LATENCY in instruments:
                    record_values(A.METRIC_INTER_TOKEN_LATENCY, request.inter_token_latencies_s(), base)
        if A.METRIC_TOKEN_USAGE in instruments:
            if request.input_tokens is not None:
                inputs = {**base, A.GEN_AI_TOKEN_TYPE: A.TOKEN_TYPE_INPUT}
                record_values(A.METRIC_TOKEN_USAGE, (request.input_tokens,), inputs)
            if request.output_tokens is not None:
                outputs = {**base, A.GEN_AI_TOKEN_TYPE: A.TOKEN_TYPE_OUTPUT}
                record_values(A.METRIC_TOKEN_USAGE, (request.output_tokens,), outputs)
    finally:
        otel_context.detach(token)
