"""Turning the instrumentation on for a block and reading the package's warnings back; what tests of the
options and environment variables share (tests/unit and tests/integration). Imports no ``transformers``."""

from __future__ import annotations

import contextlib
import logging

from otel_generate import GenerateInstrumentor

LOGGER = "otel_generate"


@contextlib.contextmanager
def instrumentation(**options):
    """``instrument(**options)`` for the block, ``uninstrument()`` after it (also on failure)."""
    instrumentor = GenerateInstrumentor()
    instrumentor.instrument(**options)
    try:
        yield instrumentor
    finally:
        instrumentor.uninstrument()


def warnings_from_package(caplog):
    return [r for r in caplog.records if r.name == LOGGER and r.levelno >= logging.WARNING]
