"""The autoscaling policy of the Ray application's two pools, as pure functions, and the two
class-callables Ray Serve's controller runs (`AutoscalingPolicy(policy_function=...)`).

Each engine replica reports its instance's `GET /kvbridge/load` figures as Serve custom
autoscaling metrics (`record_autoscaling_stats`, engine_replica.py); Serve averages them per
replica over `look_back_period_s` and hands them to the pool's policy, which answers a replica
count; Serve then clamps it to the pool's MIN:MAX bounds and applies its up/down-scale delays.

- prefill grows on its queue: the prompt tokens waiting to be prefilled, against
  `target_queued_tokens` per replica; and a queue whose oldest request has waited longer than
  `target_wait_s` asks for one more replica than there are.
- decode grows on its sequences against its KV capacity: the running (+ waiting) sequences
  against `target_running` per replica, and the KV blocks in use against `target_kv_usage` of
  the pool's blocks; sequences that keep waiting (on average at least one over the look-back)
  ask for one more replica.
- both shrink toward the least that covers their load (0 when idle; the MIN bound holds).
- a pool with no replica has no load to report: requests waiting in a Serve handle's queue for
  it (the router's wake calls, kvbridge/ray/ingress.py: a request found the pool empty) ask for
  at least one replica. Serve's own cold-start path does the same while the pool is at zero.

The module imports nothing but the standard library: Serve pickles it by value into its
controller.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# The figures an instance's /kvbridge/load answers that the policy reads (all numbers).
LOAD_FIELDS = ("running", "waiting", "queued_prompt_tokens", "oldest_wait_s", "kv_blocks_total",
               "kv_blocks_used", "leases_held", "draining")

DEFAULT_TARGET_QUEUED_TOKENS = 2048  # one engine step's default token budget
DEFAULT_TARGET_WAIT_S = 1.0
DEFAULT_TARGET_RUNNING = 16
DEFAULT_TARGET_KV_USAGE = 0.7


@dataclass(frozen=True)
class Load:
    """One replica's load, as its /kvbridge/load said (averaged by Serve over its look-back)."""

    running: float = 0.0
    waiting: float = 0.0
    queued_prompt_tokens: float = 0.0
    oldest_wait_s: float = 0.0
    kv_blocks_total: float = 0.0
    kv_blocks_used: float = 0.0
    leases_held: float = 0.0
    draining: float = 0.0

    @classmethod
    def from_figures(cls, figures: Mapping[str, float]) -> Load:
        return cls(**{k: float(figures[k]) for k in LOAD_FIELDS if k in figures})


def prefill_replicas(loads: Sequence[Load], current: int, target_queued_tokens: float = DEFAULT_TARGET_QUEUED_TOKENS,
                     target_wait_s: float = DEFAULT_TARGET_WAIT_S) -> int:
    """The prefill pool's replica count for `loads` (one per serving replica; `current`: the
    replicas there are now). Draining replicas do not count."""
    if target_queued_tokens <= 0 or target_wait_s <= 0:
        raise ValueError("targets must be positive")
    live = [x for x in loads if not x.draining]
    tokens = sum(x.queued_prompt_tokens for x in live)
    want = math.ceil(tokens / target_queued_tokens)
    if any(x.oldest_wait_s > target_wait_s for x in live):
        want = max(want, current + 1)
    if any(x.running or x.waiting for x in live):
        want = max(want, 1)
    return want


def decode_replicas(loads: Sequence[Load], current: int, target_running: float = DEFAULT_TARGET_RUNNING,
                    target_kv_usage: float = DEFAULT_TARGET_KV_USAGE) -> int:
    """The decode pool's replica count for `loads` (as prefill_replicas)."""
    if target_running <= 0 or not 0 < target_kv_usage <= 1:
        raise ValueError("target_running must be positive and target_kv_usage in (0, 1]")
    live = [x for x in loads if not x.draining]
    sequences = sum(x.running + x.waiting for x in live)
    want = math.ceil(sequences / target_running)
    total = sum(x.kv_blocks_total for x in live)
    if total > 0:
        used = sum(x.kv_blocks_used for x in live)
        want = max(want, math.ceil(len(live) * (used / total) / target_kv_usage))
    if any(x.waiting >= 1 for x in live):  # a sequence waiting the whole look-back (not a request's moment in line)
        want = max(want, current + 1)
    return want


def loads_from_metrics(aggregated: Mapping[str, Mapping[Any, float]] | None, replicas: Sequence[Any]) -> list[Load]:
    """Serve's aggregated custom metrics ({metric: {replica id: value}}) as one Load per replica
    of `replicas` that reported any (a replica that has not reported yet counts as idle)."""
    aggregated = aggregated or {}
    out = []
    for rid in replicas:
        figures = {name: values[rid] for name, values in aggregated.items() if rid in values}
        out.append(Load.from_figures(figures))
    return out


def with_queued(want: int, queued_requests: float) -> int:
    """`want`, and at least one replica while requests wait in a handle's queue for the pool
    (Serve's `total_queued_requests`: the router's wake calls to a pool at zero)."""
    return max(want, 1) if queued_requests > 0 else want


class PrefillPolicy:
    """Serve's policy for the prefill deployment (class-callable: `policy_kwargs` are these
    arguments). Returns (replicas wanted, state); Serve applies the bounds and delays."""

    def __init__(self, target_queued_tokens: float = DEFAULT_TARGET_QUEUED_TOKENS,
                 target_wait_s: float = DEFAULT_TARGET_WAIT_S) -> None:
        self.target_queued_tokens, self.target_wait_s = target_queued_tokens, target_wait_s

    def __call__(self, ctx: Any) -> tuple[int, dict]:
        loads = loads_from_metrics(ctx.aggregated_metrics, ctx.running_replicas)
        want = prefill_replicas(loads, ctx.current_num_replicas, self.target_queued_tokens, self.target_wait_s)
        return with_queued(want, ctx.total_queued_requests), {}


class DecodePolicy:
    """Serve's policy for the decode deployment (as PrefillPolicy)."""

    def __init__(self, target_running: float = DEFAULT_TARGET_RUNNING,
                 target_kv_usage: float = DEFAULT_TARGET_KV_USAGE) -> None:
        self.target_running, self.target_kv_usage = target_running, target_kv_usage

    def __call__(self, ctx: Any) -> tuple[int, dict]:
        loads = loads_from_metrics(ctx.aggregated_metrics, ctx.running_replicas)
        want = decode_replicas(loads, ctx.current_num_replicas, self.target_running, self.target_kv_usage)
        return with_queued(want, ctx.total_queued_requests), {}
