"""DeepSeek-V2 / DeepSeek-V3: multi-head latent attention (MLA) and mixture-of-experts MLPs.

Attention (`MLAAttention`): q from one projection or a low-rank pair (q_a_proj, RMSNorm,
q_b_proj); a shared compressed KV latent from kv_a_proj_with_mqa (RMSNorm on its first
kv_lora_rank values, rotary on the last qk_rope_head_dim: the decoupled rotary key). The KV
cache stores that latent, one entry per token (`layers/mla_attention.py`); kv_b_proj's
per-head key and value up-projections are absorbed into the query and the output for
decode, and expand the context's latents for prefill.

Rotary: DeepSeek checkpoints lay the rotary dims out as interleaved pairs (x0, x1), (x2, x3)...
`load_weights` permutes the rows that produce them (in q_proj / q_b_proj and
kv_a_proj_with_mqa) into halves [x0, x2, ... | x1, x3, ...], so the ordinary rotate_half
rotary applies; q . k is unchanged because q and k are permuted alike. YaRN scaling as in
transformers, including the softmax-scale correction mscale(factor, mscale_all_dim)^2.

MLP: a dense SwiGLU MLP on the first `first_k_dense_replace` layers, then MoE: a router over
`num_experts` routed experts (V2: softmax scores, greedy or group-limited top-k; V3: sigmoid
scores plus a correction bias for the choice, top-2-sum group selection, optional
normalisation), the chosen experts' SwiGLU outputs weighted and summed, plus shared experts.
Plain torch: tokens are grouped by expert and each expert runs one matmul pair.

Tensor parallelism (`RankShard`): query heads and kv_b_proj split by head, o_proj row-parallel;
the latent projection is replicated, so every rank caches the whole latent (the replicated
KV head the connector reads from one rank). Dense MLP, routed and shared experts split their
intermediate size; the router is replicated. Two all-reduces per layer, as for Llama.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kvbridge.engine.layers.activation import silu_and_mul
from kvbridge.engine.layers.attention import AttentionMetadata
from kvbridge.engine.layers.linear import Linear
from kvbridge.engine.layers.mla_attention import MLAPagedAttention
from kvbridge.engine.layers.norm import RMSNorm
from kvbridge.engine.layers.rotary import RotaryEmbedding, yarn_mscale
from kvbridge.engine.layers.weights import Embedding, WeightSlot, load_slots, whole
from kvbridge.engine.models.base import CausalLM, LayerList
from kvbridge.shape.model_config import MLAConfig, ModelArchConfig, MoEConfig
from kvbridge.shape.tp_split import RankShard, even_split, rank_shard

AllReduce = Callable[[torch.Tensor], torch.Tensor]


def deinterleave_rows(rows: int, rope_dim: int, group: int, offset: int) -> torch.Tensor:
    """Row order that turns interleaved rotary rows into halves: in each of the `rows // group`
    groups of `group` rows, the `rope_dim` rows from `offset` become [evens | odds]."""
    order = torch.arange(rows)
    if rows % group or offset + rope_dim > group:
        raise ValueError(f"{rows} rows do not split into groups of {group} holding {rope_dim} rotary rows at {offset}")
    rope = torch.cat((torch.arange(0, rope_dim, 2), torch.arange(1, rope_dim, 2)))
    for start in range(0, rows, group):
        order[start + offset:start + offset + rope_dim] = start + offset + rope
    return order


def softmax_scale(arch: ModelArchConfig) -> float:
    mla = arch.mla
    assert mla is not None
    scale: float = mla.qk_head_dim ** -0.5
    y = arch.rope_scaling
    if y is not None and y.mscale_all_dim:
        scale *= yarn_mscale(y.factor, y.mscale_all_dim) ** 2
    return scale


class MLAAttention(nn.Module):
    q_proj: Linear | None  # without a query LoRA
    q_a_proj: Linear | None  # with one: q_a_proj -> q_a_layernorm -> q_b_proj
    q_a_layernorm: RMSNorm | None
    q_b_proj: Linear | None
    w_uk: torch.Tensor  # buffers derived from kv_b_proj (refresh_derived)
    w_uv: torch.Tensor

    def __init__(self, arch: ModelArchConfig, mla: MLAConfig, dtype: torch.dtype, device: torch.device,
                 shard: RankShard, all_reduce: AllReduce | None) -> None:
        super().__init__()
        self.mla = mla
        self.num_heads = shard.num_q_heads
        self.all_reduce = all_reduce
        hidden, heads, qk = arch.hidden_size, self.num_heads, mla.qk_head_dim
        if mla.q_lora_rank is None:
            self.q_proj = Linear(hidden, heads * qk, False, dtype, device)
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        else:
            self.q_proj = None
            self.q_a_proj = Linear(hidden, mla.q_lora_rank, False, dtype, device)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, arch.rms_norm_eps, dtype, device)
            self.q_b_proj = Linear(mla.q_lora_rank, heads * qk, False, dtype, device)
        self.kv_a_proj_with_mqa = Linear(hidden, mla.latent_dim, False, dtype, device)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, arch.rms_norm_eps, dtype, device)
        self.kv_b_proj = Linear(mla.kv_lora_rank, heads * (mla.qk_nope_head_dim + mla.v_head_dim), False,
                                dtype, device)
        self.o_proj = Linear(heads * mla.v_head_dim, hidden, False, dtype, device)
        # kv_b_proj split per head into the absorbed key part [heads, nope, lora] and value part
        # [heads, v, lora]; refreshed by `refresh_derived` after loading.
        self.register_buffer("w_uk", torch.empty(heads, mla.qk_nope_head_dim, mla.kv_lora_rank, dtype=dtype,
                                                 device=device), persistent=False)
        self.register_buffer("w_uv", torch.empty(heads, mla.v_head_dim, mla.kv_lora_rank, dtype=dtype,
                                                 device=device), persistent=False)
        self.attn = MLAPagedAttention(heads, mla.kv_lora_rank, mla.qk_nope_head_dim, mla.qk_rope_head_dim,
                                      mla.v_head_dim, softmax_scale(arch))

    def refresh_derived(self) -> None:
        mla = self.mla
        w = self.kv_b_proj.weight.view(self.num_heads, mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank)
        self.w_uk.copy_(w[:, :mla.qk_nope_head_dim])
        self.w_uv.copy_(w[:, mla.qk_nope_head_dim:])

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_layer: torch.Tensor,
                attn: AttentionMetadata) -> torch.Tensor:
        mla, num_tokens = self.mla, x.shape[0]
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            assert self.q_a_proj is not None and self.q_a_layernorm is not None and self.q_b_proj is not None
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(num_tokens, self.num_heads, mla.qk_head_dim)
        q_nope, q_pe = q[..., :mla.qk_nope_head_dim], q[..., mla.qk_nope_head_dim:]
        ckv = self.kv_a_proj_with_mqa(x)
        latent = self.kv_a_layernorm(ckv[:, :mla.kv_lora_rank])
        k_pe = RotaryEmbedding.apply(ckv[:, None, mla.kv_lora_rank:], cos, sin)[:, 0]
        entry = torch.cat((latent, k_pe), dim=-1)  # [T, latent_dim]: what the cache keeps
        out = self.attn(q_nope, RotaryEmbedding.apply(q_pe, cos, sin), entry, kv_layer, attn, self.kv_b_proj,
                        self.w_uk, self.w_uv)  # [T, heads, v]
        out = self.o_proj(out.reshape(num_tokens, self.num_heads * mla.v_head_dim))
        return out if self.all_reduce is None else self.all_reduce(out)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up fused; this rank's `size` of the intermediate."""

    def __init__(self, hidden: int, size: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.size = size
        self.gate_up_proj = Linear(hidden, 2 * size, False, dtype, device)
        self.down_proj = Linear(size, hidden, False, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        out: torch.Tensor = self.down_proj(silu_and_mul(gate_up))
        return out


class DenseMLP(nn.Module):
    def __init__(self, hidden: int, size: int, dtype: torch.dtype, device: torch.device,
                 all_reduce: AllReduce | None) -> None:
        super().__init__()
        self.mlp = SwiGLU(hidden, size, dtype, device)
        self.all_reduce = all_reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.mlp(x)
        return out if self.all_reduce is None else self.all_reduce(out)


def route(router_logits: torch.Tensor, moe: MoEConfig, correction_bias: torch.Tensor | None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 router logits [T, experts] -> (weights [T, k], expert ids [T, k]), as transformers routes."""
    n, k = moe.num_experts, moe.num_experts_per_tok
    if moe.scoring == "softmax":
        scores = router_logits.softmax(dim=-1)
        if moe.topk_method == "group_limited_greedy":
            groups = moe.num_groups or 1
            group_scores = scores.view(-1, groups, n // groups).max(dim=-1).values
            keep = _group_mask(group_scores, moe.topk_group or groups, n)
            scores = scores.masked_fill(~keep, 0.0)
        weights, ids = torch.topk(scores, k=k, dim=-1, sorted=False)
    else:
        scores = router_logits.sigmoid()
        choice = scores if correction_bias is None else scores + correction_bias
        groups = moe.num_groups or 1
        group_scores = choice.view(-1, groups, n // groups).topk(min(2, n // groups), dim=-1)[0].sum(dim=-1)
        keep = _group_mask(group_scores, moe.topk_group or groups, n)
        ids = torch.topk(choice.masked_fill(~keep, float("-inf")), k=k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if moe.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * moe.routed_scaling_factor, ids


def _group_mask(group_scores: torch.Tensor, topk_group: int, num_experts: int) -> torch.Tensor:
    groups = group_scores.shape[1]
    chosen = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, chosen, True)
    return mask.unsqueeze(-1).expand(-1, groups, num_experts // groups).reshape(-1, num_experts)


class MoE(nn.Module):
    """Routed experts (this rank's slice of each expert's intermediate) plus shared experts."""

    def __init__(self, arch: ModelArchConfig, moe: MoEConfig, dtype: torch.dtype, device: torch.device,
                 tp_size: int, all_reduce: AllReduce | None) -> None:
        super().__init__()
        self.moe = moe
        self.all_reduce = all_reduce
        hidden = arch.hidden_size
        self.size = moe.moe_intermediate_size // tp_size
        # The router stays fp32 whatever the model's dtype, as transformers keeps it (its
        # _keep_in_fp32_modules_strict: gate.weight): the top-k choice is discrete, and a gate
        # rounded to bf16 picked other experts than transformers' bf16 model on near-ties
        # (tests/integration/test_bf16_parity.py: logits 2.5 apart on DeepSeek-V3 with MoE).
        self.gate = nn.Parameter(torch.empty(moe.num_experts, hidden, dtype=torch.float32, device=device),
                                 requires_grad=False)
        self.correction_bias = (nn.Parameter(torch.empty(moe.num_experts, dtype=torch.float32, device=device),
                                             requires_grad=False) if moe.scoring == "sigmoid" else None)
        self.w_gate_up = nn.Parameter(torch.empty(moe.num_experts, 2 * self.size, hidden, dtype=dtype, device=device),
                                      requires_grad=False)
        self.w_down = nn.Parameter(torch.empty(moe.num_experts, hidden, self.size, dtype=dtype, device=device),
                                   requires_grad=False)
        self.shared = (SwiGLU(hidden, moe.moe_intermediate_size * moe.num_shared_experts // tp_size, dtype, device)
                       if moe.num_shared_experts else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x.float(), self.gate)
        weights, ids = route(logits, self.moe, self.correction_bias)
        out = self.shared(x) if self.shared is not None else torch.zeros_like(x)
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.moe.num_experts).tolist()
        token_of = order // ids.shape[1]
        weight_of = weights.flatten()[order].to(x.dtype)
        start = 0
        for expert, count in enumerate(counts):
            if not count:
                continue
            rows = token_of[start:start + count]
            h = F.linear(x.index_select(0, rows), self.w_gate_up[expert])
            h = F.linear(silu_and_mul(h), self.w_down[expert])
            out.index_add_(0, rows, h * weight_of[start:start + count, None])
            start += count
        return out if self.all_reduce is None else self.all_reduce(out)


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, arch: ModelArchConfig, layer: int, dtype: torch.dtype, device: torch.device,
                 shard: RankShard, all_reduce: AllReduce | None) -> None:
        super().__init__()
        assert arch.mla is not None
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype, device)
        self.self_attn = MLAAttention(arch, arch.mla, dtype, device, shard, all_reduce)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype, device)
        self.mlp: MoE | DenseMLP
        if arch.moe is not None and arch.moe.is_moe_layer(layer):
            self.mlp = MoE(arch, arch.moe, dtype, device, shard.tp_size, all_reduce)
        else:
            self.mlp = DenseMLP(arch.hidden_size, arch.intermediate_size // shard.tp_size, dtype, device, all_reduce)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_layer: torch.Tensor,
                attn: AttentionMetadata) -> torch.Tensor:
        h += self.self_attn(self.input_layernorm(h), cos, sin, kv_layer, attn)
        h += self.mlp(self.post_attention_layernorm(h))
        return h


class DeepseekModel(nn.Module):
    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype, device: torch.device, shard: RankShard,
                 all_reduce: AllReduce | None) -> None:
        super().__init__()
        self.embed_tokens = Embedding(arch.vocab_size, arch.hidden_size, dtype, device)
        self.layers = LayerList(DeepseekDecoderLayer(arch, i, dtype, device, shard, all_reduce)
                                for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype, device)


class DeepseekForCausalLM(CausalLM):
    """DeepSeek-V2 / V3 causal LM over a paged latent KV cache [blocks, 1, layers, 1, block_size,
    kv_lora_rank + qk_rope_head_dim]. Parameters stay uninitialised until `load_weights`."""

    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype, device: torch.device | str,
                 shard: RankShard | None = None, all_reduce: AllReduce | None = None) -> None:
        super().__init__()
        if arch.mla is None:
            raise ValueError("DeepseekForCausalLM needs an MLA architecture")
        device = torch.device(device)
        self.arch = arch
        self.shard = shard or rank_shard(arch.num_heads, arch.cache_kv_heads, 1, 0)
        if self.shard.tp_size > 1 and all_reduce is None:
            raise ValueError("a tensor-parallel shard needs an all_reduce over its ranks")
        self.model = DeepseekModel(arch, dtype, device, self.shard, all_reduce)
        self.lm_head = None if arch.tie_word_embeddings else Linear(arch.hidden_size, arch.vocab_size, False,
                                                                   dtype, device)
        self.rotary = RotaryEmbedding(arch.mla.qk_rope_head_dim, arch.rope_theta, arch.max_position_embeddings,
                                      dtype, device, arch.rope_scaling)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata,
                kv_cache: torch.Tensor) -> torch.Tensor:
        self._check_kv_cache(kv_cache)
        h = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary.lookup(positions)
        for i, layer in enumerate(self.model.layers):
            h = layer(h, cos, sin, kv_cache[:, :, i].permute(0, 2, 3, 1, 4), attn)
        out: torch.Tensor = self.model.norm(h)
        return out

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is not None:
            logits: torch.Tensor = self.lm_head(hidden)
            return logits.float()
        return F.linear(hidden, self.model.embed_tokens.weight).float()

    @torch.inference_mode()
    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy a Hugging Face DeepSeek-V2/V3 state dict in, all or nothing (ValueError names problems)."""
        load_slots(self._weight_slots(), weights,
                   tied_head=self.model.embed_tokens.weight if self.lm_head is None else None)
        for module in self.modules():
            if isinstance(module, MLAAttention):
                module.refresh_derived()
            if isinstance(module, Linear):
                module.prepack()

    def _weight_slots(self) -> dict[str, WeightSlot]:
        arch, shard = self.arch, self.shard
        mla = arch.mla
        assert mla is not None
        heads, qk, kv_b = shard.num_q_heads, mla.qk_head_dim, mla.qk_nope_head_dim + mla.v_head_dim
        h0 = shard.q_heads.start

        def rope_rows(group: int, offset: int) -> Callable[[torch.Tensor], torch.Tensor] | None:
            if not mla.rope_interleave:
                return None
            return lambda t: t.index_select(0, deinterleave_rows(t.shape[0], mla.qk_rope_head_dim, group, offset))

        slots = {"model.embed_tokens.weight": whole(self.model.embed_tokens.weight),
                 "model.norm.weight": whole(self.model.norm.weight)}
        if self.lm_head is not None:
            slots["lm_head.weight"] = whole(self.lm_head.weight)
        for i, layer in enumerate(self.model.layers):
            p, a = f"model.layers.{i}.", layer.self_attn
            q_src = (0, h0 * qk, heads * qk, arch.num_heads * qk)
            q_rot = rope_rows(qk, mla.qk_nope_head_dim)
            if a.q_proj is not None:
                slots[f"{p}self_attn.q_proj.weight"] = WeightSlot(a.q_proj.weight, 0, heads * qk, q_src, q_rot)
            else:
                assert a.q_a_proj is not None and a.q_a_layernorm is not None and a.q_b_proj is not None
                slots[f"{p}self_attn.q_a_proj.weight"] = whole(a.q_a_proj.weight)
                slots[f"{p}self_attn.q_a_layernorm.weight"] = whole(a.q_a_layernorm.weight)
                slots[f"{p}self_attn.q_b_proj.weight"] = WeightSlot(a.q_b_proj.weight, 0, heads * qk, q_src, q_rot)
            slots[f"{p}self_attn.kv_a_proj_with_mqa.weight"] = WeightSlot(
                a.kv_a_proj_with_mqa.weight, 0, mla.latent_dim, None, rope_rows(mla.latent_dim, mla.kv_lora_rank))
            slots[f"{p}self_attn.kv_a_layernorm.weight"] = whole(a.kv_a_layernorm.weight)
            slots[f"{p}self_attn.kv_b_proj.weight"] = WeightSlot(
                a.kv_b_proj.weight, 0, heads * kv_b, (0, h0 * kv_b, heads * kv_b, arch.num_heads * kv_b))
            v = mla.v_head_dim
            slots[f"{p}self_attn.o_proj.weight"] = WeightSlot(
                a.o_proj.weight, 0, arch.hidden_size, (1, h0 * v, heads * v, arch.num_heads * v))
            slots[f"{p}input_layernorm.weight"] = whole(layer.input_layernorm.weight)
            slots[f"{p}post_attention_layernorm.weight"] = whole(layer.post_attention_layernorm.weight)
            mlp = layer.mlp
            if isinstance(mlp, MoE):
                moe = mlp.moe
                slots[f"{p}mlp.gate.weight"] = whole(mlp.gate)
                if mlp.correction_bias is not None:
                    slots[f"{p}mlp.gate.e_score_correction_bias"] = whole(mlp.correction_bias)
                inter = even_split(moe.moe_intermediate_size, shard.tp_size, shard.rank)
                rows = (1, inter.start, len(inter), moe.moe_intermediate_size)  # experts are [E, out, in]
                for e in range(moe.num_experts):
                    q = f"{p}mlp.experts.{e}."
                    gate_up, down = mlp.w_gate_up[e], mlp.w_down[e]
                    slots[f"{q}gate_proj.weight"] = WeightSlot(gate_up, 0, mlp.size, (0,) + rows[1:])
                    slots[f"{q}up_proj.weight"] = WeightSlot(gate_up, mlp.size, mlp.size, (0,) + rows[1:])
                    slots[f"{q}down_proj.weight"] = WeightSlot(down, 0, arch.hidden_size, rows)
                if mlp.shared is not None:
                    shared_size = moe.moe_intermediate_size * moe.num_shared_experts
                    slots.update(_swiglu_slots(f"{p}mlp.shared_experts.", mlp.shared, shared_size, shard, arch))
            else:
                slots.update(_swiglu_slots(f"{p}mlp.", mlp.mlp, arch.intermediate_size, shard, arch))
        return slots

    def _check_kv_cache(self, kv_cache: torch.Tensor) -> None:
        arch = self.arch
        expected = (1, arch.num_layers, 1)
        if (kv_cache.dim() != 6 or tuple(kv_cache.shape[1:4]) != expected
                or kv_cache.shape[5] != arch.cache_head_size or not kv_cache.is_contiguous()):
            raise ValueError(f"kv_cache must be one contiguous [blocks, 1, {arch.num_layers}, 1, block_size, "
                             f"{arch.cache_head_size}] tensor, got {tuple(kv_cache.shape)}")


def _swiglu_slots(prefix: str, mlp: SwiGLU, whole_size: int, shard: RankShard,
                  arch: ModelArchConfig) -> dict[str, WeightSlot]:
    inter = even_split(whole_size, shard.tp_size, shard.rank)
    size = len(inter)
    return {f"{prefix}gate_proj.weight": WeightSlot(mlp.gate_up_proj.weight, 0, size, (0, inter.start, size, whole_size)),
            f"{prefix}up_proj.weight": WeightSlot(mlp.gate_up_proj.weight, size, size, (0, inter.start, size, whole_size)),
            f"{prefix}down_proj.weight": WeightSlot(mlp.down_proj.weight, 0, arch.hidden_size,
                                                    (1, inter.start, size, whole_size))}
