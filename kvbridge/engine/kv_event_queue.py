"""The prefix cache's KV events, queued in the order they happened and drained after each step.

The KV cache manager records a `BlockStored` when a request's full blocks enter the prefix cache
(one event per request, group and run of consecutive new blocks), the block pool's eviction and
invalidation a `BlockRemoved` per block, a reset an `AllBlocksCleared`; `LLMEngine.step` drains
them into one `EventBatch` for the publisher (kv_events/publisher.py). Events are vLLM's
(kv_events/events.py), block hashes the int form of kv_events/hashing.py's chained digests,
medium "GPU" as vLLM writes for its primary cache; a lower tier's blocks (engine/kv_tier.py) under
the tier's medium.

Bounded: past `max_events` undrained events the queue keeps only an `AllBlocksCleared` (and what
follows it): a subscriber then forgets this instance's blocks and routes to it as if cold, never
believing it holds a block it lost. The engine drains after every step, so this takes a step that
changes more blocks than `max_events`.
"""

from __future__ import annotations

import logging

from kvbridge.kv_events.events import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, ExternalBlockHash, KVEvent

logger = logging.getLogger(__name__)

DEFAULT_MAX_EVENTS = 1_000_000


class KVEventQueue:
    """One producer (the engine thread), drained by the same thread after each step."""

    def __init__(self, max_events: int = DEFAULT_MAX_EVENTS) -> None:
        if max_events < 1:
            raise ValueError(f"max_events must be >= 1, got {max_events}")
        self.max_events = max_events
        self.overflows = 0  # times the queue was cut down to one AllBlocksCleared
        self._events: list[KVEvent] = []

    def __len__(self) -> int:
        return len(self._events)

    def stored(self, block_hashes: list[ExternalBlockHash], parent_block_hash: int | None, token_ids: list[int],
               block_size: int, group_idx: int, spec_kind: str, sliding_window: int | None) -> None:
        self._put(BlockStored(block_hashes=block_hashes, parent_block_hash=parent_block_hash, token_ids=token_ids,
                              block_size=block_size, lora_id=None, medium=MEDIUM_GPU, lora_name=None,
                              group_idx=group_idx, kv_cache_spec_kind=spec_kind,
                              kv_cache_spec_sliding_window=sliding_window))

    def removed(self, block_hash: int, group_idx: int) -> None:
        self._put(BlockRemoved(block_hashes=[block_hash], medium=MEDIUM_GPU, group_idx=group_idx))

    def offloaded(self, block_hashes: list[ExternalBlockHash], block_size: int, group_idx: int, medium: str) -> None:
        """Blocks a lower tier (engine/kv_tier.py) now holds: as vLLM's offloading connector publishes
        them, hashes without tokens or parent, under the tier's medium."""
        self._put(BlockStored(block_hashes=block_hashes, parent_block_hash=None, token_ids=[], block_size=block_size,
                              lora_id=None, medium=medium, lora_name=None, group_idx=group_idx))

    def offload_removed(self, block_hash: int, group_idx: int, medium: str) -> None:
        self._put(BlockRemoved(block_hashes=[block_hash], medium=medium, group_idx=group_idx))

    def cleared(self) -> None:
        self._put(AllBlocksCleared())

    def drain(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events

    def _put(self, event: KVEvent) -> None:
        if len(self._events) >= self.max_events:
            self.overflows += 1
            if self.overflows == 1:
                logger.warning("kv events: more than %d events in one step; subscribers are told to forget "
                               "this instance's blocks (logged once)", self.max_events)
            self._events = [AllBlocksCleared()]
        self._events.append(event)
