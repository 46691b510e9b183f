"""Which bytes of P's ranks' Mamba states fill a D rank's: P and D at any TP sizes.

A Mamba group's block is a *page* of one request's state (shape/kv_cache_layout.py): for each
of the group's `slots` layers, in order, the layer's conv state then its SSM state, packed,
then padding to the page size. On a rank holding Mamba heads `heads` and groups `groups`
(shape/mamba_shard.py `mamba2_shard`), one layer's part is

    conv state [conv_dim_r, K-1]  rows: x of each of its heads (P rows each) | B of each of its
                                  groups (N rows each) | C of each of its groups (N rows each)
    ssm state  [H_r, P, N]        P*N values per head

so one head's x rows are one contiguous span, one head's SSM state another, one group's B rows
and its C rows two more. A D rank fills its page from those spans: each of its heads from the
P rank holding it (heads split evenly, so exactly one does), each of its groups (B and C alike)
from ONE P rank holding a copy. Where P's TP size exceeds the group count several P ranks hold
copies of a group; the D rank picks among the copies on the P ranks it reads heads from anyway
(a rank holds its heads' groups, so there is one), by `salt` and its rank as tp_mapping.py picks
replicated KV heads: a group never adds a P rank to read, D TP < P TP spreads over the copies,
and equal TP sizes read each rank's own. Spans that continue each other on both sides merge, so
equal TP sizes read a whole packed page (every slot) as one span, and consecutive pages (equal
page sizes, no padding) as one descriptor.

Pure functions over ints. Everything that cannot be mapped raises TPMappingError with the
reason, a TP size the mixer cannot split included (`mamba2_shard`'s TPSplitError is re-raised as
TPMappingError, so D's connector catches one type for attention and Mamba alike).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from kvbridge.kv_transfer.read_plan.tp_mapping import Desc, HeadSpan, TPMappingError, strided_descs
from kvbridge.shape.mamba_shard import Mamba2Shard, mamba2_shard
from kvbridge.shape.model_config import Mamba2Config
from kvbridge.shape.tp_split import TPSplitError


@dataclass(frozen=True)
class MambaRankPages:
    """Where one rank's Mamba pages live: `num_blocks` pages of `page_bytes` from `base_addr`."""

    tp_size: int
    tp_rank: int
    base_addr: int
    page_bytes: int
    num_blocks: int


@dataclass(frozen=True)
class _Parts:
    """Byte offsets, within a page, of one rank's parts of one slot's state."""

    shard: Mamba2Shard
    config: Mamba2Config
    elem: int

    @property
    def conv_elems(self) -> int:
        c, s = self.config, self.shard
        return (s.num_heads * c.head_dim + 2 * s.num_groups * c.state_size) * (c.conv_kernel - 1)

    @property
    def slot_elems(self) -> int:
        c = self.config
        return self.conv_elems + self.shard.num_heads * c.head_dim * c.state_size

    def x(self, slot: int, head: int) -> tuple[int, int]:
        c, k = self.config, self.config.conv_kernel - 1
        i = head - self.shard.heads.start
        return self._at(slot, i * c.head_dim * k), c.head_dim * k * self.elem

    def b(self, slot: int, group: int) -> tuple[int, int]:
        return self._bc(slot, group, 0)

    def c(self, slot: int, group: int) -> tuple[int, int]:
        return self._bc(slot, group, self.shard.num_groups)

    def ssm(self, slot: int, head: int) -> tuple[int, int]:
        c = self.config
        i = head - self.shard.heads.start
        return self._at(slot, self.conv_elems + i * c.head_dim * c.state_size), c.head_dim * c.state_size * self.elem

    def _bc(self, slot: int, group: int, skip_groups: int) -> tuple[int, int]:
        c, s, k = self.config, self.shard, self.config.conv_kernel - 1
        row = s.num_heads * c.head_dim + (skip_groups + group - s.groups.start) * c.state_size
        return self._at(slot, row * k), c.state_size * k * self.elem

    def _at(self, slot: int, elems: int) -> int:
        return (slot * self.slot_elems + elems) * self.elem


def _check_sizes(slots: int, elem: int) -> None:
    if slots < 1 or elem < 1:
        raise TPMappingError(f"slots and element bytes must be >= 1, got {slots} and {elem}")


def _shard(config: Mamba2Config, tp_size: int, rank: int) -> Mamba2Shard:
    try:
        return mamba2_shard(config, tp_size, rank)
    except TPSplitError as exc:
        raise TPMappingError(f"the Mamba layers cannot be split over TP size {tp_size}: {exc}") from exc
    except ValueError as exc:  # a rank outside the TP size
        raise TPMappingError(str(exc)) from exc


def mamba_state_bytes(config: Mamba2Config, slots: int, elem: int, tp_size: int, rank: int) -> int:
    """The packed state bytes of a page of rank `rank` of `tp_size` (the rest is padding)."""
    _check_sizes(slots, elem)
    return slots * _Parts(_shard(config, tp_size, rank), config, elem).slot_elems * elem


def mamba_state_spans(config: Mamba2Config, slots: int, elem: int, local_tp: int, local_rank: int,
                      remote_tp: int, salt: int = 0) -> list[HeadSpan]:
    """The spans (tp_mapping.HeadSpan: remote rank and offset, local offset, length, within a
    page) that fill one page of local rank `local_rank` (of `local_tp`) from pages of the
    remote engine's `remote_tp` ranks, in local offset order, covering the packed state once.
    Each head (x rows, SSM state) comes from the one remote rank holding it; each group (B and
    C rows alike) from one remote rank holding a copy: among the copies on remote ranks read for
    the heads already (there always is one: a rank holds its heads' groups), the
    ((salt + local_rank) mod count)-th."""
    _check_sizes(slots, elem)
    local = _Parts(_shard(config, local_tp, local_rank), config, elem)
    remote = [_Parts(_shard(config, remote_tp, r), config, elem) for r in range(max(remote_tp, 1))]
    per_rank = config.num_heads // remote_tp
    spans: list[HeadSpan] = []

    def add(rank: int, remote_part: tuple[int, int], local_part: tuple[int, int]) -> None:
        spans.append(HeadSpan(rank, remote_part[0], local_part[0], local_part[1]))

    head_srcs = {head: remote[head // per_rank] for head in local.shard.heads}
    read = {p.shard.rank for p in head_srcs.values()}
    group_srcs: dict[int, _Parts] = {}
    for group in local.shard.groups:  # never empty: the rank read for a head holds the head's group
        near = [p for p in remote if group in p.shard.groups and p.shard.rank in read]
        group_srcs[group] = near[(salt + local_rank) % len(near)]
    for slot in range(slots):
        for head, src in head_srcs.items():
            add(src.shard.rank, src.x(slot, head), local.x(slot, head))
            add(src.shard.rank, src.ssm(slot, head), local.ssm(slot, head))
        for group, src in group_srcs.items():
            add(src.shard.rank, src.b(slot, group), local.b(slot, group))
            add(src.shard.rank, src.c(slot, group), local.c(slot, group))
    spans.sort(key=lambda s: s.local_offset)
    merged: list[HeadSpan] = []
    for s in spans:
        last = merged[-1] if merged else None
        if (last is not None and last.remote_rank == s.remote_rank
                and last.local_offset + last.length == s.local_offset
                and last.remote_offset + last.length == s.remote_offset):
            merged[-1] = HeadSpan(last.remote_rank, last.remote_offset, last.local_offset, last.length + s.length)
        else:
            merged.append(s)
    return merged


def mamba_read_descs(config: Mamba2Config, slots: int, elem: int, local: MambaRankPages,
                     remote: Sequence[MambaRankPages], local_ids: Sequence[int], remote_ids: Sequence[int],
                     salt: int = 0) -> dict[int, tuple[list[Desc], list[Desc]]]:
    """The byte ranges filling `local`'s pages `local_ids` from the remote ranks' pages
    `remote_ids` (pairwise), per remote rank read: {remote rank: (local descs, remote descs)},
    in page order then offset order, a descriptor continuing the previous one on both sides
    merged into it. Remote ids are checked against the remote ranks read only."""
    if len(local_ids) != len(remote_ids):
        raise TPMappingError(f"{len(remote_ids)} remote Mamba states for {len(local_ids)} local ones")
    if not remote:
        raise TPMappingError("no remote ranks")
    if [r.tp_rank for r in remote] != list(range(len(remote))):
        raise TPMappingError(f"the remote ranks are not 0..{len(remote) - 1} in order")
    if any(r.tp_size != len(remote) for r in remote):
        raise TPMappingError(f"the {len(remote)} remote ranks announce TP sizes {sorted({r.tp_size for r in remote})}")
    if not 0 <= local.tp_rank < local.tp_size:
        raise TPMappingError(f"local rank {local.tp_rank} outside TP size {local.tp_size}")
    for side, pages in [("local", local), *(("remote", r) for r in remote)]:
        need = mamba_state_bytes(config, slots, elem, pages.tp_size, pages.tp_rank)
        if pages.page_bytes < need:
            raise TPMappingError(f"{side} rank {pages.tp_rank}: pages of {pages.page_bytes} bytes cannot hold "
                                 f"its Mamba state of {need}")
    if any(not 0 <= b < local.num_blocks for b in local_ids):
        raise TPMappingError(f"local Mamba block id out of range [0, {local.num_blocks})")
    spans = mamba_state_spans(config, slots, elem, local.tp_size, local.tp_rank, len(remote), salt)
    for rank in sorted({s.remote_rank for s in spans}):
        if any(not 0 <= b < remote[rank].num_blocks for b in remote_ids):
            raise TPMappingError(f"remote Mamba block id out of range [0, {remote[rank].num_blocks}) on remote "
                                 f"rank {rank}")
    return strided_descs((local.base_addr, local.page_bytes), [(r.base_addr, r.page_bytes) for r in remote], spans,
                         local_ids, remote_ids)
