"""One instrumented ``generate()`` call: its span, its step recorder, and what it reports at the end.

Nothing here runs per decode step except :mod:`otel_generate._recorder`. The
request span is started when ``generate()`` is entered; the step spans are built from the
recorded timestamps once it returns (or raises), with explicit start and end times.
"""

from __future__ import annotations

import contextvars
import logging
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from otel_generate import attributes as A
from otel_generate import clock
from otel_generate.record import GenerationRecord
from otel_generate.tokens import (
    count_input_tokens,
    count_new_tokens,
    counts_from_done,
    finish_reasons,
    step_tokens,
)

_LOG = logging.getLogger("otel_generate")

#: The request of the ``generate()`` call running in this context, ``_NESTED`` inside a
#: ``generate()`` that another instrumented call started (an assistant model, a
#: ``super().generate()``), or ``None``.
_ACTIVE: contextvars.ContextVar[Any] = contextvars.ContextVar("otel_generate_active_request", default=None)
_NESTED = object()

#: Strategies whose stopping-criteria rows are the returned sequences (beam search checks
#: flattened candidate beams instead).
_ROW_ALIGNED = (A.STRATEGY_GREEDY, A.STRATEGY_SAMPLE, A.STRATEGY_ASSISTED)

#: Keywords this package adds to ``generate()``; they never reach transformers.
CALLBACK_KWARG = "per_token_latency_callback"
TRACK_KWARG = "track_token_latency"

_logged_lock = threading.Lock()
_logged_kinds: set = set()


def log_fault_once(kind: str, exc: BaseException) -> None:
    """Log a fault inside the instrumentation once per kind per process; never raises."""
    try:
        with _logged_lock:
            if kind in _logged_kinds:
                return
            _logged_kinds.add(kind)
        _LOG.warning(
            "otel_generate: %s failed (%s: %s); generate() goes on, further faults of this kind are not logged",
            kind,
            type(exc).__name__,
            exc,
            exc_info=(type(exc), exc, exc.__traceback__),
        )
    except Exception:  # pragma: no cover - logging itself failed
        pass


def error_type(exc: BaseException) -> str:
    """``error.type`` for an exception: its class name, module-qualified unless built in."""
    cls = type(exc)
    module = cls.__module__
    return cls.__qualname__ if module == "builtins" else f"{module}.{cls.__qualname__}"


def model_name(model: Any) -> str:
    """``gen_ai.request.model``: the model's ``name_or_path``, else its class name."""
    name = getattr(model, "name_or_path", None) or getattr(getattr(model, "config", None), "_name_or_path", None)
    return str(name) if name else type(model).__name__


def strategy_of(generation_config: Any, assistant_model: Any) -> str:
    """``generate.strategy`` from the effective ``GenerationConfig`` (after generate() merged its kwargs)."""
    if (
        assistant_model is not None
        or getattr(generation_config, "prompt_lookup_num_tokens", None) is not None
        or getattr(generation_config, "assistant_early_exit", None) is not None
    ):
        return A.STRATEGY_ASSISTED
    beams = getattr(generation_config, "num_beams", 1) or 1
    sampling = bool(getattr(generation_config, "do_sample", False))
    if getattr(generation_config, "constraints", None) or getattr(generation_config, "force_words_ids", None):
        return A.STRATEGY_CONSTRAINED_BEAM_SEARCH
    if (getattr(generation_config, "num_beam_groups", 1) or 1) > 1:
        return A.STRATEGY_GROUP_BEAM_SEARCH
    if getattr(generation_config, "dola_layers", None) is not None:
        return A.STRATEGY_DOLA
    if (getattr(generation_config, "penalty_alpha", None) or 0) > 0 and (getattr(generation_config, "top_k", 1) or 1) > 1:
        return A.STRATEGY_CONTRASTIVE_SEARCH
    if beams > 1:
        return A.STRATEGY_BEAM_SAMPLE if sampling else A.STRATEGY_BEAM_SEARCH
    return A.STRATEGY_SAMPLE if sampling else A.STRATEGY_GREEDY


class Telemetry:
    """What ``instrument()`` set up: the tracer, the metric instruments, the options."""

    def __init__(
        self,
        tracer: trace.Tracer,
        instruments: Optional[Dict[str, Any]],
        synchronize: bool,
        max_step_spans: int,
        skip_candidate_calls: bool,
        profilers: Callable[[], Sequence[Any]],
    ) -> None:
        self.tracer = tracer
        self.instruments = instruments or {}
        self.synchronize = synchronize
        self.max_step_spans = max_step_spans
        self.skip_candidate_calls = skip_candidate_calls
        self.profilers = profilers


class GenerateRequest:
    """State of one instrumented ``generate()`` call (created by the generate wrapper)."""

    def __init__(self, telemetry: Telemetry, model: Any, args: tuple, kwargs: dict, extras: dict) -> None:
        self.telemetry = telemetry
        self.model = model
        self.args = args
        self.kwargs = kwargs
        self.callback: Optional[Callable[[int, float], None]] = extras.get(CALLBACK_KWARG)
        track = extras[TRACK_KWARG] if TRACK_KWARG in extras else getattr(self._user_generation_config(), TRACK_KWARG, False)
        self.track = bool(track)  # the generate() keyword overrides the GenerationConfig, as for every option
        self.profilers = tuple(telemetry.profilers())
        self.name = model_name(model)
        self.generation_config: Any = None
        self.prompt_length: Optional[int] = None
        self.inputs_tensor: Any = None
        self.model_input_name: Any = None
        self.recorder: Any = None
        self.incomplete = False
        self.device: Optional[str] = None
        self.sync: Optional[Callable[[], None]] = None

        self.span = telemetry.tracer.start_span(
            f"{A.OPERATION_TEXT_COMPLETION} {self.name}",
            kind=SpanKind.INTERNAL,
            attributes={
                A.GEN_AI_OPERATION_NAME: A.OPERATION_TEXT_COMPLETION,
                A.GEN_AI_PROVIDER_NAME: A.PROVIDER_TRANSFORMERS,
                A.GEN_AI_REQUEST_MODEL: self.name,
            },
        )
        try:
            # Per-step work only when someone will read it: a recorded span, a profiler, a callback,
            # or track_token_latency. Otherwise generate() runs exactly as uninstrumented.
            self.timed = (
                self.span.is_recording() or bool(self.profilers) or self.callback is not None or self.track
            )
            self.synchronized = bool(telemetry.synchronize)
            if self.timed:
                devices = list(clock.devices_of(model))
                self.device = str(devices[-1]) if devices else None
                if telemetry.synchronize:
                    try:
                        self.sync = clock.synchronizer_for(devices)
                    except ValueError as fault:  # a device type with no synchronize we know of
                        self.synchronized = False
                        log_fault_once("device synchronize", fault)
                    self._synchronize()
            self.start_ns = clock.monotonic_ns()
            self.start_wall_ns = clock.wall_ns()
        except BaseException:
            # The caller runs generate() uninstrumented; the started span says why it has no data.
            if self.span.is_recording():
                self.span.set_attribute(A.GENERATE_STEPS_INCOMPLETE, True)
            self.span.end()
            raise
        self._context_token = otel_context.attach(trace.set_span_in_context(self.span))

    # --- hooks called from inside generate() ------------------------------------------------
    def _user_generation_config(self) -> Any:
        config = self.kwargs.get("generation_config")
        if config is None and len(self.args) > 1:
            config = self.args[1]
        if config is None:
            config = getattr(self.model, "generation_config", None)
        return config

    def on_generated_length(
        self, generation_config: Any, input_ids_length: Any, inputs_tensor: Any, model_input_name: Any
    ) -> None:
        """From ``GenerationMixin._prepare_generated_length``: the effective config and prompt width."""
        self.generation_config = generation_config
        if input_ids_length is not None:
            self.prompt_length = int(input_ids_length)
        self.inputs_tensor = inputs_tensor
        self.model_input_name = model_input_name

    def recording_criteria(self, criteria: Any, generation_config: Any) -> Any:
        """``_get_stopping_criteria``'s list, as a :class:`RecordingCriteriaList` feeding this request."""
        from otel_generate._recorder import RecordingCriteriaList, StepRecorder

        if self.generation_config is None:
            self.generation_config = generation_config
        strategy = self.strategy()
        self.recorder = StepRecorder(
            self.sync,
            clock.monotonic_ns,
            self.start_ns,
            self.prompt_length if self.prompt_length is not None else 0,
            self._on_fault,
            self.callback,
            skip_candidate_calls=self.telemetry.skip_candidate_calls and strategy == A.STRATEGY_ASSISTED,
            # one is_done row per returned sequence (not beam search's flattened candidates)
            keep_done=strategy in _ROW_ALIGNED,
        )
        return RecordingCriteriaList(criteria, self.recorder)

    def _on_fault(self, kind: str, exc: BaseException) -> None:
        if kind == "step hook":
            self.incomplete = True
        log_fault_once(kind, exc)

    def strategy(self) -> Optional[str]:
        if self.generation_config is None:
            return None
        return strategy_of(self.generation_config, self.kwargs.get("assistant_model"))

    # --- the end --------------------------------------------------------------------------
    def finish(self, result: Any = None, exc: Optional[BaseException] = None) -> Any:
        """End the request: sync, read the clock, account tokens, emit spans, metrics, records.

        Never raises; returns ``result`` (with ``token_latencies`` attached when asked for).
        """
        end_ns = None
        record = None
        try:
            self._synchronize()
            end_ns = clock.monotonic_ns()
            record = self._report(result, exc, end_ns)
        except Exception as fault:
            self.incomplete = True
            log_fault_once("request accounting", fault)
        finally:
            try:
                otel_context.detach(self._context_token)
            except Exception as fault:  # pragma: no cover - context mismatch across threads
                log_fault_once("context detach", fault)
            if end_ns is None:
                try:
                    end_ns = clock.monotonic_ns()
                except Exception:  # the clock itself is gone (already logged): let the SDK stamp the end
                    self.incomplete = True
            try:
                if self.incomplete and self.span.is_recording():
                    self.span.set_attribute(A.GENERATE_STEPS_INCOMPLETE, True)
                self.span.end(end_time=self._wall(end_ns) if end_ns is not None else None)
            except Exception as fault:
                log_fault_once("request span end", fault)
        if record is not None:
            result = self._deliver(record, result)
        # The recorder's fault callback is bound to this request (a reference cycle): drop it, so the
        # request (prompt tensors, the caller's kwargs) is freed when generate() returns, not at a later gc.
        self.recorder = None
        return result

    def _synchronize(self) -> None:
        """Wait for the device; a failing synchronize is logged once, then no longer used."""
        if self.sync is None:
            return
        try:
            self.sync()
        except Exception as fault:
            self.sync = None
            self.synchronized = False
            self.incomplete = True
            log_fault_once("device synchronize", fault)

    def _wall(self, monotonic: int) -> int:
        return self.start_wall_ns + (monotonic - self.start_ns)

    def _report(self, result: Any, exc: Optional[BaseException], end_ns: int) -> GenerationRecord:
        span = self.span
        recording = span.is_recording()
        attrs: Dict[str, Any] = {}
        config = self.generation_config
        strategy = self.strategy()
        if strategy is not None:
            attrs[A.GENERATE_STRATEGY] = strategy

        sequences = result if _is_tensor(result) else getattr(result, "sequences", None)
        prompt_length = self.prompt_length

        # --- steps ------------------------------------------------------------------------
        times: List[int] = []
        lengths: List[int] = []
        done: List[Any] = []
        if self.recorder is not None:
            times = list(self.recorder.times_ns)
            lengths = list(self.recorder.lengths)
            done = list(self.recorder.done)
            if sequences is not None and strategy in _ROW_ALIGNED and _is_tensor(sequences):
                # steps that transformers undid (MPS's deferred stop check) are not in the output
                final = int(sequences.shape[-1])
                while lengths and lengths[-1] > final:
                    del lengths[-1], times[-1], done[-1:]
        elif self.timed and exc is None:
            self.incomplete = True  # the stopping-criteria hook was never reached
        if self.timed and exc is None and prompt_length is None:
            self.incomplete = True  # the prompt width was never learned: no token accounting

        # --- token accounting from the tensors themselves -----------------------------------
        input_tokens = output_tokens = None
        per_sequence: List[int] = []
        eos = pad = max_new = None
        if config is not None:
            eos = getattr(config, "eos_token_id", None)
            pad = getattr(config, "pad_token_id", None)
            max_new = getattr(config, "max_new_tokens", None)
            if max_new is None and getattr(config, "max_length", None) is not None and prompt_length is not None:
                max_new = int(config.max_length) - prompt_length
        if self.inputs_tensor is not None and _is_tensor(self.inputs_tensor) and self.inputs_tensor.dim() >= 2:
            attrs[A.GENERATE_BATCH_SIZE] = int(self.inputs_tensor.shape[0])
            # tokens only for token inputs: not for audio features or pixels (Whisper, vision encoders)
            if self.model_input_name in (None, "input_ids", "inputs_embeds"):
                input_tokens = count_input_tokens(self.inputs_tensor, self.kwargs.get("attention_mask"), pad, eos)
                attrs[A.GEN_AI_USAGE_INPUT_TOKENS] = input_tokens
        if sequences is not None and prompt_length is not None and _is_tensor(sequences) and sequences.dim() == 2:
            per_sequence = None
            if done and len(done) == len(lengths) and self.recorder.fault is None:
                # exact: each row ends at the step where a stopping criterion first said so
                per_sequence = counts_from_done(done, lengths, prompt_length, sequences)
            if per_sequence is None:  # beams, or no step data: read it off the tensor
                per_sequence = count_new_tokens(sequences, prompt_length, eos, pad)
            output_tokens = int(sum(per_sequence))
            attrs[A.GEN_AI_USAGE_OUTPUT_TOKENS] = output_tokens
            attrs[A.GEN_AI_RESPONSE_FINISH_REASONS] = finish_reasons(
                sequences, prompt_length, per_sequence, max_new, eos
            )
        if config is not None:
            if max_new is not None and max_new >= 0:
                attrs[A.GEN_AI_REQUEST_MAX_TOKENS] = int(max_new)
            attrs[A.GENERATE_NUM_BEAMS] = int(getattr(config, "num_beams", 1) or 1)
            choices = int(getattr(config, "num_return_sequences", 1) or 1)
            if choices > 1:
                attrs[A.GEN_AI_REQUEST_CHOICE_COUNT] = choices
            if getattr(config, "do_sample", False):
                for key, name in (
                    (A.GEN_AI_REQUEST_TEMPERATURE, "temperature"),
                    (A.GEN_AI_REQUEST_TOP_P, "top_p"),
                    (A.GEN_AI_REQUEST_TOP_K, "top_k"),
                ):
                    value = getattr(config, name, None)
                    if value is not None:
                        attrs[key] = int(value) if name == "top_k" else float(value)

        tokens = step_tokens(lengths, prompt_length if prompt_length is not None else 0)
        latencies_ns = [t - p for t, p in zip(times, [self.start_ns] + times[:-1])]

        if self.timed:
            attrs[A.GENERATE_STEPS] = len(times)
            attrs[A.GENERATE_SYNCHRONIZED] = self.synchronized
            if self.device is not None:
                attrs[A.GENERATE_DEVICE] = self.device
            if latencies_ns:
                attrs[A.GENERATE_TIME_TO_FIRST_TOKEN_MS] = latencies_ns[0] / clock.NS_PER_MS
            later_tokens = sum(tokens[1:])
            if len(latencies_ns) > 1 and later_tokens > 0:
                attrs[A.GENERATE_TIME_PER_OUTPUT_TOKEN_MS] = sum(latencies_ns[1:]) / later_tokens / clock.NS_PER_MS

        etype = error_type(exc) if exc is not None else None
        if recording:
            if exc is not None:
                attrs[A.ERROR_TYPE] = etype
                span.record_exception(exc)
                span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
            span.set_attributes(attrs)
            self._emit_steps(times, tokens, latencies_ns)

        return GenerationRecord(
            model=self.name,
            strategy=strategy,
            device=self.device,
            synchronized=self.synchronized,
            duration_s=(end_ns - self.start_ns) / clock.NS_PER_S,
            step_latencies_s=[lat / clock.NS_PER_S for lat in latencies_ns],
            step_tokens=tokens,
            input_tokens=input_tokens,
            output_tokens=output_tokens,
            output_tokens_per_sequence=per_sequence,
            error_type=etype,
            incomplete=self.incomplete,
        )

    def _emit_steps(self, times: List[int], tokens: List[int], latencies_ns: List[int]) -> None:
        cap = self.telemetry.max_step_spans
        emitted = min(len(times), cap)
        self.span.set_attribute(A.GENERATE_STEP_SPANS_DROPPED, len(times) - emitted)
        if not emitted:
            return
        tracer = self.telemetry.tracer
        parent = trace.set_span_in_context(self.span)
        previous = self.start_ns
        token_index = 0
        for index in range(emitted):
            phase = A.PHASE_PREFILL if index == 0 else A.PHASE_DECODE
            step = tracer.start_span(
                phase,
                context=parent,
                kind=SpanKind.INTERNAL,
                start_time=self._wall(previous),
                attributes={
                    A.GENERATE_STEP_INDEX: index,
                    A.GENERATE_TOKEN_INDEX: token_index,
                    A.GENERATE_STEP_TOKENS: tokens[index],
                    A.GENERATE_STEP_LATENCY_MS: latencies_ns[index] / clock.NS_PER_MS,
                    A.GENERATE_STEP_PHASE: phase,
                },
            )
            step.end(end_time=self._wall(times[index]))
            previous = times[index]
            token_index += tokens[index]

    def _deliver(self, record: GenerationRecord, result: Any) -> Any:
        """Metrics, profilers and ``token_latencies``: each guarded on its own."""
        instruments = self.telemetry.instruments
        if instruments:
            try:
                _record_metrics(instruments, record, self.name)
            except Exception as fault:
                log_fault_once("metrics", fault)
        for profiler in self.profilers:
            try:
                profiler._add(record)
            except Exception as fault:
                log_fault_once("profiler", fault)
        if self.track and result is not None:
            try:
                if _is_tensor(result):
                    _LOG.info(
                        "otel_generate: track_token_latency needs return_dict_in_generate=True; "
                        "a plain tensor is returned unchanged"
                    )
                else:
                    object.__setattr__(result, "token_latencies", list(record.step_latencies_s))
            except Exception as fault:
                log_fault_once("token_latencies", fault)
        return result


def _record_metrics(instruments: Dict[str, Any], record: GenerationRecord, name: str) -> None:
    base = {
        A.GEN_AI_OPERATION_NAME: A.OPERATION_TEXT_COMPLETION,
        A.GEN_AI_PROVIDER_NAME: A.PROVIDER_TRANSFORMERS,
        A.GEN_AI_REQUEST_MODEL: name,
    }
    if record.error_type is not None:
        base[A.ERROR_TYPE] = record.error_type
    instruments[A.METRIC_REQUEST_DURATION].record(record.duration_s, base)
    if record.time_to_first_token_s is not None:
        instruments[A.METRIC_TIME_TO_FIRST_TOKEN].record(record.time_to_first_token_s, base)
    if record.time_per_output_token_s is not None:
        instruments[A.METRIC_TIME_PER_OUTPUT_TOKEN].record(record.time_per_output_token_s, base)
    usage = instruments[A.METRIC_TOKEN_USAGE]
    if record.input_tokens is not None:
        usage.record(record.input_tokens, {**base, A.GEN_AI_TOKEN_TYPE: A.TOKEN_TYPE_INPUT})
    if record.output_tokens is not None:
        usage.record(record.output_tokens, {**base, A.GEN_AI_TOKEN_TYPE: A.TOKEN_TYPE_OUTPUT})


def _is_tensor(value: Any) -> bool:
    return hasattr(value, "dim") and hasattr(value, "shape") and hasattr(value, "tolist")
