"""P/D and the prefix cache's events: D caches (and publishes) the prompt it read and the answer it
generated, so a conversation's next turn on that D finds both locally; D measures its KV pulls;
P's cached prompt blocks are published while its lease holds them; every block back after."""

from __future__ import annotations

import pytest

from kvbridge.config import KVRole
from kvbridge.engine.engine import LLMEngine
from kvbridge.engine.kv_event_queue import KVEventQueue
from kvbridge.engine.loader import load_model
from kvbridge.engine.sampling_params import SamplingParams
from kvbridge.kv_events.events import BlockStored
from kvbridge.kv_events.hashing import block_hashes
from kvbridge.kv_transfer.backends.fake import FakeFabric
from tests.integration.pd_harness import decode, make_engine, prefill, settle, tokens


@pytest.fixture(scope="module")
def loaded():
    return load_model("SmolLM2-135M-Instruct")


def _record(e: LLMEngine) -> KVEventQueue:
    """Record the engine's prefix-cache events (as --kv-events-config would, without sockets)."""
    q = KVEventQueue()
    e.kv_cache_manager.record_events(q)
    return q


def test_d_caches_prompt_and_answer_and_the_next_turn_hits_both(loaded):
    fabric = FakeFabric(seed=3)
    p = make_engine(loaded, KVRole.PRODUCER, fabric.create_agent("P"), engine_id="P")
    d = make_engine(loaded, KVRole.CONSUMER, fabric.create_agent("D"), engine_id="D")
    try:
        pq, dq = _record(p), _record(d)
        prompt = list(range(500, 540))  # 2 full blocks + 8
        params = prefill(p, prompt)
        answer = tokens(decode(d, p, prompt, params, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)))
        settle(p, d)
        assert len(answer) == 24
        root, bs = d.hash_root, d.block_size
        p_stored = [h for e in pq.drain() if isinstance(e, BlockStored) for h in e.block_hashes]
        assert p_stored == block_hashes(root, prompt, bs)
        # D computed the prompt's KV (read) and all but the last answer token: 63 tokens, 3 full blocks.
        d_stored = [h for e in dq.drain() if isinstance(e, BlockStored) for h in e.block_hashes]
        assert d_stored == block_hashes(root, prompt + answer[:-1], bs)
        assert d.load().kv_pull_bytes_per_s is not None and d.load().kv_pull_bytes_per_s > 0
        # Turn 2 on the same D, no remote prefill: prompt + answer + the user's next words hit locally.
        hits_before = d.kv_cache_manager.prefix_hits
        outs = d.generate([prompt + answer + list(range(700, 720))], SamplingParams(max_tokens=1, temperature=0))
        assert len(outs[0]) == 1
        assert d.kv_cache_manager.prefix_hits - hits_before == 3 * bs
        for e in (p, d):
            assert e.kv_cache_manager.num_free_blocks == e.kv_cache_manager.pool.num_usable_blocks
    finally:
        settle(p, d)
        p.shutdown()
        d.shutdown()
