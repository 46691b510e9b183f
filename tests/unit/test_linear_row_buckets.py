"""Issue 33, bf16: the row counts a bf16 matmul shows oneDNN are bounded (linear.py "Row buckets").

oneDNN creates one primitive per matmul shape (4-13 ms each in bf16) and keeps it in a bounded
cache; a step's row count is its token count, so without buckets almost every prefill was a new
shape, and a shape evicted came back as a new creation. `bucket_rows` maps any row count onto a
bucket (55 of them up to a 2048-token step); these tests check the mapping for every row count
up to 8192, that bucketed results are the plain matmul's (bf16 against a float64 reference), and
that an engine serving prompts of many lengths shows oneDNN no more than the buckets.
"""

from __future__ import annotations

import random

import pytest
import torch

from kvbridge.engine.layers import linear
from kvbridge.engine.layers.linear import packed_linear, prepack_weight
from kvbridge.engine.layers.shape_buckets import BUCKET_ALIGN, BUCKET_MIN_ROWS, bucket_rows

STEP_TOKENS = 2048  # the scheduler's default token budget: a step's largest row count
BOUND = 55  # distinct buckets up to STEP_TOKENS: 1..16, 32..256 by 16, then 8 per doubling
EDGES = sorted({1, BUCKET_MIN_ROWS - 1, BUCKET_MIN_ROWS, BUCKET_MIN_ROWS + 1, 47, 48, 255, 256, 257, 300, 511, 513,
                1500, 2048})

bf16_onednn = pytest.mark.skipif(prepack_weight(torch.zeros(16, 16, dtype=torch.bfloat16)) is None,
                                 reason="this CPU has no oneDNN bf16 matmul (no AVX-512): nothing is bucketed")


def test_bucket_rows_pads_little_and_bounds_the_row_counts():
    previous = 0
    for m in range(1, 4 * STEP_TOKENS + 1):
        padded = bucket_rows(m)
        assert padded >= m and padded >= previous and bucket_rows(padded) == padded
        if m <= BUCKET_MIN_ROWS:
            assert padded == m
        elif m <= 256:
            assert padded % BUCKET_ALIGN == 0 and padded - m < BUCKET_ALIGN
        else:
            assert padded - m < m / 8
        previous = padded
    assert len({bucket_rows(m) for m in range(1, STEP_TOKENS + 1)}) == BOUND
    assert len({bucket_rows(m) for m in range(1, 4 * STEP_TOKENS + 1)}) == BOUND + 16  # 8 more per doubling


@pytest.mark.parametrize("m", [0, -3])
def test_bucket_rows_refuses_an_empty_matmul(m):
    with pytest.raises(ValueError, match="at least one row"):
        bucket_rows(m)


@bf16_onednn
@pytest.mark.parametrize("m", EDGES)
@pytest.mark.parametrize("bias", [False, True])
def test_bucketed_bf16_linear_matches_float64(m, bias):
    gen = torch.Generator().manual_seed(m)
    weight = torch.randn(96, 64, generator=gen).to(torch.bfloat16)
    b = torch.randn(96, generator=gen).to(torch.bfloat16) if bias else None
    x = torch.randn(m, 64, generator=gen).to(torch.bfloat16)
    y = packed_linear(x.view(1, m, 64), prepack_weight(weight), b)
    want = x.double() @ weight.double().T + (b.double() if bias else 0)
    assert y.shape == (1, m, 96) and y.dtype == torch.bfloat16
    err = (y[0].double() - want).abs().max() / want.abs().max()
    assert err < 1e-2, f"{m} rows: relative error {err:.2e}"


def _recording(monkeypatch) -> list[tuple[int, tuple[int, ...]]]:
    calls: list[tuple[int, tuple[int, ...]]] = []
    real = linear._onednn_linear

    def record(x, packed, bias):
        calls.append((x.shape[0], tuple(packed.shape)))
        return real(x, packed, bias)
    monkeypatch.setattr(linear, "_onednn_linear", record)
    return calls


@bf16_onednn
def test_bf16_row_counts_reaching_onednn_are_bounded(monkeypatch):
    calls = _recording(monkeypatch)
    weight = prepack_weight(torch.randn(32, 16).to(torch.bfloat16))
    for m in range(1, STEP_TOKENS + 1):
        packed_linear(torch.randn(m, 16).to(torch.bfloat16), weight, None)
    assert len({rows for rows, _ in calls}) == BOUND


@bf16_onednn
def test_fp32_keeps_exact_row_counts(monkeypatch):
    calls = _recording(monkeypatch)
    weight = prepack_weight(torch.randn(32, 16))
    for m in (17, 300, 700):
        packed_linear(torch.randn(m, 16), weight, None)
    assert [rows for rows, _ in calls] == [17, 300, 700]


@bf16_onednn
def test_a_bf16_engine_shows_onednn_a_bounded_set_of_shapes(monkeypatch):
    """The cause, end to end: an engine prefilling prompts of 36 different lengths one after the
    other (steps of as many token counts) asks oneDNN for bucket row counts only, fewer than
    the steps' distinct sizes."""
    from kvbridge.config import CacheConfig, EngineConfig, SchedulerConfig
    from kvbridge.engine.engine import LLMEngine
    from kvbridge.engine.loader import load_model
    from kvbridge.engine.sampling_params import SamplingParams

    loaded = load_model("SmolLM2-135M-Instruct")
    engine = LLMEngine(EngineConfig(dtype="bfloat16", num_threads=1,
                                    cache=CacheConfig(kv_cache_memory_bytes=64 * 2**20, enable_prefix_caching=False),
                                    scheduler=SchedulerConfig(max_num_batched_tokens=512)), loaded)
    step_rows: list[int] = []
    execute = engine.runner.execute

    def counted(sched):
        step_rows.append(sum(len(s.token_ids) for s in sched.scheduled))
        return execute(sched)
    monkeypatch.setattr(engine.runner, "execute", counted)
    calls = _recording(monkeypatch)
    rng = random.Random(0)
    lengths = rng.sample(range(17, 300), 36)
    for n in lengths:
        prompt = [rng.randrange(100, loaded.arch.vocab_size) for _ in range(n)]
        [out] = engine.generate([prompt], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
        assert len(out) == 2
    assert len(set(step_rows)) >= 36  # the traffic has the cause: a new step size per prompt
    per_weight: dict[tuple[int, ...], set[int]] = {}
    for rows, shape in calls:
        per_weight.setdefault(shape, set()).add(rows)
    assert per_weight
    for shape, rows in per_weight.items():
        assert all(bucket_rows(r) == r for r in rows), (shape, sorted(rows))
        assert len(rows) < len(set(step_rows)) - 10, (shape, sorted(rows))
