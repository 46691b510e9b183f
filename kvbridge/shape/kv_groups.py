"""Which layers share a KV cache group, and where a layer's KV lives in a block.

A model's layers are grouped by the kind of KV they keep (full attention, MLA, sliding
window). Every group has the SAME number of layers, `slots_per_block`, so one block of the
shared pool has the same bytes whatever group it serves (vLLM's hybrid allocator does the
same): a block is [kv_heads, slots_per_block, entries, block_size, head_size], and the
layer in slot s of group g keeps its KV at slot s of the blocks in g's block table.

- One kind of layer (every Llama, Qwen and DeepSeek model without sliding layers): one
  group of all layers, slots_per_block = num_layers: the layout of a single-group model is
  unchanged.
- Full and sliding layers mixed (Qwen2/Qwen3 `layer_types`): each kind's layers, in order,
  split into groups of g = gcd(#full, #sliding) layers; e.g. 2 full + 4 sliding layers give
  groups [full 0, 1], [sliding 2, 3], [sliding 4, 5] of 2 slots.
- Mamba and attention layers mixed (Bamba): the same rule; a Mamba group's block holds the
  recurrent state of its layers for one request (kv_cache_layout.py says how the bytes of a
  block are shared out, and how big a block is).

Pure functions over the architecture; unit-tested exhaustively in tests/unit/test_kv_groups.py.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from math import gcd

from kvbridge.shape.model_config import ModelArchConfig


class KVCacheKind(enum.Enum):
    FULL_ATTENTION = "full_attention"
    MLA = "mla"  # multi-head latent attention: one compressed latent per token, all heads share it
    SLIDING_WINDOW = "sliding_window"  # a token sees the last `sliding_window` tokens only
    MAMBA = "mamba"  # one recurrent state (conv + SSM) per request: its one block, whatever its length

    @property
    def keeps_every_token(self) -> bool:
        """A request's blocks cover its whole context, block i holding tokens [i*bs, (i+1)*bs)."""
        return self in (KVCacheKind.FULL_ATTENTION, KVCacheKind.MLA)

    @property
    def token_indexed(self) -> bool:
        """Block i holds tokens [i*bs, (i+1)*bs) (every kind but a Mamba state)."""
        return self is not KVCacheKind.MAMBA


@dataclass(frozen=True)
class LayerGroup:
    kind: KVCacheKind
    layer_ids: tuple[int, ...]
    sliding_window: int | None = None  # SLIDING_WINDOW only


def layer_kinds(arch: ModelArchConfig) -> list[KVCacheKind]:
    if arch.mla is not None:
        return [KVCacheKind.MLA] * arch.num_layers
    types = arch.layer_types or ("full_attention",) * arch.num_layers
    kinds = {"sliding_attention": KVCacheKind.SLIDING_WINDOW, "mamba": KVCacheKind.MAMBA}
    return [kinds.get(t, KVCacheKind.FULL_ATTENTION) for t in types]


def layer_groups(arch: ModelArchConfig) -> tuple[LayerGroup, ...]:
    """The model's KV cache groups, every one with the same number of layers (see module doc).
    Groups are ordered by their first layer."""
    kinds = layer_kinds(arch)
    by_kind: dict[KVCacheKind, list[int]] = {}
    for layer, kind in enumerate(kinds):
        by_kind.setdefault(kind, []).append(layer)
    size = 0
    for layers in by_kind.values():
        size = gcd(size, len(layers))
    groups = [LayerGroup(kind, tuple(layers[i:i + size]),
                         arch.sliding_window if kind is KVCacheKind.SLIDING_WINDOW else None)
              for kind, layers in by_kind.items() for i in range(0, len(layers), size)]
    return tuple(sorted(groups, key=lambda g: g.layer_ids[0]))


def slots_per_block(arch: ModelArchConfig) -> int:
    return len(layer_groups(arch)[0].layer_ids)


def layer_slots(groups: tuple[LayerGroup, ...], num_layers: int) -> list[tuple[int, int]]:
    """(group index, slot) of every layer."""
    where: dict[int, tuple[int, int]] = {}
    for gi, group in enumerate(groups):
        for slot, layer in enumerate(group.layer_ids):
            where[layer] = (gi, slot)
    if sorted(where) != list(range(num_layers)):
        raise ValueError("the groups do not cover every layer exactly once")
    return [where[layer] for layer in range(num_layers)]
