"""Routing of a ``generate()`` producer: which request, and which decoding loop, a hook records into.

The one piece of state shared by the hooks is :data:`_ACTIVE`, a context variable holding the
innermost instrumented frame running in this context. Its four values:

* a loop (:class:`LoopFrame`, i.e. :class:`~.loop_state.Loop`): a decoding loop of a request is
  running (the GenerationMixin helpers record into it);
* a call (:class:`CallFrame`, i.e. :class:`~.loop_state.Call`): a request whose loop is not open
  (a model's own ``generate()`` between its inner loops);
* :data:`_NESTED`: inside a ``generate()`` that runs within a step of a loop (an assistant model,
  a per-step depth decoder): nothing there is recorded;
* ``None``: no request.

Also here: the pure helpers every producer shares (the strategy of a ``GenerationConfig``, the
model's name, the returned sequences of a ``generate()`` result), and the OpenTelemetry context
key of a served request's response id (:data:`RESPONSE_ID_KEY`). This module imports nothing of
the package but :mod:`otel_generate.attributes` (a leaf module of names): the frames are told
apart by the two marker classes below, which :mod:`.loop_state` subclasses.
"""

from __future__ import annotations

import contextvars
import inspect
from typing import Any, Callable, Optional

from opentelemetry import context as otel_context

from otel_generate import attributes as A

#: The innermost instrumented frame running in this context (see the module docstring).
_ACTIVE: contextvars.ContextVar[Any] = contextvars.ContextVar("otel_generate_active_request", default=None)
#: The frame of a ``generate()`` running inside a step of a loop: not recorded.
_NESTED = object()
#: OpenTelemetry context key: the id the client of a served request receives (``gen_ai.response.id``).
#: :mod:`.serve` sets it, with the request's parent, where the model's process of ``transformers
#: serve`` (5.25 and newer) takes the request from an API server; the producers read it at submission.
RESPONSE_ID_KEY = otel_context.create_key("otel_generate.response_id")


def response_id(context: Any = None) -> Optional[str]:
    """The served request's response id in ``context`` (default: the current one), else ``None``."""
    value = otel_context.get_value(RESPONSE_ID_KEY, context)
    return value if isinstance(value, str) else None


#: Strategies whose stopping-criteria rows are the returned sequences (beam search checks
#: flattened candidate beams instead).
ROW_ALIGNED = (A.STRATEGY_GREEDY, A.STRATEGY_SAMPLE, A.STRATEGY_ASSISTED, A.STRATEGY_CUSTOM_GENERATE)
#: Strategies whose loop (transformers' own ``_sample``, not a ``custom_generate``) appends exactly
#: one token per row before each stopping-criteria call.
ONE_TOKEN_STEPS = (A.STRATEGY_GREEDY, A.STRATEGY_SAMPLE)
#: Strategies that return beams (padded only after their EOS).
BEAM = (
    A.STRATEGY_BEAM_SEARCH,
    A.STRATEGY_BEAM_SAMPLE,
    A.STRATEGY_GROUP_BEAM_SEARCH,
    A.STRATEGY_CONSTRAINED_BEAM_SEARCH,
)
#: Decoding methods that transformers 5.x runs as ``custom_generate`` repositories: their name
#: is kept as the strategy when their repository's loop runs.
HUB_MODES = (
    A.STRATEGY_CONTRASTIVE_SEARCH,
    A.STRATEGY_GROUP_BEAM_SEARCH,
    A.STRATEGY_CONSTRAINED_BEAM_SEARCH,
    A.STRATEGY_DOLA,
)


class CallFrame:
    """Marker base of :class:`~.loop_state.Call` (a request) as a value of :data:`_ACTIVE`."""

    __slots__ = ()


class LoopFrame:
    """Marker base of :class:`~.loop_state.Loop` (a decoding loop) as a value of :data:`_ACTIVE`."""

    __slots__ = ()


def current_call(model: Any) -> Any:
    """What a ``generate()`` of ``model`` starting now belongs to.

    Returns ``_NESTED`` (inside a step of a running loop of the same request: an assistant
    model, a per-step depth decoder, early exit), the active call when the model is part of its
    request (itself or a submodule), or ``None`` (no request, or another model's: a request of
    its own).
    """
    frame = _ACTIVE.get()
    if frame is None:
        return None
    if frame is _NESTED:
        return _NESTED
    is_loop = isinstance(frame, LoopFrame)
    call = frame.call if is_loop else frame
    if is_loop and frame.running and (call.owns(model) or model is frame.kwargs.get("assistant_model")):
        return _NESTED
    return call if call.owns(model) else None


def active_call() -> Any:
    """The call (request) running in this context, whether or not one of its loops is open, else ``None``."""
    frame = _ACTIVE.get()
    if isinstance(frame, LoopFrame):
        return frame.call
    return frame if isinstance(frame, CallFrame) else None


def loop_for(model: Any, telemetry: Any = None) -> Any:
    """The loop a GenerationMixin helper called on ``model`` now records into, or ``None``.

    With ``telemetry``: only a loop of a request that this instrumentation started (while it was
    on: a request in flight when ``uninstrument()`` ran still gets its hooks; a new one has none).
    """
    frame = _ACTIVE.get()
    if isinstance(frame, LoopFrame) and frame.model is model:
        call = frame.call
    elif isinstance(frame, CallFrame) and frame.owns(model):
        call = frame
    else:
        return None
    if telemetry is not None and call.telemetry is not telemetry:
        return None
    return frame if frame is not call else call.implicit_loop(model)


def compiler_disabled(function: Callable) -> Callable:
    """``function`` run eagerly even inside ``torch.compile``: dynamo graph-breaks at it instead of
    tracing through it (a wrapt proxy would be inlined and skipped), and traces what it calls."""
    try:
        import torch

        return torch.compiler.disable(function, recursive=False)
    except Exception:  # an old torch without torch.compiler.disable(recursive=...)
        return function


# --- pure helpers -------------------------------------------------------------------------------


def model_name(model: Any) -> str:
    """``gen_ai.request.model``: the model's ``name_or_path``, else its config's ``_name_or_path``,
    else its class name."""
    name = getattr(model, "name_or_path", None)
    if not name:
        config = getattr(model, "config", None)
        try:  # (read from the config's own dictionary: transformers' configs run Python code on
            # every attribute read, about 13,500 instructions for this one)
            name = object.__getattribute__(config, "__dict__").get("_name_or_path")
        except (AttributeError, TypeError):  # no instance dictionary
            name = None
        if name is None:  # (not an instance attribute: as getattr finds it)
            name = getattr(config, "_name_or_path", None)
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


def loop_strategy(generation_config: Any, kwargs: dict) -> Optional[str]:
    """The strategy of a decoding loop run with ``kwargs`` under ``generation_config`` (``None``:
    not known yet); a callable ``custom_generate`` is ``custom_generate`` unless it is one of the
    Hub's decoding methods."""
    if generation_config is None:
        return None
    custom = kwargs.get("custom_generate")
    strategy = strategy_of(generation_config, kwargs.get("assistant_model"))
    if custom is not None and not isinstance(custom, str) and strategy not in HUB_MODES:
        return A.STRATEGY_CUSTOM_GENERATE  # a callable loop ran instead of transformers' own
    return strategy


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
