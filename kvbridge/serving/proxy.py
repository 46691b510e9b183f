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
The FastAPI app and the server runner around PDProxy are in proxy_app.py.

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
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import TypeVar

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvbridge.serving.protocol import parse_json_object
from kvbridge.serving.routing import Upstream, UpstreamKind, UpstreamPool

logger = logging.getLogger(__name__)
T = TypeVar("T")

RELEASE_PATH = "/kvbridge/release_kv"
UPSTREAM_KEEPALIVE_S = 2.0
REQUEST_ID_HEADER = "X-Request-Id"
# The same rule as completions.py: printable ASCII without spaces, else the server makes its own id.
_REQUEST_ID_RE = re.compile(r"[\x21-\x7e]{1,256}")
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
        # Gauges are set from the pools at scrape time (PDProxy.refresh_gauges).
        self.healthy = Gauge("kvbridge_proxy_healthy_instances", "Healthy instances by kind", ["kind"], registry=r)
        self.outstanding = Gauge("kvbridge_proxy_outstanding_requests", "In-flight upstream requests by kind",
                                 ["kind"], registry=r)


def openai_error(status: int, message: str, code: str, request_id: str | None = None) -> JSONResponse:
    """OpenAI's error body, typed like the API server's (invalid_request_error / server_error)."""
    body = {"error": {"message": message, "type": "server_error" if status >= 500 else "invalid_request_error",
                      "param": None, "code": code}}
    headers = {REQUEST_ID_HEADER: request_id} if request_id else None
    return JSONResponse(body, status_code=status, headers=headers)


def prefill_body(body: dict) -> dict:
    """The body sent to P: one token, no streaming, one sample, asking P to keep the KV."""
    out = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens", "best_of")}
    out.update(max_tokens=1, stream=False, n=1, kv_transfer_params={"do_remote_decode": True})
    if "max_completion_tokens" in body:
        out["max_completion_tokens"] = 1
    return out


@dataclass(frozen=True)
class _Unavailable:
    """No upstream of a kind took the request; nothing was sent to any of them."""

    status: int  # 503: none healthy; 502: every healthy one refused the connection
    message: str
    code: str


class _Exchange:
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


class _PassthroughStream(StreamingResponse):
    """Streams D's bytes as they arrive; closes D's response however the stream ends,
    so a client that goes away makes D abort the request and free its blocks."""

    def __init__(self, exchange: _Exchange, request_id: str) -> None:
        self._exchange = exchange
        self._request_id = request_id
        super().__init__(self._chunks(), status_code=exchange.response.status_code,
                         media_type=exchange.response.headers.get("content-type", "text/event-stream"),
                         headers={REQUEST_ID_HEADER: request_id})

    async def _chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._exchange.response.aiter_raw():
                yield chunk
        except httpx.HTTPError as exc:
            # Headers are gone already: tell the client in-band instead of truncating silently.
            logger.warning("request %s: decode stream from %s broke: %r", self._request_id,
                           self._exchange.upstream.url, exc)
            error = {"error": {"message": f"decode instance stream failed: {exc!r}",
                               "type": "server_error", "param": None, "code": "upstream_failed"}}
            yield f"data: {json.dumps(error)}\n\n".encode()
        finally:
            await self._exchange.close()

    async def __call__(self, scope, receive, send) -> None:  # type: ignore[override]
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._exchange.close()


class PDProxy:
    """Routes requests over two pools (or only the decode pool: colocated mode, `prefill`
    None); owns the pooled HTTP client and the health loop."""

    def __init__(self, prefill: UpstreamPool | None, decode: UpstreamPool, *, health_interval_s: float,
                 health_timeout_s: float, timeout_s: float, connect_timeout_s: float,
                 api_key: str | None, upstream_api_key: str | None) -> None:
        self.prefill, self.decode = prefill, decode
        self.metrics = ProxyMetrics()
        self.health_interval_s, self.health_timeout_s = health_interval_s, health_timeout_s
        self.timeout = httpx.Timeout(timeout_s, connect=connect_timeout_s)
        # Release calls and /v1/models do no model work: they get a short bound.
        self.short_timeout = httpx.Timeout(min(timeout_s, 10.0), connect=connect_timeout_s)
        self.api_key, self.upstream_api_key = api_key, upstream_api_key
        self.client: httpx.AsyncClient | None = None
        self._health_task: asyncio.Task | None = None

    @property
    def pools(self) -> tuple[UpstreamPool, ...]:
        """The configured pools, prefill first (decode only in colocated mode)."""
        return (self.decode,) if self.prefill is None else (self.prefill, self.decode)

    # ---- lifecycle -------------------------------------------------------------------
    async def start(self) -> None:
        """Open the client and run one health round before serving, then poll in the background."""
        # trust_env=False: an HTTP(S)_PROXY variable must never reroute upstream calls.
        self.client = httpx.AsyncClient(timeout=self.timeout, trust_env=False,
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=64,
                                                            # below uvicorn's 5 s keep-alive: never reuse a
                                                            # connection the upstream is closing
                                                            keepalive_expiry=UPSTREAM_KEEPALIVE_S))
        await self.check_health_once()
        self._health_task = asyncio.create_task(self._health_loop(), name="kvbridge-proxy-health")

    async def stop(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            await asyncio.gather(self._health_task, return_exceptions=True)
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

    def health_report(self) -> tuple[bool, dict]:
        report = {kind.value: [] for kind in UpstreamKind}
        for pool in self.pools:
            report[pool.kind.value] = [{"url": u.url, "healthy": u.healthy, "outstanding": u.outstanding}
                                       for u in pool.upstreams]
        ok = all(pool.healthy() for pool in self.pools)
        mode = "colocated" if self.prefill is None else "pd"
        return ok, {"status": "ok" if ok else "unavailable", "mode": mode, **report}

    # ---- requests --------------------------------------------------------------------
    def _auth_headers(self, client_request: Request | None) -> dict[str, str]:
        if self.upstream_api_key:
            return {"Authorization": f"Bearer {self.upstream_api_key}"}
        if client_request is not None and "authorization" in client_request.headers:
            return {"Authorization": client_request.headers["authorization"]}
        return {}

    def authorized(self, request: Request) -> bool:
        if not self.api_key:
            return True
        given = request.headers.get("authorization", "")
        return hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode())

    async def _send(self, pool: UpstreamPool, path: str, body: dict,
                    headers: dict[str, str]) -> _Exchange | _Unavailable:
        """POST `body` to the pool's choice, failing over only on connection errors (then no
        instance received the request). Other httpx errors propagate: the request may have arrived."""
        assert self.client is not None
        tried: list[Upstream] = []
        while (upstream := pool.pick(exclude=tried)) is not None:
            tried.append(upstream)
            request = self.client.build_request("POST", upstream.url + path, json=body, headers=headers)
            upstream.outstanding += 1
            try:
                response = await self.client.send(request, stream=True)
            except BaseException as exc:
                upstream.outstanding -= 1
                if not isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)):
                    raise
                self.metrics.upstream_errors.labels(pool.kind.value, "connect").inc()
                pool.set_health(upstream, False, f"connection failed: {exc!r}")
                continue
            return _Exchange(pool, upstream, response)
        if not tried:
            return _Unavailable(503, f"no healthy {pool.kind.value} instance", "no_healthy_instance")
        return _Unavailable(502, f"could not connect to any {pool.kind.value} instance "
                                 f"(tried {', '.join(u.url for u in tried)})", "upstream_unreachable")

    def _upstream_failed(self, kind: UpstreamKind, exc: httpx.HTTPError, request_id: str) -> Response:
        """The client's answer when an upstream that may have received the request failed."""
        timed_out = isinstance(exc, httpx.TimeoutException)
        self.metrics.upstream_errors.labels(kind.value, "timeout" if timed_out else "protocol").inc()
        logger.warning("request %s: %s instance failed: %r", request_id, kind.value, exc)
        if timed_out:
            return openai_error(504, f"{kind.value} instance timed out", "upstream_timeout", request_id)
        return openai_error(502, f"{kind.value} instance failed: {exc!r}", "upstream_failed", request_id)

    async def _read_all(self, exchange: _Exchange, request_id: str) -> Response:
        """D's or P's complete answer, status and body unchanged."""
        try:
            content = await exchange.response.aread()
        except httpx.HTTPError as exc:
            return self._upstream_failed(exchange.pool.kind, exc, request_id)
        finally:
            await exchange.close()
        return Response(content, status_code=exchange.response.status_code,
                        media_type=exchange.response.headers.get("content-type"),
                        headers={REQUEST_ID_HEADER: request_id})

    async def handle(self, request: Request, route: str) -> Response:
        """Serve one completions or chat-completions request through P then D (colocated
        mode: straight to a decode-list instance)."""
        given = request.headers.get(REQUEST_ID_HEADER)
        request_id = given if given and _REQUEST_ID_RE.fullmatch(given) else f"kvb-{uuid.uuid4().hex}"
        if not self.authorized(request):
            return openai_error(401, BAD_KEY_MESSAGE, "invalid_api_key", request_id)
        try:  # strict: what parses here can be forwarded (no NaN, no lone surrogate, no deep nesting)
            body = parse_json_object(await request.body())
        except ValueError as exc:
            return openai_error(400, str(exc), "invalid_json", request_id)
        for pool in self.pools:
            if not pool.healthy():  # checked before P works, so no KV is held for nothing
                return openai_error(503, f"no healthy {pool.kind.value} instance", "no_healthy_instance",
                                    request_id)
        headers = {REQUEST_ID_HEADER: request_id, "Accept-Encoding": "identity", **self._auth_headers(request)}
        gone = asyncio.Event()
        watcher = asyncio.create_task(_watch_disconnect(request, gone))
        try:  # the watcher must stop before a StreamingResponse listens to the client itself
            if self.prefill is None:
                answer = await _unless(gone, self._colocated(route, body, headers, request_id))
                return answer if answer is not None else Response(status_code=499)
            prefilled = await _unless(gone, self._prefill(route, body, headers, request_id))
            if isinstance(prefilled, tuple) and gone.is_set():
                # Nobody else knows P's params yet: releasing now is safe and frees P at once.
                await self.release_on_prefill(prefilled[0], prefilled[1], headers, request_id)
            if prefilled is None or gone.is_set():
                logger.info("request %s: client went away before decode started", request_id)
                return Response(status_code=499)
            if isinstance(prefilled, Response):
                return prefilled
            # A cancelled D call closes its connection, so D aborts and frees through its own path.
            answer = await _unless(gone, self._decode(route, body, headers, request_id, prefilled))
            return answer if answer is not None else Response(status_code=499)
        finally:
            watcher.cancel()

    async def _prefill(self, route: str, body: dict, headers: dict[str, str],
                       request_id: str) -> tuple[Upstream, dict] | Response:
        """Step 1: P's upstream and kv_transfer_params, or the response for the client."""
        assert self.prefill is not None, "P/D mode only"
        started = time.monotonic()
        try:
            sent = await self._send(self.prefill, route, prefill_body(body), headers)
        except httpx.HTTPError as exc:
            return self._upstream_failed(UpstreamKind.PREFILL, exc, request_id)
        if isinstance(sent, _Unavailable):
            return openai_error(sent.status, sent.message, sent.code, request_id)
        answer = await self._read_all(sent, request_id)
        self.metrics.prefill_seconds.observe(time.monotonic() - started)
        if answer.status_code >= 400:
            return answer
        try:
            params = json.loads(answer.body).get("kv_transfer_params")
        except (ValueError, AttributeError):
            params = None
        if not isinstance(params, dict):
            logger.warning("request %s: prefill instance %s returned no kv_transfer_params",
                           request_id, sent.upstream.url)
            return openai_error(502, f"prefill instance {sent.upstream.url} returned no kv_transfer_params "
                                     "(is it running with --kv-role producer?)", "no_kv_transfer_params",
                                request_id)
        return sent.upstream, params

    async def _decode(self, route: str, body: dict, headers: dict[str, str], request_id: str,
                      prefilled: tuple[Upstream, dict]) -> Response:
        """Step 2: D's answer, streamed or whole; releases P's KV if no D got the request."""
        prefill_upstream, params = prefilled
        try:
            sent = await self._send(self.decode, route, {**body, "kv_transfer_params": params}, headers)
        except httpx.HTTPError as exc:
            # D may have the request and be reading P's blocks: leave freeing to D or P's lease.
            return self._upstream_failed(UpstreamKind.DECODE, exc, request_id)
        if isinstance(sent, _Unavailable):
            # Shielded: a client hanging up now must not cancel the release half-sent.
            await asyncio.shield(self.release_on_prefill(prefill_upstream, params, headers, request_id))
            return openai_error(sent.status, sent.message, sent.code, request_id)
        return await self._answer(sent, body, request_id)

    async def _colocated(self, route: str, body: dict, headers: dict[str, str], request_id: str) -> Response:
        """Colocated mode: the client's body, without kv_transfer_params, to one decode-list instance."""
        forwarded = {k: v for k, v in body.items() if k != "kv_transfer_params"}
        try:
            sent = await self._send(self.decode, route, forwarded, headers)
        except httpx.HTTPError as exc:
            return self._upstream_failed(UpstreamKind.DECODE, exc, request_id)
        if isinstance(sent, _Unavailable):
            return openai_error(sent.status, sent.message, sent.code, request_id)
        return await self._answer(sent, body, request_id)

    async def _answer(self, sent: _Exchange, body: dict, request_id: str) -> Response:
        """The instance's answer for the client: streamed through for a successful stream, else whole."""
        if sent.response.status_code >= 400 or not body.get("stream"):
            return await self._read_all(sent, request_id)
        return _PassthroughStream(sent, request_id)

    async def release_on_prefill(self, upstream: Upstream, params: dict, headers: dict[str, str],
                                 request_id: str) -> bool:
        """Best effort: ask P to free the KV it keeps for this request. True if P said 2xx."""
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
