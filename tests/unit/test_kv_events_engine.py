"""The instance side of KV events: the prefix cache's events (kv_cache_manager + block pool +
engine/kv_event_queue.py) and the engine's measured rates (engine/load_rates.py). A real engine
publishing them: tests/integration/test_kv_events_engine_real.py."""

from __future__ import annotations

import pytest

from kvbridge.engine.block_pool import BlockPool
from kvbridge.engine.kv_cache_manager import KVCacheGroupSpec, KVCacheManager
from kvbridge.engine.kv_event_queue import KVEventQueue
from kvbridge.engine.load_rates import LoadRateMeter
from kvbridge.engine.request import Request
from kvbridge.engine.sampling_params import SamplingParams
from kvbridge.kv_events.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvbridge.kv_events.hashing import block_hashes, model_root
from kvbridge.shape.kv_groups import KVCacheKind

BS = 4
ROOT = model_root("test-model")


def _manager(num_blocks: int = 16, events: KVEventQueue | None = None,
             groups: tuple[KVCacheGroupSpec, ...] = (KVCacheGroupSpec(KVCacheKind.FULL_ATTENTION, BS, (0,)),)):
    pool = BlockPool(num_blocks, reserve_null=any(g.sliding_window is not None for g in groups))
    return KVCacheManager(pool, groups, ROOT, events)


def _run(kvm: KVCacheManager, rid: str, prompt: list[int], output: list[int] = ()) -> Request:
    """Allocate and compute the prompt (and the output tokens) as the scheduler does, then free."""
    req = Request(rid, list(prompt), SamplingParams(max_tokens=64), frozenset())
    hits, n_hit = kvm.get_computed_blocks(req)
    assert kvm.allocate_slots(req, len(prompt) - n_hit, hits) is not None
    req.num_computed_tokens = len(prompt)
    kvm.cache_blocks(req, req.num_computed_tokens)
    for t in output:  # a decode step computes the token sampled before it
        req.output_token_ids.append(t)
        assert kvm.allocate_slots(req, 1) is not None
        req.num_computed_tokens += 1
        kvm.cache_blocks(req, req.num_computed_tokens)
    kvm.free(rid)
    return req


def test_stored_then_removed_then_cleared_in_order_with_the_hashes_a_router_computes():
    q = KVEventQueue()
    kvm = _manager(num_blocks=4, events=q)
    prompt = list(range(10, 19))  # 2 full blocks + 1 token
    _run(kvm, "a", prompt)
    ev = q.drain()
    assert len(ev) == 1 and isinstance(ev[0], BlockStored)
    assert ev[0].block_hashes == block_hashes(ROOT, prompt, BS)  # the router's hashes, from the token ids
    assert ev[0].parent_block_hash is None and ev[0].token_ids == prompt[:8] and ev[0].block_size == BS
    assert (ev[0].group_idx, ev[0].kv_cache_spec_kind, ev[0].medium) == (0, "full_attention", "GPU")
    assert q.drain() == []
    _run(kvm, "b", list(range(50, 62)))  # 3 fresh blocks out of 4: evicts cached ones, tail first
    ev = q.drain()
    removed = [e for e in ev if isinstance(e, BlockRemoved)]
    assert isinstance(ev[0], BlockRemoved) and isinstance(ev[-1], BlockStored)  # evicted while allocating
    assert {h for e in removed for h in e.block_hashes} <= set(block_hashes(ROOT, prompt, BS))
    assert [e.block_hashes for e in removed] == [block_hashes(ROOT, prompt, BS)[1:]]  # a prefix's end goes first
    kvm.reset_prefix_cache()
    assert q.drain() == [AllBlocksCleared()]
    assert kvm.num_free_blocks == 4


def test_generated_tokens_blocks_enter_the_cache_and_the_next_turn_hits_prompt_and_answer():
    q = KVEventQueue()
    kvm = _manager(events=q)
    prompt, answer = list(range(100, 106)), list(range(200, 210))
    _run(kvm, "turn1", prompt, answer)
    stored = [e for e in q.drain() if isinstance(e, BlockStored)]
    whole = prompt + answer  # 16 tokens, every one computed: 4 full blocks, 3 of them partly the answer's
    assert [h for e in stored for h in e.block_hashes] == block_hashes(ROOT, whole, BS)
    assert stored[1].parent_block_hash == stored[0].block_hashes[-1]  # chained across events
    turn2 = Request("turn2", whole + [7, 8, 9], SamplingParams(max_tokens=4), frozenset())
    _, hit = kvm.get_computed_blocks(turn2)
    assert hit == 4 * BS
    assert kvm.num_free_blocks == 16


def test_hybrid_groups_are_kept_apart_by_group_idx_and_kind():
    q = KVEventQueue()
    groups = (KVCacheGroupSpec(KVCacheKind.FULL_ATTENTION, BS, (0,)),
              KVCacheGroupSpec(KVCacheKind.SLIDING_WINDOW, BS, (1,), sliding_window=4))
    kvm = _manager(num_blocks=20, events=q, groups=groups)
    prompt = list(range(1, 14))
    _run(kvm, "a", prompt)
    stored = [e for e in q.drain() if isinstance(e, BlockStored)]
    by_group = {e.group_idx: e for e in stored}
    assert set(by_group) == {0, 1}
    assert by_group[0].block_hashes == by_group[1].block_hashes == block_hashes(ROOT, prompt, BS)
    assert by_group[1].kv_cache_spec_kind == "sliding_window" and by_group[1].kv_cache_spec_sliding_window == 4
    assert by_group[0].kv_cache_spec_sliding_window is None


def test_events_off_records_nothing_and_hashes_are_the_same():
    kvm = _manager()
    assert kvm.events is None and kvm.pool.on_removed is None
    req = _run(kvm, "a", list(range(9)))
    assert [int.from_bytes(d[-8:], "big") for d in req.block_hashes] == block_hashes(ROOT, list(range(9)), BS)


def test_a_full_queue_keeps_a_clear_so_subscribers_forget_rather_than_believe():
    q = KVEventQueue(max_events=2)
    q.removed(1, 0)
    q.removed(2, 0)
    q.removed(3, 0)
    assert q.drain() == [AllBlocksCleared(), BlockRemoved([3], "GPU", 0)] and q.overflows == 1


def test_load_rates_are_ewmas_none_until_measured():
    m = LoadRateMeter(alpha=0.5)
    assert (m.rates.prefill_tokens_per_s, m.rates.decode_step_s, m.rates.kv_pull_bytes_per_s) == (None, None, None)
    m.record_step(0.5, prefill_tokens=100, decode_tokens=2)
    m.record_step(0.25, prefill_tokens=100, decode_tokens=0)
    assert m.rates.prefill_tokens_per_s == pytest.approx(300.0)  # 200, then 400
    m.record_step(0.1, 0, 3)
    m.record_step(0.3, 0, 3)
    assert m.rates.decode_step_s == pytest.approx(0.2)
    m.record_step(0.0, 5, 0)  # no time: nothing measured
    m.record_pull(2.0, 1000)
    assert m.rates.kv_pull_bytes_per_s == pytest.approx(500.0) and m.rates.prefill_tokens_per_s == pytest.approx(300.0)
    with pytest.raises(ValueError):
        LoadRateMeter(alpha=0.0)


def test_a_step_of_decodes_with_one_recomputed_prompt_token_is_a_decode_step_not_a_slow_prefill():
    m = LoadRateMeter(alpha=0.5)
    m.record_step(0.25, prefill_tokens=1000, decode_tokens=0)  # a real prefill: 4000 tok/s
    for _ in range(10):  # D: a loaded request's last prompt token rides in a batch of 31 decodes
        m.record_step(0.05, prefill_tokens=1, decode_tokens=31)
    assert m.rates.prefill_tokens_per_s == pytest.approx(4000.0)
    assert m.rates.decode_step_s == pytest.approx(0.05)


def test_d_recomputing_one_loaded_prompt_token_alone_is_a_decode_like_step_not_a_slow_prefill():
    m = LoadRateMeter(alpha=0.5)
    m.record_step(0.02, prefill_tokens=1, decode_tokens=0)  # D's first step of a lone loaded request
    m.record_step(0.02, prefill_tokens=31, decode_tokens=0)
    assert m.rates.prefill_tokens_per_s is None and m.rates.decode_step_s == pytest.approx(0.02)
    m.record_step(0.25, prefill_tokens=1000, decode_tokens=0)
    assert m.rates.prefill_tokens_per_s == pytest.approx(4000.0)


def test_a_model_with_a_mamba_group_publishes_no_blocks_it_can_never_hit():
    q = KVEventQueue()
    groups = (KVCacheGroupSpec(KVCacheKind.FULL_ATTENTION, BS, (0,)), KVCacheGroupSpec(KVCacheKind.MAMBA, BS, (1,)))
    kvm = _manager(num_blocks=20, events=q, groups=groups)
    prompt = list(range(1, 14))
    _run(kvm, "a", prompt)
    assert q.drain() == []
    assert kvm.get_computed_blocks(Request("b", prompt, SamplingParams(max_tokens=4), frozenset()))[1] == 0
    assert kvm.num_free_blocks == 20


def test_mla_groups_carry_vllms_spec_kind():
    q = KVEventQueue()
    kvm = _manager(events=q, groups=(KVCacheGroupSpec(KVCacheKind.MLA, BS, (0,)),))
    _run(kvm, "a", list(range(9)))
    [stored] = q.drain()
    assert isinstance(stored, BlockStored) and stored.kv_cache_spec_kind == "mla_attention"


def test_a_reset_while_a_request_runs_lets_its_blocks_enter_the_cache_again():
    q = KVEventQueue()
    kvm = _manager(events=q)
    prompt = list(range(30, 39))  # 2 full blocks + 1 token
    req = Request("a", list(prompt), SamplingParams(max_tokens=64), frozenset())
    assert kvm.allocate_slots(req, len(prompt), kvm.get_computed_blocks(req)[0]) is not None
    req.num_computed_tokens = len(prompt)
    kvm.cache_blocks(req, req.num_computed_tokens)
    kvm.reset_prefix_cache()
    q.drain()
    for t in (1, 2, 3):  # three decode steps fill the third block
        req.output_token_ids.append(t)
        assert kvm.allocate_slots(req, 1) is not None
        req.num_computed_tokens += 1
        kvm.cache_blocks(req, req.num_computed_tokens)
    stored = [h for e in q.drain() if isinstance(e, BlockStored) for h in e.block_hashes]
    assert stored == block_hashes(ROOT, prompt + [1, 2, 3], BS)  # the reset blocks again, then the new one
    kvm.free("a")
    again = Request("b", prompt + [1, 2, 3, 4], SamplingParams(max_tokens=4), frozenset())
    assert kvm.get_computed_blocks(again)[1] == 3 * BS
