"""A real OTLP trace receiver for tests (issue 30): what a collector is to kvbridge, on loopback.

    with OtlpReceiver(grpc=True) as receiver:        # HTTP (and gRPC) servers on 127.0.0.1, port 0
        tracing = build_tracing(TracingConfig(receiver.endpoint, "kvbridge-proxy"))
        ...                                          # or receiver.grpc_endpoint with
        spans = receiver.wait_for(lambda spans: any(s.name == "proxy.request" for s in spans), timeout=30)
        receiver.write_otlp_json(path)               # the collector file exporter's format

- OTLP/HTTP: `POST /v1/traces`, `application/x-protobuf` bodies (gzip when Content-Encoding says
  so), decoded with the official `ExportTraceServiceRequest`, answered with an
  `ExportTraceServiceResponse`; anything else gets the 4xx the OTLP spec names.
- OTLP/gRPC (`grpc=True`): the `TraceService/Export` method of the official service definition.
- A Jaeger API v3 query endpoint over what it stored, on the HTTP port (`query_url`):
  `GET /api/v3/traces?query.service_name=&query.attributes=&query.start_time_min=&...` (FindTraces)
  and `GET /api/v3/traces/{trace_id}` (GetTrace), with Jaeger's parameters (snake_case and
  camelCase), its matching rule (a span of the service, started in the window, carrying the
  attributes on itself, its scope, resource or events), its answer `{"result": {"resourceSpans":
  [...]}}` and its 400/404 error bodies.

`wait_for` blocks on a condition variable that every export notifies: no sleeps, a bounded timeout.
"""

from __future__ import annotations

import base64
import gzip
import json
import re
import threading
import zlib
from collections.abc import Callable, Iterable
from concurrent import futures
from dataclasses import dataclass
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from google.protobuf import json_format
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1 import trace_pb2

TRACES_PATH = "/v1/traces"
PROTOBUF = "application/x-protobuf"
_KINDS = {0: "UNSPECIFIED", 1: "INTERNAL", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER"}
_STATUS = {0: "UNSET", 1: "OK", 2: "ERROR"}
_ID_KEYS = frozenset({"traceId", "spanId", "parentSpanId"})
_MAX_BODY = 64 << 20


@dataclass(frozen=True)
class ReceivedSpan:
    trace_id: str  # 32 hex digits
    span_id: str  # 16 hex digits
    parent_span_id: str | None
    name: str
    kind: str  # SERVER, CLIENT, INTERNAL...
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    status_code: str  # UNSET, OK, ERROR
    status_message: str
    events: tuple[tuple[str, int, dict[str, Any]], ...]  # (name, time ns, attributes)
    service: str  # the resource's service.name

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns


def any_value(value: AnyValue) -> Any:
    which = value.WhichOneof("value")
    if which == "array_value":
        return [any_value(v) for v in value.array_value.values]
    if which == "kvlist_value":
        return {kv.key: any_value(kv.value) for kv in value.kvlist_value.values}
    return None if which is None else getattr(value, which)


def _attributes(kvs: Iterable[Any]) -> dict[str, Any]:
    return {kv.key: any_value(kv.value) for kv in kvs}


def received_spans(request: trace_service_pb2.ExportTraceServiceRequest) -> list[ReceivedSpan]:
    out = []
    for resource_spans in request.resource_spans:
        service = str(_attributes(resource_spans.resource.attributes).get("service.name", "unknown_service"))
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                out.append(ReceivedSpan(
                    trace_id=span.trace_id.hex(), span_id=span.span_id.hex(),
                    parent_span_id=span.parent_span_id.hex() or None, name=span.name,
                    kind=_KINDS.get(span.kind, str(span.kind)), start_ns=span.start_time_unix_nano,
                    end_ns=span.end_time_unix_nano, attributes=_attributes(span.attributes),
                    status_code=_STATUS.get(span.status.code, str(span.status.code)),
                    status_message=span.status.message,
                    events=tuple((e.name, e.time_unix_nano, _attributes(e.attributes)) for e in span.events),
                    service=service))
    return out


def otlp_json(message: Any) -> dict:
    """`message` (ExportTraceServiceRequest / TracesData) in OTLP JSON: protobuf's JSON mapping with
    lowerCamelCase names and integer enums, but trace and span ids as hex (the OTLP spec's one
    departure from the mapping, which would write base64)."""
    return _hex_ids(json_format.MessageToDict(message, use_integers_for_enums=True))


def _hex_ids(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: (base64.b64decode(v).hex() if k in _ID_KEYS and isinstance(v, str) else _hex_ids(v))
                for k, v in node.items()}
    if isinstance(node, list):
        return [_hex_ids(v) for v in node]
    return node


_RFC3339 = re.compile(r"^(\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2})(?:\.(\d{1,9}))?(Z|[+-]\d{2}:\d{2})$")


def parse_rfc3339_nano(text: str) -> int:
    """Unix nanoseconds of an RFC 3339 time (Go's RFC3339Nano: up to 9 fraction digits); ValueError."""
    m = _RFC3339.match(text)
    if m is None:
        raise ValueError(f"{text!r} is not an RFC 3339 time")
    zone = "+00:00" if m.group(3) == "Z" else m.group(3)
    seconds = datetime.fromisoformat(m.group(1) + zone).astimezone(timezone.utc).timestamp()
    return int(seconds) * 1_000_000_000 + int((m.group(2) or "0").ljust(9, "0"))


class _QueryError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class OtlpReceiver:
    """Collects the spans exporters send it; see the module's docstring."""

    def __init__(self, *, grpc: bool = False, host: str = "127.0.0.1") -> None:
        self._host = host
        self._want_grpc = grpc
        self._cond = threading.Condition()
        self._requests: list[trace_service_pb2.ExportTraceServiceRequest] = []
        self._spans: list[ReceivedSpan] = []
        self._encodings: list[str] = []
        self._refused: list[str] = []
        self._http: ThreadingHTTPServer | None = None
        self._http_thread: threading.Thread | None = None
        self._grpc_server: Any = None
        self._grpc_port: int | None = None

    # ---- lifecycle ----

    def start(self) -> OtlpReceiver:
        receiver = self

        class Handler(_Handler):
            owner = receiver

        self._http = ThreadingHTTPServer((self._host, 0), Handler)
        self._http.daemon_threads = True
        self._http_thread = threading.Thread(target=self._http.serve_forever, name="otlp-receiver-http",
                                             kwargs={"poll_interval": 0.05}, daemon=True)
        self._http_thread.start()
        if self._want_grpc:
            import grpc
            self._grpc_server = grpc.server(futures.ThreadPoolExecutor(max_workers=2,
                                                                       thread_name_prefix="otlp-receiver-grpc"))
            trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_Servicer(self), self._grpc_server)
            self._grpc_port = self._grpc_server.add_insecure_port(f"{self._host}:0")
            self._grpc_server.start()
        return self

    def stop(self) -> None:
        if self._grpc_server is not None:
            self._grpc_server.stop(grace=None).wait(timeout=10)
            self._grpc_server = None
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            assert self._http_thread is not None
            self._http_thread.join(timeout=10)
            self._http = None

    def __enter__(self) -> OtlpReceiver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- addresses ----

    @property
    def port(self) -> int:
        assert self._http is not None, "start() the receiver first"
        return self._http.server_address[1]

    @property
    def endpoint(self) -> str:
        """The OTLP/HTTP traces URL (kvbridge's --otlp-traces-endpoint)."""
        return f"http://{self._host}:{self.port}{TRACES_PATH}"

    @property
    def grpc_endpoint(self) -> str:
        """The OTLP/gRPC endpoint (with OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=grpc)."""
        assert self._grpc_port is not None, "OtlpReceiver(grpc=True) serves gRPC"
        return f"http://{self._host}:{self._grpc_port}"

    @property
    def query_url(self) -> str:
        """The Jaeger API v3 base URL (`kvbridge trace --endpoint`)."""
        return f"http://{self._host}:{self.port}"

    # ---- what it received ----

    def spans(self) -> list[ReceivedSpan]:
        with self._cond:
            return list(self._spans)

    def requests(self) -> list[trace_service_pb2.ExportTraceServiceRequest]:
        with self._cond:
            return list(self._requests)

    def content_encodings(self) -> list[str]:
        """The Content-Encoding of each OTLP/HTTP export accepted ("identity" when none)."""
        with self._cond:
            return list(self._encodings)

    def refused(self) -> list[str]:
        """Why each refused export was refused."""
        with self._cond:
            return list(self._refused)

    def wait_for(self, predicate: Callable[[list[ReceivedSpan]], bool], timeout: float) -> list[ReceivedSpan]:
        """The spans received, once `predicate(spans)` holds; TimeoutError after `timeout` seconds."""
        with self._cond:
            if self._cond.wait_for(lambda: predicate(list(self._spans)), timeout=timeout):
                return list(self._spans)
            names = sorted({f"{s.service}:{s.name}" for s in self._spans})
            raise TimeoutError(f"after {timeout} s the receiver holds {len(self._spans)} spans "
                               f"({', '.join(names) or 'none'}), which do not satisfy the predicate")

    def otlp_json_lines(self) -> list[str]:
        """Each export received as one line of OTLP JSON (the collector's file exporter format)."""
        return [json.dumps(otlp_json(request), separators=(",", ":")) for request in self.requests()]

    def write_otlp_json(self, path: str | Path) -> int:
        """Writes `otlp_json_lines()` to `path`; returns the number of lines."""
        lines = self.otlp_json_lines()
        Path(path).write_text("".join(line + "\n" for line in lines), encoding="utf-8")
        return len(lines)

    # ---- intake (both protocols) ----

    def _accept(self, request: trace_service_pb2.ExportTraceServiceRequest, encoding: str | None) -> None:
        spans = received_spans(request)
        with self._cond:
            self._requests.append(request)
            self._spans.extend(spans)
            if encoding is not None:
                self._encodings.append(encoding)
            self._cond.notify_all()

    def _refuse(self, why: str) -> None:
        with self._cond:
            self._refused.append(why)
            self._cond.notify_all()

    # ---- the Jaeger API v3 over what was stored ----

    def _traces_data(self, trace_ids: set[bytes]) -> trace_pb2.TracesData:
        data = trace_pb2.TracesData()
        for request in self.requests():
            for resource_spans in request.resource_spans:
                kept = trace_pb2.ResourceSpans(resource=resource_spans.resource, schema_url=resource_spans.schema_url)
                for scope_spans in resource_spans.scope_spans:
                    spans = [s for s in scope_spans.spans if s.trace_id in trace_ids]
                    if spans:
                        kept.scope_spans.append(trace_pb2.ScopeSpans(scope=scope_spans.scope, spans=spans,
                                                                     schema_url=scope_spans.schema_url))
                if kept.scope_spans:
                    data.resource_spans.append(kept)
        return data

    def jaeger_get_trace(self, trace_id: str) -> dict:
        try:
            wanted = bytes.fromhex(trace_id)
        except ValueError:
            raise _QueryError(400, f"malformed parameter trace_id: {trace_id!r}") from None
        data = self._traces_data({wanted})
        if not data.resource_spans:
            raise _QueryError(404, "trace not found")
        return {"result": otlp_json(data)}

    def jaeger_find_traces(self, query: dict[str, str]) -> dict:
        def param(canonical: str, deprecated: str) -> str:
            return query.get(canonical) or query.get(deprecated, "")

        service = param("query.serviceName", "query.service_name")
        operation = param("query.operationName", "query.operation_name")
        attributes: dict[str, str] = {}
        if query.get("query.attributes"):
            try:
                attributes = json.loads(query["query.attributes"])
            except ValueError as exc:
                raise _QueryError(400, f"malformed parameter query.attributes: {exc}") from None
            if not isinstance(attributes, dict) or not all(isinstance(v, str) for v in attributes.values()):
                raise _QueryError(400, "malformed parameter query.attributes: not a map of strings")
        low, high = param("query.startTimeMin", "query.start_time_min"), param("query.startTimeMax",
                                                                             "query.start_time_max")
        if not low or not high:
            raise _QueryError(400, "query.startTimeMin and query.startTimeMax are required")
        try:
            low_ns, high_ns = parse_rfc3339_nano(low), parse_rfc3339_nano(high)
        except ValueError as exc:
            raise _QueryError(400, f"malformed parameter: {exc}") from None
        if low_ns >= high_ns:
            raise _QueryError(400, "query.startTimeMin must be before query.startTimeMax")
        depth_text = param("query.searchDepth", "query.search_depth") or query.get("query.num_traces") or "100"
        try:
            depth = int(depth_text)
        except ValueError:
            raise _QueryError(400, f"malformed parameter query.searchDepth: {depth_text!r}") from None
        matched: dict[bytes, int] = {}  # trace id -> its latest arrival index, for most-recent-first
        for index, request in enumerate(self.requests()):
            for resource_spans in request.resource_spans:
                resource_attrs = _attributes(resource_spans.resource.attributes)
                if service and resource_attrs.get("service.name") != service:
                    continue
                for scope_spans in resource_spans.scope_spans:
                    scope_attrs = _attributes(scope_spans.scope.attributes)
                    for span in scope_spans.spans:
                        if operation and span.name != operation:
                            continue
                        if not low_ns <= span.start_time_unix_nano <= high_ns:
                            continue
                        if all(_has(key, value, span, scope_attrs, resource_attrs) for key, value in attributes.items()):
                            matched[span.trace_id] = index
        chosen = sorted(matched, key=lambda t: matched[t], reverse=True)[:max(depth, 0)]
        if not chosen:
            raise _QueryError(404, "No traces found")
        return {"result": otlp_json(self._traces_data(set(chosen)))}


def _has(key: str, value: str, span: Any, scope_attrs: dict, resource_attrs: dict) -> bool:
    """Jaeger's rule: the attribute on the span, its scope, its resource or one of its events."""
    def matches(attrs: dict) -> bool:
        return key in attrs and _as_string(attrs[key]) == value
    return (matches(_attributes(span.attributes)) or matches(scope_attrs) or matches(resource_attrs)
            or any(matches(_attributes(e.attributes)) for e in span.events))


def _as_string(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return value if isinstance(value, str) else json.dumps(value)


class _Servicer(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, owner: OtlpReceiver) -> None:
        self.owner = owner

    def Export(self, request, context):  # noqa: N802 (the generated method name)
        self.owner._accept(request, None)
        return trace_service_pb2.ExportTraceServiceResponse()


class _Handler(BaseHTTPRequestHandler):
    owner: OtlpReceiver
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # the test's output stays quiet
        pass

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _send_json(self, status: int, document: dict) -> None:
        self._send(status, json.dumps(document).encode(), "application/json")

    def _refuse(self, status: int, why: str) -> None:
        self.owner._refuse(why)
        self._send(status, why.encode(), "text/plain")

    def do_POST(self) -> None:  # noqa: N802
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            self.close_connection = True
            self._refuse(411, "a Content-Length is required")
            return
        if int(length) > _MAX_BODY:
            self.close_connection = True
            self._refuse(413, "body too large")
            return
        body = self.rfile.read(int(length))
        if urlsplit(self.path).path != TRACES_PATH:
            self._refuse(404, f"no route {self.path}")
            return
        content_type = (self.headers.get("Content-Type") or "").split(";")[0].strip().lower()
        if content_type != PROTOBUF:
            self._refuse(415, f"Content-Type {content_type!r}: this receiver takes {PROTOBUF}")
            return
        encoding = (self.headers.get("Content-Encoding") or "identity").strip().lower()
        try:
            if encoding == "gzip":
                body = gzip.decompress(body)
            elif encoding == "deflate":
                body = zlib.decompress(body)
            elif encoding != "identity":
                self._refuse(415, f"Content-Encoding {encoding!r} is not supported")
                return
            request = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
        except (OSError, EOFError, zlib.error, DecodeError) as exc:
            self._refuse(400, f"undecodable body ({encoding}): {exc}")
            return
        self.owner._accept(request, encoding)
        self._send(200, trace_service_pb2.ExportTraceServiceResponse().SerializeToString(), PROTOBUF)

    def do_GET(self) -> None:  # noqa: N802
        url = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
        try:
            if url.path == "/api/v3/traces":
                self._send_json(200, self.owner.jaeger_find_traces(query))
            elif url.path.startswith("/api/v3/traces/"):
                self._send_json(200, self.owner.jaeger_get_trace(url.path.removeprefix("/api/v3/traces/")))
            else:
                self._send_json(404, {"error": {"httpCode": 404, "message": f"no route {url.path}"}})
        except _QueryError as exc:
            self._send_json(exc.status, {"error": {"httpCode": exc.status, "message": str(exc)}})
