"""The proxy's pieces around one upstream exchange: how an attempt failed (`Failed`), a leg with
no attempt left (`Exhausted`), how a leg is retried (`RetryPolicy`), an open upstream response
(`Exchange`), D's stream passed through to the client (`PassthroughStream`), and the error
answers the proxy makes itself (`openai_error`). PDProxy (proxy.py) decides what to do with them."""

from __future__ import annotations

import json
import logging
import random
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import httpx
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from kvbridge.openai_wire import REQUEST_ID_HEADER, ErrorInfo, ErrorResponse, error_type
from kvbridge.proxy.routing import Upstream, UpstreamPool

logger = logging.getLogger("kvbridge.proxy.proxy")


def openai_error(status: int, message: str, code: str | None, request_id: str | None = None,
                 param: str | None = None) -> JSONResponse:
    """OpenAI's error body, typed like the API server's (invalid_request_error / server_error)."""
    body = ErrorResponse(error=ErrorInfo(message=message, type=error_type(status), param=param,
                                         code=code)).model_dump()
    headers = {REQUEST_ID_HEADER: request_id} if request_id else None
    return JSONResponse(body, status_code=status, headers=headers)


@dataclass(frozen=True)
class Failed:
    """One upstream attempt failed before anything reached the client."""

    reason: str  # connect | timeout | protocol | status_5xx | ... (the retry metric's label)
    received: bool  # the upstream may have received the request
    response: Response  # the client's answer if no further attempt succeeds
    # the upstream's breaker counts a failure; False: it answered, but nothing the leg can use
    # (a prefill answer without kv_transfer_params)
    instance_at_fault: bool = True
    # the request itself could not be sent (a header value the HTTP client refuses): every
    # instance would fail it the same way, so it is not retried and `response` is a 4xx
    request_at_fault: bool = False


@dataclass(frozen=True)
class Exhausted:
    """Every attempt of a leg failed, or no instance could be tried: `response` is the client's
    answer unless a fallback serves; `received`: an instance may have received the request (then
    P's KV is not released: that D may be reading it); `request_at_fault`: the leg stopped at a
    request that could not be sent (Failed.request_at_fault): no fallback serves it either."""

    response: Response
    received: bool
    request_at_fault: bool = False


@dataclass(frozen=True)
class RetryPolicy:
    """How the proxy retries a leg (prefill or decode) on another instance. `retries` attempts
    after the first at most, none starting later than `budget_s` after the leg began; before
    retry k (0-based) it waits uniform(0, min(backoff_max_s, backoff_s * 2**k)) ("full jitter").
    `decode_only_fallback`: when no P could prefill, D serves the request as an ordinary one."""

    retries: int = 3
    budget_s: float = 30.0
    backoff_s: float = 0.05
    backoff_max_s: float = 1.0
    decode_only_fallback: bool = True

    def __post_init__(self) -> None:
        if self.retries < 0 or self.budget_s < 0 or self.backoff_s < 0 or self.backoff_max_s < 0:
            raise ValueError("retries, budget and backoff must be >= 0")

    def delay(self, retry: int, rng: random.Random) -> float:
        return rng.uniform(0.0, min(self.backoff_max_s, self.backoff_s * 2 ** retry))


class Exchange:
    """One open upstream response; close() is idempotent and frees the outstanding slot."""

    def __init__(self, pool: UpstreamPool, upstream: Upstream, response: httpx.Response) -> None:
        self.pool, self.upstream, self.response = pool, upstream, response
        self._closed = False

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.upstream.outstanding -= 1
        await self.response.aclose()


class UsageTap:
    """Watches a passing SSE stream for its first event that reports cached prompt tokens (the usage
    event a client asks for with stream_options.include_usage) and hands its JSON to `observe`, once;
    holds back no byte: it keeps only the part of an event still arriving (at most MAX_EVENT_BYTES)."""

    MAX_EVENT_BYTES = 1 << 20

    def __init__(self, observe: Callable[[bytes], None]) -> None:
        self._observe = observe
        self._tail = b""
        self.done = False

    def feed(self, chunk: bytes) -> None:
        if self.done:
            return
        *events, tail = (self._tail + chunk).split(b"\n\n")
        self._tail = tail if len(tail) <= self.MAX_EVENT_BYTES else b""
        for event in events:
            if b'"cached_tokens"' not in event:
                continue
            for line in event.split(b"\n"):
                if line.startswith(b"data: "):
                    self.done = True
                    self._observe(line[len(b"data: "):])
                    return


class PassthroughStream(StreamingResponse):
    """Streams D's bytes as they arrive; closes D's response however the stream ends,
    so a client that goes away makes D abort the request and free its blocks. `tap`: sees D's
    bytes as they pass (the router's check of its cached-tokens prediction)."""

    def __init__(self, exchange: Exchange, request_id: str, first: bytes = b"", tap: UsageTap | None = None) -> None:
        self._exchange = exchange
        self._request_id = request_id
        self._tap = tap
        self._first = first  # sent before D's bytes: the events for P's token (first_token.py)
        super().__init__(self._chunks(), status_code=exchange.response.status_code,
                         media_type=exchange.response.headers.get("content-type", "text/event-stream"),
                         headers={REQUEST_ID_HEADER: request_id})

    async def _chunks(self) -> AsyncIterator[bytes]:
        try:
            if self._first:
                yield self._first
            async for chunk in self._exchange.response.aiter_raw():
                if self._tap is not None:
                    self._tap.feed(chunk)
                yield chunk
        except httpx.HTTPError as exc:
            # Headers are gone already: tell the client in-band instead of truncating silently.
            logger.warning("request %s: decode stream from %s broke: %r", self._request_id,
                           self._exchange.upstream.url, exc)
            error = ErrorResponse(error=ErrorInfo(message=f"decode instance stream failed: {exc!r}",
                                                  type="server_error", code="upstream_failed"))
            yield f"data: {json.dumps(error.model_dump())}\n\n".encode()
        finally:
            await self._exchange.close()

    async def close(self) -> None:
        """Close D's response without sending it (a prompt list's sibling failed): D aborts."""
        await self._exchange.close()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._exchange.close()
