"""The router's pools whose membership follows Ray (routing.UpstreamPool.set_members,
PDProxy.set_members): an instance that stays keeps its health, breaker and in-flight count; a
new one is probed at once; one that left is never picked again."""

from __future__ import annotations

import asyncio

import pytest

from kvbridge.proxy.proxy import PDProxy
from kvbridge.proxy.routing import BreakerState, UpstreamKind, UpstreamPool, make_policy


def pool() -> UpstreamPool:
    return UpstreamPool(UpstreamKind.DECODE, [], make_policy("round_robin"), breaker_failures=1, dynamic=True)


def test_a_fixed_pool_still_needs_urls():
    with pytest.raises(ValueError):
        UpstreamPool(UpstreamKind.DECODE, [], make_policy("round_robin"))


def test_members_that_stay_keep_their_state():
    p = pool()
    assert p.pick() is None  # empty: nothing to pick
    added, removed = p.set_members(["http://a:1", "http://b:2/"])
    assert [u.url for u in added] == ["http://a:1", "http://b:2"] and removed == []
    a, b = p.upstreams
    assert not a.healthy and p.pick() is None  # new members wait for their health probe
    p.set_health(a, True)
    p.set_health(b, True)
    a.outstanding = 3
    p.record(b, False, "boom")
    assert b.breaker.state is BreakerState.OPEN
    added, removed = p.set_members(["http://c:3", "http://b:2", "http://a:1"])
    assert [u.url for u in added] == ["http://c:3"] and removed == []
    assert p.upstreams[:2] == [a, b] and a.outstanding == 3 and a.healthy
    assert b.breaker.state is BreakerState.OPEN  # the breaker's state survives the update
    assert p.upstreams[2].index > b.index  # a newcomer sorts after the members it joined
    _added, removed = p.set_members(["http://c:3"])
    assert removed == [a, b]
    assert p.pick() is None  # c is not healthy yet; a and b are gone
    p.set_health(p.upstreams[0], True)
    assert p.pick().url == "http://c:3"


def test_the_prefix_policy_forgets_a_member_that_left():
    p = UpstreamPool(UpstreamKind.PREFILL, [], make_policy("prefix"), dynamic=True)
    p.set_members(["http://a:1", "http://b:2"])
    for u in p.upstreams:
        p.set_health(u, True)
    prompt = "x" * 200
    first = p.pick(prompt=prompt)
    assert p.pick(prompt=prompt) is first
    p.set_members([u.url for u in p.upstreams if u is not first])
    assert p.pick(prompt=prompt) is not first


def test_the_proxy_probes_a_new_member_at_once():
    """set_members on a started PDProxy probes the newcomers before it returns: a healthy one
    takes traffic without waiting for the next health round (here: 1 hour away)."""
    from fastapi import FastAPI
    import uvicorn

    from kvbridge.openai_wire import bind_socket

    health = FastAPI()

    @health.get("/health")
    async def ok() -> dict:
        return {"status": "ok"}

    async def run() -> None:
        sock = bind_socket("127.0.0.1", 0)
        server = uvicorn.Server(uvicorn.Config(health, log_level="warning"))
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        proxy = PDProxy(None, pool(), health_interval_s=3600, health_timeout_s=2, timeout_s=10,
                        connect_timeout_s=2, api_key=None, upstream_api_key=None)
        try:
            await proxy.start()  # the socket listens already: a probe waits in its backlog
            url = f"http://127.0.0.1:{sock.getsockname()[1]}"
            await proxy.set_members(UpstreamKind.DECODE, [url, "http://127.0.0.1:9"])
            assert {u.url: u.healthy for u in proxy.decode.upstreams} == {url: True, "http://127.0.0.1:9": False}
            await proxy.set_members(UpstreamKind.DECODE, [])
            assert proxy.health_report()[0] is False  # an empty pool is not healthy
        finally:
            await proxy.stop()
            server.should_exit = True
            await serving

    asyncio.run(run())
