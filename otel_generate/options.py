"""The options of ``GenerateInstrumentor().instrument()``: keywords, environment variables, defaults.

Keyword arguments win over environment variables. A keyword of the wrong type raises
``TypeError`` (an unknown keyword too), a value out of range ``ValueError``; nothing is
instrumented after the error. An environment value that cannot be parsed is reported once per
process with a warning naming the variable, the value and the default, and the default applies;
an empty variable means unset.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple, TypeVar, Union

from otel_generate import content as _content
from otel_generate._faults import LOGGER_NAME
from otel_generate.policy import STEP_SPAN_POLICIES, STEP_SPANS_ALL, STEP_SPANS_NONE, STEP_SPANS_SLOW  # noqa: F401 (re-exported)

_LOG = logging.getLogger(LOGGER_NAME)
T = TypeVar("T")

ENV_SYNCHRONIZE = "OTEL_GENERATE_SYNCHRONIZE"
ENV_MAX_STEP_SPANS = "OTEL_GENERATE_MAX_STEP_SPANS"
ENV_STEP_SPANS = "OTEL_GENERATE_STEP_SPANS"
ENV_SLOW_TIME_TO_FIRST_TOKEN = "OTEL_GENERATE_SLOW_TIME_TO_FIRST_TOKEN"
ENV_SLOW_TIME_PER_OUTPUT_TOKEN = "OTEL_GENERATE_SLOW_TIME_PER_OUTPUT_TOKEN"
ENV_SLOW_FRACTION = "OTEL_GENERATE_SLOW_FRACTION"
ENV_OUTLIER_FACTOR = "OTEL_GENERATE_STEP_OUTLIER_FACTOR"
ENV_BACKGROUND_EMISSION = "OTEL_GENERATE_BACKGROUND_EMISSION"
ENV_MEASURE_MEMORY = "OTEL_GENERATE_MEASURE_MEMORY"
ENV_MEASURE_ENERGY = "OTEL_GENERATE_MEASURE_ENERGY"
ENV_TENSOR_PARALLEL_SPANS = "OTEL_GENERATE_TENSOR_PARALLEL_SPANS"

DEFAULT_MAX_STEP_SPANS = 1024
#: ``synchronize`` values: ``True`` (also written ``"wait"``, the default) waits for the device before
#: each step's clock read; ``"events"`` records a CUDA timing event per step instead and reads the
#: device times after the request (no wait per step); ``False`` waits for nothing (launch times).
SYNCHRONIZE_WAIT = "wait"
SYNCHRONIZE_EVENTS = "events"
SYNCHRONIZE_MODES = (True, False, SYNCHRONIZE_WAIT, SYNCHRONIZE_EVENTS)
#: Step-span policies: every sampled request's steps, none, or only those of slow or failed requests.
DEFAULT_SLOW_TIME_TO_FIRST_TOKEN_S = 1.0
DEFAULT_SLOW_TIME_PER_OUTPUT_TOKEN_S = 0.1
DEFAULT_SLOW_FRACTION = 0.05
DEFAULT_OUTLIER_FACTOR = 3.0
#: Who emits a tensor-parallel group's requests: its rank 0 only (default), or every rank (its own span).
TENSOR_PARALLEL_SPANS_RANK0, TENSOR_PARALLEL_SPANS_ALL = "rank0", "all"
TENSOR_PARALLEL_SPANS_MODES = (TENSOR_PARALLEL_SPANS_RANK0, TENSOR_PARALLEL_SPANS_ALL)

NAMES = (
    "tracer_provider",
    "meter_provider",
    "logger_provider",
    "synchronize",
    "max_step_spans",
    "step_spans",
    "slow_time_to_first_token",
    "slow_time_per_output_token",
    "slow_fraction",
    "outlier_factor",
    "background_emission",
    "measure_memory",
    "measure_energy",
    "capture_message_content",
    "capture_step_token_ids",
    "capture_step_logprobs",
    "tensor_parallel_spans",
)

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
#: What a boolean environment variable accepts, as a warning about another value says it.
BOOLEAN_TEXT = "true or false"
#: (variable, value) pairs already reported, each with its warning: one warning per process
_warned_env: Dict[Tuple[str, str], str] = {}


@dataclass(frozen=True)
class Options:
    """What ``instrument()`` resolved. Durations in seconds."""

    tracer_provider: Any = None
    meter_provider: Any = None
    logger_provider: Any = None
    #: ``True`` (wait; ``"wait"`` is read as ``True``), ``"events"`` or ``False``
    synchronize: Union[bool, str] = True
    max_step_spans: int = DEFAULT_MAX_STEP_SPANS
    step_spans: str = STEP_SPANS_ALL
    slow_time_to_first_token: float = DEFAULT_SLOW_TIME_TO_FIRST_TOKEN_S
    slow_time_per_output_token: float = DEFAULT_SLOW_TIME_PER_OUTPUT_TOKEN_S
    slow_fraction: float = DEFAULT_SLOW_FRACTION
    outlier_factor: float = DEFAULT_OUTLIER_FACTOR
    background_emission: bool = True
    measure_memory: bool = True
    measure_energy: bool = True
    capture_message_content: Any = None
    capture_step_token_ids: bool = False
    capture_step_logprobs: bool = False
    tensor_parallel_spans: str = TENSOR_PARALLEL_SPANS_RANK0


def spell(value: Any) -> str:
    """``value`` as docs/configuration.md and an environment variable write it: ``true``/``false`` for a
    bool, a number without a trailing ``.0`` (``3``, ``0.05``), anything else as it is."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return format(value, "g")
    return str(value)


def _warn_env(name: str, raw: str, expected: str, default: Any) -> None:
    if (name, raw) not in _warned_env:
        _warned_env[(name, raw)] = f"{name}={raw!r} is not {expected}; using the default {spell(default)}"
        _LOG.warning("otel_generate: %s", _warned_env[(name, raw)])


def _from_env(name: str, default: T, parse: Callable[[str], T], expected: str) -> T:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return parse(raw.strip())
    except ValueError:
        _warn_env(name, raw, expected, default)
        return default


def _parse_bool(text: str) -> bool:
    value = text.lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(text)


def _parse_synchronize(text: str) -> Union[bool, str]:
    """``true``/``false`` (and their synonyms), ``wait`` (``True``) or ``events``."""
    value = text.lower()
    if value == SYNCHRONIZE_WAIT:
        return True
    if value == SYNCHRONIZE_EVENTS:
        return SYNCHRONIZE_EVENTS
    return _parse_bool(value)


def _synchronize_keyword(value: Any) -> Union[bool, str]:
    """The ``synchronize`` keyword: ``True``, ``False``, ``"wait"`` (read as ``True``) or ``"events"``.

    Raises:
        TypeError: neither a bool nor a string.
        ValueError: another string.
    """
    expected = "True, False, 'wait' or 'events'"
    if isinstance(value, bool):
        return value
    if not isinstance(value, str):
        raise TypeError(f"synchronize must be {expected}, got {type(value).__name__} {value!r}")
    if value.lower() not in (SYNCHRONIZE_WAIT, SYNCHRONIZE_EVENTS):
        raise ValueError(f"synchronize must be {expected}, got {value!r}")
    return True if value.lower() == SYNCHRONIZE_WAIT else SYNCHRONIZE_EVENTS


def _parse_count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError(text)
    return value


def _parse_positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError(text)
    return value


def _parse_fraction(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 1:
        raise ValueError(text)
    return value


def _parse_factor(text: str) -> float:
    value = float(text)
    if not value >= 1:
        raise ValueError(text)
    return value


def _parse_policy(text: str) -> str:
    value = text.lower()
    if value not in STEP_SPAN_POLICIES:
        raise ValueError(text)
    return value


def _parse_tensor_parallel_spans(text: str) -> str:
    value = text.lower()
    if value not in TENSOR_PARALLEL_SPANS_MODES:
        raise ValueError(text)
    return value


def env_bool(name: str, default: bool) -> bool:
    return _from_env(name, default, _parse_bool, BOOLEAN_TEXT)


def env_int(name: str, default: int) -> int:
    return _from_env(name, default, _parse_count, "a non-negative integer")


def _keyword(
    kwargs: Dict[str, Any],
    name: str,
    kind: Any,
    kind_text: str,
    check: Optional[Callable[[Any], bool]] = None,
    range_text: str = "",
) -> Any:
    """The keyword ``name``, or ``None`` when not given.

    Raises:
        TypeError: not of ``kind`` (a bool is not an int here): "``name`` must be ``kind_text``".
        ValueError: ``check`` fails: "``name`` must be ``range_text``".
    """
    value = kwargs.get(name)
    if value is None:
        return None
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        raise TypeError(f"{name} must be {kind_text}, got {type(value).__name__} {value!r}")
    if check is not None and not check(value):
        raise ValueError(f"{name} must be {range_text}, got {value!r}")
    return value


def resolve(kwargs: Dict[str, Any]) -> Options:
    """Validate ``instrument()`` keywords; environment variables fill what is not given.

    Raises:
        TypeError: an unknown keyword, or one of the wrong type (naming it).
        ValueError: a value out of range (naming it).
    """
    unknown = sorted(set(kwargs) - set(NAMES))
    if unknown:
        raise TypeError(
            f"GenerateInstrumentor.instrument() got unknown option(s) {', '.join(map(repr, unknown))}; "
            f"expected some of {', '.join(NAMES)}"
        )
    for name, method in (
        ("tracer_provider", "get_tracer"),
        ("meter_provider", "get_meter"),
        ("logger_provider", "get_logger"),
    ):
        provider = kwargs.get(name)
        if provider is not None and not callable(getattr(provider, method, None)):
            raise TypeError(
                f"{name} must be an OpenTelemetry provider with {method}(), got {type(provider).__name__} {provider!r}"
            )

    def pick(
        name: str,
        kind: Any,
        kind_text: str,
        check: Optional[Callable[[Any], bool]],
        range_text: str,
        env: str,
        default: Any,
        parse: Callable[[str], Any],
    ) -> Any:
        value = _keyword(kwargs, name, kind, kind_text, check, range_text)
        expected = BOOLEAN_TEXT if parse is _parse_bool else f"{kind_text} {range_text}".strip()
        return _from_env(env, default, parse, expected) if value is None else value

    mode = kwargs.get("capture_message_content")
    mode = _env_content_mode() if mode is None else _content.parse_mode(mode)  # TypeError / ValueError
    step_spans = kwargs.get("step_spans")
    if step_spans is not None:
        if not isinstance(step_spans, str):
            raise TypeError(
                f"step_spans must be one of {', '.join(STEP_SPAN_POLICIES)}, "
                f"got {type(step_spans).__name__} {step_spans!r}"
            )
        step_spans = _parse_policy_keyword(step_spans)
    else:
        step_spans = _from_env(ENV_STEP_SPANS, STEP_SPANS_ALL, _parse_policy, f"one of {', '.join(STEP_SPAN_POLICIES)}")
    tensor_parallel_spans = pick(
        "tensor_parallel_spans",
        str,
        "a string",
        lambda v: v.lower() in TENSOR_PARALLEL_SPANS_MODES,
        f"one of {', '.join(TENSOR_PARALLEL_SPANS_MODES)}",
        ENV_TENSOR_PARALLEL_SPANS,
        TENSOR_PARALLEL_SPANS_RANK0,
        _parse_tensor_parallel_spans,
    ).lower()
    number = (int, float)
    return Options(
        tracer_provider=kwargs.get("tracer_provider"),
        meter_provider=kwargs.get("meter_provider"),
        logger_provider=kwargs.get("logger_provider"),
        synchronize=(
            _from_env(ENV_SYNCHRONIZE, True, _parse_synchronize, "true, false, wait or events")
            if kwargs.get("synchronize") is None
            else _synchronize_keyword(kwargs["synchronize"])
        ),
        max_step_spans=pick(
            "max_step_spans",
            int,
            "an int",
            lambda v: v >= 0,
            ">= 0",
            ENV_MAX_STEP_SPANS,
            DEFAULT_MAX_STEP_SPANS,
            _parse_count,
        ),
        step_spans=step_spans,
        slow_time_to_first_token=float(
            pick(
                "slow_time_to_first_token",
                number,
                "a number of seconds",
                lambda v: v > 0,
                "> 0",
                ENV_SLOW_TIME_TO_FIRST_TOKEN,
                DEFAULT_SLOW_TIME_TO_FIRST_TOKEN_S,
                _parse_positive,
            )
        ),
        slow_time_per_output_token=float(
            pick(
                "slow_time_per_output_token",
                number,
                "a number of seconds",
                lambda v: v > 0,
                "> 0",
                ENV_SLOW_TIME_PER_OUTPUT_TOKEN,
                DEFAULT_SLOW_TIME_PER_OUTPUT_TOKEN_S,
                _parse_positive,
            )
        ),
        slow_fraction=float(
            pick(
                "slow_fraction",
                number,
                "a number",
                lambda v: 0 <= v <= 1,
                "between 0 and 1",
                ENV_SLOW_FRACTION,
                DEFAULT_SLOW_FRACTION,
                _parse_fraction,
            )
        ),
        outlier_factor=float(
            pick(
                "outlier_factor",
                number,
                "a number",
                lambda v: v >= 1,
                ">= 1",
                ENV_OUTLIER_FACTOR,
                DEFAULT_OUTLIER_FACTOR,
                _parse_factor,
            )
        ),
        background_emission=pick(
            "background_emission", bool, "a bool", None, "", ENV_BACKGROUND_EMISSION, True, _parse_bool
        ),
        measure_memory=pick("measure_memory", bool, "a bool", None, "", ENV_MEASURE_MEMORY, True, _parse_bool),
        measure_energy=pick("measure_energy", bool, "a bool", None, "", ENV_MEASURE_ENERGY, True, _parse_bool),
        capture_message_content=mode,
        capture_step_token_ids=pick(
            "capture_step_token_ids", bool, "a bool", None, "", _content.ENV_CAPTURE_STEP_TOKEN_IDS, False, _parse_bool
        ),
        capture_step_logprobs=pick(
            "capture_step_logprobs", bool, "a bool", None, "", _content.ENV_CAPTURE_STEP_LOGPROBS, False, _parse_bool
        ),
        tensor_parallel_spans=tensor_parallel_spans,
    )


#: The environment variable of each option that has one.
ENVIRONMENT: Dict[str, str] = {
    "synchronize": ENV_SYNCHRONIZE,
    "max_step_spans": ENV_MAX_STEP_SPANS,
    "step_spans": ENV_STEP_SPANS,
    "slow_time_to_first_token": ENV_SLOW_TIME_TO_FIRST_TOKEN,
    "slow_time_per_output_token": ENV_SLOW_TIME_PER_OUTPUT_TOKEN,
    "slow_fraction": ENV_SLOW_FRACTION,
    "outlier_factor": ENV_OUTLIER_FACTOR,
    "background_emission": ENV_BACKGROUND_EMISSION,
    "measure_memory": ENV_MEASURE_MEMORY,
    "measure_energy": ENV_MEASURE_ENERGY,
    "capture_message_content": _content.ENV_CAPTURE_MESSAGE_CONTENT,
    "capture_step_token_ids": _content.ENV_CAPTURE_STEP_TOKEN_IDS,
    "capture_step_logprobs": _content.ENV_CAPTURE_STEP_LOGPROBS,
    "tensor_parallel_spans": ENV_TENSOR_PARALLEL_SPANS,
}
SOURCE_ARGUMENT, SOURCE_ENVIRONMENT, SOURCE_DEFAULT = "argument", "environment", "default"


def explain(kwargs: Optional[Dict[str, Any]] = None) -> Dict[str, Dict[str, Any]]:
    """Each option with an environment variable, as ``resolve(kwargs)`` gives it, and where its
    value came from: ``{"value", "source", "variable"}``, the source one of ``"argument"`` (an
    ``instrument()`` keyword), ``"environment"`` (the variable, read) or ``"default"`` (nothing
    set, or a value that could not be parsed: ``"ignored"`` then holds it, and ``"problem"`` says
    what was expected, as the warning did). The options without a variable are the three providers.

    Raises what :func:`resolve` raises for bad keywords.
    """
    kwargs = dict(kwargs or {})
    resolved = resolve(kwargs)
    explained: Dict[str, Dict[str, Any]] = {}
    for name, variable in ENVIRONMENT.items():
        value = getattr(resolved, name)
        entry: Dict[str, Any] = {"value": getattr(value, "name", value), "variable": variable}
        raw = os.environ.get(variable)
        if kwargs.get(name) is not None:
            entry["source"] = SOURCE_ARGUMENT
        elif raw is None or not raw.strip():
            entry["source"] = SOURCE_DEFAULT
        elif (variable, raw) in _warned_env:  # resolve() reported it and used the default
            entry.update(source=SOURCE_DEFAULT, ignored=raw, problem=_warned_env[(variable, raw)])
        else:
            entry["source"] = SOURCE_ENVIRONMENT
        explained[name] = entry
    return explained


def _parse_policy_keyword(value: str) -> str:
    try:
        return _parse_policy(value)
    except ValueError:
        raise ValueError(f"step_spans must be one of {', '.join(STEP_SPAN_POLICIES)}, got {value!r}") from None


def _env_content_mode() -> Any:
    raw = os.environ.get(_content.ENV_CAPTURE_MESSAGE_CONTENT)
    if raw is None:
        return _content.ContentMode.NO_CONTENT
    try:
        return _content.parse_mode(raw)
    except ValueError:
        _warn_env(_content.ENV_CAPTURE_MESSAGE_CONTENT, raw, f"one of {_content.ACCEPTED_MODES}", "NO_CONTENT")
        return _content.ContentMode.NO_CONTENT
