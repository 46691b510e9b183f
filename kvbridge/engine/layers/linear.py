"""A bias-optional linear layer whose weight is allocated but not initialised.

Random initialisation of a multi-billion-parameter model costs seconds and is thrown away
by `load_weights`, so parameters start as `torch.empty`.

On CPU in fp32 and bf16 the weight can be prepacked once for oneDNN (`prepack`): MKL's fp32
matmul here costs about 9x more at 16 rows than at 1, oneDNN's prepacked one about
half of MKL's at batch sizes 16-64, and reordered into oneDNN's blocked layout another
1.2-1.5x less (benchmarks/README.md). In bf16 torch's own `F.linear` already reaches oneDNN's
AMX matmul but with the plain weight on every call; the weight reordered once is 1.1-1.6x
faster than that from 1 row to 1024 (benchmarks/README.md, "bf16"). KVBRIDGE_ONEDNN=0 turns it off.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn


_LAYOUT_ROWS_HINT = 16
PREPACKED_DTYPES = (torch.float32, torch.bfloat16)


class Linear(nn.Module):
    """y = x @ weight.T (+ bias); weight is [out_features, in_features] like `nn.Linear`."""

    def __init__(self, in_features: int, out_features: int, bias: bool,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=dtype, device=device), requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False)
                     if bias else None)
        self._packed: torch.Tensor | None = None

    def prepack(self) -> None:
        """Call after the weight is loaded (again after any later change to it)."""
        self._packed = prepack_weight(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed is not None:
            return packed_linear(x, self._packed, self.bias)
        return F.linear(x, self.weight, self.bias)


def prepack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """A oneDNN-prepacked copy of an fp32 or bf16 CPU weight, or None where that does not apply."""
    if (weight.device.type != "cpu" or weight.dtype not in PREPACKED_DTYPES or os.environ.get("KVBRIDGE_ONEDNN") == "0"
            or not torch.backends.mkldnn.is_available()):
        return None
    if weight.dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return None  # a CPU without AVX-512: torch's own bf16 linear
    # Reordered into oneDNN's blocked layout for its matmul kernel (AB16b64a here), not merely
    # converted (`to_mkldnn()` keeps the plain layout): 1.46x faster at 16 rows, 1.16x at 64, as
    # fast from 1 row to prefill's 2048 (benchmarks/README.md, linear_vs_vllm). The hint is the
    # decode batch the layout is chosen for; any row count works.
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _LAYOUT_ROWS_HINT)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] @ packed.T (+ bias), for a weight from prepack_weight."""
    shape = x.shape
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, shape[-1]), packed, bias, "none", [], "")
    return y.reshape(*shape[:-1], y.shape[-1])
