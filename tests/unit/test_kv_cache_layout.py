"""kv_cache_layout: page sizes, logical vs kernel blocks, and where Mamba states live in a page."""

from __future__ import annotations

import pytest
import torch

from kvbridge.engine.models import kv_cache_shape
from kvbridge.shape.kv_cache_layout import (logical_block_size, mamba_state_shape, plan_kv_cache_layout,
                                             rank_kv_cache_layout)
from kvbridge.shape.model_config import Mamba2Config, ModelArchConfig, ModelFamily


def arch(layer_types=None, mamba=None, kv_heads=1, head_dim=16) -> ModelArchConfig:
    layers = len(layer_types) if layer_types else 2
    return ModelArchConfig(family=ModelFamily.BAMBA if mamba else ModelFamily.LLAMA, vocab_size=32, hidden_size=64,
                           intermediate_size=128, num_layers=layers, num_heads=4, num_kv_heads=kv_heads,
                           head_dim=head_dim, layer_types=layer_types, mamba=mamba)


MAMBA = Mamba2Config(hidden_size=64, num_heads=4, head_dim=16, state_size=8, n_groups=1, conv_kernel=4)
HYBRID = ("mamba", "full_attention", "mamba", "mamba")  # groups of 1 slot


def test_an_attention_only_model_keeps_one_kernel_block_per_logical_block_and_its_old_shape():
    a = arch(kv_heads=2)
    layout = plan_kv_cache_layout(a, 16, 10, 2)
    assert layout.blocks_per_logical == 1 and layout.logical_block_size == 16 and layout.mamba is None
    assert layout.attention_shape == kv_cache_shape(a, 10, 16, 2)
    assert layout.page_elems == layout.kernel_block_elems == 2 * 2 * 2 * 16 * 16


@pytest.mark.parametrize("tp, ratio", [(1, 6), (2, 4), (4, 2)])
def test_the_logical_block_is_the_fewest_kernel_blocks_holding_a_mamba_page(tp, ratio):
    a = arch(HYBRID, MAMBA)
    layout = rank_kv_cache_layout(a, 4, 10, tp)
    state = layout.mamba_page_elems
    per_kernel_block = layout.kernel_block_elems
    assert layout.blocks_per_logical == ratio == -(-state // per_kernel_block)
    assert (ratio - 1) * per_kernel_block < state <= ratio * per_kernel_block == layout.page_elems
    assert logical_block_size(a, 4, tp) == 4 * ratio
    # TP splits Mamba heads but replicates the one KV head and the one B/C group: ratios differ
    conv_dim = 16 * (4 // tp) + 2 * 8
    assert mamba_state_shape(a, tp).conv == (conv_dim, 3) and mamba_state_shape(a, tp).ssm == (4 // tp, 16, 8)


def test_a_mamba_only_model_has_pages_of_one_state_and_the_configured_block_size():
    a = arch(("mamba", "mamba"), MAMBA)
    layout = plan_kv_cache_layout(a, 16, 5, 1)
    assert layout.kv_heads == 0 and layout.blocks_per_logical == 1 and layout.logical_block_size == 16
    assert layout.page_elems == layout.mamba_page_elems == 2 * ((64 + 16) * 3 + 4 * 16 * 8)
    assert layout.allocate(torch.float32, "cpu").shape == (5, layout.page_elems)


@pytest.mark.parametrize("slots", [1, 2])
def test_mamba_views_tile_each_page_once_and_leave_the_padding_alone(slots):
    types = ("mamba",) * (2 * slots) + ("full_attention",) * slots  # slots layers per group
    a = arch(types, MAMBA)
    layout = plan_kv_cache_layout(a, 4, 3, 1)
    assert layout.slots == slots
    cache = layout.allocate(torch.float32, "cpu").zero_()
    for slot in range(slots):
        conv, ssm = layout.mamba_views(cache, slot)
        assert conv.shape == (3, *layout.mamba.conv) and ssm.shape == (3, *layout.mamba.ssm)
        conv += 1  # every element of every page's state, once
        ssm += 1
    pages = layout.pages(cache)
    assert torch.equal(pages[:, :layout.mamba_page_elems], torch.ones(3, layout.mamba_page_elems))
    assert not pages[:, layout.mamba_page_elems:].any()
    conv, ssm = layout.mamba_views(cache, 0)
    conv[1] = 7  # block 1's state is page 1's bytes
    assert (pages[1, :conv[1].numel()] == 7).all() and (pages[0, :conv[1].numel()] == 1).all()
    with pytest.raises(ValueError):
        layout.mamba_views(cache, slots)


@pytest.mark.parametrize("ratio, ids", [(1, [3, 0]), (3, [2, 0]), (6, [1])])
def test_kernel_block_ids_of_a_logical_block_are_its_consecutive_kernel_blocks_of_the_same_page(ratio, ids):
    a = arch(kv_heads=1)
    layout = plan_kv_cache_layout(a, 4, 4, 1)
    layout = type(layout)(**{**layout.__dict__, "blocks_per_logical": ratio,
                              "page_elems": ratio * layout.kernel_block_elems})
    kernel = layout.kernel_block_ids(ids)
    assert kernel == [k for b in ids for k in range(b * ratio, (b + 1) * ratio)]
    cache = layout.allocate(torch.float32, "cpu").zero_()
    for k in kernel:
        cache[k] = 1
    pages = layout.pages(cache)
    assert [bool(pages[b].all()) for b in range(4)] == [b in ids for b in range(4)]


@pytest.mark.parametrize("block_size, blocks", [(0, 3), (4, 0), (0, 0)])
def test_sizes_below_one_are_refused(block_size, blocks):
    with pytest.raises(ValueError):
        plan_kv_cache_layout(arch(), block_size, blocks, 1)
