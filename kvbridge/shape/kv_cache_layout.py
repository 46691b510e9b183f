"""How one rank's KV cache memory is laid out: pages, logical and kernel blocks, Mamba states.

A rank's KV cache is ONE tensor of `num_blocks` equal *pages*. The KV cache manager hands out
pages as *logical* blocks (kv_cache_manager.py), one block table per KV cache group, and every
group's blocks come from the one pool, so a page must fit whichever group takes it:

- An attention group (full, sliding window, MLA) splits a page into `blocks_per_logical`
  *kernel* blocks of `kernel_block_size` tokens each (vLLM's `physical_blocks_per_logical`):
  logical block b is kernel blocks [b*r, (b+1)*r), and one kernel block is
  [kv_heads, slots, entries, kernel_block_size, head_size] (head-major, so a run of a rank's
  heads is contiguous: kv_transfer/read_plan/tp_mapping.py). The attention layers index kernel blocks; a logical
  block holds `kernel_block_size * blocks_per_logical` tokens.
- A Mamba group's page is one request's recurrent state for each of the group's `slots`
  layers: slot s's conv state [conv_dim, K-1] then its SSM state [H, P, N] (this rank's
  part), packed, then padding to the page size. A request holds one page per Mamba group.

Page size (vLLM's rule for hybrid models). Without Mamba layers a logical block is one kernel
block (`blocks_per_logical` = 1) of the configured block size. With Mamba layers the
configured block size is the attention kernel's, and the logical block is the fewest kernel
blocks whose attention KV is at least one Mamba page:

    blocks_per_logical = ceil(mamba_state_elems / (kernel_block_size * attention_elems_per_token))

and the Mamba page is padded up to that. A rank's Mamba state shrinks with the TP size in
its own way (heads split; B and C of a group replicated when the groups do not split), and
its attention KV in another (KV heads split or replicated), so engines of different TP sizes
end up with different ratios and logical block sizes over the same kernel block: P and D
must exchange their ratios (kv_transfer/read_plan/block_mapping.py). A model of Mamba layers only has
pages of one state and a logical block of the configured size.

Pure planning (`plan_kv_cache_layout`) plus the views the model runner and the models use;
unit-tested in tests/unit/test_kv_cache_layout.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbridge.shape.kv_groups import KVCacheKind, layer_groups, slots_per_block
from kvbridge.shape.mamba_shard import mamba2_shard
from kvbridge.shape.model_config import ModelArchConfig
from kvbridge.shape.tp_split import rank_shard


@dataclass(frozen=True)
class MambaStateShape:
    """One layer's recurrent state on one rank."""

    conv: tuple[int, int]  # [conv_dim of the rank, K - 1]
    ssm: tuple[int, int, int]  # [heads of the rank, head_dim, state_size]

    @property
    def conv_elems(self) -> int:
        return self.conv[0] * self.conv[1]

    @property
    def ssm_elems(self) -> int:
        return self.ssm[0] * self.ssm[1] * self.ssm[2]

    @property
    def elems(self) -> int:
        return self.conv_elems + self.ssm_elems


@dataclass(frozen=True)
class KVCacheLayout:
    num_blocks: int  # logical blocks (pages)
    kernel_block_size: int  # tokens per attention kernel block
    blocks_per_logical: int  # kernel blocks per logical block (vLLM's physical_blocks_per_logical)
    slots: int  # layers per KV cache group
    kv_heads: int  # attention KV heads this rank holds (0: no attention layers)
    entries: int  # K and V (2) or MLA's latent (1)
    head_size: int
    mamba: MambaStateShape | None  # per layer, when the model has Mamba layers
    page_elems: int  # elements of one logical block

    @property
    def logical_block_size(self) -> int:
        """Tokens per logical block: the block size of the scheduler and of prefix caching."""
        return self.kernel_block_size * self.blocks_per_logical

    @property
    def kernel_block_elems(self) -> int:
        return self.kv_heads * self.slots * self.entries * self.kernel_block_size * self.head_size

    @property
    def num_kernel_blocks(self) -> int:
        return self.num_blocks * self.blocks_per_logical

    @property
    def mamba_page_elems(self) -> int:
        """Elements of a Mamba page that hold state (the rest is padding)."""
        return self.slots * self.mamba.elems if self.mamba is not None else 0

    @property
    def attention_shape(self) -> tuple[int, ...]:
        """[kernel blocks, kv_heads, slots, entries, kernel_block_size, head_size]."""
        return (self.num_kernel_blocks, self.kv_heads, self.slots, self.entries, self.kernel_block_size,
                self.head_size)

    def allocate(self, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        """The rank's KV cache: the attention view (kernel-block-major, contiguous) when the model
        has attention layers, else the pages as [num_blocks, page_elems]."""
        if self.kv_heads:
            return torch.empty(self.attention_shape, dtype=dtype, device=device)
        return torch.empty(self.num_blocks, self.page_elems, dtype=dtype, device=device)

    def pages(self, kv_cache: torch.Tensor) -> torch.Tensor:
        """The same memory as [num_blocks, page_elems]."""
        return kv_cache.view(self.num_blocks, self.page_elems)

    def mamba_views(self, kv_cache: torch.Tensor, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Slot `slot`'s (conv_states [num_blocks, conv_dim, K-1], ssm_states [num_blocks, H, P, N]):
        strided views of every page, indexed by a Mamba group's block id."""
        if self.mamba is None or not 0 <= slot < self.slots:
            raise ValueError(f"no Mamba slot {slot} in this layout")
        flat = kv_cache.view(-1)
        m, page = self.mamba, self.page_elems
        start = slot * m.elems
        conv = flat.as_strided((self.num_blocks, *m.conv), (page, m.conv[1], 1), start)
        ssm = flat.as_strided((self.num_blocks, *m.ssm), (page, m.ssm[1] * m.ssm[2], m.ssm[2], 1),
                              start + m.conv_elems)
        return conv, ssm

    def kernel_block_ids(self, logical_ids: list[int]) -> list[int]:
        """A token-indexed group's logical block ids as the attention kernel's block ids."""
        r = self.blocks_per_logical
        if r == 1:
            return list(logical_ids)
        return [k for b in logical_ids for k in range(b * r, b * r + r)]


def mamba_state_shape(arch: ModelArchConfig, tp_size: int = 1, rank: int = 0) -> MambaStateShape | None:
    """This rank's state of one Mamba layer, or None for a model without Mamba layers."""
    if arch.mamba is None:
        return None
    c = arch.mamba
    shard = mamba2_shard(c, tp_size, rank)
    conv_dim = shard.num_heads * c.head_dim + 2 * shard.num_groups * c.state_size
    return MambaStateShape((conv_dim, c.conv_kernel - 1), (shard.num_heads, c.head_dim, c.state_size))


def plan_kv_cache_layout(arch: ModelArchConfig, block_size: int, num_blocks: int, kv_heads: int,
                         tp_size: int = 1, rank: int = 0) -> KVCacheLayout:
    """The layout of a rank holding `kv_heads` attention KV heads, for the configured
    `block_size` (the attention kernel's) and `num_blocks` logical blocks (module docstring)."""
    if block_size < 1 or num_blocks < 1:
        raise ValueError(f"block_size and num_blocks must be >= 1, got {block_size} and {num_blocks}")
    groups = layer_groups(arch)
    slots = slots_per_block(arch)
    has_attention = any(g.kind is not KVCacheKind.MAMBA for g in groups)
    mamba = mamba_state_shape(arch, tp_size, rank)
    heads = kv_heads if has_attention else 0
    layout = KVCacheLayout(num_blocks, block_size, 1, slots, heads, arch.cache_entries, arch.cache_head_size,
                           mamba, 0)
    attention_per_token = heads * slots * arch.cache_entries * arch.cache_head_size
    mamba_elems = layout.mamba_page_elems
    if not has_attention:
        return _with(layout, page_elems=mamba_elems)
    ratio = 1 if mamba is None else max(1, -(-mamba_elems // (block_size * attention_per_token)))
    return _with(layout, blocks_per_logical=ratio, page_elems=ratio * block_size * attention_per_token)


def _with(layout: KVCacheLayout, **changes: int) -> KVCacheLayout:
    from dataclasses import replace
    return replace(layout, **changes)


def rank_kv_cache_layout(arch: ModelArchConfig, block_size: int, num_blocks: int, tp_size: int = 1,
                         rank: int = 0) -> KVCacheLayout:
    """`plan_kv_cache_layout` for rank `rank` of `tp_size` (its share of the KV heads)."""
    heads = rank_shard(arch.num_heads, arch.cache_kv_heads, tp_size, rank).num_kv_heads
    return plan_kv_cache_layout(arch, block_size, num_blocks, heads, tp_size, rank)


def logical_block_size(arch: ModelArchConfig, block_size: int, tp_size: int = 1) -> int:
    """Tokens per scheduler block for the configured (kernel) `block_size` at `tp_size`."""
    return rank_kv_cache_layout(arch, block_size, 1, tp_size).logical_block_size
