"""Real faults between real processes on loopback (nixl backend): a prefill process
killed with SIGKILL before D reads, a prefill restarted under the same address, and a
wrong side-channel port. D follows its policy: recompute answers exactly what a clean
transfer would; fail answers HTTP 500 with an OpenAI error body. D stays alive."""

from __future__ import annotations

import time

import httpx
import pytest

from kvbridge.config import CacheConfig, EngineConfig, KVRole
from kvbridge.engine.engine import LLMEngine
from kvbridge.engine.loader import load_model
from kvbridge.engine.sampling_params import SamplingParams
from kvbridge.launcher.cluster import free_ports
from tests.e2e.processes import metric_total
from tests.fleet import SMOLLM2, Fleet, FleetSpec, Member

PROMPT = "Write one sentence about the moon and its influence on the tides of the ocean."
BODY = {"model": SMOLLM2, "prompt": PROMPT, "max_tokens": 6, "temperature": 0}
# Every prefill has the same engine id: a restart under the same address is the same peer to D.
PREFILL = Member(KVRole.PRODUCER, 1, ("--kv-engine-id", "P", "--kv-lease-seconds", "5"))
# A fresh prefill for each test (each kills its own), started with the decoders: a server spends
# its seconds of start-up on about one core, so started together they use both.
SPARES = ("prefill-0", "prefill-1")
MEMBERS = {"d-recompute": Member(KVRole.CONSUMER, 1, ("--kv-engine-id", "D1", "--kv-handshake-timeout", "2")),
           "d-fail": Member(KVRole.CONSUMER, 1, ("--kv-engine-id", "D2", "--kv-load-failure-policy", "fail",
                                                 "--kv-handshake-timeout", "2")),
           **{name: PREFILL for name in SPARES}}


@pytest.fixture(scope="module")
def want():
    loaded = load_model(SMOLLM2)
    e = LLMEngine(EngineConfig(cache=CacheConfig(num_blocks=64)), loaded)
    return loaded.tokenizer.decode(e.generate([loaded.tokenizer.encode(PROMPT)],
                                              SamplingParams(max_tokens=6, temperature=0))[0])


@pytest.fixture(scope="module")
def fleet(fleets):
    fleet = fleets.own(FleetSpec.of(SMOLLM2, "nixl", MEMBERS))
    fleet.spares = list(SPARES)
    try:
        yield fleet
    finally:
        fleet.stop()


def spare_prefill(fleet: Fleet) -> str:
    """A prefill no test used yet."""
    return fleet.spares.pop(0)


def prefill(fleet: Fleet, p: str) -> dict:
    r = httpx.post(fleet.urls[p] + "/v1/completions", timeout=60,
                   json={**BODY, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 200, r.text
    return r.json()["kv_transfer_params"]


def decode(fleet: Fleet, d: str, params: dict) -> httpx.Response:
    return httpx.post(fleet.urls[d] + "/v1/completions", json={**BODY, "kv_transfer_params": params}, timeout=60)


def kill(fleet: Fleet, name: str) -> None:
    child = fleet.child(name)
    child.popen.kill()
    child.popen.wait()


def test_killed_prefill_and_wrong_port_follow_each_policy(fleet, want):
    d_re, d_fail, p = "d-recompute", "d-fail", spare_prefill(fleet)
    params = prefill(fleet, p)
    assert decode(fleet, d_re, params).json()["choices"][0]["text"] == want  # a clean transfer first

    # A wrong side-channel port: the handshake is refused.
    bad = {**prefill(fleet, p), "remote_port": free_ports(1)[0]}
    assert decode(fleet, d_re, bad).json()["choices"][0]["text"] == want
    r = decode(fleet, d_fail, {**prefill(fleet, p), "remote_port": bad["remote_port"]})
    assert r.status_code == 500 and "KV transfer failed" in r.json()["error"]["message"]
    assert r.json()["error"]["code"] == "kv_transfer_failed"  # the proxy tells it from D's own failures

    # P dies with SIGKILL after answering, before D reads.
    params_re, params_fail = prefill(fleet, p), prefill(fleet, p)
    kill(fleet, p)
    assert decode(fleet, d_re, params_re).json()["choices"][0]["text"] == want
    r = decode(fleet, d_fail, params_fail)
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    assert "retried" in r.json()["error"]["message"]
    for d in (fleet.urls[d_re], fleet.urls[d_fail]):  # alive, counted, and nothing left allocated
        assert httpx.get(d + "/health").status_code == 200
        assert metric_total(d, "kvbridge_kv_failed_transfers_total") >= 2
        assert metric_total(d, "kvbridge_kv_cache_free_blocks") == metric_total(d, "kvbridge_kv_cache_total_blocks")


def test_prefill_restarted_under_the_same_address(fleet, want):
    d_re, p = "d-recompute", spare_prefill(fleet)
    d = fleet.urls[d_re]
    assert decode(fleet, d_re, prefill(fleet, p)).json()["choices"][0]["text"] == want  # D handshakes with P
    kill(fleet, p)
    fleet.forget(p)
    port = int(fleet.urls[p].rsplit(":", 1)[1])
    p2 = fleet.add(f"{p}-restarted", PREFILL, port=port, side_channel_port=fleet.side_channel_ports[p])  # same id, ports
    before = metric_total(d, "kvbridge_kv_failed_transfers_total")
    assert decode(fleet, d_re, prefill(fleet, f"{p}-restarted")).json()["choices"][0]["text"] == want
    assert metric_total(d, "kvbridge_kv_failed_transfers_total") == before  # re-handshook, no failure
    deadline = time.monotonic() + 10
    while metric_total(p2, "kvbridge_kv_held_blocks") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert metric_total(p2, "kvbridge_kv_held_blocks") == 0
