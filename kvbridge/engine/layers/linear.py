"""A bias-optional linear layer whose weight is allocated but not initialised.

Random initialisation of a multi-billion-parameter model costs seconds and is thrown away
by `load_weights`, so parameters start as `torch.empty`.

On CPU in fp32 and bf16 the weight can be prepacked once for oneDNN (`prepack`): MKL's fp32
matmul grows steeply with the row count at decode batch sizes, oneDNN's prepacked one less so,
and reordered into oneDNN's blocked layout less again; in bf16 torch's own `F.linear` reaches
oneDNN's AMX matmul but with the plain weight on every call, and the weight reordered once is
faster from 1 row to 1024 (figures: benchmarks/README.md, linear_vs_vllm and "bf16").
KVBRIDGE_ONEDNN=0 turns it off.

Row buckets (bf16): oneDNN compiles and caches one primitive per matmul shape, and a
step's row count is its token count, so a prefilling server meets a new shape with almost every
prompt. A bf16 primitive costs milliseconds to create (AMX brgemm JIT), and with the caches bounded
(setup/native_memory.py) a shape evicted comes back as a new creation. A bf16 matmul of more than
`BUCKET_MIN_ROWS` rows therefore runs on its row count rounded up to a bucket
(shape_buckets.bucket_rows, which bf16 prefill attention uses too): multiples of 16 (AMX's tile
height) up to 256, then 8 buckets per doubling, so the zero rows added are at most 1/8 of the
rows (16 rows below 256) and a token budget of 2048 shows oneDNN 55 row counts per weight:
each is created once, at warm-up, and stays cached. The result is
the first rows of the padded product (a view: nothing copied). fp32 keeps exact row counts (a
creation is cheaper there, and padded rows are real work). KVBRIDGE_ROW_BUCKETS=0 turns
it off.

Widened bf16 (Intel CPUs without AMX): there oneDNN's bf16 matmul runs on AVX-512 BF16's vdpbf16ps,
which issues at a quarter of the rate of fp32 FMAs for twice their products, so bf16's peak is
half of fp32's (benchmarks/README.md, "Fourteenth session: a CPU without AMX"). Not on AMD: on a
Zen 4 EPYC the blocked bf16 matmul is 1.8-3x faster than fp32 and 2-6x faster than widened, from
128 rows to 2048 (benchmarks/README.md, "bf16 on an AMD EPYC"). A bf16 matmul of
at least `WIDEN_MIN_ROWS` rows on such a CPU (a prefill step) therefore widens the input and the
plain weight to fp32 (exact), multiplies in fp32 and rounds the result to bf16 once: the sums are
fp32 in both, and the time is lower from 128 rows up, weight conversion included (no fp32 copy is
kept; figures in the same section). Decode batches (fewer rows) stay on the packed bf16 weight,
where reading half the bytes is what counts. KVBRIDGE_BF16_WIDEN=0 turns it off, =1 on.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
from torch import nn

from kvbridge.engine.setup.dtype_choice import read_cpu_flags, read_cpu_vendor
from kvbridge.engine.layers import shape_buckets


_LAYOUT_ROWS_HINT = 16
PREPACKED_DTYPES = (torch.float32, torch.bfloat16)
WIDEN_MIN_ROWS = 128  # bf16 matmuls of this many rows run widened to fp32 where widens_bf16()


@functools.cache
def widens_bf16() -> bool:
    """bf16 matmuls of WIDEN_MIN_ROWS rows or more run in fp32 here: an Intel CPU without AMX-BF16
    (its bf16 matmul is no faster than fp32 FMAs); not an AMD one (Zen 4's bf16 matmul runs at about
    twice its fp32 one); KVBRIDGE_BF16_WIDEN=0 or 1 decides instead."""
    forced = os.environ.get("KVBRIDGE_BF16_WIDEN")
    if forced is not None:
        return forced != "0"
    return "amx_bf16" not in read_cpu_flags() and read_cpu_vendor() == "GenuineIntel"


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
        self._widen = False  # bf16 on a CPU where long matmuls run widened (widens_bf16)

    def prepack(self) -> None:
        """Call after the weight is loaded (again after any later change to it)."""
        self._packed = prepack_weight(self.weight)
        self._widen = self._packed is not None and self.weight.dtype == torch.bfloat16 and widens_bf16()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._widen and x.numel() >= WIDEN_MIN_ROWS * x.shape[-1]:
            return widened_linear(x, self.weight, self.bias)
        if self._packed is not None:
            return packed_linear(x, self._packed, self.bias)
        return F.linear(x, self.weight, self.bias)


def widened_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """bf16 x @ weight.T (+ bias) computed in fp32 from the exact widened values, rounded to bf16 once."""
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)


def prepack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """A oneDNN-prepacked copy of an fp32 or bf16 CPU weight, or None where that does not apply."""
    if (weight.device.type != "cpu" or weight.dtype not in PREPACKED_DTYPES or os.environ.get("KVBRIDGE_ONEDNN") == "0"
            or not torch.backends.mkldnn.is_available()):  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        return None
    if weight.dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return None  # a CPU without AVX-512: torch's own bf16 linear
    # Reordered into oneDNN's blocked layout for its matmul kernel (AB16b64a here), not merely
    # converted (`to_mkldnn()` keeps the plain layout): faster at decode batch sizes, as fast up
    # to prefill's row counts (benchmarks/README.md, linear_vs_vllm). The hint is the
    # decode batch the layout is chosen for; any row count works.
    packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _LAYOUT_ROWS_HINT)
    return packed


def _onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return out


def _bucketed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    m = x.shape[0]
    padded = shape_buckets.bucket_rows(m)
    if padded == m:
        return _onednn_linear(x, packed, bias)
    return _onednn_linear(F.pad(x, (0, 0, 0, padded - m)), packed, bias)[:m]


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] @ packed.T (+ bias), for a weight from prepack_weight (bf16: in row buckets)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if shape_buckets.ENABLED and x2.dtype == torch.bfloat16 and x2.shape[0] > shape_buckets.BUCKET_MIN_ROWS:
        y = _bucketed_linear(x2, packed, bias)
    else:
        y = _onednn_linear(x2, packed, bias)
    return y.reshape(*shape[:-1], y.shape[-1])

