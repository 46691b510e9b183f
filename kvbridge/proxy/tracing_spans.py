"""The proxy's spans (docs: the span contract): one `proxy.request` per client request
and children that tile it, from its first byte in to its last byte out:

  proxy.read_body    the request's ASGI dispatch, authorisation, body read and JSON parsing
  proxy.route        one per routing decision (which P or D an attempt goes to)
  proxy.attempt      one per upstream attempt (CLIENT); the `traceparent` sent upstream names it
  proxy.backoff      the wait before a retry
  proxy.first_token  the first-token path: P's answer -> its token's events handed to the server
  proxy.release      asking P to free a request's KV
  proxy.relay        the answer in hand -> its last byte handed to the server

The request path tells a request's spans what happened (`Spans`, `LegSpans`, `AttemptSpans`:
the proxy decides, the spans only observe); it never asks whether tracing is on. With tracing off
every request gets `NO_SPANS`, whose legs and attempts are `NO_LEG` and `NO_ATTEMPT`: one shared
object each, whose methods do nothing (no span object, no allocation; benchmarks/proxy_spans.py
measures the cost either way).

`ProxyTracingMiddleware` (a pure ASGI middleware, installed only when tracing is on) starts
`proxy.request` as a `RequestSpans` before FastAPI dispatches the request, sees the answer's bytes
go out, and ends the request's spans at the last one. A step starts where the one before it ended
(`last_end_ns`: the request read, a route, an attempt, a backoff, P's leg), so the proxy's own
work between two steps (the event loop's turn, recording a span) is in the next one and the
children leave no gap; `read_body` starts with the request, the relay ends with it. The handler
finds the request's spans with `request_spans(request, request_id)`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Protocol
from urllib.parse import urlsplit

from fastapi import Request
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvbridge.proxy.exchange import Exchange, Failed
from kvbridge.proxy.routing import PrefixAffinityPolicy, Upstream, UpstreamPool
from kvbridge.tracing import TRACEPARENT_HEADER, Tracing, format_traceparent, parse_traceparent, without_none
from kvbridge.tracing.core import Attributes

SCOPE_KEY = "kvbridge.proxy_spans"  # the ASGI scope's entry holding the request's RequestSpans
TRACED_PATHS = ("/v1/completions", "/v1/chat/completions")
STREAM_END = b"data: [DONE]\n\n"  # the last event of a streamed answer


# ---- what the request path tells the spans ----------------------------------------------------
class AttemptSpans(Protocol):
    """One upstream attempt's span."""

    def headers(self, headers: dict[str, str]) -> dict[str, str]:
        """The attempt's headers: `headers`, plus the `traceparent` naming the attempt when traced."""
        ...

    def end(self, sent: Exchange | Failed, result: object) -> None:
        """The attempt's verdict: `sent` what the upstream answered, `result` the leg's judgement."""
        ...


class LegSpans(Protocol):
    """The spans of one leg (P, D, or D alone) of a request: its routes, attempts and backoffs."""

    def routed(self, pool: UpstreamPool, path: str, exclude: list[Upstream], chosen: Upstream | None) -> None:
        """The proxy just picked `chosen` from `pool` (None: no instance), excluding `exclude`."""
        ...

    def attempt(self, upstream: Upstream, path: str, number: int) -> AttemptSpans:
        """Attempt `number` (1-based) on `upstream` starts."""
        ...

    def backoff_ended(self, number: int, retrying: bool) -> None:
        """The wait before attempt `number` is over (`retrying`: the attempt is to be made)."""
        ...


class Spans(Protocol):
    """One client request's spans, as the request path sees them."""

    def leg(self, role: str) -> LegSpans: ...

    def identified(self, request_id: str) -> None:
        """The request's id is known (named on `proxy.request`)."""
        ...

    def body_read(self) -> None:
        """The request's body was read and parsed (or refused)."""
        ...

    def timed(self, name: str, attributes: Attributes) -> AbstractContextManager[object]:
        """The `with` block's time as span `name` (recorded when it ends without raising)."""
        ...

    def first_token_started(self) -> None:
        """The first-token path starts (P's answer in hand)."""
        ...

    def first_token_planned(self, planned: bool) -> None:
        """The first-token plan was made (`planned` False: the ordinary path serves the request)."""
        ...

    def first_token_outcome(self, outcome: str) -> None:
        """continued | finished_at_prefill | decode_failed | no_token."""
        ...

    def pd_path(self, path: str, reason: str) -> None:
        """The path that served the request (prefill_decode | decode_only) and why."""
        ...


# ---- tracing off: the null objects ------------------------------------------------------------
class _NoAttempt(AttemptSpans):
    def headers(self, headers: dict[str, str]) -> dict[str, str]:
        return headers

    def end(self, sent: Exchange | Failed, result: object) -> None:
        pass


class _NoLeg(LegSpans):
    def routed(self, pool: UpstreamPool, path: str, exclude: list[Upstream], chosen: Upstream | None) -> None:
        pass

    def attempt(self, upstream: Upstream, path: str, number: int) -> AttemptSpans:
        return NO_ATTEMPT

    def backoff_ended(self, number: int, retrying: bool) -> None:
        pass


class _NoSpans(Spans):
    _untimed: AbstractContextManager[object] = nullcontext()  # reusable: it holds no state

    def leg(self, role: str) -> LegSpans:
        return NO_LEG

    def identified(self, request_id: str) -> None:
        pass

    def body_read(self) -> None:
        pass

    def timed(self, name: str, attributes: Attributes) -> AbstractContextManager[object]:
        return self._untimed

    def first_token_started(self) -> None:
        pass

    def first_token_planned(self, planned: bool) -> None:
        pass

    def first_token_outcome(self, outcome: str) -> None:
        pass

    def pd_path(self, path: str, reason: str) -> None:
        pass


NO_ATTEMPT: AttemptSpans = _NoAttempt()
NO_LEG: LegSpans = _NoLeg()
NO_SPANS: Spans = _NoSpans()


def request_spans(request: Request, request_id: str) -> Spans:
    """The request's spans (NO_SPANS: tracing off); a traced one names the request id on `proxy.request`."""
    spans: Spans = request.scope.get(SCOPE_KEY, NO_SPANS)
    spans.identified(request_id)
    return spans


# ---- tracing on -------------------------------------------------------------------------------
def _server(url: str) -> dict[str, object]:
    parts = urlsplit(url)
    return {"server.address": parts.hostname, "server.port": parts.port}


def _end(span: Span, end_ns: int, outcome: str, error: bool) -> None:
    span.set_attribute("kvbridge.outcome", outcome)
    if error:
        span.set_status(Status(StatusCode.ERROR, outcome))
    span.end(end_time=end_ns)


class AttemptSpan(AttemptSpans):
    """One live `proxy.attempt`."""

    def __init__(self, owner: RequestSpans, span: Span) -> None:
        self._owner, self.span = owner, span

    def headers(self, headers: dict[str, str]) -> dict[str, str]:
        traceparent = format_traceparent(self.span.get_span_context())
        return headers if traceparent is None else {**headers, TRACEPARENT_HEADER: traceparent}

    def end(self, sent: Exchange | Failed, result: object) -> None:
        end_ns = time.time_ns()
        status = sent.response.status_code if isinstance(sent, Exchange) else None
        if status is not None:
            self.span.set_attribute("http.response.status_code", status)
        if isinstance(result, Failed):
            outcome = result.reason
        else:
            outcome = "ok" if status is None or status < 400 else f"status_{status}"
        _end(self.span, end_ns, outcome, outcome != "ok")
        self._owner.attempt_ended(self, end_ns)


class Leg(LegSpans):
    """The spans of one traced leg: `proxy.route`, `proxy.attempt` and `proxy.backoff`."""

    def __init__(self, owner: RequestSpans, role: str) -> None:
        self.owner, self.role = owner, role

    def routed(self, pool: UpstreamPool, path: str, exclude: list[Upstream], chosen: Upstream | None) -> None:
        """`proxy.route`, from the previous step's end."""
        attributes: dict[str, object] = {"kvbridge.role": self.role, "kvbridge.policy": pool.policy.name,
                                         "kvbridge.excluded": len(exclude)}
        if chosen is not None:
            attributes.update(_server(chosen.url), **{"url.full": chosen.url + path})
            if isinstance(pool.policy, PrefixAffinityPolicy):
                attributes["kvbridge.prefix_match_blocks"] = pool.policy.last_match_blocks
        attributes["kvbridge.outcome"] = "chosen" if chosen is not None else "no_instance"
        self.owner.record("proxy.route", self.owner.last_end_ns, time.time_ns(), attributes)

    def attempt(self, upstream: Upstream, path: str, number: int) -> AttemptSpan:
        """A live `proxy.attempt`, from its route's end."""
        url = upstream.url + path
        span = self.owner.tracing.start_span(
            "proxy.attempt", self.owner.context, kind=SpanKind.CLIENT, start_ns=self.owner.last_end_ns,
            attributes=without_none({
                "kvbridge.role": self.role, "kvbridge.attempt": number, "url.full": url,
                "http.request.method": "POST", **_server(upstream.url)}))
        attempt = AttemptSpan(self.owner, span)
        self.owner.open_attempts.append(attempt)
        return attempt

    def backoff_ended(self, number: int, retrying: bool) -> None:
        """`proxy.backoff`, from the failed attempt's end (nothing of the leg ends in between)."""
        self.owner.record("proxy.backoff", self.owner.last_end_ns, time.time_ns(), {
            "kvbridge.role": self.role, "kvbridge.attempt": number,
            "kvbridge.outcome": "retry" if retrying else "no_retry"})


class RequestSpans(Spans):
    """One traced client request (`Spans`): the live `proxy.request` and what its children need."""

    def __init__(self, tracing: Tracing, path: str, traceparent: str | None, start_ns: int) -> None:
        self.tracing, self.start_ns = tracing, start_ns
        self.request = tracing.start_span("proxy.request", parse_traceparent(traceparent), kind=SpanKind.SERVER,
                                          start_ns=start_ns, attributes={
                                              "http.request.method": "POST", "http.route": path, "url.path": path})
        self.context = self.request.get_span_context()
        self.open_attempts: list[AttemptSpan] = []
        self.last_end_ns = start_ns  # the end of the latest child: where the next step starts
        self.status: int | None = None
        self.chunks = self.bytes = 0
        self._first_token: tuple[int, str] | None = None  # its start and outcome, while open
        self.last_body_ns = start_ns  # when the latest body bytes were handed to the server
        self.stream_done = False  # the latest body bytes ended a server-sent-event stream
        self._finished = False

    def leg(self, role: str) -> Leg:
        return Leg(self, role)

    def identified(self, request_id: str) -> None:
        self.request.set_attribute("kvbridge.request_id", request_id)

    def record(self, name: str, start_ns: int, end_ns: int, attributes: Mapping[str, object], *,
               kind: SpanKind = SpanKind.INTERNAL, error: str | None = None) -> None:
        self.tracing.record(name, self.context, start_ns, end_ns, kind=kind,
                            attributes=without_none(attributes), error=error)
        self.last_end_ns = max(self.last_end_ns, end_ns)

    def body_read(self) -> None:
        """`proxy.read_body`: from the request's first byte in until it was parsed (or refused)."""
        self.record("proxy.read_body", self.start_ns, time.time_ns(), {})

    def attempt_ended(self, attempt: AttemptSpan, end_ns: int) -> None:
        self.open_attempts.remove(attempt)
        self.last_end_ns = max(self.last_end_ns, end_ns)

    @contextmanager
    def timed(self, name: str, attributes: Attributes) -> Iterator[None]:
        start_ns = time.time_ns()
        yield
        self.record(name, start_ns, time.time_ns(), attributes)

    def first_token_started(self) -> None:
        """The first-token path starts (P's answer in hand): `proxy.first_token` runs until the
        answer's first bytes are handed to the server (`first_token_outcome` names how it ended)."""
        self._first_token = (self.last_end_ns, "planned")  # from P's leg's end

    def first_token_planned(self, planned: bool) -> None:
        """Without a plan (P offered no token, or a context length unknown) the path ends now."""
        if not planned:
            self.first_token_outcome("no_token")
            self._end_first_token(time.time_ns())

    def pd_path(self, path: str, reason: str) -> None:
        self.request.set_attribute("kvbridge.pd_path", path)
        self.request.set_attribute("kvbridge.pd_reason", reason)

    def first_token_outcome(self, outcome: str) -> None:
        """continued | finished_at_prefill | decode_failed | no_token."""
        if self._first_token is not None:
            self._first_token = (self._first_token[0], outcome)

    def _end_first_token(self, end_ns: int) -> None:
        if self._first_token is not None:
            start_ns, outcome = self._first_token
            self._first_token = None
            # Not the step before a relay: it ends once the answer's first bytes went out.
            self.tracing.record("proxy.first_token", self.context, start_ns, end_ns,
                                attributes={"kvbridge.outcome": outcome},
                                error=outcome if outcome == "decode_failed" else None)
            if outcome == "no_token":  # the ordinary path's D leg follows
                self.last_end_ns = max(self.last_end_ns, end_ns)

    # ---- the answer going out (ProxyTracingMiddleware) ---------------------------------------
    def response_started(self, status: int) -> None:
        self.status = status

    def body_sent(self, body: bytes, end_ns: int) -> None:
        if body:
            self.chunks += 1
            self.bytes += len(body)
            self.last_body_ns = end_ns
            self.stream_done = body.endswith(STREAM_END)
            self._end_first_token(end_ns)

    def finish(self, end_ns: int, outcome: str | None = None) -> None:
        """The last byte was handed to the server (or the request ended without one): ends
        `proxy.relay`, whatever was left open, and `proxy.request`. Idempotent."""
        if self._finished:
            return
        self._finished = True
        self._end_first_token(end_ns)
        for attempt in list(self.open_attempts):  # abandoned: the client went away, or a bug
            _end(attempt.span, end_ns, "cancelled", True)
        self.open_attempts.clear()
        self.tracing.record("proxy.relay", self.context, min(self.last_end_ns, end_ns), end_ns,
                            attributes=without_none({"kvbridge.chunks": self.chunks, "kvbridge.bytes": self.bytes,
                                                     "http.response.status_code": self.status}))
        if self.status is not None:
            self.request.set_attribute("http.response.status_code", self.status)
        server_error = self.status is None or self.status >= 500
        if outcome is None:
            outcome = "client_gone" if self.status == 499 else "error" if server_error else "ok"
        _end(self.request, end_ns, outcome, server_error)


class ProxyTracingMiddleware:
    """Pure ASGI: traces POSTs to the completion routes from their first byte in to the last
    byte out (the handler adds the children; see the module docstring)."""

    def __init__(self, app: ASGIApp, tracing: Tracing) -> None:
        self.app, self.tracing = app, tracing

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in TRACED_PATHS:
            await self.app(scope, receive, send)
            return
        start_ns = time.time_ns()
        traceparent = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"traceparent"), None)
        spans = RequestSpans(self.tracing, scope["path"], traceparent, start_ns)
        scope[SCOPE_KEY] = spans

        async def traced_send(message: Message) -> None:
            await send(message)
            if message["type"] == "http.response.start":
                spans.response_started(message["status"])
            elif message["type"] == "http.response.body":
                end_ns = time.time_ns()
                spans.body_sent(message.get("body", b""), end_ns)
                if not message.get("more_body", False):
                    spans.finish(end_ns)

        try:
            await self.app(scope, receive, traced_send)
        except BaseException as exc:
            spans.finish(time.time_ns(), outcome=type(exc).__name__)
            raise
        if spans.stream_done:
            # A stream whose [DONE] went out, closed by its client before the empty last message
            # (the openai client does): complete, at its last byte.
            spans.finish(spans.last_body_ns)
        else:  # no-op after the last byte went out
            spans.finish(time.time_ns(), outcome="client_gone" if spans.status is not None else "no_answer")
