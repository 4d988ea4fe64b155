"""Producer: one user call of ``generate()``, and the decoding loops it runs.

A user's ``model.generate(...)`` is one request (a :class:`Call`), whatever class it was called
on: ``GenerationMixin.generate`` itself, a model class's own ``generate()`` (Whisper, Blip-2,
Bark, MusicGen, ...; see :mod:`.overrides`) or a ``custom_generate`` function. Each decoding
loop inside it is a :class:`Loop`: normally exactly one, the ``GenerationMixin.generate`` the
user called; several when a model's ``generate()`` calls the base one per window or per
fallback attempt (Whisper) or per sub-model (Bark). The loops' steps, tokens and finish reasons
are assembled into one :class:`~otel_generate.request.Request`, handed to
:func:`otel_generate.emit.finish` when the user call returns.

Hooks, installed by :class:`otel_generate.GenerateInstrumentor` as plain functions that the
compiler does not trace (``torch.compiler.disable(recursive=False)``: under
``torch.compile(model.generate)`` they still run, eagerly):

* ``GenerationMixin.generate`` (:func:`make_generate`): a request, or one loop of the request
  in progress;
* ``GenerationMixin._prepare_generated_length``: the loop's effective ``GenerationConfig`` and
  prompt width;
* ``GenerationMixin._get_stopping_criteria``: the criteria list becomes a
  :class:`~otel_generate.integrations.step_hook.RecordingCriteriaList`, whose call at the end of
  every decoding iteration is the step boundary (the only per-step code).

Token counts are read from the tensors here (:mod:`otel_generate.tokens`); everything else
about telemetry is :mod:`otel_generate.emit`'s.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import logging
import threading
from typing import Any, Callable, Dict, List, Optional

import wrapt
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.instrumentation.utils import is_instrumentation_enabled

from otel_generate import attributes as A
from otel_generate import cancellation, clock, emit, figures, ranks
from otel_generate._faults import log_fault_once
from otel_generate.request import InnerCall, Request
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

#: The innermost instrumented frame running in this context: a :class:`Loop`, the :class:`Call`
#: itself while no loop is open, ``_NESTED`` inside a ``generate()`` that runs within a step of
#: a loop (an assistant model, a per-step depth decoder), or ``None``.
_ACTIVE: contextvars.ContextVar[Any] = contextvars.ContextVar("otel_generate_active_request", default=None)
_NESTED = object()

#: Strategies whose stopping-criteria rows are the returned sequences (beam search checks
#: flattened candidate beams instead).
_ROW_ALIGNED = (A.STRATEGY_GREEDY, A.STRATEGY_SAMPLE, A.STRATEGY_ASSISTED, A.STRATEGY_CUSTOM_GENERATE)
#: Strategies that return beams (padded only after their EOS).
_BEAM = (
    A.STRATEGY_BEAM_SEARCH,
    A.STRATEGY_BEAM_SAMPLE,
    A.STRATEGY_GROUP_BEAM_SEARCH,
    A.STRATEGY_CONSTRAINED_BEAM_SEARCH,
)
#: Decoding methods that transformers 5.x runs as ``custom_generate`` repositories: their name
#: is kept as the strategy when their repository's loop runs.
_HUB_MODES = (
    A.STRATEGY_CONTRASTIVE_SEARCH,
    A.STRATEGY_GROUP_BEAM_SEARCH,
    A.STRATEGY_CONSTRAINED_BEAM_SEARCH,
    A.STRATEGY_DOLA,
)

#: ``uninstrument()`` waits at most this long (seconds) for other threads' requests still in their
#: set-up (their loop's hooks not reached yet) before it removes the hooks.
UNINSTRUMENT_SETUP_WAIT_S = 2.0

#: Keywords this package adds to ``generate()``; they never reach transformers.
CALLBACK_KWARG = "per_token_latency_callback"
TRACK_KWARG = "track_token_latency"


def model_name(model: Any) -> str:
    """``gen_ai.request.model``: the model's ``name_or_path``, else its class name."""
    name = getattr(model, "name_or_path", None) or getattr(getattr(model, "config", None), "_name_or_path", None)
    return str(name) if name else type(model).__name__


def strategy_of(generation_config: Any, assistant_model: Any) -> str:
    """``generate.strategy`` from the effective ``GenerationConfig`` (after generate() merged its kwargs).

    Follows ``GenerationConfig.get_generation_mode``: an assistant model, prompt lookup, early
    exit or multi-token prediction (``use_mtp``) make it ``assisted``.
    """
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
    if (getattr(generation_config, "penalty_alpha", None) or 0) > 0 and (
        getattr(generation_config, "top_k", 1) or 1
    ) > 1:
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


def custom_generate_name(value: Any) -> Optional[str]:
    """``generate.custom_generate``: a repository or directory as given, a callable's qualified name."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    function = getattr(value, "func", value)  # functools.partial
    module = getattr(function, "__module__", None)
    name = getattr(function, "__qualname__", None) or type(function).__name__
    return f"{module}.{name}" if module else name


def _is_tensor(value: Any) -> bool:
    return hasattr(value, "dim") and hasattr(value, "shape") and hasattr(value, "tolist")


def _sequences(result: Any) -> Any:
    """The ``(rows, length)`` id tensor of what a ``generate()`` returned: the tensor itself, a
    ``ModelOutput``'s ``sequences``, or the ``"sequences"`` of a plain dict (Whisper's
    ``generate()`` returns ``{"sequences": ..., "segments": ...}`` when asked for segments or token
    timestamps, as the speech-recognition pipeline does for ``return_language=True``); else ``None``."""
    if _is_tensor(result):
        sequences = result
    elif isinstance(result, dict):  # a ModelOutput is an OrderedDict too
        sequences = result.get("sequences")
    else:
        sequences = getattr(result, "sequences", None)
    return sequences if _is_tensor(sequences) and sequences.dim() == 2 else None


# --- one user call -------------------------------------------------------------------------------


class Call:
    """Producer state of one user call of ``generate()``: the request span, the record, its loops.

    Args:
        telemetry: from ``instrument()``.
        model: the model the user called ``generate()`` on (names the request).
        args, kwargs: the call's arguments (``self``/``model`` excluded); ``kwargs`` is the dict
            passed on to the original, so a streamer in it is replaced by a timing proxy.
        extras: this package's own ``generate()`` keywords, already removed from ``kwargs``.
        custom_generate: the ``custom_generate`` that the call runs (a string or a callable).

    Raises:
        Whatever starting the span or the first clock read raises (a broken span processor): the
        caller then runs ``generate()`` uninstrumented, and the started span is ended marked
        incomplete.
    """

    def __init__(
        self,
        telemetry: emit.Telemetry,
        model: Any,
        args: tuple,
        kwargs: dict,
        extras: dict,
        custom_generate: Any = None,
    ) -> None:
        self.telemetry = telemetry
        self.model = model
        self.args = args
        self.kwargs = kwargs
        self.callback: Optional[Callable[[int, float], None]] = extras.get(CALLBACK_KWARG)
        track = (
            extras[TRACK_KWARG]
            if TRACK_KWARG in extras
            else getattr(self._user_generation_config(), TRACK_KWARG, False)
        )
        self.track = bool(track)  # the generate() keyword overrides the GenerationConfig, as for every option
        self.profilers = tuple(telemetry.profilers())
        self.name = model_name(model)
        self.loops: List[Loop] = []
        #: the call is a model's own generate() (or a custom_generate) whose loops are inner calls
        #: (Whisper's windows, Bark's sub-models): set by run_request
        self.outer = False
        self.custom_generate = custom_generate_name(
            custom_generate if custom_generate is not None else kwargs.get("custom_generate")
        )
        self.sync: Optional[Callable[[], None]] = None
        self.streamer: Optional[_TimedStreamer] = None
        self.whisper: Optional[Dict[str, Any]] = None  # the current Whisper window (see .whisper)
        self._submodules: Optional[set] = None
        self.memory_device: Optional[str] = None

        self.span = emit.start_request_span(telemetry, self.name)
        try:
            # The full record (memory, cache size, streamer timing, ...) only when someone reads it: a
            # recorded span, a profiler, a callback, or track_token_latency.
            self.detailed = self.span.is_recording() or bool(self.profilers) or self.callback is not None or self.track
            # Steps are timed for those, and for the latency metrics, which are recorded for every
            # request, sampled or not, whenever a meter provider collects them. Otherwise generate()
            # runs exactly as uninstrumented.
            self.timed = self.detailed or telemetry.metrics_live()
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
            self.memory_device = (
                figures.cuda_device(device) if self.detailed and telemetry.options.measure_memory else None
            )
            self._synchronize()
            self._memory(figures.reset_peak_memory)
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
            if self.detailed:
                self.streamer = kwargs["streamer"] = _TimedStreamer(streamer)
        self._context_token = otel_context.attach(trace.set_span_in_context(self.span))

    def _user_generation_config(self) -> Any:
        config = self.kwargs.get("generation_config")
        if config is None and len(self.args) > 1 and not _is_tensor(self.args[1]):
            config = self.args[1]
        if config is None:
            config = getattr(self.model, "generation_config", None)
        return config

    def owns(self, model: Any) -> bool:
        """Whether ``model``'s ``generate()`` is part of this request: the model itself or one of its
        submodules (Blip-2's language model, Bark's sub-models); walked once, when first needed."""
        if model is self.model:
            return True
        if self._submodules is None:
            modules = getattr(self.model, "modules", None)
            try:
                self._submodules = {id(m) for m in modules()} if callable(modules) else set()
            except Exception:
                self._submodules = set()
        return id(model) in self._submodules

    def open_loop(self, model: Any, kwargs: dict, implicit: bool = False, start_ns: Optional[int] = None) -> "Loop":
        """A new decoding loop of this request, started now (or at ``start_ns``)."""
        loop = Loop(self, model, kwargs, implicit, start_ns)
        self.loops.append(loop)
        if self.whisper is not None:
            from otel_generate.integrations.whisper import open_attempt

            open_attempt(self, loop)
        return loop

    def implicit_loop(self, model: Any) -> "Loop":
        """The loop of a ``generate()`` that runs the GenerationMixin helpers without
        ``GenerationMixin.generate`` (MusicGen, RAG-token, Dia): opened by the first helper."""
        if self.loops and self.loops[-1].implicit and not self.loops[-1].closed:
            return self.loops[-1]
        return self.open_loop(model, {}, implicit=True)

    def on_fault(self, kind: str, exc: BaseException) -> None:
        if kind == "step hook":
            self.request.incomplete = True
        log_fault_once(kind, exc)

    def _memory(self, read: Callable[[str], Any]) -> Any:
        """A CUDA memory statistic of the request's device (``None`` off CUDA); a failing one is
        logged once and not read again in this request."""
        if self.memory_device is None:
            return None
        try:
            return read(self.memory_device)
        except Exception as fault:
            self.memory_device = None
            log_fault_once("memory statistics", fault)
            return None

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

    # --- the end --------------------------------------------------------------------------
    def finish(self, result: Any = None, exc: Optional[BaseException] = None) -> Any:
        """End the request: sync, read the clock, account tokens, then emit; never raises.

        Returns ``result`` (with ``token_latencies`` attached when asked for).
        """
        request = self.request
        cancelled = cancellation.is_cancellation(exc)  # a departed client: not an error
        request.error = None if cancelled else exc
        setup_done(self)
        try:
            self._synchronize()
            request.end_ns = clock.monotonic_ns()
            request.memory_peak_bytes = self._memory(figures.peak_memory)
            self._assemble(result, exc)
            if cancelled:
                cancellation.account(request, self.loops)
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
        if self.track:  # track_token_latency needs the record now
            record, deferred = emit.finish(self.telemetry, self.span, request, self.profilers, need_record=True), False
        else:
            record, deferred = self.telemetry.emit(self.span, request, self.profilers)
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
        # The loops' recorders call back into this call, and the exception's traceback holds the
        # wrappers' frames (reference cycles): drop both, so the call (prompt tensors, the caller's
        # kwargs) is freed when generate() returns, not at a later gc.
        for loop in self.loops:
            loop.release()
        self.loops = []
        if not deferred:
            request.error = None  # (a deferred emission drops it once done)
        return result

    def _assemble(self, result: Any, exc: Optional[BaseException]) -> None:
        """Fill the record from the loops that ran (or from the call itself when none could be
        seen), then the opt-in content."""
        loops = self._account_loops(result, exc)
        if self.telemetry.content is not None:  # opt-in content capture (otel_generate.content)
            from otel_generate.integrations.generate_content import fill_request

            fill_request(self, loops, result)

    def _account_loops(self, result: Any, exc: Optional[BaseException]) -> List["Loop"]:
        """The numbers: steps, tokens, finish reasons and parameters; returns the loops that ran."""
        request = self.request
        params = request.parameters
        loops = [loop for loop in self.loops if loop.observed()]
        if self.custom_generate is not None:
            params[A.GENERATE_CUSTOM_GENERATE] = self.custom_generate
        if not self.telemetry.active and (
            not loops or self.custom_generate is not None or self.outer or len(self.loops) > 1
        ):
            # uninstrument() ran during the request: an inner call it started afterwards went unseen
            # (with one loop seen so far as well: Whisper's later windows)
            request.uninstrumented = exc is None
        if not loops:
            self._account_unobserved(result, exc)
            return loops
        first = loops[0]
        for loop in loops:
            if loop.end_ns is None:  # an implicit loop, or a loop cut short by an exception
                loop.end_ns = request.end_ns
            if not loop.closed:  # an implicit loop ends with its call
                loop.size_cache(result if loop.model is self.model else None)
            loop.account(None if len(loops) > 1 or loop.model is not self.model else result, exc)
        params.update(first.parameters)
        if first.assisted_generator is not None:
            params[A.GENERATE_ASSISTED_GENERATOR] = first.assisted_generator
        request.input_tokens = first.input_tokens
        request.kv_cache_bytes = loops[-1].kv_cache_bytes
        assisted = [loop for loop in loops if loop.candidates_proposed is not None]
        if assisted and all(loop.candidates_accepted is not None for loop in assisted):
            request.candidates_proposed = sum(loop.candidates_proposed for loop in assisted)
            request.candidates_accepted = sum(loop.candidates_accepted for loop in assisted)

        # steps: concatenated in call order; indices and token positions continue across loops
        ends: List[int] = []
        starts: List[int] = []
        tokens: List[int] = []
        for loop in loops:
            if loop.step_starts_ns is not None:  # explicit starts (continuous batching's batch steps)
                starts.extend(loop.step_starts_ns)
                ends.extend(loop.step_ends_ns)
                tokens.extend(loop.step_tokens)
                continue
            steps = min(len(loop.step_ends_ns), len(loop.step_tokens))
            loop_ends = loop.step_ends_ns[:steps]
            if loop_ends:  # each step starts where the one before it ended
                starts.extend([loop.start_ns] + loop_ends[:-1])
            ends.extend(loop_ends)
            tokens.extend(loop.step_tokens[:steps])
        request.step_ends_ns, request.step_starts_ns, request.step_tokens = ends, starts, tokens
        if self.timed and exc is None and any(loop.unobserved for loop in loops) and not ends:
            request.unobserved = next(loop.unobserved for loop in loops if loop.unobserved)
        if len(loops) == 1:
            request.output_tokens_per_sequence = first.per_sequence
            request.output_tokens = first.output_tokens
            request.finish_reasons = first.finish_reasons
            request.prefill_steps = first.prefill_steps
            request.step_requests = first.step_requests
            request.queue_ns = first.queue_ns
            if self.timed and exc is None and first.incomplete:
                request.incomplete = True
            if first.uninstrumented:
                request.uninstrumented = True
            return loops

        # several loops: one grouping span each, tokens summed, Whisper's kept decisions applied
        from otel_generate.integrations.whisper import attempt_attributes

        index = 0
        total = discarded = 0
        counted = False
        row_reasons: Dict[int, str] = {}
        for number, loop in enumerate(loops):
            attributes: Dict[str, Any] = {
                A.GENERATE_CALL_INDEX: number,
                A.GENERATE_CALL_MODEL: model_name(loop.model),
                A.GENERATE_CALL_STEPS: len(loop.step_ends_ns),
            }
            if loop.parameters.get(A.GENERATE_STRATEGY) is not None:
                attributes[A.GENERATE_STRATEGY] = loop.parameters[A.GENERATE_STRATEGY]
            kept_rows = None
            if loop.whisper is not None:
                extra, kept_rows = attempt_attributes(loop)
                attributes.update(extra)
                # each batch row ends as its last kept attempt ended (rows are original batch rows)
                for position, row in enumerate(extra.get(A.GENERATE_ATTEMPT_ROWS, ())):
                    if position in kept_rows and loop.finish_reasons and position < len(loop.finish_reasons):
                        row_reasons[row] = loop.finish_reasons[position]
            if loop.output_tokens is not None:
                counted = True
                attributes[A.GENERATE_CALL_OUTPUT_TOKENS] = loop.output_tokens
                total += loop.output_tokens
                if kept_rows is not None:
                    discarded += sum(count for row, count in enumerate(loop.per_sequence) if row not in kept_rows)
            request.calls.append(
                InnerCall(
                    start_ns=loop.start_ns,
                    end_ns=loop.end_ns,
                    first_step=index,
                    steps=len(loop.step_ends_ns),
                    output_tokens=loop.output_tokens,
                    attributes=attributes,
                )
            )
            index += len(loop.step_ends_ns)
            if self.timed and exc is None and loop.incomplete:
                request.incomplete = True
            if loop.uninstrumented:
                request.uninstrumented = True
        if counted:
            request.output_tokens = total
            if any(loop.whisper is not None for loop in loops):
                request.discarded_output_tokens = discarded
        if row_reasons:  # Whisper: one reason per returned row, from the window that ended it
            request.finish_reasons = [row_reasons[row] for row in sorted(row_reasons)]
        else:
            request.finish_reasons = loops[-1].finish_reasons
        return loops

    def _account_unobserved(self, result: Any, exc: Optional[BaseException]) -> None:
        """No decoding loop could be seen (a ``custom_generate`` or a model's own loop): count the
        tokens from the call's token input and its output, and say why there are no steps."""
        request = self.request
        if exc is None and not request.uninstrumented:
            request.unobserved = (
                A.UNOBSERVED_CUSTOM_GENERATE if self.custom_generate is not None else A.UNOBSERVED_MODEL_LOOP
            )
        inputs = self.kwargs.get("input_ids", self.kwargs.get("inputs"))
        if inputs is None and self.args and _is_tensor(self.args[0]):
            inputs = self.args[0]
        if not _is_tensor(inputs) or inputs.dim() != 2 or inputs.is_floating_point():
            return  # audio, pixels, embeddings: no token input to count
        config = self._user_generation_config()
        eos = self.kwargs.get("eos_token_id", getattr(config, "eos_token_id", None))
        pad = self.kwargs.get("pad_token_id", getattr(config, "pad_token_id", None))
        mask = self.kwargs.get("attention_mask")
        request.parameters[A.GENERATE_BATCH_SIZE] = int(inputs.shape[0])
        request.input_tokens = count_input_tokens(inputs, mask, pad, eos)
        sequences = _sequences(result)
        if sequences is None or getattr(self.model.config, "is_encoder_decoder", False):
            return
        width = int(inputs.shape[-1])
        if sequences.shape[-1] < width:
            return
        max_new = self.kwargs.get("max_new_tokens", getattr(config, "max_new_tokens", None))
        per_sequence = count_new_tokens(sequences, width, eos, pad)
        request.output_tokens_per_sequence = per_sequence
        request.output_tokens = int(sum(per_sequence))
        request.finish_reasons = finish_reasons(sequences, width, per_sequence, max_new, eos)
        if max_new is not None:
            request.parameters[A.GEN_AI_REQUEST_MAX_TOKENS] = int(max_new)


# --- one decoding loop ---------------------------------------------------------------------------


class Loop:
    """One decoding loop of a request: a ``GenerationMixin.generate`` call, or the implicit loop of
    a model that runs the GenerationMixin helpers itself. Filled by the helper hooks; accounted
    from its own result tensor when it ends."""

    def __init__(self, call: Call, model: Any, kwargs: dict, implicit: bool, start_ns: Optional[int] = None) -> None:
        self.call = call
        self.model = model
        self.kwargs = kwargs
        self.implicit = implicit
        self.start_ns = clock.monotonic_ns() if start_ns is None else start_ns
        self.end_ns: Optional[int] = None
        self.closed = False
        self.generation_config: Any = None
        self.prompt_length: Optional[int] = None
        self.inputs_tensor: Any = None
        self.model_input_name: Any = None
        self.recorder: Any = None
        self.criteria: Any = None
        self.assisted_generator: Optional[str] = None
        self.whisper: Optional[Dict[str, Any]] = None  # window and attempt, see .whisper
        self.whisper_attempt = 0
        self.whisper_decisions: Dict[int, tuple] = {}
        self.step_logprobs: Any = None  # opt-in content: set by generate_content's logits-processor hook
        self.result: Any = None
        self.cache: Any = None  # the key/value cache object, until the loop returns
        self.kv_cache_bytes: Optional[int] = None
        self.candidates_proposed: Optional[int] = None  # assisted decoding (figures.count_candidates)
        self.candidates_accepted: Optional[int] = None
        #: the continuous-batching requests this loop handed its rows to (``cache_implementation="paged"``),
        #: a :class:`~otel_generate.integrations.continuous_batching.PagedGroup`, or ``None``
        self.paged: Any = None
        # what account() fills
        self.step_ends_ns: List[int] = []
        self.step_tokens: List[int] = []
        self.step_starts_ns: Optional[List[int]] = None  # explicit step starts (batch steps), else contiguous
        self.step_requests: Optional[List[int]] = None
        self.prefill_steps = 1
        self.queue_ns: Optional[int] = None
        self.parameters: Dict[str, Any] = {}
        self.input_tokens: Optional[int] = None
        self.output_tokens: Optional[int] = None
        self.per_sequence: List[int] = []
        self.finish_reasons: Optional[List[str]] = None
        self.unobserved: Optional[str] = None
        self.incomplete = False
        self.uninstrumented = False  # uninstrument() ran before this loop's hooks were all reached
        # the temperature of this attempt, read now: Whisper changes the same config for the next one
        config = kwargs.get("generation_config")
        self.temperature: Optional[float] = None
        if config is not None:
            self.temperature = float(config.temperature or 0.0) if getattr(config, "do_sample", False) else 0.0

    @property
    def running(self) -> bool:
        """Its decoding loop has started (the stopping criteria are installed) and not ended."""
        return self.criteria is not None and not self.closed

    def observed(self) -> bool:
        """Whether this loop reached the decoding machinery (a dispatching call, e.g. the outer
        ``generate(custom_generate="dir")``, never does)."""
        return self.generation_config is not None or self.recorder is not None or self.paged is not None

    def release(self) -> None:
        self.recorder = self.criteria = self.result = self.cache = self.paged = None

    # --- hooks called from inside generate() ------------------------------------------------
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
        """``_get_stopping_criteria``'s list, as a :class:`RecordingCriteriaList` feeding this loop."""
        from otel_generate.integrations.step_hook import RecordingCriteriaList, StepRecorder

        if self.generation_config is None:
            self.generation_config = generation_config
        strategy = self.strategy()
        call = self.call
        self.recorder = StepRecorder(
            call.sync,
            clock.monotonic_ns,
            self.start_ns,
            self.prompt_length if self.prompt_length is not None else 0,
            call.on_fault,
            call.callback,
            skip_candidate_calls=call.telemetry.skip_candidate_calls and strategy == A.STRATEGY_ASSISTED,
            # one is_done row per returned sequence (not beam search's flattened candidates)
            keep_done=strategy in _ROW_ALIGNED,
            token_offset=sum(sum(loop.step_tokens or _tokens_so_far(loop)) for loop in call.loops if loop is not self),
        )
        self.criteria = RecordingCriteriaList(criteria, self.recorder)
        return self.criteria

    def _missed_hook(self) -> None:
        """A hook of this loop never ran: a fault (``incomplete``), or ``uninstrument()`` removed the
        hooks while the request was being set up (``uninstrumented``: the loop itself ran normally)."""
        if self.call.telemetry.active:
            self.incomplete = True
        else:
            self.uninstrumented = True

    def strategy(self) -> Optional[str]:
        if self.generation_config is None:
            return None
        custom = self.kwargs.get("custom_generate")
        strategy = strategy_of(self.generation_config, self.kwargs.get("assistant_model"))
        if custom is not None and not isinstance(custom, str) and strategy not in _HUB_MODES:
            return A.STRATEGY_CUSTOM_GENERATE  # a callable loop ran instead of transformers' own
        return strategy

    def close(self, result: Any = None, read_clock: bool = True) -> None:
        """The loop returned (``result``) or raised; ``read_clock=False`` when it ends with its
        request, whose (synchronized) end time it then takes."""
        self.closed = True
        self.result = result
        self.size_cache(result)
        if read_clock:
            self.call._synchronize()
            self.end_ns = clock.monotonic_ns()

    def size_cache(self, result: Any = None) -> None:
        """``kv_cache_bytes`` from the cache object the loop built (or, with transformers 4.x's legacy
        tuples, the ``past_key_values`` of its output), once; then the cache is let go."""
        if self.cache is None and self.call.detailed:
            self.cache = getattr(result, "past_key_values", None)
        if self.cache is not None:
            try:
                self.kv_cache_bytes = figures.cache_bytes(self.cache)
            except Exception as fault:
                log_fault_once("key/value cache size", fault)
            self.cache = None

    # --- the end --------------------------------------------------------------------------
    def account(self, call_result: Any, exc: Optional[BaseException]) -> None:
        """Steps, tokens and parameters of this loop, from the hooks' data and its result tensor
        (its own result; for an implicit loop, ``call_result`` when it is the loop's output)."""
        if self.paged is not None:  # the rows ran as continuous-batching requests
            self.paged.account(self)
            return
        call = self.call
        params = self.parameters
        config = self.generation_config
        strategy = self.strategy()
        if strategy is not None:
            params[A.GENERATE_STRATEGY] = strategy
        sequences = _sequences(self.result if self.result is not None else call_result)
        prompt_length = self.prompt_length

        # --- steps ------------------------------------------------------------------------
        times: List[int] = []
        lengths: List[int] = []
        done: List[Any] = []
        recorder = self.recorder
        if recorder is not None:
            times = list(recorder.times_ns)
            lengths = list(recorder.lengths)
            done = list(recorder.done)
            if sequences is not None and strategy in _ROW_ALIGNED:
                # steps that transformers undid (MPS's deferred stop check) are not in the output
                final = int(sequences.shape[-1])
                while lengths and lengths[-1] > final:
                    del lengths[-1], times[-1], done[-1:]
            if not times and exc is None and self.kwargs.get("custom_generate") is not None:
                self.unobserved = A.UNOBSERVED_CUSTOM_GENERATE  # the custom loop never called the criteria
        elif call.timed and exc is None:
            self._missed_hook()  # the stopping-criteria hook was never reached
        if call.timed and exc is None and prompt_length is None:
            self._missed_hook()  # the prompt width was never learned: no token accounting
        self.step_ends_ns = times
        self.step_tokens = step_tokens(lengths, prompt_length if prompt_length is not None else 0)

        # --- token accounting from the tensors themselves -----------------------------------
        eos = pad = max_new = None
        if config is not None:
            eos = getattr(config, "eos_token_id", None)
            pad = getattr(config, "pad_token_id", None)
            max_new = getattr(config, "max_new_tokens", None)
            if max_new is None and getattr(config, "max_length", None) is not None and prompt_length is not None:
                max_new = int(config.max_length) - prompt_length
        inputs = self.inputs_tensor
        if _is_tensor(inputs) and inputs.dim() >= 2:
            params[A.GENERATE_BATCH_SIZE] = int(inputs.shape[0])
            # tokens only for token inputs: not for audio features or pixels (Whisper, vision encoders)
            if self.model_input_name in (None, "input_ids", "inputs_embeds"):
                self.input_tokens = count_input_tokens(inputs, self.kwargs.get("attention_mask"), pad, eos)
        if sequences is not None and prompt_length is not None and sequences.shape[-1] >= prompt_length:
            per_sequence = None
            if done and len(done) == len(lengths) and recorder.fault is None:
                # exact: each row ends at the step where a stopping criterion first said so
                per_sequence = counts_from_done(done, lengths, prompt_length, sequences)
            if per_sequence is None:  # beams, or no step data: read it off the tensor
                # beam search pads only after an EOS (which ends the count already): a trailing run of
                # tokens equal to the pad id in a beam without EOS is real output
                per_sequence = count_new_tokens(sequences, prompt_length, eos, None if strategy in _BEAM else pad)
            self.per_sequence = per_sequence
            self.output_tokens = int(sum(per_sequence))
            self.finish_reasons = finish_reasons(
                sequences,
                prompt_length,
                per_sequence,
                max_new,
                eos,
                forced_eos_token_id=getattr(config, "forced_eos_token_id", None),
                budget_rows=self._rows_out_of_time(lengths, prompt_length, per_sequence),
                stopped_rows=self._rows_at_a_stop_string(sequences, prompt_length, per_sequence, max_new),
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
                params[A.GEN_AI_REQUEST_STOP_SEQUENCES] = (
                    [stop_strings] if isinstance(stop_strings, str) else [str(s) for s in stop_strings]
                )
        if call.streamer is not None:
            call.request.first_chunk_ns = call.streamer._self_first_chunk_ns
            call.request.streamer_ns = call.streamer._self_inside_ns

    def _rows_at_a_stop_string(self, sequences: Any, prompt_length: int, counts: List[int], max_new: Any) -> List[int]:
        """Rows that used their whole budget and whose last token also completed a stop string: the
        stop string ended them (``StopStringCriteria`` asked once more on the final sequences; it has
        no state)."""
        from transformers.generation.stopping_criteria import StopStringCriteria

        if self.criteria is None or max_new is None:
            return []
        full = [
            row for row, count in enumerate(counts) if count >= max_new and prompt_length + count == sequences.shape[-1]
        ]
        criteria = [c for c in self.criteria if isinstance(c, StopStringCriteria)]
        if not full or not criteria:
            return []
        matched = set()
        for criterion in criteria:
            done = criterion(sequences, None)
            matched.update(row for row in full if bool(done[row]))
        return sorted(matched)

    def _rows_out_of_time(self, lengths: List[int], prompt_length: int, counts: List[int]) -> List[int]:
        """Rows that ``max_time`` ended: still running at the last step, which ended after the deadline.

        ``MaxTimeCriteria`` stops every row at once when ``time.time() - initial_timestamp >
        max_time``; the step's clock read follows the criteria's, so a last step that ended after
        the deadline is the one ``max_time`` ended.
        """
        from transformers.generation.stopping_criteria import MaxTimeCriteria

        if not self.step_ends_ns or not lengths or self.criteria is None:
            return []
        deadlines = [c.initial_timestamp + c.max_time for c in self.criteria if isinstance(c, MaxTimeCriteria)]
        if not deadlines:
            return []
        last_step_wall_s = self.call.request.wall_ns(self.step_ends_ns[-1]) / clock.NS_PER_S
        if last_step_wall_s <= min(deadlines):
            return []
        last = lengths[-1] - prompt_length
        return [row for row, count in enumerate(counts) if count >= last]


def _tokens_so_far(loop: Loop) -> List[int]:
    """Tokens per step a loop has recorded so far (it may still be running)."""
    recorder = loop.recorder
    if recorder is None:
        return []
    return step_tokens(list(recorder.lengths), loop.prompt_length if loop.prompt_length is not None else 0)


class _TimedStreamer(wrapt.ObjectProxy):
    """The user's streamer, with its calls timed (it is the same object to transformers and to
    ``isinstance``). transformers' first ``put`` is the prompt (or the decoder start tokens); the
    first ``put`` after it carries the first generated tokens."""

    def __init__(self, streamer: Any) -> None:
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


# --- what the hooks share ------------------------------------------------------------------------


def current_call(model: Any) -> Any:
    """What a ``generate()`` of ``model`` starting now belongs to.

    Returns ``_NESTED`` (inside a step of a running loop of the same request: an assistant
    model, a per-step depth decoder, early exit), the active :class:`Call` when the model is
    part of its request (itself or a submodule), or ``None`` (no request, or another model's:
    a request of its own).
    """
    frame = _ACTIVE.get()
    if frame is None:
        return None
    if frame is _NESTED:
        return _NESTED
    call = frame.call if isinstance(frame, Loop) else frame
    if isinstance(frame, Loop) and frame.running and (call.owns(model) or model is frame.kwargs.get("assistant_model")):
        return _NESTED
    return call if call.owns(model) else None


def pop_extras(kwargs: dict) -> dict:
    """Remove this package's keywords from ``kwargs``; validate them.

    Raises:
        TypeError: ``per_token_latency_callback`` is not callable.
    """
    extras = {key: kwargs.pop(key) for key in (CALLBACK_KWARG, TRACK_KWARG) if key in kwargs}
    callback = extras.get(CALLBACK_KWARG)
    if callback is not None and not callable(callback):
        raise TypeError(f"{CALLBACK_KWARG} must be callable as fn(token_index, latency_s), got {callback!r}")
    return extras


def run_request(
    telemetry: emit.Telemetry,
    original: Callable,
    model: Any,
    args: tuple,
    kwargs: dict,
    loop: bool,
    custom_generate: Any = None,
    call_args: Optional[tuple] = None,
) -> Any:
    """Run ``original(*call_args or (model, *args), **kwargs)`` as one request of ``model``.

    ``loop``: the call itself is a decoding loop (``GenerationMixin.generate``) rather than an
    outer ``generate()`` whose loops are inner calls.
    """
    call_args = (model, *args) if call_args is None else call_args
    extras = pop_extras(kwargs)  # never passed on to transformers, even when suppressed
    placement = ranks.placement(model, telemetry.options.tensor_parallel_spans)  # None unless distributed
    if not is_instrumentation_enabled():
        return original(*call_args, **kwargs)
    if placement is not None and placement.silent:  # rank 0 of the group emits this call
        token = _ACTIVE.set(_NESTED)  # the generate() calls inside it are not requests either
        try:
            return original(*call_args, **kwargs)
        finally:
            _ACTIVE.reset(token)
    try:
        call = Call(telemetry, model, args, kwargs, extras, custom_generate=custom_generate)
    except Exception as fault:
        log_fault_once("request start", fault)
        return original(*call_args, **kwargs)
    if placement is not None:
        ranks.apply(placement, call.request)
    call.outer = not loop
    # the user's GenerationMixin.generate is the request's loop: it starts when the request does
    frame = call.open_loop(model, kwargs, start_ns=call.request.start_ns) if loop else call
    if loop:
        setup_started(call)  # until its stopping criteria exist, uninstrument() waits for it
    token = _ACTIVE.set(frame)
    try:
        result = original(*call_args, **kwargs)
    except BaseException as exc:
        _ACTIVE.reset(token)
        if loop:
            frame.close(read_clock=False)
        call.finish(exc=exc)
        raise
    _ACTIVE.reset(token)
    if loop:
        frame.close(result, read_clock=False)
    return call.finish(result=result)


def setup_started(call: Call) -> None:
    """``call`` needs its loop's hooks: ``uninstrument()`` waits for :func:`setup_done` (bounded)."""
    telemetry = call.telemetry
    with telemetry.setups_changed:
        telemetry.setups[call] = threading.get_ident()


def setup_done(call: Call) -> None:
    """``call``'s loop reached its last set-up hook (the stopping criteria), or the call ended."""
    telemetry = call.telemetry
    if call not in telemetry.setups:
        return
    with telemetry.setups_changed:
        if telemetry.setups.pop(call, None) is not None:
            telemetry.setups_changed.notify_all()


def wait_for_setups(telemetry: emit.Telemetry, timeout_s: Optional[float] = None) -> bool:
    """Wait until no other thread's request is in its set-up, at most ``timeout_s`` seconds
    (default :data:`UNINSTRUMENT_SETUP_WAIT_S`); ``uninstrument()`` calls it after turning the
    instrumentation off for new requests and before removing the hooks, so that a request already
    started gets its loop's hooks. The calling thread's own requests are not waited for.

    Returns:
        True when none is left (one that is left carries ``generate.steps.uninstrumented``).
    """
    me = threading.get_ident()
    bound = UNINSTRUMENT_SETUP_WAIT_S if timeout_s is None else timeout_s
    with telemetry.setups_changed:
        return telemetry.setups_changed.wait_for(
            lambda: all(thread == me for thread in telemetry.setups.values()), timeout=bound
        )


def run_nested(original: Callable, model: Any, args: tuple, kwargs: dict) -> Any:
    """Run a ``generate()`` that belongs to a step of the running loop (an assistant model's, early
    exit's, one called from a logits processor) opaquely: nothing of it is recorded into the loop."""
    token = _ACTIVE.set(_NESTED)
    try:
        return original(model, *args, **kwargs)
    finally:
        _ACTIVE.reset(token)


def run_inner_loop(call: Call, original: Callable, model: Any, args: tuple, kwargs: dict) -> Any:
    """Run ``GenerationMixin.generate`` as one more decoding loop of ``call``."""
    pop_extras(kwargs)  # already handled by the outer call
    loop = call.open_loop(model, kwargs)
    token = _ACTIVE.set(loop)
    try:
        result = original(model, *args, **kwargs)
    except BaseException:
        _ACTIVE.reset(token)
        loop.close()
        raise
    _ACTIVE.reset(token)
    loop.close(result)
    return result


def compiler_disabled(function: Callable) -> Callable:
    """``function`` run eagerly even inside ``torch.compile``: dynamo graph-breaks at it instead of
    tracing through it (a wrapt proxy would be inlined and skipped), and traces what it calls."""
    try:
        import torch

        return torch.compiler.disable(function, recursive=False)
    except Exception:  # an old torch without torch.compiler.disable(recursive=...)
        return function


# --- the hooks ------------------------------------------------------------------------------------


def make_generate(original: Callable, telemetry: emit.Telemetry) -> Callable:
    """``GenerationMixin.generate``: a request of its own, or one more loop of the request in progress."""

    @functools.wraps(original)
    def generate(self, *args, **kwargs):
        if not telemetry.active:
            return original(self, *args, **kwargs)
        owner = current_call(self)
        if owner is _NESTED:  # inside a step of a running loop: the helpers it calls are not that loop's
            return run_nested(original, self, args, kwargs)
        if owner is not None:
            return run_inner_loop(owner, original, self, args, kwargs)
        return run_request(telemetry, original, self, args, kwargs, loop=True)

    return compiler_disabled(generate)


@functools.lru_cache(maxsize=None)
def _method_signature(function: Any) -> inspect.Signature:
    """The signature of a method's function without its ``self`` parameter (cached)."""
    signature = inspect.signature(function)
    return signature.replace(parameters=list(signature.parameters.values())[1:])


def loop_for(model: Any, telemetry: Optional[emit.Telemetry] = None) -> Optional[Loop]:
    """The loop a GenerationMixin helper called on ``model`` now records into, or ``None``.

    With ``telemetry``: only a loop of a request that this instrumentation started (while it was
    on: a request in flight when ``uninstrument()`` ran still gets its hooks; a new one has none).
    """
    frame = _ACTIVE.get()
    if isinstance(frame, Loop) and frame.model is model:
        call = frame.call
    elif isinstance(frame, Call) and frame.owns(model):
        call = frame
    else:
        return None
    if telemetry is not None and call.telemetry is not telemetry:
        return None
    return frame if frame is not call else call.implicit_loop(model)


def make_prepare_generated_length(original: Callable, telemetry: emit.Telemetry) -> Callable:
    """``GenerationMixin._prepare_generated_length``: learns the loop's config and prompt width."""
    signature = _method_signature(original)

    @functools.wraps(original)
    def _prepare_generated_length(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        loop = loop_for(self, telemetry)
        if loop is not None:
            try:
                # by name, whether generate() (keywords) or an overriding model (positional) called it
                bound = signature.bind(*args, **kwargs).arguments
                loop.on_generated_length(
                    result, bound.get("input_ids_length"), bound.get("inputs_tensor"), bound.get("model_input_name")
                )
            except Exception as fault:
                log_fault_once("generation config capture", fault)
        return result

    return compiler_disabled(_prepare_generated_length)


def make_get_stopping_criteria(original: Callable, telemetry: emit.Telemetry) -> Callable:
    """``GenerationMixin._get_stopping_criteria``: returns the criteria as a recording list."""

    @functools.wraps(original)
    def _get_stopping_criteria(self, *args, **kwargs):
        criteria = original(self, *args, **kwargs)
        loop = loop_for(self, telemetry)
        if loop is None:
            return criteria
        setup_done(loop.call)  # the loop's last set-up hook: uninstrument() need not wait any longer
        if loop.call.timed and loop.recorder is None:
            try:
                config = kwargs.get("generation_config", args[0] if args else None)
                return loop.recording_criteria(criteria, config)
            except Exception as fault:
                loop.incomplete = True
                log_fault_once("step hook install", fault)
        return criteria

    return compiler_disabled(_get_stopping_criteria)


def make_get_candidate_generator(original: Callable, telemetry: emit.Telemetry) -> Callable:
    """``GenerationMixin._get_candidate_generator``: which candidate generator assisted decoding uses."""

    @functools.wraps(original)
    def _get_candidate_generator(self, *args, **kwargs):
        generator = original(self, *args, **kwargs)
        frame = _ACTIVE.get()
        if isinstance(frame, Loop) and frame.model is self and frame.call.telemetry is telemetry:
            frame.assisted_generator = type(generator).__name__
            if frame.call.detailed:
                try:
                    figures.count_candidates(generator, frame)
                except Exception as fault:
                    log_fault_once("assisted candidates count", fault)
        return generator

    return compiler_disabled(_get_candidate_generator)


def make_prepare_cache_for_generation(original: Callable, telemetry: emit.Telemetry) -> Callable:
    """``GenerationMixin._prepare_cache_for_generation``: the loop's key/value cache object, to size it at the end."""
    signature = _method_signature(original)

    @functools.wraps(original)
    def _prepare_cache_for_generation(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        loop = loop_for(self, telemetry)
        if loop is not None and loop.call.detailed:
            try:
                model_kwargs = signature.bind(*args, **kwargs).arguments.get("model_kwargs") or {}
                for name in ("cache", "past_key_values", "cache_params"):
                    if model_kwargs.get(name) is not None:
                        loop.cache = model_kwargs[name]
                        break
            except Exception as fault:
                log_fault_once("key/value cache capture", fault)
        return result

    return compiler_disabled(_prepare_cache_for_generation)


#: method of ``GenerationMixin`` -> hook factory ``(original, telemetry) -> replacement``.
HOOKS = {
    "generate": make_generate,
    "_prepare_generated_length": make_prepare_generated_length,
    "_get_stopping_criteria": make_get_stopping_criteria,
    "_get_candidate_generator": make_get_candidate_generator,
    "_prepare_cache_for_generation": make_prepare_cache_for_generation,
}
#: The hooks without which there are no step spans.
REQUIRED = ("generate", "_prepare_generated_length", "_get_stopping_criteria")
