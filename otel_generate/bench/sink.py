"""A local OTLP/HTTP receiver that the serving bench's servers export to: it answers like a Collector,
counts what it receives and keeps nothing.

Run as ``python -m otel_generate.bench.sink``: it listens on 127.0.0.1 (an ephemeral port unless
``--port``), prints ``{"port": N}`` on its first line of stdout, and serves until it is terminated.

* ``POST /v1/traces``: the body is parsed (``ExportTraceServiceRequest``) to count its spans, then
  dropped; requests, bytes and spans are counted.
* ``POST /v1/metrics``: parsed (``ExportMetricsServiceRequest``); kept of it, per exporting process
  (the resource's ``process.pid``; the servers run with the ``process`` resource detector) and per
  stream, the highest cumulative value of the ``generate.emitter.dropped_requests`` counter (the
  requests whose telemetry the instrumentation's background emitter dropped) and the highest count of
  the ``gen_ai.server.request.duration`` histogram (the requests the instrumentation recorded).
* ``POST /v1/logs``: counted and dropped.
* ``GET /stats``: all of it as JSON: ``{"traces": {"requests", "bytes", "spans"}, "metrics": {...},
  "logs": {...}, "processes": {pid: {"dropped_requests", "requests_recorded"}}}``.

Every ``POST`` is answered ``200`` with an empty protobuf response (a full success), as a Collector
answers. The bodies are parsed with opentelemetry-proto, the OTLP exporter's own dependency.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Dict, Optional, Tuple

from otel_generate.attributes import METRIC_EMITTER_DROPPED, METRIC_REQUEST_DURATION

PATHS = {"/v1/traces": "traces", "/v1/metrics": "metrics", "/v1/logs": "logs"}


class Counts:
    """What the sink received, under one lock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.signals: Dict[str, Dict[str, int]] = {
            name: {"requests": 0, "bytes": 0, "spans": 0} if name == "traces" else {"requests": 0, "bytes": 0}
            for name in PATHS.values()
        }
        # (pid, metric, stream attributes) -> the highest cumulative value seen
        self.streams: Dict[Tuple[Optional[int], str, Tuple[Tuple[str, str], ...]], float] = {}

    def received(self, signal: str, body: bytes) -> None:
        spans = 0
        streams: Dict[Tuple[Optional[int], str, Tuple[Tuple[str, str], ...]], float] = {}
        if signal == "traces":
            from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

            request = ExportTraceServiceRequest()
            request.ParseFromString(body)
            spans = sum(len(scope.spans) for resource in request.resource_spans for scope in resource.scope_spans)
        elif signal == "metrics":
            streams = metric_streams(body)
        with self.lock:
            counts = self.signals[signal]
            counts["requests"] += 1
            counts["bytes"] += len(body)
            if signal == "traces":
                counts["spans"] += spans
            for key, value in streams.items():
                self.streams[key] = max(value, self.streams.get(key, value))

    def snapshot(self) -> Dict[str, Any]:
        with self.lock:
            processes: Dict[str, Dict[str, float]] = {}
            for (pid, metric, _attributes), value in self.streams.items():
                entry = processes.setdefault(str(pid), {"dropped_requests": 0, "requests_recorded": 0})
                entry["dropped_requests" if metric == METRIC_EMITTER_DROPPED else "requests_recorded"] += value
            return {**{k: dict(v) for k, v in self.signals.items()}, "processes": processes}


def metric_streams(body: bytes) -> Dict[Tuple[Optional[int], str, Tuple[Tuple[str, str], ...]], float]:
    """The dropped-requests counter's values and the request-duration histogram's counts in one OTLP metrics
    request, per ``(process.pid, metric name, data point attributes)``."""
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest

    request = ExportMetricsServiceRequest()
    request.ParseFromString(body)
    found: Dict[Tuple[Optional[int], str, Tuple[Tuple[str, str], ...]], float] = {}
    for resource in request.resource_metrics:
        pid = next((kv.value.int_value for kv in resource.resource.attributes if kv.key == "process.pid"), None)
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                if metric.name == METRIC_EMITTER_DROPPED:
                    points = [(p.attributes, p.as_int or p.as_double) for p in metric.sum.data_points]
                elif metric.name == METRIC_REQUEST_DURATION:
                    points = [(p.attributes, p.count) for p in metric.histogram.data_points]
                else:
                    continue
                for attributes, value in points:
                    key = (pid, metric.name, tuple(sorted((kv.key, str(kv.value)) for kv in attributes)))
                    found[key] = max(float(value), found.get(key, float(value)))
    return found


def make_server(port: int = 0) -> Tuple[ThreadingHTTPServer, Counts]:
    """The sink's HTTP server on 127.0.0.1 (not started) and its counts."""
    counts = Counts()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as the exporters' sessions expect

        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length)
            signal = PATHS.get(self.path.split("?", 1)[0])
            if signal is None:
                self._answer(404, b"", "text/plain")
                return
            try:
                counts.received(signal, body)
            except Exception as fault:  # a body that does not parse: say so, as a Collector would
                self._answer(400, str(fault).encode(), "text/plain")
                return
            self._answer(200, b"", "application/x-protobuf")

        def do_GET(self) -> None:  # noqa: N802
            if self.path != "/stats":
                self._answer(404, b"", "text/plain")
                return
            self._answer(200, json.dumps(counts.snapshot()).encode(), "application/json")

        def _answer(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's name)
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    server.daemon_threads = True
    return server, counts


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m otel_generate.bench.sink", description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, default=0, help="port on 127.0.0.1 (default: an ephemeral one)")
    args = parser.parse_args(argv)
    server, _counts = make_server(args.port)
    print(json.dumps({"port": server.server_address[1]}), flush=True)
    try:
        server.serve_forever(poll_interval=0.5)
    except KeyboardInterrupt:  # pragma: no cover
        pass
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
