"""In-process transfer backend with fault knobs, for tests of the failure paths.

Agents live in a ``FakeFabric`` (passed in; no module globals) and find each other
through it by the metadata they exchange, as real agents do. The real protocol is
kept: peers must be added from metadata, memory must be registered, a read copies
bytes (ctypes.memmove) only when it completes DONE, and only then does the target
receive the notification. The fault knobs (``FaultConfig``) replace what a real
network would do wrong:

=========================  ==========================================================
knob                       outcome
=========================  ==========================================================
fail_add_remote_agent      add_remote_agent raises RemoteAgentError
fail_read_setup            read raises TransferSetupError (no handle)
error_state                reads end ERROR (after any delay); no bytes, no notif
raise_on_check_state       check_state raises TransferStateError
fail_send_notif            send_notif raises NotificationError
drop_completion_notif      reads end DONE, bytes copied, but the target gets no notif
delay_polls=N              each read answers IN_PROGRESS to its first N polls
hold_reads                 reads answer IN_PROGRESS while it is set (set_faults lifts it:
                           a read then completes when the test says so)
FakeFabric.kill(name)      reads from that agent (in flight or later) end ERROR,
                           send_notif to it raises; its own calls raise TransferError
*_rate, max_random_delay   the same faults drawn at random per operation from a
                           generator seeded by (fabric seed, agent name): chaos tests
=========================  ==========================================================

Faults apply to operations the agent *initiates*. ``FakeFabric(strict_progress=True)``
also mimics NIXL without a progress thread: a read completes only after the target
has called ``get_new_notifs`` since the read began.
"""

from __future__ import annotations

import ctypes
import json
import random
import threading
import uuid
from dataclasses import dataclass, fields
from typing import Sequence

from kvbridge.kv_transfer.backends.base import (
    DescList, MemoryRegion, NotificationError, RemoteAgentError, TransferBackend,
    TransferError, TransferSetupError, TransferState, TransferStateError, XferHandle,
    check_read_pairing, in_regions, validate_descs,
)

_META_KIND = "kvbridge-fake"
_META_VERSION = 1


@dataclass(frozen=True)
class FaultConfig:
    fail_add_remote_agent: bool = False
    fail_read_setup: bool = False
    error_state: bool = False
    raise_on_check_state: bool = False
    fail_send_notif: bool = False
    drop_completion_notif: bool = False
    delay_polls: int = 0
    hold_reads: bool = False
    # Chaos mode: probability of each fault per operation (per poll for the check_state one).
    add_remote_agent_failure_rate: float = 0.0
    read_setup_failure_rate: float = 0.0
    error_state_rate: float = 0.0
    check_state_raise_rate: float = 0.0
    send_notif_failure_rate: float = 0.0
    max_random_delay_polls: int = 0  # each read waits uniform[0, n] extra polls

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name.endswith("_rate") and not 0.0 <= getattr(self, f.name) <= 1.0:
                raise ValueError(f"{f.name} must be in [0, 1]")
        if self.delay_polls < 0 or self.max_random_delay_polls < 0:
            raise ValueError("delays must be >= 0")

    @classmethod
    def chaos(cls, rate: float, max_random_delay_polls: int = 3) -> "FaultConfig":
        """Every random fault at the same ``rate``."""
        return cls(add_remote_agent_failure_rate=rate, read_setup_failure_rate=rate,
                   error_state_rate=rate, check_state_raise_rate=rate,
                   send_notif_failure_rate=rate,
                   max_random_delay_polls=max_random_delay_polls)


class FakeFabric:
    """The in-process 'network': a registry of FakeBackend agents."""

    def __init__(self, seed: int = 0, strict_progress: bool = False) -> None:
        self.fabric_id = uuid.uuid4().hex
        self.seed = seed
        self.strict_progress = strict_progress
        self._lock = threading.Lock()
        self._agents: dict[str, FakeBackend] = {}

    def create_agent(self, name: str, faults: FaultConfig | None = None) -> "FakeBackend":
        return FakeBackend(name, fabric=self, faults=faults)

    def _join(self, agent: "FakeBackend") -> None:
        with self._lock:
            if agent.agent_name in self._agents:
                raise ValueError(f"agent {agent.agent_name!r} already exists in this fabric")
            self._agents[agent.agent_name] = agent

    def kill(self, name: str) -> None:
        """Simulate the agent's process dying (see the module docstring)."""
        self._get(name)._dead = True

    def is_alive(self, name: str) -> bool:
        agent = self.lookup(name)
        return agent is not None and agent._usable()

    def lookup(self, name: str) -> "FakeBackend | None":
        with self._lock:
            return self._agents.get(name)

    def _get(self, name: str) -> "FakeBackend":
        agent = self.lookup(name)
        if agent is None:
            raise KeyError(f"no agent {name!r} in this fabric")
        return agent


@dataclass
class _FakeRead:
    pairs: tuple[tuple[int, int, int], ...]  # (local addr, remote addr, length)
    remote_device: tuple[str, int]  # memory type and device id the remote spans were named in
    polls_left: int
    fated_error: bool
    posted_epoch: int  # the target's progress epoch when the read began
    state: TransferState = TransferState.IN_PROGRESS


class FakeBackend(TransferBackend):
    """One in-process agent. Create through ``FakeFabric.create_agent``."""

    def __init__(self, agent_name: str, *, fabric: FakeFabric,
                 faults: FaultConfig | None = None) -> None:
        super().__init__(agent_name)
        self.fabric = fabric
        self._faults = faults or FaultConfig()
        self._rng = random.Random(f"{fabric.seed}:{agent_name}")
        self._lock = threading.RLock()
        self._regions: list[MemoryRegion] = []
        self._remotes: set[str] = set()
        self._inbox: dict[str, list[bytes]] = {}
        self._progress_epoch = 0
        self._dead = False
        self._closed = False
        fabric._join(self)

    @property
    def faults(self) -> FaultConfig:
        return self._faults

    def set_faults(self, faults: FaultConfig) -> None:
        """Replace the fault knobs; applies to operations from now on (and to polls
        of reads already in flight)."""
        with self._lock:
            self._faults = faults

    # -- interface ---------------------------------------------------------------------

    def register_memory(self, regions: Sequence[MemoryRegion]) -> None:
        if any(r.device != "cpu" for r in regions):
            raise TransferError("the fake backend copies host memory only (device 'cpu')")
        with self._lock:
            self._ensure_usable()
            self._regions.extend(regions)

    def agent_metadata(self) -> bytes:
        self._ensure_usable()
        return json.dumps({"kind": _META_KIND, "version": _META_VERSION,
                           "fabric": self.fabric.fabric_id,
                           "name": self.agent_name}).encode()

    def add_remote_agent(self, metadata: bytes) -> str:
        with self._lock:
            self._ensure_usable()
            if self._draw(self._faults.fail_add_remote_agent,
                          self._faults.add_remote_agent_failure_rate):
                raise RemoteAgentError("injected fault: add_remote_agent failed")
            name = self._parse_metadata(metadata)
            self._remotes.add(name)
            return name

    def remove_remote_agent(self, name: str) -> None:
        with self._lock:
            self._remotes.discard(name)

    def prep_descs(self, descs: Sequence[tuple[int, int]], device: str = "cpu",
                   device_id: int = 0) -> DescList:
        return DescList(validate_descs(descs, device, device_id), device, device_id)

    def read(self, remote_agent: str, local: DescList, remote: DescList,
             notif: bytes) -> XferHandle:
        check_read_pairing(local, remote)
        with self._lock:
            self._ensure_usable()
            if remote_agent not in self._remotes:
                raise TransferSetupError(f"unknown remote agent {remote_agent!r}")
            if not all(in_regions(self._regions, a, n, local.device, local.device_id) for a, n in local.descs):
                raise TransferSetupError("local descriptors outside registered memory")
            target = self.fabric.lookup(remote_agent)
            if target is not None and target._usable() and not all(
                    in_regions(target._regions, a, n, remote.device, remote.device_id) for a, n in remote.descs):
                raise TransferSetupError("remote descriptors outside the peer's registered memory")
            if self._draw(self._faults.fail_read_setup, self._faults.read_setup_failure_rate):
                raise TransferSetupError("injected fault: transfer setup failed")
            extra = (self._rng.randint(0, self._faults.max_random_delay_polls)
                     if self._faults.max_random_delay_polls else 0)
            state = _FakeRead(
                pairs=tuple((la, ra, n) for (la, n), (ra, _) in zip(local.descs, remote.descs)),
                remote_device=(remote.device, remote.device_id),
                polls_left=self._faults.delay_polls + extra,
                fated_error=self._draw(self._faults.error_state, self._faults.error_state_rate),
                posted_epoch=target._progress_epoch if target is not None else 0)
            handle = XferHandle(remote_agent, local.nbytes, len(local), bytes(notif), native=state)
            self._live[handle.handle_id] = handle
        self._count(reads_started=1)
        return handle

    def check_state(self, handle: XferHandle) -> TransferState:
        with self._lock:
            read = self._owned(handle)
            if read.state is not TransferState.IN_PROGRESS:
                return read.state
            if self._draw(self._faults.raise_on_check_state, self._faults.check_state_raise_rate):
                raise TransferStateError("injected fault: polling the transfer failed")
            read.state = self._advance(handle, read)
            notify = (read.state is TransferState.DONE and bool(handle.notif)
                      and not self._faults.drop_completion_notif)
        if notify:  # outside our lock: the target takes its own (no lock-order deadlock)
            target = self.fabric.lookup(handle.remote_agent)
            if target is not None:
                target._deliver(self.agent_name, handle.notif)
        self._settle(handle, read.state)
        return read.state

    def release(self, handle: XferHandle) -> None:
        with self._lock:
            self._untrack(handle)  # a no-op if released before, or not ours

    def send_notif(self, remote_agent: str, msg: bytes) -> None:
        with self._lock:
            self._ensure_usable()
            if remote_agent not in self._remotes:
                raise NotificationError(f"unknown remote agent {remote_agent!r}")
            if self._draw(self._faults.fail_send_notif, self._faults.send_notif_failure_rate):
                raise NotificationError("injected fault: send_notif failed")
            target = self.fabric.lookup(remote_agent)
            if target is None or not target._usable():
                raise NotificationError(f"remote agent {remote_agent!r} is unreachable")
        target._deliver(self.agent_name, bytes(msg))
        self._count(notifs_sent=1)

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        with self._lock:
            self._ensure_usable()
            self._progress_epoch += 1
            inbox, self._inbox = self._inbox, {}
        self._count(notifs_received=sum(len(v) for v in inbox.values()))
        return inbox

    def shutdown(self) -> None:
        with self._lock:
            for handle in list(self._live.values()):
                self.release(handle)
            self._remotes.clear()
            self._regions.clear()
            self._inbox.clear()
            self._closed = True

    # -- internals ---------------------------------------------------------------------

    def _advance(self, handle: XferHandle, read: _FakeRead) -> TransferState:
        """One poll of an in-flight read; the copy happens on DONE only."""
        target = self.fabric.lookup(handle.remote_agent)
        if target is None or not target._usable():
            return TransferState.ERROR
        if self._faults.hold_reads:
            return TransferState.IN_PROGRESS
        if read.polls_left > 0:
            read.polls_left -= 1
            return TransferState.IN_PROGRESS
        if read.fated_error:
            return TransferState.ERROR
        if self.fabric.strict_progress and target._progress_epoch <= read.posted_epoch:
            return TransferState.IN_PROGRESS
        regions = target._regions
        if not all(in_regions(regions, ra, n, *read.remote_device) for _, ra, n in read.pairs):
            return TransferState.ERROR  # the peer deregistered the memory meanwhile
        for local_addr, remote_addr, length in read.pairs:
            ctypes.memmove(local_addr, remote_addr, length)
        return TransferState.DONE

    def _deliver(self, sender: str, msg: bytes) -> None:
        with self._lock:
            if self._usable():
                self._inbox.setdefault(sender, []).append(msg)

    def _owned(self, handle: XferHandle) -> _FakeRead:
        self._check_live(handle)
        read: _FakeRead = handle.native
        return read

    def _parse_metadata(self, metadata: bytes) -> str:
        try:
            meta = json.loads(metadata)
            kind, version, fabric, name = (meta["kind"], meta["version"],
                                           meta["fabric"], meta["name"])
        except (ValueError, TypeError, KeyError) as exc:
            raise RemoteAgentError(f"malformed fake agent metadata: {exc}") from exc
        if kind != _META_KIND or version != _META_VERSION:
            raise RemoteAgentError(f"metadata is {kind!r} v{version}, "
                                   f"not {_META_KIND} v{_META_VERSION}")
        if fabric != self.fabric.fabric_id:
            raise RemoteAgentError("metadata comes from another fabric")
        if not isinstance(name, str) or self.fabric.lookup(name) is None:
            raise RemoteAgentError(f"no agent {name!r} in this fabric")
        return name

    def _draw(self, forced: bool, rate: float) -> bool:
        return forced or (rate > 0.0 and self._rng.random() < rate)

    def _usable(self) -> bool:
        return not (self._dead or self._closed)

    def _ensure_usable(self) -> None:
        if self._dead:
            raise TransferError(f"agent {self.agent_name!r} was killed")
        if self._closed:
            raise TransferError(f"agent {self.agent_name!r} is shut down")
