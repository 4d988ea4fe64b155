"""Producer: transformers' ``GenerationMixin.generate`` loop.

Three methods of ``transformers.generation.utils.GenerationMixin`` are wrapped (by
:class:`otel_generate.GenerateInstrumentor`):

* ``generate``: the outermost call is one request (:class:`GenerateCall`): its span starts on
  entry, its record is finished and handed to :func:`otel_generate.emit.finish` on return;
* ``_prepare_generated_length``: the effective ``GenerationConfig`` and the prompt width;
* ``_get_stopping_criteria``: the criteria list becomes a
  :class:`~otel_generate.integrations.step_hook.RecordingCriteriaList`, whose call at the end
  of every decoding iteration is the step boundary (the only per-step code).

Token counts are read from the tensors here (:mod:`otel_generate.tokens`); everything else
about telemetry is :mod:`otel_generate.emit`'s.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import logging
from typing import Any, Callable, List, Optional

import wrapt
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.instrumentation.utils import is_instrumentation_enabled

from otel_generate import attributes as A
from otel_generate import clock, emit
from otel_generate._faults import log_fault_once
from otel_generate.request import Request
from otel_generate.tokens import (
    count_input_tokens,
    count_new_tokens,
    counts_from_done,
    finish_reasons,
    step_tokens,
)

_LOG = logging.getLogger("otel_generate")

MODULE = "transformers.generation.utils"
CLASS = "GenerationMixin"

#: The call of the ``generate()`` running in this context, ``_NESTED`` inside a ``generate()``
#: that another instrumented call started (an assistant model, a ``super().generate()``), or ``None``.
_ACTIVE: contextvars.ContextVar[Any] = contextvars.ContextVar("otel_generate_active_request", default=None)
_NESTED = object()

#: Strategies whose stopping-criteria rows are the returned sequences (beam search checks
#: flattened candidate beams instead).
_ROW_ALIGNED = (A.STRATEGY_GREEDY, A.STRATEGY_SAMPLE, A.STRATEGY_ASSISTED)

#: Keywords this package adds to ``generate()``; they never reach transformers.
CALLBACK_KWARG = "per_token_latency_callback"
TRACK_KWARG = "track_token_latency"


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
        or getattr(generation_config, "use_mtp", None)
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


def assisted_calls_criteria_on_candidates(mixin: Any) -> bool:
    """transformers < 4.47 calls the stopping criteria on the candidate tokens too (not a step)."""
    try:
        return "stopping_criteria(candidate_input_ids" in inspect.getsource(mixin._assisted_decoding)
    except (OSError, TypeError, AttributeError):
        return False


class GenerateCall:
    """Producer state of one instrumented ``generate()`` call (created by the generate wrapper).

    It starts the request span, learns the configuration and the prompt width from the hooks,
    installs the step recorder, and at the end fills a :class:`~otel_generate.request.Request`
    from the tensors and hands it to :func:`otel_generate.emit.finish`.
    """

    def __init__(self, telemetry: emit.Telemetry, model: Any, args: tuple, kwargs: dict, extras: dict) -> None:
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
        self.criteria: Any = None
        self.sync: Optional[Callable[[], None]] = None
        self.streamer: Optional[_TimedStreamer] = None
        self.step_logprobs: Any = None  # opt-in content: set by generate_content's logits-processor wrapper

        self.span = emit.start_request_span(telemetry, self.name)
        try:
            # Per-step work only when someone will read it: a recorded span, a profiler, a callback,
            # or track_token_latency. Otherwise generate() runs exactly as uninstrumented.
            self.timed = self.span.is_recording() or bool(self.profilers) or self.callback is not None or self.track
            synchronized = bool(telemetry.synchronize)
            device = None
            if self.timed:
                devices = list(clock.devices_of(model))
                device = str(devices[-1]) if devices else None
                if telemetry.synchronize:
                    try:
                        self.sync = clock.synchronizer_for(devices)
                    except ValueError as fault:  # a device type with no synchronize we know of
                        synchronized = False
                        log_fault_once("device synchronize", fault)
            self.request = Request(
                model=self.name, start_ns=0, start_wall_ns=0, timed=self.timed, synchronized=synchronized, device=device
            )
            self._synchronize()
            self.request.start_ns = clock.monotonic_ns()
            self.request.start_wall_ns = clock.wall_ns()
        except BaseException:
            # The caller runs generate() uninstrumented; the started span says why it has no data.
            if self.span.is_recording():
                self.span.set_attribute(A.GENERATE_STEPS_INCOMPLETE, True)
            self.span.end()
            raise
        streamer = kwargs.get("streamer")
        if streamer is not None:
            self.request.parameters[A.GEN_AI_REQUEST_STREAM] = True
            if self.timed:
                self.streamer = kwargs["streamer"] = _TimedStreamer(streamer, self.request.start_ns)
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
        from otel_generate.integrations.step_hook import RecordingCriteriaList, StepRecorder

        if self.generation_config is None:
            self.generation_config = generation_config
        strategy = self.strategy()
        self.recorder = StepRecorder(
            self.sync,
            clock.monotonic_ns,
            self.request.start_ns,
            self.prompt_length if self.prompt_length is not None else 0,
            self._on_fault,
            self.callback,
            skip_candidate_calls=self.telemetry.skip_candidate_calls and strategy == A.STRATEGY_ASSISTED,
            # one is_done row per returned sequence (not beam search's flattened candidates)
            keep_done=strategy in _ROW_ALIGNED,
        )
        self.criteria = RecordingCriteriaList(criteria, self.recorder)
        return self.criteria

    def _on_fault(self, kind: str, exc: BaseException) -> None:
        if kind == "step hook":
            self.request.incomplete = True
        log_fault_once(kind, exc)

    def strategy(self) -> Optional[str]:
        if self.generation_config is None:
            return None
        return strategy_of(self.generation_config, self.kwargs.get("assistant_model"))

    # --- the end --------------------------------------------------------------------------
    def finish(self, result: Any = None, exc: Optional[BaseException] = None) -> Any:
        """End the request: sync, read the clock, account tokens, then emit; never raises.

        Returns ``result`` (with ``token_latencies`` attached when asked for).
        """
        request = self.request
        request.error = exc
        try:
            self._synchronize()
            request.end_ns = clock.monotonic_ns()
            self._account(result, exc)
        except Exception as fault:
            request.incomplete = True
            log_fault_once("request accounting", fault)
        finally:
            try:
                otel_context.detach(self._context_token)
            except Exception as fault:  # pragma: no cover - context mismatch across threads
                log_fault_once("context detach", fault)
            if request.end_ns is None:
                try:
                    request.end_ns = clock.monotonic_ns()
                except Exception:  # the clock itself is gone (already logged): let the SDK stamp the end
                    request.incomplete = True
        record = emit.finish(self.telemetry, self.span, request, self.profilers)
        if record is not None and self.track and result is not None:
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
        # The recorder's fault callback is bound to this call, and the exception's traceback holds the
        # wrapper's frame (reference cycles): drop both, so the call (prompt tensors, the caller's
        # kwargs) is freed when generate() returns, not at a later gc.
        self.recorder = self.criteria = None
        request.error = None
        return result

    def _synchronize(self) -> None:
        """Wait for the device; a failing synchronize is logged once, then no longer used."""
        if self.sync is None:
            return
        try:
            self.sync()
        except Exception as fault:
            self.sync = None
            self.request.synchronized = False
            self.request.incomplete = True
            log_fault_once("device synchronize", fault)

    def _account(self, result: Any, exc: Optional[BaseException]) -> None:
        """Fill the record from the hooks' data and the returned tensor."""
        request = self.request
        params = request.parameters
        config = self.generation_config
        strategy = self.strategy()
        if strategy is not None:
            params[A.GENERATE_STRATEGY] = strategy

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
            request.incomplete = True  # the stopping-criteria hook was never reached
        if self.timed and exc is None and prompt_length is None:
            request.incomplete = True  # the prompt width was never learned: no token accounting
        request.step_ends_ns = times
        request.step_tokens = step_tokens(lengths, prompt_length if prompt_length is not None else 0)

        # --- token accounting from the tensors themselves -----------------------------------
        eos = pad = max_new = None
        if config is not None:
            eos = getattr(config, "eos_token_id", None)
            pad = getattr(config, "pad_token_id", None)
            max_new = getattr(config, "max_new_tokens", None)
            if max_new is None and getattr(config, "max_length", None) is not None and prompt_length is not None:
                max_new = int(config.max_length) - prompt_length
        if self.inputs_tensor is not None and _is_tensor(self.inputs_tensor) and self.inputs_tensor.dim() >= 2:
            params[A.GENERATE_BATCH_SIZE] = int(self.inputs_tensor.shape[0])
            # tokens only for token inputs: not for audio features or pixels (Whisper, vision encoders)
            if self.model_input_name in (None, "input_ids", "inputs_embeds"):
                request.input_tokens = count_input_tokens(self.inputs_tensor, self.kwargs.get("attention_mask"), pad, eos)
        if sequences is not None and prompt_length is not None and _is_tensor(sequences) and sequences.dim() == 2:
            per_sequence = None
            if done and len(done) == len(lengths) and self.recorder.fault is None:
                # exact: each row ends at the step where a stopping criterion first said so
                per_sequence = counts_from_done(done, lengths, prompt_length, sequences)
            if per_sequence is None:  # beams, or no step data: read it off the tensor
                per_sequence = count_new_tokens(sequences, prompt_length, eos, pad)
            request.output_tokens_per_sequence = per_sequence
            request.output_tokens = int(sum(per_sequence))
            request.finish_reasons = finish_reasons(
                sequences, prompt_length, per_sequence, max_new, eos,
                forced_eos_token_id=getattr(config, "forced_eos_token_id", None),
                budget_rows=self._rows_out_of_time(lengths, prompt_length, per_sequence),
            )
        if config is not None:
            if max_new is not None and max_new >= 0:
                params[A.GEN_AI_REQUEST_MAX_TOKENS] = int(max_new)
            params[A.GENERATE_NUM_BEAMS] = int(getattr(config, "num_beams", 1) or 1)
            choices = int(getattr(config, "num_return_sequences", 1) or 1)
            if choices > 1:
                params[A.GEN_AI_REQUEST_CHOICE_COUNT] = choices
            if getattr(config, "do_sample", False):
                for key, name in (
                    (A.GEN_AI_REQUEST_TEMPERATURE, "temperature"),
                    (A.GEN_AI_REQUEST_TOP_P, "top_p"),
                    (A.GEN_AI_REQUEST_TOP_K, "top_k"),
                ):
                    value = getattr(config, name, None)
                    if value is not None:  # doubles, top_k included (GenAI span conventions)
                        params[key] = float(value)
            stop_strings = getattr(config, "stop_strings", None)
            if stop_strings:
                params[A.GEN_AI_REQUEST_STOP_SEQUENCES] = [stop_strings] if isinstance(stop_strings, str) else [str(s) for s in stop_strings]
        if self.streamer is not None:
            request.first_chunk_ns = self.streamer._self_first_chunk_ns
            request.streamer_ns = self.streamer._self_inside_ns
        if self.telemetry.content is not None:  # opt-in content capture (otel_generate.content)
            from otel_generate.integrations.generate_content import fill_request

            fill_request(self, sequences)

    def _rows_out_of_time(self, lengths: List[int], prompt_length: int, counts: List[int]) -> List[int]:
        """Rows that ``max_time`` ended: still running at the last step, which ended after the deadline.

        ``MaxTimeCriteria`` stops every row at once when ``time.time() - initial_timestamp >
        max_time``; the step's clock read follows the criteria's, so a last step that ended after
        the deadline is the one ``max_time`` ended.
        """
        from transformers.generation.stopping_criteria import MaxTimeCriteria

        request = self.request
        if not request.step_ends_ns or not lengths or self.criteria is None:
            return []
        deadlines = [c.initial_timestamp + c.max_time for c in self.criteria if isinstance(c, MaxTimeCriteria)]
        if not deadlines:
            return []
        last_step_wall_s = request.wall_ns(request.step_ends_ns[-1]) / clock.NS_PER_S
        if last_step_wall_s <= min(deadlines):
            return []
        last = lengths[-1] - prompt_length
        return [row for row, count in enumerate(counts) if count >= last]


class _TimedStreamer(wrapt.ObjectProxy):
    """The user's streamer, with its calls timed (it is the same object to transformers and to
    ``isinstance``). transformers' first ``put`` is the prompt (or the decoder start tokens); the
    first ``put`` after it carries the first generated tokens."""

    def __init__(self, streamer: Any, start_ns: int) -> None:
        super().__init__(streamer)
        self._self_puts = 0
        self._self_first_chunk_ns: Optional[int] = None
        self._self_inside_ns = 0

    def put(self, value: Any) -> Any:
        started = clock.monotonic_ns()
        self._self_puts += 1
        if self._self_puts == 2:
            self._self_first_chunk_ns = started
        try:
            return self.__wrapped__.put(value)
        finally:
            self._self_inside_ns += clock.monotonic_ns() - started

    def end(self) -> Any:
        started = clock.monotonic_ns()
        try:
            return self.__wrapped__.end()
        finally:
            self._self_inside_ns += clock.monotonic_ns() - started


def _is_tensor(value: Any) -> bool:
    return hasattr(value, "dim") and hasattr(value, "shape") and hasattr(value, "tolist")


# --- wrappers ---------------------------------------------------------------------------------


def generate_wrapper(telemetry: emit.Telemetry) -> Callable:
    """Wrapper of ``GenerationMixin.generate``: one request per outermost call."""

    def wrapper(wrapped, instance, args, kwargs):
        extras = {key: kwargs.pop(key) for key in (CALLBACK_KWARG, TRACK_KWARG) if key in kwargs}
        callback = extras.get(CALLBACK_KWARG)
        if callback is not None and not callable(callback):
            raise TypeError(f"{CALLBACK_KWARG} must be callable as fn(token_index, latency_s), got {callback!r}")
        model, model_args = instance, args
        if model is None and args:  # called through the class: GenerationMixin.generate(model, ...)
            model, model_args = args[0], args[1:]
        active = _ACTIVE.get()
        if active is _NESTED or (
            isinstance(active, GenerateCall)
            and (model is active.model or model is active.kwargs.get("assistant_model"))
        ):
            # super().generate() from an overriding model, or an assistant model's generate():
            # part of the outer request, not a request of its own. Another model's generate()
            # called meanwhile (say from a logits processor) is a request of its own.
            token = _ACTIVE.set(_NESTED)
            try:
                return wrapped(*args, **kwargs)
            finally:
                _ACTIVE.reset(token)
        if not is_instrumentation_enabled():
            return wrapped(*args, **kwargs)
        try:
            call = GenerateCall(telemetry, model, model_args, kwargs, extras)
        except Exception as fault:
            log_fault_once("request start", fault)
            return wrapped(*args, **kwargs)
        token = _ACTIVE.set(call)
        try:
            result = wrapped(*args, **kwargs)
        except BaseException as exc:
            _ACTIVE.reset(token)
            call.finish(exc=exc)
            raise
        _ACTIVE.reset(token)
        return call.finish(result=result)

    return wrapper


@functools.lru_cache(maxsize=None)
def _method_signature(function: Any) -> inspect.Signature:
    """The signature of a method's function without its ``self`` parameter (cached)."""
    signature = inspect.signature(function)
    return signature.replace(parameters=list(signature.parameters.values())[1:])


def _signature(bound_method: Any) -> inspect.Signature:
    function = getattr(bound_method, "__func__", None)
    return inspect.signature(bound_method) if function is None else _method_signature(function)


def prepare_generated_length_wrapper(telemetry: emit.Telemetry) -> Callable:
    """Wrapper of ``GenerationMixin._prepare_generated_length``: learns the prompt width and config."""

    def wrapper(wrapped, instance, args, kwargs):
        result = wrapped(*args, **kwargs)
        call = _ACTIVE.get()
        if isinstance(call, GenerateCall) and call.model is instance:
            try:
                # by name, whether generate() (keywords) or an overriding model (positional) called it
                bound = _signature(wrapped).bind(*args, **kwargs).arguments
                call.on_generated_length(
                    result, bound.get("input_ids_length"), bound.get("inputs_tensor"), bound.get("model_input_name")
                )
            except Exception as fault:
                log_fault_once("generation config capture", fault)
        return result

    return wrapper


def get_stopping_criteria_wrapper(telemetry: emit.Telemetry) -> Callable:
    """Wrapper of ``GenerationMixin._get_stopping_criteria``: returns the criteria as a recording list."""

    def wrapper(wrapped, instance, args, kwargs):
        criteria = wrapped(*args, **kwargs)
        call = _ACTIVE.get()
        if isinstance(call, GenerateCall) and call.model is instance and call.timed and call.recorder is None:
            try:
                config = kwargs.get("generation_config", args[0] if args else None)
                return call.recording_criteria(criteria, config)
            except Exception as fault:
                call.request.incomplete = True
                log_fault_once("step hook install", fault)
        return criteria

    return wrapper


#: method of ``GenerationMixin`` -> wrapper factory.
WRAPPERS = {
    "generate": generate_wrapper,
    "_prepare_generated_length": prepare_generated_length_wrapper,
    "_get_stopping_criteria": get_stopping_criteria_wrapper,
}
