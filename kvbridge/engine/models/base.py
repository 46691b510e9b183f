"""The contract every model class keeps (`CausalLM`); the package's docstring says how the model
runner uses it."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from typing import Generic, TypeVar, cast

import torch

from kvbridge.engine.layers.attention import AttentionMetadata
from kvbridge.engine.layers.weights import WeightSlot
from kvbridge.shape.model_config import ModelArchConfig


M = TypeVar("M", bound=torch.nn.Module)


class LayerList(torch.nn.ModuleList, Generic[M]):
    """An nn.ModuleList of one kind of layer, iterated as that kind (the state dict is a
    ModuleList's: `layers.0.`, `layers.1.`, ...)."""

    def __init__(self, layers: Iterable[M]) -> None:
        super().__init__(layers)

    def __iter__(self) -> Iterator[M]:
        return cast(Iterator[M], super().__iter__())  # every item was given as an M


class CausalLM(torch.nn.Module, ABC):
    """A decoder-only LM over a paged KV cache."""

    arch: ModelArchConfig

    @abstractmethod
    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy Hugging Face-named tensors in; ValueError names any missing/unexpected/mis-shaped one."""

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every Hugging Face tensor `load_weights` takes, with its whole (unsharded) shape."""
        return {name: slot.checkpoint_shape() for name, slot in self._weight_slots().items()}

    @abstractmethod
    def _weight_slots(self) -> dict[str, WeightSlot]:
        """Where each checkpoint tensor goes (layers/weights.py)."""

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
