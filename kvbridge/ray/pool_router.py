"""The request router of the prefill and decode deployments (discovery.py says why). Serve
pickles this module by value into every process that holds a handle, so it holds nothing but
the class: the registry it publishes to is discovery's, imported by reference."""

from __future__ import annotations

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from kvbridge.ray import discovery


class PoolRouter(FIFOMixin, RequestRouter):
    """The request router of the prefill and decode deployments: publishes their replicas to
    the ingress (module docstring). Calls made through a handle (tests, `info`) go to any
    replica; the pools' generation requests never pass through it."""

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        deployment_id = self._deployment_id
        discovery.publish((deployment_id.app_name, deployment_id.name), discovery.endpoints_of(replicas))

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        return [candidate_replicas]
