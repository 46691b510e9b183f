"""Seed 002: when D rejects a request with a remote prefill before admission, P frees the
request's blocks at once (not at lease expiry) — through real API servers on loopback."""

import time

import httpx
import pytest

from kvbridge.chaos import ThreadServer
from kvbridge.config import CacheConfig, EngineConfig, KVRole, KVTransferConfig
from kvbridge.engine.engine import LLMEngine
from kvbridge.engine.kv_connector_factory import build_connectors
from kvbridge.engine.loader import load_model
from kvbridge.server.api_server import build_app
from kvbridge.server.async_engine import AsyncEngine

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def servers():
    loaded = load_model(MODEL)

    def engine(role, eid):
        config = EngineConfig(cache=CacheConfig(num_blocks=64), max_model_len=512, num_threads=1,
                              kv_transfer=KVTransferConfig(role=role, backend="tcp", engine_id=eid, lease_seconds=60))
        return AsyncEngine(LLMEngine(config, loaded, build_connectors(config, loaded.arch, loaded.name)))
    p, d = engine(KVRole.PRODUCER, "P"), engine(KVRole.CONSUMER, "D")
    srv = ThreadServer(build_app(p)), ThreadServer(build_app(d))
    yield p, srv[0].url, d, srv[1].url
    for s in srv:
        s.stop()
    p.shutdown()
    d.shutdown()


BAD = {"zero max_tokens": {"max_tokens": 0}, "unknown model": {"model": "nope"},
       "prompt too long": {"max_tokens": 600}, "wrong type": {"temperature": "hot"}}


@pytest.mark.parametrize("cause", list(BAD))
def test_d_rejection_frees_p_blocks_at_once(servers, cause):
    p, p_url, d, d_url = servers
    body = {"model": MODEL, "prompt": "Tell me about dragons.", "max_tokens": 1}
    params = httpx.post(p_url + "/v1/completions", timeout=60,
                        json={**body, "kv_transfer_params": {"do_remote_decode": True}}).json()["kv_transfer_params"]
    held = lambda: p.call_threadsafe(lambda e: e.metrics().num_held_for_remote).result(timeout=10)  # noqa: E731
    stats = lambda: p.call_threadsafe(  # noqa: E731
        lambda e: (e.connectors.worker.stats.early_releases, e.connectors.worker.stats.expired_leases)).result(timeout=10)
    assert held() == 1
    early, expired = stats()
    r = httpx.post(d_url + "/v1/completions", timeout=60, json={**body, **BAD[cause], "kv_transfer_params": params})
    assert r.status_code in (400, 404) and "error" in r.json()
    # D's release reaches P from D's engine thread and is applied on P's: poll for its effect.
    # The lease is 60 s, so a free within this (generous, load-proof) wait is the notification's;
    # the counters say so too: one early release, no expiry.
    deadline = time.monotonic() + 20.0
    while held() and time.monotonic() < deadline:
        time.sleep(0.005)
    assert held() == 0
    assert stats() == (early + 1, expired)
