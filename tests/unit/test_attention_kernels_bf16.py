"""The CPU decode attention kernel at bf16 (issue 31): straight from a bf16 paged cache, against
float64 attention of the same (bf16) values, over the fp32 kernel tests' grid (shuffled block
tables, GQA groups, head sizes on and off the 16 lanes, sliding windows) and bad input.

The kernel computes in fp32 from the bf16 values (widened as read, or, with AVX-512 BF16 at head
sizes 64 and 128, scored by vdpbf16ps, whose products of two bf16 are exact in fp32, in another
order of summation), so its bf16 output is the fp32 kernel's output on the widened inputs rounded
once to bf16 (give or take one bf16 step where the fp32 value sits on a rounding boundary), and
within one bf16 rounding of the float64 result."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

from kvbridge.engine.layers import cpu_kernels  # noqa: E402
from kvbridge.engine.layers.attention import AttentionMetadata, PagedAttention  # noqa: E402
from tests.unit import cpu_isa  # noqa: E402
from tests.unit.attention_cases import DECODE_GRID, decode_case, fused_qkv  # noqa: E402

BF16_EPS = 2.0 ** -8  # bf16's 8 significant bits: a rounding is within this, relative (a step within 2x)
FP32_ERROR = 5e-5  # fp32 arithmetic's own error on these inputs (|v| < 10, scores up to ~30)


@pytest.fixture(autouse=True, params=cpu_isa.PARAMS)
def isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test here runs on each build (avx2, avx512, amx) this CPU can execute."""
    return cpu_isa.use(request.param, monkeypatch)


def assert_bf16_of(out: torch.Tensor, fp32_out: torch.Tensor, exact: torch.Tensor) -> None:
    """out is bf16, the fp32 kernel's result rounded to bf16 (the nearest bf16 for all but a
    few boundary cases, the next one at most), and within one bf16 rounding (plus fp32's own
    error) of the float64 result."""
    assert out.dtype == torch.bfloat16
    rounded = fp32_out.bfloat16()
    off = out != rounded
    assert off.float().mean().item() < 1e-3, f"{off.sum().item()} of {out.numel()} differ from fp32's rounding"
    # One step, and fp32's rounding where a sum of values about 1 cancels to about 1e-5 or less.
    assert ((out.double() - fp32_out.double()).abs() <= 2 * BF16_EPS * fp32_out.double().abs() + 1e-6).all()
    excess = (out.double() - exact).abs() - 2 * BF16_EPS * exact.abs()
    assert (excess <= FP32_ERROR).all(), (excess.max().item(), exact.flatten()[excess.argmax()].item())


def reference_decode(q: torch.Tensor, kv_layer: torch.Tensor, tables: list[list[int]], contexts: list[int],
                     window: int | None) -> torch.Tensor:
    """Decode attention in float64, sequence by sequence, from the block table: [B, H * D]."""
    heads, kv_heads, head_dim = q.shape[1], kv_layer.shape[3], q.shape[2]
    block_size = kv_layer.shape[2]
    rows = []
    for b, (table, ctx) in enumerate(zip(tables, contexts)):
        k, v = (kv_layer[table, i].reshape(-1, kv_heads, head_dim)[:ctx].double() for i in (0, 1))
        first = max(0, ctx - window) if window else 0
        k, v = k[first:].repeat_interleave(heads // kv_heads, 1), v[first:].repeat_interleave(heads // kv_heads, 1)
        scores = torch.einsum("hd,thd->ht", q[b].double(), k) * head_dim ** -0.5
        rows.append(torch.einsum("ht,thd->hd", scores.softmax(-1), v).reshape(-1))
        assert len(table) * block_size >= ctx
    return torch.stack(rows)


def bf16_case(heads: int, kv_heads: int, head_dim: int, block_size: int, contexts: list[int],
              window: int | None, seed: int):
    q, kv_layer, attn, _ = decode_case(heads, kv_heads, head_dim, block_size, contexts, window, seed)
    # The same strided layer view, of a bf16 cache: [blocks, kv_heads, layers, 2, bs, D] -> layer 1.
    cache = kv_layer.permute(0, 3, 1, 2, 4).bfloat16().unsqueeze(2).expand(-1, -1, 3, -1, -1, -1).contiguous()
    return q.bfloat16(), cache[:, :, 1].permute(0, 2, 3, 1, 4), attn


@pytest.mark.parametrize("heads_kv,head_dim,block_size,window", DECODE_GRID)
def test_decode_kernel_bf16(heads_kv: tuple[int, int], head_dim: int, block_size: int, window: int | None) -> None:
    heads, kv_heads = heads_kv
    contexts = [1, 2, block_size, block_size + 1, 40, 77, 3 * block_size]
    q, kv_layer, attn = bf16_case(heads, kv_heads, head_dim, block_size, contexts, window, seed=head_dim + block_size)
    layer = PagedAttention(heads, kv_heads, head_dim, fold_gqa_decode=False)
    assert layer.reads_in_place(q, kv_layer)
    decode = attn.decode
    assert decode is not None
    out = layer._decode(q, kv_layer, decode)
    fp32_out = layer._decode(q.float(), kv_layer.float(), decode)
    tables = [t.tolist() for t in decode.block_index]
    exact = reference_decode(q, kv_layer, tables, contexts, window)
    assert out.shape == (len(contexts), heads * head_dim)
    assert_bf16_of(out, fp32_out, exact)


@pytest.mark.parametrize("heads_kv", [(9, 3), (8, 1), (12, 2)])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [32, 40])
@pytest.mark.parametrize("window", [None, 37])
def test_decode_kernel_bf16_blocks_of_several_key_chunks(heads_kv: tuple[int, int], head_dim: int, block_size: int,
                                                         window: int | None) -> None:
    """The AVX-512 BF16 path scores a block's keys 16 at a time, reading a whole chunk's 16 rows when
    they lie in the block (32: two such chunks) and only the keys when they do not (40: the last
    chunk of 8 rows); group sizes 6 and 8 take several value passes."""
    heads, kv_heads = heads_kv
    contexts = [1, 17, block_size - 1, block_size + 5, 2 * block_size + 16, 3 * block_size]
    q, kv_layer, attn = bf16_case(heads, kv_heads, head_dim, block_size, contexts, window, seed=block_size)
    layer = PagedAttention(heads, kv_heads, head_dim, fold_gqa_decode=False)
    decode = attn.decode
    assert decode is not None
    out = layer._decode(q, kv_layer, decode)
    fp32_out = layer._decode(q.float(), kv_layer.float(), decode)
    exact = reference_decode(q, kv_layer, [t.tolist() for t in decode.block_index], contexts, window)
    assert_bf16_of(out, fp32_out, exact)


def test_decode_bf16_window_never_reads_blocks_behind_it() -> None:
    q, kv_layer, _ = bf16_case(4, 2, 64, 4, [30], 6, seed=1)
    attn = AttentionMetadata.build([1], [30], [[10**6] * 6 + list(range(1, 3))], 4, "cpu", 6)
    assert attn.decode is not None
    out = PagedAttention(4, 2, 64, fold_gqa_decode=False)._decode(q, kv_layer, attn.decode)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()


@pytest.mark.parametrize("table,context", [([0, 99], 8), ([0, -1], 8), ([0, 1], 9), ([0, 1], 0)])
def test_decode_bf16_refuses_out_of_range_blocks_and_contexts(table: list[int], context: int) -> None:
    q, kv_layer, _ = bf16_case(4, 2, 64, 4, [8], None, seed=2)
    with pytest.raises(RuntimeError, match="paged_decode_attention"):
        cpu_kernels.paged_decode_attention(q, kv_layer, torch.tensor([table]), torch.tensor([context]), None, 0.125)


def test_decode_refuses_mixed_dtypes_and_bad_layouts() -> None:
    q, kv_layer, attn = bf16_case(4, 2, 64, 4, [8], None, seed=3)
    assert attn.decode is not None
    args = (attn.decode.block_index, attn.decode.context_lens, None, 0.125)
    for mixed in ((q, kv_layer.float()), (q.float(), kv_layer), (q.half(), kv_layer.half())):
        with pytest.raises(RuntimeError, match="both float32 or both bfloat16"):
            cpu_kernels.paged_decode_attention(*mixed, *args)
    assert not cpu_kernels.decode_applies(q, kv_layer.float())
    with pytest.raises(RuntimeError, match="contiguous"):
        cpu_kernels.paged_decode_attention(q, kv_layer.transpose(2, 3), *args)
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        cpu_kernels.paged_decode_attention(q[:, :3], kv_layer, *args)


def test_bf16_prompts_go_to_sdpa(monkeypatch: pytest.MonkeyPatch) -> None:
    """The prefill kernel is fp32-only (torch's bf16 SDPA is faster, benchmarks/README.md "bf16"):
    it refuses bf16, and the layer attends a fresh bf16 prompt with SDPA."""
    q, k, v = (t.bfloat16() for t in fused_qkv(40, 9, 3, 64, seed=11))
    with pytest.raises(RuntimeError, match="float32"):
        cpu_kernels.prefill_attention(q, k, v, 0.125)
    calls = []
    real = cpu_kernels.prefill_attention
    monkeypatch.setattr(cpu_kernels, "prefill_attention", lambda *a: calls.append(1) or real(*a))
    kv_layer = torch.zeros(3, 3, 1, 2, 16, 64, dtype=torch.bfloat16)[:, :, 0].permute(0, 2, 3, 1, 4)
    attn = AttentionMetadata.build([40], [40], [[0, 1, 2]], 16, "cpu", None)
    out = PagedAttention(9, 3, 64, fold_gqa_decode=False).forward(q, k, v, kv_layer, attn)
    assert calls == [] and out.dtype == torch.bfloat16 and out.shape == (40, 9 * 64)
