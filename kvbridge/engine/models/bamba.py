"""Bamba (`BambaForCausalLM`): a hybrid of Mamba2 mixers and Llama-style attention layers.

Every layer is `h += mixer(input_layernorm(h)); h += feed_forward(pre_ff_layernorm(h))`, where
the mixer is a Mamba2 mixer (layers/mamba2.py) or, at the config's `attn_layer_indices`,
grouped-query attention with rotary on the first half of each head (`partial_rotary_factor`
0.5, as transformers hard-codes for Bamba); the feed-forward is Llama's gated SiLU MLP.

KV cache (shape/kv_cache_layout.py): the layers fall into KV cache groups (shape/kv_groups.py), attention
groups and Mamba groups of equal layer counts. `forward` gets the rank's KV cache tensor
(kernel-block-major attention view) and one metadata per group: an AttentionMetadata over
kernel block ids for an attention group, a Mamba2Metadata whose state slots are the requests'
block ids of that Mamba group. A Mamba layer in slot s reads and writes its state through
`KVCacheLayout.mamba_views(kv_cache, s)`, strided views of the same pages.

Tensor parallelism: attention and MLP split as Llama's; Mamba heads (and groups, or copies of
one) as `Mamba2Mixer`'s.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from kvbridge.engine.layers.attention import AttentionMetadata
from kvbridge.engine.layers.linear import Linear
from kvbridge.engine.layers.mamba2 import Mamba2Metadata, Mamba2Mixer, mamba2_weight_slots
from kvbridge.engine.layers.norm import RMSNorm
from kvbridge.engine.layers.rotary import RotaryEmbedding
from kvbridge.engine.layers.weights import Embedding, WeightSlot, load_slots, whole
from kvbridge.engine.models.base import CausalLM, LayerList
from kvbridge.engine.models.llama import (HeadAndPrepack, LlamaAttention, LlamaMLP, attention_weight_slots,
                                          mlp_weight_slots)
from kvbridge.shape.kv_cache_layout import KVCacheLayout
from kvbridge.shape.kv_groups import layer_groups, layer_slots
from kvbridge.shape.model_config import ModelArchConfig
from kvbridge.shape.tp_split import RankShard, rank_shard

AllReduce = Callable[[torch.Tensor], torch.Tensor]
GroupMetadata = AttentionMetadata | Mamba2Metadata


class BambaDecoderLayer(nn.Module):
    def __init__(self, arch: ModelArchConfig, is_mamba: bool, dtype: torch.dtype, device: torch.device,
                 shard: RankShard, all_reduce: AllReduce | None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype, device)
        self.pre_ff_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype, device)
        self.feed_forward = LlamaMLP(arch, dtype, device, shard.tp_size, all_reduce)
        self.mamba: Mamba2Mixer | None = None
        self.self_attn: LlamaAttention | None = None
        if is_mamba:
            assert arch.mamba is not None
            self.mamba = Mamba2Mixer(arch.mamba, dtype, device, shard.tp_size, shard.rank, all_reduce)
        else:
            self.self_attn = LlamaAttention(arch, dtype, device, device.type == "cuda", shard, all_reduce)


class BambaModel(nn.Module):
    """The body, named like the Hugging Face `model.` prefix."""

    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype, device: torch.device, shard: RankShard,
                 all_reduce: AllReduce | None) -> None:
        super().__init__()
        types = arch.layer_types or ("full_attention",) * arch.num_layers
        self.embed_tokens = Embedding(arch.vocab_size, arch.hidden_size, dtype, device)
        self.layers = LayerList(BambaDecoderLayer(arch, t == "mamba", dtype, device, shard, all_reduce)
                                for t in types)
        self.final_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype, device)


class BambaForCausalLM(HeadAndPrepack, CausalLM):
    """Bamba over a hybrid KV cache: call `bind_kv_cache_layout` before the first forward."""

    model: BambaModel

    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype, device: torch.device | str,
                 shard: RankShard | None = None, all_reduce: AllReduce | None = None) -> None:
        super().__init__()
        device = torch.device(device)
        if arch.mamba is None:
            raise ValueError("a Bamba model needs a Mamba2 config")
        self.arch = arch
        self.shard = shard or rank_shard(arch.num_heads, arch.num_kv_heads, 1, 0)
        if self.shard.tp_size > 1 and all_reduce is None:
            raise ValueError("a tensor-parallel shard needs an all_reduce over its ranks")
        self.model = BambaModel(arch, dtype, device, self.shard, all_reduce)
        self.lm_head = None if arch.tie_word_embeddings else Linear(arch.hidden_size, arch.vocab_size, False,
                                                                     dtype, device)
        self._packed_head: torch.Tensor | None = None
        self.rotary = RotaryEmbedding(arch.rope_dim, arch.rope_theta, arch.max_position_embeddings, dtype, device)
        groups = layer_groups(arch)
        self.num_groups = len(groups)
        self.layer_slots = layer_slots(groups, arch.num_layers)
        self.layout: KVCacheLayout | None = None

    def bind_kv_cache_layout(self, layout: KVCacheLayout) -> None:
        """How the KV cache tensor `forward` gets is laid out (where the Mamba states are)."""
        if layout.mamba is None or layout.slots != len(self.model.layers) // self.num_groups:
            raise ValueError("the KV cache layout does not match this model's groups")
        self.layout = layout

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,  # type: ignore[override]
                attn: Sequence[GroupMetadata], kv_cache: torch.Tensor) -> torch.Tensor:
        # (a hybrid model takes one metadata per KV cache group, Mamba's too: the model runner
        # passes the sequence whenever a model has more than one group)
        """Hidden states after the final norm, [T, hidden]; `attn`: one metadata per KV cache group."""
        if self.layout is None:
            raise RuntimeError("bind_kv_cache_layout first")
        metas = tuple(attn)
        if len(metas) != self.num_groups:
            raise ValueError(f"{len(metas)} metadata for {self.num_groups} KV cache groups")
        h = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary.lookup(positions)
        for layer, (group, slot) in zip(self.model.layers, self.layer_slots):
            x = layer.input_layernorm(h)
            meta = metas[group]
            if layer.mamba is not None:
                if not isinstance(meta, Mamba2Metadata):
                    raise ValueError(f"KV cache group {group} holds Mamba layers: it needs a Mamba2Metadata")
                conv, ssm = self.layout.mamba_views(kv_cache, slot)
                h = h + layer.mamba(x, conv, ssm, meta)
            else:
                assert layer.self_attn is not None
                if not isinstance(meta, AttentionMetadata):
                    raise ValueError(f"KV cache group {group} holds attention layers: it needs an AttentionMetadata")
                h = h + layer.self_attn(x, cos, sin, kv_cache[:, :, slot].permute(0, 2, 3, 1, 4), meta)
            h = h + layer.feed_forward(layer.pre_ff_layernorm(h))
        out: torch.Tensor = self.model.final_layernorm(h)
        return out

    @torch.inference_mode()
    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        load_slots(self._weight_slots(), weights,
                   tied_head=self.model.embed_tokens.weight if self.lm_head is None else None)
        for layer in self.model.layers:
            if layer.self_attn is not None:
                layer.self_attn.refresh_derived()
        self._prepack()

    def _weight_slots(self) -> dict[str, WeightSlot]:
        slots = {"model.embed_tokens.weight": whole(self.model.embed_tokens.weight),
                 "model.final_layernorm.weight": whole(self.model.final_layernorm.weight)}
        if self.lm_head is not None:
            slots["lm_head.weight"] = whole(self.lm_head.weight)
        for i, layer in enumerate(self.model.layers):
            p = f"model.layers.{i}."
            if layer.mamba is not None:
                slots.update(mamba2_weight_slots(layer.mamba, f"{p}mamba."))
            else:
                assert layer.self_attn is not None  # every layer is Mamba or attention
                slots.update(attention_weight_slots(layer.self_attn, self.arch, self.shard, f"{p}self_attn."))
            slots.update(mlp_weight_slots(layer.feed_forward, self.arch, self.shard, f"{p}feed_forward."))
            slots[f"{p}input_layernorm.weight"] = whole(layer.input_layernorm.weight)
            slots[f"{p}pre_ff_layernorm.weight"] = whole(layer.pre_ff_layernorm.weight)
        return slots
