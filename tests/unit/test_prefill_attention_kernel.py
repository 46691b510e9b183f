"""The CPU causal prefill attention kernel (cpu_kernels.prefill_attention) against torch's SDPA,
over prompt lengths around its 16-query and 32-key tiles, GQA groups, head sizes, the model's
strided views into a fused QKV tensor, the layer path that uses it, and bad input."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import itertools  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kvbridge.engine.layers import cpu_kernels  # noqa: E402
from kvbridge.engine.layers.attention import AttentionMetadata, PagedAttention  # noqa: E402
from tests.unit import cpu_isa  # noqa: E402
from tests.unit.attention_cases import fused_qkv  # noqa: E402


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """SDPA's causal attention computed in `dtype`, as [L, heads, D] float64."""
    q, k, v = (t.to(dtype).transpose(0, 1)[None] for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
    return out[0].transpose(0, 1).double()


def _assert_fp32_close(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """The kernel is as close to the float64 result as torch's own fp32 SDPA (within 2x), or 1e-5."""
    exact = _sdpa(q, k, v, torch.float64)
    sdpa_error = (_sdpa(q, k, v) - exact).abs().max().item()
    kernel_error = (out.double() - exact).abs().max().item()
    assert kernel_error <= max(2 * sdpa_error, 1e-5), (kernel_error, sdpa_error)


@pytest.fixture(autouse=True, params=cpu_isa.PARAMS)
def isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test here runs on each build (avx2, avx512, amx) this CPU can execute."""
    return cpu_isa.use(request.param, monkeypatch)


def test_kernels_build_on_this_machine() -> None:
    assert os.environ.get("KVBRIDGE_CPU_KERNELS") != "0"
    assert cpu_kernels.available()


GRID = list(itertools.product([(4, 4), (4, 2), (9, 3), (8, 1)], [16, 64, 128],
                              [1, 2, 15, 16, 17, 31, 32, 33, 47, 100, 130]))


@pytest.mark.parametrize("heads_kv,head_dim,length", GRID)
def test_kernel_matches_sdpa(heads_kv: tuple[int, int], head_dim: int, length: int) -> None:
    heads, kv_heads = heads_kv
    q, k, v = fused_qkv(length, heads, kv_heads, head_dim, seed=length * 1000 + head_dim + heads)
    out = cpu_kernels.prefill_attention(q, k, v, head_dim ** -0.5)
    assert out.shape == (length, heads, head_dim) and out.is_contiguous()
    _assert_fp32_close(out, q, k, v)


def test_a_long_prompt_and_large_scores() -> None:
    """Many key tiles, and scores large enough that every tile's running maximum moves."""
    q, k, v = fused_qkv(600, 9, 3, 64, seed=7)
    q = q * torch.linspace(1, 8, 600)[:, None, None]
    _assert_fp32_close(cpu_kernels.prefill_attention(q, k, v, 64 ** -0.5), q, k, v)


def test_deterministic_across_calls() -> None:
    q, k, v = fused_qkv(130, 9, 3, 64, seed=3)
    first = cpu_kernels.prefill_attention(q, k, v, 0.125)
    assert all(torch.equal(first, cpu_kernels.prefill_attention(q, k, v, 0.125)) for _ in range(3))


def test_empty_prompt() -> None:
    q, k, v = fused_qkv(0, 4, 2, 16, seed=0)
    assert cpu_kernels.prefill_attention(q, k, v, 0.25).shape == (0, 4, 16)


@pytest.mark.parametrize("window", [None, 7])
def test_layer_uses_the_kernel_for_a_fresh_prompt(window: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """PagedAttention attends a prompt that starts at position 0 with the kernel (not with a
    window, which needs a mask), and its output equals SDPA's."""
    heads, kv_heads, head_dim, block_size, length = 9, 3, 64, 16, 40
    q, k, v = fused_qkv(length, heads, kv_heads, head_dim, seed=11)
    num_blocks = 4
    kv_layer = torch.zeros(num_blocks, kv_heads, 1, 2, block_size, head_dim)[:, :, 0].permute(0, 2, 3, 1, 4)
    attn = AttentionMetadata.build([length], [length], [[0, 1, 2]], block_size, "cpu", window)
    calls = []
    real = cpu_kernels.prefill_attention
    monkeypatch.setattr(cpu_kernels, "prefill_attention", lambda *a: calls.append(1) or real(*a))
    layer = PagedAttention(heads, kv_heads, head_dim, fold_gqa_decode=False)
    out = layer.forward(q, k, v, kv_layer, attn).view(length, heads, head_dim)
    assert calls == ([1] if window is None else [])
    if window is None:
        _assert_fp32_close(out, q, k, v)


@pytest.mark.parametrize("change,message", [
    (lambda q, k, v: (q.double(), k.double(), v.double()), "float32"),
    (lambda q, k, v: (q[..., :24], k[..., :24], v[..., :24]), "multiple of 16"),
    (lambda q, k, v: (q, k[:-1], v[:-1]), "disagree"),
    (lambda q, k, v: (q[:, :3], k, v), "multiple of KV heads"),
    (lambda q, k, v: (q.transpose(1, 2), k, v), "contiguous"),
])
def test_kernel_refuses_bad_input(change, message: str) -> None:
    q, k, v = fused_qkv(20, 4, 2, 32, seed=1)
    with pytest.raises(RuntimeError, match=message):
        cpu_kernels.prefill_attention(*change(q, k, v), 0.2)
