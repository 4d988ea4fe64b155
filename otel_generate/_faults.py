"""Faults inside the instrumentation: logged once per kind per process, never raised to the user."""

from __future__ import annotations

import logging
import threading

LOGGER_NAME = "otel_generate"
_LOG = logging.getLogger(LOGGER_NAME)

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


def error_type(exc: BaseException) -> str:
    """``error.type`` for an exception: its class name, module-qualified unless built in."""
    cls = type(exc)
    module = cls.__module__
    return cls.__qualname__ if module == "builtins" else f"{module}.{cls.__qualname__}"
