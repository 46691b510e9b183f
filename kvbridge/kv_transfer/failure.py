"""Failure kinds, the load-failure policy, and the one handler every failed load goes through."""

from __future__ import annotations

import enum
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvbridge.config import LoadFailurePolicy
from kvbridge.kv_transfer.params import BlockIds
from kvbridge.kv_transfer.stats import KVTransferStats

logger = logging.getLogger("kvbridge.kv_transfer")

LOG_INTERVAL_S = 10.0  # at most one failure line per (peer, kind) per interval


class FailureKind(str, enum.Enum):
    HANDSHAKE = "handshake"  # timeout, refused, version/hash/engine-id/layout mismatch, undecodable
    TRANSFER_SETUP = "transfer_setup"  # preparing or posting the read raised
    TRANSFER_STATE = "transfer_state"  # the backend reported the read as failed
    TRANSFER_POLL = "transfer_poll"  # polling the read raised
    TRANSFER_TIMEOUT = "transfer_timeout"  # the read ran past --kv-transfer-timeout (a dead link, a hung peer)
    NOTIFICATION = "notification"  # a notification could not be sent
    PEER_DEATH = "peer_death"  # the peer went away mid-transfer
    STALE_LEASE = "stale_lease"  # P no longer holds the blocks (lease expired or foreign blocks)
    CONTENT_MISMATCH = "content_mismatch"  # P's blocks hold another prompt's KV (swapped/replayed params)
    KV_CONTENT_MISMATCH = "kv_content_mismatch"  # the bytes D read differ from P's digests of them (digest.py)


def recompute_on_failure(policy: LoadFailurePolicy, recompute_max_tokens: int, num_prompt_tokens: int) -> bool:
    """True: recompute the request locally; False: finish it with an error (HTTP 500)."""
    if policy is LoadFailurePolicy.RECOMPUTE:
        return True
    if policy is LoadFailurePolicy.FAIL:
        return False
    return num_prompt_tokens <= recompute_max_tokens


@dataclass(frozen=True)
class LoadFailure:
    request_id: str
    kind: FailureKind
    cause: str
    invalid_block_ids: frozenset[int]  # local ids, every KV cache group


class FailureHandler:
    """The single path of every failed load, callable from any thread.

    handle() marks the request's local blocks invalid (all groups), queues the request
    as failed, records the failure and logs one structured line (rate-limited per peer
    and kind). The worker half releases the transfer handles before calling it and
    drains the queue in get_finished().
    """

    def __init__(self, stats: KVTransferStats, clock: Callable[[], float] = time.monotonic) -> None:
        self.stats = stats
        self._queue: "queue.SimpleQueue[LoadFailure]" = queue.SimpleQueue()
        self._clock = clock
        self._log_lock = threading.Lock()
        self._last_log: dict[tuple[str, FailureKind], tuple[float, int]] = {}

    def handle(self, request_id: str, kind: FailureKind, cause: str, local_block_ids: BlockIds,
               remote_engine: str) -> None:
        ids = frozenset(b for group in local_block_ids for b in group)
        self._queue.put(LoadFailure(request_id, kind, cause, ids))
        self.stats.record_failure(kind.value)
        self._log(request_id, kind, cause, remote_engine)

    def drain(self) -> list[LoadFailure]:
        out = []
        while True:
            try:
                out.append(self._queue.get_nowait())
            except queue.Empty:
                return out

    def _log(self, request_id: str, kind: FailureKind, cause: str, remote_engine: str) -> None:
        now = self._clock()
        key = (remote_engine, kind)
        with self._log_lock:
            last, suppressed = self._last_log.get(key, (float("-inf"), 0))
            if now - last < LOG_INTERVAL_S:
                self._last_log[key] = (last, suppressed + 1)
                return
            self._last_log[key] = (now, 0)
        logger.warning("kv load failed: request_id=%s remote_engine=%s class=%s cause=%s suppressed_since_last=%d",
                       request_id, remote_engine, kind.value, cause, suppressed)
