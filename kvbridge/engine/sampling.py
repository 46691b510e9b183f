"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds, logprobs."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Sequence

import torch

from kvbridge.engine.outputs import TokenLogprob
from kvbridge.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class SamplerOutput:
    """Per request id: its token, or why none could be sampled (then it has no token)."""

    tokens: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)  # only where asked for
    errors: dict[str, str] = field(default_factory=dict)


class Sampler:
    """Samples one token per row of logits. Per-request generators make seeded requests
    reproducible whatever else shares their batch. A row that cannot be sampled (e.g. NaN
    logits) fails only its own request: the error is reported, never raised."""

    def __init__(self, seed: int = 0) -> None:
        self._default = torch.Generator().manual_seed(seed)
        self._generators: dict[str, torch.Generator] = {}

    def forget(self, request_ids: Sequence[str] | set[str]) -> None:
        for rid in request_ids:
            self._generators.pop(rid, None)

    def _generator(self, request_id: str, params: SamplingParams, sampled_before: int,
                   vocab: int) -> torch.Generator:
        """The request's generator. A seeded request's first generator here is advanced past
        `sampled_before` draws: tokens another engine sampled from the same seed (a prefill's
        first token), so the sequence equals one engine's."""
        if params.seed is None:
            return self._default
        gen = self._generators.get(request_id)
        if gen is None:
            gen = self._generators[request_id] = torch.Generator().manual_seed(params.seed)
            for _ in range(sampled_before):
                skip_draw(gen, vocab)
        return gen

    def sample(self, logits: torch.Tensor, request_ids: Sequence[str], params: Sequence[SamplingParams],
               sampled_before: Sequence[int] | None = None) -> SamplerOutput:
        """logits: [N, vocab] on any device, one row per request. `sampled_before`: per row,
        the request's output tokens so far (its generator's offset; all 0 if None)."""
        logits = logits.float().cpu()
        before = sampled_before if sampled_before is not None else [0] * len(request_ids)
        out = SamplerOutput()
        # argmax over the greedy rows only (2.6 ms at 64 rows of a 49,152-entry vocabulary here).
        greedy_rows = [row for row, sp in enumerate(params) if sp.greedy]
        greedy = dict(zip(greedy_rows, torch.argmax(logits[greedy_rows], dim=-1).tolist())) if greedy_rows else {}
        drawn = self._sample_plain_rows(logits, params)
        for row, (rid, sp) in enumerate(zip(request_ids, params)):
            try:
                if sp.greedy:
                    out.tokens[rid] = greedy[row]
                elif row in drawn:
                    out.tokens[rid] = drawn[row]
                else:
                    out.tokens[rid] = self._sample_row(logits[row], sp,
                                                       self._generator(rid, sp, before[row], logits.shape[-1]))
            except Exception as exc:  # this request's failure, not the batch's
                logger.warning("request %s: sampling failed: %s", rid, exc)
                out.errors[rid] = f"sampling the next token failed: {exc}"
        want = [i for i, (rid, sp) in enumerate(zip(request_ids, params))
                if sp.logprobs is not None and rid in out.tokens]
        if want:
            lp = torch.log_softmax(logits[want], dim=-1)
            for j, row in enumerate(want):
                rid, k = request_ids[row], params[row].logprobs or 0
                top = torch.topk(lp[j], k) if k else None
                out.logprobs[rid] = TokenLogprob(
                    token_id=out.tokens[rid], logprob=float(lp[j, out.tokens[rid]]),
                    top=tuple(zip(top.indices.tolist(), top.values.tolist())) if top is not None else ())
        return out

    def _sample_plain_rows(self, logits: torch.Tensor, params: Sequence[SamplingParams]) -> dict[int, int]:
        """Row -> token for the rows that draw from the shared generator with temperature only (no
        seed, top-k or top-p: e.g. every request of `vllm bench serve`), all at once: one softmax
        over those rows and one uniform per row, inverted through the row's cumulative
        probabilities. Sampling them one by one (`torch.multinomial` draws one exponential per
        vocabulary entry) took a sixth of a 64-sequence decode step. A row whose probabilities
        are not finite is left out, for `_sample_row` to fail alone."""
        vocab = logits.shape[-1]
        rows = [i for i, sp in enumerate(params)
                if not sp.greedy and sp.seed is None and not 0 < sp.top_k < vocab and sp.top_p >= 1.0]
        if not rows:
            return {}
        temperatures = torch.tensor([params[i].temperature for i in rows], dtype=torch.float32)
        probs = torch.softmax(logits[rows] / temperatures[:, None], dim=-1)
        cumulative = probs.double().cumsum_(dim=-1)
        total = cumulative[:, -1]
        targets = torch.rand(len(rows), dtype=torch.float64, generator=self._default) * total
        # The first entry whose cumulative mass exceeds the target: zero-probability entries never are.
        tokens = torch.searchsorted(cumulative, targets[:, None], right=True)[:, 0].clamp_(max=vocab - 1)
        ok = (torch.isfinite(total) & (total > 0)).tolist()
        return {i: t for i, t, good in zip(rows, tokens.tolist(), ok) if good}

    @staticmethod
    def _sample_row(row: torch.Tensor, sp: SamplingParams, gen: torch.Generator) -> int:
        # sp.temperature >= GREEDY_TEMPERATURE here: finite logits stay finite (a huge
        # temperature rounds to inf in float32 and flattens them to 0, a uniform draw).
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


def skip_draw(gen: torch.Generator, vocab: int) -> None:
    """Advance `gen` exactly as one `_sample_row` draw over `vocab` logits does. torch's
    one-sample multinomial draws one exponential per category whatever the probabilities
    (tests/unit/test_sampling_robust.py checks it), so uniform probabilities do."""
    torch.multinomial(torch.ones(vocab), 1, generator=gen)
