"""A local OTLP/HTTP receiver for the telemetry tests: what execbox exports, decoded; and a collector that accepts
connections and never answers."""

from __future__ import annotations

import contextlib
import http.server
import socket
import threading
from collections.abc import Iterator
from typing import Any

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest


class Receiver:
    """What reached the receiver, by path (/v1/traces, /v1/metrics), as the request bodies."""

    def __init__(self, url: str, received: dict[str, list[bytes]]) -> None:
        self.url = url
        self.received = received

    def spans(self) -> list[Any]:
        """Every span received (the protobuf Span: name, trace_id, span_id, parent_span_id as bytes)."""
        return [span for body in self.received.get("/v1/traces", [])
                for resource in ExportTraceServiceRequest.FromString(body).resource_spans
                for scope in resource.scope_spans for span in scope.spans]

    def metric_names(self) -> set[str]:
        return {metric.name for body in self.received.get("/v1/metrics", [])
                for resource in ExportMetricsServiceRequest.FromString(body).resource_metrics
                for scope in resource.scope_metrics for metric in scope.metrics}


@contextlib.contextmanager
def receiver(port: int = 0) -> Iterator[Receiver]:
    """An OTLP/HTTP receiver on a loopback port (a free one by default), answering 200 to every export."""
    received: dict[str, list[bytes]] = {}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - the handler's name
            body = self.rfile.read(int(self.headers["Content-Length"]))
            received.setdefault(self.path, []).append(body)
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield Receiver(f"http://127.0.0.1:{server.server_address[1]}", received)
    finally:
        server.shutdown()
        server.server_close()


@contextlib.contextmanager
def silent_collector() -> Iterator[str]:
    """A collector that takes connections (the kernel completes them: a listening socket's backlog) and never
    reads or answers: its URL."""
    with socket.create_server(("127.0.0.1", 0), backlog=64) as sock:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
