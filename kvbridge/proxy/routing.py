"""Instance selection for the P/D proxy: the upstreams of one kind and the policy that
picks among the healthy ones.

An UpstreamPool holds the configured instances of one kind (prefill or decode) in
configuration order; the proxy's health loop marks them healthy or not, and `pick`
asks the pool's SelectionPolicy to choose among the healthy ones. Policies are named
in configuration (`make_policy`): "round_robin", "least_outstanding" and "prefix" (prefix
affinity with a load guard).

Each upstream also has a CircuitBreaker fed by the outcome of the requests sent to it (the
health loop is separate and unchanged): after `failure_threshold` consecutive failures it
opens and the pool skips the upstream; after `cooldown_s` it lets one request through
(half-open); that request's success closes it, its failure opens it again.
Everything here runs on the proxy's event loop and is not thread-safe.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum

logger = logging.getLogger(__name__)


class UpstreamKind(str, Enum):
    PREFILL = "prefill"
    DECODE = "decode"


class BreakerState(str, Enum):
    CLOSED = "closed"  # requests flow
    OPEN = "open"  # skipped until the cool-down ends
    HALF_OPEN = "half_open"  # one probe request at a time decides

    @property
    def gauge(self) -> int:
        return {BreakerState.CLOSED: 0, BreakerState.HALF_OPEN: 1, BreakerState.OPEN: 2}[self]


@dataclass
class CircuitBreaker:
    """Consecutive request failures of one upstream (module docstring)."""

    failure_threshold: int = 5
    cooldown_s: float = 10.0
    state: BreakerState = BreakerState.CLOSED
    failures: int = 0  # consecutive
    opened_at: float = 0.0
    probing: bool = False  # HALF_OPEN: the probe request is in flight
    probe_sent_at: float = 0.0

    def __post_init__(self) -> None:
        if self.failure_threshold < 1 or self.cooldown_s < 0:
            raise ValueError("a breaker needs failure_threshold >= 1 and cooldown_s >= 0")

    def allows(self, now: float) -> bool:
        """Whether a request may be sent now (an OPEN breaker past its cool-down turns HALF_OPEN)."""
        if self.state is BreakerState.OPEN and now - self.opened_at >= self.cooldown_s:
            self.state, self.probing = BreakerState.HALF_OPEN, False
        if self.state is BreakerState.HALF_OPEN:
            # A probe whose outcome never came back (its client hung up) does not block forever.
            return not self.probing or now - self.probe_sent_at >= self.cooldown_s
        return self.state is BreakerState.CLOSED

    def on_send(self, now: float) -> None:
        if self.state is BreakerState.HALF_OPEN:
            self.probing, self.probe_sent_at = True, now

    def on_unsent(self) -> None:
        """The send `on_send` counted never left the proxy (the request could not be sent): no
        verdict on the upstream; a half-open breaker's probe slot is free again."""
        self.probing = False

    def record_success(self) -> None:
        self.state, self.failures, self.probing = BreakerState.CLOSED, 0, False

    def record_failure(self, now: float) -> bool:
        """Count a failure; True when it opened the breaker."""
        self.failures += 1
        if self.state is BreakerState.HALF_OPEN or self.failures >= self.failure_threshold:
            opened = self.state is not BreakerState.OPEN
            self.state, self.opened_at, self.probing = BreakerState.OPEN, now, False
            return opened
        return False


@dataclass(eq=False)
class Upstream:
    """One P or D instance as the proxy sees it; mutated only on the proxy's event loop.

    `healthy` is False until the first health probe answers 200.
    `outstanding` counts requests sent to it whose response is not closed yet.
    `missed_probes`: late /health answers in a row (health.py drops it after a few).
    `context_len`: its max_model_len as its /v1/models said (0: it did not say); None until it
    answered the proxy's question, and again once it is dropped as unhealthy (it may come back
    with another).
    """

    url: str
    index: int  # position in the configured list: the tie-break order
    healthy: bool = False
    outstanding: int = 0
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)
    context_len: int | None = None
    missed_probes: int = 0  # /health probes in a row that timed out (health.py)


@dataclass(frozen=True)
class KvCosts:
    """The fleet view's costs for one request (kv_routing.py): `by_url`, each instance's cost from
    its cached overlap and its last reported load; `per_outstanding`, what each request this proxy
    has in flight on an instance adds (its reports lag: without it, every request of a burst would
    go to the instance that was cheapest at the last report)."""

    by_url: Mapping[str, float]
    per_outstanding: float = 0.0


class SelectionPolicy(ABC):
    """Chooses the upstream for the next request of one kind (P or D)."""

    name = ""  # its configuration name (POLICIES), for traces

    @abstractmethod
    def choose(self, candidates: Sequence[Upstream], prompt: str = "",
               costs: KvCosts | None = None) -> Upstream:
        """Return one of `candidates`: non-empty, healthy, in configuration order. `prompt`:
        the request's prompt text (PrefixAffinityPolicy uses it); `costs`: the fleet view's cost
        per candidate URL when it could predict the request (KvAwarePolicy uses them; the others
        ignore them).

        Called once per attempt, on the event loop; may update the policy's own state.
        """


class RoundRobinPolicy(SelectionPolicy):
    """Cycles through the configured instances in order, skipping unhealthy ones."""

    name = "round_robin"

    def __init__(self) -> None:
        self._last_index = -1

    def choose(self, candidates: Sequence[Upstream], prompt: str = "",
               costs: KvCosts | None = None) -> Upstream:
        chosen = next((u for u in candidates if u.index > self._last_index), candidates[0])
        self._last_index = chosen.index
        return chosen


class LeastOutstandingPolicy(SelectionPolicy):
    """Picks the instance with the fewest in-flight requests; ties go to the earliest."""

    name = "least_outstanding"

    def choose(self, candidates: Sequence[Upstream], prompt: str = "",
               costs: KvCosts | None = None) -> Upstream:
        return min(candidates, key=lambda u: u.outstanding)


class PrefixAffinityPolicy(SelectionPolicy):
    """Sends requests sharing a prompt prefix to the instance that served it last, so that
    instance's prefix cache hits; least-outstanding otherwise, and whenever the affine instance
    is overloaded.

    The prompt text is cut into blocks of `block_chars` characters (the proxy has no tokenizer;
    64 characters are roughly 16 tokens, a block of the engine's prefix cache) and each block
    is keyed by a chained hash of the text up to its end, so equal keys mean equal prefixes
    (SGLang's router keeps a radix tree of characters to the same end). A table of at most
    `max_entries` keys (least recently used evicted) remembers the instance each prefix was
    sent to. A request goes to the candidate remembered for its longest known prefix unless
    that one has more than `imbalance` requests in flight beyond the least-loaded candidate
    (the load guard: one hot prefix cannot swamp one instance); then, or with no known prefix,
    to the least-loaded. Every block key of the request then points at the chosen instance.
    `last_match_blocks`: how many prompt blocks the last choice's instance was remembered for
    (0: no known prefix, or the load guard chose another), for traces."""

    name = "prefix"

    def __init__(self, block_chars: int = 64, max_blocks: int = 256, max_entries: int = 65536,
                 imbalance: int = 4) -> None:
        if min(block_chars, max_blocks, max_entries) < 1 or imbalance < 0:
            raise ValueError("block_chars, max_blocks and max_entries must be >= 1, imbalance >= 0")
        self.block_chars, self.max_blocks, self.max_entries, self.imbalance = (
            block_chars, max_blocks, max_entries, imbalance)
        self._owner: OrderedDict[int, str] = OrderedDict()  # prefix key -> upstream URL
        self.hits = 0  # requests sent to the instance remembered for their prefix
        self.last_match_blocks = 0

    def prefix_keys(self, prompt: str) -> list[int]:
        """Chained hashes of the prompt's whole blocks of characters, at most max_blocks."""
        keys, parent = [], 0
        for i in range(min(len(prompt) // self.block_chars, self.max_blocks)):
            parent = hash((parent, prompt[i * self.block_chars:(i + 1) * self.block_chars]))
            keys.append(parent)
        return keys

    def choose(self, candidates: Sequence[Upstream], prompt: str = "",
               costs: KvCosts | None = None) -> Upstream:
        least = min(candidates, key=lambda u: u.outstanding)
        keys = self.prefix_keys(prompt)
        by_url = {u.url: u for u in candidates}
        matched, affine = 0, None  # the longest known prefix among the candidates
        for i in range(len(keys) - 1, -1, -1):
            url = self._owner.get(keys[i])
            if url in by_url:
                matched, affine = i + 1, by_url[url]
                break
        chosen, self.last_match_blocks = least, 0
        if affine is not None and affine.outstanding - least.outstanding <= self.imbalance:
            chosen, self.last_match_blocks = affine, matched
            self.hits += 1
        for k in keys:
            self._owner[k] = chosen.url
            self._owner.move_to_end(k)
        while len(self._owner) > self.max_entries:
            self._owner.popitem(last=False)
        return chosen


class KvAwarePolicy(SelectionPolicy):
    """The lowest cost the fleet view computed for the request (kv_cost.py: the instance's
    cached overlap from its KV events and its reported load, plus the requests in flight there);
    ties, and a request without costs (no prediction: events off, a prompt list), go to the
    fewest in-flight requests."""

    name = "kv_aware"

    def choose(self, candidates: Sequence[Upstream], prompt: str = "",
               costs: KvCosts | None = None) -> Upstream:
        if costs is None:
            return min(candidates, key=lambda u: u.outstanding)
        by_url, each = costs.by_url, costs.per_outstanding
        return min(candidates, key=lambda u: (by_url.get(u.url, float("inf")) + each * u.outstanding, u.outstanding))


POLICIES: dict[str, type[SelectionPolicy]] = {
    "round_robin": RoundRobinPolicy,
    "least_outstanding": LeastOutstandingPolicy,
    "prefix": PrefixAffinityPolicy,
    "kv_aware": KvAwarePolicy,
}


def make_policy(name: str) -> SelectionPolicy:
    """Build a policy by name; ValueError names the valid ones."""
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r} (choose from {', '.join(POLICIES)})")
    return POLICIES[name]()


class UpstreamPool:
    """The instances of one kind and the policy that picks among the healthy ones.

    `dynamic`: the membership follows a discovery source (`set_members`, e.g. Ray Serve's
    replica list, kvbridge/ray/) and may be empty; otherwise `urls` is fixed and non-empty."""

    def __init__(self, kind: UpstreamKind, urls: Sequence[str], policy: SelectionPolicy,
                 breaker_failures: int = 5, breaker_cooldown_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic, dynamic: bool = False) -> None:
        if not urls and not dynamic:
            raise ValueError(f"at least one {kind.value} URL is required")
        self.kind = kind
        self.policy = policy
        self.clock = clock
        self.dynamic = dynamic
        self._breaker = (breaker_failures, breaker_cooldown_s)
        self.upstreams = [Upstream(url.rstrip("/"), i, breaker=CircuitBreaker(breaker_failures, breaker_cooldown_s))
                          for i, url in enumerate(urls)]
        self._next_index = len(self.upstreams)

    def set_members(self, urls: Sequence[str]) -> tuple[list[Upstream], list[Upstream]]:
        """Make `urls` the pool's instances: (added, removed). An instance that stays keeps its
        Upstream (health, breaker, outstanding count); a new one starts unhealthy (the health loop
        admits it) and sorts after every earlier one; a removed one is no longer picked, while
        the requests already sent to it finish on their own."""
        wanted = list(dict.fromkeys(url.rstrip("/") for url in urls))
        by_url = {u.url: u for u in self.upstreams}
        added = []
        for url in wanted:
            if url not in by_url:
                by_url[url] = Upstream(url, self._next_index, breaker=CircuitBreaker(*self._breaker))
                self._next_index += 1
                added.append(by_url[url])
        keep = set(wanted)
        removed = [u for u in self.upstreams if u.url not in keep]
        self.upstreams = sorted((by_url[url] for url in wanted), key=lambda u: u.index)
        for u in added:
            logger.info("%s instance %s joined the pool", self.kind.value, u.url)
        for u in removed:
            logger.info("%s instance %s left the pool", self.kind.value, u.url)
        return added, removed

    def healthy(self) -> list[Upstream]:
        return [u for u in self.upstreams if u.healthy]

    def pick(self, exclude: Sequence[Upstream] = (), prompt: str = "",
             costs: KvCosts | None = None) -> Upstream | None:
        """The policy's choice among healthy instances not in `exclude` whose breaker lets a
        request through (`prompt`: the request's prompt text, for the prefix policy); None if
        none is left. The chosen one's breaker counts the send."""
        now = self.clock()
        candidates = [u for u in self.healthy() if u not in exclude and u.breaker.allows(now)]
        if not candidates:
            return None
        chosen = self.policy.choose(candidates, prompt, costs)
        chosen.breaker.on_send(now)
        return chosen

    def can_pick(self, exclude: Sequence[Upstream] = ()) -> bool:
        """Whether `pick(exclude)` would find an instance (counts no send)."""
        now = self.clock()
        return any(u not in exclude and u.breaker.allows(now) for u in self.healthy())

    def record(self, upstream: Upstream, ok: bool, reason: str = "") -> None:
        """A request's outcome on `upstream`, for its breaker."""
        if ok:
            if upstream.breaker.state is not BreakerState.CLOSED:
                logger.info("%s instance %s: circuit closed again", self.kind.value, upstream.url)
            upstream.breaker.record_success()
        elif upstream.breaker.record_failure(self.clock()):
            logger.warning("%s instance %s: circuit opened after %d consecutive failures (%s); skipped for %.1f s",
                           self.kind.value, upstream.url, upstream.breaker.failures, reason,
                           upstream.breaker.cooldown_s)

    def set_health(self, upstream: Upstream, healthy: bool, reason: str = "") -> None:
        if upstream.healthy == healthy:
            return
        upstream.healthy = healthy
        if not healthy:
            upstream.context_len = None
        if healthy:
            logger.info("%s instance %s is healthy again: re-admitted", self.kind.value, upstream.url)
        else:
            logger.warning("%s instance %s dropped from selection: %s", self.kind.value, upstream.url, reason)
