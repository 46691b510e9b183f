"""Block pool and KV cache manager: reference counts, prefix cache, LRU eviction, groups."""

import pytest

from kvbridge.engine.block_pool import BlockPool
from kvbridge.engine.kv_cache_manager import KVCacheGroupSpec, KVCacheManager
from kvbridge.engine.request import Request
from kvbridge.engine.sampling_params import SamplingParams
from kvbridge.shape.kv_groups import KVCacheKind


def make_kvm(num_blocks=8, block_size=4, caching=True, groups=1):
    specs = [KVCacheGroupSpec(KVCacheKind.FULL_ATTENTION, block_size, (0,)) for _ in range(groups)]
    return KVCacheManager(BlockPool(num_blocks, caching), specs)


def req(rid, tokens):
    return Request(rid, list(tokens), SamplingParams(max_tokens=4, temperature=0))


def test_allocate_and_free_returns_every_block():
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    assert pool.num_free_blocks == 1
    pool.free(blocks)
    assert pool.num_free_blocks == 4


def test_allocate_more_than_free_raises_and_changes_nothing():
    pool = BlockPool(2)
    with pytest.raises(ValueError):
        pool.allocate(3)
    assert pool.num_free_blocks == 2


def test_double_free_is_detected():
    pool = BlockPool(2)
    blocks = pool.allocate(1)
    pool.free(blocks)
    with pytest.raises(RuntimeError):
        pool.free(blocks)


def test_prefix_hit_reuses_cached_blocks_and_leaves_last_token():
    kvm = make_kvm()
    a = req("a", range(12))  # 3 full blocks of 4
    hits, n = kvm.get_computed_blocks(a)
    assert n == 0
    kvm.allocate_slots(a, 12, hits)
    a.num_computed_tokens = 12
    kvm.cache_blocks(a, 12)
    ids_a = kvm.get_block_ids("a")
    kvm.free("a")
    b = req("b", range(12))
    hits, n = kvm.get_computed_blocks(b)
    assert n == 8  # at most (12 - 1) // 4 = 2 blocks, so one token is left to compute
    ids_b = kvm.allocate_slots(b, 4, hits)
    assert ids_b[0][:2] == ids_a[0][:2]
    kvm.free("b")
    assert kvm.num_free_blocks == 8


def test_shared_prefix_blocks_are_refcounted():
    kvm = make_kvm()
    a, b = req("a", range(9)), req("b", range(9))
    kvm.allocate_slots(a, 9)
    a.num_computed_tokens = 9
    kvm.cache_blocks(a, 9)
    hits, n = kvm.get_computed_blocks(b)
    assert n == 8
    kvm.allocate_slots(b, 1, hits)
    assert kvm.pool.blocks[kvm.get_block_ids("a")[0][0]].ref_cnt == 2
    kvm.free("a")
    kvm.free("b")
    assert kvm.num_free_blocks == 8


def test_lru_evicts_oldest_cached_block_first():
    kvm = make_kvm(num_blocks=2, block_size=4)
    a = req("a", range(5))
    kvm.allocate_slots(a, 5)
    a.num_computed_tokens = 5
    kvm.cache_blocks(a, 5)
    kvm.free("a")  # block 0 cached (full), block 1 not; tail freed first
    c = req("c", [99] * 4)
    kvm.allocate_slots(c, 4)  # takes the uncached tail block first
    kvm.free("c")
    b = req("b", range(5))
    assert kvm.get_computed_blocks(b)[1] == 4


def test_invalidated_blocks_leave_the_prefix_cache():
    kvm = make_kvm()
    a = req("a", range(9))
    ids = kvm.allocate_slots(a, 9)
    kvm.cache_blocks(a, 9)
    kvm.invalidate_blocks(set(ids[0]))
    kvm.free("a")
    assert kvm.get_computed_blocks(req("b", range(9)))[1] == 0


def test_allocate_slots_fails_atomically_when_out_of_blocks():
    kvm = make_kvm(num_blocks=2, block_size=4)
    a = req("a", range(12))
    assert kvm.allocate_slots(a, 12) is None
    assert kvm.num_free_blocks == 2
    assert kvm.get_block_ids("a") == ([],)


def test_block_ids_are_a_tuple_with_one_list_per_group():
    kvm = make_kvm(num_blocks=8, groups=2)
    a = req("a", range(6))
    ids = kvm.allocate_slots(a, 6)
    assert isinstance(ids, tuple) and len(ids) == 2 and all(len(g) == 2 for g in ids)
    assert not set(ids[0]) & set(ids[1])
    kvm.free("a")
    assert kvm.num_free_blocks == 8


def test_can_allocate_agrees_with_allocate_slots_when_hits_are_free():
    kvm = make_kvm(num_blocks=3, block_size=4)
    a = req("a", range(9))
    kvm.allocate_slots(a, 9)
    a.num_computed_tokens = 9
    kvm.cache_blocks(a, 9)
    kvm.free("a")  # two cached free blocks, one plain free block
    b = req("b", range(9))
    hits, n = kvm.get_computed_blocks(b)
    assert n == 8
    assert kvm.can_allocate(b, 1, hits)  # touches 2 cached + takes 1 fresh = all 3
    assert not kvm.can_allocate(b, 5, hits)  # would need a 4th block
    assert kvm.allocate_slots(b, 5, hits) is None and kvm.num_free_blocks == 3
    assert kvm.allocate_slots(b, 1, hits) is not None
    kvm.free("b")
