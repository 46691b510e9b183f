"""The proxy's health checks: every instance's `/health` is probed before the proxy serves and
then every interval (a dynamic pool's newcomers at once), and its pool marks it healthy or not
(routing.py); selection skips the unhealthy ones.

An instance that refuses the connection or answers non-200 (dead, draining, its engine failed)
leaves selection at that probe. One that answers late is busy, not dead: it leaves only after
MISSED_PROBES_TO_DROP late answers in a row (a hung one is gone within that many intervals plus
timeouts); any answer starts the count over. Dropping the only D on one late /health turned a
loaded fleet into 503s for everyone."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import httpx

from kvbridge.proxy.fleet_view import FleetView
from kvbridge.proxy.routing import Upstream, UpstreamPool

logger = logging.getLogger("kvbridge.proxy.proxy")  # the name these lines logged under before the split
MISSED_PROBES_TO_DROP = 3


class HealthChecks:
    """Owns the health loop's task. `client`: the proxy's pooled client (once it started);
    `headers`: what each probe sends (the upstream key); `fleet`: the router's fleet view, told
    what each probe found (fleet_view.py), or None."""

    def __init__(self, pools: tuple[UpstreamPool, ...], client: Callable[[], httpx.AsyncClient],
                 headers: dict[str, str], interval_s: float, timeout_s: float, fleet: FleetView | None = None) -> None:
        self._pools, self._client, self._headers, self._fleet = pools, client, headers, fleet
        self._interval_s, self._timeout_s = interval_s, timeout_s
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """One round now, then one every interval in the background."""
        await self.check_once()
        self._task = asyncio.create_task(self._loop(), name="kvbridge-proxy-health")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def check_once(self) -> None:
        await asyncio.gather(*(self.probe(pool, u) for pool in self._pools for u in pool.upstreams))

    async def probe(self, pool: UpstreamPool, upstream: Upstream) -> None:
        await self._probe(pool, upstream)
        if self._fleet is None:
            return
        if upstream.healthy:
            await self._fleet.refresh(self._client(), upstream.url, self._headers, self._timeout_s)
        else:
            await self._fleet.forget(upstream.url)

    async def _probe(self, pool: UpstreamPool, upstream: Upstream) -> None:
        try:
            r = await self._client().get(upstream.url + "/health", timeout=self._timeout_s, headers=self._headers)
        except httpx.TimeoutException:
            upstream.missed_probes += 1
            if upstream.missed_probes >= MISSED_PROBES_TO_DROP:
                pool.set_health(upstream, False, f"/health did not answer within {self._timeout_s:g} s, "
                                                 f"{upstream.missed_probes} times in a row")
            elif upstream.healthy:
                logger.info("%s instance %s answered no /health within %g s (%d of %d before it is dropped)",
                            pool.kind.value, upstream.url, self._timeout_s, upstream.missed_probes,
                            MISSED_PROBES_TO_DROP)
            return
        except httpx.HTTPError as exc:
            upstream.missed_probes = 0
            pool.set_health(upstream, False, f"/health failed: {exc!r}")
            return
        upstream.missed_probes = 0
        pool.set_health(upstream, r.status_code == 200, f"/health answered {r.status_code}")

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                await self.check_once()
            except Exception:  # the loop must outlive any one bad round
                logger.exception("health check round failed")
