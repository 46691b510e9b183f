"""NIXL transfer backend: a thin typed wrapper over ``nixl._api.nixl_agent`` (UCX).

Host memory is registered as NIXL "DRAM", CUDA memory as "VRAM". Reads use
``initialize_xfer("READ", ..., notif)`` + ``transfer``; NIXL delivers the notif to
the target once the read is complete.

Environment (read by UCX when the agent is created, so a launcher must set it in
every process that runs NIXL, before start-up):

* ``UCX_NET_DEVICES=lo`` when all instances are on one host: UCX otherwise also
  opens lanes on the host's other interfaces.
* ``UCX_MODULES=^ib`` avoids a crash at exit where Debian's ibverbs-providers is
  installed.
* ``UCX_KEEPALIVE_INTERVAL=inf``, set here unless the environment sets it (`KEEPALIVE_ENV`):
  UCX's endpoint keepalive (every 20 s by default) makes reads need the target's progress
  again: after an idle spell, with the target's agent making no call, the first READ
  completed and every later one stayed in progress; with the keepalive off each completed
  (benchmarks/README.md, pd_transfer). kvbridge does not rely on it for liveness: a read has its own
  timeout (`transfer_timeout_s`), P's leases expire, D's heartbeats renew them.

The progress thread is off by default (it cut throughput on a small CPU), so
an agent progresses only inside its own calls: the target of reads must call
``get_new_notifs`` regularly or reads from it stay IN_PROGRESS (measured: a READ
between two agents never completes while the target is idle), and a notification
to a peer not yet connected leaves only while the sender keeps calling in. NIXL's
agent is not thread-safe in this mode; one lock serialises every call into it.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Sequence

import numpy as np

from kvbridge.kv_transfer.backends.base import (
    BackendUnavailableError, DescList, MemoryRegion, NotificationError, RemoteAgentError,
    TransferBackend, TransferError, TransferSetupError, TransferState, TransferStateError,
    XferHandle, check_read_pairing, validate_descs,
)

logger = logging.getLogger(__name__)

KEEPALIVE_ENV = ("UCX_KEEPALIVE_INTERVAL", "inf")
INSTALL_HINT = "pip install nixl-cu12==1.5.1 && pip install --no-deps nixl==1.5.1"
_MEM_TYPES = {"cpu": "DRAM", "cuda": "VRAM"}
_STATES = {"DONE": TransferState.DONE, "PROC": TransferState.IN_PROGRESS}


def _import_nixl() -> Any:
    try:
        from nixl import _api
    except ImportError as exc:
        raise BackendUnavailableError(
            f"the nixl backend needs NIXL, which cannot be imported ({exc}); "
            f"install it with: {INSTALL_HINT}, or choose the tcp backend") from exc
    return _api


class NixlBackend(TransferBackend):
    """One NIXL agent with the UCX backend."""

    def __init__(self, agent_name: str, *, enable_prog_thread: bool = False,
                 backends: Sequence[str] = ("UCX",)) -> None:
        super().__init__(agent_name)
        api = _import_nixl()
        if "UCX_NET_DEVICES" not in os.environ:
            logger.warning("UCX_NET_DEVICES is not set: UCX may use every network interface "
                           "(set UCX_NET_DEVICES=lo when all instances run on one host)")
        os.environ.setdefault(*KEEPALIVE_ENV)  # UCX reads it when the agent creates its context
        config = api.nixl_agent_config(enable_prog_thread=enable_prog_thread,
                                       backends=list(backends))
        self._agent = api.nixl_agent(agent_name, config)
        missing = [b for b in backends if b not in self._agent.backends]
        if missing:
            raise BackendUnavailableError(f"NIXL could not start backend(s) {missing}; "
                                          f"available plugins: {self._agent.get_plugin_list()}")
        self._lock = threading.RLock()
        self._reg_descs: list[Any] = []
        self._remotes: set[str] = set()
        self._leaked: list[Any] = []  # xfer handles NIXL refused to release; retried at shutdown
        self._closed = False

    def register_memory(self, regions: Sequence[MemoryRegion]) -> None:
        with self._lock:
            self._ensure_open()
            for device, mem_type in _MEM_TYPES.items():
                tuples = [(r.addr, r.length, r.device_id, "") for r in regions
                          if r.device == device]
                if not tuples:
                    continue
                try:
                    descs = self._agent.get_reg_descs(tuples, mem_type)
                    self._agent.register_memory(descs)
                except Exception as exc:  # nixl's binding errors share no public base
                    raise TransferError(
                        f"NIXL refused to register {mem_type} memory: {exc}") from exc
                self._reg_descs.append(descs)

    def agent_metadata(self) -> bytes:
        with self._lock:
            self._ensure_open()
            return bytes(self._agent.get_agent_metadata())

    def add_remote_agent(self, metadata: bytes) -> str:
        with self._lock:
            self._ensure_open()
            try:
                name = self._agent.add_remote_agent(bytes(metadata))
            except Exception as exc:
                raise RemoteAgentError(f"NIXL rejected the agent metadata: {exc}") from exc
            name = name.decode() if isinstance(name, bytes) else str(name)
            self._remotes.add(name)
            return name

    def remove_remote_agent(self, name: str) -> None:
        with self._lock:
            if name not in self._remotes or self._closed:
                return
            self._remotes.discard(name)
            try:
                self._agent.remove_remote_agent(name)
            except Exception as exc:
                logger.warning("NIXL agent %s: removing remote agent %s failed: %s",
                               self.agent_name, name, exc)

    def prep_descs(self, descs: Sequence[tuple[int, int]], device: str = "cpu",
                   device_id: int = 0) -> DescList:
        spans = validate_descs(descs, device, device_id)
        array = np.empty((len(spans), 3), dtype=np.uint64)  # rows: addr, length, device id
        array[:, :2] = spans
        array[:, 2] = device_id
        with self._lock:
            self._ensure_open()
            native = self._agent.get_xfer_descs(array, _MEM_TYPES[device])
        return DescList(spans, device, device_id, native)

    def read(self, remote_agent: str, local: DescList, remote: DescList,
             notif: bytes) -> XferHandle:
        check_read_pairing(local, remote)
        with self._lock:
            self._ensure_open()
            if remote_agent not in self._remotes:
                raise TransferSetupError(f"unknown remote agent {remote_agent!r}")
            try:
                xfer = self._agent.initialize_xfer("READ", local.native, remote.native,
                                                   remote_agent, bytes(notif))
            except Exception as exc:
                raise TransferSetupError(f"NIXL could not create the READ: {exc}") from exc
            try:
                posted, detail = self._agent.transfer(xfer), ""
            except Exception as exc:
                posted, detail = "ERR", f": {exc}"
            if posted == "ERR":
                self._release_xfer(xfer)
                raise TransferSetupError(f"NIXL could not post the READ to {remote_agent}{detail}")
            handle = XferHandle(remote_agent, local.nbytes, len(local), bytes(notif),
                                native=xfer)
            self._live[handle.handle_id] = handle
        self._count(reads_started=1)
        return handle

    def check_state(self, handle: XferHandle) -> TransferState:
        with self._lock:
            self._check_live(handle)
            try:
                raw = self._agent.check_xfer_state(handle.native)
            except Exception as exc:
                raise TransferStateError(f"NIXL could not poll the READ: {exc}") from exc
        state = _STATES.get(raw, TransferState.ERROR)
        self._settle(handle, state)
        return state

    def release(self, handle: XferHandle) -> None:
        with self._lock:
            if self._untrack(handle) and not self._closed:
                self._release_xfer(handle.native)

    def send_notif(self, remote_agent: str, msg: bytes) -> None:
        with self._lock:
            self._ensure_open()
            if remote_agent not in self._remotes:
                raise NotificationError(f"unknown remote agent {remote_agent!r}")
            try:
                self._agent.send_notif(remote_agent, bytes(msg))
            except Exception as exc:
                raise NotificationError(f"NIXL could not notify {remote_agent}: {exc}") from exc
        self._count(notifs_sent=1)

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        with self._lock:
            self._ensure_open()
            raw = self._agent.get_new_notifs()
        notifs = {(k.decode() if isinstance(k, bytes) else str(k)): [bytes(m) for m in v]
                  for k, v in raw.items() if v}
        self._count(notifs_received=sum(len(v) for v in notifs.values()))
        return notifs

    def shutdown(self) -> None:
        with self._lock:
            if self._closed:
                return
            for handle in list(self._live.values()):
                self.release(handle)
            for xfer in self._leaked:
                try:
                    xfer.release()
                except Exception as exc:
                    logger.warning("NIXL agent %s: handle still not releasable at shutdown: %s",
                                   self.agent_name, exc)
            self._leaked.clear()
            for name in list(self._remotes):
                self.remove_remote_agent(name)
            for descs in self._reg_descs:
                try:
                    self._agent.deregister_memory(descs)
                except Exception as exc:
                    logger.warning("NIXL agent %s: deregistering memory failed: %s",
                                   self.agent_name, exc)
            self._reg_descs.clear()
            self._closed = True
            self._agent = None  # drops NIXL's agent (its destructor frees the rest)

    def _release_xfer(self, xfer: Any) -> None:
        try:
            self._agent.release_xfer_handle(xfer)
        except Exception as exc:  # still in flight and not abortable: retry at shutdown
            logger.warning("NIXL agent %s: could not release a transfer handle: %s",
                           self.agent_name, exc)
            self._leaked.append(xfer)

    def _ensure_open(self) -> None:
        if self._closed:
            raise TransferError(f"agent {self.agent_name!r} is shut down")
