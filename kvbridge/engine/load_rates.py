"""An instance's measured rates for a router's cost model (GET /kvbridge/load): exponentially
weighted moving averages over recent steps and loads.

- prefill tokens per second: prompt tokens a step computed / the step's compute time, over steps
  where prompt tokens were most of the step's tokens and at least MIN_PREFILL_SAMPLE_TOKENS (a
  step that also decodes counts whole: the decodes ride along);
- seconds per decode step: the compute time of the other steps (output tokens, and D's one
  recomputed prompt token per loaded request, riding in a batch of decodes or alone: a step of a
  few tokens costs what a decode step costs, and read as a prefill rate it would be a small
  fraction of the real one);
- KV pull bytes per second: bytes a completed remote load read / its time from parking to done.

Each is None until measured once. Not thread-safe: the engine thread updates it and snapshots it
into the EngineLoad other threads read.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_ALPHA = 0.2  # weight of the newest sample
MIN_PREFILL_SAMPLE_TOKENS = 32  # fewer prompt tokens in a step: a decode-like step (module docstring)


@dataclass(frozen=True)
class LoadRates:
    prefill_tokens_per_s: float | None = None
    decode_step_s: float | None = None
    kv_pull_bytes_per_s: float | None = None


def _ewma(old: float | None, sample: float, alpha: float) -> float:
    return sample if old is None else (1.0 - alpha) * old + alpha * sample


class LoadRateMeter:
    def __init__(self, alpha: float = DEFAULT_ALPHA) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.alpha = alpha
        self.rates = LoadRates()
        self.tier_bytes_per_s: float | None = None  # one rank's KV tier reads (engine/kv_tier.py)

    def record_tier_load(self, seconds: float, nbytes: int) -> None:
        """One step's KV tier loads read and verified `nbytes` (one rank's) in `seconds`."""
        if seconds > 0.0 and nbytes > 0:
            self.tier_bytes_per_s = _ewma(self.tier_bytes_per_s, nbytes / seconds, self.alpha)

    def tier_load_faster(self, tokens: int, bytes_per_token: float) -> bool:
        """Whether loading `tokens` tokens' KV from the tier (`bytes_per_token` on one rank; a step's wait
        included) is predicted faster than computing them; True until both rates are measured."""
        prefill = self.rates.prefill_tokens_per_s
        if prefill is None or self.tier_bytes_per_s is None:
            return True
        return tokens * bytes_per_token / self.tier_bytes_per_s + (self.rates.decode_step_s or 0.0) < tokens / prefill

    def record_step(self, seconds: float, prefill_tokens: int, decode_tokens: int) -> None:
        """One step's compute: `seconds` of it, computing `prefill_tokens` prompt tokens and
        `decode_tokens` output tokens. A step with no tokens, or no time, measures nothing."""
        if seconds <= 0.0:
            return
        r = self.rates
        if prefill_tokens >= MIN_PREFILL_SAMPLE_TOKENS and prefill_tokens >= decode_tokens:
            self.rates = LoadRates(_ewma(r.prefill_tokens_per_s, prefill_tokens / seconds, self.alpha),
                                   r.decode_step_s, r.kv_pull_bytes_per_s)
        elif decode_tokens > 0 or prefill_tokens > 0:  # a few prompt tokens would read as a slow prefill
            self.rates = LoadRates(r.prefill_tokens_per_s, _ewma(r.decode_step_s, seconds, self.alpha),
                                   r.kv_pull_bytes_per_s)

    def record_pull(self, seconds: float, nbytes: int) -> None:
        """A remote load read `nbytes` in `seconds` (parked -> loaded)."""
        if seconds <= 0.0 or nbytes <= 0:
            return
        r = self.rates
        self.rates = LoadRates(r.prefill_tokens_per_s, r.decode_step_s,
                               _ewma(r.kv_pull_bytes_per_s, nbytes / seconds, self.alpha))
