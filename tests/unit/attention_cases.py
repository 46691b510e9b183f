"""Inputs the CPU attention kernels' tests (fp32 and bf16) share: a decode case over a shuffled
paged cache, the grid of decode shapes, and a prompt's q, k, v as views into one fused tensor."""

from __future__ import annotations

import itertools
import random

import torch

from kvbridge.engine.layers.attention import AttentionMetadata


def decode_case(heads: int, kv_heads: int, head_dim: int, block_size: int, contexts: list[int],
                window: int | None, seed: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, int]:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    per_seq = [-(-c // block_size) for c in contexts]
    num_blocks = sum(per_seq) + 3
    ids = list(range(1, num_blocks))
    rng.shuffle(ids)
    tables = []
    for n in per_seq:
        tables.append(ids[:n])
        ids = ids[n:]
    slots = 3  # layers in a block; the kernel reads the middle one's strided view
    cache = torch.randn(num_blocks, kv_heads, slots, 2, block_size, head_dim, generator=gen)
    kv_layer = cache[:, :, 1].permute(0, 2, 3, 1, 4)
    attn = AttentionMetadata.build([1] * len(contexts), contexts, tables, block_size, "cpu", window)
    q = torch.randn(len(contexts), heads + kv_heads, head_dim, generator=gen)[:, :heads]  # strided, as the model's
    return q, kv_layer, attn, heads


DECODE_GRID = list(itertools.product([(4, 4), (4, 2), (9, 3), (8, 1)], [24, 64, 128], [1, 4, 16], [None, 5, 37]))


def fused_qkv(length: int, heads: int, kv_heads: int, head_dim: int, seed: int) -> tuple[torch.Tensor, ...]:
    """q, k, v as the model has them: views into one fused [L, heads + 2 kv_heads, D] tensor."""
    gen = torch.Generator().manual_seed(seed)
    fused = torch.randn(length, heads + 2 * kv_heads, head_dim, generator=gen) * 2
    return fused[:, :heads], fused[:, heads:heads + kv_heads], fused[:, heads + kv_heads:]
