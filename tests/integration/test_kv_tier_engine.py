"""The KV tier (engine/kv_tier.py) on the real default model: a prompt's blocks evicted from a small
pool come back from the tier byte-equal to the KV the model computed, the next turn computes only
what the tier did not hold and answers as an engine without a tier; a flipped byte in the tier is
caught and that block recomputed (same answer); 32 concurrent requests on one tier-held prefix
cause one load; through the HTTP server the answer's cached_tokens counts the loaded tokens and
/metrics the tier's counters. TP 3: each rank keeps and verifies its own shard."""

from __future__ import annotations

import os

import pytest
import torch

from kvbridge.config import CacheConfig, EngineConfig
from kvbridge.server.async_engine import AsyncEngine
from kvbridge.engine.engine import LLMEngine
from kvbridge.engine.loader import LoadedModel
from kvbridge.engine.model_runner import ModelRunner
from kvbridge.engine.pacing import Pacer
from kvbridge.engine.sampling_params import SamplingParams
from tests.integration.api_instance import MODEL, Instance, loaded  # noqa: F401

BS = 16
POOL = 24  # blocks: a 200-token prompt takes 13
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def _engine(loaded: LoadedModel, tier_blocks: int = 64, tp: int = 1, num_blocks: int = POOL) -> LLMEngine:
    from kvbridge.engine.model_runner import kv_bytes_per_block
    from kvbridge.shape.dtypes import DTYPES
    per_block = kv_bytes_per_block(loaded.arch, BS, DTYPES["float32"], tp) * tp
    return LLMEngine(EngineConfig(model=MODEL, num_threads=2, tensor_parallel_size=tp,
                                  cache=CacheConfig(block_size=BS, num_blocks=num_blocks,
                                                    kv_offloading_bytes=tier_blocks * per_block)), loaded)


@pytest.fixture(scope="module")
def reference(loaded: LoadedModel) -> LLMEngine:  # noqa: F811
    """The same model without a tier (and without prefix caching): the answers to match."""
    engine = LLMEngine(EngineConfig(model=MODEL, num_threads=2, cache=CacheConfig(block_size=BS, num_blocks=64,
                                                                                  enable_prefix_caching=False)), loaded)
    yield engine
    engine.shutdown()


def _prompt(seed: int, n: int = 200) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, 20000, (n,), generator=g).tolist()


def _run(engine: LLMEngine, prompt: list[int]):
    """One request to the end; returns its final output (tokens gathered)."""
    rid = f"r-{os.urandom(4).hex()}"
    engine.add_request(rid, prompt, GREEDY)
    tokens, pacer = [], Pacer()
    while True:
        step = engine.step()
        for out in step.outputs:
            tokens.extend(out.new_token_ids)
            if out.finished:
                out.new_token_ids = tokens
                return out
        pacer.sleep_after(step.next_step)


def _pages(engine: LLMEngine) -> torch.Tensor:
    runner = engine.runner
    assert isinstance(runner, ModelRunner)
    return runner.layout.pages(runner.kv_cache)


def _cached_pages(engine: LLMEngine, prompt: list[int], n_blocks: int) -> list[torch.Tensor] | None:
    """Copies of the pages holding the prompt's first n_blocks blocks in the pool, or None if any left it."""
    kvm = engine.kv_cache_manager
    hashes = kvm.block_hashes(_request(prompt))
    blocks = [kvm.pool.get_cached_block((0, h)) for h in hashes[:n_blocks]]
    if any(b is None for b in blocks):
        return None
    pages = _pages(engine)
    return [pages[b.block_id].clone() for b in blocks]


def _request(prompt: list[int]):
    from kvbridge.engine.request import Request
    return Request("h", prompt, GREEDY, frozenset())


def _evict(engine: LLMEngine, seeds: range) -> None:
    for s in seeds:
        _run(engine, _prompt(s))


def test_evicted_blocks_come_back_byte_equal_and_the_turn_computes_only_the_rest(loaded, reference) -> None:  # noqa: F811
    engine = _engine(loaded)
    try:
        first = _prompt(1)
        _run(engine, first)
        full = len(first) // BS
        computed = _cached_pages(engine, first, full)
        assert computed is not None
        _evict(engine, range(10, 12))  # 26 fresh blocks through a pool of 24: every block of `first` goes
        assert _cached_pages(engine, first, 1) is None and engine.kv_tier.counters.stores >= full
        turn = first + _prompt(2, 20)
        out = _run(engine, turn)
        assert out.num_cached_tokens == full * BS  # every full block of the history, from the tier
        assert engine.kv_tier.counters.loaded_blocks == full and engine.kv_tier.counters.failed_blocks == 0
        reloaded = _cached_pages(engine, first, full)
        assert reloaded is not None
        assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(computed, reloaded))
        assert out.new_token_ids == _run(reference, turn).new_token_ids
        assert engine.metrics().num_free_blocks == POOL
    finally:
        engine.shutdown()


def test_a_flipped_byte_in_the_tier_is_caught_and_that_block_recomputed(loaded, reference) -> None:  # noqa: F811
    engine = _engine(loaded)
    try:
        first = _prompt(3)
        _run(engine, first)
        _evict(engine, range(20, 22))
        tier, kvm = engine.kv_tier, engine.kv_cache_manager
        hashes = kvm.block_hashes(_request(first))
        slot = tier._entries[(0, hashes[5])]
        f = engine.runner.tier
        off = slot * f.page_bytes + 1000
        os.pwrite(f.fd, bytes([os.pread(f.fd, 1, off)[0] ^ 0x01]), off)
        turn = first + _prompt(4, 20)
        out = _run(engine, turn)
        assert tier.counters.failed_blocks == 1 and (0, hashes[5]) not in tier
        assert out.num_cached_tokens == 5 * BS  # blocks 0-4 loaded and verified; from block 5 on computed
        assert out.new_token_ids == _run(reference, turn).new_token_ids
        assert engine.metrics().num_free_blocks == POOL
    finally:
        engine.shutdown()


def test_32_concurrent_requests_on_one_tier_held_prefix_cause_one_load(loaded, reference) -> None:  # noqa: F811
    engine = _engine(loaded, num_blocks=64, tier_blocks=128)
    try:
        shared = _prompt(5, 160)  # 10 blocks
        _run(engine, shared)
        _evict(engine, range(30, 35))  # 65 fresh blocks through a pool of 64
        assert _cached_pages(engine, shared, 1) is None
        turns = [shared + _prompt(100 + i, 8) for i in range(32)]
        rids = [f"c{i}" for i in range(32)]
        for rid, p in zip(rids, turns):
            engine.add_request(rid, p, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
        done, outs, pacer = set(), {}, Pacer()
        while len(done) < 32:
            step = engine.step()
            for out in step.outputs:
                outs.setdefault(out.request_id, []).extend(out.new_token_ids)
                if out.finished:
                    done.add(out.request_id)
                    assert out.num_cached_tokens == 160
            pacer.sleep_after(step.next_step)
        assert engine.kv_tier.counters.loads == 1 and engine.kv_tier.counters.loaded_blocks == 10
        ref = reference.generate(turns[:2], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
        assert [outs["c0"], outs["c1"]] == ref
        assert engine.metrics().num_free_blocks == 64
    finally:
        engine.shutdown()


def test_through_the_server_cached_tokens_and_metrics_count_the_tier(loaded) -> None:  # noqa: F811
    engine = _engine(loaded)
    inst = Instance(AsyncEngine(engine))
    try:
        client = inst.client()
        first = _prompt(7)
        client.completions.create(model=MODEL, prompt=first, max_tokens=2, temperature=0)
        for s in (40, 41):
            client.completions.create(model=MODEL, prompt=_prompt(s), max_tokens=2, temperature=0)
        turn = first + _prompt(8, 20)
        full = len(first) // BS
        r = client.completions.create(model=MODEL, prompt=turn, max_tokens=2, temperature=0)
        assert r.usage.prompt_tokens_details.cached_tokens == full * BS
        stream = client.completions.create(model=MODEL, prompt=turn + [5], max_tokens=2, temperature=0,
                                           stream=True, stream_options={"include_usage": True})
        usage = [c.usage for c in stream if c.usage is not None]
        # now from the pool: every full block of the turn before (its own 13 went in once computed)
        assert usage and usage[0].prompt_tokens_details.cached_tokens == len(turn) // BS * BS
        assert inst.metric("kvbridge_kv_tier_loaded_blocks_total") == full
        assert inst.metric("kvbridge_kv_tier_capacity_blocks") == 64
        assert inst.wait_all_blocks_free().num_free_blocks == POOL
    finally:
        inst.close()
        inst.engine.shutdown()


def test_tp3_ranks_keep_and_verify_their_own_shards(loaded, reference) -> None:  # noqa: F811
    engine = _engine(loaded, tp=3)  # SmolLM2 has 3 KV heads
    try:
        first = _prompt(9)
        _run(engine, first)
        _evict(engine, range(50, 52))
        turn = first + _prompt(10, 20)
        out = _run(engine, turn)
        assert out.num_cached_tokens == (len(first) // BS) * BS
        assert engine.kv_tier.counters.loaded_blocks == len(first) // BS  # from the tier, not the pool
        assert out.new_token_ids == _run(reference, turn).new_token_ids
        assert engine.metrics().num_free_blocks == POOL
    finally:
        engine.shutdown()


def test_a_tier_is_refused_where_it_cannot_serve(loaded) -> None:  # noqa: F811
    with pytest.raises(ValueError, match="prefix caching"):
        LLMEngine(EngineConfig(model=MODEL, cache=CacheConfig(num_blocks=8, enable_prefix_caching=False,
                                                              kv_offloading_bytes=1 << 30)), loaded)
    with pytest.raises(ValueError, match="smaller than one KV block"):
        LLMEngine(EngineConfig(model=MODEL, cache=CacheConfig(num_blocks=8, kv_offloading_bytes=10)), loaded)


def test_the_tiers_events_let_a_router_predict_what_it_serves_without_computing(loaded) -> None:  # noqa: F811
    """A real engine's KV events, read by the router's fleet index: after eviction the prefix cache
    holds none of the history (overlap 0) and the tier all of it (reusable = every full block), which
    is what the next turn then finds (cached_tokens)."""
    from kvbridge.kv_events.config import parse_kv_events_config
    from kvbridge.kv_events.events import KVEventBatch, encode_batch
    from kvbridge.kv_events.index import FleetIndex
    from kvbridge.engine.model_runner import kv_bytes_per_block
    from kvbridge.shape.dtypes import DTYPES

    per_block = kv_bytes_per_block(loaded.arch, BS, DTYPES["float32"])
    config = EngineConfig(model=MODEL, num_threads=2, cache=CacheConfig(block_size=BS, num_blocks=POOL,
                                                                       kv_offloading_bytes=64 * per_block),
                          kv_events=parse_kv_events_config(
                              '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:*"}'))
    engine = LLMEngine(config, loaded)
    batches: list[KVEventBatch] = []
    real = engine.publisher
    engine.publisher = type("Recorder", (), {"publish": lambda self, b: batches.append(b),
                                             "shutdown": lambda self: real.shutdown()})()
    try:
        first = _prompt(11)
        _run(engine, first)
        _evict(engine, range(60, 62))
        index = FleetIndex(engine.hash_root, engine.block_size)
        for seq, batch in enumerate(batches):
            index.ingest("e", [b"", seq.to_bytes(8, "big"), encode_batch(batch)])
        turn = first + _prompt(12, 20)
        hashes = index.hashes(turn[:-1])
        full = len(first) // BS
        assert (index.overlap_blocks("e", hashes), index.reusable_blocks("e", hashes)) == (0, full)
        assert _run(engine, turn).num_cached_tokens == full * BS
    finally:
        engine.shutdown()


@pytest.mark.parametrize("tier_blocks", [0, 64])
def test_a_dropped_engine_is_freed_at_once_not_by_the_cyclic_gc(loaded, tier_blocks) -> None:  # noqa: F811
    """No reference cycle through the engine (the scheduler once held one of its methods): its memory
    (weights, KV cache) goes back when the last reference does. With cycles, test lanes that build
    engine after engine grew by the engines' size each time until the kernel killed them."""
    import gc
    import weakref
    gc.collect()
    gc.disable()
    try:
        engine = _engine(loaded, tier_blocks=tier_blocks)
        _run(engine, _prompt(13, 40))
        engine.shutdown()
        ref = weakref.ref(engine)
        del engine
        assert ref() is None
    finally:
        gc.enable()
