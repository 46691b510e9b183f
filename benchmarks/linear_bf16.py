"""bf16 linear layers on the CPU's matrix units: torch's bf16 `F.linear` (oneDNN matmul with the
plain weight, reordered on every call), oneDNN's inner product with the weight reordered once
into its blocked layout (`torch.ops.mkldnn._reorder_linear_weight` + `_linear_pointwise`, what
kvbridge's `Linear.prepack` does), the bf16 product widened to fp32 (`linear.widened_linear`:
input and plain weight widened on every call, fp32 matmul, one rounding to bf16; what kvbridge
runs from 128 rows on CPUs without AMX), and today's fp32 path (blocked, fp32), on SmolLM2-135M's
layer shapes. One process; every repetition runs each candidate once in a rotated order, so
background load hits all alike; medians of the repetitions; ratios fp32 blocked / the bf16
candidates, and bf16 blocked / bf16 widened (> 1: widening is faster).

    OMP_WAIT_POLICY=PASSIVE python benchmarks/linear_bf16.py --rows 1 16 64 128 512 2048
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kvbridge.engine.layers.linear import widened_linear  # noqa: E402

SHAPES = {"qkv": (960, 576), "o_proj": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "lm_head": (49152, 576)}
LAYER = ("qkv", "o_proj", "gate_up", "down")


def interleaved_medians(calls: dict[str, Callable[[], object]], reps: int, inner: int) -> dict[str, float]:
    """Microseconds per call, the median over `reps` rounds of `inner` calls each; each round
    runs every candidate, starting from a different one."""
    names = list(calls)
    for fn in calls.values():
        for _ in range(3):
            fn()
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(reps):
        for n in names[r % len(names):] + names[:r % len(names)]:
            fn = calls[n]
            start = time.perf_counter()
            for _ in range(inner):
                fn()
            times[n].append((time.perf_counter() - start) / inner * 1e6)
    return {n: statistics.median(t) for n, t in times.items()}


def candidates(w32: torch.Tensor, x32: torch.Tensor) -> dict[str, Callable[[], object]]:
    w16, x16 = w32.bfloat16(), x32.bfloat16()
    blocked32 = torch.ops.mkldnn._reorder_linear_weight(w32, 16)
    blocked16 = torch.ops.mkldnn._reorder_linear_weight(w16, 16)
    return {
        "fp32 blocked": lambda: torch.ops.mkldnn._linear_pointwise(x32, blocked32, None, "none", [], ""),
        "bf16 F.linear": lambda: F.linear(x16, w16),
        "bf16 blocked": lambda: torch.ops.mkldnn._linear_pointwise(x16, blocked16, None, "none", [], ""),
        "bf16 widened": lambda: widened_linear(x16, w16, None),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 512])
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__}, {args.threads} threads; microseconds per call, medians of {args.reps} "
          "interleaved rounds; ratio = fp32 blocked / candidate")
    names = ("fp32 blocked", "bf16 F.linear", "bf16 blocked", "bf16 widened")
    print(f"{'M':>4} {'layer':<8} " + " ".join(f"{n:>14}" for n in names) + "  F.linear x  blocked x  widened x"
          + "  blocked/widened")

    def ratios(t: dict[str, float]) -> str:
        return ("".join(f" {t['fp32 blocked'] / t[n]:>9.2f}" for n in names[1:])
                + f"  {t['bf16 blocked'] / t['bf16 widened']:>15.2f}")
    for m in args.rows:
        layer_total = dict.fromkeys(names, 0.0)
        for shape_name, (out_f, in_f) in SHAPES.items():
            w, x = torch.randn(out_f, in_f, generator=gen) / in_f ** 0.5, torch.randn(m, in_f, generator=gen)
            calls = candidates(w, x)
            inner = max(1, int(2e6 / (out_f * in_f * max(m, 8) / 8)))  # ~ the same work per round
            t = interleaved_medians(calls, args.reps, min(inner, 50))
            if shape_name in LAYER:
                for n in names:
                    layer_total[n] += t[n]
            print(f"{m:>4} {shape_name:<8} " + " ".join(f"{t[n]:>14.1f}" for n in names) + " " + ratios(t))
        print(f"{m:>4} {'layer':<8} " + " ".join(f"{layer_total[n]:>14.1f}" for n in names) + " " + ratios(layer_total))


if __name__ == "__main__":
    main()
