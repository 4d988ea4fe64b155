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
* ``capture_message_content`` (bool or ``"NO_CONTENT"``, ``"SPAN_ONLY"``, ``"EVENT_ONLY"``,
  ``"SPAN_AND_EVENT"``; default off): the prompt and completion text as
  ``gen_ai.input.messages`` / ``gen_ai.output.messages`` (``True`` means ``SPAN_ONLY``), when a
  tokenizer is at hand (see :mod:`otel_generate.content`). Environment:
  ``OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT``.
* ``logger_provider``: the logs-API provider the ``gen_ai.client.inference.operation.details``
  event goes to (``EVENT_ONLY``, ``SPAN_AND_EVENT``) instead of the global one.
* ``capture_step_token_ids`` (bool, default ``False``): ``generate.step.token_ids`` on the step
  spans. Environment: ``OTEL_GENERATE_CAPTURE_STEP_TOKEN_IDS``.
* ``capture_step_logprobs`` (bool, default ``False``): ``generate.step.logprobs`` (and the token
  ids) on the step spans, for greedy and sampling requests. Environment:
  ``OTEL_GENERATE_CAPTURE_STEP_LOGPROBS``.

Keyword arguments win over environment variables; an environment value that cannot be parsed
is reported once with a warning and the default is used. Suppressing instrumentation
(``opentelemetry.instrumentation.utils.suppress_instrumentation``) or an unsampled request span
turns all per-step work off.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Collection, Dict

from opentelemetry.instrumentation.instrumentor import BaseInstrumentor

from otel_generate import _lifecycle, _versions
from otel_generate import content as _content
from otel_generate._patch import Patches
from otel_generate.emit import Telemetry, create_instruments, get_event_logger, get_tracer
from otel_generate.integrations import generate_loop, overrides, whisper
from otel_generate.package import _instruments
from otel_generate.record import GenerationRecord
from otel_generate.version import __version__

__all__ = ["GenerateInstrumentor", "GenerationRecord", "TokenLatencyProfiler", "__version__"]

_LOG = logging.getLogger("otel_generate")

ENV_SYNCHRONIZE = "OTEL_GENERATE_SYNCHRONIZE"
ENV_MAX_STEP_SPANS = "OTEL_GENERATE_MAX_STEP_SPANS"
DEFAULT_MAX_STEP_SPANS = 1024

_OPTIONS = (
    "tracer_provider",
    "meter_provider",
    "logger_provider",
    "synchronize",
    "max_step_spans",
    "capture_message_content",
    "capture_step_token_ids",
    "capture_step_logprobs",
)

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


def _env_content_mode() -> "_content.ContentMode":
    raw = os.environ.get(_content.ENV_CAPTURE_MESSAGE_CONTENT)
    if raw is None:
        return _content.ContentMode.NO_CONTENT
    try:
        return _content.parse_mode(raw)
    except ValueError:
        _warn_env(_content.ENV_CAPTURE_MESSAGE_CONTENT, raw, f"one of {_content.ACCEPTED_MODES}", "NO_CONTENT")
        return _content.ContentMode.NO_CONTENT


def _bool_option(kwargs: Dict[str, Any], name: str, env: str) -> bool:
    value = kwargs.get(name)
    if value is None:
        return _env_bool(env, False)
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return value


def _resolve_options(kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """Validate ``instrument()`` keywords; environment variables fill what is not given."""
    unknown = sorted(set(kwargs) - set(_OPTIONS))
    if unknown:
        raise TypeError(
            f"GenerateInstrumentor.instrument() got unknown option(s) {', '.join(map(repr, unknown))}; "
            f"expected some of {', '.join(_OPTIONS)}"
        )
    for name, method in (
        ("tracer_provider", "get_tracer"), ("meter_provider", "get_meter"), ("logger_provider", "get_logger")
    ):
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
    mode = kwargs.get("capture_message_content")
    mode = _env_content_mode() if mode is None else _content.parse_mode(mode)  # TypeError / ValueError
    return {
        "tracer_provider": kwargs.get("tracer_provider"),
        "meter_provider": kwargs.get("meter_provider"),
        "logger_provider": kwargs.get("logger_provider"),
        "synchronize": synchronize,
        "max_step_spans": max_step_spans,
        "capture_message_content": mode,
        "capture_step_token_ids": _bool_option(kwargs, "capture_step_token_ids", _content.ENV_CAPTURE_STEP_TOKEN_IDS),
        "capture_step_logprobs": _bool_option(kwargs, "capture_step_logprobs", _content.ENV_CAPTURE_STEP_LOGPROBS),
    }


def _content_options(options: Dict[str, Any]) -> Any:
    """The :class:`~otel_generate.content.ContentOptions` to capture, or ``None`` when nothing is."""
    mode = options["capture_message_content"]
    token_ids, logprobs = options["capture_step_token_ids"], options["capture_step_logprobs"]
    if mode is _content.ContentMode.NO_CONTENT and not token_ids and not logprobs:
        return None
    return _content.ContentOptions(
        mode=mode,
        step_token_ids=token_ids or logprobs,
        step_logprobs=logprobs,
        event_logger=get_event_logger(options["logger_provider"]) if mode.on_event else None,
    )


class GenerateInstrumentor(BaseInstrumentor):
    """An instrumentor for ``transformers.GenerationMixin.generate``.

    See the module docstring for usage and options. ``BaseInstrumentor`` makes it a singleton:
    ``GenerateInstrumentor().instrument()`` a second time only logs a warning.
    """

    def instrumentation_dependencies(self) -> Collection[str]:
        return _instruments

    def _check_dependency_conflicts(self) -> Any:
        # pre-releases of supported versions pass, whatever packaging is installed (_versions)
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

        missing = [name for name in generate_loop.REQUIRED if name not in GenerationMixin.__dict__]
        if missing:
            _LOG.warning(
                "otel_generate: this transformers has no GenerationMixin.%s; request spans only, no step spans",
                ", ".join(missing),
            )
        telemetry = Telemetry(
            tracer=get_tracer(options["tracer_provider"]),
            instruments=create_instruments(options["meter_provider"]),
            synchronize=options["synchronize"],
            max_step_spans=options["max_step_spans"],
            skip_candidate_calls=generate_loop.assisted_calls_criteria_on_candidates(GenerationMixin),
            profilers=active_profilers,
            content=_content_options(options),
        )
        # Every patch, in one place: GenerationMixin's loop (generate_loop), every model class's own
        # generate() and custom_generate (overrides), Whisper's windows (whisper), and, only when
        # content capture is on, the pipelines' tokenizer and the step log-probabilities (content).
        patches = Patches()
        for name, factory in generate_loop.HOOKS.items():
            patches.replace(GenerationMixin, name, factory, telemetry)
        overrides.install(patches, telemetry, GenerationMixin)
        whisper.install(patches, telemetry)
        if telemetry.content is not None:
            from otel_generate.integrations import generate_content, pipelines

            if telemetry.content.mode is not _content.ContentMode.NO_CONTENT:
                pipelines.install(patches, telemetry)
            if telemetry.content.step_logprobs:
                generate_content.install(patches, telemetry, GenerationMixin)
        self._telemetry, self._patches = telemetry, patches
        _lifecycle.enable(options["tracer_provider"], options["meter_provider"])  # pool workers flush on exit

    def _uninstrument(self, **kwargs: Any) -> None:
        telemetry, patches = getattr(self, "_telemetry", None), getattr(self, "_patches", None)
        if telemetry is not None:
            telemetry.active = False  # hooks still reachable (a bound method held somewhere) only call through
        if patches is not None:
            patches.restore_all()
        self._telemetry = self._patches = None
        _lifecycle.disable()  # the fork hook stays registered but does nothing


from otel_generate.profiler import TokenLatencyProfiler  # noqa: E402  (needs GenerateInstrumentor)
