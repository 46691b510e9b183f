"""The P/D proxy: one OpenAI-compatible front that routes each request to a prefill
instance (P), then to a decode instance (D), and streams D's answer back.

Life of a request (docs: ARCHITECTURE.md, "The life of a P/D request"):
  1. pick a healthy P and a healthy D (routing.py: pools and selection policies;
     503 if either kind has none);
  2. POST to P the client's body with max_tokens=1, stream=false, n=1 and
     kv_transfer_params={"do_remote_decode": true}; P's errors go back unchanged;
  3. POST to D the client's original body plus P's response `kv_transfer_params`;
     D's answer (JSON or SSE, success or error) goes back unchanged, streamed as it comes.
Both upstream calls carry the same `X-Request-Id` (the client's, else a new one).
With `stream: true`, P's sampled token goes to the client as soon as D accepted the request,
and D continues from it (first_token.py: first token straight from prefill).
The FastAPI app and the server runner around PDProxy are in app.py.

Colocated mode (no prefill URLs): each request goes straight to a decode-list instance
(a plain `kvbridge serve`), its body unchanged but for any client `kv_transfer_params`,
which are dropped as in P/D mode (only the proxy sets them). Everything else — client,
selection, health, SSE passthrough, errors — is the same code path; it is the baseline
that P/D latency is compared with (benchmarks/pd_ttft.py).

Release contract (the API server must implement it on P):
  `POST {P}/kvbridge/release_kv` with JSON `{"kv_transfer_params": <P's response params>}`
  and the request's `X-Request-Id`. P frees the blocks it holds for
  `remote_request_id` at once (idempotent; unknown ids answer 200 or 404, never 5xx).
The proxy calls it only when it knows no D received the request (no healthy D, or
every D refused the connection): if D may have received it, D may be reading those
blocks, and only D (its notification) or P's lease may free them.
Each P attempt also carries a fresh random `X-KVBridge-Release-Key`; an attempt whose
answer the proxy never read whole (the client left, the connection broke mid-read) is
released by `{"release_key": K}` in the background, since nobody can have its params
(server/undelivered.py: P's side of it, and P's own release of answers it could not write).
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import logging
import random
import re
import secrets
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import TypeVar

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvbridge.kv_transfer.params import KV_LOAD_FAILED
from kvbridge.openai_wire import (MAX_BODY_BYTES, RELEASE_KEY_HEADER, REQUEST_ID_HEADER, ErrorInfo, ErrorResponse,
                                  error_type, parse_json_object, read_capped, usable_request_id)
from kvbridge.proxy import first_token, tracing_spans
from kvbridge.proxy.exchange import Exchange, Exhausted, Failed, PassthroughStream, RetryPolicy
from kvbridge.proxy.routing import Upstream, UpstreamKind, UpstreamPool
from kvbridge.proxy.tracing_spans import Leg, RequestSpans
from kvbridge.tracing import Tracing

logger = logging.getLogger(__name__)
T = TypeVar("T")
Prefilled = tuple[Upstream, dict, bytes]  # step 1's result: P, its kv_transfer_params, its whole answer

RELEASE_PATH = "/kvbridge/release_kv"
# How long a decode instance may take to start a streamed answer (its status line, sent once it
# admitted the request): a stopped or hung one fails the attempt rather than holding it for the
# whole timeout. Admission waits for the engine's current step and tokenises the prompt: seconds.
FIRST_BYTE_TIMEOUT_S = 30.0
FIRST_BYTE_TIMEOUT = "first_byte_timeout"  # the failure's reason (metrics, logs)
UPSTREAM_KEEPALIVE_S = 2.0
BAD_KEY_MESSAGE = "Incorrect or missing API key. Send 'Authorization: Bearer <key>'."


class ProxyMetrics:
    """Prometheus metrics in a registry of the app's own (several apps may share a process)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvbridge_proxy_requests", "Client requests by route and status",
                                ["route", "status"], registry=r)
        self.upstream_errors = Counter("kvbridge_proxy_upstream_errors",
                                       "Failed upstream calls by kind and reason", ["kind", "reason"], registry=r)
        self.kv_releases = Counter("kvbridge_proxy_kv_releases",
                                   "Release calls sent to P by outcome", ["outcome"], registry=r)
        self.prefill_seconds = Histogram("kvbridge_proxy_prefill_seconds", "Time for P to answer", registry=r)
        self.retries = Counter("kvbridge_proxy_retries", "Upstream attempts retried on another instance, by kind "
                               "and the failure that caused the retry", ["kind", "reason"], registry=r)
        self.decode_only_fallback = Counter("kvbridge_proxy_decode_only_fallback",
                                            "Requests served by a decode instance alone because no prefill "
                                            "instance could prefill them", registry=r)
        self.first_token = Counter("kvbridge_proxy_first_token_from_prefill",
                                   "Streamed requests whose first token came straight from prefill, by whether "
                                   "decode continued them or prefill's token finished them", ["outcome"],
                                   registry=r)
        for outcome in ("continued", "finished_at_prefill"):
            self.first_token.labels(outcome)  # exported at 0 from the start
        self.circuit = Gauge("kvbridge_proxy_circuit_state", "Circuit breaker per upstream: 0 closed, 1 half-open, "
                             "2 open", ["kind", "url"], registry=r)
        # Gauges are set from the pools at scrape time (PDProxy.refresh_gauges).
        self.healthy = Gauge("kvbridge_proxy_healthy_instances", "Healthy instances by kind", ["kind"], registry=r)
        self.outstanding = Gauge("kvbridge_proxy_outstanding_requests", "In-flight upstream requests by kind",
                                 ["kind"], registry=r)


def openai_error(status: int, message: str, code: str, request_id: str | None = None) -> JSONResponse:
    """OpenAI's error body, typed like the API server's (invalid_request_error / server_error)."""
    body = ErrorResponse(error=ErrorInfo(message=message, type=error_type(status), code=code)).model_dump()
    headers = {REQUEST_ID_HEADER: request_id} if request_id else None
    return JSONResponse(body, status_code=status, headers=headers)


def _error_code(answer: Response) -> str | None:
    """The `error.code` of an upstream's OpenAI-style error body, or None."""
    try:
        error = parse_json_object(answer.body).get("error")
    except ValueError:
        return None
    return error.get("code") if isinstance(error, dict) else None


def prefill_body(body: dict) -> dict:
    """The body sent to P: one token, no streaming, one sample, asking P to keep the KV."""
    out = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens", "best_of")}
    out.update(max_tokens=1, stream=False, n=1, kv_transfer_params={"do_remote_decode": True})
    if "max_completion_tokens" in body:
        out["max_completion_tokens"] = 1
    return out


def prompt_text(body: dict) -> str:
    """The request's prompt as text, for prefix-affinity routing: a completion's prompt (token
    ids as their decimal list; the first of a batch), or a chat's messages as `role: content`
    lines (text parts of multi-part contents). Empty when there is none."""
    prompt = body.get("prompt")
    if prompt is None and isinstance(body.get("messages"), list):
        lines = []
        for m in body["messages"]:
            if not isinstance(m, dict):
                continue
            content = m.get("content")
            if isinstance(content, list):
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict)
                                  and isinstance(p.get("text", ""), str))
            lines.append(f"{m.get('role', '')}: {content if isinstance(content, str) else ''}\n")
        return "".join(lines)
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch: route by its first prompt
    if isinstance(prompt, list):
        return ",".join(str(t) for t in prompt)
    return prompt if isinstance(prompt, str) else ""


def _kv_transfer_params(body: bytes) -> dict | None:
    try:
        params = json.loads(body).get("kv_transfer_params")
    except (ValueError, AttributeError):
        return None
    return params if isinstance(params, dict) else None


# A header value the proxy's HTTP client sends: visible ASCII, single runs of spaces or tabs
# inside (h11 refuses control characters and whitespace at either end, httpx anything outside ASCII).
_SENDABLE_HEADER_VALUE = re.compile(r"[\x21-\x7e]+(?:[ \t]+[\x21-\x7e]+)*")


def forwardable(value: str | None) -> str | None:
    """A client's header value as the proxy forwards it: without the spaces and tabs around it
    (they are not part of a field's value, RFC 9110 5.5; some servers' parsers keep trailing
    ones: lm-eval sends `Bearer ` when it has no key); None, not forwarded, when nothing is left
    or it holds what the proxy's HTTP client may not send (a control character, a byte outside ASCII)."""
    if value is None:
        return None
    value = value.strip(" \t")
    return value if _SENDABLE_HEADER_VALUE.fullmatch(value) else None


class UnreadAnswers:
    """One P leg's release keys (server/undelivered.py): each attempt sends a fresh random key; an
    attempt whose answer was not read whole (the leg was cancelled, the connection broke) may have
    left a lease on its P that nobody will learn of, and the key lets the proxy end it. A leg
    tries each P at most once."""

    def __init__(self) -> None:
        self._keys: dict[str, tuple[Upstream, str]] = {}

    def new(self, upstream: Upstream) -> dict[str, str]:
        """The headers of a new attempt on `upstream`."""
        key = secrets.token_hex(16)
        self._keys[upstream.url] = (upstream, key)
        return {RELEASE_KEY_HEADER: key}

    def read(self, upstream: Upstream) -> None:
        """The attempt's answer was read whole (or it never reached `upstream`): nothing to end."""
        self._keys.pop(upstream.url, None)

    def unread(self) -> list[tuple[Upstream, str]]:
        return list(self._keys.values())


class PDProxy:
    """Routes requests over two pools (or only the decode pool: colocated mode, `prefill`
    None); owns the pooled HTTP client and the health loop."""

    def __init__(self, prefill: UpstreamPool | None, decode: UpstreamPool, *, health_interval_s: float,
                 health_timeout_s: float, timeout_s: float, connect_timeout_s: float,
                 api_key: str | None, upstream_api_key: str | None, retry: RetryPolicy = RetryPolicy(),
                 seed: int | None = None, first_token_from_prefill: bool = True,
                 max_body_bytes: int = MAX_BODY_BYTES, first_byte_timeout_s: float = FIRST_BYTE_TIMEOUT_S,
                 tracing: Tracing | None = None,
                 wrap_transport: Callable[[httpx.AsyncBaseTransport], httpx.AsyncBaseTransport] | None = None) -> None:
        """`wrap_transport`: wraps the upstream connections' transport (tests inject faults there)."""
        if max_body_bytes < 1 or first_byte_timeout_s <= 0:
            raise ValueError("max_body_bytes and first_byte_timeout_s must be positive")
        self.prefill, self.decode = prefill, decode
        self.tracing = tracing  # None: no spans
        self.max_body_bytes = max_body_bytes
        self.first_byte_timeout_s = first_byte_timeout_s
        self.first_token_from_prefill = first_token_from_prefill
        self.retry = retry
        self._rng = random.Random(seed)  # backoff jitter
        self.metrics = ProxyMetrics()
        self.health_interval_s, self.health_timeout_s = health_interval_s, health_timeout_s
        self.timeout = httpx.Timeout(timeout_s, connect=connect_timeout_s)
        # Release calls and /v1/models do no model work: they get a short bound.
        self.short_timeout = httpx.Timeout(min(timeout_s, 10.0), connect=connect_timeout_s)
        self.api_key, self.upstream_api_key = api_key, upstream_api_key
        self.wrap_transport = wrap_transport
        self.client: httpx.AsyncClient | None = None
        self._health_task: asyncio.Task | None = None
        self._background: set[asyncio.Future] = set()  # releases outliving their request

    @property
    def pools(self) -> tuple[UpstreamPool, ...]:
        """The configured pools, prefill first (decode only in colocated mode)."""
        return (self.decode,) if self.prefill is None else (self.prefill, self.decode)

    # ---- lifecycle -------------------------------------------------------------------
    async def start(self) -> None:
        """Open the client and run one health round before serving, then poll in the background."""
        # trust_env=False: an HTTP(S)_PROXY variable must never reroute upstream calls.
        transport: httpx.AsyncBaseTransport = httpx.AsyncHTTPTransport(
            trust_env=False, limits=httpx.Limits(max_connections=None, max_keepalive_connections=64,
                                                 # below uvicorn's 5 s keep-alive: never reuse a
                                                 # connection the upstream is closing
                                                 keepalive_expiry=UPSTREAM_KEEPALIVE_S))
        if self.wrap_transport is not None:
            transport = self.wrap_transport(transport)
        self.client = httpx.AsyncClient(timeout=self.timeout, trust_env=False, transport=transport)
        await self.check_health_once()
        self._health_task = asyncio.create_task(self._health_loop(), name="kvbridge-proxy-health")

    async def stop(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            await asyncio.gather(self._health_task, return_exceptions=True)
        if self._background:  # each bounded by the short timeout
            await asyncio.gather(*self._background, return_exceptions=True)
        if self.client is not None:
            await self.client.aclose()

    # ---- health ----------------------------------------------------------------------
    async def check_health_once(self) -> None:
        probes = [self._probe(pool, u) for pool in self.pools for u in pool.upstreams]
        await asyncio.gather(*probes)

    async def _probe(self, pool: UpstreamPool, upstream: Upstream) -> None:
        assert self.client is not None
        try:
            r = await self.client.get(upstream.url + "/health", timeout=self.health_timeout_s,
                                      headers=self._auth_headers(None))
            pool.set_health(upstream, r.status_code == 200, f"/health answered {r.status_code}")
        except httpx.HTTPError as exc:
            pool.set_health(upstream, False, f"/health failed: {exc!r}")

    async def set_members(self, kind: UpstreamKind, urls: list[str]) -> None:
        """A dynamic pool's instances are now `urls` (routing.UpstreamPool.set_members): the
        new ones are probed at once, so one that is healthy takes traffic without waiting for the
        next health round; one that left is picked no more."""
        pool = self.decode if kind is UpstreamKind.DECODE else self.prefill
        if pool is None:
            raise ValueError("colocated mode has no prefill pool")
        added, _removed = pool.set_members(urls)
        if added and self.client is not None:
            await asyncio.gather(*(self._probe(pool, u) for u in added))

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            try:
                await self.check_health_once()
            except Exception:  # the loop must outlive any one bad round
                logger.exception("health check round failed")

    def refresh_gauges(self) -> None:
        for pool in self.pools:
            self.metrics.healthy.labels(pool.kind.value).set(len(pool.healthy()))
            self.metrics.outstanding.labels(pool.kind.value).set(sum(u.outstanding for u in pool.upstreams))
            for u in pool.upstreams:
                self.metrics.circuit.labels(pool.kind.value, u.url).set(u.breaker.state.gauge)

    def health_report(self) -> tuple[bool, dict]:
        report = {kind.value: [] for kind in UpstreamKind}
        for pool in self.pools:
            report[pool.kind.value] = [{"url": u.url, "healthy": u.healthy, "outstanding": u.outstanding,
                                        "circuit": u.breaker.state.value} for u in pool.upstreams]
        ok = all(pool.healthy() for pool in self.pools)
        mode = "colocated" if self.prefill is None else "pd"
        return ok, {"status": "ok" if ok else "unavailable", "mode": mode, **report}

    # ---- requests --------------------------------------------------------------------
    def _auth_headers(self, client_request: Request | None) -> dict[str, str]:
        """The upstream key, else the client's Authorization as `forwardable` makes it (without
        --api-key an instance takes any value; one that cannot be sent goes on as none)."""
        if self.upstream_api_key:
            return {"Authorization": f"Bearer {self.upstream_api_key}"}
        given = None if client_request is None else forwardable(client_request.headers.get("authorization"))
        return {"Authorization": given} if given else {}

    def authorized(self, request: Request) -> bool:
        """Whether the client's Authorization (without the whitespace around it) names the proxy's key."""
        if not self.api_key:
            return True
        given = request.headers.get("authorization", "").strip(" \t")
        return hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode())

    async def _attempt(self, pool: UpstreamPool, upstream: Upstream, path: str, body: dict,
                       headers: dict[str, str], request_id: str,
                       first_byte_s: float | None = None) -> Exchange | Failed:
        """POST `body` to `upstream` once: its open response, or why it failed (a connection that
        was refused marks the upstream unhealthy, as a failed health probe does; `first_byte_s`:
        the status line must arrive within this many seconds). A request the HTTP client may not
        send (a header value outside what HTTP/1.1 allows) fails before any byte left: the
        request's own fault (`_unsendable`)."""
        assert self.client is not None
        try:
            request = self.client.build_request("POST", upstream.url + path, json=body, headers=headers)
        except (ValueError, TypeError) as exc:  # a header or body that cannot be encoded (UnicodeEncodeError)
            return self._unsendable(pool.kind, exc, request_id)
        upstream.outstanding += 1
        try:
            sent = self.client.send(request, stream=True)
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
                self.metrics.upstream_errors.labels(pool.kind.value, "connect").inc()
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
        self.metrics.upstream_errors.labels(kind.value, FIRST_BYTE_TIMEOUT).inc()
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
        self.metrics.upstream_errors.labels(kind.value, reason).inc()
        logger.warning("request %s: %s instance failed: %r", request_id, kind.value, exc)
        if timed_out:
            return Failed(reason, True, openai_error(504, f"{kind.value} instance timed out", "upstream_timeout",
                                                      request_id))
        return Failed(reason, True, openai_error(502, f"{kind.value} instance failed: {exc!r}", "upstream_failed",
                                                  request_id))

    async def _read_all(self, exchange: Exchange, request_id: str) -> Response | Failed:
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

    async def _before_retry(self, pool: UpstreamPool, tried: list[Upstream], attempt: int, reason: str,
                            started: float, request_id: str) -> bool:
        """Wait out the backoff before attempt `attempt` (1 = the first retry); False when the
        retry count or time budget is spent or no other instance is left to try."""
        policy, kind = self.retry, pool.kind
        delay = policy.delay(attempt - 1, self._rng)
        if (attempt > policy.retries or time.monotonic() + delay - started > policy.budget_s
                or not pool.can_pick(exclude=tried)):
            return False
        self.metrics.retries.labels(kind.value, reason).inc()
        logger.warning("request %s: %s attempt failed (%s); retry %d of %d in %.3f s on another instance",
                       request_id, kind.value, reason, attempt, policy.retries, delay)
        await asyncio.sleep(delay)
        return True

    async def handle(self, request: Request, route: str) -> Response:
        """Serve one completions or chat-completions request through P then D (colocated
        mode: straight to a decode-list instance)."""
        given = request.headers.get(REQUEST_ID_HEADER)
        request_id = given if usable_request_id(given) else f"kvb-{uuid.uuid4().hex}"
        trace = tracing_spans.request_spans(request, request_id)  # None: tracing off
        try:
            if not self.authorized(request):
                return openai_error(401, BAD_KEY_MESSAGE, "invalid_api_key", request_id)
            try:
                raw = await _read_body(request, self.max_body_bytes)
            except ClientDisconnect:  # gone mid-body: nothing was sent anywhere, nobody reads an answer
                return Response(status_code=499)
            if raw is None:
                return openai_error(413, f"the request body is larger than {self.max_body_bytes} bytes",
                                    "request_too_large", request_id)
            try:  # strict: what parses here can be forwarded (no NaN, no lone surrogate, no deep nesting)
                body = parse_json_object(raw)
            except ValueError as exc:
                return openai_error(400, str(exc), "invalid_json", request_id)
        finally:
            if trace is not None:
                trace.body_read()
        body.pop(first_token.CONTINUE_FIELD, None)  # like kv_transfer_params: only the proxy sets it
        for pool in self.pools:
            if pool is self.prefill and self.retry.decode_only_fallback:
                continue  # no healthy P: the decode-only fallback serves it
            if not pool.healthy():  # checked before P works, so no KV is held for nothing
                return openai_error(503, f"no healthy {pool.kind.value} instance", "no_healthy_instance",
                                    request_id)
        headers = {REQUEST_ID_HEADER: request_id, "Accept-Encoding": "identity", **self._auth_headers(request)}
        gone = asyncio.Event()
        watcher = asyncio.create_task(_watch_disconnect(request, gone))
        try:  # the watcher must stop before a StreamingResponse listens to the client itself
            if self.prefill is None:
                answer = await _unless(gone, self._decode(route, body, headers, request_id, None, trace=trace))
                return answer if answer is not None else Response(status_code=499)
            prefilled = await _unless(gone, self._prefill(route, body, headers, request_id, trace))
            if prefilled is None or gone.is_set():
                return await self._gone_before_decode(prefilled, headers, request_id, trace)
            if isinstance(prefilled, Exhausted):
                if not self.retry.decode_only_fallback or prefilled.request_at_fault:
                    return prefilled.response
                self.metrics.decode_only_fallback.inc()
                logger.warning("request %s: no prefill instance could serve it; decode-only fallback", request_id)
                answer = await _unless(gone, self._decode(route, body, headers, request_id, None, trace=trace))
                return answer if answer is not None else Response(status_code=499)
            if isinstance(prefilled, Response):
                return prefilled
            upstream, params, p_answer = prefilled
            plan = await self._first_token_plan(body, route, upstream, params, p_answer, headers, trace)
            if gone.is_set():  # left while the first-token plan was made
                return await self._gone_before_decode(prefilled, headers, request_id, trace)
            if plan is not None and plan.finished:
                self.metrics.first_token.labels("finished_at_prefill").inc()
                if trace is not None:
                    trace.first_token_outcome("finished_at_prefill")
                await asyncio.shield(self.release_on_prefill(upstream, params, headers, request_id, trace))
                return Response(plan.events, media_type="text/event-stream", headers={REQUEST_ID_HEADER: request_id})
            # A cancelled D call closes its connection, so D aborts and frees through its own path.
            answer = await _unless(gone, self._decode(
                route, body if plan is None else plan.decode_body(body), headers, request_id, (upstream, params),
                plan.events if plan is not None else b"", trace))
            if plan is not None and isinstance(answer, PassthroughStream):
                self.metrics.first_token.labels("continued").inc()
            if plan is not None and trace is not None:
                trace.first_token_outcome("continued" if isinstance(answer, PassthroughStream) else "decode_failed")
            return answer if answer is not None else Response(status_code=499)
        finally:
            watcher.cancel()

    async def _gone_before_decode(self, prefilled: Prefilled | Response | Exhausted | None, headers: dict[str, str],
                                  request_id: str, trace: RequestSpans | None) -> Response:
        """The client left before any D was asked: P's KV, if P granted some, is released at once
        (nobody else knows its params yet; shielded, so the release is not cut half-sent)."""
        if isinstance(prefilled, tuple):
            await asyncio.shield(self.release_on_prefill(prefilled[0], prefilled[1], headers, request_id, trace))
        logger.info("request %s: client went away before decode started", request_id)
        return Response(status_code=499)

    async def _first_token_plan(self, body: dict, route: str, upstream: Upstream, params: dict, p_answer: bytes,
                                headers: dict[str, str], trace: RequestSpans | None) -> first_token.Plan | None:
        """The first-token path for this request, or None for the ordinary path. A request the
        context limits (a chat without max_tokens) needs P's context length: asked once per P."""
        if not (self.first_token_from_prefill and first_token.eligible(body, route)):
            return None
        if trace is not None:
            trace.first_token_started()
        context_len = None
        if first_token.limited_by_context(body, route):
            if upstream.context_len is None:
                upstream.context_len = await self._ask_context_len(upstream, headers)
            context_len = upstream.context_len
        plan = first_token.plan(body, route, p_answer, params, context_len)
        if trace is not None:
            trace.first_token_planned(plan is not None)
        return plan

    async def _ask_context_len(self, upstream: Upstream, headers: dict[str, str]) -> int | None:
        """`upstream`'s max_model_len from its /v1/models (kvbridge's and vLLM's cards name it); 0
        when its answer does not say, None when it could not be asked (asked again next time)."""
        assert self.client is not None
        try:
            r = await self.client.get(upstream.url + "/v1/models", headers=headers, timeout=self.short_timeout)
        except httpx.HTTPError as exc:
            logger.warning("could not ask %s for its context length: %r", upstream.url, exc)
            return None
        try:
            context_len = r.json()["data"][0]["max_model_len"]
        except (ValueError, KeyError, IndexError, TypeError):
            context_len = None
        if type(context_len) is not int or context_len < 1:
            logger.warning("%s named no context length on /v1/models: streamed chat requests without max_tokens "
                           "take the ordinary P/D path", upstream.url)
            return 0
        return context_len

    async def _attempts(self, pool: UpstreamPool, route: str, body: dict, headers: dict[str, str], request_id: str,
                        prompt: str, judge: Callable[[Exchange], Awaitable[T | Failed]],
                        first_byte_s: float | None = None, leg: Leg | None = None,
                        keys: UnreadAnswers | None = None) -> T | Exhausted:
        """One leg: POST `body` to an instance of `pool` until `judge` makes the leg's result of
        one's open answer. An attempt that failed before anything reached the client (connection,
        timeout, a broken answer, 5xx, or what `judge` calls a failure) is retried on another
        instance, within the retry count and time budget, after a backoff; each attempt counts in
        its instance's breaker (a judged failure whose instance is not at fault as a success). A
        request that could not be sent at all ends the leg at once, counted nowhere.
        Exhausted: no attempt left, or no instance could be tried; its `received` says whether
        any instance may have received the request. `leg`: its spans (None: not traced). `keys`
        (the P leg): each attempt carries a fresh release key, kept until its answer is read."""
        started = time.monotonic()
        tried: list[Upstream] = []
        received, last, reason = False, None, ""
        for attempt in range(self.retry.retries + 1):
            if attempt:
                waiting = self._before_retry(pool, tried, attempt, reason, started, request_id)
                if not await (waiting if leg is None else leg.backoff(attempt + 1, waiting)):
                    break
            upstream = pool.pick(exclude=tried, prompt=prompt) if leg is None else leg.pick(pool, route, tried, prompt)
            if upstream is None:
                break
            tried.append(upstream)
            span = None if leg is None else leg.attempt(upstream, route, attempt + 1, headers)
            attempt_headers = headers if span is None else span.headers
            if keys is not None:
                attempt_headers = {**attempt_headers, **keys.new(upstream)}
            sent = await self._attempt(pool, upstream, route, body, attempt_headers, request_id, first_byte_s)
            received |= isinstance(sent, Exchange) or sent.received
            if keys is not None and isinstance(sent, Failed) and not sent.received:
                keys.read(upstream)  # it never got the request: no lease to end
            result = await judge(sent) if isinstance(sent, Exchange) else sent
            if span is not None:
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

    def _server_error(self, kind: UpstreamKind, answer: Response | Failed) -> Failed | None:
        """`answer` as a failed attempt when it is one (reading it failed, or a 5xx), else None."""
        if isinstance(answer, Failed):
            return answer
        if answer.status_code < 500:
            return None
        self.metrics.upstream_errors.labels(kind.value, "status").inc()
        return Failed(f"status_{answer.status_code}", True, answer)

    async def _prefill(self, route: str, body: dict, headers: dict[str, str], request_id: str,
                       trace: RequestSpans | None = None) -> Prefilled | Response | Exhausted:
        """Step 1: P's upstream, kv_transfer_params and whole answer; P's 4xx answer for the client; or, when
        every attempt failed (connection, timeout, a broken answer, 5xx, no kv_transfer_params)
        or no P could be tried, what the client gets without a fallback."""
        assert self.prefill is not None, "P/D mode only"
        started = time.monotonic()
        keys = UnreadAnswers()
        try:
            result = await self._attempts(self.prefill, route, prefill_body(body), headers, request_id,
                                          prompt_text(body), functools.partial(self._prefill_answer,
                                                                               request_id=request_id, keys=keys),
                                          leg=None if trace is None else trace.leg("prefill"), keys=keys)
        finally:  # cancelled (the client left), or attempts that broke mid-answer: P may hold their KV
            for upstream, key in keys.unread():
                self._in_background(self.release_by_key(upstream, key, headers, request_id))
        if isinstance(result, tuple):
            self.metrics.prefill_seconds.observe(time.monotonic() - started)
        return result

    async def _prefill_answer(self, exchange: Exchange, request_id: str,
                              keys: UnreadAnswers) -> Prefilled | Response | Failed:
        """P's whole answer as step 1's result (a 4xx, the request's own fault, is never retried),
        or why this attempt failed (an answer without kv_transfer_params: not P's breaker's failure)."""
        answer = await self._read_all(exchange, request_id)
        if not isinstance(answer, Failed):
            keys.read(exchange.upstream)  # read whole: its params (if any) are ours to pass on or release
        failed = self._server_error(UpstreamKind.PREFILL, answer)
        if failed is not None:
            return failed
        if answer.status_code >= 400:  # the request's own fault: never retried
            return answer
        params = _kv_transfer_params(answer.body)
        if params is None:
            url = exchange.upstream.url
            logger.warning("request %s: prefill instance %s returned no kv_transfer_params", request_id, url)
            return Failed("no_kv_transfer_params", True, openai_error(
                502, f"prefill instance {url} returned no kv_transfer_params (is it running with --kv-role "
                     "producer?)", "no_kv_transfer_params", request_id), instance_at_fault=False)
        return exchange.upstream, params, bytes(answer.body)

    async def _decode(self, route: str, body: dict, headers: dict[str, str], request_id: str,
                      prefilled: tuple[Upstream, dict] | None, first: bytes = b"",
                      trace: RequestSpans | None = None) -> Response:
        """Step 2 (or the whole request in colocated mode and in the decode-only fallback:
        `prefilled` None, the client's body without kv_transfer_params): D's answer, streamed or
        whole. A D that fails before anything reached the client (connection, timeout, a broken
        answer, 5xx) is retried on another D with the same kv_transfer_params; a 4xx and a
        stream that started are never retried. P's KV is released when no D received the request.
        `first`: bytes a successful stream sends before D's (the first-token path's events)."""
        if prefilled is None:
            forwarded = {k: v for k, v in body.items() if k != "kv_transfer_params"}
        else:
            forwarded = {**body, "kv_transfer_params": prefilled[1]}
        # D sends a stream's status line once it admitted the request (before any KV moves), an
        # unstreamed answer's only when it is complete: only a stream's start can be bounded.
        first_byte_s = self.first_byte_timeout_s if body.get("stream") else None
        judge = functools.partial(self._decode_answer, request_id=request_id, stream=bool(body.get("stream")),
                                  first=first)
        role = "decode" if prefilled is not None else "colocated" if self.prefill is None else "decode_only"
        result = await self._attempts(self.decode, route, forwarded, headers, request_id, prompt_text(body), judge,
                                      first_byte_s, None if trace is None else trace.leg(role))
        if not isinstance(result, Exhausted):
            return result
        if prefilled is not None and not result.received:
            # Shielded: a client hanging up now must not cancel the release half-sent.
            await asyncio.shield(self.release_on_prefill(prefilled[0], prefilled[1], headers, request_id, trace))
        return result.response

    async def _decode_answer(self, exchange: Exchange, request_id: str, stream: bool,
                             first: bytes) -> Response | Failed:
        """D's answer as step 2's result: a stream passed through (its first byte goes to the
        client: no retry after it), or the whole answer; or why this attempt failed."""
        status = exchange.response.status_code
        if status < 400 and stream:
            return PassthroughStream(exchange, request_id, first)
        answer = await self._read_all(exchange, request_id)
        if not isinstance(answer, Failed) and status >= 500 and _error_code(answer) == KV_LOAD_FAILED:
            # D is fine; the request's KV could not be loaded and P has released it, so
            # another D could not load it either: the client gets D's answer, D's breaker a success.
            return answer
        return self._server_error(UpstreamKind.DECODE, answer) or answer

    async def release_on_prefill(self, upstream: Upstream, params: dict, headers: dict[str, str],
                                 request_id: str, trace: RequestSpans | None = None) -> bool:
        """Best effort: ask P to free the KV it keeps for this request. True if P said 2xx."""
        if trace is not None:  # as span proxy.release
            return await trace.timed("proxy.release", self.release_on_prefill(upstream, params, headers, request_id),
                                     {"url.full": upstream.url + RELEASE_PATH})
        assert self.client is not None
        try:
            r = await self.client.post(upstream.url + RELEASE_PATH, json={"kv_transfer_params": params},
                                       headers=headers, timeout=self.short_timeout)
            ok = r.status_code < 300
            detail = f"status {r.status_code}"
        except httpx.HTTPError as exc:
            ok, detail = False, repr(exc)
        self.metrics.kv_releases.labels("ok" if ok else "failed").inc()
        if ok:
            logger.info("request %s: no decode instance took it; released its KV on %s", request_id, upstream.url)
        else:
            logger.warning("request %s: release on %s failed (%s); P frees the KV when its lease expires",
                           request_id, upstream.url, detail)
        return ok

    async def release_by_key(self, upstream: Upstream, key: str, headers: dict[str, str], request_id: str) -> bool:
        """Best effort: P may hold KV for an attempt whose answer the proxy never read (it gave
        up mid-attempt, or the connection broke): ask P to end that lease by the attempt's key.
        True if P said 2xx (whether or not a lease was held)."""
        assert self.client is not None
        try:
            r = await self.client.post(upstream.url + RELEASE_PATH, json={"release_key": key}, headers=headers,
                                       timeout=self.short_timeout)
            ok, detail = r.status_code < 300, f"status {r.status_code}"
        except httpx.HTTPError as exc:
            ok, detail = False, repr(exc)
        self.metrics.kv_releases.labels("ok" if ok else "failed").inc()
        if not ok:
            logger.warning("request %s: release of an unread prefill answer on %s failed (%s); P frees its KV when "
                           "its lease expires", request_id, upstream.url, detail)
        return ok

    def _in_background(self, work: Awaitable[object]) -> None:
        """Run `work` beyond the request that started it (a client that left cancels the request);
        stop() waits for what is still running."""
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def models(self, request: Request) -> Response:
        """/v1/models as the first healthy D that answers it reports."""
        assert self.client is not None
        for upstream in self.decode.healthy():
            try:
                r = await self.client.get(upstream.url + "/v1/models", headers=self._auth_headers(request),
                                          timeout=self.short_timeout)
            except httpx.HTTPError:
                continue
            return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))
        return openai_error(503, "no healthy decode instance answered /v1/models", "no_healthy_instance")


async def _read_body(request: Request, limit: int) -> bytes | None:
    """The request's body, or None when it is longer than `limit` bytes: refused on its
    Content-Length before any of it is read, else once the bytes read pass the limit."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        return None
    return await read_capped(request.stream(), limit)


async def _watch_disconnect(request: Request, gone: asyncio.Event) -> None:
    """Set `gone` when the client disconnects. The body has been read, so the next ASGI
    message can only be the disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    gone.set()


async def _unless(gone: asyncio.Event, work: Awaitable[T]) -> T | None:
    """`work`'s result, or None if `gone` is set first; then `work` is cancelled, which
    closes its upstream connection (an upstream kvbridge server aborts the request)."""
    task = asyncio.ensure_future(work)
    waiter = asyncio.ensure_future(gone.wait())
    try:
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    return task.result() if not task.cancelled() else None
