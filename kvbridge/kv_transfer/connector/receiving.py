"""D's side of the worker connector: the receive state machine.

For each request to receive, a small state machine advanced twice per step (before the
ranks run, to hand them new reads; after, to take their reports) without blocking:
  HANDSHAKE  the (deduplicated, background) handshakes with each of P's ranks: rank 0's
             payload names P's TP size, then the others are fetched; the pairing of D's
             ranks with P's is checked (tp_mapping.check_pairing) before any read
  CHECK      P confirms on its side channel that the lease is live and grants the blocks
  READ       the request's ReadPlan (tp_mapping.plan_request_reads): one one-sided read
             per (D rank, P rank) pair it names, without a backend notification (a
             replicated head, e.g. MLA's latent, from the one P rank the plan picks). The
             request is settled only when EVERY read has settled: then the
             handles are released, and either D sends P the plan's notice as one
             kv_read_done (all reads DONE) or the request fails with the first failure
             and the same notice goes as a kv_release
Any failure goes through the one FailureHandler and the request is reported in
finished_recving + failed_recving with its blocks invalid; nothing raises into the step.

Because D's reads are aggregated here before D says anything to P, P receives ONE
read-done per request however many ranks either side has, and frees on it (or on
release / lease expiry), keyed by its own request id: P needs no per-rank count, and a
P rank whose copy nobody read (MLA, P TP > D TP) is freed by the same notice.

The bytes move in the ranks: the reads planned here leave as per-rank commands
(`take_commands`) and come back as the ranks' settled results (`take_result`).

Every settled load is counted in ``kvbridge_kv_load_seconds`` (by outcome) and, read in full, in
``kvbridge_kv_read_bytes``; a request that had to wait for a handshake, in
``kvbridge_kv_handshake_seconds``. A traced request (RecvSpec.trace) also gets its spans
(``kv.load`` and its children, ``kv.read_done`` / ``kv.release``: receive_spans.py), made by the
request's `LoadSpans`, which the state machine calls at its transitions. An untraced request has
none: it notes no wall-clock time and makes no span.

Everything the machine reaches outside itself comes from its factory as one `ReceiverDeps`: the
side-channel client every handshake and control message goes through, the pools those blocking
calls run on, and the clocks. `ReceiverDeps.default(config)` is production's (sockets, thread
pools, time.monotonic / time.perf_counter); a test gives an in-memory P, executors that run a
call when the test says and a clock it moves (tests/unit/receiver_world.py), so every failure
path is reachable without an engine pair.
"""

from __future__ import annotations

import enum
import itertools
import logging
import time
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

from kvbridge.config import KVTransferConfig
from kvbridge.kv_transfer.connector.base import KVConnectorOutput
from kvbridge.kv_transfer.connector.metadata import ConnectorMetadata, RecvSpec, RemoteEngine
from kvbridge.kv_transfer.connector.rank_agent import RankCommands, RankRegistration, ReadOp, ReadResult
from kvbridge.kv_transfer.connector.receive_spans import LoadSpans, traced_message
from kvbridge.kv_transfer.side_channel.control import ControlClient, incarnation_of
from kvbridge.kv_transfer.failure import FailureHandler, FailureKind
from kvbridge.kv_transfer.side_channel.handshake import (CompatibilityInfo, HandshakeDecodeError, HandshakeError,
                                                         HandshakeFailureKind,
                                                         HandshakeHashMismatch, HandshakeLayoutMismatch, HandshakeMetadata,
                                                         HandshakeVersionMismatch, RankLayout)
from kvbridge.kv_transfer.side_channel.handshake_manager import HandshakeManager
from kvbridge.kv_transfer.lease import CONTENT_MISMATCH
from kvbridge.kv_transfer.read_plan.block_mapping import BlockMappingError
from kvbridge.kv_transfer.read_plan.request_reads import Descs, KVGroups, request_descs
from kvbridge.kv_transfer.read_plan.tp_mapping import (RankBlocks, RankKV, ReadPlan, ReleaseNotice, TPMappingError,
                                                       check_pairing, plan_request_reads, request_salt)
from kvbridge.kv_transfer.side_channel.client import HandshakeClient
from kvbridge.kv_transfer.stats import KVTransferStats
from kvbridge.tracing import RequestTrace

logger = logging.getLogger("kvbridge.kv_transfer")

MAX_REMOTE_TP_SIZE = 256  # the most ranks D will shake hands with for one prefill engine

# Failures after which D tells P to release: the read failed, but P's side channel answered
# (so does any failure once P granted the read: a rank failing to add P's agent, too).
_RELEASE_AFTER = frozenset({FailureKind.TRANSFER_SETUP, FailureKind.TRANSFER_STATE, FailureKind.TRANSFER_POLL,
                            FailureKind.TRANSFER_TIMEOUT})


# Handshake refusals of a payload P's own side channel sent (another protocol version, dtype or
# model, a layout D cannot map): P is up and named in the params, so it frees the lease at once on
# D's release rather than at expiry. Not after a timeout, a refusal to connect or another engine.
_P_ANSWERED = (HandshakeVersionMismatch, HandshakeHashMismatch, HandshakeLayoutMismatch)


@dataclass(frozen=True)
class ReceiverDeps:
    """What KVReceiver talks to outside itself, given by its factory (module docstring)."""

    side_client: HandshakeClient  # every handshake and control message to P; signs them when P and D share a key
    executor: Executor  # runs check_read, read-done, release, heartbeats; shut down with the receiver
    # runs the handshakes, shut down with the receiver; None: HandshakeManager's own pool (it shuts that down)
    handshake_executor: Executor | None = None
    clock: Callable[[], float] = time.monotonic  # deadlines: the late-grant check, handshake backoff
    timer: Callable[[], float] = time.perf_counter  # measured durations (load, transfer, handshake wait)

    @classmethod
    def default(cls, config: KVTransferConfig) -> ReceiverDeps:
        """Production's: a socket client with the config's key, a 2-thread control pool."""
        return cls(HandshakeClient(key=config.side_channel_key),
                   ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvbridge-control"))


class _Phase(enum.Enum):
    HANDSHAKE = "handshake"
    CHECK = "check"
    READ = "read"


@dataclass
class _SubRead:
    """One (D rank, P rank) read of a request."""

    local_rank: int
    remote_rank: int
    nbytes: int
    ndescs: int
    result: ReadResult | None = None


@dataclass(frozen=True)
class _Peer:
    """A prefill engine D has shaken hands with: every rank's agent blob and KV blocks."""

    key: str
    ranks: tuple[RankBlocks, ...]
    agent_metadata: tuple[bytes, ...]
    incarnation: str
    blocks_per_logical: int = 1  # P's kernel blocks per logical block (its block ids are logical)
    memory: tuple[tuple[str, int], ...] = ()  # each rank's KV memory: (cpu | cuda, device id)

    def rank_key(self, tp_rank: int) -> str:
        return f"{self.key}/tp{tp_rank}"


@dataclass
class _Recv:
    spec: RecvSpec
    phase: _Phase
    futures: list[Future[Any]]  # HANDSHAKE: one per P rank asked so far; CHECK: the lease check
    created: float  # parked (ReceiverDeps.timer; kvbridge_kv_load_seconds)
    started: float  # READ: the reads were planned (ReceiverDeps.timer; until then, created)
    peer: _Peer | None = None
    rehandshaken: bool = False
    plan: ReadPlan | None = None  # READ: what is read from which P rank, and the notice that frees P
    asked_at: float = 0.0  # CHECK: when D asked P to grant the read (ReceiverDeps.clock)
    reads: dict[str, _SubRead] = field(default_factory=dict)  # xfer id -> read
    handshake_from: float | None = None  # waiting for a handshake since (ReceiverDeps.timer), or not waiting
    spans: LoadSpans | None = None  # a traced request's (RecvSpec.trace), until the load settles
    abandoned: tuple[FailureKind, str] | None = None  # READ: failed by a bug while reads were in flight
    # CHECK, with verification on: the reads planned before asking P (P digests their remote spans)
    planned: tuple[ReadPlan, Descs] | None = None

    def notice(self) -> ReleaseNotice:
        """What frees P's blocks of this request: the plan's notice; before a plan, the same
        key (P's request id and generation) for whatever P ranks are known."""
        if self.plan is not None:
            return self.plan.notice
        ranks = tuple(range(len(self.peer.ranks))) if self.peer is not None else ()
        return ReleaseNotice(self.spec.remote_request_id, self.spec.lease_generation, ranks)


def _expected_digests(descs: Descs, digests: dict[int, list[int] | None]
                      ) -> dict[tuple[int, int], tuple[int, ...] | None]:
    """Each read's share of P's digests: P digested each P rank's spans in the order D sent them
    (every read of that rank, in `descs` order). None for a read whose P rank sent no digests."""
    out: dict[tuple[int, int], tuple[int, ...] | None] = {}
    offsets: dict[int, int] = {}
    for (local_rank, remote_rank), (_, r_descs) in descs.items():
        rank_digests = digests.get(remote_rank)
        start = offsets.get(remote_rank, 0)
        offsets[remote_rank] = start + len(r_descs)
        if rank_digests is None:
            out[(local_rank, remote_rank)] = None
        elif len(rank_digests) < start + len(r_descs):
            raise HandshakeDecodeError(f"P rank {remote_rank} digested none of the spans D planned to read "
                                       "(outside the blocks its lease grants)")
        else:
            out[(local_rank, remote_rank)] = tuple(rank_digests[start:start + len(r_descs)])
    return out


def rank_blocks(layout: RankLayout) -> RankBlocks:
    """A rank's KV blocks as the TP mapping sees them, from the layout it announced."""
    head_bytes = layout.block_len_bytes[0] // layout.num_kv_heads
    kv = RankKV(layout.tp_rank, range(layout.kv_head_start, layout.kv_head_start + layout.num_kv_heads), head_bytes)
    return RankBlocks(kv, layout.region_base_addrs[0], layout.num_blocks)


class KVReceiver:
    """D: the requests whose KV this engine reads from a prefill engine, from handshake to the
    read-done (or release) P hears. Called on the engine thread only; the side-channel calls
    (handshakes, check_read, read-done, release, heartbeats) run on `deps`' pools, each
    bounded by a timeout."""

    def __init__(self, config: KVTransferConfig, compat: CompatibilityInfo, failures: FailureHandler,
                 stats: KVTransferStats, prefix_caching: bool, groups: KVGroups, deps: ReceiverDeps) -> None:
        self.config = config
        self.groups = groups  # the model's KV cache groups: how D pairs P's blocks with its own
        self.compat = compat
        self.failures = failures
        self.stats = stats
        self.prefix_caching = prefix_caching
        # One client for handshakes and control messages: it signs requests when P and D share a key.
        self._side_client = deps.side_client
        self.control = ControlClient(config.handshake_timeout_s, self._side_client, config.transfer_timeout_s)
        self._executor = deps.executor
        self._handshake_executor = deps.handshake_executor
        self._clock, self._timer = deps.clock, deps.timer
        self._handshakes: HandshakeManager | None = None
        self.ranks: tuple[RankRegistration, ...] = ()
        self._local: tuple[RankBlocks, ...] = ()
        self._commands: list[RankCommands] = []
        self._xfer_ids = itertools.count()
        self._xfers: dict[str, str] = {}  # live xfer id -> D's request id
        self._peers: dict[RemoteEngine, _Peer] = {}
        # (peer key, D rank, P rank) of the rank pairs that completed a read since D added P's
        # agents: wired up, so a read between them needs no progress from P and check_read
        # tells P it need not poll promptly (lease.py).
        self._wired: set[tuple[str, int, int]] = set()
        self._recvs: dict[str, _Recv] = {}
        self._done_recv: set[str] = set()
        self._side_requests: list[tuple[str, Future[object]]] = []  # (what, future) of releases and heartbeats

    def register_ranks(self, ranks: tuple[RankRegistration, ...], handshakes: bool) -> None:
        """This engine's ranks, in order; `handshakes`: this engine receives (a consumer), so it
        shakes hands with prefill engines."""
        self.ranks = ranks
        self._local = tuple(rank_blocks(r.layout) for r in ranks)
        self._commands = [RankCommands() for _ in ranks]
        if handshakes:
            self._handshakes = HandshakeManager(
                self.compat, ranks[0].layout, prefix_caching=self.prefix_caching,
                client=self._side_client, timeout_s=self.config.handshake_timeout_s,
                validate=self._validate_peer_rank, executor=self._handshake_executor, clock=self._clock)

    def _validate_peer_rank(self, meta: HandshakeMetadata) -> None:
        if meta.backend != self.config.backend:
            raise HandshakeLayoutMismatch(
                f"peer uses transfer backend {meta.backend!r}, this engine {self.config.backend!r}")

    # ---- per step ----------------------------------------------------------
    def take(self, metadata: ConnectorMetadata) -> None:
        """This step's requests to receive, releases to send and leases to renew."""
        for r in metadata.reqs_to_recv:
            self._start_recv(r)
        for rel in metadata.reqs_to_release:
            self._side_request("release", self.control.release, rel.remote.host, rel.remote.port,
                               rel.remote_request_id, rel.lease_generation, trace=rel.trace)
        for remote, items in metadata.heartbeats.items():
            self._side_request("heartbeat", self.control.heartbeat, remote.host, remote.port, items)

    def advance_all(self) -> None:
        """Move every request as far as its futures and its reads' results allow; never blocks."""
        for rid, recv in list(self._recvs.items()):
            self._advance(rid, recv)

    def take_commands(self) -> list[RankCommands] | None:
        """Each rank's commands gathered since the last call, or None when no rank has any."""
        if not any(self._commands):
            return None
        commands, self._commands = self._commands, [RankCommands() for _ in self.ranks]
        return commands

    def take_result(self, tp_rank: int, result: ReadResult) -> None:
        """A rank reports one of its reads settled."""
        rid = self._xfers.get(result.xfer_id)
        recv = self._recvs.get(rid) if rid is not None else None
        if recv is None or result.xfer_id not in recv.reads:
            logger.warning("rank %d reported unknown transfer %s", tp_rank, result.xfer_id)
            return
        recv.reads[result.xfer_id].result = result

    def report(self, out: KVConnectorOutput) -> None:
        """Into `out`: the requests settled since the last call, the failed ones with their blocks."""
        out.finished_recving |= self._done_recv
        self._done_recv = set()
        for failure in self.failures.drain():
            out.finished_recving.add(failure.request_id)
            out.failed_recving.add(failure.request_id)
            out.invalid_block_ids |= failure.invalid_block_ids
            out.failure_causes[failure.request_id] = f"KV transfer failed ({failure.kind.value}): {failure.cause}"
            out.failure_kinds[failure.request_id] = failure.kind
        self._reap_side_requests()

    def has_loads(self) -> bool:
        """Requests still receiving, or commands waiting to ride the next step to the ranks."""
        return bool(self._recvs) or any(self._commands)

    def has_unsettled_reads(self) -> bool:
        """A read handed to a rank has not settled (its rank's poll reports it)."""
        return any(read.result is None for recv in self._recvs.values() for read in recv.reads.values())

    def has_commands(self) -> bool:
        return any(self._commands)

    def has_work(self) -> bool:
        return bool(self._recvs or self._side_requests or any(self._commands))

    def shutdown(self) -> None:
        for recv in self._recvs.values():
            self._end_spans(recv, "shutdown", "the engine shut down during the load")
        self._recvs.clear()
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self._handshakes is not None:
            self._handshakes.close()  # shuts down its own pool, when it has one
        if self._handshake_executor is not None:
            self._handshake_executor.shutdown(wait=False, cancel_futures=True)

    def _start_recv(self, spec: RecvSpec) -> None:
        assert self._handshakes is not None, "a consumer connector receives only after register_ranks"
        r = spec.remote
        future = self._handshakes.ensure(r.engine_id or None, r.host, r.port, 0)
        now = self._timer()
        recv = self._recvs[spec.request_id] = _Recv(spec, _Phase.HANDSHAKE, [future], created=now, started=now)
        if spec.trace is not None:
            recv.spans = LoadSpans(spec, spec.trace)
        self._note_handshake_wait(recv)

    def _side_request(self, what: str, fn: Callable[..., None], *args: object,
                      trace: RequestTrace | None = None) -> None:
        """Send P a message on the control thread; `trace`: the request's, for a read-done or a
        release (its kv.read_done / kv.release span)."""
        try:
            self._side_requests.append((what, self._executor.submit(traced_message(trace, what, fn), *args)))
        except RuntimeError:  # executor shut down
            self.stats.incr("failed_notifications")

    # ---- metrics and spans -------------------------------------------------
    def _note_handshake_wait(self, recv: _Recv) -> None:
        """The request waits for a handshake (one of its futures is not done): note since when."""
        if recv.handshake_from is None and not all(f.done() for f in recv.futures):
            recv.handshake_from = self._timer()
            if recv.spans is not None:
                recv.spans.handshake_waited()

    def _handshake_done(self, recv: _Recv, outcome: str, error: str | None = None) -> None:
        """The request's handshake wait (if it had one) ended: count it and record kv.handshake."""
        if recv.handshake_from is None:
            return
        self.stats.record_handshake_wait(self._timer() - recv.handshake_from, outcome)
        recv.handshake_from = None
        if recv.spans is not None:
            recv.spans.handshake_done(outcome, error, len(recv.futures))

    def _check_done(self, recv: _Recv, outcome: str, error: str | None = None) -> None:
        """The kv_check_read round trip ended: end its kv.lease_check span."""
        if recv.spans is not None:
            recv.spans.check_done(outcome, error)

    def _load_settled(self, recv: _Recv, outcome: str, error: str | None = None) -> None:
        """The load settled (outcome "ok" or a FailureKind value): count it; end its spans, with a
        kv.read per (D rank, P rank) read that settled. Before the reads' handles are released."""
        nbytes = sum(r.nbytes for r in recv.reads.values()) if error is None else None
        self.stats.record_load(self._timer() - recv.created, outcome, nbytes)
        self._end_spans(recv, outcome, error)

    def _end_spans(self, recv: _Recv, outcome: str, error: str | None) -> None:
        self._handshake_done(recv, outcome, error)
        spans, recv.spans = recv.spans, None
        if spans is not None:
            spans.load_settled(recv.reads.values(), outcome, error, self.config.backend)

    # ---- D: the receive state machine -------------------------------------
    def _advance(self, rid: str, recv: _Recv) -> None:
        # A phase that fails the receive removes it from _recvs: then nothing more is done to it.
        try:
            if recv.phase is _Phase.HANDSHAKE and all(f.done() for f in recv.futures):
                self._after_handshake(rid, recv)
            if self._recvs.get(rid) is recv and recv.phase is _Phase.CHECK and recv.futures[0].done():
                self._after_check(rid, recv)
            if self._recvs.get(rid) is recv and recv.phase is _Phase.READ:
                self._settle_reads(rid, recv)
        except Exception as exc:  # never let a transfer failure reach the step loop
            if self._recvs.get(rid) is recv:
                logger.exception("request %s: unexpected error in its KV transfer", rid)
                self._abandon_reads(rid, recv, FailureKind.TRANSFER_POLL, f"unexpected {type(exc).__name__}: {exc}")
            else:
                logger.exception("request %s: error after its transfer had already ended", rid)

    def _after_handshake(self, rid: str, recv: _Recv) -> None:
        for future in recv.futures:
            exc = future.exception()
            if exc is not None:
                kind = exc.kind.value if isinstance(exc, HandshakeError) else "error"
                self.stats.record_handshake(0.0, kind)
                self._handshake_done(recv, kind, str(exc))
                self._fail(rid, recv, FailureKind.HANDSHAKE, f"{kind}: {exc}",
                           p_answered=isinstance(exc, _P_ANSWERED))
                return
        metas: list[HandshakeMetadata] = [f.result() for f in recv.futures]
        s = recv.spec
        p_tp = metas[0].layout.tp_size
        if p_tp > MAX_REMOTE_TP_SIZE:  # a hostile payload must not make D fetch a million payloads
            self.stats.record_handshake(0.0, HandshakeFailureKind.LAYOUT_MISMATCH.value)
            cause = f"the prefill engine announces TP size {p_tp}, more than {MAX_REMOTE_TP_SIZE}"
            self._handshake_done(recv, HandshakeFailureKind.LAYOUT_MISMATCH.value, cause)
            self._fail(rid, recv, FailureKind.HANDSHAKE, f"{HandshakeFailureKind.LAYOUT_MISMATCH.value}: {cause}")
            return
        assert self._handshakes is not None, "a consumer connector receives only after register_ranks"
        if len(metas) < p_tp:  # rank 0 named P's TP size: fetch the other ranks' payloads
            recv.futures += [self._handshakes.ensure(s.remote.engine_id or None, s.remote.host, s.remote.port, r)
                             for r in range(len(metas), p_tp)]
            self._note_handshake_wait(recv)
            return
        try:
            waited = self._timer() - recv.handshake_from if recv.handshake_from is not None else 0.0
            peer = self._peer(s.remote, metas, waited)
        except (HandshakeLayoutMismatch, TPMappingError) as exc:
            self.stats.record_handshake(0.0, HandshakeFailureKind.LAYOUT_MISMATCH.value)
            self._handshake_done(recv, HandshakeFailureKind.LAYOUT_MISMATCH.value, str(exc))
            self._fail(rid, recv, FailureKind.HANDSHAKE, f"{HandshakeFailureKind.LAYOUT_MISMATCH.value}: {exc}",
                       p_answered=True)
            return
        self._handshake_done(recv, "ok")
        recv.peer = peer
        recv.phase = _Phase.CHECK
        recv.asked_at = self._clock()
        watch = self._needs_watch(s, peer)
        traceparent = recv.spans.check_sent(watch) if recv.spans is not None else None
        digest: dict[int, list[tuple[int, int]]] | None = None
        if self.config.kv_verify:
            try:  # the read plan is pure: plan now, so P can digest exactly what D will read (digest.py)
                recv.planned = self._plan_reads(s, peer)
            except (TPMappingError, BlockMappingError) as exc:
                self._fail(rid, recv, FailureKind.TRANSFER_SETUP, str(exc))
                return
            digest = {}
            for (_, remote_rank), (_, r_descs) in recv.planned[1].items():
                digest.setdefault(remote_rank, []).extend(r_descs)
        future = self._executor.submit(self.control.check_read_digests, s.remote.host, s.remote.port, s.remote_request_id,
                                       s.lease_generation, s.remote_block_ids, s.content, watch, traceparent, digest)
        if recv.spans is not None:
            future.add_done_callback(recv.spans.check_answered)
        recv.futures = [future]

    def _needs_watch(self, s: RecvSpec, peer: _Peer) -> bool:
        """Does a read of this request go between a D rank and a P rank that have not completed
        one since D added P's agents? The first read between two agents completes only once P's
        agent has progressed (UCX wire-up): P must step promptly (lease.py)."""
        try:
            pairs = self._plan(s, peer).pairs()
        except TPMappingError:
            return True  # planning fails again after the check, and the request fails with the reason
        return any((peer.key, local, remote) not in self._wired for local, remote in pairs)

    def _peer(self, remote: RemoteEngine, metas: list[HandshakeMetadata], waited_s: float = 0.0) -> _Peer:
        """The peer for P's ranks' payloads; raises HandshakeLayoutMismatch / TPMappingError with
        the reason when D's ranks cannot be filled from P's. `waited_s`: how long the request
        that completes the handshake waited for it (kvbridge_kv_handshake_duration_seconds)."""
        blobs = tuple(m.agent_metadata for m in metas)
        peer = self._peers.get(remote)
        if peer is not None and peer.agent_metadata == blobs:
            return peer
        if peer is not None:  # the peer restarted: its old agents are gone
            self._drop_peer(remote)
        if len({m.engine_id for m in metas}) != 1 or len({m.layout.tp_size for m in metas}) != 1:
            raise HandshakeLayoutMismatch("the prefill engine's ranks disagree on its engine id or TP size "
                                          "(it restarted during the handshake?)")
        ranks = tuple(rank_blocks(m.layout) for m in metas)
        check_pairing([r.kv for r in self._local], [r.kv for r in ranks])
        incarnation = incarnation_of(blobs[0])
        ratios = {m.layout.physical_blocks_per_logical for m in metas}
        if len(ratios) != 1:
            raise HandshakeLayoutMismatch(f"the prefill engine's ranks disagree on kernel blocks per logical block "
                                          f"({sorted(ratios)})")
        peer = self._peers[remote] = _Peer(f"{metas[0].engine_id}@{remote.host}:{remote.port}#{incarnation[:12]}",
                                           ranks, blobs, incarnation, ratios.pop(),
                                           tuple((m.layout.memory, m.layout.device_id) for m in metas))
        self.stats.record_handshake(waited_s, None)
        logger.info("connected to prefill engine %s at %s:%s (TP %d -> TP %d here)", remote.engine_id,
                    remote.host, remote.port, len(ranks), len(self._local))
        return peer

    def _drop_peer(self, remote: RemoteEngine) -> None:
        peer = self._peers.pop(remote, None)
        if self._handshakes is not None:
            self._handshakes.forget(remote.engine_id)
        if peer is not None:  # every rank removes its agents for the peer's ranks
            self._wired = {w for w in self._wired if w[0] != peer.key}
            for commands in self._commands:
                commands.drop_peers += [peer.rank_key(r) for r in range(len(peer.ranks))]

    def _after_check(self, rid: str, recv: _Recv) -> None:
        future = recv.futures[0]
        exc = future.exception()
        if exc is not None:
            kind = getattr(exc, "kind", None)
            if kind is HandshakeFailureKind.PEER_ERROR:
                # P refused: a content mismatch (P freed those blocks) or a stale/foreign lease.
                refused = FailureKind.CONTENT_MISMATCH if CONTENT_MISMATCH in str(exc) else FailureKind.STALE_LEASE
                self._check_done(recv, refused.value, str(exc))
                self._fail(rid, recv, refused, str(exc))
            else:
                self._drop_peer(recv.spec.remote)
                self._check_done(recv, FailureKind.PEER_DEATH.value, str(exc))
                self._fail(rid, recv, FailureKind.PEER_DEATH, str(exc))
            return
        s = recv.spec
        peer = recv.peer
        assert peer is not None
        incarnation, digests = future.result()
        if incarnation != peer.incarnation:
            # P restarted under the same address: its old agents are gone. Handshake afresh, once.
            self._check_done(recv, "restarted", "the prefill engine answered as another incarnation")
            self._drop_peer(s.remote)
            if recv.rehandshaken:
                self._fail(rid, recv, FailureKind.HANDSHAKE, "the prefill engine restarted during the handshake")
                return
            recv.rehandshaken = True
            recv.phase = _Phase.HANDSHAKE
            assert self._handshakes is not None  # it asked P's ranks before
            recv.futures = [self._handshakes.ensure(s.remote.engine_id or None, s.remote.host, s.remote.port, 0)]
            self._note_handshake_wait(recv)
            return
        self._check_done(recv, "granted")
        late = self._clock() - recv.asked_at
        if late > self.config.transfer_timeout_s:
            # P holds a granted read's blocks for two read timeouts from the grant (lease.py): a
            # read started this late could outlive that and copy blocks P gave to another prompt.
            self._fail(rid, recv, FailureKind.TRANSFER_TIMEOUT, f"P granted the read {late:.1f}s ago, more than "
                       f"the read timeout ({self.config.transfer_timeout_s}s); not starting it")
            return
        try:
            plan, descs = recv.planned if recv.planned is not None else self._plan_reads(s, peer)
        except (TPMappingError, BlockMappingError) as exc:
            self._fail(rid, recv, FailureKind.TRANSFER_SETUP, str(exc))
            return
        try:
            expected = _expected_digests(descs, digests) if digests is not None else None
        except HandshakeDecodeError as exc:
            self._fail(rid, recv, FailureKind.TRANSFER_SETUP, str(exc))
            return
        if expected is not None:
            self.stats.incr("unverified_reads", sum(1 for e in expected.values() if e is None))
        recv.phase = _Phase.READ
        recv.plan = plan
        recv.started = self._timer()
        for (local_rank, remote_rank), (l_descs, r_descs) in descs.items():
            xfer_id = f"x{next(self._xfer_ids)}"
            self._commands[local_rank].reads.append(ReadOp(
                xfer_id, peer.rank_key(remote_rank), peer.agent_metadata[remote_rank], tuple(l_descs), tuple(r_descs),
                peer.memory[remote_rank], traced=recv.spans is not None,
                expected=expected.get((local_rank, remote_rank)) if expected is not None else None))
            recv.reads[xfer_id] = _SubRead(local_rank, remote_rank, sum(n for _, n in l_descs), len(l_descs))
            self._xfers[xfer_id] = rid
        self._settle_reads(rid, recv)  # a notification-only request has no reads: settled now

    def _plan_reads(self, s: RecvSpec, peer: _Peer) -> tuple[ReadPlan, Descs]:
        """The request's plan, and {(D rank, P rank): (local descs, remote descs)} of its
        reads over every group's blocks (request_reads.py: the only place reads come from)."""
        plan = self._plan(s, peer)
        descs = request_descs(self.groups, plan, self._local, peer.ranks,
                              local_ratio=self.ranks[0].layout.physical_blocks_per_logical,
                              remote_ratio=peer.blocks_per_logical, local_ids=s.local_block_ids,
                              remote_ids=s.remote_block_ids, salt=request_salt(s.remote_request_id))
        return plan, descs

    def _plan(self, s: RecvSpec, peer: _Peer) -> ReadPlan:
        """Which D rank reads what from which P rank for this request (pure: the same before P's
        check_read answer, to know whether to ask P to watch, as after it). Raises TPMappingError."""
        return plan_request_reads([r.kv for r in self._local], [r.kv for r in peer.ranks],
                                  request_salt(s.remote_request_id), s.remote_request_id, s.lease_generation)

    def _settle_reads(self, rid: str, recv: _Recv) -> None:
        """Once every read of the request has settled (never before), release their
        handles and finish the request: read-done to P, or the first failure."""
        reads = recv.reads.values()
        if any(r.result is None for r in reads):
            return
        if recv.abandoned is not None:  # a bug struck while reads were in flight: some may never have started
            self._fail(rid, recv, *recv.abandoned)
            return
        failed = [(r, r.result.kind, r.result.cause) for r in reads if r.result is not None and r.result.kind is not None]
        if failed:
            first, kind, cause = failed[0]
            if kind is FailureKind.HANDSHAKE:  # a rank could not add P's agent
                self.stats.record_handshake(0.0, "add_remote_agent")
            if kind in (FailureKind.HANDSHAKE, FailureKind.TRANSFER_TIMEOUT):
                self._drop_peer(recv.spec.remote)  # a timed-out rank removed P's agent: P may be gone
            self._fail(rid, recv, kind, f"{cause} (D rank {first.local_rank} from P rank {first.remote_rank}; "
                                        f"{len(failed)} of {len(recv.reads)} reads failed)")
            return
        self.stats.record_transfer(self._timer() - recv.started, sum(r.nbytes for r in reads),
                                   sum(r.ndescs for r in reads))
        if recv.peer is not None and self._peers.get(recv.spec.remote) is recv.peer:
            self._wired.update((recv.peer.key, r.local_rank, r.remote_rank) for r in reads)
        self._load_settled(recv, "ok")
        self._release_handles(recv)
        del self._recvs[rid]
        self._done_recv.add(rid)
        self._notify(recv, "read-done", self.control.read_done)

    def _notify(self, recv: _Recv, what: str, send: Callable[[str, int, str, int], None]) -> None:
        """Send P the request's notice (P's request id and generation: it frees every P rank's
        copy, read or not) as a read-done or a release."""
        notice = recv.notice()
        self._side_request(what, send, recv.spec.remote.host, recv.spec.remote.port, notice.request_id,
                           notice.generation, trace=recv.spec.trace)

    def _abandon_reads(self, rid: str, recv: _Recv, kind: FailureKind, cause: str) -> None:
        """A bug in this half: reads may still be in flight, so the request's blocks are kept
        out of use by failing it only when they settle; reads not yet reported are marked
        failed now only if none was ever handed to a rank."""
        if recv.phase is _Phase.READ and recv.reads:
            for read in recv.reads.values():
                if read.result is None:
                    recv.abandoned = (kind, cause)
                    return  # the ranks' reports settle it; _settle_reads fails it then
        self._fail(rid, recv, kind, cause)

    def _fail(self, rid: str, recv: _Recv, kind: FailureKind, cause: str, p_answered: bool = False) -> None:
        """`p_answered`: P's side channel answered and named itself (a handshake D refused for its
        layout): P may free now too."""
        self._load_settled(recv, kind.value, cause)
        self._release_handles(recv)
        self._recvs.pop(rid, None)
        self.failures.handle(rid, kind, cause, recv.spec.local_block_ids, recv.spec.remote.engine_id)
        if kind is FailureKind.KV_CONTENT_MISMATCH:  # P's lease ends as a content mismatch
            self._notify(recv, "release", self.control.release_mismatch)
        elif kind in _RELEASE_AFTER or recv.phase is _Phase.READ or p_answered:
            # P granted the read on its side channel: let every P rank free now, not at lease expiry.
            self._notify(recv, "release", self.control.release)

    def _release_handles(self, recv: _Recv) -> None:
        for xfer_id, read in recv.reads.items():
            self._xfers.pop(xfer_id, None)
            self._commands[read.local_rank].release.append(xfer_id)
        recv.reads = {}

    def _reap_side_requests(self) -> None:
        pending = []
        for what, fut in self._side_requests:
            if not fut.done():
                pending.append((what, fut))
            elif fut.cancelled():  # never sent: the receiver shut down first
                self.stats.incr("failed_notifications")
            elif fut.exception() is not None:
                self.stats.incr("failed_notifications")
                logger.warning("kv %s notification failed: %s", what, fut.exception())
        self._side_requests = pending
