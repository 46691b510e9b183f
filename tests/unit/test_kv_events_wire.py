"""KV events on the wire: kvbridge's bytes are vLLM 0.33's, byte for byte, for every event type;
the decoder reads vLLM's map encoding, its older positional arrays (even mixed in one batch),
skips unknown or invalid events and never raises on a bad payload."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.kv_events.events import (
    AllBlocksCleared, BlockRemoved, BlockStored, DecodedBatch, Encoding, HashBatch, KVEventBatch, RemovedHashes,
    SPEC_KIND, SkipKind, StoredHashes, Undecodable, decode_batch, decode_hashes, encode_batch, external_hash)
from kvbridge.shape.kv_groups import KVCacheKind
from tests.unit import kv_events_vllm_reference as ref

STORED = dict(block_hashes=[2**64 - 1, 7], parent_block_hash=None, token_ids=list(range(32)),
              block_size=16, lora_id=None, medium="GPU", lora_name=None)
STORED_ALL = dict(STORED, parent_block_hash=123456789, lora_id=3, lora_name="adapter",
                  extra_keys=[("salt",), None], group_idx=1, kv_cache_spec_kind="sliding_window",
                  kv_cache_spec_sliding_window=4096, locality="LOCAL", ownership="tier1",
                  session_id="s", lookahead_token_ids=[[1], [2]])
REMOVED = dict(block_hashes=[b"\x01" * 32, 5], medium="GPU", group_idx=2)

CASES = {
    "stored_defaults": (BlockStored(**STORED), ref.MapBlockStored(**STORED)),
    "stored_every_field": (BlockStored(**STORED_ALL), ref.MapBlockStored(**STORED_ALL)),
    "stored_bytes_hashes": (BlockStored(**dict(STORED, block_hashes=[b"\xff" * 32], parent_block_hash=b"\0" * 32)),
                            ref.MapBlockStored(**dict(STORED, block_hashes=[b"\xff" * 32],
                                                      parent_block_hash=b"\0" * 32))),
    "removed": (BlockRemoved(**REMOVED), ref.MapBlockRemoved(**REMOVED)),
    "removed_no_group": (BlockRemoved(block_hashes=[1], medium=None), ref.MapBlockRemoved(block_hashes=[1], medium=None)),
    "cleared": (AllBlocksCleared(), ref.MapAllBlocksCleared()),
}


@pytest.mark.parametrize("name", CASES)
def test_each_event_type_encodes_byte_for_byte_as_vllm_0_33(name):
    ours, theirs = CASES[name]
    assert encode_batch(KVEventBatch(ts=1.5, events=[ours], data_parallel_rank=0)) == \
        msgspec.msgpack.encode(ref.MapKVEventBatch(ts=1.5, events=[theirs], data_parallel_rank=0))


def test_a_batch_is_a_positional_array_and_each_event_a_map_tagged_type():
    payload = encode_batch(KVEventBatch(ts=2.0, events=[BlockStored(**STORED), AllBlocksCleared()]))
    ts, events, rank = msgspec.msgpack.decode(payload)  # array-like: every field, None too
    assert ts == 2.0 and rank is None
    assert events[0] == {"type": "BlockStored", **STORED}
    assert list(events[0])[:8] == ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size",
                                   "lora_id", "medium", "lora_name"]
    assert events[1] == {"type": "AllBlocksCleared"}


def test_vllm_0_33_batches_decode_to_the_same_events():
    batch = ref.MapKVEventBatch(ts=3.0, events=[theirs for _, theirs in CASES.values()], data_parallel_rank=2)
    decoded = decode_batch(msgspec.msgpack.encode(batch))
    assert isinstance(decoded, DecodedBatch)
    assert decoded.encoding is Encoding.MAP and decoded.data_parallel_rank == 2 and decoded.ts == 3.0
    assert decoded.events == tuple(ours for ours, _ in CASES.values())


def test_positional_arrays_of_vllm_before_42892_decode():
    stored = {k: v for k, v in STORED_ALL.items() if k not in ("locality", "ownership", "session_id",
                                                                 "lookahead_token_ids")}
    batch = ref.ArrayKVEventBatch(ts=4.0, events=[ref.ArrayBlockStored(**stored), ref.ArrayBlockRemoved(**REMOVED),
                                                  ref.ArrayAllBlocksCleared()], data_parallel_rank=1)
    raw = msgspec.msgpack.encode(batch)
    assert msgspec.msgpack.decode(raw)[1][0][0] == "BlockStored"  # really positional
    decoded = decode_batch(raw)
    assert isinstance(decoded, DecodedBatch) and decoded.encoding is Encoding.ARRAY
    assert decoded.events == (BlockStored(**stored), BlockRemoved(**REMOVED), AllBlocksCleared())
    assert decoded.data_parallel_rank == 1


def test_the_oldest_arrays_without_lora_name_groups_or_rank_decode():
    old = ref.OldEventBatch(ts=5.0, events=[ref.OldArrayBlockStored([1, 2], None, [9] * 4, 2, None, "GPU"),
                                            ref.OldArrayBlockRemoved([1], "GPU")])
    decoded = decode_batch(msgspec.msgpack.encode(old))
    assert isinstance(decoded, DecodedBatch) and decoded.data_parallel_rank is None
    assert decoded.events == (BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=[9] * 4,
                                          block_size=2, lora_id=None, medium="GPU", lora_name=None),
                              BlockRemoved(block_hashes=[1], medium="GPU"))


def test_a_batch_mixing_both_encodings_keeps_every_event_in_order():
    raw = msgspec.msgpack.encode([6.0, [{"type": "BlockRemoved", "block_hashes": [1], "medium": None},
                                        ["BlockRemoved", [2], None], {"type": "AllBlocksCleared"}]])
    decoded = decode_batch(raw)
    assert isinstance(decoded, DecodedBatch) and decoded.encoding is Encoding.MIXED
    assert decoded.events == (BlockRemoved([1], None), BlockRemoved([2], None), AllBlocksCleared())


def test_unknown_and_invalid_events_are_skipped_by_kind_and_the_rest_kept():
    raw = msgspec.msgpack.encode([7.0, [{"type": "BlockMoved", "to": "CPU"}, ["CacheEviction", 1],
                                        {"type": "BlockStored", "block_hashes": "nope"}, 42,
                                        {"type": "AllBlocksCleared"}], 0])
    decoded = decode_batch(raw)
    assert isinstance(decoded, DecodedBatch)
    assert decoded.events == (AllBlocksCleared(),)
    assert decoded.skipped == (SkipKind.UNKNOWN_TYPE, SkipKind.UNKNOWN_TYPE, SkipKind.INVALID, SkipKind.INVALID)


def test_unknown_map_fields_of_a_newer_vllm_are_ignored():
    raw = msgspec.msgpack.encode([8.0, [{"type": "BlockRemoved", "block_hashes": [3], "medium": "GPU",
                                         "future_field": {"x": 1}}]])
    decoded = decode_batch(raw)
    assert isinstance(decoded, DecodedBatch) and decoded.events == (BlockRemoved([3], "GPU"),)


@pytest.mark.parametrize("payload", [b"", b"\xc1", b"\x92", msgspec.msgpack.encode({"ts": 1}),
                                     msgspec.msgpack.encode([1.0]), msgspec.msgpack.encode(["x", []]),
                                     msgspec.msgpack.encode([1.0, 5]),
                                     encode_batch(KVEventBatch(ts=1.0, events=[AllBlocksCleared()]))[:-1]])
def test_a_payload_that_is_no_batch_is_undecodable_not_an_exception(payload):
    assert isinstance(decode_batch(payload), Undecodable)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_never_raise(payload):
    assert isinstance(decode_batch(payload), (DecodedBatch, Undecodable))


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 40), st.integers(0, 255))
def test_a_corrupted_byte_never_raises(at, value):
    payload = bytearray(encode_batch(KVEventBatch(ts=1.0, events=[BlockStored(**STORED_ALL), BlockRemoved(**REMOVED)])))
    payload[at % len(payload)] = value
    assert isinstance(decode_batch(bytes(payload)), (DecodedBatch, Undecodable))


def test_external_hash_is_vllms_int_form():
    digest = bytes(range(32))
    assert external_hash(digest) == int.from_bytes(digest, "big") & (2**64 - 1)
    assert external_hash(2**64 + 5) == 5 and external_hash(9) == 9


def test_the_index_decoding_keeps_the_same_hashes_from_either_encoding():
    """decode_hashes (the router's fast path) and decode_batch agree on every fixture; bytes hashes
    and positional arrays take the full path and come out in the int form."""
    batches = [ref.MapKVEventBatch(ts=1.0, events=[theirs for _, theirs in CASES.values()], data_parallel_rank=0),
               ref.ArrayKVEventBatch(ts=1.0, events=[ref.ArrayBlockRemoved(**REMOVED), ref.ArrayAllBlocksCleared()])]
    for batch in batches:
        raw = msgspec.msgpack.encode(batch)
        full, lean = decode_batch(raw), decode_hashes(raw)
        assert isinstance(full, DecodedBatch) and isinstance(lean, HashBatch)
        assert len(full.events) == len(lean.events)
        for event, hashes in zip(full.events, lean.events):
            if isinstance(event, AllBlocksCleared):
                assert hashes == event
            else:
                assert isinstance(hashes, (StoredHashes, RemovedHashes))
                assert hashes.block_hashes == [external_hash(h) for h in event.block_hashes]
                assert (hashes.medium, hashes.group_idx) == (event.medium, event.group_idx)
    assert isinstance(decode_hashes(b"\xc1"), Undecodable)
    skipped = decode_hashes(msgspec.msgpack.encode([1.0, [{"type": "BlockMoved"}, {"type": "AllBlocksCleared"}]]))
    assert isinstance(skipped, HashBatch) and skipped.skipped == (SkipKind.UNKNOWN_TYPE,)
    assert skipped.events == (AllBlocksCleared(),)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_the_index_decoding_never_raises_either(payload):
    assert isinstance(decode_hashes(payload), (HashBatch, Undecodable))


def test_a_vllm_consumer_decodes_kvbridges_batches_with_vllms_own_structs():
    ours = KVEventBatch(ts=9.0, events=[ours for ours, _ in CASES.values()], data_parallel_rank=1)
    theirs = msgspec.msgpack.Decoder(ref.MapKVEventBatch).decode(encode_batch(ours))
    assert theirs == ref.MapKVEventBatch(ts=9.0, events=[t for _, t in CASES.values()], data_parallel_rank=1)


VLLM_SPEC_KINDS = {"full_attention", "mla_attention", "sliding_window", "sliding_window_mla", "mamba",
                   "chunked_local_attention", "sink_full_attention", "encoder_only_attention", "cross_attention",
                   "unknown"}  # vLLM 0.33's KVCacheSpecKind values


def test_every_kvbridge_group_kind_has_a_vllm_spec_kind():
    assert set(SPEC_KIND) == set(KVCacheKind) and set(SPEC_KIND.values()) <= VLLM_SPEC_KINDS
