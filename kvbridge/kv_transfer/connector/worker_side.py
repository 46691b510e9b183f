"""The connector's worker half: the control plane of the engine's KV transfers.

It lives in the engine process and joins the two roles: D's receive state machine
(receiving.py: handshakes, the lease check, the reads each of D's ranks makes from P's ranks,
read-done and release) and P's serving side (the side channel's ControlServer publishing the
ranks' payloads and answering D's control messages, and the lease table owning the held blocks). An engine of role "both" runs both. The bytes move
in the ranks: each rank (the engine process at TP 1, a rank process at TP N) owns a
`RankAgent` with its own transfer agent, and this half drives them with per-rank commands
that ride the step's scheduler output and reads the per-rank reports that come back with
its result (rank_agent.py).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence

from prometheus_client.registry import Collector

from kvbridge.config import KVRole, KVTransferConfig
from kvbridge.kv_transfer.backends.base import TransferBackend
from kvbridge.kv_transfer.connector.base import KVConnectorOutput, WorkerConnector, WorkerStatus
from kvbridge.kv_transfer.connector.metadata import ConnectorMetadata
from kvbridge.kv_transfer.connector.rank_agent import RankAgent, RankCommands, RankRegistration, RankReport, RankSetup
from kvbridge.kv_transfer.connector.receiving import KVReceiver, ReceiverDeps
from kvbridge.kv_transfer.failure import FailureHandler
from kvbridge.kv_transfer.digest import DIGEST_ID, DIGEST_OFF
from kvbridge.kv_transfer.side_channel.control import ControlServer, RankDigester
from kvbridge.kv_transfer.side_channel.handshake import CompatibilityInfo
from kvbridge.kv_transfer.lease import LeaseTable
from kvbridge.kv_transfer.params import KVTransferParams
from kvbridge.kv_transfer.read_plan.request_reads import KVGroups
from kvbridge.kv_transfer.side_channel.server import SideChannelServer
from kvbridge.kv_transfer.stats import KVTransferStats

logger = logging.getLogger("kvbridge.kv_transfer")

# P: how long a granted read D did not ask P to watch (every (D rank, P rank) pair it reads
# between has completed a read since D added P's agent: their agents are wired up) may be in
# flight before P's ranks poll their agents for it. Such a read needs no progress from P
# (NIXL reads between wired-up agents complete with the target making no call at all; UCX's
# keepalive, which breaks that after an idle spell, is off: backends/nixl.py), so the polls
# are only a safety net, and at TP N each is a round through N + 1 processes that slows the
# reader's copy. Chosen longer than a 1k-token read and shorter than an 8k-token one
# (benchmarks/README.md, pd_transfer, has both read times and a poll's cost).
UNWATCHED_POLL_AFTER_S = 0.02


class KVBridgeWorkerConnector(WorkerConnector):
    """`backend` is the engine process's own transfer agent at TP 1; None at TP N, where each
    rank process creates its own (`rank_setup`). `side_channel`: P's (None: this engine
    serves no reads)."""

    def __init__(self, config: KVTransferConfig, engine_id: str, backend: TransferBackend | None,
                 compat: CompatibilityInfo, leases: LeaseTable, failures: FailureHandler, stats: KVTransferStats,
                 side_channel: SideChannelServer | None, prefix_caching: bool,
                 groups: KVGroups = KVGroups(("full_attention",)),
                 receiver_deps: ReceiverDeps | None = None) -> None:
        """`receiver_deps`: what D's receiver reaches P through (None: ReceiverDeps.default, sockets
        and threads; a unit test gives its in-memory P, executors and clock)."""
        self.config = config
        self.engine_id = engine_id
        # what a peer must share with this engine to exchange KV, the digest setting included (digest.py)
        self.compat = dataclasses.replace(compat, kv_digest=DIGEST_ID if config.kv_verify else DIGEST_OFF)
        local_agent = (RankAgent(backend, side_channel is not None, config.transfer_timeout_s)
                       if backend is not None else None)
        self._rank_setup = RankSetup(engine_id, config.backend, side_channel is not None, local_agent)
        self.leases = leases
        self.stats = stats
        self.side_channel = side_channel
        self.receiving = KVReceiver(config, self.compat, failures, stats, prefix_caching, groups,
                                    receiver_deps if receiver_deps is not None else ReceiverDeps.default(config))
        # P: D's handshakes and control messages, answered from the lease table
        self.control = ControlServer(side_channel, leases) if side_channel is not None else None
        self.ranks: tuple[RankRegistration, ...] = ()
        self._closed = False
        self._last_backend_error_log = float("-inf")

    @property
    def rank_setup(self) -> RankSetup:
        return self._rank_setup

    @property
    def local_agent(self) -> RankAgent | None:
        """The engine process's rank agent (TP 1), or None (TP N)."""
        return self._rank_setup.local_agent

    @property
    def backend(self) -> TransferBackend:
        """The engine process's transfer agent (TP 1 only)."""
        if self.local_agent is None:
            raise AttributeError("at tensor parallel size > 1 each rank process owns its transfer agent")
        return self.local_agent.backend

    @property
    def is_consumer(self) -> bool:
        return self.config.role in (KVRole.CONSUMER, KVRole.BOTH)

    # ---- registration ------------------------------------------------------
    def register_ranks(self, ranks: Sequence[RankRegistration]) -> None:
        """Every rank's agent blob and KV layout, rank order: serve them (P), shake hands (D)."""
        self.ranks = tuple(ranks)
        if [r.layout.tp_rank for r in self.ranks] != list(range(len(self.ranks))):
            raise ValueError("rank registrations must be ranks 0..n-1 in order")
        if self.control is not None:
            local = self.local_agent.registration if self.local_agent is not None else None
            if self.config.kv_verify and local is not None and local.layout.memory == "cpu":
                # this process holds the rank's KV in host memory: it digests what readers read (digest.py)
                self.control.digesters[local.layout.tp_rank] = RankDigester.of(local.layout)
            self.control.publish_ranks(self.engine_id, self.config.backend, self.compat,
                                       [(r.agent_metadata, r.layout) for r in self.ranks])
        self.receiving.register_ranks(self.ranks, handshakes=self.is_consumer)

    # ---- per step ----------------------------------------------------------
    def start_load_kv(self, metadata: ConnectorMetadata | None) -> list[RankCommands] | None:
        """Before the ranks run: take this step's requests, and return each rank's commands
        (None when no rank has any: nothing to ship with the step)."""
        if metadata is not None:
            self.receiving.take(metadata)
        self.receiving.advance_all()
        return self.receiving.take_commands()

    def get_finished(self, reports: Sequence[RankReport] = ()) -> KVConnectorOutput:
        """After the ranks ran: take their reports; say which requests settled. Never raises."""
        out = KVConnectorOutput()
        for report in reports:
            if report.backend_error is not None:
                self._log_backend_error(f"rank {report.tp_rank}", report.backend_error)
            for result in report.settled:
                self.receiving.take_result(report.tp_rank, result)
        self.receiving.advance_all()
        self.receiving.report(out)
        if self.control is not None:
            out.finished_sending.update(self.leases.finished_sending())
        return out

    def release(self, params: KVTransferParams) -> bool:
        """P: free the blocks held for the request `params` name, if they name this engine."""
        if params.remote_engine_id != self.engine_id or params.remote_request_id is None:
            return False
        return self.release_local(params.remote_request_id, params.lease_generation or 0)

    def release_local(self, request_id: str, generation: int) -> bool:
        """P: free a request's held blocks now, by P's own request id and the lease's generation.
        Thread-safe; False if no such lease is held."""
        return self.control is not None and self.leases.release(request_id, generation)

    def _log_backend_error(self, where: str, error: str) -> None:
        now = time.monotonic()
        if now - self._last_backend_error_log >= 10.0:  # rate-limited: it repeats every step
            self._last_backend_error_log = now
            logger.error("transfer backend of %s failed on engine %s: %s", where, self.engine_id, error)

    def status(self) -> WorkerStatus:
        """In flight: D's loads under way, or on P a watched read of its leased blocks granted and
        not yet done (one that may complete only after P's agent progresses: the loop must step
        promptly). Rank commands: D's reads planned after the ranks ran (when P's check_read
        answer came in), waiting for the next step."""
        in_flight = self.receiving.has_loads() or (self.control is not None and self.leases.reads_in_flight(watched=True))
        leases = self.leases.lent()  # retentions are no work a step must advance until one may expire
        return WorkerStatus(rank_commands_waiting=self.receiving.has_commands(), transfers_in_flight=in_flight,
                            has_work=self.receiving.has_work() or bool(leases) or self.leases.retention_due(),
                            leases_held=leases,
                            lease_outcomes=self.stats.lease_outcomes())

    def collectors(self) -> Sequence[Collector]:
        return (self.stats,)

    def needs_rank_poll(self) -> bool:
        """D: a read handed to a rank has not settled (its poll reports it). P: a read of its
        blocks was granted and has not ended, and either D asked P to watch it (it may need its
        agents' progress, `LeaseTable.reads_in_flight`) or it has been in flight for
        UNWATCHED_POLL_AFTER_S. Otherwise a step with nothing scheduled and no commands leaves
        the ranks alone: a P holding leases steps every few ms to expire them, and nothing of
        that needs its ranks."""
        return (self.receiving.has_unsettled_reads()
                or (self.control is not None
                    and (self.leases.reads_in_flight(watched=True)
                         or self.leases.reads_in_flight(min_age_s=UNWATCHED_POLL_AFTER_S))))

    def set_wakeup(self, wake: Callable[[], None]) -> None:
        """P: call ``wake`` (from the side-channel thread) when a read of leased blocks is granted,
        so that an engine loop sleeping between idle steps polls again at once."""
        if self.control is not None:
            self.leases.on_read_granted = wake

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.receiving.shutdown()
        if self.side_channel is not None:
            self.side_channel.close()
            self.leases.close()  # the leases still held end (outcome shutdown)
        if self.local_agent is not None:  # releases its live handles, then the backend
            self.local_agent.shutdown()
