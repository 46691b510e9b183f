"""Copying Hugging Face-named checkpoint tensors into a model's (possibly fused, possibly
TP-sharded) parameters, all or nothing.

A model describes where each checkpoint tensor goes with a `WeightSlot` per name;
`load_slots` checks every name and shape first and copies only when all are right, so
a bad checkpoint leaves the model untouched and the error names every problem.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

# Non-persistent buffers that older checkpoints sometimes contain; they carry no weights.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class WeightSlot:
    """Where one checkpoint tensor goes: rows [start, start + rows) of a (possibly fused) parameter.
    `src` = (dim, start, length, whole): this rank's part [start, start + length) along `dim` of a
    checkpoint tensor `whole` long in that dim (TP), or None for the whole tensor. `transform`
    rewrites the whole checkpoint tensor first (e.g. a row permutation), keeping its shape."""

    param: torch.Tensor
    start: int
    rows: int
    src: tuple[int, int, int, int] | None = None
    transform: Callable[[torch.Tensor], torch.Tensor] | None = None

    @property
    def target(self) -> torch.Tensor:
        return self.param.narrow(0, self.start, self.rows)

    def checkpoint_shape(self) -> tuple[int, ...]:
        """The shape of the whole checkpoint tensor this slot takes its part of."""
        shape = list(self.target.shape)
        if self.src is not None:
            shape[self.src[0]] = self.src[3]
        return tuple(shape)

    def source(self, tensor: torch.Tensor) -> torch.Tensor:
        """The rank's part of a checkpoint tensor; a mis-shaped one unchanged (load_slots reports it)."""
        if self.transform is not None:
            tensor = self.transform(tensor)
        if self.src is None:
            return tensor
        dim, start, length, whole = self.src
        if tensor.dim() <= dim or tensor.shape[dim] != whole:
            return tensor
        return tensor.narrow(dim, start, length)


def whole(param: torch.Tensor) -> WeightSlot:
    return WeightSlot(param, 0, param.shape[0])


def load_slots(slots: dict[str, WeightSlot], weights: dict[str, torch.Tensor],
               tied_head: torch.Tensor | None = None) -> None:
    """Copy `weights` into `slots`, all or nothing. `tied_head` = the embedding weight of a model
    with tied embeddings, against which a stored `lm_head.weight` is only shape-checked.

    Raises ValueError naming every missing, unexpected or mis-shaped tensor; on error nothing
    is copied."""
    unexpected, misshaped = [], []
    for name, tensor in weights.items():
        if name.endswith(IGNORED_SUFFIXES):
            continue
        if name == "lm_head.weight" and tied_head is not None and name not in slots:
            if tuple(tensor.shape) != tuple(tied_head.shape):
                misshaped.append(f"lm_head.weight: expected {tuple(tied_head.shape)}, got {tuple(tensor.shape)}")
            continue
        slot = slots.get(name)
        if slot is None:
            unexpected.append(name)
        elif tuple(tensor.shape) != slot.checkpoint_shape():
            misshaped.append(f"{name}: expected {slot.checkpoint_shape()}, got {tuple(tensor.shape)}")
    missing = sorted(set(slots) - set(weights))
    if missing or unexpected or misshaped:
        raise ValueError(_describe_problems(missing, sorted(unexpected), misshaped))
    for name, slot in slots.items():
        slot.target.copy_(slot.source(weights[name]))


class Embedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype, device=device),
                                   requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


def _describe_problems(missing: list[str], unexpected: list[str], misshaped: list[str]) -> str:
    def listed(label: str, items: list[str]) -> str:
        shown = ", ".join(items[:8]) + (f", ... ({len(items)} in all)" if len(items) > 8 else "")
        return f"{label}: {shown}"
    parts = [listed(label, items) for label, items in
             (("missing", missing), ("unexpected", unexpected), ("wrong shape", misshaped)) if items]
    return "cannot load weights; " + "; ".join(parts)
