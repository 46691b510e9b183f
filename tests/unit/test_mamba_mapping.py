"""mamba_mapping: a D rank's Mamba states filled from P's ranks, for every pair of TP sizes,
executed as real copies between rank buffers and compared with a split of the same whole state."""

from __future__ import annotations

import ctypes
import itertools

import pytest
import torch

from kvbridge.kv_transfer.read_plan.mamba_mapping import (MambaRankPages, mamba_read_descs, mamba_state_bytes,
                                                          mamba_state_spans)
from kvbridge.kv_transfer.read_plan.tp_mapping import TPMappingError
from kvbridge.shape.mamba_shard import mamba2_shard
from kvbridge.shape.model_config import Mamba2Config
from kvbridge.shape.tp_split import TPSplitError

DTYPES = {4: torch.float32, 2: torch.int16}
GEOMETRIES = [  # (heads H, groups G, conv kernel K, head dim P, state size N)
    (4, 1, 4, 2, 3), (4, 2, 2, 3, 2), (4, 4, 4, 2, 3), (8, 2, 4, 2, 3), (8, 8, 2, 1, 2), (8, 1, 2, 2, 2)]
TP_SIZES = (1, 2, 4, 8)
NUM_BLOCKS = 5
# (D block, P block): shuffled, not in order, D 3, 4 and P 1, 2 consecutive on both sides
PAIRS = [(3, 1), (4, 2), (0, 4), (2, 0)]


def config(heads: int, groups: int, kernel: int, head_dim: int = 2, state: int = 3) -> Mamba2Config:
    return Mamba2Config(hidden_size=8, num_heads=heads, head_dim=head_dim, state_size=state, n_groups=groups,
                        conv_kernel=kernel)


def whole_states(c: Mamba2Config, slots: int, blocks: list[int], dtype: torch.dtype,
                 seed: int) -> dict[int, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per block, per slot, the unsplit (conv [conv_dim, K-1], ssm [H, P, N]) state: every value
    of every block and slot distinct, so any byte read from the wrong place shows."""
    conv, ssm = c.conv_dim * (c.conv_kernel - 1), c.num_heads * c.head_dim * c.state_size
    total = len(blocks) * slots * (conv + ssm)
    assert total < 1 << 15  # distinct in int16 too
    values = (torch.randperm(total, generator=torch.Generator().manual_seed(seed)) - total // 2).to(dtype)
    chunks = iter(values.split([conv, ssm] * len(blocks) * slots))
    return {b: [(next(chunks).view(c.conv_dim, c.conv_kernel - 1),
                 next(chunks).view(c.num_heads, c.head_dim, c.state_size)) for _ in range(slots)] for b in blocks}


def rank_page(c: Mamba2Config, state: list[tuple[torch.Tensor, torch.Tensor]], tp: int, rank: int) -> bytes:
    """What rank `rank` of `tp` holds of `state`, packed: per slot its conv rows (x of its heads,
    B of its groups, C of its groups) then its heads' SSM states."""
    s = mamba2_shard(c, tp, rank)
    p, n, i = c.head_dim, c.state_size, c.intermediate_size
    rows = [*range(s.heads.start * p, s.heads.stop * p),
            *(i + r for r in range(s.groups.start * n, s.groups.stop * n)),
            *(i + c.n_groups * n + r for r in range(s.groups.start * n, s.groups.stop * n))]
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


def splits(c: Mamba2Config, tp: int) -> bool:
    try:
        mamba2_shard(c, tp, 0)
        return True
    except TPSplitError:
        return False


def check_one_pairing(c: Mamba2Config, p_tp: int, d_tp: int, slots: int, elem: int, padded: bool) -> None:
    p_pad, d_pad = (7 * elem, 3 * elem) if padded else (0, 0)  # padding must stay untouched
    states = whole_states(c, slots, [b for _, b in PAIRS], DTYPES[elem], seed=p_tp * 10 + d_tp)
    p_ranks = [Rank(p_tp, r, mamba_state_bytes(c, slots, elem, p_tp, r) + p_pad, seed=100 + r) for r in range(p_tp)]
    for p_block, state in states.items():
        for r in p_ranks:
            r.write(p_block, rank_page(c, state, p_tp, r.pages.tp_rank))
    for d_rank in range(d_tp):
        packed = mamba_state_bytes(c, slots, elem, d_tp, d_rank)
        salt = d_rank * 7 + slots
        spans = mamba_state_spans(c, slots, elem, d_tp, d_rank, p_tp, salt)
        # the spans tile the local packed state exactly once, each inside its remote rank's packed state
        assert [s.local_offset for s in spans] == list(itertools.accumulate([0] + [s.length for s in spans[:-1]]))
        assert sum(s.length for s in spans) == packed
        assert all(s.remote_offset + s.length <= mamba_state_bytes(c, slots, elem, p_tp, s.remote_rank) for s in spans)
        d = Rank(d_tp, d_rank, packed + d_pad, seed=200 + d_rank)
        expected = d.buf.clone()
        descs = mamba_read_descs(c, slots, elem, d.pages, [r.pages for r in p_ranks], [b for b, _ in PAIRS],
                                 [b for _, b in PAIRS], salt=salt)
        assert set(descs) == {s.remote_rank for s in spans}
        for local, remote in descs.values():
            assert [n for _, n in local] == [n for _, n in remote]
            for (l_addr, n), (r_addr, _) in zip(local, remote):
                ctypes.memmove(l_addr, r_addr, n)
        # consecutive pages merge only at equal TP sizes with unpadded pages (D 3, 4 <- P 1, 2)
        merged = 1 if p_tp == d_tp and not padded else 0
        assert sum(len(local) for local, _ in descs.values()) == len(PAIRS) * len(spans) - merged
        for d_block, p_block in PAIRS:
            want = rank_page(c, states[p_block], d_tp, d_rank)
            assert len(want) == packed
            start = d_block * d.pages.page_bytes
            expected[start:start + packed] = torch.frombuffer(bytearray(want), dtype=torch.uint8)
        assert torch.equal(d.buf, expected)  # its state, byte for byte; padding and other blocks untouched


@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("p_tp, d_tp", list(itertools.product(TP_SIZES, TP_SIZES)))
def test_every_d_rank_gets_exactly_its_split_of_the_state_and_nothing_else_changes(p_tp, d_tp, geometry):
    c = config(*geometry)
    if not (splits(c, p_tp) and splits(c, d_tp)):
        d = MambaRankPages(d_tp, 0, 0, 1 << 16, NUM_BLOCKS)
        p = [MambaRankPages(p_tp, r, 1 << 20, 1 << 16, NUM_BLOCKS) for r in range(p_tp)]
        with pytest.raises(TPMappingError, match="cannot be split over TP size"):
            mamba_read_descs(c, 1, 4, d, p, [0], [0])
        return
    for slots, elem in itertools.product((1, 2), (4, 2)):
        check_one_pairing(c, p_tp, d_tp, slots, elem, padded=elem == 4)


def test_the_packed_size_is_conv_rows_times_k_minus_1_plus_the_heads_ssm():
    c = config(8, 2, 4, head_dim=3, state=5)
    for tp, slots, elem in itertools.product((1, 2, 4, 8), (1, 3), (2, 4)):
        h, g = 8 // tp, max(1, 2 // tp)
        assert mamba_state_bytes(c, slots, elem, tp, tp - 1) == slots * ((h * 3 + 2 * g * 5) * 3 + h * 3 * 5) * elem


def test_equal_tp_reads_a_whole_page_as_one_span_and_consecutive_pages_as_one_descriptor():
    c = config(8, 2, 4)
    for tp, slots in itertools.product((1, 2, 4, 8), (1, 2)):
        for rank in range(tp):
            spans = mamba_state_spans(c, slots, 4, tp, rank, tp, salt=rank + 1)
            assert [(s.remote_rank, s.remote_offset, s.local_offset, s.length) for s in spans] == [
                (rank, 0, 0, mamba_state_bytes(c, slots, 4, tp, rank))]
    packed = mamba_state_bytes(c, 2, 4, 2, 1)
    d = MambaRankPages(2, 1, 1 << 20, packed, 8)
    p = [MambaRankPages(2, r, (r + 2) << 20, packed, 8) for r in range(2)]
    descs = mamba_read_descs(c, 2, 4, d, p, [2, 3, 4], [5, 6, 7])
    assert descs == {1: ([((1 << 20) + 2 * packed, 3 * packed)], [((3 << 20) + 5 * packed, 3 * packed)])}
    # a gap on either side (padding, or ids not consecutive) leaves one descriptor per page
    padded = [MambaRankPages(2, r, (r + 2) << 20, packed + 8, 8) for r in range(2)]
    assert len(mamba_read_descs(c, 2, 4, d, padded, [2, 3, 4], [5, 6, 7])[1][0]) == 3
    assert len(mamba_read_descs(c, 2, 4, d, p, [2, 3, 4], [5, 7, 6])[1][0]) == 3


def test_unequal_tp_reads_x_b_c_ssm_runs_per_remote_rank():
    c = config(4, 2, 4)
    # D TP 1 <- P TP 2: per slot, from each P rank its heads' x rows, its group's B, its group's C, its heads' SSM
    spans = mamba_state_spans(c, 2, 4, 1, 0, 2)
    assert [s.remote_rank for s in spans] == [0, 1] * 8
    # D TP 2 <- P TP 1: per slot, the one P rank's x, B, C and SSM of D's heads and group
    spans = mamba_state_spans(c, 2, 4, 2, 1, 1)
    assert len(spans) == 8 and {s.remote_rank for s in spans} == {0}


def group_sources(c: Mamba2Config, d_tp: int, d_rank: int, p_tp: int, salt: int) -> dict[int, tuple[int, int]]:
    """For each group of the D rank, the remote ranks its B rows and its C rows come from."""
    s = mamba2_shard(c, d_tp, d_rank)
    k, n = c.conv_kernel - 1, c.state_size
    spans = mamba_state_spans(c, 1, 4, d_tp, d_rank, p_tp, salt)

    def source(elem_offset: int) -> int:
        (rank,) = [x.remote_rank for x in spans if x.local_offset <= elem_offset * 4 < x.local_offset + x.length]
        return rank

    x_rows = s.num_heads * c.head_dim
    return {g: (source((x_rows + j * n) * k), source((x_rows + (s.num_groups + j) * n) * k))
            for j, g in enumerate(s.groups)}


def test_a_replicated_group_is_read_from_one_copy_on_a_rank_read_anyway_chosen_by_salt_and_rank():
    for geometry, p_tp in [((8, 2, 4), 8), ((8, 2, 4), 4), ((4, 1, 4), 4), ((4, 1, 4), 2), ((8, 1, 2), 8)]:
        c = config(*geometry)
        per = c.num_heads // p_tp
        for d_tp, salt in itertools.product((1, 2, 4, 8), range(6)):
            if not splits(c, d_tp):
                continue
            for d_rank in range(d_tp):
                read = {h // per for h in mamba2_shard(c, d_tp, d_rank).heads}  # the P ranks holding its heads
                for g, (b_src, c_src) in group_sources(c, d_tp, d_rank, p_tp, salt).items():
                    near = [r for r in sorted(read) if g in mamba2_shard(c, p_tp, r).groups]
                    assert b_src == c_src == near[(salt + d_rank) % len(near)]  # B and C from the same copy
    # D TP < P TP: over requests (salts) a D rank reads each copy equally often, and D ranks of one
    # request spread over the copies
    c = config(4, 1, 4)
    assert sorted(group_sources(c, 1, 0, 4, salt)[0][0] for salt in range(8)) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [group_sources(c, 2, r, 4, 1)[0][0] for r in range(2)] == [1, 2]
    assert [group_sources(c, 2, r, 4, 0)[0][0] for r in range(2)] == [0, 3]
    # D TP >= P TP: each D rank reads its group from the one P rank holding its heads, whatever the salt
    for salt in range(4):
        assert [group_sources(c, 4, r, 4, salt)[0][0] for r in range(4)] == [0, 1, 2, 3]
        assert [group_sources(c, 4, r, 2, salt)[0][0] for r in range(4)] == [0, 0, 1, 1]
        assert {s.remote_rank for s in mamba_state_spans(c, 1, 4, 1, 0, 4, salt=salt)} == {0, 1, 2, 3}


def refusal(case: str) -> tuple[Mamba2Config, int, int, MambaRankPages, list[MambaRankPages], list[int], list[int]]:
    c, slots, elem = config(4, 2, 4), 1, 4
    packed = mamba_state_bytes(c, 1, 4, 2, 0)
    d = MambaRankPages(1, 0, 0, mamba_state_bytes(c, 1, 4, 1, 0), 4)
    p = [MambaRankPages(2, r, 1 << 20, packed, 4) for r in range(2)]
    local_ids, remote_ids = [0, 1], [1, 2]
    if case == "lengths":
        remote_ids = [1, 2, 3]
    elif case == "no_remote":
        p = []
    elif case == "order":
        p = p[::-1]
    elif case == "remote_tp":
        p = [MambaRankPages(2, 0, 1 << 20, packed, 4), MambaRankPages(4, 1, 1 << 20, packed, 4)]
    elif case == "local_rank":
        d = MambaRankPages(1, 1, 0, 1 << 10, 4)
    elif case == "local_page":
        d = MambaRankPages(1, 0, 0, mamba_state_bytes(c, 1, 4, 1, 0) - 1, 4)
    elif case == "remote_page":
        p = [p[0], MambaRankPages(2, 1, 1 << 20, packed - 4, 4)]
    elif case == "local_id":
        local_ids = [0, 4]
    elif case == "negative_id":
        local_ids = [-1, 0]
    elif case == "remote_id":
        remote_ids = [1, 9]
    elif case == "slots":
        slots = 0
    elif case == "elem":
        elem = 0
    elif case == "local_split":
        d = MambaRankPages(3, 0, 0, 1 << 10, 4)
    elif case == "remote_split":
        p = [MambaRankPages(3, r, 1 << 20, 1 << 10, 4) for r in range(3)]
    elif case == "group_split":
        c = config(6, 3, 4)
        d = MambaRankPages(1, 0, 0, 1 << 10, 4)
        p = [MambaRankPages(2, r, 1 << 20, 1 << 10, 4) for r in range(2)]
    return c, slots, elem, d, p, local_ids, remote_ids


@pytest.mark.parametrize("case, words", [
    ("lengths", "3 remote Mamba states for 2 local"), ("no_remote", "no remote ranks"),
    ("order", r"not 0\.\.1 in order"), ("remote_tp", r"announce TP sizes \[2, 4\]"),
    ("local_rank", "local rank 1 outside TP size 1"), ("local_page", "local rank 0: pages of .* cannot hold"),
    ("remote_page", "remote rank 1: pages of .* cannot hold"),
    ("local_id", r"local Mamba block id out of range \[0, 4\)"), ("negative_id", "local Mamba block id out of range"),
    ("remote_id", r"remote Mamba block id out of range \[0, 4\) on remote rank 0"),
    ("slots", "must be >= 1, got 0"), ("elem", "must be >= 1, got 1 and 0"),
    ("local_split", "cannot be split over TP size 3: .*does not divide the 4 Mamba heads"),
    ("remote_split", "cannot be split over TP size 3"),
    ("group_split", "cannot be split over TP size 2: .*groups")])
def test_what_cannot_be_mapped_is_refused_with_the_reason(case, words):
    c, slots, elem, d, p, local_ids, remote_ids = refusal(case)
    with pytest.raises(TPMappingError, match=words):
        mamba_read_descs(c, slots, elem, d, p, local_ids, remote_ids)


def test_the_helpers_refuse_a_split_as_a_tp_mapping_error_too():
    c = config(4, 2, 4)
    with pytest.raises(TPMappingError, match="cannot be split over TP size 8"):
        mamba_state_bytes(c, 1, 4, 8, 0)
    with pytest.raises(TPMappingError, match="cannot be split over TP size 3"):
        mamba_state_spans(c, 1, 4, 1, 0, 3)
    with pytest.raises(TPMappingError, match="cannot be split over TP size 0"):
        mamba_state_spans(c, 1, 4, 1, 0, 0)
    with pytest.raises(TPMappingError, match="rank 2 out of range"):
        mamba_state_spans(c, 1, 4, 2, 2, 1)
    with pytest.raises(TPMappingError, match="must be >= 1"):
        mamba_state_bytes(c, 0, 4, 1, 0)
