"""The proxy's HTTP surface: the FastAPI app around PDProxy (proxy.py) and the server runner."""

from __future__ import annotations

import logging
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvbridge.http_protocol import AnnouncingServer, server_config
from kvbridge.openai_wire import MAX_BODY_BYTES, bind_socket, parse_json_object
from kvbridge.proxy import instance_routes
from kvbridge.proxy.bodies import read_body
from kvbridge.proxy.exchange import RetryPolicy, openai_error
from kvbridge.proxy.kv_cost import PdMode
from kvbridge.proxy.proxy import BAD_KEY_MESSAGE, FIRST_BYTE_TIMEOUT_S, PDProxy
from kvbridge.proxy.routing import UpstreamKind, UpstreamPool, make_policy
from kvbridge.proxy.tracing_spans import ProxyTracingMiddleware
from kvbridge.tracing import Tracing, TracingConfig, program_tracing

logger = logging.getLogger(__name__)


def build_proxy_app(prefill_urls: list[str], decode_urls: list[str], prefill_policy: str = "round_robin",
                    decode_policy: str = "round_robin", health_interval_s: float = 2.0,
                    api_key: str | None = None, timeout_s: float = 300.0, *,
                    upstream_api_key: str | None = None, connect_timeout_s: float = 5.0,
                    health_timeout_s: float = 2.0, retry: RetryPolicy = RetryPolicy(), breaker_failures: int = 5,
                    breaker_cooldown_s: float = 10.0, first_token_from_prefill: bool = True,
                    max_body_bytes: int = MAX_BODY_BYTES,
                    first_byte_timeout_s: float = FIRST_BYTE_TIMEOUT_S, tracing: Tracing | None = None,
                    pd_mode: PdMode = "always", kv_reuse: bool = False) -> FastAPI:
    """The proxy as a FastAPI app; the health loop and HTTP client live in its lifespan.

    `api_key` guards the proxy's /v1 routes (Bearer); upstreams get `upstream_api_key` if
    set, else the client's Authorization header. `timeout_s` bounds each upstream read
    (for a stream: the gap between two chunks); `first_byte_timeout_s` bounds the wait for a
    decode instance's status line on a streamed request (a silent instance is a failed attempt).
    Empty `prefill_urls`: colocated mode (see the module docstring). `retry`: retries, backoff
    and the decode-only fallback; `breaker_*`: each upstream's circuit breaker (routing.py);
    `first_token_from_prefill`: stream P's token at once and let D continue from it
    (first_token.py); `max_body_bytes`: longer request bodies get HTTP 413, read no further
    than that. `tracing`: the proxy's tracer (None: no spans), owned by the caller. `pd_mode`: P/D
    per request (kv_routing.py); `kv_reuse`: read a prefix another instance holds (kv_reuse.py). ValueError for an empty decode list or bad names.
    """
    if health_interval_s <= 0 or health_timeout_s <= 0 or timeout_s <= 0 or connect_timeout_s <= 0:
        raise ValueError("intervals and timeouts must be positive")

    def pool(kind: UpstreamKind, urls: list[str], policy: str) -> UpstreamPool:
        return UpstreamPool(kind, urls, make_policy(policy), breaker_failures=breaker_failures,
                            breaker_cooldown_s=breaker_cooldown_s)

    prefill = pool(UpstreamKind.PREFILL, prefill_urls, prefill_policy) if prefill_urls else None
    proxy = PDProxy(prefill, pool(UpstreamKind.DECODE, decode_urls, decode_policy),
                    health_interval_s=health_interval_s, health_timeout_s=health_timeout_s,
                    timeout_s=timeout_s, connect_timeout_s=connect_timeout_s,
                    api_key=api_key, upstream_api_key=upstream_api_key, retry=retry,
                    first_token_from_prefill=first_token_from_prefill, max_body_bytes=max_body_bytes,
                    first_byte_timeout_s=first_byte_timeout_s, pd_mode=pd_mode, kv_reuse=kv_reuse)
    return proxy_app(proxy, tracing)


def proxy_app(proxy: PDProxy, tracing: Tracing | None = None) -> FastAPI:
    """The FastAPI app serving `proxy` (build_proxy_app's; kvbridge/ray's ingress builds its
    PDProxy over pools whose membership follows Ray). `tracing`: the proxy's tracer, or None."""

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await proxy.start()
        try:
            yield
        finally:
            await proxy.stop()

    # No /docs, /redoc or /openapi.json, as on an instance: they would describe the API to
    # anyone, key or not.
    app = FastAPI(title="kvbridge P/D proxy", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.proxy = proxy
    # Where the proxy chooses, once, between traced requests and NO_SPANS (tracing_spans.py): the
    # middleware starts proxy.request before FastAPI dispatches the request and hands it to the handler.
    if tracing is not None:
        app.add_middleware(ProxyTracingMiddleware, tracing=tracing)

    async def on_unexpected(request: Request, exc: Exception) -> Response:
        """A bug, not the client's fault: still OpenAI's error body, never plain text."""
        logger.error("%s %s: unexpected error", request.method, request.url.path, exc_info=exc)
        return openai_error(500, f"internal error: {type(exc).__name__}", "internal_error")

    app.add_exception_handler(Exception, on_unexpected)

    async def on_http_error(_: Request, exc: Exception) -> Response:
        """Routing's 404 and 405 in OpenAI's error body, as an instance answers them (a 405 keeps
        its Allow header), never FastAPI's {"detail": ...}."""
        assert isinstance(exc, StarletteHTTPException)
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        response = openai_error(exc.status_code, str(exc.detail), code)
        response.headers.update(exc.headers or {})
        return response

    app.add_exception_handler(StarletteHTTPException, on_http_error)

    async def route(request: Request) -> Response:
        response = await proxy.handle(request, request.url.path)
        proxy.metrics.requests.labels(request.url.path, str(response.status_code)).inc()
        return response

    app.add_api_route("/v1/completions", route, methods=["POST"])
    app.add_api_route("/v1/chat/completions", route, methods=["POST"])

    async def tokenization(request: Request) -> Response:
        response = await instance_routes.tokenization(proxy, request, request.url.path)
        proxy.metrics.requests.labels(request.url.path, str(response.status_code)).inc()
        return response

    app.add_api_route("/tokenize", tokenization, methods=["POST"])
    app.add_api_route("/detokenize", tokenization, methods=["POST"])

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: Request) -> Response:
        response = await instance_routes.tokenizer_info(proxy, request)
        proxy.metrics.requests.labels(request.url.path, str(response.status_code)).inc()
        return response

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        if not proxy.authorized(request):
            return openai_error(401, BAD_KEY_MESSAGE, "invalid_api_key")
        return await instance_routes.models(proxy, request)

    @app.get("/kvbridge/fleet")
    async def fleet() -> Response:
        """The router's fleet view (fleet_view.py): what it knows each instance holds, and its load."""
        view = proxy.fleet
        return JSONResponse({"enabled": view is not None, "pd_mode": proxy.pd_mode, "kv_reuse": proxy.kv_reuse,
                             "instances": view.report() if view is not None else {}})

    @app.post("/kvbridge/fleet/predict")
    async def predict(request: Request) -> Response:
        """What the router predicts each healthy instance holds of a request's prompt: the body of a
        completions request (or of a chat one: `messages`), answered {"prompt_tokens": n, "cached":
        {url: tokens}} (the operator's "why did it go there"). API key as /v1; 404 without a fleet view."""
        if not proxy.authorized(request):
            return openai_error(401, BAD_KEY_MESSAGE, "invalid_api_key")
        view = proxy.fleet
        if view is None:
            return openai_error(404, "the fleet view is off (--pd-mode always, no kv_aware policy, --kv-reuse off)",
                                "not_found")
        raw = await read_body(request, proxy.max_body_bytes)
        if raw is None:
            return openai_error(413, f"the request body is larger than {proxy.max_body_bytes} bytes",
                                "request_too_large")
        try:
            body = parse_json_object(raw)
        except ValueError as exc:
            return openai_error(400, str(exc), "invalid_json")
        route = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        urls = [u.url for pool in proxy.pools for u in pool.healthy()]
        tokens = (await view.token_ids(proxy.client(), urls[0], route, body, proxy.upstream_headers(request),
                                       proxy.short_timeout) if urls else None)
        if tokens is None:
            return openai_error(400, "the request's prompt could not be tokenized by a healthy instance", "invalid_prompt")
        prediction = view.predict(tokens, urls)
        return JSONResponse({"prompt_tokens": prediction.prompt_tokens, "cached": prediction.cached,
                             "reusable": {u: prediction.served(u) for u in prediction.cached}})

    @app.get("/health")
    async def health() -> Response:
        ok, report = proxy.health_report()
        return JSONResponse(report, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        proxy.refresh_gauges()
        return Response(generate_latest(proxy.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def run_proxy(prefill_urls: list[str], decode_urls: list[str], host: str = "127.0.0.1", port: int = 8000,
              prefill_policy: str = "round_robin", decode_policy: str = "round_robin",
              health_interval_s: float = 2.0, api_key: str | None = None, timeout_s: float = 300.0,
              upstream_api_key: str | None = None, log_level: str = "info", retry: RetryPolicy = RetryPolicy(),
              breaker_failures: int = 5, breaker_cooldown_s: float = 10.0,
              first_token_from_prefill: bool = True, max_body_bytes: int = MAX_BODY_BYTES,
              first_byte_timeout_s: float = FIRST_BYTE_TIMEOUT_S, tracing: TracingConfig | None = None,
              pd_mode: PdMode = "always", kv_reuse: bool = False) -> int:
    """Serve the proxy until SIGINT/SIGTERM; prints its URL once bound (port 0: the OS picks)."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    with program_tracing(tracing) as tracer:  # shut down (spans flushed) once the server stopped
        app = build_proxy_app(prefill_urls, decode_urls, prefill_policy, decode_policy, health_interval_s,
                              api_key, timeout_s, upstream_api_key=upstream_api_key, retry=retry,
                              breaker_failures=breaker_failures, breaker_cooldown_s=breaker_cooldown_s,
                              first_token_from_prefill=first_token_from_prefill, max_body_bytes=max_body_bytes,
                              first_byte_timeout_s=first_byte_timeout_s, tracing=tracer, pd_mode=pd_mode,
                              kv_reuse=kv_reuse)
        sock = bind_socket(host, port)  # connections made right after the URL is printed wait in the backlog
        bound_port = sock.getsockname()[1]
        url_host = f"[{host}]" if sock.family == socket.AF_INET6 else host
        prefill = f"prefill: {' '.join(prefill_urls)}" if prefill_urls else "colocated: no prefill"
        # printed once serving, with SIGINT/SIGTERM handled
        server = AnnouncingServer(server_config(app, log_level=log_level, timeout_graceful_shutdown=5),
                                  f"kvbridge proxy: http://{url_host}:{bound_port} ({prefill}; decode: "
                                  f"{' '.join(decode_urls)})")
        server.run(sockets=[sock])
    return 0
