"""The CPU causal prefill attention kernel against torch's SDPA (its CPU flash attention).

One prompt of each length, SmolLM2-135M's heads (9 query heads, 3 KV heads of 64), q/k/v as the
model has them (views into one fused QKV tensor), one layer; the two run alternately and each
figure is the median of `--reps` calls. GFLOP/s counts the causal work (half of L x L).

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/prefill_attention.py --lengths 128 512 1024 2048
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kvbridge.engine.layers import cpu_kernels  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 1024, 2048])
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if not cpu_kernels.available():
        raise SystemExit("the CPU kernels are not available here (see the log above)")
    print(f"threads {args.threads}, load average {os.getloadavg()[0]:.1f}")
    print(f"{'tokens':>6} {'kernel us':>10} {'GFLOP/s':>8} {'SDPA us':>10} {'GFLOP/s':>8} {'speed-up':>8}")
    for length in args.lengths:
        fused = torch.randn(length, HEADS + 2 * KV_HEADS, HEAD_DIM)
        q, k, v = fused[:, :HEADS], fused[:, HEADS:HEADS + KV_HEADS], fused[:, HEADS + KV_HEADS:]
        qs, ks, vs = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # attention.py's SDPA call
        runs = {"kernel": lambda: cpu_kernels.prefill_attention(q, k, v, HEAD_DIM ** -0.5),
                "sdpa": lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)}
        times: dict[str, list[float]] = {name: [] for name in runs}
        for rep in range(args.reps + 2):
            for name, fn in runs.items():
                start = time.perf_counter()
                fn()
                if rep >= 2:  # two warm-ups each
                    times[name].append(time.perf_counter() - start)
        flops = HEADS * length * length * HEAD_DIM * 2  # QK and PV, causal half
        kernel, sdpa = (statistics.median(times[name]) for name in runs)
        print(f"{length:>6} {kernel * 1e6:>10.0f} {flops / kernel / 1e9:>8.0f} {sdpa * 1e6:>10.0f} "
              f"{flops / sdpa / 1e9:>8.0f} {sdpa / kernel:>7.2f}x")


if __name__ == "__main__":
    main()
