"""What an engine request carries for its spans: the tracer and the parent span.

The server starts one span per request it serves (its HTTP handling) and hands the engine a
`RequestTrace` naming that span as the parent; the engine, the scheduler and the KV connector
record their spans (queue wait, prefill chunks, lease held, KV reads...) under it, from times
they note as the work happens. A request without tracing carries None, and nothing is noted.

The engine's own spans are made here from the phase times the scheduler notes on a traced
request (wall clock, `time.time_ns()`), each at its natural point: the queue when the request
is first scheduled, a prefill chunk at the end of its step, the first token once its output is
made, the decode (and an unfinished recompute) when the request finishes:

  engine.queue             arrival -> first scheduled (not for a request parked for remote KV)
  engine.admission         D: arrival -> blocks allocated, parked for the remote KV
  engine.prefill           one per chunk computed before the first token: its step
  engine.recompute         D: a failed load's fallback: the policy applied -> first token
  engine.first_token       the step that sampled the first token, until its output was made
  engine.first_decode_step D: the first step after the remote KV arrived, until its output was made
  engine.decode            the first decode step -> finish (tokens sampled in decode steps)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from opentelemetry.trace import SpanContext, SpanKind

from kvbridge.tracing.core import Attributes, Tracing, format_traceparent

QUEUE = "engine.queue"
ADMISSION = "engine.admission"
PREFILL = "engine.prefill"
RECOMPUTE = "engine.recompute"
FIRST_TOKEN = "engine.first_token"
FIRST_DECODE_STEP = "engine.first_decode_step"
DECODE = "engine.decode"
_FAILED = ("abort", "error")  # finish reasons that end the open spans with an ERROR status


@dataclass(eq=False)
class RequestTrace:
    tracing: Tracing
    parent: SpanContext  # the span of the instance's handling of this request
    # Phase bookkeeping: wall-clock ns noted by the engine (0: not reached yet).
    arrival_ns: int = 0
    scheduled_ns: int = 0  # first scheduled
    parked_ns: int = 0  # D: parked for remote KV (its wait is engine.admission + kv.load, no engine.queue)
    kv_loaded: bool = False  # D: the remote KV arrived; the next step that samples is the first decode step
    prefill_chunks: int = 0
    first_token_ns: int = 0  # the step that sampled this engine's first token ended
    decode_start_ns: int = 0
    decode_tokens: int = 0
    recompute_start_ns: int = 0  # D: a failed load is being recomputed (open engine.recompute)
    recompute_attributes: dict[str, str | int] | None = None
    finished_ns: int = 0

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

    # ---- the engine's phases (called only for traced requests) ----------------

    def first_scheduled(self, now_ns: int) -> None:
        """The request is scheduled to compute for the first time: its queue wait ends."""
        self.scheduled_ns = now_ns
        if not self.parked_ns:
            self.record(QUEUE, self.arrival_ns, now_ns)

    def parked(self, now_ns: int, num_blocks: int, num_remote_tokens: int) -> None:
        """D: blocks allocated and the request parked until its remote KV arrives."""
        self.parked_ns = now_ns
        self.record(ADMISSION, self.arrival_ns, now_ns,
                    attributes={"kvbridge.num_blocks": num_blocks, "kvbridge.num_tokens": num_remote_tokens})

    def recompute_started(self, now_ns: int, failure_kind: str, num_tokens: int, from_token: int) -> None:
        """D: the remote load failed and the request is recomputed locally (policy recompute)."""
        self.recompute_start_ns = now_ns
        self.recompute_attributes = {"kvbridge.failure_kind": failure_kind, "kvbridge.num_tokens": num_tokens,
                                     "kvbridge.start_token": from_token}

    def step_ran(self, start_ns: int, end_ns: int, num_tokens: int, sampled: bool) -> str | None:
        """A step computed `num_tokens` of this request from `start_ns` (scheduled) to `end_ns`
        (results back) and sampled a token or not. Records a prefill chunk; returns the name of
        the first-step span to record once the step's output is made (`first_step`), if any."""
        if self.first_token_ns:  # decoding
            if sampled:
                self.decode_start_ns = self.decode_start_ns or start_ns
                self.decode_tokens += 1
            return None
        if self.kv_loaded:  # D: the first step after the remote KV arrived
            if not sampled:
                return None
            self.first_token_ns = end_ns
            self.decode_start_ns, self.decode_tokens = start_ns, 1
            return FIRST_DECODE_STEP
        self.record(PREFILL, start_ns, end_ns,
                    attributes={"kvbridge.num_tokens": num_tokens, "kvbridge.chunk": self.prefill_chunks})
        self.prefill_chunks += 1
        if not sampled:
            return None
        self.first_token_ns = end_ns
        if self.recompute_start_ns:
            self._end_recompute(end_ns, None)
        return FIRST_TOKEN

    def first_step(self, name: str, start_ns: int, end_ns: int, num_tokens: int) -> None:
        """The step that produced the first token (or D's first decode step): its output is made."""
        self.record(name, start_ns, end_ns, attributes={"kvbridge.num_tokens": num_tokens})

    def finished(self, now_ns: int, reason: str) -> None:
        """The request finished (any reason): ends the spans still open. Once."""
        if self.finished_ns:
            return
        self.finished_ns = now_ns
        error = f"request finished: {reason}" if reason in _FAILED else None
        if not self.scheduled_ns and not self.parked_ns:
            self.record(QUEUE, self.arrival_ns, now_ns, attributes={"kvbridge.outcome": reason}, error=error)
        if self.recompute_start_ns:
            self._end_recompute(now_ns, error or f"request finished during recompute: {reason}")
        if self.decode_start_ns:
            self.record(DECODE, self.decode_start_ns, now_ns,
                        attributes={"kvbridge.num_tokens": self.decode_tokens, "kvbridge.outcome": reason},
                        error=error)

    def _end_recompute(self, end_ns: int, error: str | None) -> None:
        self.record(RECOMPUTE, self.recompute_start_ns, end_ns, attributes=self.recompute_attributes, error=error)
        self.recompute_start_ns = 0
