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

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from kvbridge.engine.loader.cache import ModelParts
from kvbridge.engine.models.config import ModelArchConfig, ModelFamily
from kvbridge.engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

_FAMILIES = {
    "LlamaForCausalLM": ModelFamily.LLAMA,
    "Qwen2ForCausalLM": ModelFamily.QWEN2,
    "Qwen3ForCausalLM": ModelFamily.QWEN3,
}
# transformers' LlamaConfig / Qwen2Config / Qwen3Config defaults for the keys read here.
_DEFAULTS = {
    ModelFamily.LLAMA: {"rms_norm_eps": 1e-6, "max_position_embeddings": 2048},
    ModelFamily.QWEN2: {"rms_norm_eps": 1e-6, "max_position_embeddings": 32768},
    ModelFamily.QWEN3: {"rms_norm_eps": 1e-6, "max_position_embeddings": 32768},
}
# Buffers some checkpoints store that are recomputed at run time.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _read_config(folder: Path) -> dict:
    path = folder / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e
    if not isinstance(config, dict):
        raise ValueError(f"{path} is not a JSON object")
    return config


def _rope_theta(config: dict) -> float:
    """rope_theta from a flat key (transformers 4) or rope_parameters (transformers 5); rejects
    scaled RoPE, which kvbridge does not implement."""
    parameters = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or parameters
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"RoPE scaling {rope_type!r} is not supported")
    return float(config.get("rope_theta", parameters.get("rope_theta", 10000.0)))


def arch_from_config(config: dict) -> ModelArchConfig:
    """ModelArchConfig from a parsed config.json; ValueError for unsupported models."""
    architectures = config.get("architectures") or []
    family = next((_FAMILIES[a] for a in architectures if a in _FAMILIES), None)
    if family is None:
        raise ValueError(f"unsupported architectures {architectures!r} (supported: {', '.join(_FAMILIES)})")
    if config.get("use_sliding_window"):
        raise ValueError("sliding-window attention is not supported")
    defaults = _DEFAULTS[family]
    if family is not ModelFamily.QWEN2 and config.get("attention_bias"):
        # transformers gives these o_proj a bias too, which ModelArchConfig cannot express.
        raise ValueError(f"attention_bias is not supported for {family.value} models")
    try:
        num_heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        return ModelArchConfig(
            family=family,
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
            head_dim=int(config.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(config.get("rms_norm_eps", defaults["rms_norm_eps"])),
            rope_theta=_rope_theta(config),
            max_position_embeddings=int(config.get("max_position_embeddings",
                                                   defaults["max_position_embeddings"])),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=family is ModelFamily.QWEN2,  # always on q/k/v; its config has no key for it
            qk_norm=family is ModelFamily.QWEN3,
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
