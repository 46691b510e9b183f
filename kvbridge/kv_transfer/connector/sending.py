"""P's side of the worker connector: serving this engine's KV to remote readers.

P publishes every rank's handshake payload on its side channel, where D's control messages
are parsed (side_channel/control.py) and handed to the lease table (lease.py), the one owner of P's held
blocks. Once per step it reports the requests whose blocks may now be freed
(`finished_sending`, the table's): their lease ended by D's read-done or release, a content
mismatch, P's own release (`release_local`), or expiry. The blocks themselves are freed by
the engine's scheduler when it sees the request id in finished_sending.
"""

from __future__ import annotations

from typing import Callable

from kvbridge.kv_transfer.connector.rank_agent import RankRegistration
from kvbridge.kv_transfer.side_channel.control import ControlServer, incarnation_of
from kvbridge.kv_transfer.side_channel.handshake import CompatibilityInfo, HandshakeMetadata, encode_payload
from kvbridge.kv_transfer.lease import LeaseTable
from kvbridge.kv_transfer.side_channel.server import SideChannelServer


class KVSender:
    """P: the side channel that serves this engine's ranks and the leases on blocks held for
    remote readers. Methods are called on the engine thread; the side channel's handlers run on
    its own thread and touch only the (thread-safe) lease table."""

    def __init__(self, engine_id: str, backend_name: str, compat: CompatibilityInfo, side_channel: SideChannelServer,
                 leases: LeaseTable) -> None:
        self.engine_id = engine_id
        self.backend_name = backend_name
        self.compat = compat
        self.side_channel = side_channel
        self.leases = leases
        self.control_server = ControlServer(side_channel, leases)

    def serve(self, ranks: tuple[RankRegistration, ...]) -> None:
        """Publish each rank's agent blob and KV layout for D's handshakes."""
        self.control_server.incarnation = incarnation_of(ranks[0].agent_metadata)
        for r in ranks:
            meta = HandshakeMetadata(self.engine_id, self.backend_name, r.agent_metadata, r.layout)
            self.side_channel.set_payload(r.layout.tp_rank, encode_payload(meta, self.compat))

    def finished_sending(self) -> set[str]:
        """The requests whose held blocks may be freed now: leases ended since the last call."""
        return self.leases.finished_sending()

    def release_local(self, request_id: str, generation: int) -> bool:
        """Free a request's held blocks now (e.g. the proxy could not reach any D).
        Thread-safe; False if no such lease is held."""
        return self.leases.release(request_id, generation)

    def reads_in_flight(self, watched: bool = False, min_age_s: float = 0.0) -> bool:
        """LeaseTable.reads_in_flight: a granted read of held blocks has not ended."""
        return self.leases.reads_in_flight(watched=watched, min_age_s=min_age_s)

    def set_wakeup(self, wake: Callable[[], None]) -> None:
        self.leases.on_read_granted = wake

    def shutdown(self) -> None:
        self.side_channel.close()
        self.leases.close()  # the leases still held end (outcome shutdown)
