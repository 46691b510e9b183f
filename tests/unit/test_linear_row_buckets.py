"""Issue 33, bf16: the row counts a bf16 matmul shows oneDNN are bounded (linear.py "Row buckets").

oneDNN creates one primitive per matmul shape (4-13 ms each in bf16) and keeps it in a bounded
cache; a step's row count is its token count, so without buckets almost every prefill was a new
shape, and a shape evicted came back as a new creation. `row_chunks` maps any row count onto at
most 31 padded counts; these tests check the mapping for every row count up to several chunks,
that bucketed results are the plain matmul's (bf16 against a float64 reference), and that an
engine serving prompts of many lengths shows oneDNN no more than the bound.
"""

from __future__ import annotations

import random

import pytest
import torch

from kvbridge.engine.layers import linear
from kvbridge.engine.layers.linear import (BUCKET_ALIGN, BUCKET_CHUNK_ROWS, BUCKET_MIN_ROWS, RowChunk,
                                           packed_linear, prepack_weight, row_chunks)

# the padded counts: 1..16, then the multiples of 16 up to 256 (31 in all)
BOUND = len(set(range(1, BUCKET_MIN_ROWS + 1)) | set(range(BUCKET_ALIGN, BUCKET_CHUNK_ROWS + 1, BUCKET_ALIGN)))
EDGES = sorted({1, BUCKET_MIN_ROWS - 1, BUCKET_MIN_ROWS, BUCKET_MIN_ROWS + 1, BUCKET_ALIGN * 3 - 1, BUCKET_ALIGN * 3,
                BUCKET_CHUNK_ROWS - 1, BUCKET_CHUNK_ROWS, BUCKET_CHUNK_ROWS + 1, 2 * BUCKET_CHUNK_ROWS + 17, 2048})

bf16_onednn = pytest.mark.skipif(prepack_weight(torch.zeros(16, 16, dtype=torch.bfloat16)) is None,
                                 reason="this CPU has no oneDNN bf16 matmul (no AVX-512): nothing is bucketed")


def test_row_chunks_cover_every_row_once_with_bounded_padded_counts():
    seen: set[int] = set()
    for m in range(1, 5 * BUCKET_CHUNK_ROWS + 2):
        chunks = row_chunks(m)
        assert chunks[0].start == 0 and sum(c.rows for c in chunks) == m
        for before, after in zip(chunks, chunks[1:]):
            assert after.start == before.start + before.rows
        for c in chunks:
            assert c.rows <= c.padded < c.rows + BUCKET_ALIGN
            if m > BUCKET_MIN_ROWS:
                assert c.padded % BUCKET_ALIGN == 0 and c.padded <= BUCKET_CHUNK_ROWS
            seen.add(c.padded)
        if m <= BUCKET_MIN_ROWS:
            assert chunks == [RowChunk(0, m, m)]
        else:
            assert all(c.rows == BUCKET_CHUNK_ROWS for c in chunks[:-1])
    assert len(seen) == BOUND


@pytest.mark.parametrize("m", [0, -3])
def test_row_chunks_refuse_an_empty_matmul(m):
    with pytest.raises(ValueError, match="at least one row"):
        row_chunks(m)


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
    for m in range(1, 3 * BUCKET_CHUNK_ROWS):
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
    other (steps of as many token counts) asks oneDNN for at most BOUND row counts per weight."""
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
    assert len(set(step_rows)) > BOUND  # the traffic has the cause: more distinct step sizes than the bound
    per_weight: dict[tuple[int, ...], set[int]] = {}
    for rows, shape in calls:
        per_weight.setdefault(shape, set()).add(rows)
    assert per_weight and all(len(rows) <= BOUND for rows in per_weight.values()), \
        {shape: len(rows) for shape, rows in per_weight.items()}
