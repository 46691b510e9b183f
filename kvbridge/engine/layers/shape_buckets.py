"""Bounded shapes for reduced-precision CPU kernels that cache per shape.

oneDNN compiles and caches one primitive per matmul shape, and torch's CPU flash attention in
bf16/fp16 keeps per-shape kernels of its own (AMX brgemm), so a prefilling server whose steps
and prompts take a new length with almost every request grows native memory with every new
length: live memory the caches hold plus the heap holes their churn leaves behind. A bf16
SDPA call at 400 random lengths of 17-2000 grew glibc's bytes in use 84 -> 170 MB and its free
(fragmented) bytes 6 -> 384 MB; the same calls on bucketed lengths stayed at 95 MB and 38 MB
(benchmarks/README.md, "soak"). fp32 SDPA and kvbridge's own kernels do not grow this way.

`bucket_rows` maps a length onto a bounded set: the length itself up to `BUCKET_MIN_ROWS`
(decode batches), multiples of `BUCKET_ALIGN` (AMX's tile height) up to 256, then 8 buckets per
doubling, so the padding is at most 1/8 of the length (15 rows below 256) and a 2048-token step
budget meets 55 lengths. KVBRIDGE_ROW_BUCKETS=0 turns every use off (exact shapes).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

BUCKET_MIN_ROWS = 16  # up to this many rows (decode batches) a shape is its own bucket
BUCKET_ALIGN = 16  # the finest bucket step (AMX's tile height)
ENABLED = os.environ.get("KVBRIDGE_ROW_BUCKETS") != "0"
_PADDED_ATTENTION_DTYPES = (torch.bfloat16, torch.float16)


def bucket_rows(m: int) -> int:
    """m up to BUCKET_MIN_ROWS; above, m rounded up to a multiple of BUCKET_ALIGN up to 256 and of
    2**(k-3) for 2**k < m <= 2**(k+1) beyond (8 buckets per doubling: at most m/8 rows of padding)."""
    if m < 1:
        raise ValueError(f"a shape needs at least one row, got {m}")
    if m <= BUCKET_MIN_ROWS:
        return m
    step = max(BUCKET_ALIGN, 1 << max(0, (m - 1).bit_length() - 4))
    return -(-m // step) * step


def pads_attention(q: torch.Tensor) -> bool:
    """Whether a prefill SDPA over q runs on bucketed lengths: bf16/fp16 on CPU (torch's flash
    attention caches kernels per shape there), unless KVBRIDGE_ROW_BUCKETS=0."""
    return ENABLED and q.device.type == "cpu" and q.dtype in _PADDED_ATTENTION_DTYPES


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x [..., L, D] with zero rows appended along L up to `rows`."""
    extra = rows - x.shape[-2]
    return x if extra == 0 else F.pad(x, (0, 0, 0, extra))


def padded_mask(mask: torch.Tensor, q_rows: int, k_cols: int) -> torch.Tensor:
    """mask [..., Lq, Lk] (True = attend) grown to [..., q_rows, k_cols]: the added keys are never
    attended; an added query row attends key 0 only (a row with no key would compute NaN)."""
    *lead, lq, lk = mask.shape
    if (lq, lk) == (q_rows, k_cols):
        return mask
    out = torch.zeros(*lead, q_rows, k_cols, dtype=torch.bool, device=mask.device)
    out[..., :lq, :lk] = mask
    out[..., lq:, 0] = True
    return out


def prefill_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                 scale: float | None = None, enable_gqa: bool = False,
                 mask_cache: dict[tuple[int, int], torch.Tensor] | None = None) -> torch.Tensor:
    """SDPA for one prefill sequence, q [1, H, Lq, D], k/v [1, Hkv, Lk, D*]: causal over its own K/V
    when mask is None (then Lq == Lk), else under mask [1, 1, Lq, Lk]. Where `pads_attention`,
    the lengths are padded to buckets and the result is the first Lq rows (the real rows see
    exactly the keys they saw before: a causal row never sees a later key, the mask hides the
    added ones). `mask_cache` keeps the padded mask for the step's other layers."""
    if not pads_attention(q):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                              enable_gqa=enable_gqa)
    lq, lk = q.shape[-2], k.shape[-2]
    pq = bucket_rows(lq)
    if mask is None:
        if lq != lk:
            raise ValueError(f"causal attention without a mask needs as many queries as keys, got {lq} and {lk}")
        out = F.scaled_dot_product_attention(_pad_rows(q, pq), _pad_rows(k, pq), _pad_rows(v, pq),
                                             is_causal=True, scale=scale, enable_gqa=enable_gqa)
    else:
        pk = bucket_rows(lk)
        grown = None if mask_cache is None else mask_cache.get((pq, pk))
        if grown is None:
            grown = padded_mask(mask, pq, pk)
            if mask_cache is not None:
                mask_cache[(pq, pk)] = grown
        out = F.scaled_dot_product_attention(_pad_rows(q, pq), _pad_rows(k, pk), _pad_rows(v, pk),
                                             attn_mask=grown, scale=scale, enable_gqa=enable_gqa)
    return out[..., :lq, :]
