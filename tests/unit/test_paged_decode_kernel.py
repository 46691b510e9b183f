"""The in-place CPU decode attention kernel (cpu_kernels.paged_decode_attention) against the
gather + SDPA path it replaces on CPU, over shuffled block tables, padding, GQA groups, head
sizes that are and are not a multiple of the kernel's 16 lanes, sliding windows, and bad input."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


import pytest  # noqa: E402
import torch  # noqa: E402

from kvbridge.engine.layers import cpu_kernels  # noqa: E402
from kvbridge.engine.layers.attention import AttentionMetadata, PagedAttention  # noqa: E402
from tests.unit import cpu_isa  # noqa: E402
from tests.unit.attention_cases import DECODE_GRID, decode_case  # noqa: E402


@pytest.fixture(autouse=True, params=cpu_isa.PARAMS)
def isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test here runs on each build (avx2, avx512, amx) this CPU can execute."""
    return cpu_isa.use(request.param, monkeypatch)


def test_kernels_build_on_this_machine() -> None:
    """CI must run the kernel, not silently fall back to the gather path."""
    assert os.environ.get("KVBRIDGE_CPU_KERNELS") != "0"
    assert cpu_kernels.available()




@pytest.mark.parametrize("heads_kv,head_dim,block_size,window", DECODE_GRID)
def test_kernel_matches_gather_and_sdpa(heads_kv: tuple[int, int], head_dim: int, block_size: int,
                                        window: int | None) -> None:
    heads, kv_heads = heads_kv
    contexts = [1, 2, block_size, block_size + 1, 40, 77, 3 * block_size]
    q, kv_layer, attn, _ = decode_case(heads, kv_heads, head_dim, block_size, contexts, window, seed=head_dim + block_size)
    layer = PagedAttention(heads, kv_heads, head_dim, fold_gqa_decode=False)
    assert layer.reads_in_place(q, kv_layer)
    decode = attn.decode
    assert decode is not None
    in_place = layer._decode(q, kv_layer, decode)
    layer.in_place_decode = False
    gathered = layer._decode(q, kv_layer, decode)
    assert in_place.shape == gathered.shape == (len(contexts), heads * head_dim)
    torch.testing.assert_close(in_place, gathered, rtol=1e-5, atol=1e-5)


def test_window_never_reads_blocks_behind_it() -> None:
    """Table entries wholly behind a sliding window may be anything (the null block): poison them."""
    q, kv_layer, _, heads = decode_case(4, 2, 64, 4, [30], 6, seed=1)
    attn = AttentionMetadata.build([1], [30], [[10**6] * 6 + list(range(1, 3))], 4, "cpu", 6)
    assert attn.decode is not None
    layer = PagedAttention(heads, 2, 64, fold_gqa_decode=False)
    out = layer._decode(q, kv_layer, attn.decode)  # would raise on block 10**6 if it were read
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("table,context", [([0, 99], 8), ([0, -1], 8), ([0, 1], 9), ([0, 1], 0)])
def test_kernel_refuses_out_of_range_blocks_and_contexts(table: list[int], context: int) -> None:
    q, kv_layer, _, _ = decode_case(4, 2, 64, 4, [8], None, seed=2)
    with pytest.raises(RuntimeError, match="paged_decode_attention"):
        cpu_kernels.paged_decode_attention(q, kv_layer, torch.tensor([table]), torch.tensor([context]), None, 0.125)


def test_kernel_refuses_wrong_dtypes_and_layouts() -> None:
    q, kv_layer, attn, _ = decode_case(4, 2, 64, 4, [8], None, seed=3)
    assert attn.decode is not None
    args = (attn.decode.block_index, attn.decode.context_lens, None, 0.125)
    with pytest.raises(RuntimeError, match="float32"):
        cpu_kernels.paged_decode_attention(q.double(), kv_layer.double(), *args)
    with pytest.raises(RuntimeError, match="contiguous"):
        cpu_kernels.paged_decode_attention(q, kv_layer.transpose(2, 3), *args)
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        cpu_kernels.paged_decode_attention(q[:, :3], kv_layer, *args)
