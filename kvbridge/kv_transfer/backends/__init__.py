"""KV transfer backends: one interface (base.py), three implementations.

``create_backend`` picks one by name; the NIXL one imports NIXL only when chosen.
"""

from __future__ import annotations

from typing import Any

from kvbridge.kv_transfer.backends.base import (
    BackendUnavailableError, BlockRun, DescList, MemoryRegion, NotificationError,
    RemoteAgentError, TransferBackend, TransferError, TransferSetupError, TransferState,
    TransferStateError, TransferStats, XferHandle, coalesce_block_runs, run_descs,
)

BACKEND_NAMES = ("nixl", "tcp", "fake")


def create_backend(name: str, agent_name: str, **opts: Any) -> TransferBackend:
    """A new agent of backend ``name``.

    ``opts`` go to the implementation: nixl: ``enable_prog_thread``, ``backends``;
    tcp: ``host``, ``port``, ``connect_timeout_s``, ``io_timeout_s``; fake: ``fabric``
    (a FakeFabric, required) and ``faults``. Raises ValueError for an unknown name and
    BackendUnavailableError when NIXL is missing (never falls back silently).
    """
    if name == "nixl":
        from kvbridge.kv_transfer.backends.nixl import NixlBackend
        return NixlBackend(agent_name, **opts)
    if name == "tcp":
        from kvbridge.kv_transfer.backends.tcp import TcpBackend
        return TcpBackend(agent_name, **opts)
    if name == "fake":
        from kvbridge.kv_transfer.backends.fake import FakeBackend
        if "fabric" not in opts:
            raise ValueError("the fake backend needs fabric=FakeFabric() shared by its peers")
        return FakeBackend(agent_name, **opts)
    raise ValueError(f"unknown transfer backend {name!r} (one of {', '.join(BACKEND_NAMES)})")


__all__ = [
    "BACKEND_NAMES", "BackendUnavailableError", "BlockRun", "DescList", "MemoryRegion",
    "NotificationError", "RemoteAgentError", "TransferBackend", "TransferError",
    "TransferSetupError", "TransferState", "TransferStateError", "TransferStats",
    "XferHandle", "coalesce_block_runs", "create_backend", "run_descs",
]
