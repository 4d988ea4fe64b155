"""Producer: the hooks of one user call of ``generate()`` and of the decoding loops it runs.

A user's ``model.generate(...)`` is one request, a :class:`~.loop_state.Call`; each decoding loop
inside it is a :class:`~.loop_state.Loop` (the modules of this producer, bottom up:
:mod:`._routing`, :mod:`.streamer`, :mod:`.loop_state`, :mod:`.accounting`, then this one). When
the user call returns, :func:`finish` accounts its loops (:mod:`.accounting`) into one
:class:`~otel_generate.request.Request` and hands it to :func:`otel_generate.emit.hand_over`.

Hooks, installed by :class:`otel_generate.GenerateInstrumentor` as plain functions that the
compiler does not trace (``torch.compiler.disable(recursive=False)``: under
``torch.compile(model.generate)`` they still run, eagerly); :data:`otel_generate.instrumentor.PATCHES` lists them:

* ``GenerationMixin.generate`` (:func:`make_generate`): a request, or one loop of the request
  in progress;
* ``GenerationMixin._prepare_generated_length``: the loop's effective ``GenerationConfig`` and
  prompt width;
* ``GenerationMixin._get_stopping_criteria``: the criteria list becomes a
  :class:`~otel_generate.integrations.step_hook.RecordingCriteriaList`, whose call at the end of
  every decoding iteration is the step boundary (the only per-step code);
* ``GenerationMixin._get_candidate_generator`` and ``_prepare_cache_for_generation``: assisted
  decoding's candidate generator, the key/value cache (to size it at the end).

:func:`run_request` is also the entry of a model's own ``generate()`` and of ``custom_generate``
(:mod:`.overrides`). Content capture, when on, is attached to the call here
(:class:`~.loop_state.ContentCapture`, :mod:`.generate_content`); Whisper's windows attach
themselves (:mod:`.whisper`).
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
from typing import Any, Callable, Optional

from opentelemetry import context as otel_context
from opentelemetry.instrumentation.utils import is_instrumentation_enabled

from otel_generate import cancellation, clock, emit, figures, ranks
from otel_generate._faults import LOGGER_NAME, Fault, log_fault_once
from otel_generate.integrations._routing import (
    _ACTIVE,
    _NESTED,
    _is_tensor,
    compiler_disabled,
    current_call,
    loop_for,
)
from otel_generate.integrations.accounting import account_call
from otel_generate.integrations.loop_state import CALLBACK_KWARG, TRACK_KWARG, Call, Loop
from otel_generate.telemetry import Telemetry

_LOG = logging.getLogger(LOGGER_NAME)

#: ``uninstrument()`` waits at most this long (seconds) for other threads' requests still in their
#: set-up (their loop's hooks not reached yet) before it removes the hooks.
UNINSTRUMENT_SETUP_WAIT_S = 2.0


# --- the end of a call -----------------------------------------------------------------------------


def finish(call: Call, result: Any = None, exc: Optional[BaseException] = None) -> Any:
    """End the request: sync (or wait for its last device event), read the clock, account tokens,
    then emit; never raises.

    Returns ``result`` (with ``token_latencies`` attached when asked for).
    """
    request = call.request
    cancelled = cancellation.is_cancellation(exc)  # a departed client: not an error
    request.error = None if cancelled else exc
    setup_done(call)
    try:
        call.synchronize()
        events = call.events is not None
        if events:  # synchronize="events": the wait on the request's last event
            call.wait_for_last_event()
        request.end_ns = clock.monotonic_ns()
        if call.energy is not None:
            call.read_energy_end()
        request.memory_peak_bytes = call.memory(figures.peak_memory)
        for loop in call.loops:
            if not loop.closed and loop.observed():  # an implicit loop ends with its call
                loop.size_cache(result if loop.model is call.model else None)
        if events:  # the steps' device times, before they are accounted
            call.resolve_device_times()
        loops = account_call(call, result, exc)
        if call.energy is not None:
            call.attribute_energy(loops)
        if call.content is not None:  # opt-in content capture (otel_generate.content)
            call.content.fill(call, loops, result)
    except Exception as fault:
        request.incomplete = True
        log_fault_once(Fault.REQUEST_ACCOUNTING, fault)
    finally:
        try:
            otel_context.detach(call.context_token)
        except Exception as fault:  # pragma: no cover - context mismatch across threads
            log_fault_once(Fault.CONTEXT_DETACH, fault)
        if request.end_ns is None:
            try:
                request.end_ns = clock.monotonic_ns()
            except Exception:  # the clock itself is gone (already logged): let the SDK stamp the end
                request.incomplete = True
    # built on the caller's context, now current again (the call's own context is detached above);
    # track_token_latency needs the record now
    record, deferred = emit.hand_over(call.telemetry, call.span, request, call.profilers, need_record=call.track)
    if record is not None and call.track and result is not None:
        try:
            if _is_tensor(result):
                _LOG.info(
                    "otel_generate: track_token_latency needs return_dict_in_generate=True; "
                    "a plain tensor is returned unchanged"
                )
            else:
                object.__setattr__(result, "token_latencies", list(record.step_latencies_s))
        except Exception as fault:
            log_fault_once(Fault.TOKEN_LATENCIES, fault)
    # The loops' recorders call back into this call, and the exception's traceback holds the
    # wrappers' frames (reference cycles): drop both, so the call (prompt tensors, the caller's
    # kwargs) is freed when generate() returns, not at a later gc.
    call.release()
    if not deferred:
        request.error = None  # (a deferred emission drops it once done)
    return result


def _content_capture(telemetry: Telemetry) -> Any:
    """The :class:`~.loop_state.ContentCapture` of a new call, or ``None`` (content capture off: then
    :mod:`.generate_content`, which imports transformers' logits processors, is never imported)."""
    if telemetry.content is None:
        return None
    try:
        from otel_generate.integrations.generate_content import CAPTURE
    except Exception as fault:  # never break generate()
        log_fault_once(Fault.CONTENT_CAPTURE, fault)
        return None
    return CAPTURE


# --- one request, one loop --------------------------------------------------------------------------


def pop_extras(kwargs: dict) -> dict:
    """Remove this package's keywords from ``kwargs``; validate them.

    Raises:
        TypeError: ``per_token_latency_callback`` is not callable.
    """
    if CALLBACK_KWARG not in kwargs and TRACK_KWARG not in kwargs:
        return {}  # (the common case, without the comprehension)
    extras = {key: kwargs.pop(key) for key in (CALLBACK_KWARG, TRACK_KWARG) if key in kwargs}
    callback = extras.get(CALLBACK_KWARG)
    if callback is not None and not callable(callback):
        raise TypeError(f"{CALLBACK_KWARG} must be callable as fn(token_index, latency_s), got {callback!r}")
    return extras


def run_request(
    telemetry: Telemetry,
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
        log_fault_once(Fault.REQUEST_START, fault)
        return original(*call_args, **kwargs)
    call.content = _content_capture(telemetry)
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
        finish(call, exc=exc)
        raise
    _ACTIVE.reset(token)
    if loop:
        frame.close(result, read_clock=False)
    return finish(call, result=result)


def setup_started(call: Call) -> None:
    """``call`` needs its loop's hooks: ``uninstrument()`` waits for :func:`setup_done` (bounded)."""
    telemetry = call.telemetry
    with telemetry.setups_lock:  # (setups_changed's lock)
        telemetry.setups[call] = threading.get_ident()


def setup_done(call: Call) -> None:
    """``call``'s loop reached its last set-up hook (the stopping criteria), or the call ended."""
    telemetry = call.telemetry
    if call not in telemetry.setups:
        return
    with telemetry.setups_lock:  # (setups_changed's lock: held, so that it may be notified)
        if telemetry.setups.pop(call, None) is not None and telemetry.setup_waiters:
            telemetry.setups_changed.notify_all()  # (only uninstrument() waits, rarely: then it is told)


def wait_for_setups(telemetry: Telemetry, timeout_s: Optional[float] = None) -> bool:
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
        telemetry.setup_waiters += 1  # (setup_done notifies only while someone waits)
        try:
            return telemetry.setups_changed.wait_for(
                lambda: all(thread == me for thread in telemetry.setups.values()), timeout=bound
            )
        finally:
            telemetry.setup_waiters -= 1


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


# --- the hooks ------------------------------------------------------------------------------------


def make_generate(original: Callable, telemetry: Telemetry) -> Callable:
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


def _arguments_reader(function: Any) -> Callable[[tuple, dict], Any]:
    """``(args, kwargs) -> {name: value}`` of a call of the method ``function`` (``self`` left out),
    as ``Signature.bind(...).arguments`` gives for a call that succeeded. Where every parameter
    is a plain one (no ``*args``/``**kwargs``/positional-only), the positional values are zipped
    with the parameter names (``bind`` costs about 4 us a call); otherwise ``bind``."""
    signature = _method_signature(function)
    plain = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    if all(parameter.kind in plain for parameter in signature.parameters.values()):
        names = tuple(signature.parameters)

        def read(args: tuple, kwargs: dict) -> Any:
            if not args:
                return kwargs
            arguments = dict(zip(names, args))
            arguments.update(kwargs)
            return arguments

        return read
    return lambda args, kwargs: signature.bind(*args, **kwargs).arguments


def make_prepare_generated_length(original: Callable, telemetry: Telemetry) -> Callable:
    """``GenerationMixin._prepare_generated_length``: learns the loop's config and prompt width."""
    arguments = _arguments_reader(original)

    @functools.wraps(original)
    def _prepare_generated_length(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        loop = loop_for(self, telemetry)
        if loop is not None:
            try:
                # by name, whether generate() (keywords) or an overriding model (positional) called it
                bound = arguments(args, kwargs)
                loop.on_generated_length(
                    result, bound.get("input_ids_length"), bound.get("inputs_tensor"), bound.get("model_input_name")
                )
            except Exception as fault:
                log_fault_once(Fault.GENERATION_CONFIG_CAPTURE, fault)
        return result

    return compiler_disabled(_prepare_generated_length)


def make_get_stopping_criteria(original: Callable, telemetry: Telemetry) -> Callable:
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
                log_fault_once(Fault.STEP_HOOK_INSTALL, fault)
        return criteria

    return compiler_disabled(_get_stopping_criteria)


def make_get_candidate_generator(original: Callable, telemetry: Telemetry) -> Callable:
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
                    log_fault_once(Fault.ASSISTED_CANDIDATES_COUNT, fault)
        return generator

    return compiler_disabled(_get_candidate_generator)


def make_prepare_cache_for_generation(original: Callable, telemetry: Telemetry) -> Callable:
    """``GenerationMixin._prepare_cache_for_generation``: the loop's key/value cache object, to size it at the end."""
    arguments = _arguments_reader(original)

    @functools.wraps(original)
    def _prepare_cache_for_generation(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        loop = loop_for(self, telemetry)
        if loop is not None and loop.call.detailed:
            try:
                model_kwargs = arguments(args, kwargs).get("model_kwargs") or {}
                for name in ("cache", "past_key_values", "cache_params"):
                    if model_kwargs.get(name) is not None:
                        loop.cache = model_kwargs[name]
                        break
            except Exception as fault:
                log_fault_once(Fault.KEY_VALUE_CACHE_CAPTURE, fault)
        return result

    return compiler_disabled(_prepare_cache_for_generation)
