"""vLLM's KV event structs as its releases declare them, the reference kvbridge's wire is checked
against (tests/unit/test_kv_events_*.py). Reproduced from the published schema, not imported:
vLLM is not a dependency.

- `Map*`: vLLM 0.33.0, `vllm/distributed/kv_events.py` (events are maps since PR #42892).
- `Array*`: vLLM 0.23 (before PR #42892): the same fields, events `array_like=True`.
- `OldArray*`: vLLM 0.9 (before `lora_name`, `extra_keys`, groups; no data_parallel_rank).
"""

from __future__ import annotations

from typing import Any

import msgspec


class MapEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class MapKVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class MapBlockStored(MapKVCacheEvent, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class MapBlockRemoved(MapKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class MapAllBlocksCleared(MapKVCacheEvent, tag="AllBlocksCleared"):
    pass


class MapKVEventBatch(MapEventBatch):
    events: list[MapBlockStored | MapBlockRemoved | MapAllBlocksCleared]


class ArrayKVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class ArrayBlockStored(ArrayKVCacheEvent, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class ArrayBlockRemoved(ArrayKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None


class ArrayAllBlocksCleared(ArrayKVCacheEvent, tag="AllBlocksCleared"):
    pass


class ArrayKVEventBatch(MapEventBatch):
    events: list[ArrayBlockStored | ArrayBlockRemoved | ArrayAllBlocksCleared]


class OldEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


class OldArrayBlockStored(ArrayKVCacheEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class OldArrayBlockRemoved(ArrayKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None
