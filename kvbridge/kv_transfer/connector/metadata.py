"""Messages of the connector: the per-step metadata the scheduler half hands the worker half
(what to receive, what to release, which leases to renew).

Nothing rides the transfer backend's notification channel: every message between D and P
(the pre-read lease check, read-done, release, heartbeat) is a small JSON body on P's side
channel (side_channel/control.py), so it works before (or without) a transfer-agent handshake and P's side
channel thread answers it whatever P's engine loop is doing. Request ids in every message are
P's own (the remote_request_id P returned).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvbridge.kv_transfer.params import BlockIds, KVTransferParams
from kvbridge.tracing import RequestTrace


@dataclass(frozen=True)
class RemoteEngine:
    """Where a prefill engine's side channel is."""

    engine_id: str
    host: str
    port: int


@dataclass(frozen=True)
class RecvSpec:
    """D: read `remote_block_ids` of P's request into `local_block_ids` (same shapes, per group).
    Empty lists mean a notification-only request (nothing to read; P may free)."""

    request_id: str  # D's request id
    remote: RemoteEngine
    remote_request_id: str
    lease_generation: int
    local_block_ids: BlockIds
    remote_block_ids: BlockIds
    content: str  # content_digest of D's prompt: P checks its blocks hold that prompt's KV
    trace: RequestTrace | None = field(default=None, compare=False)  # D's request's (its kv.* spans)

    @property
    def num_blocks(self) -> int:
        return sum(len(g) for g in self.local_block_ids)


@dataclass(frozen=True)
class ReleaseSpec:
    """D: tell P it may free a request's blocks without a read."""

    request_id: str
    remote: RemoteEngine
    remote_request_id: str
    lease_generation: int
    trace: RequestTrace | None = field(default=None, compare=False)  # D's request's (its kv.release span)


@dataclass
class ConnectorMetadata:
    reqs_to_recv: list[RecvSpec] = field(default_factory=list)
    reqs_to_release: list[ReleaseSpec] = field(default_factory=list)
    heartbeats: dict[RemoteEngine, list[tuple[str, int]]] = field(default_factory=dict)


def remote_of(params: KVTransferParams) -> RemoteEngine:
    return RemoteEngine(params.remote_engine_id or "", params.remote_host or "", int(params.remote_port or 0))
