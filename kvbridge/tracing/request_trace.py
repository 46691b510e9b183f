"""What an engine request carries for its spans: the tracer and the parent span (issue 30).

The server starts one span per request it serves (its HTTP handling) and hands the engine a
`RequestTrace` naming that span as the parent; the engine, the scheduler and the KV connector
record their spans (queue wait, prefill chunks, lease held, KV reads...) under it, from times
they note as the work happens. A request without tracing carries None, and nothing is noted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from opentelemetry.trace import SpanContext, SpanKind

from kvbridge.tracing.core import Attributes, Tracing, format_traceparent


@dataclass(eq=False)
class RequestTrace:
    tracing: Tracing
    parent: SpanContext  # the span of the instance's handling of this request

    @property
    def traceparent(self) -> str | None:
        """The parent as a W3C traceparent, for messages to other processes (D's lease check)."""
        return format_traceparent(self.parent)

    def record(self, name: str, start_ns: int, end_ns: int, *, parent: SpanContext | None = None,
               kind: SpanKind = SpanKind.INTERNAL, attributes: Attributes | None = None,
               error: str | None = None, events: Sequence[tuple[str, int, Attributes]] = ()) -> SpanContext:
        """A finished span under this request's span (or under `parent`, one of its children)."""
        return self.tracing.record(name, parent if parent is not None else self.parent, start_ns, end_ns,
                                   kind=kind, attributes=attributes, error=error, events=events)
