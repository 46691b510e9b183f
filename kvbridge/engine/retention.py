"""Answers retained for their conversation's next turn (--kv-retention-seconds).

When a request finishes with output on an instance that can hold prefixes, the cached blocks of its
prompt and answer (whole blocks: the conversation's history as the next turn will send it) stay
referenced under a retention id, leased by the connector (kv_transfer/lease.py: `LeaseTable.retain`),
so that one-off traffic does not evict a live conversation's history first. A retention:

- is renewed (`touch`) whenever a request's prefix-cache hit or a hold (another instance about to
  read the history) covers its last block: the conversation is live. Blocks are chained by content,
  so a hit on the last block is a hit on all of them;
- ends when the conversation's next answer is retained here with all of its blocks (superseded), when
  the pool needs blocks (pressure: before any request waits or is preempted, oldest first), when the
  retentions and held prefixes would pin more than their share of the pool (the oldest end), at a
  drain or a prefix-cache reset (release), or when it was not used for the retention period (its
  lease expires: the conversation went quiet; the blocks stay cached, evictable as any).

Its blocks appear in the instance's KV events as any cached block: the router needs no conversation
id. The blocks of an ended retention are freed at once (they stay in the prefix cache until evicted).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from kvbridge.engine.block_pool import KVBlock
from kvbridge.engine.kv_cache_manager import KVCacheManager
from kvbridge.engine.request import FinishReason, Request
from kvbridge.kv_transfer.connector.base import SchedulerConnector

ANSWERED = (FinishReason.STOP, FinishReason.LENGTH)  # an answer a next turn may send back as history


@dataclass(frozen=True)
class Retained:
    pinned: int  # blocks referenced, every group
    tail: int  # group 0's last block id: a hit that covers it covers the whole retention


class Retentions:
    """The scheduler's retained answers: one owner of their references (`kvm` under their ids) and
    of the map from a last block to its retention. Engine thread only."""

    def __init__(self, kvm: KVCacheManager, connector: SchedulerConnector) -> None:
        self.kvm = kvm
        self.connector = connector
        self.retained: dict[str, Retained] = {}  # least recently used first
        self._by_tail: dict[int, str] = {}
        self._ids = itertools.count(1)
        self.pinned = 0  # blocks the retentions reference together (read every step by LLMEngine.load)
        self.closed = False  # a draining instance retains nothing more (`close`)

    def __contains__(self, retention_id: str) -> bool:
        return retention_id in self.retained

    def __len__(self) -> int:
        return len(self.retained)

    def retain(self, req: Request, room: int) -> str | None:
        """Retain finished `req`'s cached blocks (before the scheduler frees the request's own
        references), ending the retentions they cover and, while more than `room` blocks would be
        pinned, the least recently used others. Returns the retention id, or None: nothing retained (not
        an answer, a P's prefill, nothing cached, retention off, or more blocks than `room` alone)."""
        params = req.kv_transfer_params
        if (req.finish_reason not in ANSWERED
                or (params is not None and params.wants_remote_decode) or self.closed
                or not self.connector.retains()):
            return None
        hits, n = self.kvm.get_computed_blocks(req, count=False)  # the cached blocks of its tokens, in order
        if n == 0:
            return None
        pinned = sum(len(g) for g in hits)
        if pinned > room:  # one answer longer than the share: kept by nothing, ending nothing
            return None
        for block in hits[0]:
            covered = self._by_tail.get(block.block_id)
            if covered is not None:
                self.end(covered, "superseded")
        while self.pinned + pinned > room:
            self.end_oldest()
        rid = f"kvbridge-retain-{next(self._ids)}-{req.request_id}"
        block_ids = self.kvm.reference(rid, hits)
        if not self.connector.retain(rid, req.all_token_ids[:n], block_ids):
            self.kvm.free(rid)
            return None
        self.retained[rid] = Retained(pinned, block_ids[0][-1])
        self._by_tail[block_ids[0][-1]] = rid
        self.pinned += pinned
        return rid

    def touch(self, hits: tuple[list[KVBlock], ...]) -> None:
        """A request's prefix-cache hit or a hold: renew every retention whose last block it covers
        (least recently used last again). O(blocks hit)."""
        if not self.retained:
            return
        for block in hits[0]:
            rid = self._by_tail.get(block.block_id)
            if rid is not None and self.connector.touch_retention(rid):
                self.retained[rid] = self.retained.pop(rid)

    def end(self, retention_id: str, outcome: str) -> None:
        """End a retention now and free its blocks (a lease that already ended, by expiry in this
        step, comes out of finished_sending later: `finished` ignores it then)."""
        self.connector.end_retention(retention_id, outcome)
        self.finished(retention_id)

    def end_oldest(self) -> bool:
        """The pool needs blocks: end the least recently used retention. False when none is left."""
        if not self.retained:
            return False
        self.end(next(iter(self.retained)), "pressure")
        return True

    def end_all(self, outcome: str = "release") -> None:
        for rid in list(self.retained):
            self.end(rid, outcome)

    def close(self) -> None:
        """A drain: end every retention, retain nothing from now on."""
        self.closed = True
        self.end_all()

    def finished(self, retention_id: str) -> bool:
        """Its lease ended (expired, or ended here): free its blocks. False if it is none of ours
        (or was freed already)."""
        r = self.retained.pop(retention_id, None)
        if r is None:
            return False
        self._by_tail.pop(r.tail, None)
        self.pinned -= r.pinned
        self.kvm.free(retention_id)
        return True
