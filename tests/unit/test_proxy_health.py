"""The proxy's health checks (proxy/health.py) against real HTTP servers on loopback: an
instance that answers /health late while it is busy is not a dead one. It stays selected until
it misses MISSED_PROBES_TO_DROP probes in a row; one that refuses the connection or answers
non-200 (dead, draining) leaves at once; a late one that answers again is kept and its count
starts over.

Found under load (the Ray autoscale test on two oversubscribed cores): the only D answered one
/health after the 2 s timeout, the router dropped it, and 112 requests got 503 "no healthy decode
instance" from a fleet whose every instance was alive."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import Response

from kvbridge.proxy.health import MISSED_PROBES_TO_DROP, HealthChecks
from kvbridge.proxy.routing import RoundRobinPolicy, UpstreamKind, UpstreamPool
from tests.unit.proxy_upstreams import serve

pytestmark = pytest.mark.timeout(60)
TIMEOUT_S = 0.2


class SlowHealth:
    """/health answers after `delay_s` (the probe's timeout is TIMEOUT_S) with `status`."""

    def __init__(self) -> None:
        self.delay_s, self.status = 0.0, 200
        self.app = FastAPI()

        @self.app.get("/health")
        async def health() -> Response:
            await asyncio.sleep(self.delay_s)
            return Response(status_code=self.status)


async def checks_for(url: str, client: httpx.AsyncClient) -> tuple[HealthChecks, UpstreamPool]:
    pool = UpstreamPool(UpstreamKind.DECODE, [url], RoundRobinPolicy())
    checks = HealthChecks((pool,), lambda: client, {}, interval_s=3600, timeout_s=TIMEOUT_S)
    await checks.check_once()
    assert pool.upstreams[0].healthy
    return checks, pool


async def test_late_answers_drop_an_instance_only_after_missed_probes_in_a_row() -> None:
    instance = SlowHealth()
    server = await serve(instance.app)
    try:
        async with httpx.AsyncClient() as client:
            checks, pool = await checks_for(server.url, client)
            upstream = pool.upstreams[0]
            instance.delay_s = 10 * TIMEOUT_S
            for _ in range(MISSED_PROBES_TO_DROP - 1):
                await checks.check_once()
                assert upstream.healthy, "one late /health dropped a busy instance"
            instance.delay_s = 0.0
            await checks.check_once()  # on time again: the count starts over
            instance.delay_s = 10 * TIMEOUT_S
            for _ in range(MISSED_PROBES_TO_DROP - 1):
                await checks.check_once()
                assert upstream.healthy
            await checks.check_once()
            assert not upstream.healthy and pool.healthy() == []
            instance.delay_s = 0.0
            await checks.check_once()  # answers again: re-admitted
            assert upstream.healthy
    finally:
        await server.stop()


@pytest.mark.parametrize("how", ["503", "refused"])
async def test_an_instance_that_says_no_or_is_gone_leaves_at_the_first_probe(how: str) -> None:
    instance = SlowHealth()
    server = await serve(instance.app)
    stopped = False
    try:
        async with httpx.AsyncClient() as client:
            checks, pool = await checks_for(server.url, client)
            if how == "503":
                instance.status = 503  # draining, or its engine failed
            else:
                await server.stop()  # nothing listens there any more
                stopped = True
            await checks.check_once()
            assert not pool.upstreams[0].healthy
    finally:
        if not stopped:
            await server.stop()
