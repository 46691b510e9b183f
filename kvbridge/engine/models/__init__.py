"""Model classes of the engine and the one function the model runner builds them with.

Contract (the model runner codes against it):
- `build_model(arch, dtype, device)` returns a `CausalLM` with uninitialised weights;
  the runner then calls `load_weights` with Hugging Face tensor names.
- The runner allocates ONE KV cache tensor of shape `kv_cache_shape(arch, num_blocks,
  block_size)` = [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim] (0 = K,
  1 = V; block-major, so a block of every layer is contiguous for KV transfers) and passes
  it to every `forward`; layer i uses the view `kv_cache[:, i]`.
- Each step: `forward(input_ids, positions, attn, kv_cache)` -> hidden [T, hidden], then
  `compute_logits(hidden[rows])` -> fp32 logits for the rows it samples from.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from kvbridge.engine.layers.attention import AttentionMetadata
from kvbridge.engine.models.config import ModelArchConfig, ModelFamily


class CausalLM(torch.nn.Module, ABC):
    """A decoder-only LM over a paged KV cache."""

    arch: ModelArchConfig

    @abstractmethod
    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy Hugging Face-named tensors in; ValueError names any missing/unexpected/mis-shaped one."""

    @abstractmethod
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata,
                kv_cache: torch.Tensor) -> torch.Tensor:
        """int64 [T] token ids and absolute positions -> final hidden states [T, hidden].

        Writes the new tokens' K/V into kv_cache at attn.slot_mapping, and attends each token
        to its sequence's earlier context (read from the cache) and causally to the new tokens.
        """

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> fp32 logits [N, vocab]."""


def kv_cache_shape(arch: ModelArchConfig, num_blocks: int, block_size: int) -> tuple[int, ...]:
    """The shape of the single KV cache tensor the runner allocates for `arch`."""
    return (num_blocks, arch.num_layers, 2, block_size, arch.num_kv_heads, arch.head_dim)


def build_model(arch: ModelArchConfig, dtype: torch.dtype, device: torch.device | str) -> CausalLM:
    """An eval-mode model for arch on device, weights allocated in dtype but not yet loaded."""
    # Imported here because the family modules import CausalLM from this package.
    from kvbridge.engine.models.llama import LlamaForCausalLM

    families: dict[ModelFamily, type[CausalLM]] = {
        ModelFamily.LLAMA: LlamaForCausalLM,
        ModelFamily.QWEN2: LlamaForCausalLM,  # differs by arch.attention_bias
        ModelFamily.QWEN3: LlamaForCausalLM,  # differs by arch.qk_norm
    }
    model_cls = families.get(arch.family)
    if model_cls is None:
        raise ValueError(f"no model class for family {arch.family!r}")
    return model_cls(arch, dtype, torch.device(device)).eval()


__all__ = ["AttentionMetadata", "CausalLM", "build_model", "kv_cache_shape"]
