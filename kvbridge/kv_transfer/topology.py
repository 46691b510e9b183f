"""Where blocks live in memory, and which byte ranges a read copies.

The engine's KV cache is one block-major tensor [num_blocks, layers, 2, block_size,
kv_heads, head_dim]: one block of every layer is one contiguous span (a "plane" of
equal-sized blocks; the layout keeps room for several planes). A read of blocks
`remote -> local` becomes one descriptor per run of blocks consecutive on both sides
(coalescing), so a request moves as a few large copies, not thousands of small ones.

Tensor parallelism is 1 on both sides in kvbridge today: a D rank reads from the
one P rank; head-slicing for differing TP sizes is not implemented.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from kvbridge.kv_transfer.backends.base import coalesce_block_runs, run_descs


@dataclass(frozen=True)
class PlaneLayout:
    """One engine's KV memory: `num_planes` planes of `num_blocks` blocks of `block_bytes`."""

    plane_base_addrs: tuple[int, ...]
    block_bytes: int
    num_blocks: int

    @classmethod
    def of_kv_cache(cls, kv_cache) -> "PlaneLayout":
        """The block-major engine cache: one plane whose blocks are kv_cache[b]."""
        if not kv_cache.is_contiguous():
            raise ValueError("the KV cache must be contiguous")
        return cls((kv_cache.data_ptr(),), kv_cache[0].numel() * kv_cache.element_size(), kv_cache.shape[0])


def read_descriptors(local: PlaneLayout, remote: PlaneLayout, local_ids: Sequence[int],
                     remote_ids: Sequence[int]) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(local descs, remote descs) as (addr, length) pairs for reading remote_ids into local_ids."""
    if len(local_ids) != len(remote_ids):
        raise ValueError(f"{len(remote_ids)} remote blocks for {len(local_ids)} local blocks")
    if local.block_bytes != remote.block_bytes or len(local.plane_base_addrs) != len(remote.plane_base_addrs):
        raise ValueError("local and remote KV layouts differ")
    if any(not 0 <= b < remote.num_blocks for b in remote_ids):
        raise ValueError("remote block id out of range")
    if any(not 0 <= b < local.num_blocks for b in local_ids):
        raise ValueError("local block id out of range")
    runs = coalesce_block_runs(list(local_ids), list(remote_ids))
    local_descs, remote_descs = [], []
    for lbase, rbase in zip(local.plane_base_addrs, remote.plane_base_addrs):
        ld, rd = run_descs(runs, local_base=lbase, remote_base=rbase, block_bytes=local.block_bytes)
        local_descs += ld
        remote_descs += rd
    return local_descs, remote_descs
