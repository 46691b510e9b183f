"""Rotary position embedding, Llama style (rotate_half over the two halves of each head, HF layout).

The cos/sin table for every position up to `max_positions` is built once; each step looks up
its positions once (`lookup`) and every layer reuses the result (`apply`). With a
`YarnScaling` (DeepSeek configs) the inverse frequencies are YaRN's blend of interpolated
and extrapolated ones and cos/sin carry its attention factor, as transformers computes them.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from kvbridge.engine.layers import cpu_kernels
from kvbridge.shape.model_config import YarnScaling


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_inv_freq(dim: int, base: float, y: YarnScaling) -> tuple[torch.Tensor, float]:
    """YaRN's inverse frequencies for `dim` rotated dims and the factor cos/sin are scaled by."""
    attention_factor = y.attention_factor
    if attention_factor is None:
        if y.mscale and y.mscale_all_dim:
            attention_factor = yarn_mscale(y.factor, y.mscale) / yarn_mscale(y.factor, y.mscale_all_dim)
        else:
            attention_factor = yarn_mscale(y.factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(y.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(y.beta_fast), correction_dim(y.beta_slow)
    if y.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no division by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (y.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    cos: torch.Tensor  # buffers: [max_positions, head_dim] tables
    signed_sin: torch.Tensor

    def __init__(self, head_dim: int, rope_theta: float, max_positions: int,
                 dtype: torch.dtype, device: torch.device, scaling: YarnScaling | None = None) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary embedding needs an even head_dim, got {head_dim}")
        self.head_dim = head_dim
        self.max_positions = max_positions
        # Same arithmetic as the reference (fp32 inverse frequencies, position * inv_freq),
        # so the tables agree bit for bit in fp32.
        factor = 1.0
        if scaling is None:
            inv_freq = 1.0 / (rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        else:
            inv_freq, factor = yarn_inv_freq(head_dim, rope_theta, scaling)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        half = head_dim // 2
        # rotate_half(x) * sin == roll(x, half) * signed_sin, with the first half's sign flipped.
        sign = torch.cat((-torch.ones(half), torch.ones(half)))
        self.register_buffer("cos", (emb.cos() * factor).to(device=device, dtype=dtype), persistent=False)
        self.register_buffer("signed_sin", (emb.sin() * factor * sign).to(device=device, dtype=dtype),
                             persistent=False)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin for each position, shaped [T, 1, head_dim] to broadcast over heads.

        Positions must be < max_positions (the model's max_position_embeddings).
        """
        cos = self.cos.index_select(0, positions).unsqueeze(1)
        sin = self.signed_sin.index_select(0, positions).unsqueeze(1)
        return cos, sin

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        # (a rotation, named like the reference's; not nn.Module.apply(fn): always called on the class)
        """Rotate x [T, heads, head_dim] (any head count) by the looked-up angles."""
        return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)

    @staticmethod
    def apply_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate the first rope_dim (cos.shape[-1]) dims of each head of x [T, heads, head_dim] in
        place, the rest unchanged; returns x. One pass on CPU in fp32 and bf16 (cpu_kernels)."""
        rope = cos.shape[-1]
        if x.stride(-1) == 1 and cos.is_contiguous() and sin.is_contiguous() and cpu_kernels.elementwise_applies(x, cos, sin):
            cpu_kernels.ops().rotary_(x, cos, sin)
        else:
            x[..., :rope] = RotaryEmbedding.apply(x[..., :rope], cos, sin)
        return x
