"""Token sampling: greedy, temperature, repetition penalty, logit bias, min tokens, min-p, top-k, top-p,
per-request seeds, logprobs."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch
import torch.nn.functional as F

from kvbridge.engine.outputs import TokenLogprob
from kvbridge.engine.sampling_params import SamplingParams
from kvbridge.engine.structured import apply_bitmask

logger = logging.getLogger(__name__)

_FLOAT64_MAX = torch.finfo(torch.float64).max


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
        self._buffer = torch.empty(0)

    def _scratch(self, shape: torch.Size) -> torch.Tensor:
        """A float32 CPU tensor of `shape` over memory reused from step to step."""
        if self._buffer.numel() < shape.numel():
            self._buffer = torch.empty(shape.numel())
        return self._buffer[:shape.numel()].view(shape)

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
               sampled_before: Sequence[int] | None = None,
               penalty_token_ids: Sequence[Sequence[int]] | None = None,
               masks: Mapping[int, torch.Tensor] | None = None) -> SamplerOutput:
        """logits: [N, vocab] on any device, one row per request. `sampled_before`: per row,
        the request's output tokens so far (its generator's offset; all 0 if None).
        `penalty_token_ids`: per row, the tokens a repetition penalty discourages (the prompt's
        and output's), read for rows whose params have one. Then logit_bias and min_tokens
        (`shape_logits`). Logprobs are the model's, before any of them (vLLM's default)."""
        logits = logits.float().cpu()
        raw = logits
        before = sampled_before if sampled_before is not None else [0] * len(request_ids)
        # One pass over the rows finds those whose logits change (none for most steps: no copy then).
        masks = masks or {}
        adjusted = [row for row, sp in enumerate(params) if sp.penalises_repetition or sp.shapes_logits or row in masks]
        if adjusted:
            logits = logits.clone()
            for row in adjusted:
                sp = params[row]
                if sp.penalises_repetition and penalty_token_ids is not None:
                    apply_repetition_penalty(logits[row], penalty_token_ids[row], sp.repetition_penalty)
                if sp.shapes_logits:
                    shape_logits(logits[row], sp, before[row])
                if row in masks:  # structured output: the ids the grammar forbids next
                    apply_bitmask(logits[row], masks[row])
        out = SamplerOutput()
        # argmax over the greedy rows only (a full-vocabulary pass per row: benchmarks/sampling_ab.py).
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
            lp = torch.log_softmax(raw[want], dim=-1)
            for j, row in enumerate(want):
                rid, k = request_ids[row], params[row].logprobs or 0
                top = torch.topk(lp[j], k) if k else None
                out.logprobs[rid] = TokenLogprob(
                    token_id=out.tokens[rid], logprob=float(lp[j, out.tokens[rid]]),
                    top=tuple(zip(top.indices.tolist(), top.values.tolist())) if top is not None else ())
        return out

    def _sample_plain_rows(self, logits: torch.Tensor, params: Sequence[SamplingParams]) -> dict[int, int]:
        """Row -> token for the rows that draw from the shared generator with temperature only (no
        seed, top-k or top-p: e.g. every request of `vllm bench serve`), all at once: the rows'
        unnormalised probabilities and one uniform per row, inverted through the row's cumulative
        weights (`inverse_cdf`). Sampling them one by one (`torch.multinomial` draws one
        exponential per vocabulary entry) took a sixth of a 64-sequence decode step. A row whose
        probabilities are not finite is left out, for `_sample_row` to fail alone."""
        vocab = logits.shape[-1]
        rows = [i for i, sp in enumerate(params)
                if not sp.greedy and sp.seed is None and not 0 < sp.top_k < vocab and sp.top_p >= 1.0
                and sp.min_p == 0.0]
        if not rows:
            return {}
        src = logits if len(rows) == logits.shape[0] else logits[rows]
        # Unnormalised probabilities exp((logit - max) / T), in a buffer kept across steps (a fresh
        # 12 MB tensor every step cost more than the arithmetic); a NaN or +inf logit makes its
        # row's mass NaN.
        weights = self._scratch(src.shape)
        torch.sub(src, src.amax(dim=-1, keepdim=True), out=weights)
        temperatures = [params[i].temperature for i in rows]
        if any(t != 1.0 for t in temperatures):
            weights.mul_(1.0 / torch.tensor(temperatures, dtype=torch.float32)[:, None])
        weights.exp_()
        uniforms = torch.rand(len(rows), dtype=torch.float64, generator=self._default)
        tokens, ok = inverse_cdf(weights, uniforms)
        return {i: t for i, t, good in zip(rows, tokens.tolist(), ok.tolist()) if good}

    @staticmethod
    def _sample_row(row: torch.Tensor, sp: SamplingParams, gen: torch.Generator) -> int:
        # sp.temperature >= GREEDY_TEMPERATURE here: a huge temperature rounds to inf in float32
        # and flattens the logits to 0, a uniform draw. A cold one can take a huge finite logit
        # (3e38 / 1e-3) past float32's range: then the row is shifted to a top of 0 first (what
        # softmax gives does not change), so that every scaled logit is at most 0.
        scaled = row / sp.temperature
        if not bool(torch.isfinite(scaled).all()) and bool(torch.isfinite(row).all()):
            scaled = (row - row.max()) / sp.temperature
        if sp.min_p > 0.0:  # as vLLM: on the tempered distribution, before top-k and top-p
            probs = torch.softmax(scaled, dim=-1)
            scaled = scaled.masked_fill(probs < sp.min_p * probs.max(), float("-inf"))
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


def apply_repetition_penalty(row: torch.Tensor, token_ids: Sequence[int], penalty: float) -> None:
    """vLLM's (and transformers') repetition penalty, in place on one row of logits: each distinct
    token of `token_ids` has a positive logit divided by `penalty`, a negative one multiplied by it.

    Any penalty > 0 is accepted, as vLLM does. One far from 1 takes finite logits past float32's
    range (1e-300: a logit of 2 becomes 2e300, inf in float32; 1e39 is inf itself, and 0 x inf is
    NaN), where vLLM's softmax is NaN. Then the row is computed in float64 and shifted so that its top
    logit is 0, which changes nothing sampling does with it (softmax, argmax, top-k, min-p), and
    what is below float32's range becomes -inf: a token infinitely less likely than the top one, the
    limit the penalty tends to. A row whose logits were not finite to begin with is left to fail."""
    vocab = row.numel()
    seen = torch.tensor(sorted({t for t in token_ids if 0 <= t < vocab}), dtype=torch.long)
    if not seen.numel():
        return
    values = row[seen]
    penalised = torch.where(values > 0, values / penalty, values * penalty)
    if bool(torch.isfinite(penalised).all()) or not bool(torch.isfinite(values).all()):
        row[seen] = penalised  # float32, as vLLM computes it
        return
    wide = row.double()
    values = wide[seen]
    # A subnormal penalty overflows even float64: the largest float64 instead (ties at the top).
    wide[seen] = torch.where(values > 0, values / penalty, values * penalty).clamp(-_FLOAT64_MAX, _FLOAT64_MAX)
    row.copy_(wide - wide.max())


def shape_logits(row: torch.Tensor, sp: SamplingParams, generated: int) -> None:
    """vLLM's logit_bias and min_tokens, in place on one row of logits: each biased token's logit
    gets its bias added; while fewer than `sp.min_tokens` tokens were generated (`generated`: the
    request's output tokens so far, a prefill's first token included), the stop token ids (the
    server folds the end-of-generation ids in) are made impossible. Ids past the row are skipped
    (the server refuses them before admission)."""
    vocab = row.numel()
    if sp.logit_bias:
        ids = torch.tensor([t for t, _ in sp.logit_bias if t < vocab], dtype=torch.long)
        biases = torch.tensor([b for t, b in sp.logit_bias if t < vocab], dtype=row.dtype)
        row.index_add_(0, ids, biases)
    if generated < sp.min_tokens:
        stops = [t for t in sp.stop_token_ids if 0 <= t < vocab]
        if stops:
            row[torch.tensor(stops, dtype=torch.long)] = float("-inf")


INVERSE_CDF_CHUNK = 1024  # vocabulary entries summed per chunk (49,152 = 48 chunks)


def inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor,
                chunk: int = INVERSE_CDF_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of non-negative `weights` [N, V] (unnormalised probabilities), the first entry
    whose cumulative weight exceeds uniforms[row] x the row's total, and whether the row could
    be sampled (a finite, positive total). Two levels, in float64: the chunks' cumulative sums
    pick a chunk, then that one chunk's cumulative sum picks the entry, so the vocabulary is
    read once (a sum per chunk) instead of being converted and cumulatively summed whole. An
    entry of zero weight is never picked, whatever the rounding: a target at or past the total
    falls to the last entry of positive weight."""
    n, vocab = weights.shape
    pad = -vocab % chunk
    chunks = (F.pad(weights, (0, pad)) if pad else weights).view(n, -1, chunk)  # padding weighs 0
    chunk_mass = chunks.sum(dim=-1).double()  # [N, chunks]; summed in fp32 (a float64 sum casts a copy first)
    cumulative = chunk_mass.cumsum(dim=-1)
    total = cumulative[:, -1]
    targets = uniforms.to(torch.float64) * total
    rows = torch.arange(n)
    picked = torch.minimum(torch.searchsorted(cumulative, targets[:, None], right=True)[:, 0],
                           _last_positive(chunk_mass))
    before = torch.where(picked > 0, cumulative[rows, (picked - 1).clamp_(min=0)], 0.0)
    inside = chunks[rows, picked]  # [N, chunk]: the picked chunk of every row
    offset = torch.minimum(torch.searchsorted(inside.double().cumsum_(dim=-1), (targets - before)[:, None],
                                              right=True)[:, 0], _last_positive(inside))
    ok = torch.isfinite(total) & (total > 0)
    return (picked * chunk + offset).clamp_(max=vocab - 1), ok  # clamped: a row that is not ok


def _last_positive(values: torch.Tensor) -> torch.Tensor:
    """Per row of [N, M], the index of the last positive entry (0 in a row without one)."""
    m = values.shape[-1]
    return (m - 1) - torch.flip(values > 0, dims=(-1,)).to(torch.uint8).argmax(dim=-1)


def skip_draw(gen: torch.Generator, vocab: int) -> None:
    """Advance `gen` exactly as one `_sample_row` draw over `vocab` logits does. torch's
    one-sample multinomial draws one exponential per category whatever the probabilities
    (tests/unit/test_sampling_robust.py checks it), so uniform probabilities do."""
    torch.multinomial(torch.ones(vocab), 1, generator=gen)
