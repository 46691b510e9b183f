"""GET /kvbridge/kv_events and /kvbridge/load of an instance (server/api_server.py) on a real
engine: events off (or the null publisher) answer {"enabled": false} and record nothing; on, the
bound addresses with any-address hosts replaced by the listen host; the load's contract fields."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from kvbridge.config import CacheConfig, EngineConfig
from kvbridge.kv_events.config import parse_kv_events_config
from kvbridge.server.api_server import _advertised, build_app
from kvbridge.server.async_engine import AsyncEngine


@pytest.mark.parametrize(("endpoint", "listen", "want"), [
    ("tcp://127.0.0.1:5557", "0.0.0.0", "tcp://127.0.0.1:5557"),
    ("tcp://0.0.0.0:5557", "10.1.2.3", "tcp://10.1.2.3:5557"),
    ("tcp://*:5557", "10.1.2.3", "tcp://10.1.2.3:5557"),
    ("tcp://[::]:5557", "::1", "tcp://[::1]:5557"),
    ("tcp://0.0.0.0:5557", "0.0.0.0", "tcp://127.0.0.1:5557"),
    ("ipc:///tmp/kv", "10.1.2.3", "ipc:///tmp/kv"),
])
def test_the_advertised_endpoint_names_a_reachable_host(endpoint, listen, want):
    assert _advertised(endpoint, listen) == want


def _get(engine: AsyncEngine, path: str, listen_host: str = "127.0.0.1") -> dict:
    async def go() -> httpx.Response:
        app = build_app(engine, listen_host=listen_host)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://kvbridge") as c:
            return await c.get(path)
    r = asyncio.run(go())
    assert r.status_code == 200
    return r.json()


@pytest.mark.parametrize("events", [None, '{"enable_kv_cache_events": true, "publisher": "null"}',
                                    '{"enable_kv_cache_events": false}'])
def test_no_events_published_answers_disabled_and_records_nothing(events):
    cfg = EngineConfig(num_threads=1, cache=CacheConfig(num_blocks=8),
                       kv_events=parse_kv_events_config(events) if events else None)
    engine = AsyncEngine.from_config(cfg)
    try:
        assert _get(engine, "/kvbridge/kv_events") == {"enabled": False}
        load = _get(engine, "/kvbridge/load")
        assert {k: load[k] for k in ("waiting", "waiting_prefill_tokens", "running", "kv_blocks_total",
                                     "kv_blocks_free", "prefill_tokens_per_s", "decode_step_s",
                                     "kv_pull_bytes_per_s")} == {
            "waiting": 0, "waiting_prefill_tokens": 0, "running": 0, "kv_blocks_total": 8, "kv_blocks_free": 8,
            "prefill_tokens_per_s": None, "decode_step_s": None, "kv_pull_bytes_per_s": None}
        assert isinstance(load["kv_bytes_per_token"], int) and load["kv_bytes_per_token"] > 0
        assert engine.kv_events is None
    finally:
        engine.shutdown()


def test_events_on_advertise_the_bound_ports_and_the_hash_root():
    cfg = EngineConfig(num_threads=1, cache=CacheConfig(num_blocks=8), kv_events=parse_kv_events_config(
        '{"enable_kv_cache_events": true, "replay_endpoint": "tcp://127.0.0.1:*"}'))
    engine = AsyncEngine.from_config(cfg)
    try:
        info = _get(engine, "/kvbridge/kv_events", listen_host="127.0.0.1")
        assert info["enabled"] is True and info["topic"] == "" and info["block_size"] == 16
        assert info["endpoint"].startswith("tcp://127.0.0.1:") and not info["endpoint"].endswith(":*")
        assert info["replay_endpoint"].startswith("tcp://127.0.0.1:") and info["data_parallel_rank"] == 0
        assert len(bytes.fromhex(info["hash_root"])) == 32
    finally:
        engine.shutdown()
