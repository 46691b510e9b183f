"""Reading a GGUF file (llama.cpp's format) into Hugging Face-named fp32 weights.

Uses the `gguf` package: GGUFReader for metadata and tensors, gguf.quants.dequantize for the
quantised types it implements. Three conversions happen here:
- GGUF tensor names (blk.N.attn_q.weight) become HF names (model.layers.N.self_attn.q_proj.weight);
- for the llama family, Q/K projection rows are permuted back from llama.cpp's RoPE order
  (its converter interleaves the two rotary halves of each head) to the HF layout;
- the architecture comes from `<arch>.*` metadata, the tokenizer from `tokenizer.*` metadata.
Reading and dequantising SmolLM2-135M takes seconds, so callers cache the result (cache.py).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader, GGUFValueType
from gguf.quants import dequantize

from kvbridge.engine.loader.cache import ModelParts
from kvbridge.engine.tokenizer import GGUFVocab, Tokenizer
from kvbridge.shape.model_config import ModelArchConfig, ModelFamily

logger = logging.getLogger(__name__)

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_name(gguf_name: str) -> str:
    """The HF parameter name of a GGUF tensor; ValueError for tensors kvbridge cannot use."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _BLOCK_TENSOR.fullmatch(gguf_name)
    if match and match.group(2) in _BLOCK_NAMES:
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{_BLOCK_NAMES[part]}.{kind}"
    if gguf_name == "rope_freqs.weight":
        raise ValueError("GGUF uses RoPE frequency scaling (rope_freqs), which kvbridge does not support")
    raise ValueError(f"unsupported GGUF tensor {gguf_name!r}")


def unpermute_rope_rows(rows: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of llama.cpp convert_hf_to_gguf.py's permute(): per head, its rows are stored as
    (pair, half) and HF wants (half, pair). Works on weights (rows x cols) and biases (rows)."""
    head_rows = rows.shape[0] // n_heads
    split = rows.reshape(n_heads, head_rows // 2, 2, *rows.shape[1:])
    return split.swapaxes(1, 2).reshape(rows.shape)


def _field_value(reader: GGUFReader, key: str) -> object:
    """A metadata value as plain Python (str, int, float, bool, or a list of them); None if absent."""
    field = reader.fields.get(key)
    if field is None:
        return None
    kinds = field.types
    if kinds[0] == GGUFValueType.ARRAY:
        if kinds[-1] == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        return [field.parts[i].tolist()[0] for i in field.data]
    if kinds[0] == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")
    return field.parts[field.data[0]].tolist()[0]


def _int(reader: GGUFReader, key: str, default: int | None = None) -> int:
    value = _field_value(reader, key)
    if value is None and default is not None:
        return default
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"GGUF metadata {key} must be one integer, got {value!r}")
    return value


def _float(reader: GGUFReader, key: str, default: float) -> float:
    value = _field_value(reader, key)
    return default if value is None else float(value)  # type: ignore[arg-type]


# The families read from GGUF (DeepSeek models are served from Hugging Face folders).
GGUF_FAMILIES = (ModelFamily.LLAMA, ModelFamily.QWEN2, ModelFamily.QWEN3)


def read_arch(reader: GGUFReader) -> ModelArchConfig:
    """ModelArchConfig from `general.architecture` and its `<arch>.*` keys."""
    arch_name = _field_value(reader, "general.architecture")
    family = next((f for f in GGUF_FAMILIES if f.value == arch_name), None)
    if family is None:
        raise ValueError(f"unsupported GGUF architecture {arch_name!r} "
                         f"(supported: {', '.join(f.value for f in GGUF_FAMILIES)})")
    p = family.value
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ValueError("GGUF has no token_embd.weight tensor")
    scaling = _field_value(reader, f"{p}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise ValueError(f"GGUF uses RoPE scaling {scaling!r}, which kvbridge does not support")
    num_heads = _int(reader, f"{p}.attention.head_count")
    hidden = _int(reader, f"{p}.embedding_length")
    head_dim = _int(reader, f"{p}.attention.key_length", hidden // num_heads)
    rotary = _int(reader, f"{p}.rope.dimension_count", head_dim)
    if rotary != head_dim:
        raise ValueError(f"partial rotary embeddings ({rotary} of {head_dim} dims) are not supported")
    return ModelArchConfig(
        family=family,
        vocab_size=int(tensors["token_embd.weight"].shape[1]),  # ggml order: (hidden, vocab)
        hidden_size=hidden,
        intermediate_size=_int(reader, f"{p}.feed_forward_length"),
        num_layers=_int(reader, f"{p}.block_count"),
        num_heads=num_heads,
        num_kv_heads=_int(reader, f"{p}.attention.head_count_kv", num_heads),
        head_dim=head_dim,
        rms_norm_eps=_float(reader, f"{p}.attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta=_float(reader, f"{p}.rope.freq_base", 10000.0),
        max_position_embeddings=_int(reader, f"{p}.context_length", 2048),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
    )


def read_vocab(reader: GGUFReader) -> GGUFVocab:
    model = _field_value(reader, "tokenizer.ggml.model")
    tokens = _field_value(reader, "tokenizer.ggml.tokens")
    if not isinstance(model, str) or not isinstance(tokens, list):
        raise ValueError("GGUF has no tokenizer (tokenizer.ggml.model / tokenizer.ggml.tokens missing)")
    bos = _field_value(reader, "tokenizer.ggml.bos_token_id")
    eos = _field_value(reader, "tokenizer.ggml.eos_token_id")
    template = _field_value(reader, "tokenizer.chat_template")
    pre = _field_value(reader, "tokenizer.ggml.pre")
    return GGUFVocab(
        model=model,
        pre=pre if isinstance(pre, str) else None,
        tokens=tokens,
        merges=_field_value(reader, "tokenizer.ggml.merges") or [],  # type: ignore[arg-type]
        token_types=_field_value(reader, "tokenizer.ggml.token_type") or [],  # type: ignore[arg-type]
        bos_token_id=bos if isinstance(bos, int) else None,
        eos_token_id=eos if isinstance(eos, int) else None,
        add_bos_token=bool(_field_value(reader, "tokenizer.ggml.add_bos_token")),
        chat_template=template if isinstance(template, str) else None,
    )


def read_weights(reader: GGUFReader, arch: ModelArchConfig) -> dict[str, torch.Tensor]:
    """All tensors, dequantised to fp32 on CPU, HF-named, in HF layout."""
    weights: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        try:
            values = dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError as e:
            raise ValueError(f"tensor {tensor.name}: {e}") from e
        # ggml lists dimensions fastest-first; numpy/torch want them slowest-first.
        values = values.reshape(tuple(int(d) for d in reversed(tensor.shape)))
        if arch.family is ModelFamily.LLAMA and (".q_proj." in name or ".k_proj." in name):
            values = unpermute_rope_rows(values, arch.num_heads if ".q_proj." in name else arch.num_kv_heads)
        values = np.ascontiguousarray(values, dtype=np.float32)
        if np.may_share_memory(values, tensor.data):  # F32 tensors are views of the memory map
            values = values.copy()
        weights[name] = torch.from_numpy(values)
    return weights


def read_gguf(path: Path) -> ModelParts:
    """Architecture, fp32 weights and tokenizer of a GGUF file; ValueError if kvbridge cannot run it."""
    try:
        reader = GGUFReader(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read GGUF file {path}: {e}") from e
    arch = read_arch(reader)
    tokenizer = Tokenizer.from_gguf_vocab(read_vocab(reader))
    parts = ModelParts(arch=arch, weights=read_weights(reader, arch), tokenizer=tokenizer)
    logger.info("read %s: %s, %d tensors", path, arch.family.value, len(parts.weights))
    return parts
