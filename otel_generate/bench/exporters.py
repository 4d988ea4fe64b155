"""The instrumented side's exporters: count (and, with ``otlp-encode``, encode) what would be sent, drop it."""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence, Tuple

from otel_generate.bench.config import EXPORTERS


def encode_spans_request(spans: Sequence[Any]) -> Any:
    """The OTLP ``ExportTraceServiceRequest`` a real OTLP exporter would send for ``spans``.

    opentelemetry-exporter-otlp-proto-common's ``encode_spans``, the encoder of the SDK's OTLP
    gRPC and HTTP span exporters.
    """
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    return encode_spans(spans)


def encode_metrics_request(data: Any) -> Any:
    """The OTLP ``ExportMetricsServiceRequest`` for ``data`` (``encode_metrics`` of the same package)."""
    from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics

    return encode_metrics(data)


def make_exporters(kind: str) -> Tuple[Any, Any]:
    """``(span exporter, metric reader)`` for ``--exporter kind`` (see :data:`EXPORTERS`).

    * ``discard``: the span exporter counts spans (``.spans``) and drops them; the metrics go
      to an SDK ``InMemoryMetricReader`` (collected, never encoded). ``.bytes`` is ``None``.
    * ``otlp-encode``: the span exporter encodes each batch with :func:`encode_spans_request`,
      serializes it (``SerializeToString``), adds its length to ``.bytes`` and its span count
      to ``.spans``, and drops the bytes; the metrics go to a ``PeriodicExportingMetricReader``
      (no timer thread: collected on flush) whose exporter does the same with
      :func:`encode_metrics_request` (``.bytes`` of the metric exporter, ``reader.exporter``).
      What is left out is only the network.

    Raises:
        ValueError: an unknown ``kind``.
    """
    from opentelemetry.sdk.metrics.export import (
        InMemoryMetricReader,
        MetricExporter,
        MetricExportResult,
        PeriodicExportingMetricReader,
    )
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    if kind not in EXPORTERS:
        raise ValueError(f"unknown exporter {kind!r}; expected one of {', '.join(EXPORTERS)}")
    encode = kind == "otlp-encode"

    class BenchSpanExporter(SpanExporter):
        """Counts the spans (and, encoding, the OTLP bytes) it receives and drops them."""

        def __init__(self) -> None:
            self.spans = 0
            self.bytes: Optional[int] = 0 if encode else None

        def export(self, spans: Sequence[Any]) -> Any:
            if encode:
                self.bytes += len(encode_spans_request(spans).SerializeToString())
            self.spans += len(spans)
            return SpanExportResult.SUCCESS

        def shutdown(self) -> None:
            pass

        def force_flush(self, timeout_millis: int = 30000) -> bool:
            return True

    if not encode:
        return BenchSpanExporter(), InMemoryMetricReader()

    class EncodingMetricExporter(MetricExporter):
        """Encodes each metrics export as OTLP protobuf, counts the bytes and drops them."""

        def __init__(self) -> None:
            super().__init__()  # cumulative temporality, as the in-memory reader of ``discard`` collects
            self.bytes = 0
            self.last: Any = None  # the last collection, to read a counter back (--serve --in-process)

        def export(self, metrics_data: Any, timeout_millis: float = 10_000, **kwargs: Any) -> Any:
            self.last = metrics_data
            self.bytes += len(encode_metrics_request(metrics_data).SerializeToString())
            return MetricExportResult.SUCCESS

        def force_flush(self, timeout_millis: float = 10_000) -> bool:
            return True

        def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
            pass

    metric_exporter = EncodingMetricExporter()
    reader = PeriodicExportingMetricReader(metric_exporter, export_interval_millis=math.inf)
    reader.exporter = metric_exporter
    return BenchSpanExporter(), reader
