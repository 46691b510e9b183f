"""What one tensor-parallel rank holds of a Mamba2 mixer: its heads and the groups whose B and C
it reads (`mamba2_shard`).

The H heads split evenly over ranks (H % tp == 0). Groups split evenly when G % tp == 0;
otherwise tp must be a multiple of G and each rank holds a copy of the one group its heads read
(engine/layers/mamba2.py computes with the shard; kv_transfer's mamba_mapping pairs P's and D's
shards of the state). Pure functions; a split that cannot be made raises TPSplitError.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbridge.shape.model_config import Mamba2Config
from kvbridge.shape.tp_split import TPSplitError


@dataclass(frozen=True)
class Mamba2Shard:
    """What one rank holds of a Mamba2 mixer: global ids of its heads and of the groups whose B
    and C it holds (its heads' groups: its share of G, or the one group it shares with others)."""

    tp_size: int
    rank: int
    heads: range
    groups: range

    @property
    def num_heads(self) -> int:
        return len(self.heads)

    @property
    def num_groups(self) -> int:
        return len(self.groups)


def mamba2_shard(config: Mamba2Config, tp_size: int, rank: int) -> Mamba2Shard:
    """Rank `rank`'s part of the mixer; raises TPSplitError for a split it cannot make."""
    heads, groups = config.num_heads, config.n_groups
    if tp_size < 1:
        raise TPSplitError(f"tensor parallel size must be >= 1, got {tp_size}")
    if not 0 <= rank < tp_size:
        raise ValueError(f"rank {rank} out of range for tensor parallel size {tp_size}")
    if heads % tp_size:
        raise TPSplitError(f"tensor parallel size {tp_size} does not divide the {heads} Mamba heads")
    if groups % tp_size and tp_size % groups:
        raise TPSplitError(f"tensor parallel size {tp_size} neither divides the {groups} Mamba groups nor is a "
                           "multiple of them, so ranks cannot hold whole groups or share copies of one")
    per = heads // tp_size
    if groups % tp_size == 0:
        g = groups // tp_size
        held = range(rank * g, (rank + 1) * g)
    else:
        group = rank // (tp_size // groups)
        held = range(group, group + 1)
    return Mamba2Shard(tp_size, rank, range(rank * per, (rank + 1) * per), held)
