"""The CPU attention kernels at bf16 against torch's bf16 path, beside the fp32 kernels, one layer
of SmolLM2-135M's heads (9 query, 3 KV, of 64), in one process, rotated order, medians:

- decode (`batch` sequences of --context tokens, blocks interleaved, block size 16): the kernel
  reading the bf16 cache in place vs gather + SDPA (PagedAttention with `in_place_decode` off),
  and the fp32 kernel on the fp32 cache;
- causal prefill of a step's N fresh prompts of L tokens (one layer's attention over them, into
  the step's [N L, heads * D] output): the bf16 kernel (`prefill_attention_bf16_`, one call for all
  N) on each product the CPU runs (AVX-512 BF16 dot products; AMX tiles where it has AMX-BF16) vs
  `F.scaled_dot_product_attention` in bf16 per prompt (torch's CPU flash attention, what the engine
  used for bf16 prompts before, and still uses on CPUs with neither) copied into the output as the
  layer did, and the fp32 kernel per prompt. (A bf16 build of the
  fp32 prefill kernel, commit 0c85364, was 2.4-5x slower than bf16 SDPA: benchmarks/README.md "bf16".)

    OMP_WAIT_POLICY=PASSIVE python benchmarks/attention_bf16.py --batches 1 16 64 --prefills 1x128 16x128 1x1024
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kvbridge.engine.layers import cpu_kernels  # noqa: E402
from kvbridge.engine.layers.attention import AttentionMetadata, PagedAttention  # noqa: E402
from linear_bf16 import interleaved_medians  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def decode_calls(batch: int, context: int, gen: torch.Generator) -> dict:
    per_seq = -(-context // BLOCK)
    tables = [[b * batch + s for b in range(per_seq)] for s in range(batch)]
    cache = torch.randn(batch * per_seq, KV_HEADS, 1, 2, BLOCK, HEAD_DIM, generator=gen)
    kv32 = cache[:, :, 0].permute(0, 2, 3, 1, 4)
    kv16 = cache.bfloat16()[:, :, 0].permute(0, 2, 3, 1, 4)
    q32 = torch.randn(batch, HEADS, HEAD_DIM, generator=gen)
    q16 = q32.bfloat16()
    decode = AttentionMetadata.build([1] * batch, [context] * batch, tables, BLOCK, "cpu").decode
    kernel, gather = (PagedAttention(HEADS, KV_HEADS, HEAD_DIM, fold_gqa_decode=True) for _ in range(2))
    gather.in_place_decode = False
    return {"fp32 kernel": lambda: kernel._decode(q32, kv32, decode),
            "bf16 torch": lambda: gather._decode(q16, kv16, decode),
            KERNELS["avx512_bf16"]: lambda: kernel._decode(q16, kv16, decode)}


def prefill_calls(prompts: int, length: int, gen: torch.Generator) -> dict:
    tokens = prompts * length
    fused = torch.randn(tokens, HEADS + 2 * KV_HEADS, HEAD_DIM, generator=gen)
    q32, k32, v32 = fused[:, :HEADS], fused[:, HEADS:HEADS + KV_HEADS], fused[:, HEADS + KV_HEADS:]
    q16, k16, v16 = (t.bfloat16() for t in (q32, k32, v32))
    scale = HEAD_DIM ** -0.5
    out16, out32 = torch.empty(tokens, HEADS * HEAD_DIM).bfloat16(), torch.empty(tokens, HEADS * HEAD_DIM)
    starts, lens = torch.arange(prompts) * length, torch.full((prompts,), length)

    def each_prompt(attend, out: torch.Tensor) -> None:
        for s in range(0, tokens, length):
            out[s:s + length] = attend(slice(s, s + length))

    def sdpa(rows: slice) -> torch.Tensor:
        q, k, v = (t[rows].transpose(0, 1)[None] for t in (q16, k16, v16))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return out[0].transpose(0, 1).reshape(length, HEADS * HEAD_DIM)

    def fp32(rows: slice) -> torch.Tensor:
        return cpu_kernels.prefill_attention(q32[rows], k32[rows], v32[rows], scale).view(length, -1)

    calls = {"fp32 kernel": lambda: each_prompt(fp32, out32), "bf16 torch": lambda: each_prompt(sdpa, out16)}
    for isa in cpu_kernels.bf16_prefill_isas():
        calls[KERNELS[isa]] = (lambda isa=isa: cpu_kernels.prefill_attention_bf16_(out16, q16, k16, v16, starts, lens,
                                                                                   scale, isa=isa))
    return calls


KERNELS = {"avx512_bf16": "bf16 avx512", "amx": "bf16 amx"}  # the prefill kernel's products, as columns
NAMES = ("fp32 kernel", "bf16 torch", *KERNELS.values())


def report(label: str, t: dict[str, float]) -> None:
    """Times, then bf16 torch / each bf16 kernel and fp32 kernel / the fastest bf16 path (decode:
    the paged kernel, in the avx512 column)."""
    cells = "".join(f"{t[n]:>13.0f}" if n in t else f"{'-':>13}" for n in NAMES)
    ratios = "".join(f"{t['bf16 torch'] / t[n]:>12.2f}x" if n in t else f"{'-':>13}" for n in KERNELS.values())
    best = min(t[n] for n in NAMES[1:] if n in t)
    print(f"{label:<20}{cells}{ratios}{t['fp32 kernel'] / best:>10.2f}x", flush=True)


@torch.inference_mode()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--prefills", nargs="+", default=["1x128", "16x128", "1x512", "1x1024"], metavar="NxL",
                   help="steps of N fresh prompts of L tokens (default: 1x128 16x128 1x512 1x1024)")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    assert cpu_kernels.available(), "the CPU kernels did not build"
    gen = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__}, {args.threads} threads; microseconds per layer call, medians of {args.reps} "
          "rotated rounds; ratios: bf16 torch / each bf16 kernel, fp32 kernel / the fastest bf16 path")
    print(f"{'':<20}" + "".join(f"{n:>13}" for n in NAMES) + "".join(f"{'vs ' + n[5:]:>13}" for n in KERNELS.values())
          + f"{'vs fp32':>10}")
    for batch in args.batches:
        report(f"decode {batch}x{args.context}", interleaved_medians(decode_calls(batch, args.context, gen), args.reps, 5))
    for case in args.prefills:
        prompts, length = (int(x) for x in case.lower().split("x"))
        report(f"prefill {prompts}x{length}", interleaved_medians(prefill_calls(prompts, length, gen), args.reps, 1))


if __name__ == "__main__":
    main()
