"""P's side of the worker connector: serving this engine's KV to remote readers.

P publishes every rank's handshake payload on its side channel, answers D's control
messages there (control.py), and reports, once per step, the requests whose held blocks
may now be freed (`finished_sending`): their lease ended by D's read-done or release, a
content mismatch, P's own release (`release_local`), or expiry. The blocks themselves are
freed by the engine's scheduler when it sees the request id in finished_sending.
"""

from __future__ import annotations

import logging
from typing import Callable

from kvbridge.kv_transfer.connector.rank_agent import RankRegistration
from kvbridge.kv_transfer.control import ControlServer, incarnation_of
from kvbridge.kv_transfer.handshake import CompatibilityInfo, HandshakeMetadata, encode_payload
from kvbridge.kv_transfer.lease import LeaseTable
from kvbridge.kv_transfer.side_channel import SideChannelServer
from kvbridge.kv_transfer.stats import KVTransferStats

logger = logging.getLogger("kvbridge.kv_transfer")


class KVSender:
    """P: the side channel that serves this engine's ranks and the leases on blocks held for
    remote readers. Methods are called on the engine thread; the side channel's handlers run on
    its own thread and touch only the (thread-safe) lease table and the released queue."""

    def __init__(self, engine_id: str, backend_name: str, compat: CompatibilityInfo, side_channel: SideChannelServer,
                 leases: LeaseTable, stats: KVTransferStats) -> None:
        self.engine_id = engine_id
        self.backend_name = backend_name
        self.compat = compat
        self.side_channel = side_channel
        self.leases = leases
        self.stats = stats
        self.control_server = ControlServer(side_channel, leases, stats)

    def serve(self, ranks: tuple[RankRegistration, ...]) -> None:
        """Publish each rank's agent blob and KV layout for D's handshakes."""
        self.control_server.incarnation = incarnation_of(ranks[0].agent_metadata)
        for r in ranks:
            meta = HandshakeMetadata(self.engine_id, self.backend_name, r.agent_metadata, r.layout)
            self.side_channel.set_payload(r.layout.tp_rank, encode_payload(meta, self.compat))

    def finished_sending(self) -> set[str]:
        """The requests whose held blocks may be freed now: leases ended since the last call."""
        done = set(self.control_server.drain_released())
        for rid in self.leases.pop_expired():
            self.stats.incr("expired_leases")
            logger.warning("lease expired: request_id=%s engine=%s; freeing its KV blocks unread", rid,
                           self.engine_id)
            done.add(rid)
        return done

    def release_local(self, request_id: str, generation: int) -> bool:
        """Free a request's held blocks now (e.g. the proxy could not reach any D).
        Thread-safe; False if no such lease is held."""
        if not self.leases.release(request_id, generation):
            return False
        self.stats.incr("early_releases")
        self.control_server.queue_released(request_id)
        return True

    def reads_in_flight(self, watched: bool = False, min_age_s: float = 0.0) -> bool:
        """LeaseTable.reads_in_flight: a granted read of held blocks has not ended."""
        return self.leases.reads_in_flight(watched=watched, min_age_s=min_age_s)

    def set_wakeup(self, wake: Callable[[], None]) -> None:
        self.control_server.on_read_granted = wake

    def shutdown(self) -> None:
        self.side_channel.close()
