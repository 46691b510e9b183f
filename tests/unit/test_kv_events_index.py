"""The fleet index as a specification: stored/removed/cleared blocks per instance and group, the
longest cached prefix, staleness on an injected clock, gaps filled by replay, lost history
dropped (the index then knows less than the instance, never more), restarts, and bad messages
counted by kind without ever raising."""

from __future__ import annotations

import random

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.kv_events.events import (
    AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, KVEventBatch, encode_batch)
from kvbridge.kv_events.hashing import model_root
from kvbridge.kv_events.index import FleetIndex, InstanceStatus, Outcome, Problem

BS = 4
TOKENS = list(range(100, 132))  # 8 blocks


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_index(clock: Clock | None = None, **kwargs: int) -> FleetIndex:
    return FleetIndex(model_root("m"), BS, clock=clock or Clock(), stale_after_s=5.0, **kwargs)


def stored(hashes: list[int], group: int | None = 0, medium: str | None = "GPU", block_size: int = BS) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=[0] * (block_size * len(hashes)),
                       block_size=block_size, lora_id=None, medium=medium, lora_name=None, group_idx=group)


def payload(*events: KVEvent) -> bytes:
    return encode_batch(KVEventBatch(ts=0.0, events=list(events)))


def frames(seq: int, *events: KVEvent) -> list[bytes]:
    return [b"", seq.to_bytes(8, "big"), payload(*events)]


def test_stored_blocks_give_the_longest_cached_prefix():
    index = make_index()
    h = index.hashes(TOKENS)
    assert index.ingest("d0", frames(0, stored(h[:5]))).outcome is Outcome.APPLIED
    assert index.overlap("d0", TOKENS) == 5
    assert index.overlap("d0", TOKENS[:10]) == 2  # only full blocks of the request count
    assert index.overlap("d0", [7] + TOKENS[1:]) == 0  # a different first block: nothing shared
    assert index.overlap("d1", TOKENS) == 0  # an instance never heard of


def test_removed_blocks_cut_the_prefix_and_a_clear_empties_it():
    index = make_index()
    h = index.hashes(TOKENS)
    index.ingest("d0", frames(0, stored(h)))
    index.ingest("d0", frames(1, BlockRemoved(block_hashes=[h[3]], medium="GPU", group_idx=0)))
    assert index.overlap_blocks("d0", h) == 3
    index.ingest("d0", frames(2, AllBlocksCleared()))
    assert index.overlap_blocks("d0", h) == 0 and index.view("d0").blocks == {}


def test_groups_are_kept_apart_and_a_prefix_must_be_in_every_group_asked():
    index = make_index()
    h = index.hashes(TOKENS)
    index.ingest("d0", frames(0, stored(h[:6], group=0), stored(h[:2], group=1)))
    assert index.overlap_blocks("d0", h, groups=(0,)) == 6
    assert index.overlap_blocks("d0", h, groups=(1,)) == 2
    assert index.overlap_blocks("d0", h, groups=(0, 1)) == 2
    index.ingest("d0", frames(1, BlockRemoved(block_hashes=h[:6], medium="GPU", group_idx=1)))
    assert index.view("d0").blocks == {0: 6, 1: 0}


def test_vllm_events_without_a_group_are_group_0_and_offload_tiers_are_reusable_not_cached():
    index = make_index()
    h = index.hashes(TOKENS)
    index.ingest("v0", frames(0, stored(h[:3], group=None), stored(h[3:], medium="CPU")))
    assert index.overlap_blocks("v0", h) == 3  # a hold can pin only the prefix cache's
    assert index.reusable_blocks("v0", h) == 8  # the instance loads the rest back


def test_a_tier_continues_the_prefix_until_a_block_neither_holds_and_follows_removals_and_clears():
    index = make_index()
    h = index.hashes(TOKENS)
    # kvbridge's tier: evicted blocks 2-5 went to DISK, blocks 0-1 stayed, block 6 in neither
    index.ingest("d0", frames(0, stored(h[:2]), stored(h[2:6], medium="DISK", block_size=BS),
                              stored(h[7:], medium="DISK")))
    assert (index.overlap_blocks("d0", h), index.reusable_blocks("d0", h)) == (2, 6)
    index.ingest("d0", frames(1, BlockRemoved(block_hashes=[h[4]], medium="DISK", group_idx=0)))
    assert index.reusable_blocks("d0", h) == 4
    index.ingest("d0", frames(2, stored(h[4:5])))  # loaded back into the pool
    assert (index.overlap_blocks("d0", h), index.reusable_blocks("d0", h)) == (2, 6)
    index.ingest("d0", frames(3, stored(h[6:7], medium="CPU", block_size=2 * BS)))  # another block size: not ours
    assert index.reusable_blocks("d0", h) == 6 and index.view("d0").problems == {}
    index.ingest("d0", frames(4, AllBlocksCleared()))
    assert index.reusable_blocks("d0", h) == 0
    index.ingest("d0", frames(5, stored(h[:8], medium="DISK")))
    index.ingest("d0", frames(7, stored(h[:1])))  # a gap with no replay endpoint: history lost, tiers too
    index.end_replay("d0", ok=False)
    assert index.reusable_blocks("d0", h) <= 1


def test_bytes_hashes_fold_to_the_int_form():
    index = make_index()
    digest = (5).to_bytes(32, "big")
    index.ingest("v0", frames(0, BlockStored(block_hashes=[digest], parent_block_hash=None, token_ids=[0] * BS,
                                             block_size=BS, lora_id=None, medium=None, lora_name=None)))
    assert index.overlap_blocks("v0", [5]) == 1


def test_an_instance_whose_events_stop_is_stale_and_routed_cold():
    clock = Clock()
    index = make_index(clock)
    h = index.hashes(TOKENS)
    assert index.status("d0") is InstanceStatus.UNKNOWN
    index.ingest("d0", frames(0, stored(h)))
    clock.now = 5.0
    assert index.status("d0") is InstanceStatus.LIVE and index.overlap_blocks("d0", h) == 8
    clock.now = 5.1
    assert index.status("d0") is InstanceStatus.STALE and index.overlap_blocks("d0", h) == 0
    index.note_alive("d0")  # the health loop heard from it: its entries count again
    assert index.status("d0") is InstanceStatus.LIVE and index.overlap_blocks("d0", h) == 8


def test_a_gap_holds_live_messages_until_the_replay_fills_it():
    index = make_index()
    h = index.hashes(TOKENS)
    index.ingest("d0", frames(0, stored(h[:1])))
    result = index.ingest("d0", frames(3, stored(h[3:4])))
    assert result.outcome is Outcome.NEEDS_REPLAY and result.replay_from == 1
    assert index.status("d0") is InstanceStatus.RESYNCING and index.overlap_blocks("d0", h) == 0
    assert index.ingest("d0", frames(4, stored(h[4:5]))).outcome is Outcome.HELD
    for seq in (1, 2, 3):  # the replay: everything kept from seq 1 on
        assert index.ingest_replay("d0", seq, payload(stored(h[seq:seq + 1]))).outcome is Outcome.APPLIED
    index.end_replay("d0", ok=True)
    view = index.view("d0")
    assert view.status is InstanceStatus.LIVE and view.last_seq == 4 and view.complete
    assert index.overlap_blocks("d0", h) == 5 and view.problems == {Problem.GAP: 1}
    assert index.ingest("d0", frames(5, stored(h[5:6]))).outcome is Outcome.APPLIED


def test_a_replay_that_no_longer_has_the_gap_drops_the_history():
    index = make_index()
    h = index.hashes(TOKENS)
    index.ingest("d0", frames(0, stored(h[:4])))
    index.ingest("d0", frames(5, stored(h[5:6])))
    index.ingest_replay("d0", 3, payload(stored(h[4:5])))  # 1 and 2 are gone from the buffer
    index.ingest_replay("d0", 4, payload(BlockRemoved(block_hashes=[h[0]], medium="GPU")))
    index.ingest_replay("d0", 5, payload(stored(h[5:6])))
    index.end_replay("d0", ok=True)
    view = index.view("d0")
    assert not view.complete and view.last_seq == 5 and view.problems[Problem.LOSSY_RESYNC] == 1
    assert view.blocks == {0: 2}  # only what the replay and after said: h[4], h[5]
    assert index.overlap_blocks("d0", h[4:]) == 2


def test_a_failed_replay_drops_the_history_and_goes_on_from_the_held_messages():
    index = make_index()
    h = index.hashes(TOKENS)
    index.ingest("d0", frames(0, stored(h[:4])))
    index.ingest("d0", frames(2, stored(h[4:5])))
    index.ingest("d0", frames(3, stored(h[5:6])))
    index.end_replay("d0", ok=False)  # a timeout, or no replay endpoint
    view = index.view("d0")
    assert view.status is InstanceStatus.LIVE and view.last_seq == 3 and view.blocks == {0: 2}
    assert not view.complete and view.problems[Problem.REPLAY_FAILED] == 1
    assert index.ingest("d0", frames(4)).outcome is Outcome.APPLIED


def test_a_router_that_joins_late_replays_from_0():
    index = make_index()
    h = index.hashes(TOKENS)
    result = index.ingest("d0", frames(2, stored(h[2:3])))
    assert result.outcome is Outcome.NEEDS_REPLAY and result.replay_from == 0
    index.ingest_replay("d0", 0, payload(stored(h[:1])))
    index.ingest_replay("d0", 1, payload(stored(h[1:2])))
    index.ingest_replay("d0", 2, payload(stored(h[2:3])))
    index.end_replay("d0", ok=True)
    view = index.view("d0")
    assert view.complete and view.last_seq == 2 and index.overlap_blocks("d0", h) == 3 and view.problems == {}


def test_a_subscriber_that_missed_the_only_batch_catches_up_by_replay_and_the_late_copy_is_ignored():
    index = make_index()
    h = index.hashes(TOKENS)
    assert index.begin_catch_up("d0") == 0 and index.begin_catch_up("d0") is None  # one resync at a time
    index.ingest_replay("d0", 0, payload(stored(h[:2])))
    index.end_replay("d0", ok=True)
    assert index.overlap_blocks("d0", h) == 2 and index.begin_catch_up("d0") is None  # followed: nothing to do
    assert index.ingest("d0", frames(0, stored(h[:2]))).outcome is Outcome.IGNORED
    assert index.ingest("d0", frames(1, stored(h[2:3]))).outcome is Outcome.APPLIED
    assert index.overlap_blocks("d0", h) == 3 and index.view("d0").problems == {}


def test_seq_0_again_is_a_restart_the_old_entries_go():
    index = make_index()
    h = index.hashes(TOKENS)
    index.ingest("d0", frames(0, stored(h)))
    index.ingest("d0", frames(1))
    assert index.ingest("d0", frames(0, stored(h[:1]))).outcome is Outcome.APPLIED
    view = index.view("d0")
    assert view.blocks == {0: 1} and view.last_seq == 0 and view.problems[Problem.RESTART] == 1


def test_duplicates_are_counted_and_ignored_and_a_stream_that_keeps_going_back_restarted():
    index = make_index()
    h = index.hashes(TOKENS)
    for seq in range(10):
        index.ingest("d0", frames(seq, stored(h[seq % 8:seq % 8 + 1])))
    assert index.ingest("d0", frames(4, AllBlocksCleared())).outcome is Outcome.IGNORED
    assert index.ingest("d0", frames(5, AllBlocksCleared())).outcome is Outcome.IGNORED
    assert index.view("d0").blocks == {0: 8} and index.view("d0").problems == {Problem.DUPLICATE: 2}
    # a third message behind: the publisher restarted and its seq 0 was missed
    result = index.ingest("d0", frames(1, stored(h[1:2])))
    assert result.outcome is Outcome.NEEDS_REPLAY and result.replay_from == 0
    assert index.view("d0").blocks == {} and index.view("d0").problems[Problem.RESTART] == 1


def test_bad_messages_are_counted_by_kind_and_never_raise():
    index = make_index()
    h = index.hashes(TOKENS)
    assert index.ingest("d0", [b"", b"\0" * 8]).outcome is Outcome.IGNORED  # truncated: 2 frames
    assert index.ingest("d0", [b"", b"\0" * 4, payload()]).outcome is Outcome.IGNORED
    newer = msgspec.msgpack.encode([0.0, [{"type": "BlockMoved"}, {"type": "AllBlocksCleared"}], 0])
    assert index.ingest("d0", [b"", (0).to_bytes(8, "big"), newer]).outcome is Outcome.APPLIED
    assert index.ingest("d0", frames(1, stored(h[:2], block_size=BS * 2))).outcome is Outcome.APPLIED
    assert index.view("d0").problems == {Problem.FRAMES: 1, Problem.SEQUENCE_FRAME: 1,
                                         Problem.UNKNOWN_EVENT_TYPE: 1, Problem.BLOCK_SIZE: 1}


def test_a_garbled_payload_is_replayed_and_the_good_copy_applies():
    index = make_index()
    h = index.hashes(TOKENS)
    index.ingest("d0", frames(0, stored(h[:1])))
    garbled = frames(1, stored(h[1:2]))
    garbled[2] = garbled[2][:7]
    result = index.ingest("d0", garbled)
    assert result.outcome is Outcome.NEEDS_REPLAY and result.replay_from == 1
    index.ingest_replay("d0", 1, payload(stored(h[1:2])))
    index.end_replay("d0", ok=True)
    view = index.view("d0")
    assert view.complete and view.last_seq == 1 and index.overlap_blocks("d0", h) == 2
    assert view.problems == {Problem.UNDECODABLE: 1}


def test_held_messages_are_bounded():
    index = make_index(max_held=2)
    index.ingest("d0", frames(0))
    index.ingest("d0", frames(2))
    assert index.ingest("d0", frames(3)).outcome is Outcome.HELD
    assert index.ingest("d0", frames(4)).outcome is Outcome.IGNORED
    assert index.view("d0").problems[Problem.HELD_OVERFLOW] == 1


def test_reset_forgets_an_instance():
    index = make_index()
    index.ingest("d0", frames(0, stored(index.hashes(TOKENS))))
    index.reset("d0")
    assert index.status("d0") is InstanceStatus.UNKNOWN and index.instances() == []


class Publisher:
    """The publisher's side in the property test: truth, a replay buffer of `keep` batches."""

    def __init__(self, keep: int) -> None:
        self.truth: set[int] = set()
        self.buffer: list[tuple[int, bytes]] = []
        self.keep = keep

    def batch(self, seq: int, rng: random.Random) -> bytes:
        if rng.random() < 0.6:
            hashes = [rng.randrange(40) for _ in range(rng.randrange(1, 4))]
            self.truth.update(hashes)
            body = payload(stored(hashes))
        elif rng.random() < 0.9:
            hashes = [rng.randrange(40) for _ in range(rng.randrange(1, 4))]
            self.truth.difference_update(hashes)
            body = payload(BlockRemoved(block_hashes=hashes, medium="GPU"))
        else:
            self.truth.clear()
            body = payload(AllBlocksCleared())
        self.buffer = (self.buffer + [(seq, body)])[-self.keep:]
        return body


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 2**32), st.integers(1, 30), st.booleans())
def test_whatever_the_network_does_the_index_never_claims_a_block_the_instance_dropped(seed, keep, replay_works):
    """Drops, duplicates, swaps and truncations of a random stream; replay served from a buffer of
    `keep` batches (or failing). The index never raises, never holds a block the publisher does
    not, and holds exactly the publisher's blocks when the history was never lost."""
    rng = random.Random(seed)
    pub, index = Publisher(keep), make_index()
    delivered: list[list[bytes]] = []
    for seq in range(60):
        body = pub.batch(seq, rng)
        r = rng.random()
        if r < 0.1:
            continue  # dropped
        message = [b"", seq.to_bytes(8, "big"), body]
        if r < 0.15:
            message[2] = body[: rng.randrange(len(body))]  # truncated on the way
        delivered.append(message)
        if r > 0.95:
            delivered.append(list(message))  # duplicated
        if r > 0.9 and len(delivered) > 2:
            delivered[-1], delivered[-2] = delivered[-2], delivered[-1]  # reordered
    delivered.append([b"", (60).to_bytes(8, "big"), payload()])  # a last batch: an empty one
    pub.buffer = (pub.buffer + [(60, payload())])[-keep:]
    for message in delivered:
        result = index.ingest("d0", message)
        if result.outcome is Outcome.NEEDS_REPLAY and result.replay_from is not None:
            if replay_works:
                for seq, body in pub.buffer:
                    if seq >= result.replay_from:
                        index.ingest_replay("d0", seq, body)
            index.end_replay("d0", ok=replay_works)
    view = index.view("d0")
    held = set().union(*index.held_blocks("d0").values())
    assert held <= pub.truth
    if view.complete and view.last_seq == 60:
        assert held == pub.truth
