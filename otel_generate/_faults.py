"""Faults inside the instrumentation: logged once per kind per process, never raised to the user."""

from __future__ import annotations

import logging
import threading

LOGGER_NAME = "otel_generate"
_LOG = logging.getLogger(LOGGER_NAME)


class Fault:
    """Every kind of fault :func:`log_fault_once` logs: one constant per place that can fail.

    The value is what the WARNING says (``otel_generate: <kind> failed (...)``) and the key that
    logs it once per process. Kinds built per module come from :meth:`hook_install` and
    :meth:`import_hook_install`.
    """

    ASSISTED_CANDIDATES_COUNT = "assisted candidates count"
    BACKGROUND_EMISSION = "background emission"
    CONTENT_CAPTURE = "content capture"
    CONTENT_EVENT = "content event"
    CONTEXT_DETACH = "context detach"
    CONTINUOUS_BATCHING_ACCOUNTING = "continuous batching accounting"
    CONTINUOUS_BATCHING_CANCEL = "continuous batching cancel"
    CONTINUOUS_BATCHING_DELIVERY = "continuous batching delivery"
    CONTINUOUS_BATCHING_STEP = "continuous batching step"
    CONTINUOUS_BATCHING_SUBMIT = "continuous batching submit"
    CONTINUOUS_BATCHING_UNINSTRUMENT = "continuous batching uninstrument"
    DEVICE_EVENTS = "device events"
    DEVICE_SYNCHRONIZE = "device synchronize"
    DISTRIBUTED_RANKS = "distributed ranks"
    ENERGY_READING = "energy reading"
    GENERATE_OVERRIDE_HOOK = "generate override hook"
    GENERATION_CONFIG_CAPTURE = "generation config capture"
    IMPLIED_STEP_LENGTHS = "implied step lengths"
    KEY_VALUE_CACHE_CAPTURE = "key/value cache capture"
    KEY_VALUE_CACHE_SIZE = "key/value cache size"
    MEMORY_STATISTICS = "memory statistics"
    METRICS = "metrics"
    PER_TOKEN_LATENCY_CALLBACK = "per_token_latency_callback"
    PIPELINE_TOKENIZER_LOOKUP = "pipeline tokenizer lookup"
    PROFILER = "profiler"
    REQUEST_ACCOUNTING = "request accounting"
    REQUEST_SET_UPS_AFTER_FORK = "request set-ups after fork"
    REQUEST_SPAN_END = "request span end"
    REQUEST_START = "request start"
    SERVE_CONTEXT_CAPTURE = "serve context capture"
    SERVE_SHUTDOWN_FLUSH_INSTALL = "serve shutdown flush install"
    STEP_HOOK = "step hook"
    STEP_HOOK_INSTALL = "step hook install"
    STEP_LOG_PROBABILITIES = "step log-probabilities"
    STEP_LOG_PROBABILITIES_INSTALL = "step log-probabilities install"
    STEP_SPAN_EXPORT = "step span export"
    TOKEN_LATENCIES = "token_latencies"
    WHISPER_FALLBACK_CAPTURE = "whisper fallback capture"
    WHISPER_WINDOW_CAPTURE = "whisper window capture"

    @staticmethod
    def hook_install(module: str) -> str:
        """The kind for installing the patch-table rows of ``module`` (one per module)."""
        return f"{module} hook install"

    @staticmethod
    def import_hook_install(module: str) -> str:
        """The kind for a post-import hook of ``module`` that failed to run."""
        return f"hook install on import of {module}"


_logged_lock = threading.Lock()
_logged_kinds: set = set()


def log_fault_once(kind: str, exc: BaseException) -> None:
    """Log a fault inside the instrumentation once per ``kind`` per process, as a WARNING with its
    traceback on the logger ``otel_generate``; never raises."""
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


def note_once(key: str, message: str, *args: object, level: int = logging.INFO) -> None:
    """Log ``message % args`` once per ``key`` per process on the logger ``otel_generate``, at
    ``level`` (INFO by default): a setting that cannot apply here and what is done instead (not
    a fault: no traceback). Never raises."""
    try:
        with _logged_lock:
            if ("note", key) in _logged_kinds:
                return
            _logged_kinds.add(("note", key))
        _LOG.log(level, message, *args)
    except Exception:  # pragma: no cover - logging itself failed
        pass


def error_type(exc: BaseException) -> str:
    """``error.type`` for an exception: its class name, module-qualified unless built in."""
    cls = type(exc)
    module = cls.__module__
    return cls.__qualname__ if module == "builtins" else f"{module}.{cls.__qualname__}"
