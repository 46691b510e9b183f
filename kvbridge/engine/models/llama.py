"""The Llama family: Llama, Qwen2 (bias on Q/K/V) and Qwen3 (per-head RMSNorm on Q and K).

The three differ only in two `ModelArchConfig` flags (`attention_bias`, `qk_norm`), so one
class serves them all. For speed the Q/K/V projections are fused into one matmul and so are
the MLP's gate/up projections; `load_weights` takes the Hugging Face names and writes each
tensor into its slice of the fused weight.

Tensor parallelism (Megatron-style): given a `RankShard`, a rank builds only its part. The
fused Q/K/V and gate/up projections are column-parallel (the rank's query heads, KV heads
and slice of the intermediate size), o_proj and down_proj are row-parallel (the matching
input columns) and their partial outputs are summed across ranks by `all_reduce`, twice
per layer. Embedding, norms and the LM head are replicated. `load_weights` still takes the
whole Hugging Face tensors and copies each rank's slice.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from kvbridge.engine.layers.activation import silu_and_mul
from kvbridge.engine.layers.attention import AttentionMetadata, PagedAttention
from kvbridge.engine.layers.linear import Linear, packed_linear, prepack_weight
from kvbridge.engine.layers.norm import RMSNorm, add_rms_norm_, rms_norm
from kvbridge.engine.layers.rotary import RotaryEmbedding
from kvbridge.engine.layers.weights import Embedding, WeightSlot, load_slots, whole
from kvbridge.engine.models.base import CausalLM, LayerList
from kvbridge.shape.kv_groups import layer_groups, layer_slots
from kvbridge.shape.model_config import ModelArchConfig
from kvbridge.shape.tp_split import RankShard, even_split, rank_shard

AllReduce = Callable[[torch.Tensor], torch.Tensor]  # sums a tensor over the TP ranks, in place


class LlamaAttention(nn.Module):
    qk_norm_weight: torch.Tensor  # a buffer (with qk_norm)
    q_norm: RMSNorm | None
    k_norm: RMSNorm | None
    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype, device: torch.device,
                 fold_gqa_decode: bool, shard: RankShard, all_reduce: AllReduce | None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = shard.num_q_heads, shard.num_kv_heads, arch.head_dim
        self.eps = arch.rms_norm_eps
        self.all_reduce = all_reduce
        qkv_out = (self.num_heads + 2 * self.num_kv_heads) * arch.head_dim
        self.qkv_proj = Linear(arch.hidden_size, qkv_out, arch.attention_bias, dtype, device)
        self.o_proj = Linear(self.num_heads * arch.head_dim, arch.hidden_size, False, dtype, device)
        self.q_norm = self.k_norm = None
        if arch.qk_norm:
            self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, dtype, device)
            self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, dtype, device)
            # q_norm's weight repeated per query head, then k_norm's per KV head, so Q and K are
            # normalised by one call; refreshed by `refresh_derived` after loading.
            self.register_buffer("qk_norm_weight", torch.empty(
                self.num_heads + self.num_kv_heads, arch.head_dim, dtype=dtype, device=device), persistent=False)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, arch.head_dim, fold_gqa_decode)

    def refresh_derived(self) -> None:
        if self.q_norm is not None and self.k_norm is not None:
            self.qk_norm_weight[:self.num_heads] = self.q_norm.weight
            self.qk_norm_weight[self.num_heads:] = self.k_norm.weight

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_layer: torch.Tensor,
                attn: AttentionMetadata) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        qk_width = (self.num_heads + self.num_kv_heads) * self.head_dim
        qk = qkv[:, :qk_width].view(num_tokens, -1, self.head_dim)  # Q and K heads side by side
        if self.q_norm is not None:
            qk = rms_norm(qk, self.qk_norm_weight, self.eps)
        qk = RotaryEmbedding.apply_(qk, cos, sin)  # in place: qk is this step's own projection
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        v = qkv[:, qk_width:].view(num_tokens, self.num_kv_heads, self.head_dim)
        out = self.o_proj(self.attn(q, k, v, kv_layer, attn))
        return out if self.all_reduce is None else self.all_reduce(out)


class LlamaMLP(nn.Module):
    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype, device: torch.device, tp_size: int,
                 all_reduce: AllReduce | None) -> None:
        super().__init__()
        self.intermediate_size = arch.intermediate_size // tp_size
        self.all_reduce = all_reduce
        self.gate_up_proj = Linear(arch.hidden_size, 2 * self.intermediate_size, False, dtype, device)
        self.down_proj = Linear(self.intermediate_size, arch.hidden_size, False, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        out = self.down_proj(silu_and_mul(gate_up))
        return out if self.all_reduce is None else self.all_reduce(out)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype, device: torch.device,
                 fold_gqa_decode: bool, shard: RankShard, all_reduce: AllReduce | None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype, device)
        self.self_attn = LlamaAttention(arch, dtype, device, fold_gqa_decode, shard, all_reduce)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype, device)
        self.mlp = LlamaMLP(arch, dtype, device, shard.tp_size, all_reduce)

    def forward(self, h: torch.Tensor, pending: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                kv_layer: torch.Tensor, attn: AttentionMetadata) -> torch.Tensor:
        """Updates the residual stream h in place and returns this layer's MLP output, not yet added:
        `pending` is the previous layer's (None for the first layer), added here by the input norm's
        one pass (add_rms_norm_), and the model's final norm adds the last layer's. One pass over h a
        layer fewer than adding each MLP output on its own."""
        norm = self.input_layernorm
        x = norm(h) if pending is None else add_rms_norm_(h, pending, norm.weight, norm.eps)
        delta = self.self_attn(x, cos, sin, kv_layer, attn)
        out: torch.Tensor = self.mlp(add_rms_norm_(h, delta, self.post_attention_layernorm.weight,
                                                   self.post_attention_layernorm.eps))
        return out


class LlamaModel(nn.Module):
    """The transformer body, named like the Hugging Face `model.` prefix."""

    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype, device: torch.device,
                 fold_gqa_decode: bool, shard: RankShard, all_reduce: AllReduce | None) -> None:
        super().__init__()
        self.embed_tokens = Embedding(arch.vocab_size, arch.hidden_size, dtype, device)
        self.layers = LayerList(LlamaDecoderLayer(arch, dtype, device, fold_gqa_decode, shard, all_reduce)
                                for _ in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype, device)


class EmbeddingBody(Protocol):
    """A model body with token embeddings (`model.embed_tokens`)."""

    @property
    def embed_tokens(self) -> Embedding: ...


class HeadAndPrepack:
    """For models with `model.embed_tokens`, an optional `lm_head` (None: tied embeddings) and
    `Linear` layers: logits through the head (tied: the embedding, prepacked), and the prepacking
    `load_weights` ends with."""

    model: EmbeddingBody
    lm_head: Linear | None
    _packed_head: torch.Tensor | None

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> fp32 logits [N, vocab]."""
        if self.lm_head is not None:
            logits: torch.Tensor = self.lm_head(hidden)
            return logits.float()
        if self._packed_head is not None:
            return packed_linear(hidden, self._packed_head, None).float()
        return F.linear(hidden, self.model.embed_tokens.weight).float()

    def _prepack(self) -> None:
        for module in self.modules():  # type: ignore[attr-defined]  # a mixin of nn.Module subclasses
            if isinstance(module, Linear):
                module.prepack()
        self._packed_head = prepack_weight(self.model.embed_tokens.weight) if self.lm_head is None else None


class LlamaForCausalLM(HeadAndPrepack, CausalLM):
    """Llama / Qwen2 / Qwen3 causal LM over a paged KV cache. Parameters stay uninitialised
    until `load_weights`.

    fold_gqa_decode: see `PagedAttention`; None picks per device (True on CUDA).
    shard, all_reduce: this rank's heads and the sum over TP ranks (None: one rank, the whole model).
    """

    model: LlamaModel

    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype, device: torch.device | str,
                 fold_gqa_decode: bool | None = None, shard: RankShard | None = None,
                 all_reduce: AllReduce | None = None) -> None:
        super().__init__()
        device = torch.device(device)
        self.arch = arch
        self.shard = shard or rank_shard(arch.num_heads, arch.num_kv_heads, 1, 0)
        if self.shard.tp_size > 1 and all_reduce is None:
            raise ValueError("a tensor-parallel shard needs an all_reduce over its ranks")
        fold = device.type == "cuda" if fold_gqa_decode is None else fold_gqa_decode
        self.model = LlamaModel(arch, dtype, device, fold, self.shard, all_reduce)
        self._packed_head: torch.Tensor | None = None  # tied embeddings, prepacked by load_weights
        self.lm_head = None if arch.tie_word_embeddings else Linear(
            arch.hidden_size, arch.vocab_size, False, dtype, device)
        self.rotary = RotaryEmbedding(arch.rope_dim, arch.rope_theta, arch.max_position_embeddings, dtype, device)
        groups = layer_groups(arch)
        self.num_groups, self.slots = len(groups), len(groups[0].layer_ids)
        self.layer_slots = layer_slots(groups, arch.num_layers)  # layer -> (KV cache group, slot in a block)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn: AttentionMetadata | Sequence[AttentionMetadata], kv_cache: torch.Tensor) -> torch.Tensor:
        """Hidden states after the final norm, [T, hidden], for the step's T tokens.

        Writes each token's K/V into kv_cache [blocks, kv_heads, slots, 2, block_size, head_dim]
        (this rank's KV heads; slots = layers per KV cache group) at the slot mapping of the
        layer's group: `attn` is one AttentionMetadata per group (or the one of a one-group
        model). Positions must be < max_position_embeddings.
        """
        self._check_kv_cache(kv_cache)
        metas = (attn,) if isinstance(attn, AttentionMetadata) else tuple(attn)
        if len(metas) != self.num_groups:
            raise ValueError(f"{len(metas)} attention metadata for {self.num_groups} KV cache groups")
        h = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary.lookup(positions)
        pending = None  # the last layer's MLP output, added by the next norm
        for layer, (group, slot) in zip(self.model.layers, self.layer_slots):
            # The layer's strided view, as PagedAttention takes it: [blocks, 2, block_size, kv_heads, head_dim].
            pending = layer(h, pending, cos, sin, kv_cache[:, :, slot].permute(0, 2, 3, 1, 4), metas[group])
        norm = self.model.norm
        return norm(h) if pending is None else add_rms_norm_(h, pending, norm.weight, norm.eps)

    @torch.inference_mode()
    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy a Hugging Face state dict (any dtype/device) into the model, all or nothing.

        Raises ValueError naming every missing, unexpected or mis-shaped tensor; on error
        nothing is copied. `lm_head.weight` is accepted and ignored when embeddings are tied.
        """
        load_slots(self._weight_slots(), weights,
                   tied_head=self.model.embed_tokens.weight if self.lm_head is None else None)
        for layer in self.model.layers:
            layer.self_attn.refresh_derived()
        self._prepack()

    def _weight_slots(self) -> dict[str, WeightSlot]:
        slots = {"model.embed_tokens.weight": whole(self.model.embed_tokens.weight),
                 "model.norm.weight": whole(self.model.norm.weight)}
        if self.lm_head is not None:
            slots["lm_head.weight"] = whole(self.lm_head.weight)
        for i, layer in enumerate(self.model.layers):
            p = f"model.layers.{i}."
            slots.update(attention_weight_slots(layer.self_attn, self.arch, self.shard, f"{p}self_attn."))
            slots.update(mlp_weight_slots(layer.mlp, self.arch, self.shard, f"{p}mlp."))
            slots[f"{p}input_layernorm.weight"] = whole(layer.input_layernorm.weight)
            slots[f"{p}post_attention_layernorm.weight"] = whole(layer.post_attention_layernorm.weight)
        return slots

    def _check_kv_cache(self, kv_cache: torch.Tensor) -> None:
        arch, heads = self.arch, self.shard.num_kv_heads
        if (kv_cache.dim() != 6 or tuple(kv_cache.shape[1:4]) != (heads, self.slots, 2)
                or kv_cache.shape[5] != arch.head_dim or not kv_cache.is_contiguous()):
            raise ValueError(f"kv_cache must be one contiguous [blocks, {heads}, {self.slots}, 2, block_size, "
                             f"{arch.head_dim}] tensor, got {tuple(kv_cache.shape)}")


def attention_weight_slots(attn: LlamaAttention, arch: ModelArchConfig, shard: RankShard,
                           prefix: str) -> dict[str, WeightSlot]:
    """Where `{prefix}q_proj.weight` etc. go in a rank's fused Q/K/V and o_proj (column- and
    row-parallel: the rank's heads)."""
    hd = arch.head_dim
    q_rows, kv_rows = shard.num_q_heads * hd, shard.num_kv_heads * hd
    q_src = (0, shard.q_heads.start * hd, q_rows, arch.num_heads * hd)  # column-parallel: the rank's rows
    kv_src = (0, shard.kv_heads.start * hd, kv_rows, arch.num_kv_heads * hd)
    o_src = (1, shard.q_heads.start * hd, q_rows, arch.num_heads * hd)  # row-parallel: matching columns
    slots = {}
    for kind in ["weight"] + (["bias"] if arch.attention_bias else []):
        fused = getattr(attn.qkv_proj, kind)
        slots[f"{prefix}q_proj.{kind}"] = WeightSlot(fused, 0, q_rows, q_src)
        slots[f"{prefix}k_proj.{kind}"] = WeightSlot(fused, q_rows, kv_rows, kv_src)
        slots[f"{prefix}v_proj.{kind}"] = WeightSlot(fused, q_rows + kv_rows, kv_rows, kv_src)
    slots[f"{prefix}o_proj.weight"] = WeightSlot(attn.o_proj.weight, 0, arch.hidden_size, o_src)
    if attn.q_norm is not None and attn.k_norm is not None:
        slots[f"{prefix}q_norm.weight"] = whole(attn.q_norm.weight)
        slots[f"{prefix}k_norm.weight"] = whole(attn.k_norm.weight)
    return slots


def mlp_weight_slots(mlp: LlamaMLP, arch: ModelArchConfig, shard: RankShard, prefix: str) -> dict[str, WeightSlot]:
    """gate/up (column-parallel, fused) and down (row-parallel) of a rank's slice of the MLP."""
    inter = even_split(arch.intermediate_size, shard.tp_size, shard.rank)
    size = len(inter)
    i_src = (0, inter.start, size, arch.intermediate_size)
    i_cols = (1, inter.start, size, arch.intermediate_size)
    return {f"{prefix}gate_proj.weight": WeightSlot(mlp.gate_up_proj.weight, 0, size, i_src),
            f"{prefix}up_proj.weight": WeightSlot(mlp.gate_up_proj.weight, size, size, i_src),
            f"{prefix}down_proj.weight": WeightSlot(mlp.down_proj.weight, 0, arch.hidden_size, i_cols)}
