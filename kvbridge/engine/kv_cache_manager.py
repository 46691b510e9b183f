"""KV cache manager: block tables per request, organised by KV cache groups.

Layers are grouped by the kind of state they keep (a *KV cache group*): full
attention (per-head K and V) and MLA (one latent per token, the same on every TP rank;
for block tables and prefix caching it behaves exactly like full attention: every token
of the context stays); sliding window and Mamba state are further specs. Each group
has one block table per request, and block ids cross every boundary as a tuple
of lists, one list per group, so hybrid models need no interface change.
All groups share one block pool (shape/kv_cache_layout.py: one block is one page whatever
the group). Prefix caching works on token-indexed groups by chained hashes of full
blocks' token ids (kv_events/hashing.py: SHA-256 from the model's root, so every instance of a
model, and the router, compute the same ones), keyed by (group index, digest); a model with a Mamba group gets no prefix hits (a Mamba state is one
request's whole context, not a run of tokens), and a request holds one block per Mamba
group from its first token on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from kvbridge.engine.block_pool import BlockPool, KVBlock
from kvbridge.engine.kv_event_queue import KVEventQueue
from kvbridge.engine.request import Request
from kvbridge.kv_events.events import SPEC_KIND
from kvbridge.kv_events.hashing import block_digest, model_root, to_external
from kvbridge.kv_transfer.params import BlockIds
from kvbridge.shape.kv_groups import KVCacheKind


@dataclass(frozen=True)
class KVCacheGroupSpec:
    kind: KVCacheKind
    block_size: int
    layer_ids: tuple[int, ...]
    sliding_window: int | None = None  # SLIDING_WINDOW: keys a query sees, itself included

    def __post_init__(self) -> None:
        if (self.kind is KVCacheKind.SLIDING_WINDOW) != (self.sliding_window is not None):
            raise ValueError("a sliding-window group needs a sliding_window, and only it")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")

    def blocks_needed(self, num_tokens: int) -> int:
        if self.kind is KVCacheKind.MAMBA:  # the request's one state, from its first token on
            return 1 if num_tokens > 0 else 0
        return -(-num_tokens // self.block_size)

    def first_needed_block(self, position: int) -> int:
        """The first block a query at `position` (and any later one) still reads."""
        if self.sliding_window is None:
            return 0
        return max(0, position - self.sliding_window + 1) // self.block_size


# The root of managers built without a model's (unit tests): any fixed root works within one process.
UNNAMED_ROOT = model_root("kvbridge-unnamed-model")


class KVCacheManager:
    """Block tables of every request, one per group, all of equal length (one entry per block
    of tokens); a sliding-window group's entries behind the window are the pool's null block
    (their blocks went back to the pool, and stay in the prefix cache until evicted)."""

    def __init__(self, pool: BlockPool, groups: Sequence[KVCacheGroupSpec], hash_root: bytes = UNNAMED_ROOT,
                 events: KVEventQueue | None = None) -> None:
        """`hash_root`: kv_events.hashing.model_root of the model (every chain starts there).
        `events`: where the prefix cache's changes are recorded (None: nowhere, at no cost)."""
        if not groups:
            raise ValueError("at least one KV cache group is required")
        if len({g.block_size for g in groups}) != 1:
            raise ValueError("every KV cache group must have the same block size")
        for g in groups:
            if g.kind not in KVCacheKind:
                raise ValueError(f"unsupported KV cache group kind {g.kind}")
        if any(g.sliding_window is not None for g in groups) and pool.null_block is None:
            raise ValueError("sliding-window groups need a pool with a null block (reserve_null=True)")
        self.pool = pool
        self.groups = tuple(groups)
        self.block_size = groups[0].block_size
        # Mamba states are not cached by prefix: a state holds exactly one request's whole context.
        self.has_mamba = any(g.kind is KVCacheKind.MAMBA for g in groups)
        self._tokens_group = next((i for i, g in enumerate(groups) if g.kind.token_indexed), None)
        self._tables: dict[str, tuple[list[KVBlock], ...]] = {}
        self._num_cached: dict[str, int] = {}  # full blocks of a request cache_blocks has handled
        self.hash_root = hash_root
        self.events: KVEventQueue | None = None
        if events is not None:
            self.record_events(events)
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of which found in the cache

    # ---- queries -------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def record_events(self, events: KVEventQueue) -> None:
        """From now on, record the prefix cache's changes in `events`."""
        self.events = events
        self.pool.on_removed = self._record_removed

    def get_block_ids(self, request_id: str) -> BlockIds:
        table = self._tables.get(request_id)
        if table is None:
            return tuple([] for _ in self.groups)
        return tuple([b.block_id for b in blocks] for blocks in table)

    def num_allocated_tokens(self, request_id: str) -> int:
        table = self._tables.get(request_id)
        if not table or self._tokens_group is None:
            return 0
        return len(table[self._tokens_group]) * self.block_size

    def block_hashes(self, request: Request) -> list[bytes]:
        """Chained digests of the request's full blocks (prompt and output), computed incrementally:
        each block is hashed once in the request's life (kept in request.block_hashes)."""
        tokens = request.all_token_ids
        hashes = request.block_hashes
        bs = self.block_size
        while (len(hashes) + 1) * bs <= len(tokens):
            i = len(hashes)
            hashes.append(block_digest(hashes[-1] if hashes else self.hash_root, tokens[i * bs:(i + 1) * bs]))
        return hashes

    def _may_hit(self, request: Request) -> bool:
        """Whether the prefix cache may serve `request` at all: caching on, no Mamba state, and no prompt
        logprobs wanted (they need the logits of every prompt position: vLLM's rule)."""
        return self.pool.enable_caching and not self.has_mamba and not request.wants_prompt_logprobs

    def can_share_prompt(self, request: Request) -> bool:
        """Whether a sibling's cached prompt blocks could serve `request` (get_computed_blocks would hit)."""
        return self._may_hit(request) and request.num_tokens > self.block_size

    def get_computed_blocks(self, request: Request, count: bool = True) -> tuple[tuple[list[KVBlock], ...], int]:
        """Longest cached prefix of the request, in whole blocks, that EVERY group can resume
        from; takes no reference. A full-attention group needs every block of the prefix; a
        sliding-window group only the blocks the next query still sees (the rest are null),
        except for a request whose whole KV a decode instance will read (every block).

        At least one prompt token is always left to compute, so the step that ends
        the prompt has logits to sample from. `count`: add the query to the prefix cache's
        hit-rate counters (a request's first schedule does; a held prefix does not).
        """
        empty: tuple[list[KVBlock], ...] = tuple([] for _ in self.groups)
        if not self._may_hit(request):
            return empty, 0
        hashes = self.block_hashes(request)[:(request.num_tokens - 1) // self.block_size]
        whole = request.keeps_whole_context  # a decode instance will read every block: all must be there
        hit = len(hashes)
        for gi, group in enumerate(self.groups):
            if group.sliding_window is None or whole:
                n = 0
                while n < hit and self.pool.get_cached_block((gi, hashes[n])) is not None:
                    n += 1
                hit = n
        while hit > 0 and not whole and not all(self._window_cached(gi, g, hashes, hit)
                                                for gi, g in enumerate(self.groups) if g.sliding_window is not None):
            hit -= 1
        if count:
            self.prefix_queries += request.num_tokens
            self.prefix_hits += hit * self.block_size
        if hit == 0:
            return empty, 0
        tables = []
        for gi, group in enumerate(self.groups):
            first = 0 if whole else group.first_needed_block(hit * self.block_size)
            found = [self.pool.get_cached_block((gi, h)) for h in hashes[first:hit]]
            table = [self.pool.null_block] * first + found
            assert all(b is not None for b in table)  # a hit is cached; a window's skipped blocks are null (reserved)
            tables.append([b for b in table if b is not None])
        return tuple(tables), hit * self.block_size

    def tier_keys(self, request: Request, num_local: int) -> list[tuple[int, bytes]]:
        """The cache keys of the prompt's full blocks after a pool hit of `num_local` tokens, up to the
        last one a hit may cover (one prompt token is always computed): what a lower tier may hold for
        it (engine/kv_tier.py; one token-indexed group, checked when the tier is made)."""
        if not self._may_hit(request):
            return []
        hashes = self.block_hashes(request)[:(request.num_tokens - 1) // self.block_size]
        return [(0, h) for h in hashes[num_local // self.block_size:]]

    def _window_cached(self, gi: int, group: KVCacheGroupSpec, hashes: list[bytes], hit: int) -> bool:
        first = group.first_needed_block(hit * self.block_size)
        return all(self.pool.get_cached_block((gi, h)) is not None for h in hashes[first:hit])

    def can_allocate(self, request: Request, num_new_tokens: int,
                     new_computed_blocks: tuple[list[KVBlock], ...] | None = None) -> bool:
        """Whether allocate_slots with the same arguments would succeed, without side effects."""
        hits = new_computed_blocks or tuple([] for _ in self.groups)
        return self._free_blocks_needed(request, num_new_tokens, hits) <= self.pool.num_free_blocks

    # ---- actions -------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: tuple[list[KVBlock], ...] | None = None) -> BlockIds | None:
        """Make room for `num_new_tokens` more tokens after the request's computed ones.

        `new_computed_blocks` are prefix-cache hits found by get_computed_blocks for a
        request that has no blocks yet; they are referenced here. A sliding-window group's
        blocks that no query from now on sees go back to the pool (unless a decode instance
        will read the request's KV: `Request.keeps_whole_context`). Returns the request's
        full block ids, or None (and changes nothing) if blocks ran out.
        """
        hits = new_computed_blocks or tuple([] for _ in self.groups)
        if self._free_blocks_needed(request, num_new_tokens, hits) > self.pool.num_free_blocks:
            return None
        first_new = request.num_computed_tokens + self._hit_tokens(hits)
        total_tokens = first_new + num_new_tokens
        table = self._tables.get(request.request_id)
        if table is None:
            table = tuple([] for _ in self.groups)
            self._tables[request.request_id] = table
        for gi, group in enumerate(self.groups):
            if hits[gi]:
                self.pool.touch(b for b in hits[gi] if b is not self.pool.null_block)
                table[gi].extend(hits[gi])
            missing = group.blocks_needed(total_tokens) - len(table[gi])
            if missing > 0:
                table[gi].extend(self.pool.allocate(missing))
            if group.sliding_window is not None and not request.keeps_whole_context:
                self._drop_behind_window(table[gi], group.first_needed_block(first_new))
        return self.get_block_ids(request.request_id)

    def reference(self, request_id: str, blocks: tuple[list[KVBlock], ...]) -> BlockIds:
        """Reference cached `blocks` (a get_computed_blocks hit, every group) under `request_id`, which
        holds none yet: they stay out of the free queue until `free(request_id)`."""
        if request_id in self._tables:
            raise ValueError(f"{request_id!r} already holds blocks")
        self.pool.touch(b for g in blocks for b in g if b is not self.pool.null_block)
        self._tables[request_id] = tuple(list(g) for g in blocks)
        return self.get_block_ids(request_id)

    def _drop_behind_window(self, blocks: list[KVBlock], first_needed: int) -> None:
        null = self.pool.null_block
        behind = [b for b in blocks[:first_needed] if b is not null]
        if behind:
            blocks[:first_needed] = [null] * first_needed  # type: ignore[list-item]
            self.pool.free(list(reversed(behind)))

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Publish the request's full blocks up to num_computed_tokens in the prefix cache: the
        prompt's and, as they fill, the generated tokens' (a conversation's next turn finds both).
        Each block once per allocation; the blocks that enter the cache are recorded as events."""
        rid = request.request_id
        table = self._tables.get(rid)
        # A model with a Mamba group gets no prefix hits (get_computed_blocks): blocks it cannot
        # reuse are neither cached nor published, or a router would route to them for nothing.
        if table is None or not self.pool.enable_caching or self.has_mamba:
            return
        hashes = self.block_hashes(request)
        start = self._num_cached.get(rid, 0)
        n_full = min(num_computed_tokens // self.block_size, len(hashes))
        if n_full <= start:
            return
        self._num_cached[rid] = n_full
        for gi, blocks in enumerate(table):
            if not self.groups[gi].kind.token_indexed:
                continue
            stored = [i for i in range(start, n_full) if self.pool.cache_block(blocks[i], (gi, hashes[i]))]
            if stored and self.events is not None:
                self._record_stored(request, gi, hashes, stored)

    def _record_stored(self, request: Request, gi: int, hashes: list[bytes], stored: list[int]) -> None:
        """One BlockStored per run of consecutive block indices that entered the cache."""
        assert self.events is not None
        group, bs, tokens = self.groups[gi], self.block_size, request.all_token_ids
        run_start = 0
        for k in range(1, len(stored) + 1):
            if k < len(stored) and stored[k] == stored[k - 1] + 1:
                continue
            first, last = stored[run_start], stored[k - 1]
            self.events.stored([to_external(h) for h in hashes[first:last + 1]],
                               to_external(hashes[first - 1]) if first > 0 else None,
                               list(tokens[first * bs:(last + 1) * bs]), bs, gi, SPEC_KIND[group.kind],
                               group.sliding_window)
            run_start = k

    def _record_removed(self, key: object) -> None:
        assert self.events is not None and isinstance(key, tuple)
        gi, digest = key
        self.events.removed(to_external(digest), gi)

    def free(self, request_id: str) -> None:
        """Release all of the request's blocks; safe to call for a request with none."""
        table = self._tables.pop(request_id, None)
        self._num_cached.pop(request_id, None)
        if table is None:
            return
        for blocks in table:
            self.pool.free([b for b in reversed(blocks) if b is not self.pool.null_block])

    def invalidate_blocks(self, block_ids: set[int]) -> None:
        """Blocks whose content is wrong (a failed remote load) leave the prefix cache."""
        self.pool.invalidate(block_ids)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (blocks in use stay with their requests)."""
        self.pool.reset_prefix_cache()
        self._num_cached.clear()  # running requests' full blocks enter the cache again at their next step
        if self.events is not None:
            self.events.cleared()

    def _hit_tokens(self, hits: tuple[list[KVBlock], ...]) -> int:
        return len(hits[self._tokens_group]) * self.block_size if self._tokens_group is not None else 0

    def _free_blocks_needed(self, request: Request, num_new_tokens: int,
                            hits: tuple[list[KVBlock], ...]) -> int:
        """Free blocks that allocate_slots would take: fresh ones, plus cached hits that are
        free right now (touching them takes them off the free list)."""
        total_tokens = request.num_computed_tokens + self._hit_tokens(hits) + num_new_tokens
        table = self._tables.get(request.request_id)
        needed = 0
        for gi, group in enumerate(self.groups):
            have = len(table[gi]) if table else 0
            needed += max(group.blocks_needed(total_tokens) - have - len(hits[gi]), 0)
            needed += sum(1 for b in hits[gi] if b.ref_cnt == 0 and b is not self.pool.null_block)
        return needed
