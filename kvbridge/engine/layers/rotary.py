"""Rotary position embedding, Llama style (rotate_half over the two halves of each head, HF layout).

The cos/sin table for every position up to `max_positions` is built once; each step looks up
its positions once (`lookup`) and every layer reuses the result (`apply`).
"""

from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, rope_theta: float, max_positions: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary embedding needs an even head_dim, got {head_dim}")
        self.head_dim = head_dim
        self.max_positions = max_positions
        # Same arithmetic as the reference (fp32 inverse frequencies, position * inv_freq),
        # so the tables agree bit for bit in fp32.
        inv_freq = 1.0 / (rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        half = head_dim // 2
        # rotate_half(x) * sin == roll(x, half) * signed_sin, with the first half's sign flipped.
        sign = torch.cat((-torch.ones(half), torch.ones(half)))
        self.register_buffer("cos", emb.cos().to(device=device, dtype=dtype), persistent=False)
        self.register_buffer("signed_sin", (emb.sin() * sign).to(device=device, dtype=dtype),
                             persistent=False)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin for each position, shaped [T, 1, head_dim] to broadcast over heads.

        Positions must be < max_positions (the model's max_position_embeddings).
        """
        cos = self.cos.index_select(0, positions).unsqueeze(1)
        sin = self.signed_sin.index_select(0, positions).unsqueeze(1)
        return cos, sin

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate x [T, heads, head_dim] (any head count) by the looked-up angles."""
        return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)
