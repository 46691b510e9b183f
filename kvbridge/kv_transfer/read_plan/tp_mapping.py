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

`plan_request_reads` is the whole plan of one request, and the one D's worker connector
executes: per local (D) rank the spans it reads and so the remote (P) ranks it reads
from, the P ranks whose copies nobody reads (MLA with P TP > D TP: all but the chosen
ones), and the `ReleaseNotice` that frees the request's blocks on EVERY P rank, read or
not: P's request id (never D's: P knows no other) and the lease generation. P's blocks live in
one block pool in P's engine process, so that one notice (D's read-done, or its release
after a failure) frees every rank's copy at once; no P rank is left to its lease.

Pure functions over the layouts both sides announce in the handshake.
"""

from __future__ import annotations

import zlib
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
    if [r.kv.tp_rank for r in remote] != list(range(len(remote))):
        raise TPMappingError("the remote ranks are not 0..n-1 in order")
    return span_descs(local, remote, rank_reads(local.kv, [r.kv for r in remote], salt), local_ids, remote_ids)


def span_descs(local: RankBlocks, remote: Sequence[RankBlocks], spans: Sequence[HeadSpan],
               local_ids: Sequence[int], remote_ids: Sequence[int]) -> dict[int, tuple[list[Desc], list[Desc]]]:
    """`block_read_descs` for spans already chosen (`rank_reads`, or a `ReadPlan`'s)."""
    if len(local_ids) != len(remote_ids):
        raise TPMappingError(f"{len(remote_ids)} remote blocks for {len(local_ids)} local blocks")
    if [r.kv.tp_rank for r in remote] != list(range(len(remote))):
        raise TPMappingError("the remote ranks are not 0..n-1 in order")
    if any(not 0 <= b < local.num_blocks for b in local_ids):
        raise TPMappingError(f"local block id out of range [0, {local.num_blocks})")
    for s in spans:
        if not 0 <= s.remote_rank < len(remote):
            raise TPMappingError(f"a span reads remote rank {s.remote_rank} of {len(remote)}")
        if any(not 0 <= b < remote[s.remote_rank].num_blocks for b in remote_ids):
            raise TPMappingError(f"remote block id out of range [0, {remote[s.remote_rank].num_blocks}) "
                                 f"on remote rank {s.remote_rank}")
    return strided_descs((local.base_addr, local.kv.block_bytes), [(r.base_addr, r.kv.block_bytes) for r in remote],
                         spans, local_ids, remote_ids)


def strided_descs(local: tuple[int, int], remote: Sequence[tuple[int, int]], spans: Sequence[HeadSpan],
                  local_ids: Sequence[int], remote_ids: Sequence[int]) -> dict[int, tuple[list[Desc], list[Desc]]]:
    """The descriptors of `spans` for each (local id, remote id) pair, where block b of a side
    starts at base + b * stride ((base, stride) of the local rank and of each remote rank):
    {remote rank: (local descs, remote descs)}, block order then span order, a descriptor that
    continues the previous one on both sides merged into it. Ids are not checked here."""
    out: dict[int, tuple[list[Desc], list[Desc]]] = {}
    for l_id, r_id in zip(local_ids, remote_ids):
        for s in spans:
            base, stride = remote[s.remote_rank]
            l_addr = local[0] + l_id * local[1] + s.local_offset
            r_addr = base + r_id * stride + s.remote_offset
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


# ---- one request's plan -----------------------------------------------------------------

def request_salt(remote_request_id: str) -> int:
    """The salt that picks a request's replicas: crc32 of P's request id (the same on every D
    rank and engine, spread over requests)."""
    return zlib.crc32(remote_request_id.encode())


@dataclass(frozen=True)
class ReleaseNotice:
    """The one message that frees a request's blocks on every rank of P: D's read-done when
    every read succeeded, its release otherwise. Keyed by P's own request id (P knows no
    other; D's id here once freed nothing) and the lease generation (a stale notice frees
    nothing). P's engine process owns one block pool for all its ranks, so one notice
    frees the copies of every rank in `remote_ranks`, read or not."""

    request_id: str  # P's request id (the remote_request_id P returned), never D's
    generation: int
    remote_ranks: tuple[int, ...]  # every P rank: each frees its copy on this notice


@dataclass(frozen=True)
class LocalRankPlan:
    """What one local (D) rank reads for each of its blocks."""

    local_rank: int
    spans: tuple[HeadSpan, ...]  # rank_reads: local offset order, covering its block once

    @property
    def remote_ranks(self) -> tuple[int, ...]:
        """The remote (P) ranks this rank reads from (one per run of heads; one for MLA)."""
        return tuple(sorted({s.remote_rank for s in self.spans}))

    @property
    def bytes_per_block(self) -> int:
        return sum(s.length for s in self.spans)


@dataclass(frozen=True)
class ReadPlan:
    """A request's reads and how P is told it may free, for one (D layout, P layout) pairing."""

    ranks: tuple[LocalRankPlan, ...]  # one per local rank, rank order
    read: tuple[int, ...]  # remote ranks some local rank reads
    unread: tuple[int, ...]  # remote ranks holding copies nobody reads (replicas not chosen)
    notice: ReleaseNotice

    def pairs(self) -> list[tuple[int, int]]:
        """(local rank, remote rank) of every read: one READ each."""
        return [(r.local_rank, p) for r in self.ranks for p in r.remote_ranks]

    def block_descs(self, local: Sequence[RankBlocks], remote: Sequence[RankBlocks], local_ids: Sequence[int],
                    remote_ids: Sequence[int]) -> dict[tuple[int, int], tuple[list[Desc], list[Desc]]]:
        """{(local rank, remote rank): (local descs, remote descs)} filling the local ranks'
        blocks `local_ids` from P's `remote_ids` (pairwise), as this plan's spans say."""
        if [r.kv.tp_rank for r in local] != [r.local_rank for r in self.ranks]:
            raise TPMappingError("the local ranks are not the plan's")
        out: dict[tuple[int, int], tuple[list[Desc], list[Desc]]] = {}
        for blocks, plan in zip(local, self.ranks):
            for remote_rank, descs in span_descs(blocks, remote, plan.spans, local_ids, remote_ids).items():
                out[(plan.local_rank, remote_rank)] = descs
        return out


def plan_request_reads(local: Sequence[RankKV], remote: Sequence[RankKV], salt: int, remote_request_id: str,
                       generation: int) -> ReadPlan:
    """The plan of one request's reads by D (`local` ranks) from P (`remote` ranks).

    Every head a D rank holds is read from exactly one P rank; a head P replicates (MLA's
    latent: every P rank; a KV head when P's TP exceeds its KV heads) from the replica
    `rank_reads` picks by `salt` (`request_salt` of P's request id) and the D rank, so the
    choice is deterministic, spread over requests, and D ranks spread over replicas. The
    notice names P's request id and `generation`, and covers every P rank. D's own request
    id is not an input: nothing P is told can carry it. Raises TPMappingError when D's ranks
    cannot be filled from P's (`check_pairing`)."""
    if not isinstance(remote_request_id, str) or not remote_request_id:
        raise TPMappingError("the remote request id must be a non-empty string")
    if type(generation) is not int:
        raise TPMappingError("the lease generation must be an int")
    check_pairing(local, remote)
    ranks = tuple(LocalRankPlan(r.tp_rank, tuple(rank_reads(r, remote, salt))) for r in local)
    read = sorted({p for r in ranks for p in r.remote_ranks})
    every = tuple(r.tp_rank for r in remote)
    return ReadPlan(ranks, tuple(read), tuple(p for p in every if p not in read),
                    ReleaseNotice(remote_request_id, generation, every))
