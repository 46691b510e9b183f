"""P/D of a hybrid Mamba model (the tiny Bamba: Mamba2 mixers + one attention layer) end to end:
real `kvbridge serve` processes with their rank processes, real `kvbridge proxy`s, the openai
client, on loopback.

With kernel blocks of 4 tokens the tiny Bamba's logical block is 6 kernel blocks at TP 1 and 4
at TP 2 (shape/kv_cache_layout.py), so P and D at different TP sizes disagree on the ratio:
- P TP 2 -> D TP 1 over NIXL and P TP 1 -> D TP 2 over tcp, prefix caching off on D: greedy
  text equals one colocated engine's, every request's KV and Mamba states read, no recompute;
- P TP 2 -> D TP 1 with prefix caching on at D: the handshake refuses (both ratios named), and
  the load-failure policy decides: recompute answers the colocated text, fail answers HTTP 500;
  either D keeps serving, and P frees at once (no lease expires).
Every block of every group is free on every instance afterwards.
"""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from kvbridge.config import KVRole
from kvbridge.engine.loader import load_model
from kvbridge.engine.loader.synthetic import TINY_BAMBA, write_synthetic_folder
from tests.e2e.processes import metric
from tests.fleet import SMOLLM2, Fleet, FleetSpec, Member, Reference, assert_settled, complete

KERNEL = ("--block-size", "4")
NO_PREFIX = (*KERNEL, "--no-prefix-caching")
PROMPT = ("The history of the Roman Empire spans many centuries, from the founding of the city to the fall of "
          "Constantinople. Summarise its three most important turning points:")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("models") / "tiny-bamba"
    write_synthetic_folder(folder, load_model(SMOLLM2).tokenizer, architecture="bamba", **TINY_BAMBA)
    return str(folder)


@pytest.fixture(scope="module")
def want(model) -> Reference:
    return Reference(model)


def pd_answers_like_one_engine(fleet: Fleet, model: str, want: Reference, prefill: str, decode: str) -> None:
    d = fleet.urls[decode]
    reads = metric(d, "kvbridge_kv_transfers_total")
    url = fleet.proxy(prefill, decode)
    for prompt in (f"[{prefill} to {decode}] {PROMPT}", f"[{prefill} to {decode}] Hello"):
        assert complete(url, Path(model).name, prompt) == want(prompt), prompt
    assert metric(d, "kvbridge_kv_transfers_total") == reads + 2
    assert metric(d, "kvbridge_kv_recomputed_requests_total") == 0


def test_p_tp2_to_d_tp1_over_nixl_and_the_refusal_with_prefix_caching_on(model, want, fleets):
    instances = {"p2": Member(KVRole.PRODUCER, 2, KERNEL), "d1": Member(KVRole.CONSUMER, 1, NO_PREFIX),
                 "d1_prefix": Member(KVRole.CONSUMER, 1, KERNEL),
                 "d1_fail": Member(KVRole.CONSUMER, 1, (*KERNEL, "--kv-load-failure-policy", "fail"))}
    fleet = fleets.own(FleetSpec.of(model, "nixl", instances))
    try:
        pd_answers_like_one_engine(fleet, model, want, "p2", "d1")
        served = Path(model).name
        # Prefix caching on at D with P's ratio 4 and D's 6: refused at the handshake.
        prompt = f"[refused] {PROMPT}"
        d = fleet.urls["d1_prefix"]
        assert complete(fleet.proxy("p2", "d1_prefix"), served, prompt) == want(prompt)  # recomputed
        assert metric(d, "kvbridge_kv_recomputed_requests_total") == 1
        assert metric(d, "kvbridge_kv_handshake_failures_total", kind="layout_mismatch") >= 1
        assert metric(d, "kvbridge_kv_transfers_total") == 0
        with pytest.raises(openai.InternalServerError) as failed:
            complete(fleet.proxy("p2", "d1_fail"), served, prompt)
        body = str(failed.value)
        assert "has 4" in body and "has 6" in body and "--no-prefix-caching" in body, body
        # D keeps serving, colocated-style
        assert complete(fleet.urls["d1_fail"], served, "Hello") == want("Hello")
        assert_settled(fleet, list(instances))
    finally:
        fleet.stop()


def test_p_tp1_to_d_tp2_over_tcp(model, want, fleets):
    instances = {"p1": Member(KVRole.PRODUCER, 1, KERNEL), "d2": Member(KVRole.CONSUMER, 2, NO_PREFIX)}
    fleet = fleets.own(FleetSpec.of(model, "tcp", instances))
    try:
        pd_answers_like_one_engine(fleet, model, want, "p1", "d2")
        assert_settled(fleet, list(instances))
    finally:
        fleet.stop()
