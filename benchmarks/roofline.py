"""How far a kvbridge decode step is from this machine's limits.

The engine (SmolLM2-135M-Instruct in --dtype, fp32 by default, --threads torch threads) decodes `batch` sequences of a
`--context`-token random prompt; the step time is the median of `--steps` pure decode steps
(schedule, forward, sampling, detokenisation: `LLMEngine.step`). Beside it, measured in the same
process right before:

- **memcpy GB/s**: torch copy of a 256 MiB fp32 tensor (the bytes copied per second; the best
  of 10, since a limit is what the machine can do, and other jobs only ever slow it down);
- **GEMM GFLOP/s**: torch.mm of 2048 x 2048 fp32 matrices (the best of 10), the
  practical compute peak of the cores torch uses; with `--dtype bfloat16`, torch.mm of bf16
  matrices of 1024 and 2048 (the best of both, 10 each): oneDNN's AMX / AVX-512 BF16 matmul, the
  peak of the bf16 matrix units (the 1024 one stays in L2 and runs fastest here).

Limits: a decode step must read every weight (the tied LM head included) and each sequence's
KV once (in --dtype: bf16 halves both), so at batch 1 its floor is (weight bytes + KV bytes) /
memcpy GB/s; it does
2 x parameters FLOPs per token in the matmuls (+ attention's 4 x context x hidden x layers), so
at batch 16 its floor is FLOPs / GEMM GFLOP/s. Reported: step time, each floor and the ratio.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/roofline.py --batches 1 16
    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/roofline.py --dtype bfloat16 --batches 1 16 64
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from kvbridge.config import EngineConfig  # noqa: E402
from kvbridge.engine.engine import LLMEngine  # noqa: E402
from kvbridge.engine.sampling_params import SamplingParams  # noqa: E402


def best_time(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def memcpy_gbps(nbytes: int = 256 << 20) -> float:
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    return nbytes / best_time(lambda: dst.copy_(src), 10) / 1e9


def gemm_gflops(n: int = 2048, dtype: torch.dtype = torch.float32) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    torch.mm(a, b)
    return 2 * n ** 3 / best_time(lambda: torch.mm(a, b), 10) / 1e9


def peak_gflops(dtype: torch.dtype) -> float:
    """fp32: torch.mm at 2048; bf16: the matrix units' best of 1024 and 2048 (see the docstring)."""
    if dtype == torch.bfloat16:
        return max(gemm_gflops(1024, dtype), gemm_gflops(2048, dtype))
    return gemm_gflops(2048, dtype)


def decode_step_s(engine: LLMEngine, batch: int, context: int, steps: int, rng: random.Random) -> float:
    """Median time of `steps` decode steps of `batch` sequences that start at `context` tokens."""
    params = SamplingParams(max_tokens=steps + 4, ignore_eos=True, temperature=0.0)
    for i in range(batch):
        engine.add_request(f"b{batch}-{i}", [rng.randrange(1000, 40000) for _ in range(context)], params)
    while engine.scheduler.num_waiting or any(not r.output_token_ids for r in engine.scheduler.running):
        engine.step()  # prefill
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    while engine.has_unfinished_requests():
        engine.step()
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--context", type=int, default=192, help="tokens per sequence when timing (default 192)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="weights, activations and KV cache (default: %(default)s)")
    args = p.parse_args()
    engine = LLMEngine.from_config(EngineConfig(num_threads=args.threads, dtype=args.dtype))
    dtype = getattr(torch, args.dtype)
    arch = engine.arch
    weights = list(engine.runner.model.parameters())
    weight_bytes = sum(w.numel() * w.element_size() for w in weights)
    params = sum(w.numel() for w in weights)
    kv_per_token = 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * torch.finfo(dtype).bits // 8
    rng = random.Random(0)
    engine.generate([[rng.randrange(1000, 40000) for _ in range(16)]],
                    SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0))  # warm-up
    print(f"{args.dtype}: weights {weight_bytes / 1e6:.0f} MB, KV {kv_per_token} B/token, threads {args.threads}, "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"{'batch':>5} {'step ms':>8} {'memcpy GB/s':>11} {'mem floor ms':>12} {'x floor':>7} "
          f"{'GEMM GFLOP/s':>12} {'flop floor ms':>13} {'x floor':>7} {'achieved GFLOP/s':>16}")
    for batch in args.batches:
        gbps, gflops = memcpy_gbps(), peak_gflops(dtype)
        step = decode_step_s(engine, batch, args.context, args.steps, rng)
        context = args.context + args.steps // 2  # the middle of the timed steps
        mem_floor = (weight_bytes + batch * context * kv_per_token) / (gbps * 1e9)
        flops = batch * (2 * params + 4 * context * arch.hidden_size * arch.num_layers)
        flop_floor = flops / (gflops * 1e9)
        print(f"{batch:>5} {step * 1e3:>8.1f} {gbps:>11.1f} {mem_floor * 1e3:>12.1f} {step / mem_floor:>6.2f}x "
              f"{gflops:>12.1f} {flop_floor * 1e3:>13.1f} {step / flop_floor:>6.2f}x {flops / step / 1e9:>16.1f}")


if __name__ == "__main__":
    main()
