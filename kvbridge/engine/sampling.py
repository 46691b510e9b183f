"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds, logprobs."""

from __future__ import annotations

from typing import Sequence

import torch

from kvbridge.engine.outputs import TokenLogprob
from kvbridge.engine.sampling_params import SamplingParams


class Sampler:
    """Samples one token per row of logits. Per-request generators make seeded requests
    reproducible whatever else shares their batch."""

    def __init__(self, seed: int = 0) -> None:
        self._default = torch.Generator().manual_seed(seed)
        self._generators: dict[str, torch.Generator] = {}

    def forget(self, request_ids: Sequence[str] | set[str]) -> None:
        for rid in request_ids:
            self._generators.pop(rid, None)

    def _generator(self, request_id: str, params: SamplingParams) -> torch.Generator:
        if params.seed is None:
            return self._default
        gen = self._generators.get(request_id)
        if gen is None:
            gen = self._generators[request_id] = torch.Generator().manual_seed(params.seed)
        return gen

    def sample(self, logits: torch.Tensor, request_ids: Sequence[str],
               params: Sequence[SamplingParams]) -> tuple[list[int], list[TokenLogprob | None]]:
        """logits: [N, vocab] float32 on any device. Returns the tokens and, per row, the
        logprobs asked for (None where not asked)."""
        logits = logits.float().cpu()
        tokens = torch.argmax(logits, dim=-1).tolist()
        for row, (rid, sp) in enumerate(zip(request_ids, params)):
            if not sp.greedy:
                tokens[row] = self._sample_row(logits[row], sp, self._generator(rid, sp))
        logprobs: list[TokenLogprob | None] = [None] * len(tokens)
        want = [i for i, sp in enumerate(params) if sp.logprobs is not None]
        if want:
            lp = torch.log_softmax(logits[want], dim=-1)
            for j, row in enumerate(want):
                k = params[row].logprobs or 0
                top = torch.topk(lp[j], k) if k else None
                logprobs[row] = TokenLogprob(
                    token_id=tokens[row], logprob=float(lp[j, tokens[row]]),
                    top=tuple(zip(top.indices.tolist(), top.values.tolist())) if top is not None else ())
        return tokens, logprobs

    @staticmethod
    def _sample_row(row: torch.Tensor, sp: SamplingParams, gen: torch.Generator) -> int:
        scaled = row / sp.temperature
        if 0 < sp.top_k < scaled.numel():
            kth = torch.topk(scaled, sp.top_k).values[-1]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        if sp.top_p < 1.0:
            sorted_p, idx = torch.sort(probs, descending=True)
            cum = torch.cumsum(sorted_p, dim=-1)
            drop = cum - sorted_p > sp.top_p  # keep the smallest prefix whose mass reaches top_p
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, idx, sorted_p)
        return int(torch.multinomial(probs, 1, generator=gen).item())
