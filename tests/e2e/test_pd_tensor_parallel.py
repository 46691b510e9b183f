"""P/D between engines of different tensor-parallel sizes, end to end: real `kvbridge serve`
processes (with their rank processes), a real `kvbridge proxy` per pairing, the official
openai client, on loopback.

- A random-weight Llama with 4 KV heads (TP 1, 2 and 4 split it): P TP 2 -> D TP 1,
  P TP 1 -> D TP 2 and P TP 2 -> D TP 2, over NIXL and over tcp.
- SmolLM2-135M (3 KV heads): P TP 3 -> D TP 1 and P TP 1 -> D TP 3, over NIXL; and KV reuse between
  TP sizes: a TP 1 P reads the conversation's history a TP 3 D holds, then D reads the rest from P.
Greedy text equals one colocated TP 1 engine's; afterwards every block is free on every
instance, no lease expired, and every request's KV was read (no recompute, no failure).
- A P rank process killed with SIGKILL after its prefill: D recomputes (the default policy)
  and answers what the colocated engine answers, frees its blocks and serves the next request.
"""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from kvbridge.config import KVRole
from kvbridge.engine.loader import load_model
from kvbridge.engine.sampling_params import SamplingParams
from kvbridge.launcher.cluster import kv_events_json
from kvbridge.engine.loader.synthetic import TINY_4_KV_HEADS, write_synthetic_folder
from tests.e2e.processes import gone, metric, rank_pids
from tests.fleet import MAX_TOKENS, PROMPTS, SMOLLM2, Fleet, FleetSpec, Member, Reference, assert_settled, complete


def check_pairing(fleet: Fleet, want: Reference, prefill: str, decode: str) -> None:
    """The prompts, made unique to the pairing (no prefix-cache hit from another pairing on D)."""
    reads_before = metric(fleet.urls[decode], "kvbridge_kv_transfers_total")
    url = fleet.proxy(prefill, decode)
    for prompt in PROMPTS:
        prompt = f"[{prefill} to {decode}] {prompt}"
        assert complete(url, fleet.served, prompt) == want(prompt), (prefill, decode, prompt)
    assert metric(fleet.urls[decode], "kvbridge_kv_transfers_total") == reads_before + len(PROMPTS)


# ---- the 4-KV-head model, NIXL and tcp ------------------------------------------------------

TINY = {"p1": Member(KVRole.PRODUCER, 1), "p2": Member(KVRole.PRODUCER, 2), "d1": Member(KVRole.CONSUMER, 1),
        "d2": Member(KVRole.CONSUMER, 2)}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("tiny-4-kv-heads")
    write_synthetic_folder(folder, load_model(SMOLLM2).tokenizer, **TINY_4_KV_HEADS)
    return str(folder)


@pytest.fixture(scope="module")
def tiny_want(tiny_model) -> Reference:
    return Reference(tiny_model)


@pytest.fixture(scope="module", params=["nixl", "tcp"])
def tiny_fleet(request, tiny_model, fleets):
    return fleets.shared(FleetSpec.of(tiny_model, request.param, TINY))


@pytest.mark.parametrize("prefill, decode", [("p2", "d1"), ("p1", "d2"), ("p2", "d2")])
def test_tiny_model_pairings_answer_like_one_tp1_engine(tiny_fleet, tiny_want, prefill, decode):
    tiny_fleet.note_expired_leases()
    check_pairing(tiny_fleet, tiny_want, prefill, decode)
    assert_settled(tiny_fleet, list(TINY))
    assert metric(tiny_fleet.urls[decode], "kvbridge_kv_recomputed_requests_total") == 0


# ---- SmolLM2 at its natural split, TP 3 ----------------------------------------------------

# p1, d1: the shared cluster's. Role both and KV events where KV reuse is tested: a TP 1 P ("p1r") reads the
# history a TP 3 D ("d3") holds, D reads the rest from P (proxy --kv-reuse on); the other pairings as before.
EVENTS = ("--kv-events-config", kv_events_json())
SMOL_TP3 = {"p3": Member(KVRole.PRODUCER, 3), "d3": Member(KVRole.BOTH, 3, EVENTS), "p1r": Member(KVRole.BOTH, 1, EVENTS)}


@pytest.fixture(scope="module")
def smol_want() -> Reference:
    return Reference(SMOLLM2)


@pytest.fixture(scope="module")
def smol_fleet(fleets, smollm2_pd):
    shared = smollm2_pd.get()  # tests/e2e/conftest.py: TP 1 P and D, NIXL, one thread each
    fleet = fleets.own(FleetSpec.of(SMOLLM2, "nixl", SMOL_TP3))
    fleet.adopt("p1", shared.urls.prefill[0])
    fleet.adopt("d1", shared.urls.decode[0])
    try:
        yield fleet
    finally:
        fleet.stop()


@pytest.mark.parametrize("prefill, decode", [("p3", "d1"), ("p1", "d3")])
def test_smollm2_tp3_pairings_answer_like_one_tp1_engine(smol_fleet, smol_want, prefill, decode):
    smol_fleet.note_expired_leases()
    recomputed = metric(smol_fleet.urls[decode], "kvbridge_kv_recomputed_requests_total")
    check_pairing(smol_fleet, smol_want, prefill, decode)
    assert_settled(smol_fleet, ["p1", "p3", "d1", "d3"])
    assert metric(smol_fleet.urls[decode], "kvbridge_kv_recomputed_requests_total") == recomputed


def test_a_tp1_prefill_reads_the_history_a_tp3_decode_holds(smol_fleet, smol_want):
    """KV reuse between TP sizes: turn 2's history is held by the TP 3 D that answered turn 1 and read
    by the TP 1 P (the hetero-TP read plan, the other way round), which prefills only the new tokens."""
    smol_fleet.note_expired_leases()
    url = smol_fleet.proxy("p1r", "d3", "--kv-reuse", "on", "--health-interval", "0.5")
    tok, d3 = smol_want.loaded.tokenizer, smol_fleet.urls["d3"]
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)

    def turn(prompt: list[int]) -> httpx.Response:
        r = httpx.post(url + "/v1/completions", json={"model": smol_fleet.served, "prompt": prompt, "max_tokens": 24,
                                                     "temperature": 0, "ignore_eos": True}, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == tok.decode(smol_want.engine.generate([prompt], greedy)[0])
        return r

    first = tok.encode("[reuse between TP sizes] " + PROMPTS[1])
    turn(first)
    second = first + smol_want.engine.generate([first], greedy)[0] + tok.encode(" Tell me more about the first.")
    whole = (len(second) - len(tok.encode(" Tell me more about the first.")) - 1) // 16 * 16
    deadline = time.monotonic() + 30
    while (cached := httpx.post(url + "/kvbridge/fleet/predict", json={"prompt": second}, timeout=10).json()
           ["cached"]).get(d3, 0) < whole:  # d3's KV events reach the proxy a moment after its answer
        assert time.monotonic() < deadline, cached
        time.sleep(0.1)
    r = turn(second)
    assert int(r.headers["x-kvbridge-kv-reused-tokens"]) == whole
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == whole
    assert_settled(smol_fleet, ["p1r", "d3"])


# ---- a P rank killed between its prefill and D's read (last: it takes p2 down) ---------------

def test_a_p_rank_killed_before_the_read_makes_d_recompute_and_serve_on(tiny_fleet, fleets, tiny_want):
    tiny_fleet.note_expired_leases()
    served = tiny_fleet.served
    p2, d1 = tiny_fleet.urls["p2"], tiny_fleet.urls["d1"]
    prompt = "[killed] " + PROMPTS[1]
    body = {"model": served, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    first = httpx.post(p2 + "/v1/completions", timeout=60,
                       json={**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    assert first.status_code == 200, first.text
    params = first.json()["kv_transfer_params"]
    ranks = rank_pids(tiny_fleet.child("p2").pid)
    assert len(ranks) == 2
    recomputed = metric(d1, "kvbridge_kv_recomputed_requests_total")
    try:
        os.kill(ranks[1], signal.SIGKILL)
        assert tiny_fleet.child("p2").popen.wait(timeout=60) != 0  # P fails cleanly and exits non-zero
        answer = httpx.post(d1 + "/v1/completions", json={**body, "kv_transfer_params": params}, timeout=120)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["text"] == tiny_want(prompt)  # recomputed on D, per the default policy
        assert metric(d1, "kvbridge_kv_recomputed_requests_total") == recomputed + 1
        check_pairing(tiny_fleet, tiny_want, "p1", "d1")  # D serves on, reading KV again
        assert_settled(tiny_fleet, ["p1", "d1", "d2"])
        assert gone(ranks) == []
    finally:
        fleets.retire(tiny_fleet)  # p2 is gone: the next test asking for this spec gets a new fleet
