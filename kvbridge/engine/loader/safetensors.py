"""Reading a Hugging Face model folder: config.json, *.safetensors (one file or shards) and the
tokenizer files.

Weights keep their HF names and layout and are converted to fp32 on CPU. Defaults for keys a
config.json leaves out are those of the matching transformers config class, since that is what
the checkpoint was trained and saved with.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from kvbridge.engine.loader.cache import ModelParts
from kvbridge.engine.tokenizer import Tokenizer
from kvbridge.shape.model_config import (Mamba2Config, MLAConfig, ModelArchConfig, ModelFamily, MoEConfig,
                                           YarnScaling)

logger = logging.getLogger(__name__)

_FAMILIES = {
    "LlamaForCausalLM": ModelFamily.LLAMA,
    "Qwen2ForCausalLM": ModelFamily.QWEN2,
    "Qwen3ForCausalLM": ModelFamily.QWEN3,
    "MistralForCausalLM": ModelFamily.MISTRAL,
    "DeepseekV2ForCausalLM": ModelFamily.DEEPSEEK_V2,
    "DeepseekV3ForCausalLM": ModelFamily.DEEPSEEK_V3,
    "BambaForCausalLM": ModelFamily.BAMBA,
}
# transformers' LlamaConfig / Qwen2Config / Qwen3Config defaults for the keys read here.
_DEFAULTS = {
    ModelFamily.LLAMA: {"rms_norm_eps": 1e-6, "max_position_embeddings": 2048},
    ModelFamily.QWEN2: {"rms_norm_eps": 1e-6, "max_position_embeddings": 32768},
    ModelFamily.QWEN3: {"rms_norm_eps": 1e-6, "max_position_embeddings": 32768},
    ModelFamily.MISTRAL: {"rms_norm_eps": 1e-6, "max_position_embeddings": 131072},
    ModelFamily.DEEPSEEK_V2: {"rms_norm_eps": 1e-6, "max_position_embeddings": 2048},
    ModelFamily.DEEPSEEK_V3: {"rms_norm_eps": 1e-6, "max_position_embeddings": 4096},
    ModelFamily.BAMBA: {"rms_norm_eps": 1e-5, "max_position_embeddings": 262144},
}
# transformers' DeepseekV2Config / DeepseekV3Config defaults for the MLA and MoE keys.
_DEEPSEEK_DEFAULTS: dict[ModelFamily, dict[str, Any]] = {
    ModelFamily.DEEPSEEK_V2: dict(kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64,
                                  v_head_dim=128, n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=None,
                                  moe_intermediate_size=1407, first_k_dense_replace=0, routed_scaling_factor=1.0,
                                  topk_method="greedy", n_group=None, topk_group=None, norm_topk_prob=False),
    ModelFamily.DEEPSEEK_V3: dict(kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64,
                                  v_head_dim=128, n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8,
                                  moe_intermediate_size=2048, first_k_dense_replace=3, routed_scaling_factor=2.5,
                                  topk_method="noaux_tc", n_group=8, topk_group=4, norm_topk_prob=True,
                                  rope_interleave=True),
}
# Buffers some checkpoints store that are recomputed at run time.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _read_config(folder: Path) -> dict[str, Any]:
    path = folder / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e
    if not isinstance(config, dict):
        raise ValueError(f"{path} is not a JSON object")
    return config


def _rope(config: dict[str, Any], allow_yarn: bool) -> tuple[float, YarnScaling | None]:
    """rope_theta and scaling from flat keys (transformers 4) or rope_parameters (transformers 5).
    YaRN where `allow_yarn` (the families whose parity with it is tested); other scaling refused."""
    parameters = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or parameters
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    theta = float(config.get("rope_theta", parameters.get("rope_theta", 10000.0)))
    if rope_type == "default":
        return theta, None
    if rope_type != "yarn" or not allow_yarn:
        raise ValueError(f"RoPE scaling {rope_type!r} is not supported for this model")
    max_pos = config.get("max_position_embeddings")
    original = scaling.get("original_max_position_embeddings")
    factor = scaling.get("factor")
    if original is None:
        raise ValueError("YaRN rope scaling needs original_max_position_embeddings")
    if factor is None:
        if max_pos is None:
            raise ValueError("YaRN rope scaling needs a factor or max_position_embeddings")
        factor = max_pos / original

    def optional(key: str) -> float | None:
        value = scaling.get(key)
        return None if value is None else float(value)

    return theta, YarnScaling(
        factor=float(factor), original_max_position_embeddings=int(original),
        beta_fast=float(scaling.get("beta_fast") or 32), beta_slow=float(scaling.get("beta_slow") or 1),
        mscale=optional("mscale"), mscale_all_dim=optional("mscale_all_dim"),
        attention_factor=optional("attention_factor"), truncate=bool(scaling.get("truncate", True)))


def _sliding_layers(config: dict[str, Any], family: ModelFamily, num_layers: int) -> dict[str, Any]:
    """layer_types and sliding_window as transformers applies them: Mistral slides every layer
    when sliding_window is set; Qwen2/Qwen3 only with use_sliding_window, on the layers their
    layer_types name (else those from max_window_layers on)."""
    if family is ModelFamily.MISTRAL:
        window = config.get("sliding_window", 4096)
        types = ["sliding_attention"] * num_layers if window else None
    elif family in (ModelFamily.QWEN2, ModelFamily.QWEN3) and config.get("use_sliding_window"):
        window = config.get("sliding_window", 4096)
        first = int(config.get("max_window_layers", 28))
        types = config.get("layer_types") or ["sliding_attention" if i >= first else "full_attention"
                                              for i in range(num_layers)]
    else:
        if config.get("use_sliding_window") or "sliding_attention" in (config.get("layer_types") or ()):
            raise ValueError(f"sliding-window attention is not supported for {family.value} models")
        return {}
    if not window or not types or "sliding_attention" not in types:
        return {}
    return dict(layer_types=tuple(types), sliding_window=int(window))


def _deepseek_parts(config: dict[str, Any], family: ModelFamily) -> dict[str, Any]:
    """The MLA and MoE fields of a DeepSeek-V2/V3 config."""
    d = {**_DEEPSEEK_DEFAULTS[family], **{k: v for k, v in config.items() if k in _DEEPSEEK_DEFAULTS[family]}}
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise ValueError("DeepSeek configs with attention_bias or mlp_bias are not supported")
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {config.get('hidden_act')!r} is not supported (silu only)")
    mla = MLAConfig(kv_lora_rank=int(d["kv_lora_rank"]),
                    q_lora_rank=None if d["q_lora_rank"] is None else int(d["q_lora_rank"]),
                    qk_nope_head_dim=int(d["qk_nope_head_dim"]), qk_rope_head_dim=int(d["qk_rope_head_dim"]),
                    v_head_dim=int(d["v_head_dim"]), rope_interleave=bool(d.get("rope_interleave", True)))
    moe = None
    layers = int(config["num_hidden_layers"])
    if d["n_routed_experts"] and d["num_experts_per_tok"] and int(d["first_k_dense_replace"]) < layers:
        v3 = family is ModelFamily.DEEPSEEK_V3
        moe = MoEConfig(num_experts=int(d["n_routed_experts"]), num_experts_per_tok=int(d["num_experts_per_tok"]),
                        moe_intermediate_size=int(d["moe_intermediate_size"]),
                        num_shared_experts=int(d["n_shared_experts"] or 0),
                        first_k_dense_replace=int(d["first_k_dense_replace"]),
                        routed_scaling_factor=float(d["routed_scaling_factor"]),
                        scoring="sigmoid" if v3 else "softmax",
                        # transformers routes every V3 model with noaux_tc, whatever topk_method says
                        topk_method="noaux_tc" if v3 else str(d["topk_method"]),
                        num_groups=d["n_group"], topk_group=d["topk_group"],
                        norm_topk_prob=bool(d["norm_topk_prob"]) and v3)  # transformers' V2 never normalises
    return dict(mla=mla, moe=moe, head_dim=mla.qk_head_dim)


def _bamba_parts(config: dict[str, Any]) -> dict[str, Any]:
    """The Mamba2 mixer and the layer types of a Bamba config: attention at attn_layer_indices,
    Mamba2 everywhere else; rotary on half of each attention head (transformers hard-codes 0.5)."""
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise ValueError("Bamba configs with attention_bias or mlp_bias are not supported")
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {config.get('hidden_act')!r} is not supported (silu only)")
    layers = int(config["num_hidden_layers"])
    attention = set(config.get("attn_layer_indices") or ())
    if not attention <= set(range(layers)):
        raise ValueError(f"attn_layer_indices {sorted(attention)} name layers outside 0..{layers - 1}")
    types = tuple("full_attention" if i in attention else "mamba" for i in range(layers))
    factor = (config.get("rope_parameters") or {}).get("partial_rotary_factor", 0.5)
    return dict(layer_types=types, mamba=Mamba2Config.from_hf(config), partial_rotary_factor=float(factor))


def arch_from_config(config: dict[str, Any]) -> ModelArchConfig:
    """ModelArchConfig from a parsed config.json; ValueError for unsupported models."""
    architectures = config.get("architectures") or []
    family = next((_FAMILIES[a] for a in architectures if a in _FAMILIES), None)
    if family is None:
        raise ValueError(f"unsupported architectures {architectures!r} (supported: {', '.join(_FAMILIES)})")
    defaults = _DEFAULTS[family]
    deepseek = family in (ModelFamily.DEEPSEEK_V2, ModelFamily.DEEPSEEK_V3)
    if not deepseek and family is not ModelFamily.QWEN2 and config.get("attention_bias"):
        # transformers gives these o_proj a bias too, which ModelArchConfig cannot express.
        raise ValueError(f"attention_bias is not supported for {family.value} models")
    try:
        num_heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        if deepseek:
            extra = _deepseek_parts(config, family)
        elif family is ModelFamily.BAMBA:
            extra = _bamba_parts(config)
        else:
            extra = _sliding_layers(config, family, int(config["num_hidden_layers"]))
        theta, scaling = _rope(config, allow_yarn=deepseek)
        return ModelArchConfig(
            family=family,
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
            head_dim=extra.pop("head_dim", None) or int(config.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(config.get("rms_norm_eps", defaults["rms_norm_eps"])),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(config.get("max_position_embeddings",
                                                   defaults["max_position_embeddings"])),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=family is ModelFamily.QWEN2,  # always on q/k/v; its config has no key for it
            qk_norm=family is ModelFamily.QWEN3,
            **extra,
        )
    except KeyError as e:
        raise ValueError(f"config.json lacks {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise ValueError(f"invalid config.json: {e}") from e


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"cannot read {index}: {e}") from e
        return [folder / name for name in sorted(set(weight_map.values()))]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder} has no *.safetensors weights")
    return files


def read_weights(folder: Path, arch: ModelArchConfig) -> dict[str, torch.Tensor]:
    """All shards merged, fp32 on CPU. A tied model's lm_head copy (if stored) is dropped."""
    weights: dict[str, torch.Tensor] = {}
    for path in _weight_files(folder):
        try:
            shard = load_file(str(path), device="cpu")
        except (OSError, SafetensorError) as e:
            raise ValueError(f"cannot read {path}: {e}") from e
        for name, tensor in shard.items():
            if name.endswith(_IGNORED_SUFFIXES) or (arch.tie_word_embeddings and name == "lm_head.weight"):
                continue
            weights[name] = tensor.to(torch.float32).contiguous()
    return weights


def read_hf_folder(folder: Path) -> ModelParts:
    """Architecture, fp32 weights and tokenizer of an HF folder; ValueError if unusable."""
    arch = arch_from_config(_read_config(folder))
    parts = ModelParts(arch=arch, weights=read_weights(folder, arch),
                       tokenizer=Tokenizer.from_hf_folder(folder))
    logger.info("read %s: %s, %d tensors", folder, arch.family.value, len(parts.weights))
    return parts
