"""The transfer-backend interface: NIXL's agent API, typed, plus block-run coalescing.

A backend moves bytes between *agents* and knows nothing of requests. The
lifecycle reads off the method names (as in NIXL):

    register_memory -> agent_metadata  (sent to peers by the handshake, not here)
    add_remote_agent(peer metadata) -> prep_descs (local and remote side)
    read(...) -> check_state (poll) ... DONE | ERROR -> release
    send_notif / get_new_notifs        (small messages between agents)
    shutdown

Semantics every implementation keeps (nixl.py, tcp.py, fake.py):

* A read is one-sided: the initiator pulls bytes from the remote agent's registered
  memory into its own registered memory.
* The remote agent receives the read's ``notif`` exactly once, and only if the read
  completed DONE. It may arrive slightly after the initiator first sees DONE. An empty
  ``notif`` sends nothing. With nixl, a READ that carries one is DONE only after the
  target's agent has progressed; one without completes when the copy does.
* Progress: without a progress thread (nixl) an agent's transport advances only
  inside its own calls, on both sides. The target of reads must call
  ``get_new_notifs`` regularly (every engine step, and from an idle loop while it
  holds leased blocks), or reads from it stay IN_PROGRESS; a sender's notifications
  leave only while it keeps calling into its agent (``check_state`` or
  ``get_new_notifs``). tcp and fake progress on their own.
* Failures are typed: ``TransferError`` subclasses for the backend refusing or
  failing, ``ValueError`` for a caller breaking a contract (unknown handle, mismatched
  descriptor lengths).
* All methods are thread-safe.
"""

from __future__ import annotations

import abc
import ctypes
import itertools
import threading
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, NamedTuple, Sequence


class TransferState(Enum):
    IN_PROGRESS = "in_progress"
    DONE = "done"
    ERROR = "error"


class TransferError(Exception):
    """Base class of every failure a backend reports by raising."""


class BackendUnavailableError(TransferError):
    """The backend's library is missing or cannot start (e.g. nixl not installed)."""


class RemoteAgentError(TransferError):
    """add_remote_agent refused the metadata (garbage, wrong version, unknown fabric)."""


class TransferSetupError(TransferError):
    """read() could not start: unknown remote agent, unregistered memory, backend refusal."""


class TransferStateError(TransferError):
    """check_state() could not poll the transfer (the poll itself failed)."""


class NotificationError(TransferError):
    """send_notif() could not deliver the message to the transport."""


DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class MemoryRegion:
    """A contiguous span of memory: ``length`` bytes at ``addr`` on ``device``.

    The caller owns the memory and keeps it alive until the backend's ``shutdown``
    returns.
    """

    addr: int
    length: int
    device: str = "cpu"  # "cpu" | "cuda"
    device_id: int = 0

    def __post_init__(self) -> None:
        if self.addr <= 0:
            raise ValueError(f"addr must be a positive address, got {self.addr}")
        if self.length <= 0:
            raise ValueError(f"length must be positive, got {self.length}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.device_id < 0:
            raise ValueError(f"device_id must be >= 0, got {self.device_id}")

    @property
    def end(self) -> int:
        return self.addr + self.length

    def contains(self, addr: int, length: int) -> bool:
        return self.addr <= addr and addr + length <= self.end

    @classmethod
    def of(cls, buffer: Any) -> "MemoryRegion":
        """The region of a contiguous torch tensor or numpy array (no copy)."""
        if hasattr(buffer, "data_ptr"):  # torch.Tensor
            if not buffer.is_contiguous():
                raise ValueError("tensor must be contiguous to be registered")
            dev = buffer.device
            return cls(buffer.data_ptr(), buffer.numel() * buffer.element_size(),
                       "cuda" if dev.type == "cuda" else "cpu",
                       dev.index or 0)
        if hasattr(buffer, "__array_interface__"):  # numpy.ndarray
            if not buffer.flags["C_CONTIGUOUS"]:
                raise ValueError("array must be C-contiguous to be registered")
            return cls(buffer.ctypes.data, buffer.nbytes)
        raise TypeError(f"cannot take a memory region of {type(buffer).__name__}")


@dataclass(frozen=True)
class DescList:
    """Prepared descriptors: (addr, length) byte spans, all on one device.

    Made by the backend's ``prep_descs`` and usable only with that backend.
    ``native`` holds the backend's own prepared form (NIXL: a nixlXferDList).
    """

    descs: tuple[tuple[int, int], ...]
    device: str
    device_id: int
    native: Any = field(default=None, compare=False, repr=False)

    @property
    def nbytes(self) -> int:
        return sum(length for _, length in self.descs)

    def __len__(self) -> int:
        return len(self.descs)


_handle_ids = itertools.count(1)


@dataclass(eq=False)
class XferHandle:
    """One read, from ``read`` until ``release``. Opaque to callers except the fields."""

    remote_agent: str
    nbytes: int
    num_descs: int
    notif: bytes
    handle_id: int = field(default_factory=lambda: next(_handle_ids))
    released: bool = False
    settled: bool = False  # DONE or ERROR has been observed and counted in the stats
    native: Any = field(default=None, repr=False)


@dataclass(frozen=True)
class TransferStats:
    """Counters since the backend was created. Bytes/descriptors count DONE reads only."""

    reads_started: int = 0
    reads_done: int = 0
    reads_failed: int = 0
    bytes_read: int = 0
    descs_read: int = 0
    notifs_sent: int = 0
    notifs_received: int = 0


class TransferBackend(abc.ABC):
    """One agent of a transfer fabric. See the module docstring for shared semantics."""

    def __init__(self, agent_name: str) -> None:
        if not agent_name:
            raise ValueError("agent_name must be non-empty")
        self.agent_name = agent_name
        self._stats_lock = threading.Lock()
        self._stats: dict[str, int] = dict.fromkeys(TransferStats.__dataclass_fields__, 0)
        self._live: dict[int, XferHandle] = {}  # handles read() gave out and release() has not ended

    @abc.abstractmethod
    def register_memory(self, regions: Sequence[MemoryRegion]) -> None:
        """Make ``regions`` readable by peers and usable as local read targets.

        Called once at start-up, before ``agent_metadata``. Regions registered later
        are visible only to peers that add this agent's metadata afterwards.
        Raises TransferError if the backend refuses (e.g. device unsupported).
        """

    @abc.abstractmethod
    def agent_metadata(self) -> bytes:
        """Opaque bytes a peer passes to ``add_remote_agent`` to read from this agent.

        Carried to peers by the handshake side channel (not by the backend).
        """

    @abc.abstractmethod
    def add_remote_agent(self, metadata: bytes) -> str:
        """Load a peer's metadata; returns the peer's agent name (always str).

        Adding the same agent again replaces its metadata. Raises RemoteAgentError on
        metadata this backend cannot use. Does not contact the peer.
        """

    @abc.abstractmethod
    def remove_remote_agent(self, name: str) -> None:
        """Forget a peer. Unknown names are a no-op. Reads still in flight to it may
        end in ERROR; the caller still releases their handles."""

    @abc.abstractmethod
    def prep_descs(self, descs: Sequence[tuple[int, int]], device: str = "cpu",
                   device_id: int = 0) -> DescList:
        """Prepare (addr, length) spans on one device, for either side of a read.

        Raises ValueError on an empty list, a non-positive length or an unknown device.
        Whether the spans lie in registered memory is checked by ``read``.
        """

    @abc.abstractmethod
    def read(self, remote_agent: str, local: DescList, remote: DescList,
             notif: bytes) -> XferHandle:
        """Start a one-sided READ: remote descriptor i -> local descriptor i.

        ``local`` and ``remote`` must have the same number of descriptors with
        pairwise equal lengths (else ValueError). On DONE, ``remote_agent`` receives
        ``notif`` exactly once (unless it is empty); on ERROR or release before
        completion it does not.
        Raises TransferSetupError when the read cannot start (unknown agent,
        unregistered memory, backend refusal); no handle exists then. Otherwise the
        caller owns the returned handle and must ``release`` it.
        """

    @abc.abstractmethod
    def check_state(self, handle: XferHandle) -> TransferState:
        """Poll a read. DONE and ERROR are final: later polls return the same state.

        DONE means every byte is in local memory. Raises TransferStateError when the
        poll itself fails (treat like ERROR), ValueError on a released handle.
        """

    @abc.abstractmethod
    def release(self, handle: XferHandle) -> None:
        """Free a read's resources. Always safe and idempotent; never raises.

        Releasing an IN_PROGRESS read cancels it: the backend stops writing into its
        local memory (nixl: as far as NIXL can abort) and the notif is not sent unless
        the read had already completed. Handles of other backends are ignored.
        """

    @abc.abstractmethod
    def send_notif(self, remote_agent: str, msg: bytes) -> None:
        """Send a standalone message to an added peer (heartbeats, "done" broadcasts).

        Raises NotificationError when it cannot be handed to the transport (unknown
        or unreachable peer).
        """

    @abc.abstractmethod
    def get_new_notifs(self) -> dict[str, list[bytes]]:
        """Drain messages received since the last call: sender agent name -> messages
        in arrival order. Also drives this agent's progress (see module docstring)."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Release every handle, forget every peer, deregister memory, stop threads.

        Idempotent. After it, other methods (except release/stats) raise TransferError.
        """

    def stats(self) -> TransferStats:
        with self._stats_lock:
            return TransferStats(**self._stats)

    # -- helpers for implementations --------------------------------------------------

    def _count(self, **increments: int) -> None:
        with self._stats_lock:
            for key, value in increments.items():
                self._stats[key] += value

    def _check_live(self, handle: XferHandle) -> None:
        """ValueError unless ``handle`` came from this agent's read() and is not released.
        Implementations call it under their own lock, as they do every use of ``_live``."""
        if handle.released or self._live.get(handle.handle_id) is not handle:
            raise ValueError(f"handle {handle.handle_id} is released or not from this agent")

    def _untrack(self, handle: XferHandle) -> bool:
        """Forget a live handle and mark it released; False if it was released before or is
        not ours (release() is then a no-op). Under the implementation's lock."""
        if self._live.get(handle.handle_id) is not handle:
            return False
        del self._live[handle.handle_id]
        handle.released = True
        return True

    def _settle(self, handle: XferHandle, state: TransferState) -> None:
        """Count a read's final state once (called by implementations on first sight)."""
        if state is TransferState.IN_PROGRESS:
            return
        with self._stats_lock:
            if handle.settled:
                return
            handle.settled = True
            if state is TransferState.DONE:
                self._stats["reads_done"] += 1
                self._stats["bytes_read"] += handle.nbytes
                self._stats["descs_read"] += handle.num_descs
            else:
                self._stats["reads_failed"] += 1


def validate_descs(descs: Sequence[tuple[int, int]], device: str,
                   device_id: int) -> tuple[tuple[int, int], ...]:
    """The shared checks of ``prep_descs``; returns the spans as a tuple of int pairs."""
    if device not in DEVICES:
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if device_id < 0:
        raise ValueError(f"device_id must be >= 0, got {device_id}")
    out = tuple((int(addr), int(length)) for addr, length in descs)
    if not out:
        raise ValueError("a descriptor list must not be empty")
    for addr, length in out:
        if addr <= 0 or length <= 0:
            raise ValueError(f"bad descriptor (addr={addr}, length={length})")
    return out


def check_read_pairing(local: DescList, remote: DescList) -> None:
    """The shared contract check of ``read``: same count, pairwise equal lengths."""
    if len(local) != len(remote):
        raise ValueError(f"local has {len(local)} descriptors, remote {len(remote)}")
    for i, ((_, a), (_, b)) in enumerate(zip(local.descs, remote.descs)):
        if a != b:
            raise ValueError(f"descriptor {i}: local length {a} != remote length {b}")


def in_regions(regions: Sequence[MemoryRegion], addr: int, length: int, device: str, device_id: int) -> bool:
    """Is the span inside one registered region of that memory (NIXL's lookup: type, device id, span)?"""
    return any(r.device == device and r.device_id == device_id and r.contains(addr, length) for r in regions)


def host_view(addr: int, length: int) -> memoryview:
    """A writable byte view of host memory (no copy). The caller vouches for the span."""
    return memoryview((ctypes.c_char * length).from_address(addr)).cast("B")


class BlockRun(NamedTuple):
    local_start: int
    remote_start: int
    num_blocks: int


def coalesce_block_runs(local_ids: Sequence[int], remote_ids: Sequence[int]) -> list[BlockRun]:
    """Group per-block (local, remote) pairs into runs consecutive on both sides.

    Pair i is ``(local_ids[i], remote_ids[i])``; order is kept. A pair extends the
    current run when both ids are exactly one more than the previous pair's, so each
    run becomes one descriptor per side instead of ``num_blocks``.
    Raises ValueError when the lists differ in length.
    """
    if len(local_ids) != len(remote_ids):
        raise ValueError(f"{len(local_ids)} local ids but {len(remote_ids)} remote ids")
    runs: list[BlockRun] = []
    for loc, rem in zip(local_ids, remote_ids):
        if runs:
            last = runs[-1]
            if (loc == last.local_start + last.num_blocks
                    and rem == last.remote_start + last.num_blocks):
                runs[-1] = last._replace(num_blocks=last.num_blocks + 1)
                continue
        runs.append(BlockRun(loc, rem, 1))
    return runs


def run_descs(runs: Sequence[BlockRun], *, local_base: int, remote_base: int,
              block_bytes: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(local, remote) descriptor spans for runs of densely packed blocks of
    ``block_bytes`` each, starting at the two regions' base addresses."""
    local = [(local_base + r.local_start * block_bytes, r.num_blocks * block_bytes) for r in runs]
    remote = [(remote_base + r.remote_start * block_bytes, r.num_blocks * block_bytes)
              for r in runs]
    return local, remote
