"""The proxy's spans (issue 30; docs: the span contract): one `proxy.request` per client request
and children that tile it, from its first byte in to its last byte out:

  proxy.read_body    the request's ASGI dispatch, authorisation, body read and JSON parsing
  proxy.route        one per routing decision (which P or D an attempt goes to)
  proxy.attempt      one per upstream attempt (CLIENT); the `traceparent` sent upstream names it
  proxy.backoff      the wait before a retry
  proxy.first_token  the first-token path: P's answer -> its token's events handed to the server
  proxy.release      asking P to free a request's KV
  proxy.relay        the answer in hand -> its last byte handed to the server

`ProxyTracingMiddleware` (a pure ASGI middleware, installed only when tracing is on) starts
`proxy.request` before FastAPI dispatches the request, sees the answer's bytes go out, and ends
the request's spans at the last one. A step starts where the one before it ended
(`last_end_ns`: the request read, a route, an attempt, a backoff, P's leg), so the proxy's own
work between two steps (the event loop's turn, recording a span) is in the next one and the
children leave no gap; `read_body` starts with the request, the relay ends with it. The handler
finds the request's `RequestSpans` with `request_spans(request, request_id)`: None when tracing
is off, and then nothing here runs.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable
from typing import TypeVar
from urllib.parse import urlsplit

from fastapi import Request
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from kvbridge.proxy.exchange import Exchange, Failed
from kvbridge.proxy.routing import PrefixAffinityPolicy, Upstream, UpstreamPool
from kvbridge.tracing import TRACEPARENT_HEADER, Tracing, format_traceparent, parse_traceparent, without_none
from kvbridge.tracing.core import Attributes

T = TypeVar("T")
SCOPE_KEY = "kvbridge.proxy_spans"  # the ASGI scope's entry holding the request's RequestSpans
TRACED_PATHS = ("/v1/completions", "/v1/chat/completions")
STREAM_END = b"data: [DONE]\n\n"  # the last event of a streamed answer


def request_spans(request: Request, request_id: str) -> RequestSpans | None:
    """The request's spans (None: tracing off); names the request id on `proxy.request`."""
    spans = request.scope.get(SCOPE_KEY)
    if spans is not None:
        spans.request.set_attribute("kvbridge.request_id", request_id)
    return spans


def _server(url: str) -> dict[str, object]:
    parts = urlsplit(url)
    return {"server.address": parts.hostname, "server.port": parts.port}


def _end(span: Span, end_ns: int, outcome: str, error: bool) -> None:
    span.set_attribute("kvbridge.outcome", outcome)
    if error:
        span.set_status(Status(StatusCode.ERROR, outcome))
    span.end(end_time=end_ns)


class AttemptSpan:
    """One live `proxy.attempt`; `headers` are the attempt's, naming it in `traceparent`."""

    def __init__(self, owner: RequestSpans, span: Span, headers: dict[str, str]) -> None:
        self._owner, self.span = owner, span
        traceparent = format_traceparent(span.get_span_context())
        self.headers = headers if traceparent is None else {**headers, TRACEPARENT_HEADER: traceparent}

    def end(self, sent: Exchange | Failed, result: object) -> None:
        """The attempt's verdict: `sent` what the upstream answered, `result` the leg's judgement."""
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


class Leg:
    """The spans of one leg (P, D, or D alone) of a request: its routes, attempts and backoffs."""

    def __init__(self, owner: RequestSpans, role: str) -> None:
        self.owner, self.role = owner, role

    def pick(self, pool: UpstreamPool, path: str, exclude: list[Upstream], prompt: str) -> Upstream | None:
        """`pool.pick`, recorded as `proxy.route`."""
        start_ns = self.owner.last_end_ns
        chosen = pool.pick(exclude=exclude, prompt=prompt)
        attributes: dict[str, object] = {"kvbridge.role": self.role, "kvbridge.policy": pool.policy.name,
                                         "kvbridge.excluded": len(exclude)}
        if chosen is not None:
            attributes.update(_server(chosen.url), **{"url.full": chosen.url + path})
            if isinstance(pool.policy, PrefixAffinityPolicy):
                attributes["kvbridge.prefix_match_blocks"] = pool.policy.last_match_blocks
        attributes["kvbridge.outcome"] = "chosen" if chosen is not None else "no_instance"
        self.owner.record("proxy.route", start_ns, time.time_ns(), attributes)
        return chosen

    def attempt(self, upstream: Upstream, path: str, number: int, headers: dict[str, str]) -> AttemptSpan:
        """A live `proxy.attempt` (number: 1-based), from its route's end."""
        url = upstream.url + path
        span = self.owner.tracing.start_span(
            "proxy.attempt", self.owner.context, kind=SpanKind.CLIENT, start_ns=self.owner.last_end_ns,
            attributes=without_none({
                "kvbridge.role": self.role, "kvbridge.attempt": number, "url.full": url,
                "http.request.method": "POST", **_server(upstream.url)}))
        attempt = AttemptSpan(self.owner, span, headers)
        self.owner.open_attempts.append(attempt)
        return attempt

    async def backoff(self, number: int, waiting: Awaitable[bool]) -> bool:
        """The wait before attempt `number` (`waiting`: True when it is to be made), as `proxy.backoff`
        from the failed attempt's end."""
        start_ns = self.owner.last_end_ns
        retrying = await waiting
        self.owner.record("proxy.backoff", start_ns, time.time_ns(), {
            "kvbridge.role": self.role, "kvbridge.attempt": number,
            "kvbridge.outcome": "retry" if retrying else "no_retry"})
        return retrying


class RequestSpans:
    """One traced client request: the live `proxy.request` and what its children need."""

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

    def record(self, name: str, start_ns: int, end_ns: int, attributes: Attributes, *,
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

    async def timed(self, name: str, work: Awaitable[T], attributes: Attributes) -> T:
        """`work`'s result, its time recorded as span `name`."""
        start_ns = time.time_ns()
        result = await work
        self.record(name, start_ns, time.time_ns(), attributes)
        return result

    def first_token_started(self) -> None:
        """The first-token path starts (P's answer in hand): `proxy.first_token` runs until the
        answer's first bytes are handed to the server (`first_token_outcome` names how it ended)."""
        self._first_token = (self.last_end_ns, "planned")  # from P's leg's end

    def first_token_planned(self, planned: bool) -> None:
        """Without a plan (P offered no token, or a context length unknown) the path ends now."""
        if not planned:
            self.first_token_outcome("no_token")
            self._end_first_token(time.time_ns())

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

    def __init__(self, app, tracing: Tracing) -> None:
        self.app, self.tracing = app, tracing

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in TRACED_PATHS:
            await self.app(scope, receive, send)
            return
        start_ns = time.time_ns()
        traceparent = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"traceparent"), None)
        spans = RequestSpans(self.tracing, scope["path"], traceparent, start_ns)
        scope[SCOPE_KEY] = spans

        async def traced_send(message) -> None:
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
