"""The bf16 causal prefill kernel (cpu_kernels.prefill_attention_bf16_), on each product this CPU
runs (AMX tiles, AVX-512 BF16 dot products), against a float64 reference and torch's bf16 SDPA: several prompts in one call (lengths around its 16-query and
16/32-key tiles), GQA groups, head sizes, the model's strided views into a fused QKV tensor,
rows outside the prompts left alone, the layer path that uses it (a step mixing decodes, fresh
prompts and a chunk over cached tokens), and bad input."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import itertools  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kvbridge.engine.layers import cpu_kernels  # noqa: E402
from kvbridge.engine.layers.attention import AttentionMetadata, PagedAttention  # noqa: E402

CPU_FLAGS = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "").split()
HAS_VEC = {"avx512f", "avx512_bf16"} <= set(CPU_FLAGS)
HAS_AMX = HAS_VEC and {"amx_tile", "amx_bf16"} <= set(CPU_FLAGS)
ISAS_HERE = ["avx512_bf16"] * HAS_VEC + ["amx"] * HAS_AMX
# Each test runs on both products where the CPU has them.
ISAS = [pytest.param("avx512_bf16", marks=pytest.mark.skipif(not HAS_VEC, reason="the CPU has no AVX-512 BF16")),
        pytest.param("amx", marks=pytest.mark.skipif(not HAS_AMX, reason="the CPU has no AMX-BF16"))]


def _fused(tokens: int, heads: int, kv_heads: int, head_dim: int, seed: int) -> tuple[torch.Tensor, ...]:
    """q, k, v as the model has them: bf16 views into one fused [T, heads + 2 kv_heads, D] tensor."""
    gen = torch.Generator().manual_seed(seed)
    fused = (torch.randn(tokens, heads + 2 * kv_heads, head_dim, generator=gen) * 2).bfloat16()
    return fused[:, :heads], fused[:, heads:heads + kv_heads], fused[:, heads + kv_heads:]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype,
            scale: float | None = None) -> torch.Tensor:
    """Causal SDPA over one prompt in `dtype`, as [L, heads, D] float64."""
    q, k, v = (t.to(dtype).transpose(0, 1)[None] for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1], scale=scale)
    return out[0].transpose(0, 1).double()


def _check_prompt(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  scale: float | None = None) -> None:
    """The kernel's rows for one prompt are within twice bf16 SDPA's distance from float64, or 0.03
    (bf16 inputs of magnitude ~2, probabilities rounded to bf16 as SDPA rounds them)."""
    length, heads, head_dim = q.shape
    exact = _attend(q, k, v, torch.float64, scale)
    sdpa_error = (_attend(q, k, v, torch.bfloat16, scale) - exact).abs().max().item()
    kernel_error = (out.view(length, heads, head_dim).double() - exact).abs().max().item()
    assert kernel_error <= max(2 * sdpa_error, 0.03), (kernel_error, sdpa_error)


@pytest.fixture(autouse=True)
def _kernels_loaded() -> None:
    assert cpu_kernels.available()


def test_the_kernel_runs_exactly_what_the_cpu_has() -> None:
    """AMX where the CPU has AMX-BF16, AVX-512 BF16 where it has that; the best one by default."""
    assert cpu_kernels.bf16_prefill_isas() == ISAS_HERE
    assert cpu_kernels.bf16_prefill_isa() == (ISAS_HERE[-1] if ISAS_HERE else None)
    q, k, v = _fused(4, 2, 1, 64, 0)
    if not HAS_AMX:  # the op is there, and says why it cannot run
        with pytest.raises(RuntimeError, match="AMX"):
            cpu_kernels.prefill_attention_bf16_(torch.empty(4, 128).bfloat16(), q, k, v, torch.tensor([0]),
                                                torch.tensor([4]), 0.125, isa="amx")
    with pytest.raises(ValueError, match="isa must be"):
        cpu_kernels.prefill_attention_bf16_(torch.empty(4, 128).bfloat16(), q, k, v, torch.tensor([0]),
                                            torch.tensor([4]), 0.125, isa="avx2")


@pytest.mark.parametrize("build,products", [("avx2", []), ("avx512", ["avx512_bf16"] * HAS_VEC), ("amx", ISAS_HERE)])
def test_each_build_runs_the_products_its_isa_has(build: str, products: list[str], monkeypatch) -> None:
    """The avx2 build has neither product (bf16 prompts go to SDPA there), the avx512 build no AMX."""
    if build not in cpu_kernels.runnable_isas():
        pytest.skip(f"this CPU cannot run {build}")
    cpu_kernels.load(build)
    monkeypatch.setattr(cpu_kernels, "_active", build)
    assert cpu_kernels.bf16_prefill_isas() == products == cpu_kernels.bf16_prefill_isas(build)
    assert cpu_kernels.bf16_prefill_applies(torch.empty(3, 2, 64).bfloat16()) == bool(products)


@pytest.mark.parametrize("choice,expected", [("sdpa", None), ("auto", "best"), ("avx512_bf16", "avx512_bf16"),
                                             ("amx", "amx")])
def test_the_environment_picks_the_product(monkeypatch, choice: str, expected: str | None) -> None:
    """KVBRIDGE_BF16_PREFILL: sdpa turns the kernel off; a product this CPU lacks falls back to the best."""
    monkeypatch.setattr(cpu_kernels, "BF16_PREFILL", choice)
    best = ISAS_HERE[-1] if ISAS_HERE else None
    want = best if expected == "best" or expected not in ISAS_HERE else expected
    assert cpu_kernels.bf16_prefill_isa() == (None if choice == "sdpa" else want)
    q = torch.empty(3, 2, 64).bfloat16()
    assert cpu_kernels.bf16_prefill_applies(q) == (choice != "sdpa" and bool(ISAS_HERE))
    assert not cpu_kernels.bf16_prefill_applies(q.float())
    assert not cpu_kernels.bf16_prefill_applies(torch.empty(3, 2, 32).bfloat16())


LENGTHS = [1, 2, 15, 16, 17, 31, 32, 33, 47, 100, 130]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("heads_kv,head_dim", list(itertools.product([(4, 4), (4, 2), (9, 3), (8, 1)], [64, 128, 256])))
def test_every_prompt_of_a_call_matches_float64(heads_kv: tuple[int, int], head_dim: int, isa: str) -> None:
    heads, kv_heads = heads_kv
    gap = 3  # rows between prompts and at both ends: not the kernel's to write
    starts = [gap + sum(LENGTHS[:i]) + i * gap for i in range(len(LENGTHS))]
    tokens = starts[-1] + LENGTHS[-1] + gap
    q, k, v = _fused(tokens, heads, kv_heads, head_dim, seed=heads * 100 + head_dim)
    out = torch.full((tokens, heads * head_dim), float("nan")).bfloat16()
    cpu_kernels.prefill_attention_bf16_(out, q, k, v, torch.tensor(starts), torch.tensor(LENGTHS), head_dim ** -0.5,
                                        isa=isa)
    written = torch.zeros(tokens, dtype=torch.bool)
    for start, length in zip(starts, LENGTHS):
        rows = slice(start, start + length)
        _check_prompt(out[rows], q[rows], k[rows], v[rows])
        written[rows] = True
    assert torch.isnan(out[~written].float()).all()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("length", [16, 257, 1024])
def test_one_long_prompt_and_another_scale(length: int, isa: str) -> None:
    q, k, v = _fused(length, 9, 3, 64, seed=length)
    out = torch.empty(length, 9 * 64).bfloat16()
    cpu_kernels.prefill_attention_bf16_(out, q, k, v, torch.tensor([0]), torch.tensor([length]), 0.3, isa=isa)
    _check_prompt(out, q, k, v, scale=0.3)


@pytest.mark.parametrize("isa", ISAS)
def test_no_prompt_and_empty_prompts_write_nothing(isa: str) -> None:
    q, k, v = _fused(8, 2, 1, 64, 1)
    out = torch.full((8, 128), 7.0).bfloat16()
    cpu_kernels.prefill_attention_bf16_(out, q, k, v, torch.tensor([], dtype=torch.int64),
                                        torch.tensor([], dtype=torch.int64), 0.125, isa=isa)
    cpu_kernels.prefill_attention_bf16_(out, q, k, v, torch.tensor([3]), torch.tensor([0]), 0.125, isa=isa)
    assert (out.float() == 7.0).all()


@pytest.mark.parametrize("isa", ISAS)
def test_bad_input_is_refused(isa: str) -> None:
    q, k, v = _fused(8, 4, 2, 64, 2)
    out = torch.empty(8, 256).bfloat16()
    one, eight = torch.tensor([0]), torch.tensor([8])

    def call(*args) -> None:
        cpu_kernels.prefill_attention_bf16_(*args, isa=isa)
    with pytest.raises(RuntimeError, match="bfloat16"):
        call(out.float(), q, k, v, one, eight, 0.125)
    with pytest.raises(RuntimeError, match="bfloat16"):
        call(out, q.float(), k, v, one, eight, 0.125)
    with pytest.raises(RuntimeError, match="multiple of 64"):
        q32, k32, v32 = _fused(8, 4, 2, 32, 2)
        call(torch.empty(8, 128).bfloat16(), q32, k32, v32, one, eight, 0.125)
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        q3, k3, v3 = _fused(8, 3, 2, 64, 2)
        call(torch.empty(8, 192).bfloat16(), q3, k3, v3, one, eight, 0.125)
    with pytest.raises(RuntimeError, match="out must be"):
        call(torch.empty(8, 255).bfloat16(), q, k, v, one, eight, 0.125)
    with pytest.raises(RuntimeError, match="outside q"):
        call(out, q, k, v, torch.tensor([4]), torch.tensor([5]), 0.125)
    with pytest.raises(RuntimeError, match="outside q"):
        call(out, q, k, v, one, torch.tensor([-1]), 0.125)
    with pytest.raises(RuntimeError, match="int64"):
        call(out, q, k, v, one.int(), eight, 0.125)


@pytest.mark.parametrize("isa", ISAS)
def test_the_layer_takes_fresh_prompts_to_the_kernel_and_the_rest_as_before(monkeypatch, isa: str) -> None:
    """One bf16 step: two decodes, two fresh prompts and a chunk after 20 cached tokens. With the
    kernel the step's output equals the one computed with it turned off (the fresh prompts'
    rows within two bf16 steps of values up to 4, and 0.002 on average; every other row
    identical), and the kernel is called once."""
    heads, kv_heads, head_dim, block = 9, 3, 64, 16
    layer = PagedAttention(heads, kv_heads, head_dim, fold_gqa_decode=False)
    query_lens, context_lens = [1, 40, 1, 17, 12], [30, 40, 9, 17, 32]
    tables = [list(range(i * 4, i * 4 + 4)) for i in range(5)]
    attn = AttentionMetadata.build(query_lens, context_lens, tables, block, "cpu")
    assert attn.fresh_prefills is not None and attn.fresh_prefills[1].tolist() == [40, 17]
    gen = torch.Generator().manual_seed(5)
    # The cache's own layout: block-major, head-major within a block (attention.py).
    base = torch.randn(20, kv_heads, 1, 2, block, head_dim, generator=gen).bfloat16()

    def cache() -> torch.Tensor:
        return base.clone()[:, :, 0].permute(0, 2, 3, 1, 4)
    q, k, v = _fused(sum(query_lens), heads, kv_heads, head_dim, seed=9)
    calls = []
    real = cpu_kernels.prefill_attention_bf16_
    monkeypatch.setattr(cpu_kernels, "BF16_PREFILL", isa)
    monkeypatch.setattr(cpu_kernels, "prefill_attention_bf16_", lambda *a: calls.append(cpu_kernels.bf16_prefill_isa())
                        or real(*a))
    with_kernel = layer(q, k, v, cache(), attn)
    monkeypatch.setattr(cpu_kernels, "BF16_PREFILL", "sdpa")
    without = layer(q, k, v, cache(), attn)
    assert calls == [isa]
    fresh = torch.zeros(sum(query_lens), dtype=torch.bool)
    fresh[1:41] = True
    fresh[42:59] = True
    assert torch.equal(with_kernel[~fresh], without[~fresh])
    diff = (with_kernel[fresh].float() - without[fresh].float()).abs()
    assert diff.max().item() <= 0.0625 and diff.mean().item() < 0.002, (diff.max().item(), diff.mean().item())
