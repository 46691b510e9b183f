"""A proxy in front of stand-in P and D servers (proxy_upstreams.py), on loopback: what the
proxy's unit tests (test_proxy*.py, test_prefix_routing.py) share."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass

import httpx
import openai

from kvbridge.proxy.app import build_proxy_app
from kvbridge.proxy.proxy import PDProxy
from tests.unit.proxy_upstreams import FakeInstance, RunningServer, serve


@dataclass
class PD:
    prefill: list[FakeInstance]
    decode: list[FakeInstance]
    servers: dict[str, RunningServer]  # by instance name
    url: str
    http: httpx.AsyncClient  # talks to the proxy
    proxy: PDProxy | None = None  # the proxy itself (its pools' clocks, for tests of time)

    async def health(self) -> dict:
        return (await self.http.get("/health")).json()

    async def wait_health(self, kind: str, index: int, healthy: bool) -> None:
        deadline = time.monotonic() + 5
        while (await self.health())[kind][index]["healthy"] is not healthy:
            assert time.monotonic() < deadline, f"{kind}[{index}] never became healthy={healthy}"
            await asyncio.sleep(0.02)

    async def metrics_show(self, line: str, timeout_s: float = 10.0) -> None:
        """Until the proxy's /metrics has `line` (the proxy counts a request once it has
        handled it, after its response is decided)."""
        deadline = time.monotonic() + timeout_s
        while line not in (await self.http.get("/metrics")).text:
            assert time.monotonic() < deadline, f"the proxy's /metrics never showed {line!r}"
            await asyncio.sleep(0.02)


async def received_by(instance: FakeInstance, timeout_s: float = 10.0) -> None:
    """Until `instance` has received a completion request (it records it on arrival)."""
    deadline = time.monotonic() + timeout_s
    while not instance.received:
        assert time.monotonic() < deadline, f"{instance.name} never received a request"
        await asyncio.sleep(0.01)


@asynccontextmanager
async def pd_cluster(num_prefill: int = 1, num_decode: int = 1, prefill_role: str = "prefill",
                     wrap_transport: Callable[[httpx.AsyncBaseTransport], httpx.AsyncBaseTransport] | None = None,
                     **proxy_kwargs) -> AsyncIterator[PD]:
    """`wrap_transport`: wraps the proxy's upstream transport (PDProxy's; fault paths only)."""
    ps = [FakeInstance(f"prefill-{i}", prefill_role) for i in range(num_prefill)]
    ds = [FakeInstance(f"decode-{i}", "decode") for i in range(num_decode)]
    async with AsyncExitStack() as stack:
        servers: dict[str, RunningServer] = {}
        stack.push_async_callback(lambda: asyncio.gather(*(s.stop() for s in servers.values())))  # in parallel
        for inst in ps + ds:
            servers[inst.name] = await serve(inst.app)
        app = build_proxy_app([servers[p.name].url for p in ps], [servers[d.name].url for d in ds], **proxy_kwargs)
        app.state.proxy.wrap_transport = wrap_transport  # read when the proxy starts
        proxy = await serve(app)
        stack.push_async_callback(proxy.stop)
        http = await stack.enter_async_context(httpx.AsyncClient(base_url=proxy.url, timeout=10, trust_env=False))
        yield PD(ps, ds, servers, proxy.url, http, app.state.proxy)


def openai_client(pd: PD, api_key: str = "sk-test") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=pd.url + "/v1", api_key=api_key, max_retries=0,
                              http_client=httpx.AsyncClient(trust_env=False, timeout=10))


COMPLETION = {"model": "m", "prompt": "The capital of France is", "max_tokens": 20, "temperature": 0.0}


def offer_token(instance) -> None:
    """This stand-in P names its sampled token, as a kvbridge P of an attention model does,
    and answers with max_tokens' finish reason (its one token did not end the request)."""
    params, completion = instance.kv_transfer_params, instance.completion
    instance.kv_transfer_params = lambda request_id: {**params(request_id), "generated_token_ids": [17]}

    def one_token(path: str, request_id: str) -> dict:
        body = completion(path, request_id)
        body["choices"][0]["finish_reason"] = "length"
        return body
    instance.completion = one_token

STREAMED = {"model": "m", "prompt": "The capital of France is", "max_tokens": 8, "stream": True}
