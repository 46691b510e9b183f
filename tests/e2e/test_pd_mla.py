"""MLA P/D between engines of different TP sizes, end to end (seed 003): real `kvbridge serve`
processes serving a tiny random-weight DeepSeek-V2 folder with MoE (built by `transformers`
in the test's temporary directory), a real `kvbridge proxy` per pairing, the openai client.

P TP 2 -> D TP 1, P TP 1 -> D TP 2 and P TP 2 -> D TP 2, over NIXL (the same reads over real tcp
agents, every pairing: tests/integration/test_tp_reads_settle_together.py; tcp between real processes:
test_pd_tensor_parallel.py, test_pd_hybrid_mamba.py):
- greedy text equals one colocated TP 1 engine's;
- P frees every rank's copy of the latent without a lease expiring (expired-lease counter 0,
  held-blocks gauge back to 0), every block is free on P and D afterwards;
- the bytes D moved per request are one copy of the request's latent cache per D rank: a D
  rank reads the latent from ONE P rank, never from each P rank that holds a replica.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvbridge.config import KVRole
from kvbridge.engine.loader import load_model
from kvbridge.engine.loader.synthetic import TINY_DEEPSEEK_V2_MOE, write_synthetic_folder
from tests.e2e.processes import metric
from tests.fleet import PROMPTS, SMOLLM2, FleetSpec, Member, Reference, assert_settled, complete

INSTANCES = {"p1": Member(KVRole.PRODUCER, 1), "p2": Member(KVRole.PRODUCER, 2), "d1": Member(KVRole.CONSUMER, 1),
             "d2": Member(KVRole.CONSUMER, 2)}
BLOCK_SIZE = 16  # kvbridge serve's default


@pytest.fixture(scope="module")
def mla_model(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("models") / "tiny-deepseek-v2-moe"
    write_synthetic_folder(folder, load_model(SMOLLM2).tokenizer, architecture="deepseek_v2", **TINY_DEEPSEEK_V2_MOE)
    return str(folder)


@pytest.fixture(scope="module")
def want(mla_model) -> Reference:
    return Reference(mla_model)


@pytest.fixture(scope="module")
def fleet(mla_model, fleets):
    return fleets.shared(FleetSpec.of(mla_model, "nixl", INSTANCES))


@pytest.mark.parametrize("prefill, decode", [("p2", "d1"), ("p1", "d2"), ("p2", "d2")])
def test_mla_pairings_answer_like_one_tp1_engine_and_move_one_latent_copy(fleet, mla_model, want, prefill, decode):
    arch, tok = want.loaded.arch, want.loaded.tokenizer
    latent_block_bytes = arch.num_layers * BLOCK_SIZE * arch.cache_head_size * 4  # one block, one copy
    d_tp = INSTANCES[decode].tp
    served, url, d_url = Path(mla_model).name, fleet.proxy(prefill, decode), fleet.urls[decode]
    for prompt in PROMPTS:
        prompt = f"[MLA {prefill} to {decode}] {prompt}"
        reads, moved = metric(d_url, "kvbridge_kv_transfers_total"), metric(d_url, "kvbridge_kv_transfer_bytes_total")
        assert complete(url, served, prompt) == want(prompt), (prefill, decode, prompt)
        assert metric(d_url, "kvbridge_kv_transfers_total") == reads + 1
        blocks = -(-len(tok.encode(prompt)) // BLOCK_SIZE)
        assert metric(d_url, "kvbridge_kv_transfer_bytes_total") - moved == d_tp * blocks * latent_block_bytes
    assert_settled(fleet, list(INSTANCES))  # every block free; no lease expired on any instance
    assert metric(fleet.urls[prefill], "kvbridge_kv_held_blocks") == 0
    assert metric(d_url, "kvbridge_kv_recomputed_requests_total") == 0
