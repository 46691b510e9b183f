"""mamba_mapping: a D rank's Mamba states filled from P's ranks, for every pair of TP sizes,
executed as real copies between rank buffers and compared with a split of the same whole state."""

from __future__ import annotations

import ctypes
import itertools

import pytest
import torch

from kvbridge.engine.layers.mamba2 import mamba2_shard
from kvbridge.engine.models.config import Mamba2Config
from kvbridge.engine.tp import TPSplitError
from kvbridge.kv_transfer.mamba_mapping import (MambaRankPages, mamba_read_descs, mamba_state_bytes,
                                                mamba_state_spans)
from kvbridge.kv_transfer.tp_mapping import TPMappingError

DTYPES = {4: torch.float32, 2: torch.int16}
GEOMETRIES = [  # (heads, groups, conv kernel)
    (4, 1, 4), (4, 2, 2), (4, 4, 4), (8, 2, 4), (8, 8, 2)]
NUM_BLOCKS = 5


def config(heads: int, groups: int, kernel: int) -> Mamba2Config:
    return Mamba2Config(hidden_size=8, num_heads=heads, head_dim=2, state_size=3, n_groups=groups,
                        conv_kernel=kernel)


def whole_state(c: Mamba2Config, slots: int, seed: int, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per slot, the unsplit (conv [conv_dim, K-1], ssm [H, P, N]) state: distinct values."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(-30000, 30000, (c.conv_dim, c.conv_kernel - 1), generator=g).to(dtype),
             torch.randint(-30000, 30000, (c.num_heads, c.head_dim, c.state_size), generator=g).to(dtype))
            for _ in range(slots)]


def rank_page(c: Mamba2Config, state, tp: int, rank: int) -> bytes:
    """What rank `rank` of `tp` holds of `state`: its x rows, its groups' B and C rows, its heads' SSM."""
    s = mamba2_shard(c, tp, rank)
    p, n = c.head_dim, c.state_size
    rows = [*range(s.heads.start * p, s.heads.stop * p),
            *(c.intermediate_size + r for r in range(s.groups.start * n, s.groups.stop * n)),
            *(c.intermediate_size + c.n_groups * n + r for r in range(s.groups.start * n, s.groups.stop * n))]
    parts = [torch.cat((conv[rows].flatten(), ssm[s.heads.start:s.heads.stop].flatten())) for conv, ssm in state]
    return torch.cat(parts).numpy().tobytes()


class Rank:
    """A rank's page buffer filled with junk, addressed like registered memory."""

    def __init__(self, tp: int, rank: int, page_bytes: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.buf = torch.randint(0, 256, (NUM_BLOCKS * page_bytes,), dtype=torch.uint8, generator=g)
        self.pages = MambaRankPages(tp, rank, self.buf.data_ptr(), page_bytes, NUM_BLOCKS)

    def write(self, block: int, data: bytes) -> None:
        start = block * self.pages.page_bytes
        self.buf[start:start + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)

    def read(self, block: int, n: int) -> bytes:
        start = block * self.pages.page_bytes
        return self.buf[start:start + n].numpy().tobytes()


def splits(c: Mamba2Config, tp: int) -> bool:
    try:
        mamba2_shard(c, tp, 0)
        return True
    except TPSplitError:
        return False


@pytest.mark.parametrize("elem", [4, 2])
@pytest.mark.parametrize("slots", [1, 2])
@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("p_tp, d_tp", list(itertools.product((1, 2, 4, 8), (1, 2, 4, 8))))
def test_every_d_rank_gets_exactly_its_split_of_the_state_and_nothing_else_changes(p_tp, d_tp, geometry, slots,
                                                                                     elem):
    c = config(*geometry)
    if not (splits(c, p_tp) and splits(c, d_tp)):
        with pytest.raises(TPSplitError):
            mamba_state_spans(c, slots, elem, d_tp, 0, p_tp) if splits(c, d_tp) else mamba2_shard(c, d_tp, 0)
        return
    pad = 7 * elem  # pages larger than the state: padding must stay untouched
    p_pages = [mamba_state_bytes(c, slots, elem, p_tp, r) + pad for r in range(p_tp)]
    pairs = [(3, 1), (0, 4), (2, 0)]  # (D block, P block), shuffled, not consecutive
    states = {p_block: whole_state(c, slots, seed=p_block, dtype=DTYPES[elem]) for _, p_block in pairs}
    p_ranks = [Rank(p_tp, r, p_pages[r], seed=100 + r) for r in range(p_tp)]
    for p_block, state in states.items():
        for r in p_ranks:
            r.write(p_block, rank_page(c, state, p_tp, r.pages.tp_rank))
    for d_rank in range(d_tp):
        packed = mamba_state_bytes(c, slots, elem, d_tp, d_rank)
        d = Rank(d_tp, d_rank, packed + 3 * elem, seed=200 + d_rank)
        before = d.buf.clone()
        descs = mamba_read_descs(c, slots, elem, d.pages, [r.pages for r in p_ranks], [b for b, _ in pairs],
                                 [b for _, b in pairs], salt=d_rank * 7)
        for local, remote in descs.values():
            assert len(local) == len(remote)
            for (l_addr, n), (r_addr, m) in zip(local, remote):
                assert n == m
                ctypes.memmove(l_addr, r_addr, n)
        expected = before.clone()
        for d_block, p_block in pairs:
            want = rank_page(c, states[p_block], d_tp, d_rank)
            assert len(want) == packed
            assert d.read(d_block, packed) == want, (d_block, p_block)
            start = d_block * d.pages.page_bytes
            expected[start:start + packed] = torch.frombuffer(bytearray(want), dtype=torch.uint8)
        assert torch.equal(d.buf, expected)  # padding and the other blocks untouched


def test_equal_tp_reads_a_whole_page_as_one_span_and_consecutive_pages_as_one_descriptor():
    c = config(8, 2, 4)
    for tp in (1, 2, 4):
        spans = mamba_state_spans(c, 2, 4, tp, tp - 1, tp)
        assert len(spans) == 1 and spans[0].length == mamba_state_bytes(c, 2, 4, tp, tp - 1)
    packed = mamba_state_bytes(c, 2, 4, 2, 1)
    d = MambaRankPages(2, 1, 1 << 20, packed, 8)
    p = [MambaRankPages(2, r, (r + 2) << 20, packed, 8) for r in range(2)]
    descs = mamba_read_descs(c, 2, 4, d, p, [2, 3, 4], [5, 6, 7])
    assert list(descs) == [1] and descs[1] == ([((1 << 20) + 2 * packed, 3 * packed)],
                                               [((3 << 20) + 5 * packed, 3 * packed)])


def test_a_head_split_reads_each_head_from_its_rank_and_replicated_groups_spread_over_copies():
    c = config(4, 1, 4)  # one group: every P rank of TP 4 holds a copy of B and C
    spans = mamba_state_spans(c, 1, 4, 1, 0, 4)
    assert {s.remote_rank for s in spans} == {0, 1, 2, 3}  # D TP 1 reads every P rank's heads
    chosen = {salt: {s.remote_rank for s in mamba_state_spans(c, 1, 4, 2, 0, 4, salt=salt)} for salt in range(4)}
    assert all(ranks >= {0, 1} for ranks in chosen.values())  # D rank 0's heads are on P ranks 0 and 1
    group_sources = {frozenset(ranks) for ranks in chosen.values()}
    assert len(group_sources) > 1  # the copy B and C come from depends on the salt


@pytest.mark.parametrize("case, words", [
    ("lengths", "remote Mamba states for"), ("order", "not 0..n-1"), ("small_page", "cannot hold"),
    ("local_id", "local Mamba block id"), ("remote_id", "remote Mamba block id"), ("slots", "must be >= 1")])
def test_what_cannot_be_mapped_is_refused_with_the_reason(case, words):
    c = config(4, 2, 4)
    packed = mamba_state_bytes(c, 1, 4, 2, 0)
    d = MambaRankPages(1, 0, 0, mamba_state_bytes(c, 1, 4, 1, 0), 4)
    p = [MambaRankPages(2, r, 1 << 20, packed, 4) for r in range(2)]
    args = dict(local_ids=[0], remote_ids=[1])
    slots = 1
    if case == "lengths":
        args["remote_ids"] = [1, 2]
    elif case == "order":
        p = p[::-1]
    elif case == "small_page":
        d = MambaRankPages(1, 0, 0, 8, 4)
    elif case == "local_id":
        args["local_ids"] = [4]
    elif case == "remote_id":
        args["remote_ids"] = [9]
    elif case == "slots":
        slots = 0
    with pytest.raises(TPMappingError, match=words):
        mamba_read_descs(c, slots, 4, d, p, args["local_ids"], args["remote_ids"])
