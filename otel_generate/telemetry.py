"""The telemetry context: what one ``instrument()`` set up, in one object, from one configuration.

:class:`Telemetry` holds the tracer, the metric instruments, the resolved
:class:`~otel_generate.options.Options` (the only source of configuration: every other setting
here is read from it once), the step-span policy, the opt-in content options, the background
emitter and the profiler registry. Producers (:mod:`otel_generate.integrations`) get it from
the instrumentor and hand it to :mod:`otel_generate.emit` with each finished request.

:func:`get_tracer`, :func:`create_instruments` and :func:`get_event_logger` give this package's
tracer, GenAI histograms and logs-API logger, all under :data:`INSTRUMENTATION_NAME` with the
semantic conventions' schema URL.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any, Callable, Collection, Dict, Optional, Sequence

from opentelemetry import metrics, trace

from otel_generate import attributes as A
from otel_generate import content as _content
from otel_generate._faults import Fault, log_fault_once
from otel_generate.options import Options
from otel_generate.policy import StepSpanPolicy
from otel_generate.version import __version__

INSTRUMENTATION_NAME = "otel_generate"


def _no_profilers() -> Sequence[Any]:
    return ()


class Telemetry:
    """What ``instrument()`` set up: the tracer, the metric instruments and the options.

    Build it with :meth:`from_options`. The constructor also takes ``synchronize`` and
    ``max_step_spans`` (older callers): they are used only without ``options``, to make one.

    Attributes:
        tracer: the ``opentelemetry.trace.Tracer`` of this package.
        instruments: metric name -> histogram (empty: no metrics).
        options: the resolved :class:`~otel_generate.options.Options`.
        synchronize: ``options.synchronize``: ``True`` (wait for the device before each clock
            read), ``"events"`` (CUDA timing events, no wait per step) or ``False``.
        max_step_spans: ``options.max_step_spans``: at most this many step spans per request.
        policy: the :class:`~otel_generate.policy.StepSpanPolicy` (from ``options``).
        slow: ``policy.slow``, the running distributions of the ``slow`` policy, or ``None``.
        skip_candidate_calls: transformers < 4.47 calls the stopping criteria on assisted
            decoding's candidates too (not a step boundary); read from ``GenerationMixin``.
        profilers: returns the :class:`~otel_generate.TokenLatencyProfiler` objects open in the
            current context (the profiler registry).
        active: False once ``uninstrument()`` ran: a hook left behind in another tool's chain of
            wrappers then only calls its original.
        content: the opt-in content to capture (:class:`~otel_generate.content.ContentOptions`),
            or ``None`` when none is: then no content code runs at all.
        emitter: the :class:`~otel_generate.background.BackgroundEmitter` (background emission,
            continuous batching), or ``None``.
    """

    def __init__(
        self,
        tracer: trace.Tracer,
        instruments: Optional[Dict[str, Any]],
        synchronize: Optional[bool] = None,
        max_step_spans: Optional[int] = None,
        skip_candidate_calls: bool = False,
        profilers: Callable[[], Sequence[Any]] = _no_profilers,
        content: Any = None,
        options: Optional[Options] = None,
    ) -> None:
        if options is None:
            given = {"synchronize": synchronize, "max_step_spans": max_step_spans}
            options = Options(**{name: value for name, value in given.items() if value is not None})
        self.tracer = tracer
        self.instruments = instruments or {}
        self.options = options
        self.synchronize = options.synchronize
        self.max_step_spans = options.max_step_spans
        self.policy = StepSpanPolicy.from_options(options)
        self.slow = self.policy.slow
        self.skip_candidate_calls = skip_candidate_calls
        self.profilers = profilers
        self.active = True
        self.content = content
        self.emitter: Any = None
        #: ``((role, provider), ...)`` whose flushes were last wrapped to drain the emitter
        self.wrapped_providers: tuple = ()
        #: ``(meter provider, whether it aggregates)`` last asked by :meth:`metrics_live`
        self._meter_liveness: tuple = (None, False)
        #: the ``generate.emitter.dropped_requests`` counter (``None``: no meter)
        self.dropped_counter: Any = (instruments or {}).get(A.METRIC_EMITTER_DROPPED)
        #: requests still in their set-up (``generate()`` entered, the loop's hooks not all reached):
        #: call -> thread ident; ``uninstrument()`` waits for them (bounded) before removing the hooks
        self.setups: Dict[Any, int] = {}
        #: guards ``setups`` and ``setup_waiters``: the lock of ``setups_changed`` (held directly
        #: by the requests, whose ``with`` on the lock itself runs no Python code)
        self.setups_lock = threading.Lock()
        self.setups_changed = threading.Condition(self.setups_lock)
        self.setup_waiters = 0  # threads in wait_for_setups (guarded by setups_lock)
        _TELEMETRIES.add(self)  # a forked child forgets the parent's other threads' set-ups

    @classmethod
    def from_options(cls, options: Options, profilers: Callable[[], Sequence[Any]] = _no_profilers) -> "Telemetry":
        """The context of resolved ``options``: the tracer, instruments and content options from
        the providers they name (``None``: the global ones); ``profilers`` is the registry of open
        :class:`~otel_generate.TokenLatencyProfiler` objects (the instrumentor passes
        ``profiler.active_profilers``; this module sits below the profiler and does not import it)."""
        return cls(
            tracer=get_tracer(options.tracer_provider),
            instruments=create_instruments(options.meter_provider),
            profilers=profilers,
            content=content_options(options),
            options=options,
        )

    def _after_fork_in_child(self) -> None:
        """In a forked child only the forking thread exists: the set-ups of the parent's other
        threads will never finish here (``uninstrument()`` would wait for them), and one of those
        threads may have held the set-up lock at the fork (every request would hang on it)."""
        me = threading.get_ident()
        self.setups = {call: thread for call, thread in list(self.setups.items()) if thread == me}
        self.setups_lock = threading.Lock()
        self.setups_changed = threading.Condition(self.setups_lock)
        self.setup_waiters = 0

    def metrics_live(self) -> bool:
        """Whether a measurement recorded now reaches a meter provider that aggregates it: one
        that can be flushed (``force_flush``, as the SDK's ``MeterProvider`` and any exporting
        provider has) and hands out real meters, not the API's no-op provider, its stand-in while
        no global provider is set, nor a provider that gives only the API's ``NoOpMeter`` (the
        SDK's with ``OTEL_SDK_DISABLED=true``). Asked per request: a global provider may be set
        after ``instrument()``; the answer is kept per provider object."""
        if not self.instruments:
            return False
        provider = self.options.meter_provider
        if provider is None:
            provider = metrics.get_meter_provider()
        known, live = self._meter_liveness
        if known is provider:
            return live
        live = callable(getattr(provider, "force_flush", None))
        if live:
            try:
                meter = provider.get_meter(INSTRUMENTATION_NAME, __version__, schema_url=A.SCHEMA_URL)
                live = not isinstance(meter, metrics.NoOpMeter)
            except Exception:  # a provider that cannot say: as before, one that can be flushed is live
                pass
        self._meter_liveness = (provider, live)
        return live

    def stop_emitter(self) -> None:
        if self.emitter is not None:
            self.emitter.stop()

    def drain_emitter(self, timeout_s: Optional[float] = None) -> bool:
        """Wait until the background emitter has emitted every request handed to it (at most
        ``timeout_s``); True when it did, or when there is no emitter."""
        emitter = self.emitter
        if emitter is None:
            return True
        drained = emitter.drain(timeout_s)
        if not drained:
            emitter.report_undrained("when a flush's time ran out")
        return drained

    def count_dropped(self) -> None:
        """One finished request the background emitter's full queue refused (its telemetry is lost)."""
        counter = self.dropped_counter
        if counter is not None:
            counter.add(1, _DROPPED_ATTRIBUTES)


#: every :class:`Telemetry` alive (``instrument()`` makes one each time): reset in a forked child
_TELEMETRIES: "weakref.WeakSet[Telemetry]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for telemetry in list(_TELEMETRIES):
        try:
            telemetry._after_fork_in_child()
        except Exception as fault:  # pragma: no cover - never break a fork
            log_fault_once(Fault.REQUEST_SET_UPS_AFTER_FORK, fault)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def content_options(options: Options) -> Optional[_content.ContentOptions]:
    """The :class:`~otel_generate.content.ContentOptions` to capture, or ``None`` when nothing is."""
    mode = options.capture_message_content
    if mode is None:  # an Options made without resolve()
        mode = _content.ContentMode.NO_CONTENT
    token_ids, logprobs = options.capture_step_token_ids, options.capture_step_logprobs
    if mode is _content.ContentMode.NO_CONTENT and not token_ids and not logprobs:
        return None
    return _content.ContentOptions(
        mode=mode,
        step_token_ids=token_ids or logprobs,
        step_logprobs=logprobs,
        event_logger=get_event_logger(options.logger_provider) if mode.on_event else None,
    )


def get_tracer(tracer_provider: Any = None) -> trace.Tracer:
    """This package's tracer, with the semantic-conventions :data:`~otel_generate.attributes.SCHEMA_URL`."""
    return trace.get_tracer(INSTRUMENTATION_NAME, __version__, tracer_provider, schema_url=A.SCHEMA_URL)


def get_event_logger(logger_provider: Any = None) -> Any:
    """This package's logs-API ``Logger`` (for the opt-in content event), with the
    :data:`~otel_generate.attributes.SCHEMA_URL`."""
    from opentelemetry import _logs

    return _logs.get_logger(INSTRUMENTATION_NAME, __version__, logger_provider, schema_url=A.SCHEMA_URL)


#: the attributes of the dropped-requests counter: the operation whose telemetry was dropped
_DROPPED_ATTRIBUTES = {A.GEN_AI_OPERATION_NAME: A.OPERATION_TEXT_COMPLETION}


def create_instruments(meter_provider: Any = None) -> Dict[str, Any]:
    """The GenAI histograms, with the conventions' units and explicit bucket boundaries, and this
    package's counter of requests whose telemetry the background emitter dropped."""
    meter = metrics.get_meter(INSTRUMENTATION_NAME, __version__, meter_provider, schema_url=A.SCHEMA_URL)

    def histogram(name: str, unit: str, description: str, buckets: Collection[float]) -> Any:
        return meter.create_histogram(
            name, unit=unit, description=description, explicit_bucket_boundaries_advisory=list(buckets)
        )

    instruments = {
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
        A.METRIC_ENERGY_PER_OUTPUT_TOKEN: histogram(
            A.METRIC_ENERGY_PER_OUTPUT_TOKEN,
            "J",
            "Energy the request used (NVML's energy counter of its GPU) divided by its output tokens, per request.",
            A.BUCKETS_ENERGY_PER_OUTPUT_TOKEN_J,
        ),
    }
    instruments[A.METRIC_EMITTER_DROPPED] = meter.create_counter(
        A.METRIC_EMITTER_DROPPED,
        unit="{request}",
        description="Finished requests whose spans and metrics were dropped because the background emitter's "
        "queue was full.",
    )
    return instruments
