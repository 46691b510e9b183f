"""Which remote ranks a local rank reads a block from, and which bytes: P and D at any TP sizes.

Every rank keeps its KV cache head-major within a block: one block of a rank is
[its KV heads, layers, 2 (K, V), block_size, head_dim], so one KV head's share of a
block (every layer, K and V) is one contiguous span of `head_bytes`, and a run of a
rank's consecutive heads is one span too. A D rank holding heads [a, b) therefore
fills each of its blocks from a few spans: one per remote rank holding a run of those
heads (D TP > P TP: one span from the one P rank holding them; D TP < P TP: one span
from each P rank holding part of them). A read is a few descriptors per block, not one
per layer per token.

Replicated KV (a P whose TP size exceeds its KV heads holds each head on several
ranks; MLA's latent is the same on every rank) is read from ONE replica, chosen
deterministically from `salt` (e.g. a request's hash) and the local rank, so different
requests and ranks spread over the replicas.

`block_read_descs` turns the spans into the byte ranges of a request's read: for each
remote rank, (local, remote) descriptor lists, with descriptors that are contiguous on
both sides merged (equal TP sizes: a run of consecutive blocks is one descriptor).

Pure functions over the layouts both sides announce in the handshake.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class RankKV:
    """One rank's KV block layout: the global KV heads it holds, and one head's bytes per block."""

    tp_rank: int
    kv_heads: range
    head_bytes: int

    @property
    def block_bytes(self) -> int:
        return len(self.kv_heads) * self.head_bytes


@dataclass(frozen=True)
class HeadSpan:
    """Copy `length` bytes at `remote_offset` within a block of remote rank `remote_rank` to
    `local_offset` within the local rank's block."""

    remote_rank: int
    remote_offset: int
    local_offset: int
    length: int


@dataclass(frozen=True)
class RankBlocks:
    """Where one rank's KV blocks live: `num_blocks` blocks of `kv.block_bytes` from `base_addr`."""

    kv: RankKV
    base_addr: int
    num_blocks: int


Desc = tuple[int, int]  # (address, length in bytes)


class TPMappingError(ValueError):
    """The two engines' layouts cannot be mapped onto each other; the message says why."""


def check_pairing(local: Sequence[RankKV], remote: Sequence[RankKV]) -> None:
    """Raises TPMappingError unless every local rank can be filled from the remote ranks."""
    for side, ranks in (("local", local), ("remote", remote)):
        if not ranks:
            raise TPMappingError(f"the {side} engine announced no ranks")
        if [r.tp_rank for r in ranks] != list(range(len(ranks))):
            raise TPMappingError(f"the {side} engine's ranks are not 0..{len(ranks) - 1} in order")
    head_bytes = {r.head_bytes for r in (*local, *remote)}
    if len(head_bytes) != 1:
        raise TPMappingError(f"KV head sizes per block differ: {sorted(head_bytes)} bytes "
                             "(model, dtype or block size differ)")
    local_heads = _all_heads(local)
    remote_heads = _all_heads(remote)
    if local_heads != remote_heads:
        raise TPMappingError(f"the engines hold different KV heads ({len(local_heads)} here, "
                             f"{len(remote_heads)} remote)")


def rank_reads(local: RankKV, remote: Sequence[RankKV], salt: int = 0) -> list[HeadSpan]:
    """The spans that fill one block of `local` from the remote ranks, in local offset order.

    Consecutive heads that come from the same remote rank at consecutive offsets are one
    span. Raises TPMappingError if a head is held by no remote rank or head sizes differ."""
    spans: list[HeadSpan] = []
    for i, head in enumerate(local.kv_heads):
        holders = [r for r in remote if head in r.kv_heads]
        if not holders:
            raise TPMappingError(f"no remote rank holds KV head {head}")
        src = holders[(salt + local.tp_rank) % len(holders)]
        if src.head_bytes != local.head_bytes:
            raise TPMappingError(f"KV head size {src.head_bytes} B remote, {local.head_bytes} B local")
        r_off = (head - src.kv_heads.start) * src.head_bytes
        l_off = i * local.head_bytes
        last = spans[-1] if spans else None
        if (last is not None and last.remote_rank == src.tp_rank and last.remote_offset + last.length == r_off
                and last.local_offset + last.length == l_off):
            spans[-1] = HeadSpan(last.remote_rank, last.remote_offset, last.local_offset,
                                 last.length + local.head_bytes)
        else:
            spans.append(HeadSpan(src.tp_rank, r_off, l_off, local.head_bytes))
    return spans


def reads_per_remote_rank(local: Sequence[RankKV], remote: Sequence[RankKV], salt: int = 0) -> dict[int, int]:
    """How many local ranks read from each remote rank (remote ranks nobody reads are absent):
    P frees a request's blocks once that many read-done notices arrived for each of its ranks."""
    counts: dict[int, int] = {}
    for rank in local:
        for remote_rank in sorted({s.remote_rank for s in rank_reads(rank, remote, salt)}):
            counts[remote_rank] = counts.get(remote_rank, 0) + 1
    return counts


def block_read_descs(local: RankBlocks, remote: Sequence[RankBlocks], local_ids: Sequence[int],
                     remote_ids: Sequence[int], salt: int = 0) -> dict[int, tuple[list[Desc], list[Desc]]]:
    """The byte ranges that fill `local`'s blocks `local_ids` from the remote engine's blocks
    `remote_ids` (pairwise), per remote rank read: {remote rank: (local descs, remote descs)}.

    Descriptors follow block order then span order; one that continues the previous one on
    both sides is merged into it. Raises TPMappingError for unequal id lists, ids outside a
    rank's blocks, or heads no remote rank holds."""
    if len(local_ids) != len(remote_ids):
        raise TPMappingError(f"{len(remote_ids)} remote blocks for {len(local_ids)} local blocks")
    if [r.kv.tp_rank for r in remote] != list(range(len(remote))):
        raise TPMappingError("the remote ranks are not 0..n-1 in order")
    if any(not 0 <= b < local.num_blocks for b in local_ids):
        raise TPMappingError(f"local block id out of range [0, {local.num_blocks})")
    spans = rank_reads(local.kv, [r.kv for r in remote], salt)
    for s in spans:
        if any(not 0 <= b < remote[s.remote_rank].num_blocks for b in remote_ids):
            raise TPMappingError(f"remote block id out of range [0, {remote[s.remote_rank].num_blocks}) "
                                 f"on remote rank {s.remote_rank}")
    out: dict[int, tuple[list[Desc], list[Desc]]] = {}
    for l_id, r_id in zip(local_ids, remote_ids):
        for s in spans:
            src = remote[s.remote_rank]
            l_addr = local.base_addr + l_id * local.kv.block_bytes + s.local_offset
            r_addr = src.base_addr + r_id * src.kv.block_bytes + s.remote_offset
            l_descs, r_descs = out.setdefault(s.remote_rank, ([], []))
            if l_descs and sum(l_descs[-1]) == l_addr and sum(r_descs[-1]) == r_addr:
                l_descs[-1] = (l_descs[-1][0], l_descs[-1][1] + s.length)
                r_descs[-1] = (r_descs[-1][0], r_descs[-1][1] + s.length)
            else:
                l_descs.append((l_addr, s.length))
                r_descs.append((r_addr, s.length))
    return out


def _all_heads(ranks: Sequence[RankKV]) -> set[int]:
    return {h for r in ranks for h in r.kv_heads}
