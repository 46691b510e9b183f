"""Architecture description of a model, independent of its weight format.

Loaders (GGUF, Hugging Face folders) produce one; model classes consume it. Two families
of attention: the Llama family's per-head K and V (grouped-query), and DeepSeek-V2/V3's
multi-head latent attention (MLA, `mla`), whose KV cache holds one compressed latent
per token shared by every head. `cache_kv_heads`, `cache_head_size` and
`cache_entries` say what the KV cache holds, whichever the family.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any


class ModelFamily(str, Enum):
    LLAMA = "llama"
    QWEN2 = "qwen2"  # Llama + bias on the Q/K/V projections
    QWEN3 = "qwen3"  # Llama + RMSNorm on each head of Q and K (no QKV bias)
    MISTRAL = "mistral"  # Llama with every layer in a sliding window
    DEEPSEEK_V2 = "deepseek_v2"  # MLA + (optionally) MoE, softmax routing
    DEEPSEEK_V3 = "deepseek_v3"  # MLA + (optionally) MoE, sigmoid routing with a score-correction bias
    BAMBA = "bamba"  # Mamba2 mixers + Llama-style attention layers (partial rotary), Llama MLP


LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "mamba"})


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2). Per token the cache keeps the normalised
    latent (kv_lora_rank values) and the rotated shared rotary key (qk_rope_head_dim)."""

    kv_lora_rank: int
    q_lora_rank: int | None  # None: q comes from one projection (q_proj)
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True  # the checkpoint's rotary dims are interleaved pairs (x0, x1), (x2, x3), ...

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            raise ValueError(f"q_lora_rank must be >= 1 or None, got {self.q_lora_rank}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values cached per token and layer."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class MoEConfig:
    """DeepSeek mixture-of-experts MLP: routed experts (top-k of n) plus always-on shared experts,
    on every layer from `first_k_dense_replace` on (earlier layers keep a dense MLP)."""

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    num_shared_experts: int
    first_k_dense_replace: int
    routed_scaling_factor: float = 1.0
    scoring: str = "softmax"  # softmax (V2) | sigmoid (V3, with e_score_correction_bias)
    topk_method: str = "greedy"  # greedy | group_limited_greedy (V2) | noaux_tc (V3)
    num_groups: int | None = None
    topk_group: int | None = None
    norm_topk_prob: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, {self.num_experts}], got {self.num_experts_per_tok}")
        if self.moe_intermediate_size < 1 or self.num_shared_experts < 0 or self.first_k_dense_replace < 0:
            raise ValueError("moe_intermediate_size must be >= 1, num_shared_experts and first_k_dense_replace >= 0")
        if self.scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"unsupported MoE scoring {self.scoring!r}")
        if self.topk_method not in ("greedy", "group_limited_greedy", "noaux_tc"):
            raise ValueError(f"unsupported MoE topk_method {self.topk_method!r}")
        if self.topk_method != "greedy":
            if not self.num_groups or not self.topk_group or self.num_experts % self.num_groups \
                    or not 1 <= self.topk_group <= self.num_groups:
                raise ValueError(f"{self.topk_method} routing needs n_group dividing the {self.num_experts} experts "
                                 f"and 1 <= topk_group <= n_group, got {self.num_groups}, {self.topk_group}")

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace


@dataclass(frozen=True)
class YarnScaling:
    """YaRN rotary scaling (the `rope_scaling` DeepSeek configs use), transformers' parameters."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True


def _json_float(value: Any) -> float:
    """A float from config.json, where transformers writes infinity as {"__float__": "Infinity"}."""
    if isinstance(value, Mapping) and set(value) == {"__float__"}:
        value = value["__float__"]
    return float(value)


@dataclass(frozen=True)
class Mamba2Config:
    """One Mamba2 mixer's geometry (the whole layer, before any TP split)."""

    hidden_size: int
    num_heads: int  # H
    head_dim: int  # P
    state_size: int  # N (d_state)
    n_groups: int  # G: heads h read B and C of group h // (H / G)
    conv_kernel: int  # K (d_conv)
    chunk_size: int = 256  # Q of the chunked scan
    conv_bias: bool = True
    proj_bias: bool = False  # in_proj and out_proj biases
    norm_eps: float = 1e-6
    time_step_limit: tuple[float, float] = (0.0, math.inf)

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_heads", "head_dim", "state_size", "n_groups", "conv_kernel", "chunk_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.n_groups:
            raise ValueError(f"n_groups {self.n_groups} must divide the {self.num_heads} Mamba heads")

    @property
    def intermediate_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.intermediate_size + 2 * self.n_groups * self.state_size

    @classmethod
    def from_hf(cls, config: Mapping[str, Any] | Any) -> Mamba2Config:
        """From a Bamba-style Hugging Face config (a `config.json` dict or a config object): its
        mamba_n_heads, mamba_d_head ("auto" = mamba_expand * hidden_size // heads), mamba_d_state,
        mamba_n_groups, mamba_d_conv, mamba_chunk_size, mamba_conv_bias, mamba_proj_bias,
        rms_norm_eps, time_step_limit. Raises ValueError for what the mixer cannot compute."""
        get = config.get if isinstance(config, Mapping) else lambda k, d=None: getattr(config, k, d)
        hidden, heads = int(get("hidden_size")), int(get("mamba_n_heads", 128))
        expand = int(get("mamba_expand", 2))
        head_dim = get("mamba_d_head", "auto")
        head_dim = expand * hidden // heads if head_dim in (None, "auto") else int(head_dim)
        if head_dim * heads != expand * hidden:
            raise ValueError(f"mamba_d_head {head_dim} x mamba_n_heads {heads} != mamba_expand {expand} x "
                             f"hidden_size {hidden}")
        act = get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"the Mamba2 mixer computes SiLU after its conv, not {act!r}")
        limit = get("time_step_limit", None)
        limit = (0.0, math.inf) if limit is None else (_json_float(limit[0]), _json_float(limit[1]))
        return cls(hidden_size=hidden, num_heads=heads, head_dim=head_dim, state_size=int(get("mamba_d_state", 256)),
                   n_groups=int(get("mamba_n_groups", 1)), conv_kernel=int(get("mamba_d_conv", 4)),
                   chunk_size=int(get("mamba_chunk_size", 256)), conv_bias=bool(get("mamba_conv_bias", True)),
                   proj_bias=bool(get("mamba_proj_bias", False)), norm_eps=float(get("rms_norm_eps", 1e-6)),
                   time_step_limit=limit)


@dataclass(frozen=True)
class ModelArchConfig:
    family: ModelFamily
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3)
    mla: MLAConfig | None = None  # DeepSeek: multi-head latent attention (head_dim = its qk_head_dim)
    moe: MoEConfig | None = None  # DeepSeek: mixture-of-experts MLP layers
    rope_scaling: YarnScaling | None = None
    # Per layer "full_attention" or "sliding_attention" (transformers' layer_types); None: all full.
    layer_types: tuple[str, ...] | None = None
    sliding_window: int | None = None  # keys a sliding layer's query sees, itself included
    mamba: Mamba2Config | None = None  # the Mamba2 mixer of every "mamba" layer (Bamba)
    partial_rotary_factor: float = 1.0  # rotate the first head_dim * factor dims of each head (Bamba: 0.5)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.layer_types is not None:
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
            if len(self.layer_types) != self.num_layers or not set(self.layer_types) <= LAYER_TYPES:
                raise ValueError(f"layer_types must name {self.num_layers} layers, each one of {sorted(LAYER_TYPES)}")
            if "sliding_attention" in self.layer_types and (self.sliding_window or 0) < 1:
                raise ValueError("sliding_attention layers need a sliding_window >= 1")
            if self.mla is not None and "sliding_attention" in self.layer_types:
                raise ValueError("sliding-window MLA layers are not supported")
            if ("mamba" in self.layer_types) != (self.mamba is not None):
                raise ValueError("mamba layers need a Mamba2Config (`mamba`), and a Mamba2Config needs mamba layers")
        elif self.mamba is not None:
            raise ValueError("a Mamba2Config needs layer_types naming the mamba layers")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")

    @property
    def use_mla(self) -> bool:
        return self.mla is not None

    @property
    def rope_dim(self) -> int:
        """Dimensions rotated per head: all of head_dim (or its first `partial_rotary_factor`), or
        MLA's decoupled rotary part."""
        return self.mla.qk_rope_head_dim if self.mla is not None else int(self.head_dim * self.partial_rotary_factor)

    @property
    def cache_kv_heads(self) -> int:
        """KV heads in the cache, whole model: MLA's latent is ONE head that every query head
        reads (so under TP every rank holds all of it: a replicated head)."""
        return 1 if self.mla is not None else self.num_kv_heads

    @property
    def cache_head_size(self) -> int:
        """Values per cached head per token and layer."""
        return self.mla.latent_dim if self.mla is not None else self.head_dim

    @property
    def cache_entries(self) -> int:
        """Tensors cached per head: K and V (2), or MLA's one latent (1)."""
        return 1 if self.mla is not None else 2

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of KV cache per token over all layers, at 4 bytes per element (fp32)."""
        return self.cache_entries * self.num_layers * self.cache_kv_heads * self.cache_head_size * 4
