"""P side: leases on the blocks of finished requests kept for a remote reader.

`LeaseTable` is the one owner of P's held blocks: it grants a lease, checks and renews it,
ends it (D's read-done or release, P's own release, a content mismatch) or expires it, and
says which requests' blocks may be freed now (`finished_sending`); the engine's scheduler
frees them when told. The side channel's control code (side_channel/control.py) only parses D's messages
and hands them here.

A lease is granted when a request with do_remote_decode finishes. It ends when D's
read-done or release notification arrives (the blocks are freed), or when it
expires (freed anyway, counted). D's heartbeats renew the leases of requests it
still waits for. Every lease has a generation; D names it in each message, and a
message naming a generation P no longer holds is refused, so a late reader never
gets blocks that were freed and reused by someone else.

A granted check_read also marks the lease as being read until the read-done message
ends it (or ``read_watch_s`` passes), since without a progress thread a NIXL read may
complete only once the target's agent has progressed: the first read between two agents
(UCX wire-up), any read after an idle spell while UCX's keepalive is on (kvbridge turns it
off: backends/nixl.py), and any read carrying a NIXL notification. A read D asks to be
watched (``watch``: one of its (D rank, P rank) pairs has not completed a read since D added
P's agent) makes P's engine loop step promptly instead of backing off and poll its ranks'
agents at every step (``reads_in_flight(watched=True)``). Other reads complete as the
reader's agent copies, and prompt polling took CPU from that copy (at TP N each poll is a
round through N + 1 processes): P's ranks poll for them only once one has been in flight
a while (``reads_in_flight(min_age_s=...)``, the connector's UNWATCHED_POLL_AFTER_S), a
safety net.

A lease also binds the blocks to their content: the digest of the prompt tokens whose
KV they hold (`content_digest`). D sends the digest of its own prompt with the
check_read, and P refuses a read whose digest differs (swapped or replayed params
naming live blocks of another prompt) and ends that lease at once. The blocks D names
must be exactly the granted ones, in order, or a suffix of them (D reads only what its
own prefix cache lacks): a repeated or reordered id is refused.

Thread-safe: the side-channel thread validates reads and ends leases while the engine
thread grants, releases and expires; ended leases wait in a queue for the engine thread.

A retention (`retain`) is a lease lent to no reader: an instance keeps a finished answer's cached
blocks (its conversation's history, the answer included) for the conversation's next turn, for
``--kv-retention-seconds`` from its last use (`touch`: a request or a hold hit them), unless the
pool needs them first, the next turn's retention covers them or the instance drains
(`end_retention`). Its expiry is the conversation going quiet: no warning, no expired_leases count.
A reader reads a hold of the same blocks (its own lease), never the retention.

Every lease's end is counted in ``kvbridge_kv_lease_held_seconds`` by outcome (`LeaseOutcome`).
A lease granted for a traced request keeps that request's `RequestTrace` and, when it ends,
records the ``kv.lease`` span (grant -> end, under P's request span; it may outlive P's HTTP
request) with its outcome, ERROR on expiry or a content mismatch. A check_read that carries D's
traceparent records ``kv.check_read`` (P's handling of it) under that parent, with the Tracing of
P's traced leases; an untraced P records nothing.
"""

from __future__ import annotations

import enum
import hashlib
import heapq
import logging
import queue
import secrets
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Callable

from opentelemetry.trace import SpanContext, SpanKind

from kvbridge.kv_transfer.params import BlockIds
from kvbridge.kv_transfer.stats import KVTransferStats
from kvbridge.tracing import RequestTrace, Tracing
from kvbridge.tracing.core import AttributeValue

logger = logging.getLogger("kvbridge.kv_transfer")


def content_digest(token_ids: Sequence[int]) -> str:
    """The digest of a prompt whose KV a request's blocks hold: equal iff the token ids are
    equal (same tokens, same order, same length). Token ids are < 2**32 (vocabulary-checked)."""
    return hashlib.blake2b(struct.pack(f"<{len(token_ids)}I", *token_ids), digest_size=16).hexdigest()


class Refusal(str, enum.Enum):
    """Why P refused a read."""

    NO_LEASE = "no_lease"  # expired, released, or never granted
    STALE = "stale"  # the lease was renewed under another generation
    BLOCKS = "blocks"  # the blocks named are not (a suffix of) the granted sequence
    CONTENT = "content"  # the reader's prompt is not the one whose KV the blocks hold


class LeaseOutcome(str, enum.Enum):
    """How a lease ended (the ``kv.lease`` span's kvbridge.outcome, the histogram's label)."""

    READ_DONE = "read_done"  # D read the blocks
    RELEASE = "release"  # D's release, or P's own (nobody will read)
    EXPIRED = "expired"  # nobody read or renewed it in time
    CONTENT_MISMATCH = "content_mismatch"  # a reader presented another prompt's digest
    SHUTDOWN = "shutdown"  # P shut down while it was held
    KV_CONTENT_MISMATCH = "kv_content_mismatch"  # what D read did not match P's digests (digest.py)
    PRESSURE = "pressure"  # a held prefix nobody had started reading: the pool needed its blocks
    RETENTION_EXPIRED = "retention_expired"  # a retained answer's conversation idled past its retention
    SUPERSEDED = "superseded"  # a retained answer's blocks are all in its conversation's next retention


_ERROR_OUTCOMES = {LeaseOutcome.EXPIRED: "the lease expired: its blocks were freed unread",
                   LeaseOutcome.CONTENT_MISMATCH: "a reader presented another prompt's content digest",
                   LeaseOutcome.KV_CONTENT_MISMATCH: "the bytes the reader read did not match their digests"}


@dataclass(frozen=True)
class ReadRefusal:
    kind: Refusal
    reason: str


@dataclass
class Lease:
    request_id: str
    block_ids: BlockIds
    generation: int
    expiry: float
    content: str  # content_digest of the prompt whose KV the blocks hold
    # content_digest of the prompt + the tokens P sampled: a reader that continues from P's
    # own tokens (first token straight from prefill) presents this one; None: no such reader
    continued: str | None = None
    granted_at: float = 0.0  # the table's clock at the grant (kvbridge_kv_lease_held_seconds)
    trace: RequestTrace | None = None  # the granting request's, when traced
    granted_ns: int = 0  # wall clock at the grant (the kv.lease span's start); 0 when not traced
    read_granted: bool = False  # a reader was granted a read (check_read): only its end frees the blocks early
    # A retention (`LeaseTable.retain`): a finished answer's blocks kept for its conversation's next turn,
    # lent to no reader (a reader gets a hold of its own), renewed by `touch` to `retained_s` from then.
    retained_s: float | None = None

    def holds(self, content: str) -> bool:
        """The reader's sequence is this prompt, or this prompt followed by exactly P's tokens."""
        return secrets.compare_digest(self.content, content) or (
            self.continued is not None and secrets.compare_digest(self.continued, content))

    def grants(self, block_ids: BlockIds) -> bool:
        """Per group, exactly the granted ids in order, or a suffix of them (the part D lacks)."""
        if len(block_ids) != len(self.block_ids):
            return False
        return all(len(want) <= len(have) and list(want) == list(have[len(have) - len(want):])
                   for want, have in zip(block_ids, self.block_ids))


# How long after a granted check_read P treats the read as in flight when no read-done
# notification arrives (D died mid-read, or its notification was lost): far longer than an
# 8k-token read on loopback (benchmarks/README.md, pd_transfer); this bounds the prompt polling
# a vanished reader can cause.
READ_WATCH_S = 5.0
# A granted read holds its blocks for this many of the reader's own read timeouts after the
# grant (D starts no read later than one timeout after it asked, and abandons a read one timeout
# after starting it: connector/receiving.py), whatever the lease's expiry: a lease that expired under a
# read still copying would hand its blocks to another prompt while D reads them.
READ_HOLD_TIMEOUTS = 2
MAX_READ_TIMEOUT_S = 3600.0  # the longest read timeout a reader may name (it pins P's blocks)
# Starts P's refusal message of a content mismatch, so D can tell it from a stale lease.
CONTENT_MISMATCH = "content mismatch"


class LeaseTable:
    """`stats`: where refused reads, content mismatches, early releases and expiries are counted
    (a fresh KVTransferStats when none is passed); `engine_id`: named on its log lines."""

    def __init__(self, lease_seconds: float, clock: Callable[[], float] = time.monotonic,
                 read_watch_s: float = READ_WATCH_S, stats: KVTransferStats | None = None,
                 engine_id: str = "") -> None:
        if lease_seconds <= 0:
            raise ValueError("lease_seconds must be positive")
        self.lease_seconds = lease_seconds
        self.read_watch_s = read_watch_s
        self.stats = stats if stats is not None else KVTransferStats()
        self.engine_id = engine_id
        # Called (on the side-channel thread) when a read from a reader that may still need
        # UCX wire-up is granted: that read completes only once P's agent progresses.
        self.on_read_granted: Callable[[], None] | None = None
        self._clock = clock
        self._lock = threading.Lock()
        self._released: "queue.SimpleQueue[str]" = queue.SimpleQueue()  # ended leases, for the engine thread
        self._leases: dict[str, Lease] = {}
        # request id -> (until when its granted read counts as in flight, whether it is watched)
        self._reading: dict[str, tuple[float, bool]] = {}
        self._heap: list[tuple[float, str, int]] = []  # (expiry, request id, generation); stale entries skipped
        self._retained = 0  # retentions among the leases (`retain`)
        # A random base: a P restarted under the same address never reissues a generation
        # that a D may still hold from before the restart.
        self._next_generation = secrets.randbits(40) << 16
        # P's Tracing, known from its traced leases: kv.check_read spans are recorded with it
        # (None until a traced request was granted a lease: P records no span then).
        self._tracing: Tracing | None = None

    def new_generation(self) -> int:
        with self._lock:
            self._next_generation += 1
            return self._next_generation

    def grant(self, request_id: str, block_ids: BlockIds, generation: int, content: str,
              continued: str | None = None, trace: RequestTrace | None = None,
              retained_s: float | None = None) -> None:
        """Hold `block_ids` for a remote reader; `content` is the content_digest of the prompt
        whose KV they hold, `continued` (optional) that of the prompt + the tokens P sampled;
        `trace`: the granting request's (its kv.lease span is recorded when the lease ends).
        `retained_s`: a retention (`retain`), not a lease for a reader.
        Raises ValueError if a lease on `request_id` is still held: a lease holds its blocks
        until it ends, and a second grant would orphan them."""
        granted_ns = time.time_ns() if trace is not None else 0
        with self._lock:
            if request_id in self._leases:
                raise ValueError(f"request {request_id!r} already holds a lease")
            now = self._clock()
            expiry = now + (self.lease_seconds if retained_s is None else retained_s)
            self._leases[request_id] = Lease(request_id, tuple(list(g) for g in block_ids), generation, expiry,
                                            content, continued, now, trace, granted_ns, retained_s=retained_s)
            if retained_s is not None:
                self._retained += 1
            heapq.heappush(self._heap, (expiry, request_id, generation))
            if trace is not None:
                self._tracing = trace.tracing

    def retain(self, retention_id: str, block_ids: BlockIds, content: str, retained_s: float) -> None:
        """Keep a finished answer's cached blocks (prompt and answer, whole blocks; `content`: the
        content_digest of their tokens) for `retained_s`, renewed by `touch` while its conversation
        is live; ended by `end_retention` (ValueError as
        `grant`). A retention is lent to no reader: a reader's check_read is refused (it reads a
        hold of the same blocks instead)."""
        if retained_s <= 0:
            raise ValueError("retained_s must be positive")
        self.grant(retention_id, block_ids, self.new_generation(), content, retained_s=retained_s)

    def touch(self, retention_id: str) -> bool:
        """The retained blocks served a request or a hold (the conversation is live): its retention
        runs `retained_s` from now. False if `retention_id` is no live retention."""
        with self._lock:
            lease = self._leases.get(retention_id)
            if lease is None or lease.retained_s is None:
                return False
            lease.expiry = self._clock() + lease.retained_s
            heapq.heappush(self._heap, (lease.expiry, retention_id, lease.generation))
            return True

    def end_retention(self, retention_id: str, outcome: LeaseOutcome) -> bool:
        """End a retention now (`outcome`: superseded, pressure, release) and queue its blocks to be
        freed (the caller may free them at once; the id still comes out of `finished_sending`).
        True if this call ended it."""
        with self._lock:
            lease = self._leases.get(retention_id)
            if lease is None or lease.retained_s is None:
                return False
            self._remove(retention_id)
        self._released.put(retention_id)
        self._ended(lease, outcome)
        return True

    def lent(self) -> int:
        """Leases for readers (a finished prefill's blocks, held prefixes): retentions not counted."""
        with self._lock:
            return len(self._leases) - self._retained

    def retention_due(self) -> bool:
        """Whether a retention may have expired by now (a step must end it): the earliest expiry on
        the heap has passed. Cheap; conservative (a renewed lease's old entry answers True once)."""
        with self._lock:
            return bool(self._retained) and bool(self._heap) and self._heap[0][0] <= self._clock()

    def _live(self, request_id: str, generation: int) -> Lease | None:
        lease = self._leases.get(request_id)
        if lease is None or lease.generation != generation:
            return None
        return lease

    def renew(self, request_id: str, generation: int) -> bool:
        """Heartbeat: extend to at least two thirds of a lease from now. False if unknown or stale."""
        with self._lock:
            lease = self._live(request_id, generation)
            if lease is None:
                return False
            new_expiry = self._clock() + self.lease_seconds * 2 / 3
            if new_expiry > lease.expiry:
                lease.expiry = new_expiry
                heapq.heappush(self._heap, (new_expiry, request_id, generation))
            return True

    def check_read(self, request_id: str, generation: int, block_ids: BlockIds,
                   content: str, watch: bool = True, read_timeout_s: float | None = None,
                   parent: SpanContext | None = None) -> ReadRefusal | None:
        """Before D reads: None if the lease is live, grants these blocks and holds the KV of
        the prompt whose digest is `content`, or that prompt followed by exactly the tokens P
        sampled (Lease.holds; the lease is renewed); else why not (counted). `watch`: the
        granted read counts in ``reads_in_flight(watched=True)`` too, and wakes the engine
        loop (``on_read_granted``). A content mismatch also ends the lease and queues its
        blocks to be freed (counted): the params that named it were swapped or replayed, and
        the KV is no use to the reader that presented them.
        `read_timeout_s`: the reader's own read timeout; a granted read keeps the blocks for
        READ_HOLD_TIMEOUTS of it (the lease cannot expire under a read still copying).
        `parent`: the reader's span (the traceparent in its message): P's handling is recorded
        under it as ``kv.check_read`` when P traces."""
        start_ns = time.time_ns() if parent is not None and self._tracing is not None else 0
        refusal, lease = self._check_read(request_id, generation, block_ids, content, watch, read_timeout_s)
        if refusal is not None:
            self.stats.incr("refused_reads")
            if refusal.kind is Refusal.CONTENT:  # the lease ended: free the blocks now
                self.stats.incr("content_mismatches")
                self._released.put(request_id)
                if lease is not None:
                    self._ended(lease, LeaseOutcome.CONTENT_MISMATCH)
        elif watch:
            self._wake()
        if start_ns and self._tracing is not None:
            attributes: dict[str, AttributeValue] = {"kvbridge.request_id": request_id, "kvbridge.lease_generation": generation,
                          "kvbridge.engine_id": self.engine_id, "kvbridge.num_blocks": sum(len(g) for g in block_ids),
                          "kvbridge.watch": watch,
                          "kvbridge.outcome": "granted" if refusal is None else refusal.kind.value}
            self._tracing.record("kv.check_read", parent, start_ns, time.time_ns(), kind=SpanKind.SERVER,
                                 attributes=attributes, error=refusal.reason if refusal is not None else None)
        return refusal

    def _wake(self) -> None:
        if self.on_read_granted is None:
            return
        try:
            self.on_read_granted()
        except Exception:  # a wake-up is an optimisation: never refuse a read over it
            logger.exception("the read-granted hook failed")

    def _check_read(self, request_id: str, generation: int, block_ids: BlockIds, content: str, watch: bool,
                    read_timeout_s: float | None) -> tuple[ReadRefusal | None, Lease | None]:
        """(why not, or None; the lease a content mismatch ended)."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None:
                return ReadRefusal(Refusal.NO_LEASE,
                                   f"no lease for request {request_id} (expired or already released)"), None
            if lease.retained_s is not None:  # a retention is lent to no reader (no params name it)
                return ReadRefusal(Refusal.NO_LEASE, f"no lease for request {request_id} (retained, not lent)"), None
            if lease.generation != generation:
                return ReadRefusal(Refusal.STALE,
                                   f"stale lease generation {generation} for request {request_id}"), None
            if not lease.grants(block_ids):
                return ReadRefusal(Refusal.BLOCKS, f"blocks not granted to request {request_id} "
                                                   "(not the granted sequence)"), None
            if not lease.holds(content):
                self._remove(request_id)
                return ReadRefusal(Refusal.CONTENT, f"{CONTENT_MISMATCH}: the blocks of request {request_id} "
                                                    "hold the KV of another prompt"), lease
            now = self._clock()
            hold = max(self.lease_seconds * 2 / 3, READ_HOLD_TIMEOUTS * (read_timeout_s or 0.0))
            lease.expiry = max(lease.expiry, now + hold)
            heapq.heappush(self._heap, (lease.expiry, request_id, generation))
            self._reading[request_id] = (now + self.read_watch_s, watch)
            lease.read_granted = True
            return None, None

    def reads_in_flight(self, watched: bool = False, min_age_s: float = 0.0) -> bool:
        """Has a read of leased blocks been granted (and watched, with `watched`; at least
        `min_age_s` ago, with `min_age_s`) and not ended (read done, release, expiry) within the
        last ``read_watch_s``?"""
        with self._lock:
            if not self._reading:
                return False
            now = self._clock()
            for rid in [rid for rid, (until, _) in self._reading.items() if until <= now]:
                del self._reading[rid]
            granted_by = now + self.read_watch_s - min_age_s  # `until` of a read granted min_age_s ago
            return any((watch or not watched) and until <= granted_by for until, watch in self._reading.values())

    def read_done(self, request_id: str, generation: int) -> bool:
        """D read the blocks: end the lease and queue them to be freed. True if this call ended it."""
        return self._end(request_id, generation, LeaseOutcome.READ_DONE)

    def release(self, request_id: str, generation: int) -> bool:
        """Nobody will read the blocks (D's release, or P's own: no D could be reached): end the
        lease and queue them to be freed (counted as an early release). True if this call ended it."""
        ended = self._end(request_id, generation, LeaseOutcome.RELEASE)
        if ended:
            self.stats.incr("early_releases")
        return ended

    def end_unread(self, request_id: str) -> bool:
        """The pool needs the blocks: end the lease on `request_id` if no read of it was granted
        (a granted read may be moving the bytes now; its lease ends as usual), and queue them to
        be freed. True if this call ended it."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None or lease.read_granted:
                return False
            self._remove(request_id)
        self._released.put(request_id)
        self._ended(lease, LeaseOutcome.PRESSURE)
        return True

    def kv_content_mismatch(self, request_id: str, generation: int) -> bool:
        """D's read failed its digests (digest.py): end the lease and queue its blocks to be freed
        (counted). True if this call ended it."""
        ended = self._end(request_id, generation, LeaseOutcome.KV_CONTENT_MISMATCH)
        if ended:
            self.stats.incr("kv_content_mismatches")
        return ended

    def _end(self, request_id: str, generation: int, outcome: LeaseOutcome) -> bool:
        with self._lock:
            lease = self._live(request_id, generation)
            if lease is None:
                return False
            self._remove(request_id)
        self._released.put(request_id)
        self._ended(lease, outcome)
        return True

    def _remove(self, request_id: str) -> Lease:
        """Take a lease out of the table (the caller holds the lock and ends it)."""
        lease = self._leases.pop(request_id)
        self._reading.pop(request_id, None)
        if lease.retained_s is not None:
            self._retained -= 1
        return lease

    def _ended(self, lease: Lease, outcome: LeaseOutcome) -> None:
        """A lease just ended (removed from the table, outside the lock): count how long it held
        its blocks and, for a traced request, record its kv.lease span."""
        self.stats.record_lease(max(0.0, self._clock() - lease.granted_at), outcome.value)
        if lease.trace is not None:
            lease.trace.record("kv.lease", lease.granted_ns, time.time_ns(), attributes={
                "kvbridge.request_id": lease.request_id, "kvbridge.lease_generation": lease.generation,
                "kvbridge.num_blocks": sum(len(g) for g in lease.block_ids), "kvbridge.engine_id": self.engine_id,
                "kvbridge.outcome": outcome.value}, error=_ERROR_OUTCOMES.get(outcome))

    def close(self) -> None:
        """P shuts down: the leases still held end (outcome shutdown; their blocks go with the
        engine). Idempotent."""
        with self._lock:
            leases = list(self._leases.values())
            self._leases.clear()
            self._reading.clear()
            self._heap.clear()
            self._retained = 0
        for lease in leases:
            self._ended(lease, LeaseOutcome.SHUTDOWN)

    def finished_sending(self) -> set[str]:
        """The engine thread, once per step: the requests whose blocks may be freed now (their
        lease ended since the last call, or expired: counted and logged; a retention's expiry is
        its conversation idling past it: neither)."""
        done = set(self.drain_released())
        for lease in self._pop_expired():
            done.add(lease.request_id)
            if lease.retained_s is not None:
                continue
            self.stats.incr("expired_leases")
            logger.warning("lease expired: request_id=%s engine=%s; freeing its KV blocks unread", lease.request_id,
                           self.engine_id)
        return done

    def drain_released(self) -> list[str]:
        """The requests whose lease ended (not expired) since the last call, in order."""
        out = []
        while True:
            try:
                out.append(self._released.get_nowait())
            except queue.Empty:
                return out

    def pop_expired(self) -> list[str]:
        """Leases past their expiry, removed. Cost: O(log n) per heap entry popped."""
        return [lease.request_id for lease in self._pop_expired()]

    def _pop_expired(self) -> list[Lease]:
        now = self._clock()
        expired: list[Lease] = []
        with self._lock:
            while self._heap and self._heap[0][0] <= now:
                _, rid, gen = heapq.heappop(self._heap)
                lease = self._live(rid, gen)
                if lease is not None and lease.expiry <= now:
                    expired.append(self._remove(rid))
        for lease in expired:
            self._ended(lease, LeaseOutcome.EXPIRED if lease.retained_s is None else LeaseOutcome.RETENTION_EXPIRED)
        return expired

    def held_blocks(self) -> int:
        """Blocks held for readers (retentions not counted: `retained_blocks`)."""
        with self._lock:
            return sum(len(g) for lease in self._leases.values() if lease.retained_s is None for g in lease.block_ids)

    def retained_blocks(self) -> int:
        with self._lock:
            return sum(len(g) for lease in self._leases.values() if lease.retained_s is not None
                       for g in lease.block_ids)

    def __len__(self) -> int:
        with self._lock:
            return len(self._leases)

    def __contains__(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._leases
