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


def test_a_request_wakes_a_pool_at_zero_and_waits_bounded():
    """Scale from zero (issue 44.2), the router's side (ingress.ScaleFromZero over the real
    router app, served on loopback): a request that finds both pools empty wakes each (one wake
    call per pool however many requests wait) and waits; once the woken D is a healthy member
    the waiting requests are answered through it (the decode-only fallback serves them without
    P). When nothing comes up, a request gets 503 no_healthy_instance in OpenAI's error body
    after the bound, not before; a request without the key wakes nothing (401 at once)."""
    from fastapi import FastAPI
    import httpx
    import uvicorn

    from kvbridge.openai_wire import bind_socket
    from kvbridge.proxy.app import proxy_app
    from kvbridge.ray.ingress import ScaleFromZero

    engine = FastAPI()

    @engine.get("/health")
    async def ok() -> dict:
        return {"status": "ok"}

    @engine.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": "woken", "object": "model"}]}

    def router(wake, timeout_s: float, api_key: str | None = None) -> tuple[PDProxy, ScaleFromZero]:
        proxy = PDProxy(UpstreamPool(UpstreamKind.PREFILL, [], make_policy("round_robin"), dynamic=True), pool(),
                        health_interval_s=3600, health_timeout_s=2, timeout_s=10, connect_timeout_s=2,
                        api_key=api_key, upstream_api_key=None)
        return proxy, ScaleFromZero(proxy_app(proxy), proxy, wake, timeout_s)

    async def serve(app) -> tuple[str, uvicorn.Server, asyncio.Task]:
        sock = bind_socket("127.0.0.1", 0)
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        task = asyncio.create_task(server.serve(sockets=[sock]))
        return f"http://127.0.0.1:{sock.getsockname()[1]}", server, task

    async def run() -> None:
        engine_url, engine_server, engine_task = await serve(engine)
        woken: list[UpstreamKind] = []
        three_waiting = asyncio.Event()

        async def wake(kind: UpstreamKind) -> None:  # as Serve: a replica starts, is published, takes the call
            woken.append(kind)
            if kind is UpstreamKind.DECODE:
                await three_waiting.wait()
                await scale.set_members(kind, [engine_url])
            else:
                await asyncio.Event().wait()  # P never comes: ended by the bound

        slow_woken: list[UpstreamKind] = []

        async def never(kind: UpstreamKind) -> None:  # no replica ever starts
            slow_woken.append(kind)
            await asyncio.Event().wait()

        proxy, scale = router(wake, timeout_s=60)
        url, server, task = await serve(scale)
        slow_proxy, slow = router(never, timeout_s=0.5, api_key="k")
        slow_url, slow_server, slow_task = await serve(slow)
        try:
            async with httpx.AsyncClient(timeout=30, trust_env=False) as client:
                asked = [asyncio.create_task(client.get(url + "/v1/models")) for _ in range(3)]
                async with scale.waiting_changed:
                    await asyncio.wait_for(scale.waiting_changed.wait_for(lambda: scale.waiting == 3), 30)
                three_waiting.set()
                answers = await asyncio.gather(*asked)
                assert [a.status_code for a in answers] == [200] * 3
                assert answers[0].json()["data"][0]["id"] == "woken"
                assert sorted(woken, key=lambda k: k.value) == [UpstreamKind.DECODE, UpstreamKind.PREFILL]

                loop = asyncio.get_running_loop()
                started = loop.time()
                refused = await client.post(slow_url + "/v1/completions", json={"prompt": "x"},
                                            headers={"Authorization": "Bearer k"})
                waited = loop.time() - started
                assert refused.status_code == 503 and 0.5 <= waited < 10, (refused.status_code, waited)
                error = refused.json()["error"]
                assert error["code"] == "no_healthy_instance" and "0.5 s" in error["message"], error
                assert refused.headers["x-request-id"]
                assert sorted(slow_woken, key=lambda k: k.value) == [UpstreamKind.DECODE, UpstreamKind.PREFILL]
                slow_woken.clear()
                unauthorized = await client.post(slow_url + "/v1/completions", json={"prompt": "x"})
                assert unauthorized.status_code == 401 and slow_woken == []
                assert scale.waiting == slow.waiting == 0
        finally:
            for s in (server, slow_server, engine_server):
                s.should_exit = True
            await asyncio.gather(task, slow_task, engine_task)
        assert [u.url for u in proxy.decode.upstreams] == [engine_url] and slow_proxy.decode.upstreams == []

    asyncio.run(run())
