"""Instance selection for the P/D proxy: the upstreams of one kind and the policy that
picks among the healthy ones.

An UpstreamPool holds the configured instances of one kind (prefill or decode) in
configuration order; the proxy's health loop marks them healthy or not, and `pick`
asks the pool's SelectionPolicy to choose among the healthy ones. Policies are named
in configuration (`make_policy`): "round_robin" and "least_outstanding".
Everything here runs on the proxy's event loop and is not thread-safe.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

logger = logging.getLogger(__name__)


class UpstreamKind(str, Enum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(eq=False)
class Upstream:
    """One P or D instance as the proxy sees it; mutated only on the proxy's event loop.

    `healthy` is False until the first health probe answers 200.
    `outstanding` counts requests sent to it whose response is not closed yet.
    """

    url: str
    index: int  # position in the configured list: the tie-break order
    healthy: bool = False
    outstanding: int = 0


class SelectionPolicy(ABC):
    """Chooses the upstream for the next request of one kind (P or D)."""

    @abstractmethod
    def choose(self, candidates: Sequence[Upstream]) -> Upstream:
        """Return one of `candidates`: non-empty, healthy, in configuration order.

        Called once per attempt, on the event loop; may update the policy's own state.
        """


class RoundRobinPolicy(SelectionPolicy):
    """Cycles through the configured instances in order, skipping unhealthy ones."""

    def __init__(self) -> None:
        self._last_index = -1

    def choose(self, candidates: Sequence[Upstream]) -> Upstream:
        chosen = next((u for u in candidates if u.index > self._last_index), candidates[0])
        self._last_index = chosen.index
        return chosen


class LeastOutstandingPolicy(SelectionPolicy):
    """Picks the instance with the fewest in-flight requests; ties go to the earliest."""

    def choose(self, candidates: Sequence[Upstream]) -> Upstream:
        return min(candidates, key=lambda u: u.outstanding)


POLICIES: dict[str, type[SelectionPolicy]] = {
    "round_robin": RoundRobinPolicy,
    "least_outstanding": LeastOutstandingPolicy,
}


def make_policy(name: str) -> SelectionPolicy:
    """Build a policy by name; ValueError names the valid ones."""
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r} (choose from {', '.join(POLICIES)})")
    return POLICIES[name]()


class UpstreamPool:
    """The instances of one kind and the policy that picks among the healthy ones."""

    def __init__(self, kind: UpstreamKind, urls: Sequence[str], policy: SelectionPolicy) -> None:
        if not urls:
            raise ValueError(f"at least one {kind.value} URL is required")
        self.kind = kind
        self.policy = policy
        self.upstreams = [Upstream(url.rstrip("/"), i) for i, url in enumerate(urls)]

    def healthy(self) -> list[Upstream]:
        return [u for u in self.upstreams if u.healthy]

    def pick(self, exclude: Sequence[Upstream] = ()) -> Upstream | None:
        """The policy's choice among healthy instances not in `exclude`; None if none is left."""
        candidates = [u for u in self.healthy() if u not in exclude]
        return self.policy.choose(candidates) if candidates else None

    def set_health(self, upstream: Upstream, healthy: bool, reason: str = "") -> None:
        if upstream.healthy == healthy:
            return
        upstream.healthy = healthy
        if healthy:
            logger.info("%s instance %s is healthy again: re-admitted", self.kind.value, upstream.url)
        else:
            logger.warning("%s instance %s dropped from selection: %s", self.kind.value, upstream.url, reason)
