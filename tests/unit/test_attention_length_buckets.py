"""Issue 33, bf16 long prompts: prefill attention shows torch's SDPA a bounded set of lengths.

torch's CPU flash attention in bf16 keeps per-shape kernels and their buffers: a bf16 SDPA at
400 random lengths grew glibc's bytes in use by ~90 MB and its fragmented free bytes by ~380 MB,
and a bf16 server under long prompts of ever-new lengths grew by ~0.25 MB a request
(benchmarks/README.md, "soak"). shape_buckets.prefill_sdpa pads the query and key lengths to
buckets (`bucket_rows`). These tests check that the padded call is exact (against a float64
reference, causal, masked after a cached context, sliding window), and that an engine prefilling
prompts of many lengths, whole and in chunks after a cached context, calls SDPA on bucket lengths only.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from kvbridge.engine.layers import shape_buckets
from kvbridge.engine.layers.shape_buckets import bucket_rows, padded_mask, pads_attention, prefill_sdpa

EDGES = [2, 15, 16, 17, 31, 33, 255, 257, 300, 513]


def _reference(q, k, v, mask, scale):
    """float64 attention; mask None = causal over equal lengths."""
    q, k, v = (t.double() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    if mask is None:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1) @ v


def _qkv(lq, lk, heads=4, kv_heads=2, d=32, dv=32, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads, lq, d, generator=g).to(dtype)
    k = torch.randn(1, kv_heads, lk, d, generator=g).to(dtype)
    v = torch.randn(1, kv_heads, lk, dv, generator=g).to(dtype)
    return q, k, v


@pytest.mark.parametrize("n", EDGES)
def test_padded_causal_prefill_equals_the_reference(n):
    q, k, v = _qkv(n, n)
    out = prefill_sdpa(q, k, v, None, enable_gqa=True)
    assert out.shape == (1, 4, n, 32) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), _reference(q, k, v, None, 32 ** -0.5), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("lq,ctx", [(2, 17), (17, 40), (33, 300), (255, 513), (300, 301)])
@pytest.mark.parametrize("window", [None, 24])
def test_padded_masked_prefill_after_a_context_equals_the_reference(lq, ctx, window):
    q, k, v = _qkv(lq, ctx, dv=16, seed=lq + ctx)
    query_pos = torch.arange(ctx - lq, ctx)[:, None]
    keys = torch.arange(ctx)[None, :]
    mask = keys <= query_pos
    if window is not None:
        mask &= keys > query_pos - window
    mask = mask.view(1, 1, lq, ctx)
    cache: dict = {}
    out = prefill_sdpa(q, k, v, mask, scale=0.2, enable_gqa=True, mask_cache=cache)
    assert out.shape == (1, 4, lq, 16)
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), _reference(q, k, v, mask[0, 0], 0.2), atol=2e-2, rtol=2e-2)
    assert list(cache) == [(bucket_rows(lq), bucket_rows(ctx))]
    again = prefill_sdpa(q, k, v, mask, scale=0.2, enable_gqa=True, mask_cache=cache)
    assert torch.equal(again, out)


def test_padded_mask_hides_the_added_keys_and_gives_added_queries_one_key():
    mask = torch.ones(1, 1, 3, 5, dtype=torch.bool).tril(2)
    grown = padded_mask(mask, 16, 32)
    assert grown.shape == (1, 1, 16, 32)
    assert torch.equal(grown[..., :3, :5], mask)
    assert not grown[..., :3, 5:].any()
    assert grown[..., 3:, 0].all() and not grown[..., 3:, 1:].any()
    assert padded_mask(mask, 3, 5) is mask


def test_only_reduced_precision_on_cpu_is_padded(monkeypatch):
    assert pads_attention(torch.zeros(1, dtype=torch.bfloat16))
    assert pads_attention(torch.zeros(1, dtype=torch.float16))
    assert not pads_attention(torch.zeros(1, dtype=torch.float32))  # fp32 SDPA does not grow
    monkeypatch.setattr(shape_buckets, "ENABLED", False)
    assert not pads_attention(torch.zeros(1, dtype=torch.bfloat16))


def test_causal_without_mask_needs_equal_lengths():
    q, k, v = _qkv(20, 30)
    with pytest.raises(ValueError, match="as many queries as keys"):
        prefill_sdpa(q, k, v, None)


def _record_sdpa(monkeypatch) -> list[tuple[int, int]]:
    calls: list[tuple[int, int]] = []
    real = F.scaled_dot_product_attention

    def record(q, k, v, *args, **kwargs):
        if q.dtype == torch.bfloat16 and q.shape[-2] > 1:
            calls.append((q.shape[-2], k.shape[-2]))
        return real(q, k, v, *args, **kwargs)
    monkeypatch.setattr(F, "scaled_dot_product_attention", record)
    return calls


def test_a_bf16_engine_prefills_on_bucket_lengths_only(monkeypatch):
    """The cause, end to end: prompts of 24 lengths, whole and (over the 64-token budget) in
    chunks after a cached context, reach SDPA on bucketed lengths only."""
    from kvbridge.config import CacheConfig, EngineConfig, SchedulerConfig
    from kvbridge.engine.engine import LLMEngine
    from kvbridge.engine.loader import load_model
    from kvbridge.engine.sampling_params import SamplingParams

    loaded = load_model("SmolLM2-135M-Instruct")
    engine = LLMEngine(EngineConfig(dtype="bfloat16", num_threads=1,
                                    cache=CacheConfig(kv_cache_memory_bytes=64 * 2**20, enable_prefix_caching=False),
                                    scheduler=SchedulerConfig(max_num_batched_tokens=64)), loaded)
    calls = _record_sdpa(monkeypatch)
    rng = random.Random(0)
    lengths = rng.sample(range(17, 64), 12) + rng.sample(range(65, 200), 12)
    for n in lengths:
        prompt = [rng.randrange(100, loaded.arch.vocab_size) for _ in range(n)]
        [out] = engine.generate([prompt], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
        assert len(out) == 2
    assert any(lq != lk for lq, lk in calls)  # chunked prefill after a context took the masked path
    assert len(calls) >= len(lengths)
    assert all(bucket_rows(lq) == lq and bucket_rows(lk) == lk for lq, lk in calls), sorted(set(calls))
