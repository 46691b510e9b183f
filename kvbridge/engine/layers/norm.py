"""RMSNorm as Llama-family checkpoints define it (weight * x / rms(x), statistics in fp32)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvbridge.engine.layers import cpu_kernels


def _one_pass(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The CPU kernel applies: fp32 or bf16 rows [tokens, hidden] with one weight (same dtype) per column."""
    return (x.dim() == 2 and x.stride(1) == 1 and weight.shape == x.shape[-1:]
            and cpu_kernels.elementwise_applies(x, weight))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise the last dimension of x and scale by weight (broadcastable to x).

    Below fp32 the statistics are taken in fp32 and the scale is applied after the cast
    back to x's dtype, as the reference implementation does. fp32 and bf16 rows on CPU take one
    pass (cpu_kernels, the same rounding); torch's rms_norm makes several there.
    """
    if _one_pass(x, weight):
        out: torch.Tensor = cpu_kernels.ops().rms_norm(x, weight, eps)
        return out
    if x.dtype == torch.float32 and weight.shape == x.shape[-1:]:
        return F.rms_norm(x, weight.shape, weight, eps)
    return weight * F.rms_norm(x.float(), x.shape[-1:], None, eps).to(x.dtype)


def add_rms_norm_(residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """residual += delta (in place), then rms_norm(residual): one pass on CPU in fp32 and bf16."""
    if residual.is_contiguous() and delta.shape == residual.shape and delta.stride(-1) == 1 and _one_pass(
            residual, weight):
        normed: torch.Tensor = cpu_kernels.ops().add_rms_norm_(residual, delta, weight, eps)
        return normed
    residual += delta
    return rms_norm(residual, weight, eps)


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension with a learned scale.

    The weight is left uninitialised; `load_weights` of the owning model fills it.
    """

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
