"""How a model's attention heads and KV heads split over tensor-parallel ranks.

Pure functions; the model builds its sharded layers from a `RankShard`, the KV cache
group spec sizes each rank's cache from it, and the connector maps reads between
engines of different TP sizes from the shards both sides announce.

The split follows vLLM: query heads are divided evenly (`num_heads % tp_size == 0`).
KV heads are divided evenly when `tp_size <= num_kv_heads` (`num_kv_heads % tp_size
== 0`); when `tp_size` exceeds them each rank holds ONE KV head, replicated on
`tp_size // num_kv_heads` consecutive ranks (`tp_size % num_kv_heads == 0`), so every
rank's query heads attend to KV heads it holds. Anything else is refused at start-up
with the reason (`TPSplitError`).
"""

from __future__ import annotations

from dataclasses import dataclass


class TPSplitError(ValueError):
    """The model cannot be split over this many ranks; the message says why."""


@dataclass(frozen=True)
class RankShard:
    """What one rank holds: global ids of its query heads and KV heads (contiguous ranges)."""

    tp_size: int
    rank: int
    q_heads: range
    kv_heads: range

    @property
    def num_q_heads(self) -> int:
        return len(self.q_heads)

    @property
    def num_kv_heads(self) -> int:
        return len(self.kv_heads)


def check_tp_split(num_heads: int, num_kv_heads: int, tp_size: int, intermediate_size: int | None = None) -> None:
    """Raises TPSplitError when `tp_size` ranks cannot split this geometry."""
    if tp_size < 1:
        raise TPSplitError(f"tensor parallel size must be >= 1, got {tp_size}")
    if num_heads % tp_size:
        raise TPSplitError(f"tensor parallel size {tp_size} does not divide the model's {num_heads} "
                           f"attention heads; use a divisor of {num_heads}")
    if tp_size <= num_kv_heads and num_kv_heads % tp_size:
        raise TPSplitError(f"tensor parallel size {tp_size} does not divide the model's {num_kv_heads} KV heads")
    if tp_size > num_kv_heads and tp_size % num_kv_heads:
        raise TPSplitError(f"tensor parallel size {tp_size} exceeds the model's {num_kv_heads} KV heads and is "
                           "not a multiple of them, so KV heads cannot be replicated evenly")
    if intermediate_size is not None and intermediate_size % tp_size:
        raise TPSplitError(f"tensor parallel size {tp_size} does not divide the MLP's intermediate size "
                           f"{intermediate_size}")


def rank_shard(num_heads: int, num_kv_heads: int, tp_size: int, rank: int) -> RankShard:
    """The heads rank `rank` of `tp_size` holds; raises TPSplitError for an impossible split."""
    check_tp_split(num_heads, num_kv_heads, tp_size)
    if not 0 <= rank < tp_size:
        raise ValueError(f"rank {rank} out of range for tensor parallel size {tp_size}")
    q = num_heads // tp_size
    if tp_size <= num_kv_heads:
        k = num_kv_heads // tp_size
        kv = range(rank * k, (rank + 1) * k)
    else:
        head = rank // (tp_size // num_kv_heads)
        kv = range(head, head + 1)
    return RankShard(tp_size, rank, range(rank * q, (rank + 1) * q), kv)


def shard_plan(num_heads: int, num_kv_heads: int, tp_size: int) -> tuple[RankShard, ...]:
    """Every rank's shard, rank order."""
    return tuple(rank_shard(num_heads, num_kv_heads, tp_size, r) for r in range(tp_size))


def even_split(size: int, tp_size: int, rank: int) -> range:
    """Rank `rank`'s contiguous part of `size` items split evenly (size % tp_size == 0)."""
    if size % tp_size:
        raise TPSplitError(f"{size} does not split evenly over {tp_size} ranks")
    part = size // tp_size
    return range(rank * part, (rank + 1) * part)
