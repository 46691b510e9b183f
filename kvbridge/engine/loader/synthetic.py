"""Random-weight model folders, for geometries the shipped model lacks (tests, benchmarks).

`write_synthetic_folder` writes a Hugging Face Llama folder (config.json, model.safetensors
with seeded random weights, tokenizer.json) that `load_model(path)` serves like any other:
e.g. 4 KV heads, which TP 2 and TP 4 can split where SmolLM2's 3 cannot. The tokenizer is
the given model's (SmolLM2's by default), so prompts are real text.
"""

from __future__ import annotations

import json
from pathlib import Path

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


def write_synthetic_folder(folder: Path | str, tokenizer: Tokenizer, seed: int = 0, **geometry) -> Path:
    """A Llama folder with `geometry` (transformers.LlamaConfig keys; vocab_size defaults to the
    tokenizer's) and random weights drawn from `seed`. Returns the folder."""
    import transformers  # only here: it is heavy, and serving never needs it

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    special = json.loads(tokenizer.to_json())
    geometry.setdefault("vocab_size", tokenizer.vocab_size)
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**geometry, bos_token_id=special["bos_token_id"],
                                      eos_token_id=special["eos_token_id"])
    transformers.LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    (folder / "tokenizer.json").write_text(special["backend"], encoding="utf-8")
    return folder
