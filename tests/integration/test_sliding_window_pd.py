"""P/D of a model with full-attention and sliding-window layers (two KV cache groups), in
process over real NIXL (UCX on loopback) and tcp: P, prefilling in chunks past the window,
keeps every block of a request D will read; D reads every group's blocks, and its own
prefix cache (partial and full hits) cuts what it reads per group. Greedy output equals the
colocated engine's; every block of every group is free on P and D afterwards, no lease expired.
"""

from __future__ import annotations

import pytest

from kvbridge.config import KVRole
from kvbridge.config import EngineConfig
from kvbridge.engine.kv_connector_factory import compatibility_of
from kvbridge.engine.loader import load_model
from kvbridge.engine.loader.synthetic import TINY_QWEN2_SLIDING, write_synthetic_folder
from kvbridge.engine.sampling_params import SamplingParams
from tests.integration.pd_harness import decode, make_engine, prefill, settle, tokens

GREEDY = SamplingParams(max_tokens=12, temperature=0)
BLOCK = 4  # the window (24 tokens) spans 6 blocks; prompts of ~40 tokens run past it


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("models") / "tiny-qwen2-sliding"
    write_synthetic_folder(folder, load_model("SmolLM2-135M-Instruct").tokenizer, architecture="qwen2",
                           **TINY_QWEN2_SLIDING)
    return load_model(str(folder))


@pytest.fixture(scope="module")
def prompts(model):
    tok = model.tokenizer
    base = ("The history of the Roman Empire spans many centuries, from the founding of the city on the Tiber "
            "by its legendary twins, through the kings, the republic and its civil wars, to the fall of ")
    prompts = [tok.encode(base + "Constantinople. Summarise it."), tok.encode(base + "the west. Who ruled first?")]
    assert min(map(len, prompts)) > TINY_QWEN2_SLIDING["sliding_window"] + 16
    return prompts


@pytest.fixture(scope="module")
def want(model, prompts):
    e = make_engine(model, None, block_size=BLOCK)
    try:
        return [e.generate([p], GREEDY)[0] for p in prompts]
    finally:
        e.shutdown()


def test_hybrid_compatibility_names_every_group_and_the_window(model):
    info = compatibility_of(EngineConfig(), model.arch, "m")
    assert info.kv_cache_groups == ("full_attention", "sliding_window:24")


@pytest.mark.parametrize("backend", ["nixl", "tcp"])
def test_hybrid_pd_with_partial_and_full_prefix_hits_on_d(model, prompts, want, backend):
    # P prefills in chunks of 8 tokens, far past the window, yet keeps every block for D to read.
    p = make_engine(model, KVRole.PRODUCER, backend_name=backend, block_size=BLOCK, max_num_batched_tokens=8)
    d = make_engine(model, KVRole.CONSUMER, backend_name=backend, block_size=BLOCK)
    try:
        assert len(d.kv_cache_manager.groups) == 2
        stats = d.connectors.worker.stats
        # 1. Nothing cached on D: it reads every block of both groups, none of them P's null block
        #    although P's chunks ran past the window.
        params = prefill(p, prompts[0])
        null = p.kv_cache_manager.pool.null_block.block_id
        assert len(params["remote_block_ids"]) == 2 and all(null not in g for g in params["remote_block_ids"])
        assert tokens(decode(d, p, prompts[0], params, GREEDY)) == want[0]
        assert stats.transfers == 1
        read_all = stats.bytes
        blocks = -(-len(prompts[0]) // BLOCK)
        assert read_all == 2 * blocks * d.runner.kv_cache[0].numel() * 4  # both groups, whole prompt
        # 2. A prompt sharing a long prefix: D reuses its cached blocks and reads only the tail.
        hits = d.metrics().prefix_cache_hits
        assert tokens(decode(d, p, prompts[1], prefill(p, prompts[1]), GREEDY)) == want[1]
        assert d.metrics().prefix_cache_hits > hits and stats.transfers == 2
        assert 0 < stats.bytes - read_all < read_all
        # 3. The first prompt again: D holds every full block and computes the short tail itself.
        before = stats.bytes
        assert tokens(decode(d, p, prompts[0], prefill(p, prompts[0]), GREEDY)) == want[0]
        assert stats.bytes == before
        settle(p, d)
        for e in (p, d):
            assert e.metrics().num_free_blocks == e.metrics().num_total_blocks
        assert p.connectors.worker.stats.expired_leases == 0 and p.metrics().num_held_for_remote == 0
    finally:
        p.shutdown()
        d.shutdown()
