"""OpenTelemetry instrumentation for Hugging Face transformers' ``generate()``.

Every ``generate()`` call becomes a span (``text_completion {model}``); every decode step
becomes a child span (``prefill`` for the first, ``decode`` for the rest) carrying its token
index and its latency, measured after waiting for the device. The same measurements feed the
GenAI metrics and the Python APIs (:class:`TokenLatencyProfiler`, ``per_token_latency_callback``,
``track_token_latency``).

Usage
-----
With no code change::

    pip install otel-generate opentelemetry-distro
    opentelemetry-instrument --traces_exporter console --metrics_exporter none python app.py

With one line::

    from otel_generate import GenerateInstrumentor

    GenerateInstrumentor().instrument()
    model.generate(**inputs)          # -> one request span with one child span per step

    GenerateInstrumentor().uninstrument()

Configuration
-------------
``instrument()`` takes these keywords (an unknown keyword raises ``TypeError``):

* ``tracer_provider`` / ``meter_provider``: providers to use instead of the global ones.
* ``synchronize`` (bool, default ``True``): wait for the device (``torch.cuda.synchronize``,
  ``torch.xpu.synchronize``, ``torch.mps.synchronize``) before each step's clock read. On CPU
  nothing is called either way. Environment: ``OTEL_GENERATE_SYNCHRONIZE=true|false``.
* ``max_step_spans`` (int >= 0, default 1024): at most this many step spans per request; the
  request span still carries the totals and ``generate.step_spans.dropped`` says how many steps
  were timed but not exported as spans. Environment: ``OTEL_GENERATE_MAX_STEP_SPANS``.

Keyword arguments win over environment variables; an environment value that cannot be parsed
is reported once with a warning and the default is used. Suppressing instrumentation
(``opentelemetry.instrumentation.utils.suppress_instrumentation``) or an unsampled request span
turns all per-step work off.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
from typing import Any, Collection, Dict

from opentelemetry import metrics, trace
from opentelemetry.instrumentation.instrumentor import BaseInstrumentor
from opentelemetry.instrumentation.utils import is_instrumentation_enabled

from otel_generate import _lifecycle, _patch, _versions
from otel_generate import attributes as A
from otel_generate._request import (
    _ACTIVE,
    _NESTED,
    CALLBACK_KWARG,
    TRACK_KWARG,
    GenerateRequest,
    Telemetry,
    log_fault_once,
)
from otel_generate.package import _instruments
from otel_generate.record import GenerationRecord
from otel_generate.version import __version__

__all__ = ["GenerateInstrumentor", "GenerationRecord", "TokenLatencyProfiler", "__version__"]

_LOG = logging.getLogger("otel_generate")

ENV_SYNCHRONIZE = "OTEL_GENERATE_SYNCHRONIZE"
ENV_MAX_STEP_SPANS = "OTEL_GENERATE_MAX_STEP_SPANS"
DEFAULT_MAX_STEP_SPANS = 1024

_GENERATION_MODULE = "transformers.generation.utils"
_GENERATION_CLASS = "GenerationMixin"
# (method, wrapper factory) pairs patched on GenerationMixin.
_PATCHED = ("generate", "_prepare_generated_length", "_get_stopping_criteria")
_OPTIONS = ("tracer_provider", "meter_provider", "synchronize", "max_step_spans")

_TRUE = {"1", "true", "yes", "on"}
_warned_env: set = set()  # (variable, value) pairs already reported: one warning per process
_FALSE = {"0", "false", "no", "off"}


def _warn_env(name: str, raw: str, expected: str, default: Any) -> None:
    if (name, raw) not in _warned_env:
        _warned_env.add((name, raw))
        _LOG.warning("otel_generate: %s=%r is not %s; using the default %s", name, raw, expected, default)


def _env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    _warn_env(name, raw, "a boolean (true/false)", default)
    return default


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw.strip())
        if value < 0:
            raise ValueError
    except ValueError:
        _warn_env(name, raw, "a non-negative integer", default)
        return default
    return value


def _resolve_options(kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """Validate ``instrument()`` keywords; environment variables fill what is not given."""
    unknown = sorted(set(kwargs) - set(_OPTIONS))
    if unknown:
        raise TypeError(
            f"GenerateInstrumentor.instrument() got unknown option(s) {', '.join(map(repr, unknown))}; "
            f"expected some of {', '.join(_OPTIONS)}"
        )
    for name, method in (("tracer_provider", "get_tracer"), ("meter_provider", "get_meter")):
        provider = kwargs.get(name)
        if provider is not None and not callable(getattr(provider, method, None)):
            raise TypeError(f"{name} must be an OpenTelemetry provider with {method}(), got {type(provider).__name__} {provider!r}")
    synchronize = kwargs.get("synchronize")
    if synchronize is None:
        synchronize = _env_bool(ENV_SYNCHRONIZE, True)
    elif not isinstance(synchronize, bool):
        raise TypeError(f"synchronize must be a bool, got {type(synchronize).__name__} {synchronize!r}")
    max_step_spans = kwargs.get("max_step_spans")
    if max_step_spans is None:
        max_step_spans = _env_int(ENV_MAX_STEP_SPANS, DEFAULT_MAX_STEP_SPANS)
    elif isinstance(max_step_spans, bool) or not isinstance(max_step_spans, int):
        raise TypeError(f"max_step_spans must be an int, got {type(max_step_spans).__name__} {max_step_spans!r}")
    elif max_step_spans < 0:
        raise ValueError(f"max_step_spans must be >= 0, got {max_step_spans}")
    return {
        "tracer_provider": kwargs.get("tracer_provider"),
        "meter_provider": kwargs.get("meter_provider"),
        "synchronize": synchronize,
        "max_step_spans": max_step_spans,
    }


def _assisted_calls_criteria_on_candidates(mixin: Any) -> bool:
    """transformers < 4.47 calls the stopping criteria on the candidate tokens too (not a step)."""
    try:
        return "stopping_criteria(candidate_input_ids" in inspect.getsource(mixin._assisted_decoding)
    except (OSError, TypeError, AttributeError):
        return False


def _create_instruments(meter_provider: Any) -> Dict[str, Any]:
    meter = metrics.get_meter(__name__, __version__, meter_provider)

    def histogram(name: str, unit: str, description: str, buckets: Collection[float]) -> Any:
        return meter.create_histogram(
            name, unit=unit, description=description, explicit_bucket_boundaries_advisory=list(buckets)
        )

    return {
        A.METRIC_TIME_TO_FIRST_TOKEN: histogram(
            A.METRIC_TIME_TO_FIRST_TOKEN, "s", "Time to generate the first token (prefill step).",
            A.BUCKETS_TIME_TO_FIRST_TOKEN_S,
        ),
        A.METRIC_TIME_PER_OUTPUT_TOKEN: histogram(
            A.METRIC_TIME_PER_OUTPUT_TOKEN, "s",
            "Time per output token after the first, per request (mean decode step).",
            A.BUCKETS_TIME_PER_OUTPUT_TOKEN_S,
        ),
        A.METRIC_REQUEST_DURATION: histogram(
            A.METRIC_REQUEST_DURATION, "s", "Duration of the generate() call.", A.BUCKETS_REQUEST_DURATION_S,
        ),
        A.METRIC_TOKEN_USAGE: histogram(
            A.METRIC_TOKEN_USAGE, "{token}", "Input and output tokens per request.", A.BUCKETS_TOKEN_USAGE,
        ),
    }


def _generate_wrapper(telemetry: Telemetry):
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
            isinstance(active, GenerateRequest)
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
            request = GenerateRequest(telemetry, model, model_args, kwargs, extras)
        except Exception as fault:
            log_fault_once("request start", fault)
            return wrapped(*args, **kwargs)
        token = _ACTIVE.set(request)
        try:
            result = wrapped(*args, **kwargs)
        except BaseException as exc:
            _ACTIVE.reset(token)
            request.finish(exc=exc)
            raise
        _ACTIVE.reset(token)
        return request.finish(result=result)

    return wrapper


@functools.lru_cache(maxsize=None)
def _method_signature(function: Any) -> inspect.Signature:
    """The signature of a method's function without its ``self`` parameter (cached)."""
    signature = inspect.signature(function)
    return signature.replace(parameters=list(signature.parameters.values())[1:])


def _signature(bound_method: Any) -> inspect.Signature:
    function = getattr(bound_method, "__func__", None)
    return inspect.signature(bound_method) if function is None else _method_signature(function)


def _prepare_generated_length_wrapper(telemetry: Telemetry):
    """Wrapper of ``GenerationMixin._prepare_generated_length``: learns the prompt width and config."""

    def wrapper(wrapped, instance, args, kwargs):
        result = wrapped(*args, **kwargs)
        request = _ACTIVE.get()
        if isinstance(request, GenerateRequest) and request.model is instance:
            try:
                # by name, whether generate() (keywords) or an overriding model (positional) called it
                bound = _signature(wrapped).bind(*args, **kwargs).arguments
                request.on_generated_length(
                    result, bound.get("input_ids_length"), bound.get("inputs_tensor"), bound.get("model_input_name")
                )
            except Exception as fault:
                log_fault_once("generation config capture", fault)
        return result

    return wrapper


def _get_stopping_criteria_wrapper(telemetry: Telemetry):
    """Wrapper of ``GenerationMixin._get_stopping_criteria``: returns the criteria as a recording list."""

    def wrapper(wrapped, instance, args, kwargs):
        criteria = wrapped(*args, **kwargs)
        request = _ACTIVE.get()
        if (
            isinstance(request, GenerateRequest)
            and request.model is instance
            and request.timed
            and request.recorder is None
        ):
            try:
                config = kwargs.get("generation_config", args[0] if args else None)
                return request.recording_criteria(criteria, config)
            except Exception as fault:
                request.incomplete = True
                log_fault_once("step hook install", fault)
        return criteria

    return wrapper


_FACTORIES = {
    "generate": _generate_wrapper,
    "_prepare_generated_length": _prepare_generated_length_wrapper,
    "_get_stopping_criteria": _get_stopping_criteria_wrapper,
}


class GenerateInstrumentor(BaseInstrumentor):
    """An instrumentor for ``transformers.GenerationMixin.generate``.

    See the module docstring for usage and options. ``BaseInstrumentor`` makes it a singleton:
    ``GenerateInstrumentor().instrument()`` a second time only logs a warning.
    """

    def instrumentation_dependencies(self) -> Collection[str]:
        return _instruments

    def _check_dependency_conflicts(self) -> Any:
        # [prod] pre-releases of supported versions pass, whatever packaging is installed (_versions)
        return _versions.dependency_conflict(self.instrumentation_dependencies())

    def instrument(self, **kwargs: Any) -> Any:
        """Instrument ``generate()`` (see the module docstring for the keywords).

        If only a :class:`TokenLatencyProfiler` had turned the instrumentation on, this call
        takes it over with these keywords, and leaving the profiler no longer turns it off.
        """
        from otel_generate import profiler

        if self.is_instrumented_by_opentelemetry and profiler.take_over_from_profilers():
            self.uninstrument()
        return super().instrument(**kwargs)

    def _instrument(self, **kwargs: Any) -> None:
        options = _resolve_options(kwargs)
        from transformers.generation.utils import GenerationMixin

        from otel_generate.profiler import active_profilers

        missing = [name for name in _PATCHED if not hasattr(GenerationMixin, name)]
        if missing:
            _LOG.warning(
                "otel_generate: this transformers has no GenerationMixin.%s; request spans only, no step spans",
                ", ".join(missing),
            )
        tracer = trace.get_tracer(__name__, __version__, options["tracer_provider"])
        telemetry = Telemetry(
            tracer=tracer,
            instruments=_create_instruments(options["meter_provider"]),
            synchronize=options["synchronize"],
            max_step_spans=options["max_step_spans"],
            skip_candidate_calls=_assisted_calls_criteria_on_candidates(GenerationMixin),
            profilers=active_profilers,
        )
        for name in _PATCHED:
            if hasattr(GenerationMixin, name):
                _patch.wrap(GenerationMixin, name, _FACTORIES[name](telemetry))  # [prod] the one patch registry
        _lifecycle.enable(options["tracer_provider"], options["meter_provider"])  # [prod] workers flush on exit

    def _uninstrument(self, **kwargs: Any) -> None:
        _patch.unwrap_all()  # [prod] removes only our wrappers, wherever they sit in a chain
        _lifecycle.disable()  # [prod] the fork hook stays registered but does nothing


from otel_generate.profiler import TokenLatencyProfiler  # noqa: E402  (needs GenerateInstrumentor)
