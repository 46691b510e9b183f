"""The KV cache manager with a full-attention and a sliding-window group sharing one pool:
blocks behind the window go back to the pool as the request advances (the table keeps the
null block there), prefix-cache hits are ones every group can resume from, and every block
comes back when the request is freed."""

from __future__ import annotations

import pytest

from kvbridge.engine.block_pool import BlockPool
from kvbridge.engine.kv_cache_manager import KVCacheGroupSpec, KVCacheManager
from kvbridge.engine.request import Request
from kvbridge.engine.sampling_params import SamplingParams
from kvbridge.shape.kv_groups import KVCacheKind

BS, WINDOW = 4, 5


def manager(num_blocks: int = 33, caching: bool = True) -> KVCacheManager:
    groups = [KVCacheGroupSpec(KVCacheKind.FULL_ATTENTION, BS, (0,)),
              KVCacheGroupSpec(KVCacheKind.SLIDING_WINDOW, BS, (1,), sliding_window=WINDOW)]
    return KVCacheManager(BlockPool(num_blocks, caching, reserve_null=True), groups)


def request(rid: str, n: int = 20) -> Request:
    return Request(rid, list(range(100, 100 + n)), SamplingParams(max_tokens=8, temperature=0))


def compute(kvm: KVCacheManager, req: Request, n: int) -> list[list[int]]:
    """Allocate n tokens, 'compute' them, publish full blocks; returns the block tables."""
    ids = kvm.allocate_slots(req, n)
    assert ids is not None
    req.num_computed_tokens += n
    kvm.cache_blocks(req, req.num_computed_tokens)
    return [list(t) for t in ids]


@pytest.mark.parametrize("first_needed, position", [(0, 0), (0, 7), (1, 8), (1, 11), (2, 12), (4, 20), (5, 24)])
def test_first_needed_block_is_the_first_one_the_window_still_reads(first_needed, position):
    group = KVCacheGroupSpec(KVCacheKind.SLIDING_WINDOW, BS, (1,), sliding_window=WINDOW)
    assert group.first_needed_block(position) == first_needed
    assert KVCacheGroupSpec(KVCacheKind.FULL_ATTENTION, BS, (0,)).first_needed_block(position) == 0


def test_blocks_behind_the_window_are_freed_as_the_request_advances():
    kvm = manager()
    null = kvm.pool.null_block.block_id
    req = request("a", 20)
    full, sliding = compute(kvm, req, 20)  # the prompt: every block written, nothing freed yet
    assert len(full) == len(sliding) == 5 and null not in full + sliding
    assert kvm.num_free_blocks == 32 - 10
    for position in range(20, 29):  # decode: one token at a time
        full_now, sliding_now = compute(kvm, req, 1)
        first = max(0, position - WINDOW + 1) // BS
        assert full_now[:5] == full  # full attention keeps every block
        assert sliding_now[:first] == [null] * first and null not in sliding_now[first:]
        held = len(full_now) + len(sliding_now) - first
        assert kvm.num_free_blocks == 32 - held
    kvm.free("a")
    assert kvm.num_free_blocks == 32


def test_chunked_prefill_drops_the_window_tail_between_chunks():
    kvm = manager()
    null = kvm.pool.null_block.block_id
    req = request("a", 24)
    compute(kvm, req, 8)
    _, sliding = compute(kvm, req, 8)  # chunk 2 starts at 8: the window from 4 needs block 1 on
    assert sliding[0] == null and null not in sliding[1:]
    _, sliding = compute(kvm, req, 8)  # chunk 3 starts at 16: needs block 3 on
    assert sliding[:3] == [null] * 3 and null not in sliding[3:]


def test_prefix_hit_needs_every_full_block_and_only_the_sliding_window():
    kvm = manager()
    null = kvm.pool.null_block.block_id
    a = request("a", 20)
    compute(kvm, a, 20)
    compute(kvm, a, 1)  # block 0..3 of the sliding group go back to the pool, still cached
    kvm.free("a")
    b = request("b", 20)
    hits, n = kvm.get_computed_blocks(b)
    assert n == 16  # 4 blocks: at least one prompt token is left to compute
    full, sliding = hits
    assert len(full) == len(sliding) == 4 and null not in [x.block_id for x in full]
    # The next query (position 16) sees positions 12..16: sliding block 3 only.
    assert [x.block_id for x in sliding[:3]] == [null] * 3 and sliding[3].block_id != null
    ids = kvm.allocate_slots(b, 4, hits)
    assert ids is not None and ids[1][:3] == [null] * 3
    kvm.free("b")
    assert kvm.num_free_blocks == 32


def test_a_lost_window_block_shortens_the_hit_to_one_every_group_can_resume_from():
    kvm = manager()
    a = request("a", 20)
    _, sliding = compute(kvm, a, 20)
    kvm.free("a")
    kvm.invalidate_blocks({sliding[3]})  # the sliding block of tokens 12..15 leaves the cache
    hits, n = kvm.get_computed_blocks(request("b", 20))
    # 4 blocks would need sliding block 3; 3 blocks need sliding block 2 (window from 8): cached.
    assert n == 12 and [x.block_id for x in hits[1]][2] == sliding[2]
    kvm.invalidate_blocks({sliding[2]})
    hits, n = kvm.get_computed_blocks(request("c", 20))
    assert n == 8  # 2 blocks need sliding block 1 (window from 4)


def test_without_caching_there_is_no_hit_and_everything_is_freed():
    kvm = manager(caching=False)
    a = request("a", 20)
    compute(kvm, a, 20)
    compute(kvm, a, 1)
    kvm.free("a")
    assert kvm.get_computed_blocks(request("b", 20)) == (([], []), 0)
    assert kvm.num_free_blocks == 32 and kvm.pool.num_usable_blocks == 32


def test_sliding_groups_need_a_null_block_and_same_block_sizes():
    groups = [KVCacheGroupSpec(KVCacheKind.SLIDING_WINDOW, BS, (0,), sliding_window=WINDOW)]
    with pytest.raises(ValueError, match="null block"):
        KVCacheManager(BlockPool(8), groups)
    with pytest.raises(ValueError, match="same block size"):
        KVCacheManager(BlockPool(8, reserve_null=True),
                       groups + [KVCacheGroupSpec(KVCacheKind.FULL_ATTENTION, 2 * BS, (1,))])
    with pytest.raises(ValueError, match="sliding_window"):
        KVCacheGroupSpec(KVCacheKind.SLIDING_WINDOW, BS, (0,))


def test_a_request_a_decode_instance_will_read_keeps_and_needs_its_whole_context():
    from kvbridge.kv_transfer.params import parse_kv_transfer_params
    kvm = manager()
    null = kvm.pool.null_block.block_id
    a = request("a", 20)
    a.kv_transfer_params = parse_kv_transfer_params({"do_remote_decode": True})
    assert a.keeps_whole_context
    for _ in range(5):
        _, sliding = compute(kvm, a, 4)  # chunks well past the window: nothing dropped
    assert null not in sliding and len(sliding) == 5
    kvm.free("a")
    plain = request("b", 20)
    plain_hit = kvm.get_computed_blocks(plain)[1]
    kvm.invalidate_blocks({sliding[0]})  # behind any window: only a whole-context hit needs it
    assert kvm.get_computed_blocks(request("c", 20))[1] == plain_hit == 16
    whole = request("d", 20)
    whole.kv_transfer_params = parse_kv_transfer_params({"do_remote_decode": True})
    hits, n = kvm.get_computed_blocks(whole)
    assert n == 0  # its first sliding block is gone: no block of a whole-context hit may be null
