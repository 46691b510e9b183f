"""One leg of a request (to P, or to D): attempts on the instances of one pool until one answers
with something the leg can use, retried on another instance after a failure that reached no
client, each attempt counted in its instance's circuit breaker. PDProxy (proxy.py) runs a P leg
and a D leg per request (or one D leg: colocated mode, the decode-only fallback)."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import httpx
from fastapi.responses import Response

from kvbridge.openai_wire import REQUEST_ID_HEADER
from kvbridge.proxy.exchange import Exchange, Exhausted, Failed, RetryPolicy, openai_error
from kvbridge.proxy.metrics import ProxyMetrics
from kvbridge.proxy.releases import NO_KEYS, AttemptKeys
from kvbridge.proxy.routing import KvCosts, Upstream, UpstreamKind, UpstreamPool
from kvbridge.proxy.tracing_spans import NO_LEG, LegSpans

logger = logging.getLogger("kvbridge.proxy.proxy")  # the name these lines logged under before the split
T = TypeVar("T")
FIRST_BYTE_TIMEOUT = "first_byte_timeout"  # the failure's reason (metrics, logs)


class Legs:
    """Runs legs over the proxy's pooled HTTP client (`client`: it, once the proxy started);
    `retry` and `rng` (the backoff's jitter) decide the retries."""

    def __init__(self, client: Callable[[], httpx.AsyncClient], metrics: ProxyMetrics, retry: RetryPolicy,
                 rng: random.Random) -> None:
        self._client, self._metrics, self._retry, self._rng = client, metrics, retry, rng

    async def run(self, pool: UpstreamPool, route: str, body: dict[str, Any], headers: dict[str, str],
                  request_id: str, prompt: str, judge: Callable[[Exchange], Awaitable[T | Failed]], *,
                  first_byte_s: float | None = None, spans: LegSpans = NO_LEG,
                  keys: AttemptKeys = NO_KEYS, costs: KvCosts | None = None) -> T | Exhausted:
        """POST `body` to an instance of `pool` until `judge` makes the leg's result of one's open
        answer. An attempt that failed before anything reached the client (connection, timeout, a
        broken answer, 5xx, or what `judge` calls a failure) is retried on another instance, within
        the retry count and time budget, after a backoff; each attempt counts in its instance's
        breaker (a judged failure whose instance is not at fault as a success). A request that
        could not be sent at all ends the leg at once, counted nowhere. Exhausted: no attempt left,
        or no instance could be tried; its `received` says whether any instance may have received
        the request. `spans` observe the leg; `keys` sign each attempt (P's leg: a fresh release
        key, kept until its answer is read). `first_byte_s`: the status line's deadline. `costs`:
        the fleet view's cost per instance URL (the kv_aware policy's), or None."""
        started = time.monotonic()
        tried: list[Upstream] = []
        received, last, reason = False, None, ""
        for attempt in range(self._retry.retries + 1):
            if attempt:
                retrying = await self._before_retry(pool, tried, attempt, reason, started, request_id)
                spans.backoff_ended(attempt + 1, retrying)
                if not retrying:
                    break
            upstream = pool.pick(exclude=tried, prompt=prompt, costs=costs)
            spans.routed(pool, route, tried, upstream)
            if upstream is None:
                break
            tried.append(upstream)
            span = spans.attempt(upstream, route, attempt + 1)
            sent = await self._attempt(pool, upstream, route, body, keys.sign(upstream, span.headers(headers)),
                                       request_id, first_byte_s)
            received |= isinstance(sent, Exchange) or sent.received
            if isinstance(sent, Failed) and not sent.received:
                keys.read(upstream)  # it never got the request: no lease to end
            result = await judge(sent) if isinstance(sent, Exchange) else sent
            span.end(sent, result)
            if not isinstance(result, Failed):
                pool.record(upstream, True)
                return result
            reason, last = result.reason, result.response
            if result.request_at_fault:  # another instance would fail it the same way; this one is not to blame
                upstream.breaker.on_unsent()
                return Exhausted(last, received, request_at_fault=True)
            if result.instance_at_fault:
                pool.record(upstream, False, reason)
            else:
                pool.record(upstream, True)
        if last is None:
            last = openai_error(503, f"no healthy {pool.kind.value} instance", "no_healthy_instance", request_id)
        return Exhausted(last, received)

    async def read_all(self, exchange: Exchange, request_id: str) -> Response | Failed:
        """The upstream's complete answer, status and body unchanged, or why reading it failed."""
        try:
            content = await exchange.response.aread()
        except httpx.HTTPError as exc:
            return self._failed(exchange.pool.kind, exc, request_id)
        finally:
            await exchange.close()
        return Response(content, status_code=exchange.response.status_code,
                        media_type=exchange.response.headers.get("content-type"),
                        headers={REQUEST_ID_HEADER: request_id})

    def server_error(self, kind: UpstreamKind, answer: Response | Failed) -> Failed | None:
        """`answer` as a failed attempt when it is one (reading it failed, or a 5xx), else None."""
        if isinstance(answer, Failed):
            return answer
        if answer.status_code < 500:
            return None
        self._metrics.upstream_errors.labels(kind.value, "status").inc()
        return Failed(f"status_{answer.status_code}", True, answer)

    async def _attempt(self, pool: UpstreamPool, upstream: Upstream, path: str, body: dict[str, Any],
                       headers: dict[str, str], request_id: str, first_byte_s: float | None) -> Exchange | Failed:
        """POST `body` to `upstream` once: its open response, or why it failed (a connection that
        was refused marks the upstream unhealthy, as a failed health probe does; `first_byte_s`:
        the status line must arrive within this many seconds). A request the HTTP client may not
        send (a header value outside what HTTP/1.1 allows) fails before any byte left: the
        request's own fault (`_unsendable`)."""
        client = self._client()
        try:
            request = client.build_request("POST", upstream.url + path, json=body, headers=headers)
        except (ValueError, TypeError) as exc:  # a header or body that cannot be encoded (UnicodeEncodeError)
            return self._unsendable(pool.kind, exc, request_id)
        upstream.outstanding += 1
        try:
            sent = client.send(request, stream=True)
            response = await (sent if first_byte_s is None else asyncio.wait_for(sent, first_byte_s))
        except BaseException as exc:
            upstream.outstanding -= 1
            if isinstance(exc, TimeoutError):  # wait_for's (httpx's own timeouts are HTTPErrors)
                return self._silent(pool.kind, upstream, first_byte_s, request_id)
            if isinstance(exc, httpx.LocalProtocolError):  # h11 refused to write the request
                return self._unsendable(pool.kind, exc, request_id)
            if not isinstance(exc, httpx.HTTPError):
                raise
            if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)):
                self._metrics.upstream_errors.labels(pool.kind.value, "connect").inc()
                pool.set_health(upstream, False, f"connection failed: {exc!r}")
                return Failed("connect", False, openai_error(
                    502, f"could not connect to {pool.kind.value} instance {upstream.url}", "upstream_unreachable",
                    request_id))
            return self._failed(pool.kind, exc, request_id)
        return Exchange(pool, upstream, response)

    def _unsendable(self, kind: UpstreamKind, exc: Exception, request_id: str) -> Failed:
        """A request the proxy's HTTP client refused to send: the client's 400, never an
        instance's failure. The exception's text is not repeated: it may hold a header's value (a key)."""
        logger.warning("request %s: could not be sent to a %s instance (%s); answered 400", request_id, kind.value,
                       type(exc).__name__)
        return Failed("unsendable_request", False, openai_error(
            400, f"the request could not be forwarded as sent ({type(exc).__name__}): a header value holds what "
                 "HTTP/1.1 does not allow", "unsendable_request", request_id),
                      instance_at_fault=False, request_at_fault=True)

    def _silent(self, kind: UpstreamKind, upstream: Upstream, after_s: float | None, request_id: str) -> Failed:
        """An upstream that took the request and sent no status line in time (stopped, hung): a
        failed attempt that may have reached it."""
        self._metrics.upstream_errors.labels(kind.value, FIRST_BYTE_TIMEOUT).inc()
        logger.warning("request %s: %s instance %s sent no answer in %s s", request_id, kind.value, upstream.url,
                       after_s)
        return Failed(FIRST_BYTE_TIMEOUT, True, openai_error(
            504, f"{kind.value} instance {upstream.url} did not start answering in {after_s} s", "upstream_timeout",
            request_id))

    def _failed(self, kind: UpstreamKind, exc: httpx.HTTPError, request_id: str) -> Failed:
        """An upstream that may have received the request failed: the client's answer if it is
        the last attempt (504 for a timeout, else 502)."""
        timed_out = isinstance(exc, httpx.TimeoutException)
        reason = "timeout" if timed_out else "protocol"
        self._metrics.upstream_errors.labels(kind.value, reason).inc()
        logger.warning("request %s: %s instance failed: %r", request_id, kind.value, exc)
        if timed_out:
            return Failed(reason, True, openai_error(504, f"{kind.value} instance timed out", "upstream_timeout",
                                                      request_id))
        return Failed(reason, True, openai_error(502, f"{kind.value} instance failed: {exc!r}", "upstream_failed",
                                                  request_id))

    async def _before_retry(self, pool: UpstreamPool, tried: list[Upstream], attempt: int, reason: str,
                            started: float, request_id: str) -> bool:
        """Wait out the backoff before attempt `attempt` (1 = the first retry); False when the
        retry count or time budget is spent or no other instance is left to try."""
        policy, kind = self._retry, pool.kind
        delay = policy.delay(attempt - 1, self._rng)
        if (attempt > policy.retries or time.monotonic() + delay - started > policy.budget_s
                or not pool.can_pick(exclude=tried)):
            return False
        self._metrics.retries.labels(kind.value, reason).inc()
        logger.warning("request %s: %s attempt failed (%s); retry %d of %d in %.3f s on another instance",
                       request_id, kind.value, reason, attempt, policy.retries, delay)
        await asyncio.sleep(delay)
        return True
