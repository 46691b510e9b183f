"""The router's fleet index: which block hashes each instance holds, per KV cache group, fed by
the instances' KV event streams; and how long a request's cached prefix is on each instance.

Who feeds it: one `EventSubscriber` (subscriber.py) per instance, on its own thread, passes each
received message to `ingest` and each replay answer to `ingest_replay` / `end_replay`. Who reads
it: the router, `overlap_blocks` per candidate (hashes computed once per request by `hashes`).
A lock makes every call atomic; all of them are short (no I/O, no waits).

Sequence numbers (one publisher's, from 0, one per batch) keep the index exact:
- the next seq: applied;
- a jump ahead (a gap: the PUB socket's high-water mark, a lost or garbled message): the index
  holds live messages and asks for a replay from the first missing seq; the replay fills the
  hole, then the held messages apply;
- history that cannot be recovered (the replay buffer no longer has it, the replay timed out,
  there is no replay endpoint): the instance's entries are dropped and rebuilt from the next
  batch on. The index then knows less than the instance holds, never more: a prediction may
  miss blocks, it never claims one that is gone;
- seq 0 after others, or the stream going back again and again: the publisher restarted, its
  cache is empty: entries dropped, rebuilt;
- a seq the live stream already passed (a duplicate, a reordering relay): counted, ignored.

An instance is routed cold (overlap 0) while it resyncs, and when nothing (no event, no
`note_alive`) came from it for `stale_after_s` (the clock is injected). Every problem is counted
per instance and kind (`Problem`) and logged once per kind; nothing here raises on bad input.
The primary medium (None or "GPU") gives the cached prefix (`overlap_blocks`: what an instance's
prefix cache holds and a hold can pin); blocks of a lower tier (any other medium: kvbridge's "DISK"
tier, vLLM's "CPU" offload) of the index's block size are kept apart and extend it in
`reusable_blocks` (what the instance serves without computing: it loads them back).

Cost (benchmarks/kv_index.py, one core of this project's 2-core Xeon, machine otherwise idle): a
rebuild from replay takes 0.35 s per million blocks when events carry 16 blocks each (vLLM stores
a request's new full blocks in one event), 1.3-1.6 s per million in the worst case of one block
per event (about 0.9 M events/s); the index holds 57-69 MB per million blocks.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from kvbridge.kv_events.events import (
    AllBlocksCleared, RemovedHashes, SkipKind, StoredHashes, Undecodable, decode_hashes)
from kvbridge.kv_events.hashing import block_hashes

logger = logging.getLogger(__name__)



class InstanceStatus(str, enum.Enum):
    UNKNOWN = "unknown"  # nothing heard yet
    LIVE = "live"
    RESYNCING = "resyncing"  # a gap is being filled by replay: routed cold
    STALE = "stale"  # nothing heard for stale_after_s: routed cold


class Problem(str, enum.Enum):
    FRAMES = "frames"  # a message not of 3 frames (truncated)
    SEQUENCE_FRAME = "sequence_frame"  # a sequence frame not of 8 bytes
    UNDECODABLE = "undecodable"  # a payload that is not an EventBatch
    UNKNOWN_EVENT_TYPE = "unknown_event_type"  # an event of a type this index does not know
    INVALID_EVENT = "invalid_event"  # an event of wrong shape
    BLOCK_SIZE = "block_size"  # a BlockStored whose block_size is not the index's
    GAP = "gap"  # seqs missing from the live stream
    DUPLICATE = "duplicate"  # a seq the live stream had already passed
    RESTART = "restart"  # the publisher started again from 0
    LOSSY_RESYNC = "lossy_resync"  # history lost: entries dropped, rebuilt from here
    REPLAY_FAILED = "replay_failed"  # no replay endpoint, a timeout, or a bad answer
    HELD_OVERFLOW = "held_overflow"  # too many live messages waiting for a replay: some dropped


class Outcome(str, enum.Enum):
    APPLIED = "applied"
    HELD = "held"  # kept until the pending replay ends
    IGNORED = "ignored"  # a duplicate, or a message that could not be read
    NEEDS_REPLAY = "needs_replay"  # the subscriber must request a replay from `replay_from`


@dataclass(frozen=True)
class IngestResult:
    outcome: Outcome
    replay_from: int | None = None


@dataclass(frozen=True)
class InstanceView:
    status: InstanceStatus
    blocks: dict[int, int]  # KV cache group -> blocks held
    last_seq: int | None
    complete: bool  # False: some history was lost; the entries are a subset of the truth
    problems: dict[Problem, int]


@dataclass
class _Instance:
    groups: dict[int, set[int]] = field(default_factory=dict)
    tiers: dict[int, set[int]] = field(default_factory=dict)  # per group, blocks of a lower tier (any other medium)
    last_seq: int | None = None  # last batch applied
    last_live: int | None = None  # highest seq seen on the live stream
    resync_from: int | None = None  # a replay is pending from this seq
    held: list[tuple[int, bytes]] = field(default_factory=list)
    accept_any: bool = False  # history was lost: the next live batch starts afresh
    backwards: int = 0  # consecutive live messages behind last_live
    last_heard: float | None = None
    complete: bool = True
    problems: Counter[Problem] = field(default_factory=Counter)


class FleetIndex:
    """All instances of one model (one hash root and block size)."""

    def __init__(self, root: bytes, block_size: int, clock: Callable[[], float] = time.monotonic,
                 stale_after_s: float = 10.0, max_held: int = 10_000, restart_after: int = 3) -> None:
        self.root = root
        self.block_size = block_size
        self._clock = clock
        self._stale_after_s = stale_after_s
        self._max_held = max_held
        self._restart_after = restart_after
        self._instances: dict[str, _Instance] = {}
        self._lock = threading.Lock()

    # ---- feeding: the subscribers --------------------------------------------------
    def ingest(self, instance: str, frames: Sequence[bytes]) -> IngestResult:
        """One live message, `[topic, seq(8 bytes), payload]`."""
        with self._lock:
            st = self._heard(instance)
            if len(frames) != 3:
                return self._problem(instance, st, Problem.FRAMES)
            if len(frames[1]) != 8:
                return self._problem(instance, st, Problem.SEQUENCE_FRAME)
            return self._live(instance, st, int.from_bytes(frames[1], "big"), bytes(frames[2]))

    def ingest_replay(self, instance: str, seq: int, payload: bytes) -> IngestResult:
        """One batch of a replay answer (the end marker is `end_replay`)."""
        with self._lock:
            st = self._heard(instance)
            if st.resync_from is None:
                return IngestResult(Outcome.IGNORED)
            expected = st.resync_from if st.last_seq is None else st.last_seq + 1
            if seq < expected:
                return IngestResult(Outcome.IGNORED)
            if seq > expected:
                self._lose_history(instance, st)
            return self._apply(instance, st, seq, payload, in_replay=True)

    def end_replay(self, instance: str, ok: bool) -> None:
        """The replay ended: with its end marker (`ok`), or not (timeout, no replay endpoint). The
        held live messages apply; a hole the replay did not fill drops the history."""
        with self._lock:
            st = self._state(instance)
            st.resync_from = None
            if not ok:
                self._count(instance, st, Problem.REPLAY_FAILED)
                self._lose_history(instance, st)
            held, st.held = st.held, []
            for seq, payload in held:
                if st.last_seq is not None and seq <= st.last_seq:
                    continue  # the replay had it
                if not self._follows(st, seq):
                    self._lose_history(instance, st)
                self._apply(instance, st, seq, payload, in_replay=True)

    def note_alive(self, instance: str) -> None:
        """A sign of life from outside the event stream (the health loop): not stale."""
        with self._lock:
            self._heard(instance)

    def begin_catch_up(self, instance: str) -> int | None:
        """A subscriber that has applied nothing yet asks for the history its publisher kept (a
        router started after the instance cached, or a first batch sent before the SUB's
        subscription reached the PUB: ZMQ drops it, and no later seq would reveal the gap when no
        later batch comes). The seq to replay from (0), or None when the stream is already
        followed or a resync runs; the caller replays, then calls `end_replay`."""
        with self._lock:
            st = self._state(instance)
            if st.resync_from is not None or st.last_seq is not None:
                return None
            self._begin_resync(st, 0, None)
            return 0

    def reset(self, instance: str) -> None:
        """The instance restarted or left (the health loop saw it): forget all about it."""
        with self._lock:
            self._instances.pop(instance, None)

    # ---- reading: the router --------------------------------------------------------
    def hashes(self, token_ids: Sequence[int]) -> list[int]:
        """The request's full blocks' hashes, as instances publish them."""
        return block_hashes(self.root, token_ids, self.block_size)

    def overlap_blocks(self, instance: str, hashes: Sequence[int], groups: Iterable[int] = (0,)) -> int:
        """How many leading blocks of `hashes` the instance holds in every one of `groups` (a
        full-attention model: group 0); 0 for an instance that is not LIVE."""
        with self._lock:
            st = self._instances.get(instance)
            if st is None or self._status(st) is not InstanceStatus.LIVE:
                return 0
            return min((_prefix(st.groups.get(g), hashes) for g in groups), default=0)

    def reusable_blocks(self, instance: str, hashes: Sequence[int], groups: Iterable[int] = (0,)) -> int:
        """How many leading blocks of `hashes` the instance holds in its prefix cache or a lower tier,
        in every one of `groups` (>= overlap_blocks); 0 for an instance that is not LIVE."""
        with self._lock:
            st = self._instances.get(instance)
            if st is None or self._status(st) is not InstanceStatus.LIVE:
                return 0
            return min((_prefix_in(st.groups.get(g), st.tiers.get(g), hashes) for g in groups), default=0)

    def overlap(self, instance: str, token_ids: Sequence[int], groups: Iterable[int] = (0,)) -> int:
        """`overlap_blocks` of the request's tokens (hashing them; for several instances, hash
        once with `hashes`)."""
        return self.overlap_blocks(instance, self.hashes(token_ids), groups)

    def status(self, instance: str) -> InstanceStatus:
        with self._lock:
            st = self._instances.get(instance)
            return InstanceStatus.UNKNOWN if st is None else self._status(st)

    def view(self, instance: str) -> InstanceView:
        with self._lock:
            st = self._instances.get(instance) or _Instance()
            return InstanceView(self._status(st), {g: len(s) for g, s in st.groups.items()},
                                st.last_seq, st.complete, dict(st.problems))

    def held_blocks(self, instance: str) -> dict[int, frozenset[int]]:
        """A copy of the instance's entries, per group (for checks and debugging: O(blocks))."""
        with self._lock:
            st = self._instances.get(instance)
            return {} if st is None else {g: frozenset(s) for g, s in st.groups.items()}

    def instances(self) -> list[str]:
        with self._lock:
            return list(self._instances)

    # ---- the sequence rules (module docstring) ------------------------------------
    def _live(self, instance: str, st: _Instance, seq: int, payload: bytes) -> IngestResult:
        if st.last_live is not None and seq <= st.last_live:
            return self._backwards(instance, st, seq, payload)
        st.backwards, st.last_live = 0, seq
        if st.resync_from is not None:
            return self._hold(instance, st, seq, payload)
        if st.last_seq is not None and seq <= st.last_seq:
            return IngestResult(Outcome.IGNORED)  # a replay already applied it
        if self._follows(st, seq):
            return self._apply(instance, st, seq, payload, in_replay=False)
        if st.last_seq is not None:
            self._count(instance, st, Problem.GAP)
        return self._begin_resync(st, 0 if st.last_seq is None else st.last_seq + 1, (seq, payload))

    def _backwards(self, instance: str, st: _Instance, seq: int, payload: bytes) -> IngestResult:
        if seq == 0 or st.backwards + 1 >= self._restart_after:
            self._count(instance, st, Problem.RESTART)
            self._instances[instance] = fresh = _Instance(last_heard=st.last_heard, problems=st.problems)
            return self._live(instance, fresh, seq, payload)
        st.backwards += 1
        return self._problem(instance, st, Problem.DUPLICATE)

    def _follows(self, st: _Instance, seq: int) -> bool:
        if st.last_seq is None:
            return seq == 0 or st.accept_any
        return seq == st.last_seq + 1

    def _begin_resync(self, st: _Instance, start: int, hold: tuple[int, bytes] | None) -> IngestResult:
        st.resync_from = start
        st.held = [hold] if hold is not None else []
        return IngestResult(Outcome.NEEDS_REPLAY, replay_from=start)

    def _hold(self, instance: str, st: _Instance, seq: int, payload: bytes) -> IngestResult:
        if len(st.held) >= self._max_held:
            return self._problem(instance, st, Problem.HELD_OVERFLOW)
        st.held.append((seq, payload))
        return IngestResult(Outcome.HELD)

    def _lose_history(self, instance: str, st: _Instance) -> None:
        if st.groups or st.last_seq is not None:
            self._count(instance, st, Problem.LOSSY_RESYNC)
        st.groups.clear()
        st.tiers.clear()
        st.last_seq, st.accept_any, st.complete = None, True, False

    def _apply(self, instance: str, st: _Instance, seq: int, payload: bytes, in_replay: bool) -> IngestResult:
        decoded = decode_hashes(payload)
        if isinstance(decoded, Undecodable):
            self._count(instance, st, Problem.UNDECODABLE)
            if in_replay:  # the publisher's own copy is bad: this batch is lost for good
                self._lose_history(instance, st)
                st.last_seq, st.accept_any = seq, False
                return IngestResult(Outcome.IGNORED)
            return self._begin_resync(st, seq, None)  # garbled on the way? the replay has it
        for skip in decoded.skipped:
            self._count(instance, st, Problem.UNKNOWN_EVENT_TYPE if skip is SkipKind.UNKNOWN_TYPE
                        else Problem.INVALID_EVENT)
        groups, tiers, block_size = st.groups, st.tiers, self.block_size
        for event in decoded.events:  # a rebuild's hot loop: no allocation but the sets' own
            if isinstance(event, StoredHashes):
                primary = event.medium is None or event.medium == "GPU"
                if primary and event.block_size != block_size:
                    self._count(instance, st, Problem.BLOCK_SIZE)
                elif not primary and event.block_size != block_size:
                    continue  # a tier of other block sizes: its hashes are not this index's
                where = groups if primary else tiers
                group = event.group_idx or 0
                held = where.get(group)
                if held is None:
                    held = where[group] = set()
                held.update(event.block_hashes)
            elif isinstance(event, RemovedHashes):
                where = groups if event.medium is None or event.medium == "GPU" else tiers
                if held := where.get(event.group_idx or 0):
                    held.difference_update(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                groups.clear()
                tiers.clear()
        st.last_seq, st.accept_any = seq, False
        return IngestResult(Outcome.APPLIED)

    # ---- bookkeeping -----------------------------------------------------------
    def _state(self, instance: str) -> _Instance:
        st = self._instances.get(instance)
        if st is None:
            st = self._instances[instance] = _Instance()
        return st

    def _heard(self, instance: str) -> _Instance:
        st = self._state(instance)
        st.last_heard = self._clock()
        return st

    def _status(self, st: _Instance) -> InstanceStatus:
        if st.last_heard is None:
            return InstanceStatus.UNKNOWN
        if st.resync_from is not None:
            return InstanceStatus.RESYNCING
        if self._clock() - st.last_heard > self._stale_after_s:
            return InstanceStatus.STALE
        return InstanceStatus.LIVE

    def _problem(self, instance: str, st: _Instance, kind: Problem) -> IngestResult:
        self._count(instance, st, kind)
        return IngestResult(Outcome.IGNORED)

    def _count(self, instance: str, st: _Instance, kind: Problem) -> None:
        st.problems[kind] += 1
        if st.problems[kind] == 1:  # once per kind and instance; the counters say how often
            logger.warning("kv events from %s: %s (logged once; counted in the index)", instance, kind.value)


def _prefix_in(held: set[int] | None, tier: set[int] | None, hashes: Sequence[int]) -> int:
    if not tier:
        return _prefix(held, hashes)
    n = 0
    for h in hashes:
        if h not in tier and (held is None or h not in held):
            break
        n += 1
    return n


def _prefix(held: set[int] | None, hashes: Sequence[int]) -> int:
    if not held:
        return 0
    n = 0
    for h in hashes:
        if h not in held:
            break
        n += 1
    return n
