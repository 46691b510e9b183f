"""Tiny random-weight models the tests build: kvbridge architectures with seeded weights
(loader and CPU-binding tests) and Hugging Face models of each Llama family (parity tests)."""

from __future__ import annotations

import torch
import transformers

from kvbridge.engine.loader.cache import expected_weight_shapes
from kvbridge.shape.model_config import ModelArchConfig, ModelFamily
from tests.paged_steps import VOCAB


def tiny_arch(family: ModelFamily) -> ModelArchConfig:
    return ModelArchConfig(
        family=family, vocab_size=258, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=32 if family is ModelFamily.QWEN3 else 16, rms_norm_eps=2.0**-20,  # exact in f32
        rope_theta=1e6, max_position_embeddings=128, tie_word_embeddings=family is ModelFamily.LLAMA,
        attention_bias=family is ModelFamily.QWEN2, qk_norm=family is ModelFamily.QWEN3)


def random_weights(arch: ModelArchConfig) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {name: torch.randn(shape, generator=generator) for name, shape in expected_weight_shapes(arch).items()}


_SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
              attn_implementation="eager")
HF_CONFIGS = {
    ModelFamily.LLAMA: lambda: transformers.LlamaConfig(
        **_SHAPE, rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=True),
    ModelFamily.QWEN2: lambda: transformers.Qwen2Config(
        **_SHAPE, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False),
    ModelFamily.QWEN3: lambda: transformers.Qwen3Config(
        **_SHAPE, head_dim=24, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False),
}


def arch_from_hf(family: ModelFamily, cfg: transformers.PretrainedConfig) -> ModelArchConfig:
    return ModelArchConfig(
        family=family, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_layers=cfg.num_hidden_layers,
        num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
        rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_parameters["rope_theta"],
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
        attention_bias=family == ModelFamily.QWEN2, qk_norm=family == ModelFamily.QWEN3)


def make_hf(family: ModelFamily, seed: int = 0) -> transformers.PreTrainedModel:
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(HF_CONFIGS[family]()).eval()
    with torch.no_grad():  # larger than HF's init so attention patterns are far from uniform
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.15)
    return hf
