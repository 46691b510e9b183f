"""Model classes of the engine and the one function the model runner builds them with.

Contract (the model runner codes against it):
- `build_model(arch, dtype, device)` returns a `CausalLM` with uninitialised weights;
  the runner then calls `load_weights` with Hugging Face tensor names.
- The runner allocates ONE KV cache tensor of shape `kv_cache_shape(arch, num_blocks,
  block_size, num_kv_heads)` = [num_blocks, num_kv_heads, num_layers, entries, block_size,
  head_size] (Llama family: entries 0 = K, 1 = V of head_dim each, num_kv_heads this rank's;
  MLA: one KV head, one entry = the latent of kv_lora_rank + qk_rope_head_dim values, the
  same on every TP rank; see ModelArchConfig.cache_*). num_layers becomes the layers per KV
  cache group when a model mixes full and sliding-window layers (shape/kv_groups.py); then
  `forward` gets one AttentionMetadata per group. With kernel blocks smaller than the
  scheduler's blocks (hybrid Mamba models) the first dimension counts kernel blocks, and a
  Bamba model also keeps its Mamba states in the same memory (shape/kv_cache_layout.py: the runner
  allocates the tensor from a `KVCacheLayout` and binds the layout to the model). Block-major, so a block of every
  layer is contiguous for KV transfers, and head-major within a block, so a run of heads
  of a block is contiguous too (a decode rank of another TP size reads its heads as one
  span: kv_transfer/read_plan/tp_mapping.py). Layer i uses the view `kv_cache[:, :, i]`.
- Each step: `forward(input_ids, positions, attn, kv_cache)` -> hidden [T, hidden], then
  `compute_logits(hidden[rows])` -> fp32 logits for the rows it samples from.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvbridge.engine.layers.attention import AttentionMetadata
from kvbridge.engine.models.bamba import BambaForCausalLM
from kvbridge.engine.models.base import CausalLM
from kvbridge.engine.models.deepseek import DeepseekForCausalLM
from kvbridge.engine.models.llama import LlamaForCausalLM
from kvbridge.shape.kv_groups import slots_per_block
from kvbridge.shape.mamba_shard import mamba2_shard
from kvbridge.shape.model_config import ModelArchConfig, ModelFamily
from kvbridge.shape.tp_split import RankShard, TPSplitError, check_tp_split


def kv_cache_shape(arch: ModelArchConfig, num_blocks: int, block_size: int,
                   num_kv_heads: int | None = None) -> tuple[int, ...]:
    """The shape of the single KV cache tensor the runner allocates for `arch` (for a TP rank:
    `num_kv_heads` = the heads it holds; default all)."""
    heads = arch.cache_kv_heads if num_kv_heads is None else num_kv_heads
    return (num_blocks, heads, slots_per_block(arch), arch.cache_entries, block_size, arch.cache_head_size)


def check_arch_tp_split(arch: ModelArchConfig, tp_size: int) -> None:
    """Raises TPSplitError when `tp_size` ranks cannot split this model (heads, MLP, experts)."""
    check_tp_split(arch.num_heads, arch.cache_kv_heads, tp_size, arch.intermediate_size)
    if arch.mamba is not None:
        mamba2_shard(arch.mamba, tp_size, 0)  # raises TPSplitError naming the Mamba heads or groups
    if arch.moe is not None:
        moe = arch.moe
        for what, size in (("MoE expert intermediate size", moe.moe_intermediate_size),
                           ("shared experts' intermediate size", moe.moe_intermediate_size * moe.num_shared_experts)):
            if size % tp_size:
                raise TPSplitError(f"tensor parallel size {tp_size} does not divide the {what} {size}")


def build_model(arch: ModelArchConfig, dtype: torch.dtype, device: torch.device | str,
                shard: RankShard | None = None,
                all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> CausalLM:
    """An eval-mode model for arch on device, weights allocated in dtype but not yet loaded.
    With a TP `shard`, only that rank's part, summing partial outputs with `all_reduce`."""
    families: dict[ModelFamily, type[CausalLM]] = {
        ModelFamily.LLAMA: LlamaForCausalLM,
        ModelFamily.QWEN2: LlamaForCausalLM,  # differs by arch.attention_bias
        ModelFamily.QWEN3: LlamaForCausalLM,  # differs by arch.qk_norm
        ModelFamily.MISTRAL: LlamaForCausalLM,  # differs by arch.layer_types (sliding window)
        ModelFamily.DEEPSEEK_V2: DeepseekForCausalLM,
        ModelFamily.DEEPSEEK_V3: DeepseekForCausalLM,  # differs by arch.moe's routing
        ModelFamily.BAMBA: BambaForCausalLM,  # Mamba2 + attention: its KV cache is a hybrid layout
    }
    model_cls = families.get(arch.family)
    if model_cls is None:
        raise ValueError(f"no model class for family {arch.family!r}")
    return model_cls(arch, dtype, torch.device(device), shard=shard, all_reduce=all_reduce).eval()


__all__ = ["AttentionMetadata", "CausalLM", "build_model", "check_arch_tp_split", "kv_cache_shape"]
