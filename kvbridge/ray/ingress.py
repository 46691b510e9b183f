"""The application's ingress: the kvbridge P/D router (PDProxy, the same code as
`kvbridge proxy`: retries before the first byte, circuit breakers, the decode-only fallback,
prefix-aware routing, the first token from prefill) as a Serve replica that serves HTTP itself.

Its two pools start empty and follow Ray (discovery.py): the prefill and decode deployments'
replicas, as Serve lists them. The router keeps its own health loop (a new replica is probed at
once and takes traffic when its /health answers 200; a draining one answers 503 and is skipped)
and its breakers: Ray says who is there, the router decides who gets a request.

It listens on its own socket (`host`, `port`), not behind Serve's HTTP proxy: a request's bytes
go client -> router -> engines, with no hop through a Serve proxy and no Serve request in
between, so the router's guarantees hold as in `kvbridge proxy`.

Scale from zero (a pool autoscaled with MIN 0): a pool with no replica has no replica to report
load, so the demand comes from the router (ScaleFromZero). A request that finds a pool empty
sends one call (`EngineReplica.wake`) through the pool's Serve handle: it waits in the handle's
queue, which the handle reports to Serve's controller at once, and Serve starts a replica (its
cold-start path; policy.py counts such requests too). The request itself waits for a healthy
decode replica (and a prefill one when the decode-only fallback is off; with it on, D serves it
alone meanwhile), at most `scale_from_zero_timeout_s`, then gets 503 `no_healthy_instance`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Any

import uvicorn
from starlette.requests import Request

from kvbridge.http_protocol import server_config
from kvbridge.openai_wire import MAX_BODY_BYTES, REQUEST_ID_HEADER, bind_socket, usable_request_id
from kvbridge.proxy.app import proxy_app
from kvbridge.proxy.exchange import RetryPolicy
from kvbridge.proxy.kv_cost import PD_MODES, PdMode
from kvbridge.proxy.proxy import FIRST_BYTE_TIMEOUT_S, PDProxy, openai_error
from kvbridge.proxy.routing import UpstreamKind, UpstreamPool, make_policy
from kvbridge.ray import discovery

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RouterOptions:
    """The router's settings (`kvbridge proxy`'s options; JSON-able)."""

    host: str = "127.0.0.1"
    port: int = 8000  # 0: any free port (the bound one is in `address`)
    prefill_policy: str = "prefix"
    decode_policy: str = "least_outstanding"
    health_interval_s: float = 1.0
    health_timeout_s: float = 2.0
    api_key: str | None = None
    timeout_s: float = 300.0
    connect_timeout_s: float = 5.0
    retries: int = 3
    retry_budget_s: float = 30.0
    decode_only_fallback: bool = True
    breaker_failures: int = 5
    breaker_cooldown_s: float = 10.0
    first_token_from_prefill: bool = True
    max_body_bytes: int = MAX_BODY_BYTES
    first_byte_timeout_s: float = FIRST_BYTE_TIMEOUT_S
    scale_from_zero_timeout_s: float = 120.0  # how long a request waits for a pool at zero to start a replica
    pd_mode: PdMode = "always"  # kvbridge/proxy/kv_routing.py
    kv_reuse: bool = False  # read a prefix another instance holds (kvbridge/proxy/kv_reuse.py)

    def to_json(self) -> dict:
        return asdict(self)


def build_router(o: RouterOptions) -> PDProxy:
    """A PDProxy over two empty pools whose membership follows Ray."""
    if o.pd_mode not in PD_MODES:
        raise ValueError(f"pd_mode must be one of {', '.join(PD_MODES)}, got {o.pd_mode!r}")
    breaker = dict(breaker_failures=o.breaker_failures, breaker_cooldown_s=o.breaker_cooldown_s, dynamic=True)
    return PDProxy(UpstreamPool(UpstreamKind.PREFILL, [], make_policy(o.prefill_policy), **breaker),
                   UpstreamPool(UpstreamKind.DECODE, [], make_policy(o.decode_policy), **breaker),
                   health_interval_s=o.health_interval_s, health_timeout_s=o.health_timeout_s,
                   timeout_s=o.timeout_s, connect_timeout_s=o.connect_timeout_s, api_key=o.api_key,
                   upstream_api_key=o.api_key,
                   retry=RetryPolicy(retries=o.retries, budget_s=o.retry_budget_s,
                                     decode_only_fallback=o.decode_only_fallback),
                   first_token_from_prefill=o.first_token_from_prefill, max_body_bytes=o.max_body_bytes,
                   first_byte_timeout_s=o.first_byte_timeout_s, pd_mode=o.pd_mode, kv_reuse=o.kv_reuse)


# The routes that need an engine: a request to one of them wakes a pool at zero.
ENGINE_ROUTES = frozenset({("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models")})
Wake = Callable[[UpstreamKind], Awaitable[None]]
ASGIApp = Callable[[dict, Callable[[], Awaitable[dict]], Callable[[dict], Awaitable[None]]], Awaitable[None]]


class ScaleFromZero:
    """ASGI middleware in front of the router's app (module docstring, "Scale from zero"). The
    pools' membership changes go through `set_members`, which wakes the requests waiting for a
    replica. Runs on the router's event loop only."""

    def __init__(self, app: ASGIApp, proxy: PDProxy, wake: Wake, timeout_s: float) -> None:
        if timeout_s <= 0:
            raise ValueError("scale_from_zero_timeout_s must be positive")
        self.app, self.proxy, self.wake, self.timeout_s = app, proxy, wake, timeout_s
        self._changed = asyncio.Condition()  # a pool's members changed
        self._waking: dict[UpstreamKind, asyncio.Task] = {}
        self.waiting = 0  # requests waiting for a replica now
        self.waiting_changed = asyncio.Condition()

    async def set_members(self, kind: UpstreamKind, urls: list[str]) -> None:
        """The pool's replicas are now `urls` (PDProxy.set_members probes the new ones)."""
        try:
            await self.proxy.set_members(kind, urls)
        finally:
            async with self._changed:
                self._changed.notify_all()

    async def __call__(self, scope: dict, receive: Callable[[], Awaitable[dict]],
                      send: Callable[[dict], Awaitable[None]]) -> None:
        if (scope["type"] != "http" or (scope["method"], scope["path"]) not in ENGINE_ROUTES
                or not self.proxy.authorized(Request(scope))):  # no key, no wake: the app answers 401
            await self.app(scope, receive, send)
            return
        empty = [pool for pool in self.proxy.pools if not pool.upstreams]
        for pool in empty:
            self._wake(pool.kind)
        needed = [pool for pool in empty
                  if pool is self.proxy.decode or not self.proxy.retry.decode_only_fallback]
        missing = await self.wait_healthy(needed) if needed else None
        if missing is None:
            await self.app(scope, receive, send)
            return
        given = Request(scope).headers.get(REQUEST_ID_HEADER)
        request_id = given if usable_request_id(given) else f"kvb-{uuid.uuid4().hex}"
        logger.warning("request %s: no %s replica started within %.0f s of its arrival (pool at zero)",
                       request_id, missing.kind.value, self.timeout_s)
        self.proxy.metrics.requests.labels(scope["path"], "503").inc()
        response = openai_error(503, f"no {missing.kind.value} instance: the pool is scaled to zero and no "
                                f"replica became healthy within {self.timeout_s:g} s", "no_healthy_instance",
                                request_id)
        await response(scope, receive, send)

    async def wait_healthy(self, pools: list[UpstreamPool]) -> UpstreamPool | None:
        """Until each of `pools` has a healthy instance (None), at most timeout_s (the first
        pool still without one). A member may also turn healthy in the proxy's health loop,
        which tells no one: looked at again every health interval as well."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        await self._count_waiting(+1)
        try:
            async with self._changed:
                while True:
                    missing = next((pool for pool in pools if not pool.healthy()), None)
                    remaining = deadline - loop.time()
                    if missing is None or remaining <= 0:
                        return missing
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._changed.wait(), min(remaining, self.proxy.health_interval_s))
        finally:
            await self._count_waiting(-1)

    async def _count_waiting(self, step: int) -> None:
        async with self.waiting_changed:
            self.waiting += step
            self.waiting_changed.notify_all()

    def _wake(self, kind: UpstreamKind) -> None:
        """One wake call in flight per pool (each bounded by timeout_s)."""
        task = self._waking.get(kind)
        if task is None or task.done():
            self._waking[kind] = asyncio.create_task(self._wake_once(kind), name=f"kvbridge-wake-{kind.value}")

    async def _wake_once(self, kind: UpstreamKind) -> None:
        try:
            await asyncio.wait_for(self.wake(kind), self.timeout_s)
        except TimeoutError:
            logger.warning("the %s pool did not take a wake call within %.0f s", kind.value, self.timeout_s)
        except Exception:  # logged: the waiting requests end at their own bound
            logger.exception("waking the %s pool failed", kind.value)


class RouterIngress:
    """The body of the ingress deployment (app.py): serves the router on its own thread and
    event loop, and feeds its pools from the prefill and decode deployments' replica lists."""

    def __init__(self, prefill, decode, router: dict, app_options: dict | None = None) -> None:
        from ray import serve
        self.options = RouterOptions(**router)
        self.app_options = app_options or {}  # the whole app's options, for `kvbridge ray scale`
        self.app_name = serve.get_replica_context().app_name
        self.proxy = build_router(self.options)
        self.sock = bind_socket(self.options.host, self.options.port)
        host, port = self.sock.getsockname()[:2]
        self.address = f"http://[{host}]:{port}" if self.sock.family == socket.AF_INET6 else f"http://{host}:{port}"
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started = threading.Event()
        self._handles: dict[UpstreamKind, Any] = {}
        self.scale_from_zero = ScaleFromZero(proxy_app(self.proxy), self.proxy, self._wake,
                                             self.options.scale_from_zero_timeout_s)
        self._server = uvicorn.Server(server_config(self.scale_from_zero, log_level="warning",
                                                    timeout_graceful_shutdown=5))  # bounded headers
        self._thread = threading.Thread(target=self._serve, name="kvbridge-router", daemon=True)
        self._thread.start()
        if not self._started.wait(60.0):
            raise RuntimeError("the kvbridge router did not start within 60 s")
        for kind, handle in ((UpstreamKind.PREFILL, prefill), (UpstreamKind.DECODE, decode)):
            discovery.listen(self.app_name, handle.deployment_name, self._listener(kind))
            # options() initialises the handle: its Serve router subscribes to the deployment's
            # replicas now, not at a first call (and PoolRouter publishes them).
            self._handles[kind] = handle.options()
        logger.info("kvbridge router at %s", self.address)

    def _serve(self) -> None:
        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._started.set()
            await self._server.serve(sockets=[self.sock])
        asyncio.run(main())

    def _listener(self, kind: UpstreamKind) -> discovery.Listener:
        def on_change(endpoints: list[discovery.ReplicaEndpoint]) -> None:
            urls = [e.url for e in endpoints]
            assert self._loop is not None
            done = asyncio.run_coroutine_threadsafe(self.scale_from_zero.set_members(kind, urls), self._loop)
            done.add_done_callback(lambda f: f.cancelled() or f.exception() is None or logger.error(
                "%s pool update to %s failed", kind.value, urls, exc_info=f.exception()))
        return on_change

    async def _wake(self, kind: UpstreamKind) -> None:
        """One call through the pool's Serve handle (ScaleFromZero): with no replica it waits in
        the handle's queue, which Serve's autoscaler counts; it returns once a replica took it.
        The caller bounds it (a cancelled call leaves the queue)."""
        handle = self._handles.get(kind)
        if handle is None:
            raise RuntimeError(f"no Serve handle to the {kind.value} pool yet")
        await handle.wake.remote()

    # ---- what Serve and the CLI call -----------------------------------------------------
    async def url(self) -> str:
        return self.address

    async def app_config(self) -> dict:
        """The options this application was built from (`kvbridge ray scale` redeploys them)."""
        return self.app_options

    async def members(self) -> dict[str, list[dict]]:
        """The router's view of its pools (tests, `kvbridge ray status`)."""
        assert self._loop is not None
        report = asyncio.run_coroutine_threadsafe(self._report(), self._loop)
        return await asyncio.wrap_future(report)

    async def _report(self) -> dict[str, list[dict]]:
        return self.proxy.health_report()[1]

    async def check_health(self) -> None:
        if not self._thread.is_alive():
            raise RuntimeError("the kvbridge router's server thread ended")

    async def __del__(self) -> None:
        for handle in self._handles.values():
            discovery.forget(self.app_name, handle.deployment_name)
        self._server.should_exit = True
        await asyncio.to_thread(self._thread.join, 15.0)
