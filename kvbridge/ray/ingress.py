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
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from dataclasses import asdict, dataclass

import uvicorn

from kvbridge.openai_wire import MAX_BODY_BYTES, bind_socket
from kvbridge.proxy.app import proxy_app
from kvbridge.proxy.exchange import RetryPolicy
from kvbridge.proxy.proxy import FIRST_BYTE_TIMEOUT_S, PDProxy
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

    def to_json(self) -> dict:
        return asdict(self)


def build_router(o: RouterOptions) -> PDProxy:
    """A PDProxy over two empty pools whose membership follows Ray."""
    breaker = dict(breaker_failures=o.breaker_failures, breaker_cooldown_s=o.breaker_cooldown_s, dynamic=True)
    return PDProxy(UpstreamPool(UpstreamKind.PREFILL, [], make_policy(o.prefill_policy), **breaker),
                   UpstreamPool(UpstreamKind.DECODE, [], make_policy(o.decode_policy), **breaker),
                   health_interval_s=o.health_interval_s, health_timeout_s=o.health_timeout_s,
                   timeout_s=o.timeout_s, connect_timeout_s=o.connect_timeout_s, api_key=o.api_key,
                   upstream_api_key=o.api_key,
                   retry=RetryPolicy(retries=o.retries, budget_s=o.retry_budget_s,
                                     decode_only_fallback=o.decode_only_fallback),
                   first_token_from_prefill=o.first_token_from_prefill, max_body_bytes=o.max_body_bytes,
                   first_byte_timeout_s=o.first_byte_timeout_s)


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
        self._server = uvicorn.Server(uvicorn.Config(proxy_app(self.proxy), log_level="warning",
                                                     timeout_graceful_shutdown=5))
        self._thread = threading.Thread(target=self._serve, name="kvbridge-router", daemon=True)
        self._thread.start()
        if not self._started.wait(60.0):
            raise RuntimeError("the kvbridge router did not start within 60 s")
        self._handles = {}
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
            done = asyncio.run_coroutine_threadsafe(self.proxy.set_members(kind, urls), self._loop)
            done.add_done_callback(lambda f: f.cancelled() or f.exception() is None or logger.error(
                "%s pool update to %s failed", kind.value, urls, exc_info=f.exception()))
        return on_change

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
