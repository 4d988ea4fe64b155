"""A minimal OTLP receiver for tests: gRPC and HTTP/protobuf, traces, metrics and logs, on 127.0.0.1.

It stands in for an OpenTelemetry Collector. The wire formats come from ``opentelemetry-proto``
(the same generated messages and gRPC service stubs the SDK's exporters use); this module only
stores what arrives so a test can decode it.

* gRPC: ``opentelemetry.proto.collector.trace.v1.TraceService/Export``,
  ``...metrics.v1.MetricsService/Export`` and ``...logs.v1.LogsService/Export`` on
  ``127.0.0.1:<grpc_port>`` (plaintext).
* HTTP: ``POST /v1/traces``, ``/v1/metrics`` and ``/v1/logs`` with an ``application/x-protobuf`` body
  (gzip or not) on ``127.0.0.1:<http_port>``; any other path gets 404.

Both ports are ephemeral (chosen by the OS). Use it as a context manager; it stops its servers on
exit. Nothing here blocks without a bound: server threads are daemons and ``stop()`` waits at
most a few seconds.
"""

from __future__ import annotations

import gzip
import threading
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Dict, Iterator, List, Tuple

import grpc
from opentelemetry.proto.collector.logs.v1 import logs_service_pb2, logs_service_pb2_grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

TRACES = "traces"
METRICS = "metrics"
LOGS = "logs"
GRPC = "grpc"
HTTP = "http/protobuf"

_REQUEST_TYPES = {
    TRACES: trace_service_pb2.ExportTraceServiceRequest,
    METRICS: metrics_service_pb2.ExportMetricsServiceRequest,
    LOGS: logs_service_pb2.ExportLogsServiceRequest,
}
_RESPONSE_TYPES = {
    TRACES: trace_service_pb2.ExportTraceServiceResponse,
    METRICS: metrics_service_pb2.ExportMetricsServiceResponse,
    LOGS: logs_service_pb2.ExportLogsServiceResponse,
}
_HTTP_PATHS = {"/v1/traces": TRACES, "/v1/metrics": METRICS, "/v1/logs": LOGS}


class OTLPReceiver:
    """Receives OTLP export requests and keeps them, decoded, per (transport, signal).

    ``requests[(GRPC, TRACES)]`` is the list of ``ExportTraceServiceRequest`` messages that
    arrived over gRPC, ``requests[(HTTP, METRICS)]`` the ``ExportMetricsServiceRequest``
    messages that arrived over HTTP, and so on.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: Dict[Tuple[str, str], list] = {
            (transport, signal): [] for transport in (GRPC, HTTP) for signal in (TRACES, METRICS, LOGS)
        }
        self._grpc_server = None
        self._http_server = None
        self._http_thread = None
        self.grpc_port = 0
        self.http_port = 0

    # --- lifecycle ----------------------------------------------------------------------------
    def start(self) -> "OTLPReceiver":
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(self), server)
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(_MetricsService(self), server)
        logs_service_pb2_grpc.add_LogsServiceServicer_to_server(_LogsService(self), server)
        self.grpc_port = server.add_insecure_port("127.0.0.1:0")
        if not self.grpc_port:
            raise RuntimeError("could not bind the OTLP gRPC receiver on 127.0.0.1")
        server.start()
        self._grpc_server = server

        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                signal = _HTTP_PATHS.get(self.path.split("?", 1)[0])
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length)
                if signal is None:
                    self._reply(404, b"unknown OTLP path", "text/plain")
                    return
                if self.headers.get("Content-Encoding", "").lower() == "gzip":
                    body = gzip.decompress(body)
                message = _REQUEST_TYPES[signal]()
                try:
                    message.ParseFromString(body)
                except Exception:
                    self._reply(400, b"body is not an OTLP protobuf message", "text/plain")
                    return
                receiver._store(HTTP, signal, message)
                self._reply(200, _RESPONSE_TYPES[signal]().SerializeToString(), "application/x-protobuf")

            def _reply(self, status: int, body: bytes, content_type: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:  # keep test output quiet
                pass

        self._http_server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._http_server.daemon_threads = True
        self.http_port = self._http_server.server_address[1]
        self._http_thread = threading.Thread(
            target=self._http_server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True
        )
        self._http_thread.start()
        return self

    def stop(self) -> None:
        if self._http_server is not None:
            self._http_server.shutdown()
            self._http_server.server_close()
            self._http_thread.join(timeout=5)
            self._http_server = None
        if self._grpc_server is not None:
            self._grpc_server.stop(grace=None).wait(timeout=5)
            self._grpc_server = None

    def __enter__(self) -> "OTLPReceiver":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # --- endpoints ----------------------------------------------------------------------------
    @property
    def grpc_endpoint(self) -> str:
        """``OTEL_EXPORTER_OTLP_ENDPOINT`` for ``grpc`` (the http scheme means plaintext)."""
        return f"http://127.0.0.1:{self.grpc_port}"

    @property
    def http_endpoint(self) -> str:
        """``OTEL_EXPORTER_OTLP_ENDPOINT`` for ``http/protobuf`` (exporters append ``/v1/traces``)."""
        return f"http://127.0.0.1:{self.http_port}"

    def endpoint(self, protocol: str) -> str:
        return self.grpc_endpoint if protocol == GRPC else self.http_endpoint

    # --- what arrived -------------------------------------------------------------------------
    def _store(self, transport: str, signal: str, message) -> None:
        with self._lock:
            self.requests[(transport, signal)].append(message)

    def received(self, transport: str, signal: str) -> list:
        with self._lock:
            return list(self.requests[(transport, signal)])

    def spans(self, transport: str) -> List[Tuple[object, object, object]]:
        """Every span that arrived over ``transport``, as ``(resource, scope, span)`` protobufs."""
        return list(_flatten(self.received(transport, TRACES), "resource_spans", "scope_spans", "spans"))

    def metrics(self, transport: str) -> List[Tuple[object, object, object]]:
        """Every metric that arrived over ``transport``, as ``(resource, scope, metric)`` protobufs."""
        return list(_flatten(self.received(transport, METRICS), "resource_metrics", "scope_metrics", "metrics"))

    def logs(self, transport: str) -> List[Tuple[object, object, object]]:
        """Every log record (event) that arrived over ``transport``, as ``(resource, scope, record)`` protobufs."""
        return list(_flatten(self.received(transport, LOGS), "resource_logs", "scope_logs", "log_records"))


def _flatten(messages: list, resource_field: str, scope_field: str, item_field: str) -> Iterator[tuple]:
    for message in messages:
        for resource_items in getattr(message, resource_field):
            for scope_items in getattr(resource_items, scope_field):
                for item in getattr(scope_items, item_field):
                    yield resource_items.resource, scope_items.scope, item


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, receiver: OTLPReceiver) -> None:
        self._receiver = receiver

    def Export(self, request, context):  # noqa: N802 (gRPC method name)
        self._receiver._store(GRPC, TRACES, request)
        return trace_service_pb2.ExportTraceServiceResponse()


class _MetricsService(metrics_service_pb2_grpc.MetricsServiceServicer):
    def __init__(self, receiver: OTLPReceiver) -> None:
        self._receiver = receiver

    def Export(self, request, context):  # noqa: N802 (gRPC method name)
        self._receiver._store(GRPC, METRICS, request)
        return metrics_service_pb2.ExportMetricsServiceResponse()


class _LogsService(logs_service_pb2_grpc.LogsServiceServicer):
    def __init__(self, receiver: OTLPReceiver) -> None:
        self._receiver = receiver

    def Export(self, request, context):  # noqa: N802 (gRPC method name)
        self._receiver._store(GRPC, LOGS, request)
        return logs_service_pb2.ExportLogsServiceResponse()


def any_value(value):
    """Decode an OTLP ``AnyValue`` into ``(kind, python value)``; kind is the oneof field name."""
    kind = value.WhichOneof("value")
    if kind is None:
        return None, None
    if kind == "array_value":
        return kind, [any_value(v) for v in value.array_value.values]
    return kind, getattr(value, kind)


def attributes(key_values) -> Dict[str, tuple]:
    """``{key: (kind, value)}`` from a repeated OTLP ``KeyValue`` field."""
    return {kv.key: any_value(kv.value) for kv in key_values}
