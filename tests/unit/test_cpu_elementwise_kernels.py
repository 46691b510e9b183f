"""kvbridge's one-pass CPU ops (csrc/elementwise.cpp) against the torch code they replace:
RMSNorm with and without the residual add, rotary embedding in place (whole and partial
head_dim, strided heads), the K/V write into the paged cache, and the MLP's SiLU(gate) * up;
plus their refusals."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kvbridge.engine.layers import cpu_kernels  # noqa: E402
from kvbridge.engine.layers.rotary import RotaryEmbedding  # noqa: E402

ops = torch.ops.kvbridge
GEN = torch.Generator().manual_seed(0)


@pytest.fixture(autouse=True)
def kernels_loaded() -> None:
    assert cpu_kernels.available(), "kvbridge's CPU kernels did not build (see the warning logged)"


def randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=GEN)


@pytest.mark.parametrize("rows,hidden", [(1, 576), (16, 576), (300, 576), (3, 13), (130, 1000)])
def test_rms_norm_matches_torch(rows: int, hidden: int) -> None:
    x, w = randn(rows, 2 * hidden)[:, :hidden], randn(hidden)  # strided rows, as a slice would be
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-5), F.rms_norm(x, (hidden,), w, 1e-5), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows,hidden", [(1, 576), (64, 576), (200, 700)])
def test_add_rms_norm_adds_in_place_and_normalises(rows: int, hidden: int) -> None:
    h, delta, w = randn(rows, hidden), randn(rows, hidden), randn(hidden)
    expected_h = h + delta
    out = ops.add_rms_norm_(h, delta, w, 1e-6)
    torch.testing.assert_close(h, expected_h, rtol=0, atol=0)
    torch.testing.assert_close(out, F.rms_norm(expected_h, (hidden,), w, 1e-6), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("head_dim,rope_dim", [(64, 64), (24, 24), (64, 32), (128, 64)])
@pytest.mark.parametrize("tokens", [1, 7, 2000])
def test_rotary_in_place_matches_torch(head_dim: int, rope_dim: int, tokens: int) -> None:
    rotary = RotaryEmbedding(rope_dim, 10000.0, 4096, torch.float32, torch.device("cpu"))
    cos, sin = rotary.lookup(torch.randint(0, 4096, (tokens,), generator=GEN))
    qkv = randn(tokens, 7 * head_dim)
    qk = qkv[:, :5 * head_dim].view(tokens, 5, head_dim)  # a strided view, as in LlamaAttention
    expected = torch.cat((RotaryEmbedding.apply(qk[..., :rope_dim], cos, sin), qk[..., rope_dim:]), -1)
    untouched = qkv[:, 5 * head_dim:].clone()
    ops.rotary_(qk, cos, sin)
    torch.testing.assert_close(qk, expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(qkv[:, 5 * head_dim:], untouched)


@pytest.mark.parametrize("tokens", [1, 5, 3000])
def test_write_kv_matches_index_put(tokens: int) -> None:
    blocks, heads, slots, block_size, dim = 400, 3, 4, 16, 64
    cache = randn(blocks, heads, slots, 2, block_size, dim)
    expected = cache.clone()
    slot_mapping = torch.randperm(blocks * block_size, generator=GEN)[:tokens]
    k, v = randn(tokens, heads, dim), randn(tokens, 2 * heads, dim)[:, :heads]
    layer, ref = (c[:, :, 2].permute(0, 2, 3, 1, 4) for c in (cache, expected))
    where = (slot_mapping // block_size, slot_mapping % block_size)
    ref[:, 0].index_put_(where, k)
    ref[:, 1].index_put_(where, v)
    ops.write_kv_(layer, k, v, slot_mapping)
    assert torch.equal(cache, expected)


@pytest.mark.parametrize("rows,inter", [(1, 1536), (64, 1536), (2048, 1536), (3, 5), (40, 1000)])
def test_silu_and_mul_matches_torch(rows: int, inter: int) -> None:
    gate_up = randn(rows, 3 * inter)[:, :2 * inter] * 6  # strided rows; values to +-30
    expected = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    torch.testing.assert_close(ops.silu_and_mul(gate_up), expected, rtol=3e-6, atol=1e-6)


def test_silu_and_mul_over_the_whole_float_range() -> None:
    """Every exponent's worth of gate values, both signs, the clamp's edges, infinities and NaN:
    the vectorised exp's SiLU agrees with torch's (NaN where torch's is NaN)."""
    mags = torch.cat([torch.logspace(-38, 38, 2001), torch.tensor([86.9, 87.0, 87.1, 88.0, 88.1, 1e6, 3e38])])
    gates = torch.cat([mags, -mags, torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan")])])
    gate_up = torch.cat([gates, torch.ones_like(gates)])[None]
    got, expected = ops.silu_and_mul(gate_up)[0], F.silu(gates)
    torch.testing.assert_close(got, expected, rtol=3e-6, atol=1e-30, equal_nan=True)


def test_ops_refuse_bad_input_and_change_nothing() -> None:
    cache = torch.zeros(4, 2, 1, 2, 4, 8)
    layer = cache[:, :, 0].permute(0, 2, 3, 1, 4)
    k = v = torch.ones(2, 2, 8)
    with pytest.raises(RuntimeError, match="outside the cache"):
        ops.write_kv_(layer, k, v, torch.tensor([3, 16]))
    assert not cache.any()  # checked before anything is written
    with pytest.raises(RuntimeError, match="one int64 slot per token"):
        ops.write_kv_(layer, k, v, torch.tensor([3]))
    with pytest.raises(RuntimeError, match="float32"):
        ops.rms_norm(torch.ones(2, 8, dtype=torch.float64), torch.ones(8, dtype=torch.float64), 1e-5)
    with pytest.raises(RuntimeError, match="weight"):
        ops.rms_norm(torch.ones(2, 8), torch.ones(7), 1e-5)
    with pytest.raises(RuntimeError, match="shaped like delta"):
        ops.add_rms_norm_(torch.ones(2, 8), torch.ones(3, 8), torch.ones(8), 1e-5)
    with pytest.raises(RuntimeError, match="rope_dim"):
        ops.rotary_(torch.ones(2, 1, 8), torch.ones(2, 1, 10), torch.ones(2, 1, 10))
    with pytest.raises(RuntimeError, match="even number"):
        ops.silu_and_mul(torch.ones(2, 7))
