"""Spans the OTLP gRPC exporter gives up on are said on the ``otel_generate`` logger, also where the
exporter's own line is filtered out.

The real OTLP gRPC exporters of the installed release export to a closed local port (nothing listens
there) with a 0.5 s timeout, shorter than the exporter's first back-off, so each gives up when its one
request fails: the metrics exporter first, then the traces exporter, in one of the exporter logger's
20-second windows, as they do at the exit of an application whose Collector is down. The exporter's
own ``Failed to export traces`` line is dropped by its logger's duplicate filter (checked, so that
this test says when a release stops dropping it), and this package's line is there once, with the
endpoint and the status code. No network, no model; about a second.
"""

from __future__ import annotations

import logging
import socket
import time

import pytest
from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from otel_generate import _export_loss
from tests.helpers.instrumenting import LOGGER, instrumentation

TIMEOUT_S = 0.5


def _closed_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Keep(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record)


@pytest.fixture
def kept():
    """Every record of the exporter's logger and of this package's, in the order they were handled."""
    handler = Keep()
    loggers = [logging.getLogger(_export_loss.EXPORTER_LOGGER), logging.getLogger(LOGGER)]
    for logger in loggers:
        logger.addHandler(handler)
    yield handler.records
    for logger in loggers:
        logger.removeHandler(handler)


def _give_up_on_metrics_then_traces(endpoint):
    meters = MeterProvider(
        metric_readers=[
            PeriodicExportingMetricReader(
                OTLPMetricExporter(endpoint=endpoint, insecure=True, timeout=TIMEOUT_S),
                export_interval_millis=600_000,
            )
        ]
    )
    tracers = TracerProvider()
    tracers.add_span_processor(
        SimpleSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=True, timeout=TIMEOUT_S))
    )
    try:
        meters.get_meter("test").create_counter("requests").add(1)
        if time.time() % 20 > 17:  # both give-ups in one of the duplicate filter's 20 s windows
            time.sleep(3.5)
        meters.force_flush()  # the metrics exporter gives up
        tracers.get_tracer("test").start_span("request").end()  # exported at once: the traces exporter gives up
    finally:
        meters.shutdown()
        tracers.shutdown()


def test_spans_given_up_are_said_on_the_package_logger_where_the_exporter_line_is_dropped(kept, tracer_provider):
    address = f"127.0.0.1:{_closed_port()}"
    with instrumentation(tracer_provider=tracer_provider):
        assert logging.getLogger(_export_loss.EXPORTER_LOGGER).filters[0] is _export_loss._watch
        _give_up_on_metrics_then_traces(address)
    exporter = [r.getMessage() for r in kept if r.name == _export_loss.EXPORTER_LOGGER and r.levelno >= logging.ERROR]
    assert [line.split(f" to {address}")[0] for line in exporter] == ["Failed to export metrics"], exporter
    ours = [(r.levelname, r.getMessage()) for r in kept if r.name == LOGGER]
    assert ours == [
        (
            "ERROR",
            f"otel_generate: spans lost: the OTLP gRPC exporter gave up on a batch of traces to {address}"
            " (StatusCode.UNAVAILABLE); its spans are not exported",
        )
    ]


def test_the_watch_is_gone_after_uninstrument_and_never_drops_a_record(kept, tracer_provider):
    exporter_logger = logging.getLogger(_export_loss.EXPORTER_LOGGER)
    with instrumentation(tracer_provider=tracer_provider):
        assert sum(f is _export_loss._watch for f in exporter_logger.filters) == 1
        _export_loss.enable()  # again: still one watch
        assert sum(f is _export_loss._watch for f in exporter_logger.filters) == 1
    assert _export_loss._watch not in exporter_logger.filters
    watch = _export_loss.GiveUpWatch()
    odd = logging.LogRecord(_export_loss.EXPORTER_LOGGER, logging.ERROR, __file__, 1, "Failed to export", None, None)
    assert watch.filter(odd) is True  # no arguments: let through, nothing said
    assert [r for r in kept if r.name == LOGGER] == []
