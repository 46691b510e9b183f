"""vLLM's KV cache events, on the wire exactly as vLLM writes them, and a decoder for both of
vLLM's encodings.

Matched against vLLM 0.33.0 (the PyPI wheel, commit g4ba787ec9), `vllm/distributed/kv_events.py`:

- `EventBatch` is an array-like msgspec struct, `[ts, events, data_parallel_rank]`, always three
  elements (msgspec writes every field of an array-like struct: None is nil).
- Each event is a tagged struct (`tag=True`: the tag is the class name, under the key "type"),
  encoded since vLLM PR #42892 as a msgpack MAP: `{"type": "BlockStored", "block_hashes": ...}`,
  fields in declaration order, fields with defaults left out while they hold their default.
  Before that PR (vLLM <= 0.23) each event was a positional array, `["BlockStored", hashes,
  parent, ...]`; `decode_batch` reads both, even mixed in one batch.
- Field order and defaults are vLLM's: BlockStored's `block_hashes, parent_block_hash, token_ids,
  block_size, lora_id, medium, lora_name` are always written (no default), then `extra_keys,
  group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window` and 0.33's `locality, ownership,
  session_id, lookahead_token_ids`, all default None. BlockRemoved: `block_hashes, medium` then
  `group_idx, locality, ownership`.
- A block hash on the wire (vLLM's ExternalBlockHash) is an int (vLLM's default: the low 64 bits
  of the digest) or the digest's bytes; `external_hash` folds either to the int the index keys on.

The structs are frozen (kvbridge's messages are values); that changes nothing on the wire.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Union

import msgspec

from kvbridge.shape.kv_groups import KVCacheKind

# vLLM's ExternalBlockHash: bytes | int.
ExternalBlockHash = Union[int, bytes]
MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
_U64 = (1 << 64) - 1


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, frozen=True):
    """One message's payload: when (time.time()), what happened, and which data-parallel rank."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True, frozen=True):
    """Base of the three events; each is written as a map tagged {"type": <class name>}."""


class BlockStored(KVCacheEvent, frozen=True):
    """Full blocks entered the prefix cache: `block_hashes[i]` holds `token_ids[i*block_size:
    (i+1)*block_size]`, chained on `parent_block_hash` (None: the first block of a prompt)."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None  # deprecated in vLLM, still written
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None  # one entry per block, or None
    group_idx: int | None = None  # the KV cache group (hybrid models); None: vLLM before groups
    kv_cache_spec_kind: str | None = None  # "full_attention", "sliding_window", "mamba", ...
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None  # vLLM 0.33: LOCAL or REMOTE to the publisher
    ownership: str | None = None  # vLLM 0.33: an offloading tier's id
    session_id: str | None = None  # vLLM 0.33
    lookahead_token_ids: list[list[int]] | None = None  # vLLM 0.33


class BlockRemoved(KVCacheEvent, frozen=True):
    """Blocks left the prefix cache (evicted or invalidated)."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent, frozen=True):
    """The whole prefix cache was dropped (a reset)."""


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


class KVEventBatch(EventBatch, frozen=True):
    """EventBatch with its events typed: what a publisher sends and `decode_batch` returns."""

    events: list[KVEvent]


# ---- the positional (array) encoding of vLLM before PR #42892 --------------------------
# Same fields and order; the later ones default to None so that the shorter arrays of older
# vLLM releases (before `medium`, `lora_name`, ...) decode too. Extra trailing elements are
# ignored by msgspec, so a newer positional writer decodes as well.


class _ArrayEvent(msgspec.Struct, array_like=True, gc=False, tag=True, frozen=True):
    pass


class _ArrayStored(_ArrayEvent, tag="BlockStored", frozen=True):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class _ArrayRemoved(_ArrayEvent, tag="BlockRemoved", frozen=True):
    block_hashes: list[ExternalBlockHash]
    medium: str | None = None
    group_idx: int | None = None


class _ArrayCleared(_ArrayEvent, tag="AllBlocksCleared", frozen=True):
    pass


class _RawBatch(msgspec.Struct, array_like=True, gc=False, frozen=True):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


class Encoding(str, enum.Enum):
    MAP = "map"  # vLLM since PR #42892 (and kvbridge)
    ARRAY = "array"  # vLLM before it
    MIXED = "mixed"  # both in one batch (a decoder that fronts a fleet mid-upgrade sees this)
    EMPTY = "empty"  # no events


class SkipKind(str, enum.Enum):
    UNKNOWN_TYPE = "unknown_type"  # a tag this decoder does not know (a newer vLLM's event)
    INVALID = "invalid"  # a known shape with wrong fields, or not an event at all


@dataclass(frozen=True)
class DecodedBatch:
    """A payload that decoded: its events in order, and the events that did not (skipped)."""

    ts: float
    events: tuple[KVEvent, ...]
    data_parallel_rank: int | None
    encoding: Encoding
    skipped: tuple[SkipKind, ...] = ()


@dataclass(frozen=True)
class Undecodable:
    """A payload that is not an EventBatch at all; `reason` is msgspec's message."""

    reason: str


_ENCODER = msgspec.msgpack.Encoder()
_MAP_BATCH = msgspec.msgpack.Decoder(KVEventBatch)
_RAW_BATCH = msgspec.msgpack.Decoder(_RawBatch)
_MAP_EVENT = msgspec.msgpack.Decoder(KVEvent)
_ARRAY_EVENT = msgspec.msgpack.Decoder(Union[_ArrayStored, _ArrayRemoved, _ArrayCleared])
_ANY = msgspec.msgpack.Decoder()
# msgspec's errors, and a ValueError (UnicodeDecodeError) for a string that is not UTF-8.
_BAD = (msgspec.MsgspecError, ValueError, RecursionError)


def encode_batch(batch: EventBatch) -> bytes:
    """The msgpack bytes vLLM's publisher sends for `batch` (its third frame)."""
    return _ENCODER.encode(batch)


def decode_batch(payload: bytes) -> DecodedBatch | Undecodable:
    """Decode one payload of either encoding; never raises. Events that do not decode are
    skipped and named in `skipped` (the others are kept, in order)."""
    try:
        batch = _MAP_BATCH.decode(payload)
    except _BAD:
        return _decode_event_by_event(payload)
    encoding = Encoding.MAP if batch.events else Encoding.EMPTY
    return DecodedBatch(batch.ts, tuple(batch.events), batch.data_parallel_rank, encoding)


def _decode_event_by_event(payload: bytes) -> DecodedBatch | Undecodable:
    try:
        raw = _RAW_BATCH.decode(payload)
    except _BAD as e:
        return Undecodable(str(e))
    events: list[KVEvent] = []
    skipped: list[SkipKind] = []
    seen: set[Encoding] = set()
    for item in raw.events:
        event, encoding, skip = _decode_event(item)
        if event is not None and encoding is not None:
            events.append(event)
            seen.add(encoding)
        elif skip is not None:
            skipped.append(skip)
    encoding = seen.pop() if len(seen) == 1 else Encoding.MIXED if seen else Encoding.EMPTY
    return DecodedBatch(raw.ts, tuple(events), raw.data_parallel_rank, encoding, tuple(skipped))


def _decode_event(item: msgspec.Raw) -> tuple[KVEvent | None, Encoding | None, SkipKind | None]:
    try:
        return _MAP_EVENT.decode(item), Encoding.MAP, None
    except _BAD:
        pass
    try:
        return _from_array(_ARRAY_EVENT.decode(item)), Encoding.ARRAY, None
    except _BAD:
        pass
    return None, None, _skip_kind(item)


def _skip_kind(item: msgspec.Raw) -> SkipKind:
    """An event with a tag we do not know is a newer vLLM's; anything else is invalid."""
    try:
        value = _ANY.decode(item)
    except _BAD:
        return SkipKind.INVALID
    tag = value.get("type") if isinstance(value, dict) else value[0] if isinstance(value, list) and value else None
    known = {"BlockStored", "BlockRemoved", "AllBlocksCleared"}
    return SkipKind.UNKNOWN_TYPE if isinstance(tag, str) and tag not in known else SkipKind.INVALID


def _from_array(event: _ArrayStored | _ArrayRemoved | _ArrayCleared) -> KVEvent:
    if isinstance(event, _ArrayStored):
        return BlockStored(
            block_hashes=event.block_hashes, parent_block_hash=event.parent_block_hash,
            token_ids=event.token_ids, block_size=event.block_size, lora_id=event.lora_id,
            medium=event.medium, lora_name=event.lora_name, extra_keys=event.extra_keys,
            group_idx=event.group_idx, kv_cache_spec_kind=event.kv_cache_spec_kind,
            kv_cache_spec_sliding_window=event.kv_cache_spec_sliding_window)
    if isinstance(event, _ArrayRemoved):
        return BlockRemoved(block_hashes=event.block_hashes, medium=event.medium, group_idx=event.group_idx)
    return AllBlocksCleared()


# ---- the router's fast path: only what the index keeps -----------------------------------
# Decoding a batch into these skips token ids, extra keys and the rest (about half the cost of a
# full decode); hashes must be ints (vLLM's default). Anything else goes the full way.


class StoredHashes(msgspec.Struct, gc=False, tag="BlockStored", frozen=True):
    """A BlockStored as the index sees it."""

    block_hashes: list[int]
    block_size: int
    medium: str | None = None
    group_idx: int | None = None


class RemovedHashes(msgspec.Struct, gc=False, tag="BlockRemoved", frozen=True):
    """A BlockRemoved as the index sees it."""

    block_hashes: list[int]
    medium: str | None = None
    group_idx: int | None = None


HashEvent = Union[StoredHashes, RemovedHashes, AllBlocksCleared]


class _HashBatch(msgspec.Struct, array_like=True, gc=False, frozen=True):
    ts: float
    events: list[HashEvent]
    data_parallel_rank: int | None = None


@dataclass(frozen=True)
class HashBatch:
    """A payload as the index applies it: hashes in their int form, in order."""

    events: tuple[HashEvent, ...]
    skipped: tuple[SkipKind, ...] = ()


_HASH_BATCH = msgspec.msgpack.Decoder(_HashBatch)


def decode_hashes(payload: bytes) -> HashBatch | Undecodable:
    """`decode_batch` for the index: the same events (either encoding, bytes hashes folded by
    `external_hash`), less what the index does not keep. Never raises."""
    try:
        return HashBatch(tuple(_HASH_BATCH.decode(payload).events))
    except _BAD:
        pass
    decoded = decode_batch(payload)
    if isinstance(decoded, Undecodable):
        return decoded
    return HashBatch(tuple(_hashes_of(e) for e in decoded.events), decoded.skipped)


def _hashes_of(event: KVEvent) -> HashEvent:
    if isinstance(event, BlockStored):
        return StoredHashes([external_hash(h) for h in event.block_hashes], event.block_size, event.medium,
                            event.group_idx)
    if isinstance(event, BlockRemoved):
        return RemovedHashes([external_hash(h) for h in event.block_hashes], event.medium, event.group_idx)
    return event


# BlockStored.kv_cache_spec_kind of each kvbridge KV cache group kind: vLLM 0.33's
# KVCacheSpecKind values (vllm/v1/kv_cache_interface.py).
SPEC_KIND: dict[KVCacheKind, str] = {
    KVCacheKind.FULL_ATTENTION: "full_attention",
    KVCacheKind.MLA: "mla_attention",
    KVCacheKind.SLIDING_WINDOW: "sliding_window",
    KVCacheKind.MAMBA: "mamba",
}


def external_hash(block_hash: ExternalBlockHash) -> int:
    """The int a block hash is keyed by: an int as is (masked to 64 bits), bytes as vLLM turns
    a digest into an int (big-endian, low 64 bits: vLLM's maybe_convert_block_hash)."""
    if isinstance(block_hash, bytes):
        return int.from_bytes(block_hash, "big") & _U64
    return block_hash & _U64
