"""The pool of fixed-size KV blocks: reference counts, prefix cache, LRU eviction.

One owner: the KV cache manager. A block is *free* when no request references it
(ref_cnt == 0); a free block may still hold a cached prefix (it has a hash) and is
then reused by a later request with the same prefix, or evicted — oldest first —
when fresh blocks are needed. Cache keys are whatever the manager hashes blocks by
(a chained hash, per KV cache group).

With `reserve_null`, block 0 is the *null block*: never handed out, never freed, never
cached; it stands in a block table for a block the request no longer needs (a sliding
window's blocks behind the window), so tables keep one entry per block of tokens.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Hashable, Iterable, Sequence


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: Hashable | None = None  # set while the block is in the prefix cache


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True, reserve_null: bool = False,
                 on_removed: Callable[[Hashable], None] | None = None) -> None:
        """`on_removed(key)` is called for each key that leaves the prefix cache by eviction or
        invalidation (not by reset_prefix_cache): the KV events' BlockRemoved. `on_evicted(block_id,
        key)` (set later, by a lower tier: engine/kv_tier.py) is called when `allocate` hands out a
        block that still held `key`, before anything can overwrite it (never for an invalidated one)."""
        if num_blocks < 1 + reserve_null:
            raise ValueError(f"num_blocks must be >= {1 + reserve_null}, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.null_block: KVBlock | None = self.blocks[0] if reserve_null else None
        # Free blocks in eviction order: the first one is evicted first.
        self._free: OrderedDict[int, KVBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks if b is not self.null_block)
        self._cached: dict[Hashable, KVBlock] = {}
        self.on_removed: Callable[[Hashable], None] | None = on_removed
        self.on_evicted: Callable[[int, Hashable], None] | None = None

    @property
    def num_usable_blocks(self) -> int:
        """Blocks requests can hold (all but the null block)."""
        return self.num_blocks - (self.null_block is not None)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by requests (cached free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def get_cached_block(self, block_hash: Hashable) -> KVBlock | None:
        return self._cached.get(block_hash) if self.enable_caching else None

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free_blocks

    def allocate(self, n: int) -> list[KVBlock]:
        """Take n free blocks (evicting their cached content). Raises ValueError if too few."""
        if not self.can_allocate(n):
            raise ValueError(f"cannot allocate {n} blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None and self.on_evicted is not None:
                self.on_evicted(block.block_id, block.block_hash)
            self._uncache(block)
            block.ref_cnt = 1
            out.append(block)
        # Ascending ids: a request's fresh blocks then form runs that a KV transfer moves as
        # one descriptor each (the free list hands them out tail-first after frees).
        out.sort(key=lambda b: b.block_id)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on blocks found in the prefix cache."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: Sequence[KVBlock]) -> None:
        """Drop one reference from each block. Pass a request's blocks tail-first so
        that the ends of prefixes are evicted before their beginnings."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def cache_block(self, block: KVBlock, block_hash: Hashable) -> bool:
        """Publish a full block under its chained hash (first writer wins). Returns whether the
        hash entered the cache now (False: caching is off, or the block or hash was cached)."""
        if not self.enable_caching or block.block_hash is not None or block is self.null_block:
            return False
        if block_hash in self._cached:
            return False
        block.block_hash = block_hash
        self._cached[block_hash] = block
        return True

    def invalidate(self, block_ids: Iterable[int]) -> None:
        """Remove blocks from the prefix cache: their content must never be reused."""
        for block_id in block_ids:
            self._uncache(self.blocks[block_id])

    def reset_prefix_cache(self) -> None:
        for block in list(self._cached.values()):
            self._uncache(block, report=False)

    def _uncache(self, block: KVBlock, report: bool = True) -> None:
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
                if report and self.on_removed is not None:
                    self.on_removed(block.block_hash)
            block.block_hash = None
