"""The connector's worker half: registers the KV cache, moves blocks, reports results.

D, per request to receive, a small state machine advanced once per step without
blocking the engine thread:
  HANDSHAKE  the (deduplicated, background) handshake with P's engine
  CHECK      P confirms on its side channel that the lease is live and grants the blocks
  READ       a one-sided backend READ without a backend notification; when it is DONE,
             D sends P kv_read_done on P's side channel (control.py says why)
Any failure on the way goes through the one FailureHandler and the request is reported
in finished_recving + failed_recving with its blocks invalid; it never raises.
P: grants leases for finished requests, frees on read-done / release / expiry.
"""

from __future__ import annotations

import enum
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from kvbridge.config import KVRole, KVTransferConfig
from kvbridge.kv_transfer.backends.base import MemoryRegion, TransferBackend, TransferState
from kvbridge.kv_transfer.connector.base import KVConnectorOutput, WorkerConnector
from kvbridge.kv_transfer.connector.metadata import ConnectorMetadata, RecvSpec, RemoteEngine
from kvbridge.kv_transfer.control import ControlClient, ControlServer, incarnation_of
from kvbridge.kv_transfer.failure import FailureHandler, FailureKind
from kvbridge.kv_transfer.handshake import (CompatibilityInfo, HandshakeError, HandshakeFailureKind,
                                            HandshakeLayoutMismatch, HandshakeMetadata, RankLayout,
                                            encode_payload)
from kvbridge.kv_transfer.handshake_manager import HandshakeManager
from kvbridge.kv_transfer.lease import CONTENT_MISMATCH, LeaseTable
from kvbridge.kv_transfer.side_channel import HandshakeClient, SideChannelServer
from kvbridge.kv_transfer.stats import KVTransferStats
from kvbridge.kv_transfer.topology import PlaneLayout, read_descriptors

logger = logging.getLogger("kvbridge.kv_transfer")

KV_LAYOUT = "block-major"  # [blocks, layers, 2, block_size, kv_heads, head_dim]: see topology.py
# Failures after which D tells P to release: the read failed, but P's side channel answered.
_RELEASE_AFTER = frozenset({FailureKind.TRANSFER_SETUP, FailureKind.TRANSFER_STATE, FailureKind.TRANSFER_POLL})


class _Phase(enum.Enum):
    HANDSHAKE = "handshake"
    CHECK = "check"
    READ = "read"


@dataclass
class _Recv:
    spec: RecvSpec
    phase: _Phase
    future: Future | None
    started: float = field(default_factory=time.perf_counter)
    agent: str | None = None
    remote_layout: PlaneLayout | None = None
    handle: object | None = None
    incarnation: str = ""
    rehandshaken: bool = False
    nbytes: int = 0
    ndescs: int = 0


@dataclass(frozen=True)
class _Peer:
    agent: str
    layout: PlaneLayout
    agent_metadata: bytes
    incarnation: str


class KVBridgeWorkerConnector(WorkerConnector):
    def __init__(self, config: KVTransferConfig, engine_id: str, backend: TransferBackend,
                 compat: CompatibilityInfo, leases: LeaseTable, failures: FailureHandler, stats: KVTransferStats,
                 side_channel: SideChannelServer | None, prefix_caching: bool) -> None:
        self.config = config
        self.engine_id = engine_id
        self.backend = backend
        self.compat = compat
        self.leases = leases
        self.failures = failures
        self.stats = stats
        self.side_channel = side_channel
        self.prefix_caching = prefix_caching
        self.control_server = ControlServer(side_channel, leases, stats) if side_channel is not None else None
        # One client for handshakes and control messages: it signs requests when P and D share a key.
        self._side_client = HandshakeClient(key=config.side_channel_key)
        self.control = ControlClient(config.handshake_timeout_s, self._side_client)
        self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvbridge-control")
        self._handshakes: HandshakeManager | None = None
        self.layout: PlaneLayout | None = None
        self._device, self._device_id = "cpu", 0
        self._peers: dict[RemoteEngine, _Peer] = {}
        self._recvs: dict[str, _Recv] = {}
        self._done_recv: set[str] = set()
        self._side_requests: list[tuple[str, Future]] = []  # (what, future) of releases and heartbeats
        self._closed = False
        self._last_backend_error_log = float("-inf")

    @property
    def is_consumer(self) -> bool:
        return self.config.role in (KVRole.CONSUMER, KVRole.BOTH)

    # ---- registration ------------------------------------------------------
    def register_kv_cache(self, kv_cache, block_size: int) -> None:
        self.layout = PlaneLayout.of_kv_cache(kv_cache)
        self._device = "cuda" if kv_cache.is_cuda else "cpu"
        self._device_id = kv_cache.device.index or 0
        self.backend.register_memory([MemoryRegion(
            kv_cache.data_ptr(), kv_cache.numel() * kv_cache.element_size(), self._device, self._device_id)])
        planes = len(self.layout.plane_base_addrs)
        rank_layout = RankLayout(
            tp_size=1, tp_rank=0, region_base_addrs=self.layout.plane_base_addrs,
            block_len_bytes=(self.layout.block_bytes,) * planes, num_blocks=self.layout.num_blocks,
            block_size=block_size, kv_layout=KV_LAYOUT)
        if self.side_channel is not None:
            meta = HandshakeMetadata(self.engine_id, self.config.backend, self.backend.agent_metadata(), rank_layout)
            self.control_server.incarnation = incarnation_of(meta.agent_metadata)
            self.side_channel.set_payload(0, encode_payload(meta, self.compat.hash()))
        if self.is_consumer:
            self._handshakes = HandshakeManager(
                self.compat.hash(), rank_layout, prefix_caching=self.prefix_caching,
                client=self._side_client, timeout_s=self.config.handshake_timeout_s,
                validate=self._validate_peer)

    def _validate_peer(self, meta: HandshakeMetadata) -> None:
        if meta.backend != self.config.backend:
            raise HandshakeLayoutMismatch(
                f"peer uses transfer backend {meta.backend!r}, this engine {self.config.backend!r}")
        assert self.layout is not None
        if meta.layout.block_len_bytes[0] != self.layout.block_bytes:
            raise HandshakeLayoutMismatch(
                f"peer block length {meta.layout.block_len_bytes[0]} B, local {self.layout.block_bytes} B")

    # ---- per step ----------------------------------------------------------
    def start_load_kv(self, metadata: ConnectorMetadata | None) -> None:
        if metadata is None:
            return
        for r in metadata.reqs_to_recv:
            self._start_recv(r)
        for rel in metadata.reqs_to_release:
            self._side_request("release", self.control.release, rel.remote.host, rel.remote.port,
                               rel.remote_request_id, rel.lease_generation)
        for remote, items in metadata.heartbeats.items():
            self._side_request("heartbeat", self.control.heartbeat, remote.host, remote.port, items)

    def _start_recv(self, spec: RecvSpec) -> None:
        assert self._handshakes is not None, "a consumer connector receives only after register_kv_cache"
        r = spec.remote
        future = self._handshakes.ensure(r.engine_id or None, r.host, r.port, 0)
        self._recvs[spec.request_id] = _Recv(spec, _Phase.HANDSHAKE, future)

    def _side_request(self, what: str, fn, *args) -> None:
        try:
            self._side_requests.append((what, self._executor.submit(fn, *args)))
        except RuntimeError:  # executor shut down
            self.stats.incr("failed_notifications")

    def get_finished(self) -> KVConnectorOutput:
        out = KVConnectorOutput()
        for rid, recv in list(self._recvs.items()):
            self._advance(rid, recv)
        out.finished_recving |= self._done_recv
        self._done_recv = set()
        for failure in self.failures.drain():
            out.finished_recving.add(failure.request_id)
            out.failed_recving.add(failure.request_id)
            out.invalid_block_ids |= failure.invalid_block_ids
            out.failure_causes[failure.request_id] = f"KV transfer failed ({failure.kind.value}): {failure.cause}"
        self._reap_side_requests()
        self._collect_sending(out)
        return out

    # ---- D: the receive state machine -------------------------------------
    def _advance(self, rid: str, recv: _Recv) -> None:
        # A phase that fails the receive removes it from _recvs: then nothing more is done to it.
        try:
            if recv.phase is _Phase.HANDSHAKE and recv.future.done():
                self._after_handshake(rid, recv)
            if self._recvs.get(rid) is recv and recv.phase is _Phase.CHECK and recv.future.done():
                self._after_check(rid, recv)
            if self._recvs.get(rid) is recv and recv.phase is _Phase.READ:
                self._poll_read(rid, recv)
        except Exception as exc:  # never let a transfer failure reach the step loop
            if self._recvs.get(rid) is recv:
                self._fail(rid, recv, FailureKind.TRANSFER_POLL, f"unexpected {type(exc).__name__}: {exc}")
            else:
                logger.exception("request %s: error after its transfer had already ended", rid)

    def _after_handshake(self, rid: str, recv: _Recv) -> None:
        exc = recv.future.exception()
        if exc is not None:
            kind = exc.kind.value if isinstance(exc, HandshakeError) else "error"
            self.stats.record_handshake(0.0, kind)
            self._fail(rid, recv, FailureKind.HANDSHAKE, f"{kind}: {exc}")
            return
        try:
            peer = self._peer(recv.spec.remote, recv.future.result())
        except Exception as exc:  # the backend refused the peer's agent metadata
            self.stats.record_handshake(0.0, "add_remote_agent")
            self._fail(rid, recv, FailureKind.HANDSHAKE, f"adding the peer's transfer agent failed: {exc}")
            return
        recv.agent, recv.remote_layout, recv.incarnation = peer.agent, peer.layout, peer.incarnation
        s = recv.spec
        recv.phase = _Phase.CHECK
        recv.future = self._executor.submit(self.control.check_read, s.remote.host, s.remote.port,
                                            s.remote_request_id, s.lease_generation, s.remote_block_ids,
                                            s.content)

    def _peer(self, remote: RemoteEngine, meta: HandshakeMetadata) -> _Peer:
        peer = self._peers.get(remote)
        if peer is not None and peer.agent_metadata == meta.agent_metadata:
            return peer
        if peer is not None:  # the peer restarted: its old agent is gone
            self._drop_peer(remote)
        t0 = time.perf_counter()
        agent = self.backend.add_remote_agent(meta.agent_metadata)
        layout = PlaneLayout(meta.layout.region_base_addrs, meta.layout.block_len_bytes[0], meta.layout.num_blocks)
        peer = self._peers[remote] = _Peer(agent, layout, meta.agent_metadata, incarnation_of(meta.agent_metadata))
        self.stats.record_handshake(time.perf_counter() - t0, None)
        logger.info("connected to prefill engine %s at %s:%s (agent %s)", remote.engine_id, remote.host,
                    remote.port, agent)
        return peer

    def _drop_peer(self, remote: RemoteEngine) -> None:
        peer = self._peers.pop(remote, None)
        if self._handshakes is not None:
            self._handshakes.forget(remote.engine_id)
        if peer is not None:
            try:
                self.backend.remove_remote_agent(peer.agent)
            except Exception:  # the agent may already be unusable; nothing else holds it
                logger.debug("removing agent %s failed", peer.agent, exc_info=True)

    def _after_check(self, rid: str, recv: _Recv) -> None:
        exc = recv.future.exception()
        if exc is not None:
            kind = getattr(exc, "kind", None)
            if kind is HandshakeFailureKind.PEER_ERROR:
                # P refused: a content mismatch (P freed those blocks) or a stale/foreign lease.
                refused = FailureKind.CONTENT_MISMATCH if CONTENT_MISMATCH in str(exc) else FailureKind.STALE_LEASE
                self._fail(rid, recv, refused, str(exc))
            else:
                self._drop_peer(recv.spec.remote)
                self._fail(rid, recv, FailureKind.PEER_DEATH, str(exc))
            return
        s = recv.spec
        if recv.future.result() != recv.incarnation:
            # P restarted under the same address: its old agent is gone. Handshake afresh, once.
            self._drop_peer(s.remote)
            if recv.rehandshaken:
                self._fail(rid, recv, FailureKind.HANDSHAKE, "the prefill engine restarted during the handshake")
                return
            recv.rehandshaken = True
            recv.phase = _Phase.HANDSHAKE
            recv.future = self._handshakes.ensure(s.remote.engine_id or None, s.remote.host, s.remote.port, 0)
            return
        assert self.layout is not None and recv.remote_layout is not None
        local, remote = [], []
        for l_ids, r_ids in zip(s.local_block_ids, s.remote_block_ids):
            ld, rd = read_descriptors(self.layout, recv.remote_layout, l_ids, r_ids)
            local += ld
            remote += rd
        recv.phase = _Phase.READ
        recv.started = time.perf_counter()
        recv.nbytes, recv.ndescs = sum(n for _, n in local), len(local)
        try:
            recv.handle = self.backend.read(
                recv.agent, self.backend.prep_descs(local, self._device, self._device_id),
                self.backend.prep_descs(remote, self._device, self._device_id), b"")
        except Exception as exc:
            self._fail(rid, recv, FailureKind.TRANSFER_SETUP, f"{type(exc).__name__}: {exc}")

    def _poll_read(self, rid: str, recv: _Recv) -> None:
        try:
            state = self.backend.check_state(recv.handle)
        except Exception as exc:
            self._fail(rid, recv, FailureKind.TRANSFER_POLL, f"{type(exc).__name__}: {exc}")
            return
        if state is TransferState.DONE:
            self.stats.record_transfer(time.perf_counter() - recv.started, recv.nbytes, recv.ndescs)
            self._release_handle(recv)
            del self._recvs[rid]
            self._done_recv.add(rid)
            s = recv.spec
            self._side_request("read-done", self.control.read_done, s.remote.host, s.remote.port,
                               s.remote_request_id, s.lease_generation)
        elif state is TransferState.ERROR:
            self._fail(rid, recv, FailureKind.TRANSFER_STATE, "the transfer backend reported the read failed")

    def _fail(self, rid: str, recv: _Recv, kind: FailureKind, cause: str) -> None:
        self._release_handle(recv)
        self._recvs.pop(rid, None)
        self.failures.handle(rid, kind, cause, recv.spec.local_block_ids, recv.spec.remote.engine_id)
        if kind in _RELEASE_AFTER:  # P is known and reachable: let it free now, not at lease expiry
            s = recv.spec
            self._side_request("release", self.control.release, s.remote.host, s.remote.port,
                               s.remote_request_id, s.lease_generation)

    def _release_handle(self, recv: _Recv) -> None:
        if recv.handle is not None:
            handle, recv.handle = recv.handle, None
            try:
                self.backend.release(handle)
            except Exception:
                logger.debug("releasing a transfer handle failed", exc_info=True)

    def _reap_side_requests(self) -> None:
        pending = []
        for what, fut in self._side_requests:
            if not fut.done():
                pending.append((what, fut))
            elif fut.exception() is not None:
                self.stats.incr("failed_notifications")
                logger.warning("kv %s notification failed: %s", what, fut.exception())
        self._side_requests = pending

    # ---- P: freeing blocks held for remote readers ---------------------------
    def _collect_sending(self, out: KVConnectorOutput) -> None:
        if self.control_server is None:
            return
        try:  # drives the agent's progress (a first read's wire-up needs it); D sends no notifications
            self.backend.get_new_notifs()
        except Exception as exc:  # a broken agent must not stop the engine; leases still expire
            self._log_backend_error("get_new_notifs", exc)
        out.finished_sending.update(self.control_server.drain_released())
        for rid in self.leases.pop_expired():
            self.stats.incr("expired_leases")
            logger.warning("lease expired: request_id=%s engine=%s; freeing its KV blocks unread", rid,
                           self.engine_id)
            out.finished_sending.add(rid)

    def release_local(self, request_id: str, generation: int) -> bool:
        """P: free a request's held blocks now (e.g. the proxy could not reach any D).
        Thread-safe; False if no such lease is held."""
        if self.control_server is None or not self.leases.release(request_id, generation):
            return False
        self.stats.incr("early_releases")
        self.control_server.queue_released(request_id)
        return True

    def _log_backend_error(self, what: str, exc: Exception) -> None:
        now = time.monotonic()
        if now - self._last_backend_error_log >= 10.0:  # rate-limited: it repeats every step
            self._last_backend_error_log = now
            logger.error("transfer backend %s failed on engine %s: %s", what, self.engine_id, exc)

    def has_transfers_in_flight(self) -> bool:
        """D: loads under way. P: a read of its leased blocks granted and not yet done (the read
        completes only after P's agent progresses, so P must keep polling promptly)."""
        return bool(self._recvs) or (self.control_server is not None and self.leases.reads_in_flight())

    def set_wakeup(self, wake: Callable[[], None]) -> None:
        """P: call ``wake`` (from the side-channel thread) when a read of leased blocks is granted,
        so that an engine loop sleeping between idle steps polls again at once."""
        if self.control_server is not None:
            self.control_server.on_read_granted = wake

    def has_work(self) -> bool:
        return bool(self._recvs or self._side_requests or len(self.leases))

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        for rid, recv in list(self._recvs.items()):
            self._release_handle(recv)
        self._recvs.clear()
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self._handshakes is not None:
            self._handshakes.close()
        if self.side_channel is not None:
            self.side_channel.close()
        self.backend.shutdown()
