"""A minimal OTLP/HTTP trace receiver: decodes every POSTed ExportTraceServiceRequest.

It stands in for an OpenTelemetry collector: the server under test exports to it over
real HTTP, in protobuf, exactly as it would to a collector's :4318/v1/traces.
"""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Span


class OtlpReceiver:
    """Listens on 127.0.0.1; `spans` holds every span received, `paths` every URL path."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.paths: list[str] = []
        self.resources: list[dict[str, str]] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                with receiver._lock:
                    receiver.paths.append(self.path)
                    for resource_spans in request.resource_spans:
                        receiver.resources.append(
                            {
                                a.key: a.value.string_value
                                for a in resource_spans.resource.attributes
                            }
                        )
                        for scope_spans in resource_spans.scope_spans:
                            receiver.spans.extend(scope_spans.spans)
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def wait_for(self, found: Callable[[list[Span]], bool], timeout: float = 30.0) -> list[Span]:
        """The spans received so far, once `found(spans)` holds (AssertionError if never)."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                spans = list(self.spans)
            if found(spans):
                return spans
            if time.monotonic() > deadline:
                raise AssertionError(f"expected spans not received; got {len(spans)} spans")
            time.sleep(0.1)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def attributes(span: Span) -> dict[str, object]:
    """A protobuf span's attributes as Python values."""
    out: dict[str, object] = {}
    for kv in span.attributes:
        value = kv.value
        kind = value.WhichOneof("value")
        if kind == "array_value":
            out[kv.key] = [getattr(v, v.WhichOneof("value")) for v in value.array_value.values]
        else:
            out[kv.key] = getattr(value, kind) if kind else None
    return out
