"""One program's tracer: the official OpenTelemetry SDK exporting over OTLP.

`build_tracing(config)` returns None when no endpoint is configured. The engine keeps a
`RequestTrace | None` per request (tracing off costs one `is None` test where the step loop would
trace); the HTTP servers and the proxy turn it into a null span object at construction
(server/completions.py, proxy/tracing_spans.py), so their request paths never test it. With an
endpoint it returns a `Tracing` that owns its TracerProvider, the batch span processor (one
exporter thread) and the exporter; the program that built it calls `shutdown()` at exit, which
flushes what is queued (`program_tracing`: the same as a `with` block).

Each server gets a Tracing of its own (never the process-global provider), so a prefill and a
decode instance in one process (as in tests) still export under their own `service.name`.

Context crosses process boundaries as a W3C `traceparent` string (HTTP header, side-channel
message field); inside a process it is an OpenTelemetry `SpanContext`. Sampling is parent-based:
a sampled incoming `traceparent` is traced, an unsampled one is not, and a trace this process
starts is sampled with probability `sample_ratio`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import NonRecordingSpan, Span, SpanContext, SpanKind, Status, StatusCode, TraceFlags

logger = logging.getLogger(__name__)

TRACEPARENT_HEADER = "traceparent"
PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"  # "grpc", else http/protobuf
INSTRUMENTATION_NAME = "kvbridge"

AttributeValue = str | bool | int | float | Sequence[str] | Sequence[int] | Sequence[float]
Attributes = Mapping[str, AttributeValue]


class TracingConfigError(ValueError):
    pass


@dataclass(frozen=True)
class TracingConfig:
    endpoint: str | None  # OTLP traces endpoint (--otlp-traces-endpoint); None: tracing off
    service_name: str  # resource `service.name`: which process this is
    sample_ratio: float = 1.0  # traces this process starts that are sampled

    def __post_init__(self) -> None:
        if not 0.0 <= self.sample_ratio <= 1.0:
            raise TracingConfigError(f"the trace sample ratio must be between 0 and 1, got {self.sample_ratio}")
        if self.endpoint is not None and not self.endpoint.startswith(("http://", "https://")):
            raise TracingConfigError(f"the OTLP traces endpoint must be an http:// or https:// URL, "
                                     f"got {self.endpoint!r}")
        if not self.service_name:
            raise TracingConfigError("the service name must not be empty")


def _exporter(endpoint: str) -> SpanExporter:
    protocol = os.environ.get(PROTOCOL_ENV, "http/protobuf").strip().lower()
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
        return GrpcExporter(endpoint=endpoint, insecure=endpoint.startswith("http://"))
    if protocol not in ("http/protobuf", "http"):
        raise TracingConfigError(f"{PROTOCOL_ENV}={protocol!r}: kvbridge exports over grpc or http/protobuf")
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
    return HttpExporter(endpoint=endpoint)  # the URL as given (vLLM's option, the collector's /v1/traces)


class Tracing:
    """A tracer with its provider and exporter. `span`/`record` are the two ways kvbridge makes
    spans: a live span around work in progress, or a finished one from times noted earlier."""

    def __init__(self, provider: TracerProvider, service_name: str) -> None:
        self.provider = provider
        self.service_name = service_name
        self.tracer = provider.get_tracer(INSTRUMENTATION_NAME)

    def start_span(self, name: str, parent: SpanContext | None = None, *, kind: SpanKind = SpanKind.INTERNAL,
                   attributes: Attributes | None = None, start_ns: int | None = None) -> Span:
        """A live span; the caller ends it (`span.end()`). No parent starts a new trace."""
        return self.tracer.start_span(name, context=_context(parent), kind=kind,
                                      attributes=attributes, start_time=start_ns)

    def record(self, name: str, parent: SpanContext | None, start_ns: int, end_ns: int, *,
               kind: SpanKind = SpanKind.INTERNAL, attributes: Attributes | None = None,
               error: str | None = None, events: Sequence[tuple[str, int, Attributes]] = ()) -> SpanContext:
        """A finished span from noted times (wall clock, ns); returns its context for children."""
        span = self.tracer.start_span(name, context=_context(parent), kind=kind,
                                      attributes=attributes, start_time=start_ns)
        for event_name, at_ns, event_attributes in events:
            span.add_event(event_name, event_attributes, timestamp=at_ns)
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_time=max(start_ns, end_ns))
        return span.get_span_context()

    def shutdown(self) -> None:
        """Exports what is queued and stops the exporter thread."""
        try:
            self.provider.shutdown()
        except Exception:  # a collector that went away must not fail the program's exit
            logger.warning("tracing: flushing spans at shutdown failed", exc_info=True)


def build_tracing(config: TracingConfig | None) -> Tracing | None:
    """The program's Tracing, or None when tracing is off (no endpoint)."""
    if config is None or config.endpoint is None:
        return None
    provider = TracerProvider(resource=Resource.create({"service.name": config.service_name}),
                              sampler=ParentBased(root=TraceIdRatioBased(config.sample_ratio)))
    provider.add_span_processor(BatchSpanProcessor(_exporter(config.endpoint)))
    logger.info("tracing: exporting spans of %s to %s (%s), sampling %g of new traces", config.service_name,
                config.endpoint, os.environ.get(PROTOCOL_ENV, "http/protobuf"), config.sample_ratio)
    return Tracing(provider, config.service_name)


@contextmanager
def program_tracing(config: TracingConfig | None) -> Iterator[Tracing | None]:
    """The program's Tracing (`build_tracing`) for the `with` block, which owns it: shut down (what
    is queued exported) when the block ends, however it ends."""
    tracing = build_tracing(config)
    try:
        yield tracing
    finally:
        if tracing is not None:
            tracing.shutdown()


def _context(parent: SpanContext | None) -> Context | None:
    if parent is None or not parent.is_valid:
        return None
    return trace.set_span_in_context(NonRecordingSpan(parent))


def parse_traceparent(value: str | None) -> SpanContext | None:
    """The remote parent named by a W3C traceparent (version 00), or None if absent or malformed."""
    if not value or not isinstance(value, str):
        return None
    parts = value.strip().split("-")
    if len(parts) != 4 or parts[0] != "00" or len(parts[1]) != 32 or len(parts[2]) != 16 or len(parts[3]) != 2:
        return None
    try:
        trace_id, span_id, flags = int(parts[1], 16), int(parts[2], 16), int(parts[3], 16)
    except ValueError:
        return None
    if trace_id == 0 or span_id == 0:
        return None
    return SpanContext(trace_id, span_id, is_remote=True, trace_flags=TraceFlags(flags & 0xFF))


def format_traceparent(context: SpanContext | None) -> str | None:
    """The W3C traceparent naming `context` as the parent, or None for no (valid) context."""
    if context is None or not context.is_valid:
        return None
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"


def without_none(attributes: Mapping[str, Any]) -> dict[str, AttributeValue]:
    """The attributes whose value is not None (OpenTelemetry drops None values with a warning)."""
    return {k: v for k, v in attributes.items() if v is not None}
