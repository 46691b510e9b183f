"""The linear layers of a model step (fp32, or bf16 with --dtype bfloat16): torch's oneDNN (what
kvbridge calls) vs vLLM CPU's own oneDNN matmul, in one process, same weights, same inputs, same
threads.

kvbridge's decode step is mostly these four matmuls per layer (SmolLM2-135M shapes: fused
Q/K/V 576 -> 960, o_proj 576 -> 576, fused gate/up 576 -> 3072, down 1536 -> 576). kvbridge runs
them through torch's bundled oneDNN (`torch.ops.mkldnn._linear_pointwise`,
kvbridge/engine/layers/linear.py) with weights reordered into oneDNN's blocked layout
(`torch.ops.mkldnn._reorder_linear_weight`; "torch blocked"); before 2026-11-25 it converted
them in their plain layout (`to_mkldnn()`; "torch plain"). vLLM CPU runs them through the oneDNN
it builds into its `_C` extension (`vllm._custom_ops.create_onednn_mm` / `onednn_mm`, what its
`dispatch_cpu_unquantized_gemm` picks for these shapes). Also timed: `F.linear` (MKL's sgemm in
fp32, oneDNN with the plain weight in bf16).
The script re-runs itself with the python of vLLM's virtualenv (benchmarks/vllm_peer.py
installs it on first use), where both torch and vLLM's ops load. Medians of --reps calls,
for each row count M (sequences in a decode step, tokens in a prefill step).

    .venv/bin/python benchmarks/linear_vs_vllm.py --rows 1 16 64
    .venv/bin/python benchmarks/linear_vs_vllm.py --dtype bfloat16 --rows 1 16 64 512 2048
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

SHAPES = {"qkv": (960, 576), "o_proj": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def median_us(fn, reps: int) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def measure(rows: list[int], reps: int, threads: int, dtype_name: str) -> None:
    import torch
    import torch.nn.functional as F
    import vllm._custom_ops as vllm_ops

    torch.set_num_threads(threads)
    dtype = getattr(torch, dtype_name)
    tol = 1e-4 if dtype == torch.float32 else 3e-2  # the same product; bf16 results rounded to 8 bits
    print(f"torch {torch.__version__}, {dtype_name}, {threads} threads; microseconds per call, median of {reps}")
    names = ("torch blocked", "torch plain", "vLLM oneDNN", "F.linear")
    print(f"{'M':>3} {'layer':<8} " + " ".join(f"{n:>13}" for n in names) + f" {'blocked/vLLM':>12}")
    gen = torch.Generator().manual_seed(0)
    for m in rows:
        total = dict.fromkeys(names, 0.0)
        for name, (out_f, in_f) in SHAPES.items():
            w, x = (torch.randn(out_f, in_f, generator=gen).to(dtype),
                    torch.randn(m, in_f, generator=gen).to(dtype))
            blocked, plain = torch.ops.mkldnn._reorder_linear_weight(w, 16), w.to_mkldnn()
            handler = vllm_ops.create_onednn_mm(w.t(), 32)
            calls = {
                "torch blocked": lambda: torch.ops.mkldnn._linear_pointwise(x, blocked, None, "none", [], ""),
                "torch plain": lambda: torch.ops.mkldnn._linear_pointwise(x, plain, None, "none", [], ""),
                "vLLM oneDNN": lambda: vllm_ops.onednn_mm(handler, x, None),
                "F.linear": lambda: F.linear(x, w),
            }
            for call in calls.values():  # the same product
                torch.testing.assert_close(call().float(), calls["F.linear"]().float(), rtol=tol, atol=tol * 10)
            t = {n: median_us(call, reps) for n, call in calls.items()}
            for n in names:
                total[n] += t[n]
            print(f"{m:>3} {name:<8} " + " ".join(f"{t[n]:>13.1f}" for n in names)
                  + f" {t['torch blocked'] / t['vLLM oneDNN']:>11.2f}x")
        print(f"{m:>3} {'a layer':<8} " + " ".join(f"{total[n]:>13.1f}" for n in names)
              + f" {total['torch blocked'] / total['vLLM oneDNN']:>11.2f}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--reps", type=int, default=60)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--vllm-version", default="0.32.0")
    p.add_argument("--in-vllm-venv", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.in_vllm_venv:
        measure(args.rows, args.reps, args.threads, args.dtype)
        return
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from vllm_peer import DEFAULT_VENV, ensure_vllm_venv

    ensure_vllm_venv(DEFAULT_VENV, args.vllm_version)
    python = str(DEFAULT_VENV / "bin" / "python")
    os.execv(python, [python, __file__, "--in-vllm-venv", "--rows", *map(str, args.rows), "--reps", str(args.reps),
                      "--threads", str(args.threads), "--dtype", args.dtype])


if __name__ == "__main__":
    main()
