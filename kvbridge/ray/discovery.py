"""How the router learns each pool's replicas from Ray: a Serve request router whose replica
updates are published to the ingress.

Serve's controller tells every deployment handle which replicas of a deployment are running
(a long poll: a replica is listed once its constructor returned, i.e. once its engine answered
/health, and unlisted as soon as it dies or starts to stop). A handle hands that list to its
deployment's request router (`RequestRouter.update_replicas`), each replica with the metadata
it published once when it became ready (`record_replica_metadata`: its engine's URL, role and
KV side channel, engine_replica.py). The prefill and decode deployments name PoolRouter
(pool_router.py) as
their request router, so the ingress, which holds a handle to each, gets every change of
membership at once, as the list of engine URLs; its kvbridge pools follow it
(routing.UpstreamPool.set_members). Health, breakers and routing stay in the kvbridge router;
the pools' requests never pass through Serve.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ray.serve.request_router import RunningReplica

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReplicaEndpoint:
    """One engine replica as the router needs it (from its Serve replica metadata)."""

    replica_id: str
    role: str
    url: str
    engine_id: str
    host: str
    side_channel_port: int
    pid: int  # the engine's process
    replica_pid: int  # the Serve replica's process (the engine's parent)
    node_id: str  # the Ray node it runs on

    @classmethod
    def from_metadata(cls, replica_id: str, metadata: dict) -> ReplicaEndpoint | None:
        """None for a replica that published no kvbridge metadata (not one of ours)."""
        if metadata.get("kvbridge") != 1:
            return None
        return cls(replica_id, str(metadata["role"]), str(metadata["url"]), str(metadata["engine_id"]),
                   str(metadata["host"]), int(metadata["side_channel_port"]), int(metadata["pid"]),
                   int(metadata["replica_pid"]), str(metadata["node_id"]))


Listener = Callable[[list[ReplicaEndpoint]], None]
_listeners: dict[tuple[str, str], Listener] = {}  # (app, deployment) -> the ingress's callback
_latest: dict[tuple[str, str], list[ReplicaEndpoint]] = {}
_lock = threading.Lock()


def listen(app_name: str, deployment_name: str, listener: Listener) -> None:
    """Call `listener` with the deployment's replicas now (if known) and on every change. It runs
    on the Serve router's event loop thread: it must hand the list over, not block."""
    with _lock:
        _listeners[(app_name, deployment_name)] = listener
        latest = _latest.get((app_name, deployment_name))
    if latest is not None:
        listener(latest)


def forget(app_name: str, deployment_name: str) -> None:
    with _lock:
        _listeners.pop((app_name, deployment_name), None)


def publish(key: tuple[str, str], endpoints: list[ReplicaEndpoint]) -> None:
    with _lock:
        _latest[key] = endpoints
        listener = _listeners.get(key)
    if listener is not None:
        try:
            listener(endpoints)
        except Exception:  # a listener's bug must not break Serve's router
            logger.exception("replica listener of %s failed", key)


def endpoints_of(replicas: Sequence[RunningReplica]) -> list[ReplicaEndpoint]:
    out = []
    for r in replicas:
        endpoint = ReplicaEndpoint.from_metadata(r.replica_id.unique_id, r.replica_metadata)
        if endpoint is not None:
            out.append(endpoint)
    return sorted(out, key=lambda e: e.replica_id)
