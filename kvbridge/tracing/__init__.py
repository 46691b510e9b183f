"""OpenTelemetry traces of kvbridge's processes: `core.py` builds a program's tracer
and exporter (off unless an OTLP endpoint is given) and reads/writes W3C traceparents;
`request_trace.py` is what an engine request carries so that its spans join the request's trace.

Ground floor: it imports only OpenTelemetry, so every layer may use it."""

from kvbridge.tracing.core import (TRACEPARENT_HEADER, Tracing, TracingConfig, TracingConfigError, build_tracing,
                                   format_traceparent, parse_traceparent, program_tracing, without_none)
from kvbridge.tracing.request_trace import RequestTrace

__all__ = ["TRACEPARENT_HEADER", "RequestTrace", "Tracing", "TracingConfig", "TracingConfigError", "build_tracing",
           "format_traceparent", "parse_traceparent", "program_tracing", "without_none"]
