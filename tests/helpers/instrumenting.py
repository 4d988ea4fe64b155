"""Turning the instrumentation on for a block and reading the package's warnings back; what tests of the
options and environment variables share (tests/unit and tests/integration). Imports no ``transformers``."""

from __future__ import annotations

import contextlib
import logging

from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

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


def drain_emitter():
    """Wait until the background emitter (on by default) has emitted every finished request, as an
    application's ``force_flush()`` does before its providers export. Only the emitter: a meter
    provider's ``force_flush`` would make an ``InMemoryMetricReader`` collect (and a DELTA reader
    lose what the flush collected)."""
    telemetry = GenerateInstrumentor().telemetry
    if telemetry is not None:
        assert telemetry.drain_emitter(30.0)


class DrainingSpanExporter(InMemorySpanExporter):
    """An in-memory exporter whose reads first wait for the background emitter."""

    def get_finished_spans(self):
        drain_emitter()
        return super().get_finished_spans()


class DrainingMetricReader(InMemoryMetricReader):
    """An in-memory reader whose collections first wait for the background emitter."""

    def get_metrics_data(self):
        drain_emitter()
        return super().get_metrics_data()
