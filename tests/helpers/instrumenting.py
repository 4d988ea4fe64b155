"""Turning the instrumentation on for a block and reading the package's warnings back; what tests of the
options and environment variables share (tests/unit and tests/integration). Imports no ``transformers``."""

from __future__ import annotations

import contextlib
import logging

from opentelemetry.sdk.metrics.export import MetricReader
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
    """Wait until the background emitter (on by default) has emitted every finished request. Only the
    emitter: for a test that reads a provider it cannot flush (a DELTA ``InMemoryMetricReader``, which
    a meter provider's ``force_flush`` would make collect, losing what the flush collected)."""
    telemetry = GenerateInstrumentor().telemetry
    if telemetry is not None:
        assert telemetry.drain_emitter(30.0)


class DrainingSpanExporter(InMemorySpanExporter):
    """An in-memory exporter read as an application reads its spans: after its tracer provider's
    ``force_flush()`` (``provider``, set by the fixture that made the provider), which waits for the
    background emitter; without a provider, after the emitter alone."""

    provider = None

    def get_finished_spans(self):
        if self.provider is not None:
            assert self.provider.force_flush()
        else:
            drain_emitter()
        return super().get_finished_spans()


class DrainingMetricReader(MetricReader):
    """A reader read as an application reads its metrics: its meter provider's ``force_flush()``
    (``provider``, set by the fixture that made it) records every finished request and makes this
    reader collect, and :meth:`get_metrics_data` returns what that collection got (cumulative), as
    an exporting reader would have exported it. One collection per read: a second would find the
    exemplars already taken. Without a provider, the emitter is drained and the reader collects."""

    provider = None

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._collected = None

    def _receive_metrics(self, metrics_data, timeout_millis=10_000, **kwargs):
        self._collected = metrics_data

    def get_metrics_data(self):
        if self.provider is not None:
            assert self.provider.force_flush()
        else:
            drain_emitter()
            self.collect()
        collected, self._collected = self._collected, None
        return collected

    def shutdown(self, timeout_millis=30_000, **kwargs):
        pass
