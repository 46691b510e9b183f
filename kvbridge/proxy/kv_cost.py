"""KV-aware costs and the per-request P/D decision, as pure functions of what the fleet reports
(an instance's /kvbridge/load and the fleet index's cached overlap). Not yet wired into routing.py.

Worker cost (Dynamo's KV router as the reference), lowest wins, ties to the first candidate:

    cost = prefill_load_scale * (max(prompt_blocks - overlap_blocks, 0) + queued_prefill_blocks)
           + decode_blocks

  prompt_blocks          the request's blocks (ceil(prompt tokens / block_size))
  overlap_blocks         its leading blocks the instance holds (fleet index)
  queued_prefill_blocks  ceil(load.waiting_prefill_tokens / block_size)
  decode_blocks          load.kv_blocks_total - load.kv_blocks_free (KV in use)
  prefill_load_scale     1.0 by default

P/D per request (`pd_mode`): `always` and `never` are forced; `auto` compares
  (a) D prefills what it lacks itself: uncached_d / d.prefill_tokens_per_s, times
      (1 + interference * d.running) for the step time its running streams lose (interference 0.1);
  (b) P's queue (p.waiting_prefill_tokens / rate_P) + P's prefill of what it lacks
      (uncached_p / rate_P) + the transfer of what D lacks (uncached_d * kv_bytes_per_token /
      d.kv_pull_bytes_per_s);
  cheaper wins (reason `cost`; a prompt D holds whole: `cached`); a rate not measured yet means
  `prefill_decode` with reason `no_measured_rate`. For comparison, `static` (Dynamo's rule:
  decode-only when the effective input length, what D lacks, is under 2048 tokens and under 0.7
  of the prompt) and `threshold` (llm-d's: decode-only when the non-cached tokens are under a
  threshold, 256 here).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

PREFILL_LOAD_SCALE = 1.0
INTERFERENCE = 0.1
STATIC_MAX_ISL = 2048
STATIC_MAX_FRACTION = 0.7
THRESHOLD_TOKENS = 256

Path = Literal["prefill_decode", "decode_only"]
PdMode = Literal["always", "never", "auto", "static", "threshold"]  # kv_routing.py says what each does
PD_MODES: tuple[PdMode, ...] = ("always", "never", "auto", "static", "threshold")


@dataclass(frozen=True)
class Load:
    """An instance's GET /kvbridge/load."""

    waiting: int
    waiting_prefill_tokens: int
    running: int
    kv_blocks_total: int
    kv_blocks_free: int
    prefill_tokens_per_s: float | None
    decode_step_s: float | None
    kv_pull_bytes_per_s: float | None
    kv_bytes_per_token: int

    @classmethod
    def from_json(cls, body: Mapping[str, object]) -> Load:
        """ValueError when a field is missing or of the wrong type."""
        return cls(waiting=_count(body, "waiting"), waiting_prefill_tokens=_count(body, "waiting_prefill_tokens"),
                   running=_count(body, "running"), kv_blocks_total=_count(body, "kv_blocks_total"),
                   kv_blocks_free=_count(body, "kv_blocks_free"),
                   prefill_tokens_per_s=_rate(body, "prefill_tokens_per_s"),
                   decode_step_s=_rate(body, "decode_step_s"), kv_pull_bytes_per_s=_rate(body, "kv_pull_bytes_per_s"),
                   kv_bytes_per_token=_count(body, "kv_bytes_per_token"))


def _count(body: Mapping[str, object], key: str) -> int:
    value = body.get(key)
    if type(value) is not int or value < 0:
        raise ValueError(f"/kvbridge/load: {key} must be a non-negative integer, got {value!r}")
    return value


def _rate(body: Mapping[str, object], key: str) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
        raise ValueError(f"/kvbridge/load: {key} must be a non-negative number or null, got {value!r}")
    return float(value)


def cost(prompt_tokens: int, overlap_blocks: int, load: Load, block_size: int,
         prefill_load_scale: float = PREFILL_LOAD_SCALE) -> float:
    """The worker cost above for one candidate."""
    prompt_blocks = math.ceil(prompt_tokens / block_size)
    queued = math.ceil(load.waiting_prefill_tokens / block_size)
    decode_blocks = max(load.kv_blocks_total - load.kv_blocks_free, 0)
    return prefill_load_scale * (max(prompt_blocks - overlap_blocks, 0) + queued) + decode_blocks


def cheapest(costs: Sequence[float]) -> int:
    """The index of the lowest cost (the first of equals); ValueError when there is none."""
    if not costs:
        raise ValueError("no candidate")
    return min(range(len(costs)), key=lambda i: (costs[i], i))


@dataclass(frozen=True)
class Decision:
    path: Path
    reason: str


def decide_auto(prompt_tokens: int, cached_d: int, cached_p: int, d: Load, p: Load,
                interference: float = INTERFERENCE, held: int = 0) -> Decision:
    """`auto`: the cheaper of D prefilling alone and P then D (module docstring). `held`: the longest
    prefix another instance holds, which either path reads instead of computing (KV reuse: D alone
    pulls what it lacks of it at its pull rate, P computes only what follows it); 0 without reuse."""
    uncached_d = max(prompt_tokens - cached_d, 0)
    uncached_p = max(prompt_tokens - max(cached_p, held), 0)
    if uncached_d == 0:
        return Decision("decode_only", "cached")
    rate_d, rate_p, pull = d.prefill_tokens_per_s, p.prefill_tokens_per_s, d.kv_pull_bytes_per_s
    if not rate_d or not rate_p or not pull:
        return Decision("prefill_decode", "no_measured_rate")
    local = (max(prompt_tokens - max(cached_d, held), 0) / rate_d * (1 + interference * d.running)
             + max(held - cached_d, 0) * d.kv_bytes_per_token / pull)
    remote = (p.waiting_prefill_tokens + uncached_p) / rate_p + uncached_d * d.kv_bytes_per_token / pull
    return Decision("decode_only" if local <= remote else "prefill_decode", "cost")


def decide_static(prompt_tokens: int, cached_d: int, max_isl: int = STATIC_MAX_ISL,
                  max_fraction: float = STATIC_MAX_FRACTION) -> Decision:
    """Dynamo's static rule: decode-only when what D lacks is short, absolutely and relatively."""
    effective = max(prompt_tokens - cached_d, 0)
    local = effective < max_isl and effective < max_fraction * prompt_tokens
    return Decision("decode_only" if local else "prefill_decode", "static")


def decide_threshold(prompt_tokens: int, cached_d: int, threshold: int = THRESHOLD_TOKENS) -> Decision:
    """llm-d's rule: decode-only when the non-cached tokens are under `threshold`."""
    return Decision("decode_only" if prompt_tokens - cached_d < threshold else "prefill_decode", "threshold")
