"""Per-request sampling parameters, validated once at construction."""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvbridge.engine.structured import StructuredSpec

# Temperatures below this sample greedily (vLLM's epsilon). Colder than this, sampling is
# argmax but for near-ties, and dividing float32 logits by a temperature such as 1e-300
# overflows to inf, whose softmax is NaN: torch.multinomial then raises.
GREEDY_TEMPERATURE = 1e-5
# torch.Generator.manual_seed takes any 64-bit value, signed or unsigned.
SEED_MIN, SEED_MAX = -(2 ** 63), 2 ** 64 - 1
# logit_bias values are clamped to this magnitude (OpenAI's range, vLLM's clamp).
MAX_LOGIT_BIAS = 100.0


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 (or below GREEDY_TEMPERATURE) means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means disabled
    min_p: float = 0.0  # drop tokens less likely than min_p x the likeliest one's probability; 0 disables it
    repetition_penalty: float = 1.0  # > 1 discourages the prompt's and output's tokens (vLLM's rule); 1 disables it
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs to return per token; None: none
    include_stop_str_in_output: bool = False
    # Until this many tokens were generated, stop_token_ids cannot be sampled (vLLM's min_tokens;
    # the server folds the model's end-of-generation ids into stop_token_ids unless ignore_eos).
    min_tokens: int = 0
    # (token id, bias) pairs added to the logits before sampling (OpenAI's logit_bias, clamped to
    # +-MAX_LOGIT_BIAS); logprobs stay the model's, as vLLM returns them by default.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # vLLM's prompt_logprobs: the logprob (and rank) of each prompt token after the first, given
    # the tokens before it, with this many top alternatives; None: none. Such a request computes its
    # whole prompt (no prefix-cache hit, no KV read from another instance), as in vLLM.
    prompt_logprobs: int | None = None
    # Structured output (engine/structured.py): what the generated text must match; None: anything.
    structured: StructuredSpec | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be finite and non-negative, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be non-negative (0 disables it), got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError(f"repetition_penalty must be finite and positive, got {self.repetition_penalty}")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise ValueError(f"seed must fit in 64 bits ({SEED_MIN} to {SEED_MAX}), got {self.seed}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be between 0 and 20, got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise ValueError(f"prompt_logprobs must be between 0 and 20, got {self.prompt_logprobs}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be between 0 and max_tokens={self.max_tokens}, got {self.min_tokens}")
        if any(t < 0 or not (math.isfinite(b) and abs(b) <= MAX_LOGIT_BIAS) for t, b in self.logit_bias):
            raise ValueError(f"logit_bias needs token ids >= 0 and biases within +-{MAX_LOGIT_BIAS}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def penalises_repetition(self) -> bool:
        return self.repetition_penalty != 1.0

    @property
    def shapes_logits(self) -> bool:
        """Whether the sampler changes this request's logits before sampling (logit_bias or min_tokens)."""
        return bool(self.logit_bias) or self.min_tokens > 0
