"""Random-weight model folders, for geometries the shipped model lacks (tests, benchmarks).

`write_synthetic_folder` writes a Hugging Face folder (config.json, model.safetensors with
seeded random weights, tokenizer.json) that `load_model(path)` serves like any other: a
Llama with 4 KV heads, which TP 2 and TP 4 can split where SmolLM2's 3 cannot, or a tiny
DeepSeek-V2/V3 (MLA, MoE). The tokenizer is the given model's (SmolLM2's by default), so
prompts are real text.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from kvbridge.engine.tokenizer import Tokenizer

# A small Llama with 8 query heads and 4 KV heads: TP 1, 2 and 4 split it.
TINY_4_KV_HEADS = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=8,
                       num_key_value_heads=4, head_dim=16, max_position_embeddings=4096, rope_theta=10000.0,
                       rms_norm_eps=1e-5, tie_word_embeddings=True,
                       initializer_range=0.2)  # weights large enough that greedy text depends on the context

# SmolLM2-135M's shapes with a head count TP 2 can split (SmolLM2 has 9 heads of 64, 3 KV heads).
SMOLLM2_SHAPED_4_KV_HEADS = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                 num_attention_heads=8, num_key_value_heads=4, head_dim=72,
                                 max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
                                 tie_word_embeddings=True)

# A small DeepSeek-V2 with MLA (latent 32 + rotary 8 per token), q LoRA, YaRN and MoE
# (8 routed experts, top-2 in 4 groups, 1 shared) after one dense layer: 4 heads, so TP 1, 2, 4.
TINY_DEEPSEEK_V2_MOE = dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48,
                            qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8,
                            n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
                            topk_method="group_limited_greedy", n_group=4, topk_group=2,
                            max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False,
                            rope_scaling=dict(type="yarn", factor=4.0, original_max_position_embeddings=1024,
                                              beta_fast=32, beta_slow=1, mscale=0.707, mscale_all_dim=0.707),
                            initializer_range=0.2)

# A small Qwen2 mixing full-attention and sliding-window layers (window 24 tokens): two KV
# cache groups of 2 layers each; 4 KV heads, so TP 1, 2 and 4 split it.
TINY_QWEN2_SLIDING = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=8,
                          num_key_value_heads=4, max_position_embeddings=4096, rope_theta=10000.0,
                          rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=True, sliding_window=24,
                          layer_types=["full_attention", "sliding_attention", "full_attention", "sliding_attention"],
                          initializer_range=0.2)

# A small Bamba: 4 layers, attention at layer 1 (rotary on half of each head; 4 query heads, 1
# KV head, replicated over TP ranks), Mamba2 mixers elsewhere with 4 heads of 16 and a state of
# 8 in 1 group (B and C replicated over TP ranks): TP 1, 2 and 4 split it. Its Mamba state
# shrinks with TP and its attention KV does not, so with kernel blocks of 4 tokens (fp32 or
# not) TP 1 chooses logical blocks of 6 kernel blocks, TP 2 of 4 and TP 4 of 2
# (shape/kv_cache_layout.py): P and D at different TP sizes have different ratios.
TINY_BAMBA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=1, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=16,
                  mamba_n_groups=1, mamba_d_state=8, mamba_d_conv=4, mamba_expand=1, mamba_chunk_size=16,
                  max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False,
                  initializer_range=0.2)

_ARCHITECTURES = {"llama": ("LlamaConfig", "LlamaForCausalLM"),
                  "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
                  "mistral": ("MistralConfig", "MistralForCausalLM"),
                  "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM"),
                  "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
                  "bamba": ("BambaConfig", "BambaForCausalLM")}


def write_synthetic_folder(folder: Path | str, tokenizer: Tokenizer, seed: int = 0, architecture: str = "llama",
                           **geometry: Any) -> Path:
    """A folder of `architecture` (llama | qwen2 | mistral | deepseek_v2 | deepseek_v3) with `geometry` (its
    transformers config keys; vocab_size defaults to the tokenizer's) and random weights drawn
    from `seed`. Returns the folder."""
    import transformers  # only here: it is heavy, and serving never needs it

    if architecture not in _ARCHITECTURES:
        raise ValueError(f"unknown architecture {architecture!r} (known: {', '.join(_ARCHITECTURES)})")
    config_cls, model_cls = (getattr(transformers, name) for name in _ARCHITECTURES[architecture])
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    special = json.loads(tokenizer.to_json())
    geometry.setdefault("vocab_size", tokenizer.vocab_size)
    torch.manual_seed(seed)
    config = config_cls(**geometry, bos_token_id=special["bos_token_id"], eos_token_id=special["eos_token_id"])
    model_cls(config).save_pretrained(folder, safe_serialization=True)
    (folder / "tokenizer.json").write_text(special["backend"], encoding="utf-8")
    if special.get("chat_template"):
        (folder / "chat_template.jinja").write_text(special["chat_template"], encoding="utf-8")
    return folder
