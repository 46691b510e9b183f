"""TP splits and hetero-TP read mapping, exhaustively against a brute-force head-by-head copy."""

from __future__ import annotations

import ctypes
import itertools

import pytest
import torch

from kvbridge.engine.tp import TPSplitError, check_tp_split, rank_shard, shard_plan
from kvbridge.kv_transfer.tp_mapping import (HeadSpan, RankBlocks, RankKV, TPMappingError, block_read_descs,
                                             check_pairing, rank_reads, reads_per_remote_rank)

TP_SIZES = (1, 2, 4)
LAYERS, BLOCK_SIZE, HEAD_DIM, NUM_BLOCKS = 3, 4, 2, 5
HEAD_BYTES = LAYERS * 2 * BLOCK_SIZE * HEAD_DIM * 4  # fp32


# ---- the split --------------------------------------------------------------------------

@pytest.mark.parametrize("num_heads, num_kv_heads, tp", [
    (h * g, h, tp) for h in (1, 2, 3, 4, 8) for g in (1, 3) for tp in (1, 2, 3, 4, 6, 8, 9)])
def test_every_valid_split_covers_every_head_and_pairs_queries_with_their_kv_heads(num_heads, num_kv_heads, tp):
    try:
        plan = shard_plan(num_heads, num_kv_heads, tp)
    except TPSplitError:
        valid = num_heads % tp == 0 and (num_kv_heads % tp == 0 if tp <= num_kv_heads else tp % num_kv_heads == 0)
        assert not valid
        return
    assert sorted(h for s in plan for h in s.q_heads) == list(range(num_heads))  # each query head once
    assert {h for s in plan for h in s.kv_heads} == set(range(num_kv_heads))
    group = num_heads // num_kv_heads
    for s in plan:
        assert {q // group for q in s.q_heads} <= set(s.kv_heads)  # a rank's queries see its own KV heads
        assert s.num_kv_heads == max(1, num_kv_heads // tp)
    if tp > num_kv_heads:  # replicated: each KV head on tp / kv consecutive ranks
        assert [s.kv_heads.start for s in plan] == [r // (tp // num_kv_heads) for r in range(tp)]


@pytest.mark.parametrize("num_heads, num_kv_heads, tp, words", [
    (9, 3, 2, "does not divide the model's 9 attention heads"),
    (8, 4, 0, "must be >= 1"),
    (12, 6, 4, "does not divide the model's 6 KV heads"),
    (24, 4, 6, "not a multiple"),
])
def test_impossible_splits_are_refused_with_the_reason(num_heads, num_kv_heads, tp, words):
    with pytest.raises(TPSplitError, match=words):
        check_tp_split(num_heads, num_kv_heads, tp)


def test_the_default_models_natural_split_is_three():
    assert [tuple(s.kv_heads) for s in shard_plan(9, 3, 3)] == [(0,), (1,), (2,)]
    with pytest.raises(TPSplitError):
        rank_shard(9, 3, 2, 0)
    with pytest.raises(TPSplitError, match="intermediate"):
        check_tp_split(8, 4, 4, intermediate_size=6)


# ---- the read mapping ---------------------------------------------------------------------

def _layout(num_heads: int, num_kv_heads: int, tp: int) -> list[RankKV]:
    return [RankKV(s.rank, s.kv_heads, HEAD_BYTES) for s in shard_plan(num_heads, num_kv_heads, tp)]


def _apply(spans_by_rank: list[list[HeadSpan]], d: list[RankKV], p_bufs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Execute the spans byte by byte, block by block, as a transfer backend would."""
    out = []
    for rank, spans in zip(d, spans_by_rank):
        buf = torch.zeros(NUM_BLOCKS, rank.block_bytes, dtype=torch.uint8)
        for block in range(NUM_BLOCKS):
            for s in spans:
                src = p_bufs[s.remote_rank][block]
                buf[block, s.local_offset:s.local_offset + s.length] = src[s.remote_offset:s.remote_offset + s.length]
        out.append(buf)
    return out


def _splits(num_heads: int, num_kv_heads: int, tp: int) -> bool:
    try:
        check_tp_split(num_heads, num_kv_heads, tp)
        return True
    except TPSplitError:
        return False


CASES = [(kv * g, kv, p, d) for kv in (1, 2, 4, 8) for g in (1, 2, 4) for p in TP_SIZES for d in TP_SIZES
         if _splits(kv * g, kv, p) and _splits(kv * g, kv, d)]


@pytest.mark.parametrize("num_heads, num_kv_heads, p_tp, d_tp", CASES)
@pytest.mark.parametrize("salt", [0, 1, 5])
def test_every_d_rank_gets_exactly_its_heads_from_p_for_every_tp_pairing(num_heads, num_kv_heads, p_tp, d_tp, salt):
    torch.manual_seed(num_heads * 100 + p_tp * 10 + d_tp)
    full = torch.randn(NUM_BLOCKS, num_kv_heads, LAYERS, 2, BLOCK_SIZE, HEAD_DIM)  # the model's whole KV
    p, d = _layout(num_heads, num_kv_heads, p_tp), _layout(num_heads, num_kv_heads, d_tp)
    check_pairing(d, p)
    # Each P rank's cache: its own heads, head-major within a block, as bytes.
    p_bufs = [full[:, r.kv_heads.start:r.kv_heads.stop].contiguous().view(NUM_BLOCKS, -1).view(torch.uint8)
              for r in p]
    spans = [rank_reads(rank, p, salt) for rank in d]
    got = _apply(spans, d, p_bufs)
    for rank, buf in zip(d, got):
        # Brute force: the D rank's heads, copied head by head from the whole KV.
        want = torch.stack([full[:, h] for h in rank.kv_heads], dim=1).contiguous()
        assert torch.equal(buf.view(torch.float32).view(want.shape), want)
        # Few descriptors: one span per P rank the heads come from, covering the block exactly once.
        assert len(spans[rank.tp_rank]) == len({s.remote_rank for s in spans[rank.tp_rank]})
        assert sum(s.length for s in spans[rank.tp_rank]) == rank.block_bytes
    counts = reads_per_remote_rank(d, p, salt)
    brute = {r.tp_rank: sum(any(s.remote_rank == r.tp_rank for s in ss) for ss in spans) for r in p}
    assert counts == {k: v for k, v in brute.items() if v}


def test_replicas_are_spread_over_p_ranks_by_salt_and_rank():
    p = _layout(4, 1, 4)  # one KV head on four P ranks (e.g. MLA's latent, or TP above the KV heads)
    d = _layout(4, 1, 1)[0]
    assert {rank_reads(d, p, salt)[0].remote_rank for salt in range(8)} == {0, 1, 2, 3}
    two = _layout(4, 1, 2)
    assert rank_reads(two[0], p, 0)[0].remote_rank != rank_reads(two[1], p, 0)[0].remote_rank


def test_same_tp_reads_whole_blocks_from_the_same_rank():
    p = d = _layout(8, 4, 2)
    for rank in d:
        assert rank_reads(rank, p) == [HeadSpan(rank.tp_rank, 0, 0, rank.block_bytes)]


@pytest.mark.parametrize("local, remote, words", [
    ([RankKV(0, range(0, 2), 64)], [RankKV(0, range(0, 2), 32)], "head sizes"),
    ([RankKV(0, range(0, 2), 64)], [RankKV(0, range(0, 4), 64)], "different KV heads"),
    ([RankKV(1, range(0, 2), 64)], [RankKV(0, range(0, 2), 64)], "in order"),
    ([], [RankKV(0, range(0, 2), 64)], "no ranks"),
])
def test_unmappable_pairings_are_refused_with_the_reason(local, remote, words):
    with pytest.raises(TPMappingError, match=words):
        check_pairing(local, remote)


def test_a_head_nobody_holds_is_refused():
    with pytest.raises(TPMappingError, match="no remote rank holds KV head 3"):
        rank_reads(RankKV(0, range(2, 4), 64), [RankKV(0, range(0, 3), 64)])


def test_cases_cover_both_directions():
    pairs = {(p, d) for _, _, p, d in CASES}
    assert pairs == set(itertools.product(TP_SIZES, TP_SIZES))


# ---- the byte ranges of a request's read ------------------------------------------------

BLOCK_IDS = [  # (remote ids, local ids): runs consecutive on both sides, on one side only, none
    ([0, 1, 2, 3], [1, 2, 3, 4]),
    ([4, 0, 1, 3], [0, 3, 4, 1]),
    ([2], [2]),
    ([], []),
]


def _caches(ranks: list[RankKV], full: torch.Tensor | None) -> list[torch.Tensor]:
    """Each rank's real cache memory: its own heads of `full` (head-major blocks), or zeros."""
    if full is None:
        return [torch.zeros(NUM_BLOCKS, r.block_bytes, dtype=torch.uint8) for r in ranks]
    return [full[:, r.kv_heads.start:r.kv_heads.stop].contiguous().view(NUM_BLOCKS, -1).view(torch.uint8)
            for r in ranks]


@pytest.mark.parametrize("num_heads, num_kv_heads, p_tp, d_tp", CASES)
@pytest.mark.parametrize("remote_ids, local_ids", BLOCK_IDS)
def test_read_descriptors_copy_exactly_each_d_ranks_heads_of_the_requested_blocks(
        num_heads, num_kv_heads, p_tp, d_tp, remote_ids, local_ids):
    torch.manual_seed(num_heads * 100 + p_tp * 10 + d_tp)
    full = torch.randn(NUM_BLOCKS, num_kv_heads, LAYERS, 2, BLOCK_SIZE, HEAD_DIM)
    p, d = _layout(num_heads, num_kv_heads, p_tp), _layout(num_heads, num_kv_heads, d_tp)
    p_mem, d_mem = _caches(p, full), _caches(d, None)
    remote = [RankBlocks(r, m.data_ptr(), NUM_BLOCKS) for r, m in zip(p, p_mem)]
    for rank, mem in zip(d, d_mem):
        plan = block_read_descs(RankBlocks(rank, mem.data_ptr(), NUM_BLOCKS), remote, local_ids, remote_ids, 3)
        for p_rank, (l_descs, r_descs) in plan.items():  # what a backend's READ does with them
            assert [n for _, n in l_descs] == [n for _, n in r_descs]
            p_lo, p_hi = p_mem[p_rank].data_ptr(), p_mem[p_rank].data_ptr() + p_mem[p_rank].numel()
            for (l_addr, n), (r_addr, _) in zip(l_descs, r_descs):
                assert mem.data_ptr() <= l_addr and l_addr + n <= mem.data_ptr() + mem.numel()
                assert p_lo <= r_addr and r_addr + n <= p_hi
                ctypes.memmove(l_addr, r_addr, n)
        # Brute force: the requested blocks of the D rank's heads, head by head; the rest untouched.
        got = mem.view(torch.float32).view(NUM_BLOCKS, len(rank.kv_heads), LAYERS, 2, BLOCK_SIZE, HEAD_DIM)
        want = torch.zeros_like(got)
        for l_id, r_id in zip(local_ids, remote_ids):
            for i, h in enumerate(rank.kv_heads):
                want[l_id, i] = full[r_id, h]
        assert torch.equal(got, want)
        spans = rank_reads(rank, p, 3)
        assert sum(len(ld) for ld, _ in plan.values()) <= len(local_ids) * len(spans)
        assert sum(n for ld, _ in plan.values() for _, n in ld) == len(local_ids) * rank.block_bytes


def test_equal_tp_reads_a_run_of_consecutive_blocks_as_one_descriptor():
    p = d = _layout(8, 4, 2)
    remote = [RankBlocks(r, 1 << 20, 64) for r in p]
    plan = block_read_descs(RankBlocks(d[1], 1 << 30, 64), remote, [5, 6, 7, 9], [10, 11, 12, 20])
    bb = d[1].block_bytes
    assert plan == {1: ([(2**30 + 5 * bb, 3 * bb), (2**30 + 9 * bb, bb)],
                        [(2**20 + 10 * bb, 3 * bb), (2**20 + 20 * bb, bb)])}


def test_a_head_slice_of_each_block_is_one_descriptor_per_block_when_d_tp_exceeds_p_tp():
    p, d = _layout(8, 4, 1), _layout(8, 4, 2)
    plan = block_read_descs(RankBlocks(d[1], 1 << 30, 8), [RankBlocks(p[0], 1 << 20, 8)], [0, 1], [0, 1])
    half = d[1].block_bytes
    assert plan == {0: ([(2**30, half), (2**30 + half, half)], [(2**20 + half, half), (2**20 + 3 * half, half)])}


@pytest.mark.parametrize("local_ids, remote_ids, words", [
    ([0, 8], [0, 1], "local block id out of range"),
    ([0, 1], [0, 8], "remote block id out of range"),
    ([0], [0, 1], "2 remote blocks for 1 local blocks"),
])
def test_read_descriptors_refuse_bad_block_ids(local_ids, remote_ids, words):
    p = d = _layout(8, 4, 1)
    with pytest.raises(TPMappingError, match=words):
        block_read_descs(RankBlocks(d[0], 1 << 30, 8), [RankBlocks(p[0], 1 << 20, 8)], local_ids, remote_ids)
