"""TP splits and hetero-TP read mapping, exhaustively against a brute-force head-by-head copy."""

from __future__ import annotations

import ctypes
import itertools

import pytest
import torch

from kvbridge.kv_transfer.read_plan.tp_mapping import (HeadSpan, RankBlocks, RankKV, ReleaseNotice, TPMappingError,
                                             block_read_descs, check_pairing, plan_request_reads, rank_reads,
                                             reads_per_remote_rank, request_salt)
from kvbridge.shape.tp_split import TPSplitError, check_tp_split, rank_shard, shard_plan

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


# ---- one request's plan: which P rank is read, which are not, and how every one is freed ---------

LATENT_DIM = 9  # MLA: kv_lora_rank + qk_rope_head_dim values per token and layer, one "head"
LATENT_BYTES = LAYERS * 1 * BLOCK_SIZE * LATENT_DIM * 4  # [1 head, layers, 1 entry, block_size, dim], fp32
P_RID, GEN = "prefill-req-BBBB", 1234567


def _mla(tp: int) -> list[RankKV]:
    """An MLA engine's ranks: each holds the whole latent, the one KV "head" (replicated)."""
    return [RankKV(r, range(0, 1), LATENT_BYTES) for r in range(tp)]


LAYOUTS = {"mla": lambda tp: _mla(tp), "gqa-8x4": lambda tp: _layout(8, 4, tp),
           "gqa-4x1": lambda tp: _layout(4, 1, tp), "gqa-8x2": lambda tp: _layout(8, 2, tp)}
SALTS = [request_salt(f"prefill-req-{i}") for i in range(64)]


@pytest.mark.parametrize("p_tp", TP_SIZES)
@pytest.mark.parametrize("d_tp", TP_SIZES)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_plan_reads_each_head_once_from_one_p_rank_and_frees_every_p_rank(layout, p_tp, d_tp):
    p, d = LAYOUTS[layout](p_tp), LAYOUTS[layout](d_tp)
    for salt in SALTS:
        plan = plan_request_reads(d, p, salt, P_RID, GEN)
        assert plan == plan_request_reads(d, p, salt, P_RID, GEN)  # deterministic
        assert [r.local_rank for r in plan.ranks] == list(range(d_tp))
        for rank, rp in zip(d, plan.ranks):
            # The spans tile the D rank's block exactly once: each of its heads comes from one P rank.
            assert [(s.local_offset, s.length) for s in rp.spans] == \
                list(zip(itertools.accumulate([0] + [s.length for s in rp.spans[:-1]]),
                         [s.length for s in rp.spans]))
            assert rp.bytes_per_block == rank.block_bytes
            assert list(rp.spans) == rank_reads(rank, p, salt)
            for span in rp.spans:  # and from a P rank that holds those heads
                src = p[span.remote_rank]
                first = src.kv_heads.start + span.remote_offset // HEAD_BYTES if layout != "mla" else 0
                assert span.remote_offset + span.length <= src.block_bytes and first in src.kv_heads
            if layout == "mla":  # one copy of the latent per D rank, from one P rank
                assert len(rp.spans) == 1 and len(rp.remote_ranks) == 1
                assert rp.bytes_per_block == p[0].block_bytes == LATENT_BYTES
        assert sorted(plan.read + plan.unread) == list(range(p_tp)) and not set(plan.read) & set(plan.unread)
        assert set(plan.read) == {q for rp in plan.ranks for q in rp.remote_ranks}
        assert plan.pairs() == [(rp.local_rank, q) for rp in plan.ranks for q in rp.remote_ranks]
        # Every P rank, read or not, is freed by the one notice: P's request id and lease generation.
        assert plan.notice == ReleaseNotice(P_RID, GEN, tuple(range(p_tp)))
        if layout == "mla":  # D TP >= P TP: every P rank is read; D TP < P TP: D TP of them
            assert len(plan.read) == min(p_tp, d_tp) and len(plan.unread) == p_tp - min(p_tp, d_tp)
        if layout == "gqa-8x4" and p_tp <= 4:  # no replicas: every P rank is read
            assert plan.unread == ()


@pytest.mark.parametrize("p_tp", TP_SIZES)
@pytest.mark.parametrize("d_tp", TP_SIZES)
def test_the_mla_latent_read_is_spread_over_p_ranks_across_requests(p_tp, d_tp):
    salts = [request_salt(f"prefill-req-{i}") for i in range(400)]
    for rank in range(d_tp):
        counts = {q: 0 for q in range(p_tp)}
        for salt in salts:
            (chosen,) = plan_request_reads(_mla(d_tp), _mla(p_tp), salt, P_RID, GEN).ranks[rank].remote_ranks
            counts[chosen] += 1
        assert min(counts.values()) >= 400 / p_tp * 0.7, counts  # every P rank takes its share
    for salt in salts[:32]:  # within a request, D's ranks read different P ranks while there are enough
        plan = plan_request_reads(_mla(d_tp), _mla(p_tp), salt, P_RID, GEN)
        chosen = [rp.remote_ranks[0] for rp in plan.ranks]
        assert len(set(chosen)) == min(p_tp, d_tp)


@pytest.mark.parametrize("p_tp", TP_SIZES)
@pytest.mark.parametrize("d_tp", TP_SIZES)
@pytest.mark.parametrize("remote_ids, local_ids", BLOCK_IDS[:2])
def test_executing_an_mla_plan_copies_one_latent_per_d_rank(p_tp, d_tp, remote_ids, local_ids):
    torch.manual_seed(p_tp * 10 + d_tp)
    latent = torch.randn(NUM_BLOCKS, 1, LAYERS, 1, BLOCK_SIZE, LATENT_DIM)  # the same on every P rank
    p_mem = [latent.clone().view(NUM_BLOCKS, -1).view(torch.uint8) for _ in range(p_tp)]
    d_mem = [torch.zeros(NUM_BLOCKS, LATENT_BYTES, dtype=torch.uint8) for _ in range(d_tp)]
    local = [RankBlocks(r, m.data_ptr(), NUM_BLOCKS) for r, m in zip(_mla(d_tp), d_mem)]
    remote = [RankBlocks(r, m.data_ptr(), NUM_BLOCKS) for r, m in zip(_mla(p_tp), p_mem)]
    plan = plan_request_reads(_mla(d_tp), _mla(p_tp), request_salt(P_RID), P_RID, GEN)
    descs = plan.block_descs(local, remote, local_ids, remote_ids)
    assert sorted(descs) == plan.pairs()  # one READ per (D rank, P rank) pair, no other
    read = {}
    for (d_rank, p_rank), (l_descs, r_descs) in descs.items():
        p_lo = p_mem[p_rank].data_ptr()
        for (l_addr, n), (r_addr, m) in zip(l_descs, r_descs):
            assert n == m and p_lo <= r_addr and r_addr + n <= p_lo + p_mem[p_rank].numel()
            ctypes.memmove(l_addr, r_addr, n)
        read[d_rank] = read.get(d_rank, 0) + sum(n for _, n in l_descs)
    for d_rank, mem in enumerate(d_mem):
        assert read[d_rank] == len(local_ids) * LATENT_BYTES  # one copy of the latent, not P TP copies
        got = mem.view(torch.float32).view(latent.shape)
        want = torch.zeros_like(got)
        want[local_ids] = latent[remote_ids]
        assert torch.equal(got, want)


def test_seed_003_case():
    """vLLM's bug (seed 003): D TP 1 read the MLA latent from one of P's 4 ranks and told the
    other three to free with D's request id, which they did not know: they held their blocks
    until the lease expired. Here the plan names P's id for every P rank, read or not, and
    D's id is not even an input."""
    d_request_id, p_request_id = "decode-req-AAAA", "prefill-req-BBBB"
    plan = plan_request_reads(_mla(1), _mla(4), request_salt(p_request_id), p_request_id, 42)
    ((d_rank, chosen),) = plan.pairs()
    assert d_rank == 0 and plan.read == (chosen,) and chosen == request_salt(p_request_id) % 4
    assert sorted(plan.unread) == sorted({0, 1, 2, 3} - {chosen}) and len(plan.unread) == 3
    assert plan.notice == ReleaseNotice(p_request_id, 42, (0, 1, 2, 3))
    assert set(plan.unread) <= set(plan.notice.remote_ranks)  # the three unread ranks: freed by P's id
    assert d_request_id not in repr(plan)


@pytest.mark.parametrize("rid, gen, words", [("", 1, "request id"), (None, 1, "request id"),
                                              ("p", "1", "generation"), ("p", True, "generation")])
def test_a_plan_needs_ps_request_id_and_generation(rid, gen, words):
    with pytest.raises(TPMappingError, match=words):
        plan_request_reads(_mla(1), _mla(2), 0, rid, gen)


def test_a_plan_refuses_layouts_it_cannot_map():
    with pytest.raises(TPMappingError, match="different KV heads"):  # MLA's one latent vs 4 K/V heads
        plan_request_reads(_mla(1), [RankKV(0, range(0, 4), LATENT_BYTES)], 0, P_RID, GEN)
    with pytest.raises(TPMappingError, match="head sizes"):
        plan_request_reads(_mla(1), _layout(4, 1, 2), 0, P_RID, GEN)
