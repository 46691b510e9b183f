"""Architecture description of a Llama-family model, independent of its weight format.

Loaders (GGUF, Hugging Face folders) produce one; model classes consume it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class ModelFamily(str, Enum):
    LLAMA = "llama"
    QWEN2 = "qwen2"  # Llama + bias on the Q/K/V projections
    QWEN3 = "qwen3"  # Llama + RMSNorm on each head of Q and K (no QKV bias)


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

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V per token over all layers, at 4 bytes per element (fp32)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 4
