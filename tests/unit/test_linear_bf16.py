"""bf16 linear layers prepacked for oneDNN (issue 31): the same product as an fp64 reference within
bf16's rounding, for SmolLM2-135M's layer shapes at decode and prefill row counts, with and
without bias, and for the shards tensor parallelism cuts those weights into; long matmuls widened
to fp32 on CPUs without AMX (linear.widens_bf16), on either kind of CPU."""

from __future__ import annotations

import pytest
import torch

from kvbridge.engine.layers import linear
from kvbridge.engine.layers.linear import WIDEN_MIN_ROWS, Linear, prepack_weight
from kvbridge.shape.tp_split import even_split, rank_shard

HIDDEN, INTER, VOCAB, HEADS, KV_HEADS, HEAD_DIM = 576, 1536, 49152, 9, 3, 64
SHAPES = {"qkv": (HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD_DIM), "o_proj": (HIDDEN, HIDDEN),
          "gate_up": (HIDDEN, 2 * INTER), "down": (INTER, HIDDEN), "lm_head": (HIDDEN, VOCAB)}
ROWS = (1, 16, 64, 512)
BF16_EPS = 2.0 ** -8  # bf16 has 8 significant bits: one rounding is within half of this, relative

pytestmark = pytest.mark.skipif(prepack_weight(torch.ones(16, 16, dtype=torch.bfloat16)) is None,
                                reason="no oneDNN bf16 on this CPU (or KVBRIDGE_ONEDNN=0)")


def bf16_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
    out_f, in_f = weight.shape
    layer = Linear(in_f, out_f, bias is not None, torch.bfloat16, torch.device("cpu"))
    layer.weight.copy_(weight)
    if bias is not None:
        layer.bias.copy_(bias)
    layer.prepack()
    assert layer._packed is not None and layer._packed.is_mkldnn  # the prepacked path, not F.linear
    return layer


def assert_bf16_close(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    """y (bf16) is x @ w.T + b rounded once to bf16, with fp32 accumulation's error besides."""
    assert y.dtype == torch.bfloat16 and y.shape == (x.shape[0], w.shape[0])
    ref = x.double() @ w.double().T + (b.double() if b is not None else 0)
    magnitude = x.double().abs() @ w.double().abs().T + (b.double().abs() if b is not None else 0)
    err = (y.double() - ref).abs()
    bound = BF16_EPS * ref.abs() + 1e-5 * magnitude  # the output's rounding + fp32 accumulation
    worst = (err - bound).max().item()
    assert worst <= 0, f"error beyond bf16 rounding by {worst:.3g} (max error {err.max().item():.3g})"


def inputs(rows: int, in_f: int, out_f: int, bias: bool, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_f, generator=gen).bfloat16()
    w = (torch.randn(out_f, in_f, generator=gen) / in_f ** 0.5).bfloat16()
    b = torch.randn(out_f, generator=gen).bfloat16() if bias else None
    return x, w, b


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("name", list(SHAPES))
def test_prepacked_bf16_matches_fp64(name, rows):
    in_f, out_f = SHAPES[name]
    if name == "lm_head" and rows == 512:
        rows = 96  # the head sees only the sampled rows
    x, w, b = inputs(rows, in_f, out_f, bias=name == "qkv", seed=rows)
    with torch.inference_mode():
        assert_bf16_close(bf16_linear(w, b)(x), x, w, b)


def test_leading_dims_and_strided_rows():
    x, w, b = inputs(24, HIDDEN, HIDDEN, bias=True, seed=7)
    layer = bf16_linear(w, b)
    with torch.inference_mode():
        y3 = layer(x.reshape(2, 12, HIDDEN))
        strided = torch.cat([x, x], dim=1)[:, :HIDDEN]  # rows with a stride of 2 * HIDDEN
        assert_bf16_close(y3.reshape(24, HIDDEN), x, w, b)
        assert_bf16_close(layer(strided), x, w, b)


@pytest.mark.parametrize("tp_size", [1, 3])
def test_tp_shards(tp_size):
    """Column-parallel shards (fused QKV, gate/up) give their slice of the whole product;
    row-parallel ones (o_proj, down) sum to it, within each shard's own bf16 rounding."""
    rows = 16
    x, w_qkv, _ = inputs(rows, HIDDEN, HIDDEN, bias=False, seed=1)
    _, w_o, _ = inputs(rows, HIDDEN, HIDDEN, bias=False, seed=2)
    _, w_down, _ = inputs(rows, INTER, HIDDEN, bias=False, seed=3)
    x_inter = torch.randn(rows, INTER, generator=torch.Generator().manual_seed(4)).bfloat16()
    o_sum = torch.zeros(rows, HIDDEN, dtype=torch.float64)
    down_sum = torch.zeros(rows, HIDDEN, dtype=torch.float64)
    with torch.inference_mode():
        for rank in range(tp_size):
            heads = rank_shard(HEADS, KV_HEADS, tp_size, rank).q_heads
            cols = slice(heads.start * HEAD_DIM, heads.stop * HEAD_DIM)
            assert_bf16_close(bf16_linear(w_qkv[cols], None)(x), x, w_qkv[cols], None)
            part = bf16_linear(w_o[:, cols].contiguous(), None)(x[:, cols])
            assert_bf16_close(part, x[:, cols], w_o[:, cols], None)
            o_sum += part.double()
            inter = even_split(INTER, tp_size, rank)
            part = bf16_linear(w_down[:, inter.start:inter.stop].contiguous(), None)(x_inter[:, inter.start:inter.stop])
            down_sum += part.double()
    for total, xx, w in ((o_sum, x, w_o), (down_sum, x_inter, w_down)):
        ref = xx.double() @ w.double().T
        bound = BF16_EPS * (xx.double().abs() @ w.double().abs().T)  # each shard rounded once
        assert ((total - ref).abs() <= bound).all()


@pytest.mark.parametrize("widen", [False, True])
@pytest.mark.parametrize("rows", [WIDEN_MIN_ROWS - 1, WIDEN_MIN_ROWS, 300])
def test_long_bf16_matmuls_run_widened_where_the_cpu_has_no_amx(monkeypatch, widen, rows):
    """From WIDEN_MIN_ROWS rows on (and only there, and only where widens_bf16()) the product runs
    in fp32 on the widened weight: the same result within bf16's one rounding, bias included."""
    monkeypatch.setattr(linear, "widens_bf16", lambda: widen)
    in_f, out_f = SHAPES["qkv"]
    x, w, b = inputs(rows, in_f, out_f, bias=True, seed=rows)
    layer = bf16_linear(w, b)
    calls = []
    real = linear.widened_linear
    monkeypatch.setattr(linear, "widened_linear", lambda *a: calls.append(a[0].shape) or real(*a))
    with torch.inference_mode():
        y = layer(x)
        y3 = layer(x.view(1, rows, in_f))  # leading dims count as rows
    assert len(calls) == 2 * (widen and rows >= WIDEN_MIN_ROWS)
    assert_bf16_close(y, x, w, b)
    assert torch.equal(y3.view_as(y), y)


@pytest.mark.parametrize("flags, vendor, env, expected", [
    ({"avx512f", "avx512_bf16"}, "GenuineIntel", None, True),  # AVX-512 BF16 only: bf16 at the fp32 FMA rate
    ({"avx2"}, "GenuineIntel", None, True),
    ({"avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}, "GenuineIntel", None, False),  # AMX: bf16 tiles far ahead
    ({"avx512f", "avx512_bf16"}, "GenuineIntel", "0", False),
    ({"avx512f", "avx512_bf16"}, "AuthenticAMD", None, False),  # Zen 4: bf16 matmuls twice fp32's
    ({"avx2"}, "AuthenticAMD", None, False),
    ({"avx512f", "avx512_bf16"}, "AuthenticAMD", "1", True),  # forced
    ({"avx512f", "avx512_bf16"}, "", None, False),  # unknown vendor: as measured nowhere, not widened
])
def test_widening_applies_exactly_on_intel_cpus_without_amx(monkeypatch, flags, vendor, env, expected):
    monkeypatch.setattr(linear, "read_cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(linear, "read_cpu_vendor", lambda: vendor)
    if env is None:
        monkeypatch.delenv("KVBRIDGE_BF16_WIDEN", raising=False)
    else:
        monkeypatch.setenv("KVBRIDGE_BF16_WIDEN", env)
    linear.widens_bf16.cache_clear()
    try:
        assert linear.widens_bf16() is expected
    finally:
        linear.widens_bf16.cache_clear()
