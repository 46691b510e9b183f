"""kvbridge's one-pass CPU ops (csrc/elementwise.cpp), fp32 and bf16, against the torch code they replace:
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
from tests.unit import cpu_isa  # noqa: E402



class _Ops:
    """The ops of the build the test runs on (the `isa` fixture's)."""

    def __getattr__(self, name: str) -> object:
        return getattr(cpu_kernels.ops(), name)


ops = _Ops()
GEN = torch.Generator().manual_seed(0)


@pytest.fixture(autouse=True, params=cpu_isa.PARAMS)
def isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test here runs on each build (avx2, avx512, amx) this CPU can execute."""
    return cpu_isa.use(request.param, monkeypatch)


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 5, 3000])
def test_write_kv_matches_index_put(tokens: int, dtype: torch.dtype) -> None:
    blocks, heads, slots, block_size, dim = 400, 3, 4, 16, 64
    cache = randn(blocks, heads, slots, 2, block_size, dim).to(dtype)
    expected = cache.clone()
    slot_mapping = torch.randperm(blocks * block_size, generator=GEN)[:tokens]
    k, v = randn(tokens, heads, dim).to(dtype), randn(tokens, 2 * heads, dim)[:, :heads].to(dtype)
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


# bf16 (issue 31): every op again with bf16 tensors, against torch's own bf16 path (which the
# kernels round like) and against float64 references within bf16 tolerances, at the same edge
# sizes; plus the refusals of mixed dtypes.
BF16 = torch.bfloat16
BF16_TOL = {"rtol": 2e-2, "atol": 2e-2}  # a few bf16 ulps (8 mantissa bits)


def bf(*shape: int) -> torch.Tensor:
    return randn(*shape).to(BF16)


def ulps_apart(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance between a and b in bf16 steps (same-sign finite values)."""
    ia, ib = (t.contiguous().view(torch.int16).to(torch.int32) for t in (a, b))
    return int((ia - ib).abs().max()) if a.numel() else 0


@pytest.mark.parametrize("rows,hidden", [(1, 576), (16, 576), (300, 576), (3, 13), (130, 1000)])
def test_rms_norm_bf16_matches_torch_and_float64(rows: int, hidden: int) -> None:
    x, w = bf(rows, 2 * hidden)[:, :hidden], bf(hidden)
    got = ops.rms_norm(x, w, 1e-5)
    assert got.dtype == BF16 and got.shape == (rows, hidden)
    torch_bf16 = w * F.rms_norm(x.float(), (hidden,), None, 1e-5).to(BF16)  # norm.py's torch path
    # Two roundings (the normalised row, then times the weight) after an fp32 sum taken in
    # another order: one ulp apart in the middle can be two at the end.
    assert ulps_apart(got, torch_bf16) <= 2
    x64 = x.double()
    reference = x64 / (x64.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt() * w.double()
    torch.testing.assert_close(got.double(), reference, **BF16_TOL)


@pytest.mark.parametrize("rows,hidden", [(1, 576), (64, 576), (200, 700)])
def test_add_rms_norm_bf16_rounds_the_sum_as_torch(rows: int, hidden: int) -> None:
    h, delta, w = bf(rows, hidden), bf(rows, hidden), bf(hidden)
    expected_h = h + delta  # torch's bf16 add: one rounding
    out = ops.add_rms_norm_(h, delta, w, 1e-6)
    assert torch.equal(h, expected_h)
    assert ulps_apart(out, w * F.rms_norm(expected_h.float(), (hidden,), None, 1e-6).to(BF16)) <= 2
    h64 = expected_h.double()
    reference = h64 / (h64.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt() * w.double()
    torch.testing.assert_close(out.double(), reference, **BF16_TOL)


@pytest.mark.parametrize("head_dim,rope_dim", [(64, 64), (24, 24), (64, 32), (128, 64)])
@pytest.mark.parametrize("tokens", [1, 7, 2000])
def test_rotary_bf16_in_place_matches_torch_and_float64(head_dim: int, rope_dim: int, tokens: int) -> None:
    rotary = RotaryEmbedding(rope_dim, 10000.0, 4096, BF16, torch.device("cpu"))
    positions = torch.randint(0, 4096, (tokens,), generator=GEN)
    cos, sin = rotary.lookup(positions)
    qkv = bf(tokens, 7 * head_dim)
    qk = qkv[:, :5 * head_dim].view(tokens, 5, head_dim)
    before = qk.clone()
    expected = torch.cat((RotaryEmbedding.apply(qk[..., :rope_dim], cos, sin), qk[..., rope_dim:]), -1)
    untouched = qkv[:, 5 * head_dim:].clone()
    ops.rotary_(qk, cos, sin)
    assert ulps_apart(qk, expected) <= 1
    assert torch.equal(qkv[:, 5 * head_dim:], untouched)
    assert torch.equal(qk[..., rope_dim:], before[..., rope_dim:])
    x64, c64, s64 = before[..., :rope_dim].double(), cos.double(), sin.double()
    reference = x64 * c64 + x64.roll(rope_dim // 2, dims=-1) * s64
    torch.testing.assert_close(qk[..., :rope_dim].double(), reference, **BF16_TOL)


@pytest.mark.parametrize("rows,inter", [(1, 1536), (64, 1536), (2048, 1536), (3, 5), (40, 1000)])
def test_silu_and_mul_bf16_matches_torch_and_float64(rows: int, inter: int) -> None:
    gate_up = (randn(rows, 3 * inter)[:, :2 * inter] * 6).to(BF16)
    got = ops.silu_and_mul(gate_up)
    assert got.dtype == BF16
    assert ulps_apart(got, F.silu(gate_up[:, :inter]) * gate_up[:, inter:]) <= 1
    g64, u64 = gate_up[:, :inter].double(), gate_up[:, inter:].double()
    torch.testing.assert_close(got.double(), g64 * torch.sigmoid(g64) * u64, **BF16_TOL)


def test_silu_and_mul_bf16_over_the_whole_range() -> None:
    mags = torch.cat([torch.logspace(-38, 38, 2001), torch.tensor([86.9, 87.0, 87.1, 88.0, 88.1, 1e6, 3e38])])
    gates = torch.cat([mags, -mags, torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan")])]).to(BF16)
    gate_up = torch.cat([gates, torch.ones_like(gates)])[None]
    torch.testing.assert_close(ops.silu_and_mul(gate_up)[0], F.silu(gates), rtol=8e-3, atol=1e-30, equal_nan=True)


def test_bf16_ops_refuse_mixed_dtypes_and_change_nothing() -> None:
    with pytest.raises(RuntimeError, match="x's dtype"):
        ops.rms_norm(torch.ones(2, 8, dtype=BF16), torch.ones(8), 1e-5)
    h = torch.ones(2, 8, dtype=BF16)
    with pytest.raises(RuntimeError, match="must be all float32 or all bfloat16"):
        ops.add_rms_norm_(h, torch.ones(2, 8), torch.ones(8, dtype=BF16), 1e-5)
    assert torch.equal(h, torch.ones(2, 8, dtype=BF16))  # refused before the add
    x = torch.ones(2, 1, 8, dtype=BF16)
    with pytest.raises(RuntimeError, match="of x's dtype"):
        ops.rotary_(x, torch.ones(2, 1, 8), torch.ones(2, 1, 8))
    cache = torch.zeros(4, 2, 1, 2, 4, 8, dtype=BF16)
    layer = cache[:, :, 0].permute(0, 2, 3, 1, 4)
    with pytest.raises(RuntimeError, match="cache's dtype"):
        ops.write_kv_(layer, torch.ones(2, 2, 8), torch.ones(2, 2, 8), torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match="outside the cache"):
        ops.write_kv_(layer, torch.ones(2, 2, 8, dtype=BF16), torch.ones(2, 2, 8, dtype=BF16), torch.tensor([3, 16]))
    assert not cache.any()
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.silu_and_mul(torch.ones(2, 8, dtype=torch.float16))


def test_elementwise_applies_takes_one_dtype_of_two() -> None:
    assert cpu_kernels.elementwise_applies(torch.ones(2, dtype=BF16), torch.ones(2, dtype=BF16))
    assert cpu_kernels.elementwise_applies(torch.ones(2), torch.ones(2))
    assert not cpu_kernels.elementwise_applies(torch.ones(2, dtype=BF16), torch.ones(2))
    assert not cpu_kernels.elementwise_applies(torch.ones(2, dtype=torch.float16))
