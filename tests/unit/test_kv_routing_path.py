"""Every request's P/D path and reason: a response header (streamed and not) and a counter."""

from __future__ import annotations

import pytest

from tests.unit.proxy_cluster import COMPLETION, pd_cluster

pytestmark = pytest.mark.timeout(60)
ERROR = b'{"error": {"message": "engine failed", "type": "server_error", "code": 500}}'


def path_of(r) -> tuple[str | None, str | None]:
    return r.headers.get("x-kvbridge-pd-path"), r.headers.get("x-kvbridge-pd-reason")


@pytest.mark.parametrize("stream", [False, True])
async def test_a_prefilled_request_names_its_path(stream: bool) -> None:
    async with pd_cluster() as pd:
        r = await pd.http.post("/v1/completions", json={**COMPLETION, "stream": stream})
        assert r.status_code == 200 and path_of(r) == ("prefill_decode", "forced")
        await pd.metrics_show('kvbridge_proxy_pd_path_total{path="prefill_decode",reason="forced"} 1.0')


async def test_the_fallback_names_why_decode_served_alone() -> None:
    async with pd_cluster() as pd:
        pd.prefill[0].error = (503, ERROR)
        r = await pd.http.post("/v1/completions", json={**COMPLETION, "stream": True})
        assert r.status_code == 200 and path_of(r) == ("decode_only", "prefill_failed")
        await pd.metrics_show('kvbridge_proxy_pd_path_total{path="decode_only",reason="prefill_failed"} 1.0')
    async with pd_cluster(health_interval_s=0.05) as pd:
        pd.prefill[0].healthy = False
        await pd.wait_health("prefill", 0, False)
        r = await pd.http.post("/v1/completions", json=COMPLETION)
        assert r.status_code == 200 and path_of(r) == ("decode_only", "no_prefill_healthy")
