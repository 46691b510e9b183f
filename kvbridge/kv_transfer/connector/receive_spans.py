"""D's receive spans: one traced load's live spans and the wall-clock times noted for them.

The receive state machine (receiving.py) makes a `LoadSpans` only for a traced request
(RecvSpec.trace) and calls it at its transitions; an untraced request has none, so it makes no
span object and notes no wall-clock time. The spans (docs/architecture.md "Traces"), under the
request's span: ``kv.load`` (live from the receive's start, when the request was parked in
WAITING_FOR_REMOTE_KVS, to settled) with children ``kv.handshake`` (only when it waited for one),
``kv.lease_check`` (the check_read round trip: its traceparent rides the message, so P's
``kv.check_read`` nests under it) and one ``kv.read`` per (D rank, P rank) read (times noted by
the rank, `ReadResult.started_ns`); and ``kv.read_done`` or ``kv.release`` (D telling P, on the
control thread: `traced_message`).
"""

from __future__ import annotations

import functools
import time
from concurrent.futures import Future
from typing import Callable, Iterable, Protocol

from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from kvbridge.kv_transfer.connector.metadata import RecvSpec
from kvbridge.kv_transfer.connector.rank_agent import ReadResult
from kvbridge.tracing import RequestTrace, format_traceparent
from kvbridge.tracing.core import AttributeValue


class _Read(Protocol):
    """One (D rank, P rank) read of a request, as the state machine keeps it."""

    local_rank: int
    remote_rank: int
    nbytes: int
    ndescs: int
    result: ReadResult | None


class LoadSpans:
    """A traced request's load: its live kv.load and kv.lease_check spans and noted times.
    Called on the engine thread, except `check_answered` (the control thread)."""

    def __init__(self, spec: RecvSpec, trace: RequestTrace) -> None:
        """Start kv.load under the request's span: the receive starts now."""
        r = spec.remote
        self.spec = spec
        self.trace = trace
        self.load: Span = trace.tracing.start_span("kv.load", trace.parent, attributes={
            "kvbridge.request_id": spec.request_id, "kvbridge.remote_engine_id": r.engine_id,
            "kvbridge.remote_request_id": spec.remote_request_id,
            "kvbridge.lease_generation": spec.lease_generation, "kvbridge.num_blocks": spec.num_blocks,
            "server.address": r.host, "server.port": r.port})
        self.handshake_ns = 0  # wall clock when it started waiting for a handshake (kv.handshake)
        self.check: Span | None = None  # kv.lease_check, live while check_read is in flight
        self.check_end_ns = 0  # when P's answer came (noted on the control thread)

    def handshake_waited(self) -> None:
        """The request started waiting for a handshake."""
        self.handshake_ns = time.time_ns()

    def handshake_done(self, outcome: str, error: str | None, remote_ranks: int) -> None:
        """Its handshake wait ended: record kv.handshake."""
        if self.handshake_ns:
            r = self.spec.remote
            self.trace.record("kv.handshake", self.handshake_ns, time.time_ns(), parent=self.load.get_span_context(),
                              attributes={"kvbridge.remote_engine_id": r.engine_id, "server.address": r.host,
                                          "server.port": r.port, "kvbridge.outcome": outcome,
                                          "kvbridge.remote_ranks": remote_ranks}, error=error)
        self.handshake_ns = 0

    def check_sent(self, watch: bool) -> str | None:
        """D asks P to grant the read: start kv.lease_check; its traceparent rides the message."""
        s = self.spec
        self.check = self.trace.tracing.start_span("kv.lease_check", self.load.get_span_context(),
                                                   kind=SpanKind.CLIENT,
                                                   attributes={"kvbridge.remote_request_id": s.remote_request_id,
                                                               "kvbridge.lease_generation": s.lease_generation,
                                                               "kvbridge.watch": watch,
                                                               "server.address": s.remote.host,
                                                               "server.port": s.remote.port})
        return format_traceparent(self.check.get_span_context())

    def check_answered(self, _future: Future[object]) -> None:
        """Done callback of the check_read (control thread): when P's answer came."""
        self.check_end_ns = time.time_ns()

    def check_done(self, outcome: str, error: str | None = None) -> None:
        """The check_read round trip ended: end kv.lease_check (if live)."""
        span, self.check = self.check, None
        if span is None:
            return
        span.set_attribute("kvbridge.outcome", outcome)
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_time=self.check_end_ns or time.time_ns())

    def load_settled(self, reads: Iterable[_Read], outcome: str, error: str | None, backend: str) -> None:
        """The load settled (outcome "ok" or a FailureKind value; after `handshake_done`): end
        kv.lease_check if live, record a kv.read per read that settled, end kv.load."""
        self.check_done(outcome, error)
        reads = list(reads)
        tracing, parent = self.trace.tracing, self.load.get_span_context()
        for read in reads:
            r = read.result
            if r is None or r.started_ns is None:
                continue
            tracing.record("kv.read", parent, r.started_ns, r.settled_ns or time.time_ns(), attributes={
                "kvbridge.tp_rank": read.local_rank, "kvbridge.remote_rank": read.remote_rank,
                "kvbridge.bytes": read.nbytes, "kvbridge.descriptors": read.ndescs, "kvbridge.backend": backend,
                "kvbridge.outcome": r.kind.value if r.kind is not None else "ok"}, error=None if r.ok else r.cause)
        span = self.load
        span.set_attribute("kvbridge.outcome", outcome)
        span.set_attribute("kvbridge.num_reads", len(reads))
        if error is None:
            span.set_attribute("kvbridge.bytes", sum(r.nbytes for r in reads))
        else:
            span.set_attribute("kvbridge.failure_kind", outcome)
            span.set_status(Status(StatusCode.ERROR, error))
        span.end()


_MESSAGE_SPANS = {"read-done": "kv.read_done", "release": "kv.release"}  # D telling P, per message


def traced_message(trace: RequestTrace | None, what: str, send: Callable[..., None]) -> Callable[..., None]:
    """`send` for a message to P (`what`); for a traced request's read-done or release, one that
    also records it as kv.read_done / kv.release under the request's span."""
    if trace is None or what not in _MESSAGE_SPANS:
        return send
    return functools.partial(_traced_message, trace, _MESSAGE_SPANS[what], send)


def _traced_message(trace: RequestTrace, name: str, send: Callable[..., None], host: str, port: int, rid: str,
                    gen: int) -> None:
    """Send a read-done or release (on the control thread) and record it as `name` under the
    request's span."""
    start_ns = time.time_ns()
    attributes: dict[str, AttributeValue] = {"kvbridge.remote_request_id": rid, "kvbridge.lease_generation": gen, "server.address": host,
                  "server.port": port}
    try:
        send(host, port, rid, gen)
    except Exception as exc:
        trace.record(name, start_ns, time.time_ns(), kind=SpanKind.CLIENT,
                     attributes={**attributes, "kvbridge.outcome": "error"}, error=f"{type(exc).__name__}: {exc}")
        raise
    trace.record(name, start_ns, time.time_ns(), kind=SpanKind.CLIENT,
                 attributes={**attributes, "kvbridge.outcome": "ok"})
