"""The data plane of one rank: its transfer agent, its registered KV shard, its reads.

Every rank of an engine (the engine process itself at TP 1, each rank process at TP N)
owns one `RankAgent`, which owns one transfer backend (NIXL agent / tcp endpoint). It
knows nothing of requests, leases or handshakes: those live with the control plane
(`worker_side.KVBridgeWorkerConnector`) in the engine process. Once per engine step the
control plane's `RankCommands` for this rank travel to it inside the scheduler output
(the step's one broadcast at TP N), and its `RankReport` travels back with the step's
result (the one gather):

    apply(commands)  before the forward: start reads, release settled ones, drop peers
    poll()           after the forward: the reads that settled (DONE or ERROR) since the
                     last poll, each reported once; the agent keeps a settled read's handle
                     until the control plane releases it, which it does only when every
                     read of the request has settled

A read still in progress `read_timeout_s` after it started is abandoned: the agent of its peer
is removed first (that closes the transport's endpoint, so the read can write nothing more into
this rank's blocks, even once a cut link comes back; measured with NIXL/UCX over tcp), then the
read settles as TRANSFER_TIMEOUT. Other reads from that peer then fail too, and the next read
adds the peer's agent afresh.

A read of a traced request (`ReadOp.traced`) notes its wall-clock start and settle times, which
ride back in its ReadResult (the rank has no tracer: the control plane records the ``kv.read``
span); an untraced read notes nothing more.

A rank whose KV others read (P) also drives its agent's progress in `poll()`
(`get_new_notifs`): without a progress thread NIXL advances a read only inside the
target's calls. Failures are data (`ReadResult` with a FailureKind); nothing raises into
the step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvbridge.kv_transfer.backends.base import MemoryRegion, TransferBackend, TransferState, XferHandle
from kvbridge.kv_transfer.digest import digest_span
from kvbridge.kv_transfer.failure import FailureKind
from kvbridge.kv_transfer.side_channel.handshake import RankLayout

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("kvbridge.kv_transfer")

# Every rank's KV cache is [blocks, kv_heads, layers, 2 (K, V), block_size, head_dim]: a block is
# one contiguous span and so is each head's share of it (read_plan/tp_mapping.py, docs/internals.md).
KV_LAYOUT = "blocks,heads,layers,kv,tokens,dim"

Desc = tuple[int, int]


@dataclass(frozen=True)
class ReadOp:
    """Read `remote` descs of the peer agent `peer` into this rank's `local` descs."""

    xfer_id: str
    peer: str  # the peer rank's key: one agent per (engine incarnation, remote rank)
    agent_metadata: bytes  # the peer's agent blob: added on first use, replaced when it changes
    local: tuple[Desc, ...]
    remote: tuple[Desc, ...]
    remote_memory: tuple[str, int] = ("cpu", 0)  # where the peer rank registered them (RankLayout)
    traced: bool = False  # the request is traced: note the read's start and settle times (time.time_ns)
    # P's digest of each remote desc (digest.py): the read is DONE only if the local descs match;
    # None: not verified
    expected: tuple[int, ...] | None = None


@dataclass
class RankCommands:
    reads: list[ReadOp] = field(default_factory=list)
    release: list[str] = field(default_factory=list)  # xfer ids whose handles to release
    drop_peers: list[str] = field(default_factory=list)  # peer keys whose agents to remove

    def __bool__(self) -> bool:
        return bool(self.reads or self.release or self.drop_peers)


def reads_start_together(step_commands: Sequence[RankCommands | None]) -> bool:
    """Do two or more ranks start reads in this step (every rank's commands, rank order)? Then the
    ranks wait for each other before starting them (a barrier, `ModelRunner.sync_ranks`): the
    request settles only when its last read does, and on a busy host a rank that is woken late
    for the step would otherwise start its read only after another rank's copy (how much later:
    benchmarks/README.md, pd_transfer). Every rank sees
    the same commands, so all of them take the same branch."""
    return sum(1 for c in step_commands if c is not None and c.reads) >= 2


@dataclass(frozen=True)
class ReadResult:
    xfer_id: str
    kind: FailureKind | None  # None: DONE
    cause: str = ""
    started_ns: int | None = None  # a traced read: when this rank started it (wall clock)
    settled_ns: int | None = None  # a traced read: when this rank saw it settle

    @property
    def ok(self) -> bool:
        return self.kind is None


@dataclass
class RankReport:
    tp_rank: int
    settled: list[ReadResult] = field(default_factory=list)
    backend_error: str | None = None  # the agent's progress call failed (the control plane logs it)


@dataclass(frozen=True)
class RankRegistration:
    """What a rank tells the control plane at start-up: its agent blob and where its KV is."""

    agent_metadata: bytes
    layout: RankLayout


@dataclass(frozen=True)
class RankSetup:
    """How an engine's ranks get their transfer agents (WorkerConnector.rank_setup). At TP 1 the
    engine process's rank uses `local_agent`; at TP N `local_agent` is None and each rank process
    creates one: a `backend` agent named `agent_name(rank)`, serving reads when `serves_reads`."""

    engine_id: str
    backend: str  # the transfer backend's name (nixl, tcp, fake)
    serves_reads: bool  # P: others read this engine's KV
    local_agent: RankAgent | None = None

    def agent_name(self, tp_rank: int) -> str:
        return f"{self.engine_id}-tp{tp_rank}"


class RankAgent:
    """One rank's transfer agent and reads. Called on the thread that steps this rank."""

    def __init__(self, backend: TransferBackend, serves_reads: bool, read_timeout_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`read_timeout_s`: how long a read may stay in progress (None: forever)."""
        self.backend = backend
        self.read_timeout_s, self._clock = read_timeout_s, clock
        self._started: dict[str, tuple[float, str]] = {}  # live xfer id -> (start time, peer key)
        self._started_ns: dict[str, int] = {}  # live xfer id of a traced read -> wall-clock start
        self.serves_reads = serves_reads  # P: others read this rank's KV; drive the agent's progress
        self.registration: RankRegistration | None = None
        self._device, self._device_id = "cpu", 0
        self._peers: dict[str, tuple[bytes, str]] = {}  # peer key -> (agent metadata, agent name)
        self._reads: dict[str, XferHandle | None] = {}  # live xfer id -> handle (None: never started)
        self._settled: list[ReadResult] = []  # settled since the last poll
        self._reported: set[str] = set()  # live xfer ids already settled (polled no more)
        self._expected: dict[str, tuple[tuple[Desc, ...], tuple[int, ...]]] = {}  # xfer id -> (local, digests)
        self._closed = False

    def register(self, kv_cache: torch.Tensor, block_size: int, tp_rank: int, tp_size: int, kv_heads: range,
                 blocks_per_logical: int = 1) -> RankRegistration:
        """Register this rank's KV cache ([kernel blocks, its kv heads, ...], contiguous; a logical
        block is `blocks_per_logical` consecutive kernel blocks of `block_size` tokens) with the agent."""
        if not kv_cache.is_contiguous():
            raise ValueError("the KV cache must be contiguous")
        self._device = "cuda" if kv_cache.is_cuda else "cpu"
        self._device_id = kv_cache.device.index or 0
        nbytes = kv_cache.numel() * kv_cache.element_size()
        self.backend.register_memory([MemoryRegion(kv_cache.data_ptr(), nbytes, self._device, self._device_id)])
        layout = RankLayout(
            tp_size=tp_size, tp_rank=tp_rank, region_base_addrs=(kv_cache.data_ptr(),),
            block_len_bytes=(nbytes // kv_cache.shape[0],), num_blocks=kv_cache.shape[0], block_size=block_size,
            kv_layout=KV_LAYOUT, kv_head_start=kv_heads.start, num_kv_heads=len(kv_heads),
            physical_blocks_per_logical=blocks_per_logical, memory=self._device, device_id=self._device_id)
        self.registration = RankRegistration(self.backend.agent_metadata(), layout)
        return self.registration

    def apply(self, commands: RankCommands | None) -> None:
        if commands is None:
            return
        for xfer_id in commands.release:
            self._release(xfer_id)
        for peer in commands.drop_peers:
            self._drop_peer(peer)
        for op in commands.reads:
            self._start(op)

    def poll(self) -> RankReport:
        report = RankReport(self.registration.layout.tp_rank if self.registration else 0)
        for xfer_id, handle in self._reads.items():
            if handle is None or xfer_id in self._reported:
                continue
            try:
                state = self.backend.check_state(handle)
            except Exception as exc:
                self._reported.add(xfer_id)
                self._settle(xfer_id, FailureKind.TRANSFER_POLL, f"{type(exc).__name__}: {exc}")
                continue
            if state is TransferState.DONE:
                self._reported.add(xfer_id)
                self._settle(xfer_id, *self._verify(xfer_id))
            elif state is TransferState.IN_PROGRESS and self._timed_out(xfer_id):
                started, peer = self._started[xfer_id]
                self._drop_peer(peer)  # before the handle is released: no byte may land later
                self._reported.add(xfer_id)
                self._settle(xfer_id, FailureKind.TRANSFER_TIMEOUT,
                             f"the read was still in progress after {self._clock() - started:.1f}s "
                             f"(limit {self.read_timeout_s}s)")
            elif state is TransferState.ERROR:
                self._reported.add(xfer_id)
                self._settle(xfer_id, FailureKind.TRANSFER_STATE, "the transfer backend reported the read failed")
        if self.serves_reads:
            try:
                self.backend.get_new_notifs()
            except Exception as exc:  # a broken agent must not stop the engine; leases still expire
                report.backend_error = f"get_new_notifs: {type(exc).__name__}: {exc}"
        report.settled, self._settled = self._settled, []
        return report

    def _settle(self, xfer_id: str, kind: FailureKind | None, cause: str = "") -> None:
        """The read settled (None: DONE); a traced one carries its start and settle times."""
        started_ns = self._started_ns.get(xfer_id)
        if started_ns is None:
            self._settled.append(ReadResult(xfer_id, kind, cause))
        else:
            self._settled.append(ReadResult(xfer_id, kind, cause, started_ns, time.time_ns()))

    def _verify(self, xfer_id: str) -> tuple[FailureKind | None, str]:
        """A DONE read against P's digests of what it read (digest.py), in this rank's memory
        before anything uses it: (None, "") when they match or nothing is to be verified."""
        check = self._expected.pop(xfer_id, None)
        if check is None:
            return None, ""
        local, expected = check
        for i, ((addr, length), want) in enumerate(zip(local, expected)):
            if digest_span(addr, length) != want:
                return FailureKind.KV_CONTENT_MISMATCH, (f"descriptor {i} of {len(local)} ({length} bytes) does not "
                                                         "match the prefill engine's digest")
        return None, ""

    def _timed_out(self, xfer_id: str) -> bool:
        started = self._started.get(xfer_id)
        return self.read_timeout_s is not None and started is not None and \
            self._clock() - started[0] > self.read_timeout_s

    @property
    def num_live_reads(self) -> int:
        return len(self._reads)

    def shutdown(self) -> None:
        """Release every handle and the backend. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for xfer_id in list(self._reads):
            self._release(xfer_id)
        self.backend.shutdown()

    # ---- internals ------------------------------------------------------------------
    def _start(self, op: ReadOp) -> None:
        if op.xfer_id in self._reads:
            self._settled.append(ReadResult(op.xfer_id, FailureKind.TRANSFER_SETUP, "duplicate transfer id"))
            return
        self._reads[op.xfer_id] = None
        self._started[op.xfer_id] = (self._clock(), op.peer)
        if op.expected is not None:
            if len(op.expected) != len(op.local) or self._device != "cpu":
                self._settle(op.xfer_id, FailureKind.TRANSFER_SETUP, "digests do not fit the read (count or memory)")
                return
            self._expected[op.xfer_id] = (op.local, op.expected)
        if op.traced:
            self._started_ns[op.xfer_id] = time.time_ns()
        try:
            agent = self._agent(op.peer, op.agent_metadata)
        except Exception as exc:
            self._settle(op.xfer_id, FailureKind.HANDSHAKE, f"adding the peer's transfer agent failed: {exc}")
            return
        try:
            self._reads[op.xfer_id] = self.backend.read(
                agent, self.backend.prep_descs(list(op.local), self._device, self._device_id),
                self.backend.prep_descs(list(op.remote), *op.remote_memory), b"")
        except Exception as exc:
            self._settle(op.xfer_id, FailureKind.TRANSFER_SETUP, f"{type(exc).__name__}: {exc}")

    def _agent(self, peer: str, metadata: bytes) -> str:
        known = self._peers.get(peer)
        if known is not None and known[0] == metadata:
            return known[1]
        if known is not None:
            self._drop_peer(peer)
        name = self.backend.add_remote_agent(metadata)
        self._peers[peer] = (metadata, name)
        return name

    def _drop_peer(self, peer: str) -> None:
        known = self._peers.pop(peer, None)
        if known is None:
            return
        try:
            self.backend.remove_remote_agent(known[1])
        except Exception:  # the agent may already be unusable; nothing else holds it
            logger.debug("removing agent %s failed", known[1], exc_info=True)

    def _release(self, xfer_id: str) -> None:
        self._reported.discard(xfer_id)
        self._started.pop(xfer_id, None)
        self._started_ns.pop(xfer_id, None)
        self._expected.pop(xfer_id, None)
        handle = self._reads.pop(xfer_id, None)
        if handle is None:
            return
        try:
            self.backend.release(handle)
        except Exception:
            logger.debug("releasing a transfer handle failed", exc_info=True)
