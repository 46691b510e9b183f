"""One token's logprob as the engine reports it (sampled tokens' and prompt tokens')."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token_id, logprob), best first
    rank: int | None = None  # of token_id among the vocabulary (1: the likeliest); prompt logprobs only
