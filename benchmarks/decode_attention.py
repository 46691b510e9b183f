"""The CPU decode attention kernel against this machine's memory limits.

One decode step's attention over every layer of SmolLM2-135M's shape (30 layers, 9 query heads,
3 KV heads of 64, block size 16): `batch` sequences of `context` tokens each, their blocks
scattered over a KV cache laid out as the engine's (per block: heads, layers, K/V, tokens; on
transparent huge pages, as the engine asks for), one `paged_decode_attention` call a layer.
Beside it, in the same process:

- **read GB/s**: `torch.sum` over a 512 MiB tensor (the best of 5): what the cores can stream in;
  the kernel reads each K/V byte once and writes almost nothing, so this is its memory limit;
- **hot GB/s**: the same step with every sequence's table pointing at the same blocks (they stay
  in cache): the kernel's arithmetic without memory stalls.

Figures are medians of `--reps` steps; GB/s = K/V bytes of the step / time.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/decode_attention.py --shapes 64x160 16x192
    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/decode_attention.py --dtype bfloat16
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from kvbridge.engine.layers import cpu_kernels  # noqa: E402
from kvbridge.engine.model_runner import advise_huge_pages  # noqa: E402

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 30, 9, 3, 64, 16


def read_gbps(nbytes: int = 512 << 20) -> float:
    x = torch.ones(nbytes // 4)
    times = []
    for _ in range(6):
        start = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - start)
    return nbytes / min(times[1:]) / 1e9


def step_s(batch: int, context: int, reps: int, hot: bool, rng: random.Random, dtype: torch.dtype) -> float:
    per_seq = -(-context // BLOCK_SIZE)
    num_blocks = batch * per_seq * 2  # half of the cache unused, as in a server that is not full
    cache = torch.empty(num_blocks, KV_HEADS, LAYERS, 2, BLOCK_SIZE, HEAD_DIM, dtype=dtype)
    advise_huge_pages(cache)
    cache.normal_()
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    table = torch.tensor([ids[:per_seq] if hot else ids[i * per_seq:(i + 1) * per_seq] for i in range(batch)])
    contexts = torch.full((batch,), context, dtype=torch.long)
    q = torch.randn(batch, HEADS, HEAD_DIM, dtype=dtype)
    layers = [cache[:, :, layer].permute(0, 2, 3, 1, 4) for layer in range(LAYERS)]  # the engine's layer views
    times = []
    for _ in range(reps + 1):
        start = time.perf_counter()
        for kv in layers:
            cpu_kernels.paged_decode_attention(q, kv, table, contexts, None, HEAD_DIM ** -0.5)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=["64x160", "16x192", "1x512"], help="BATCHxCONTEXT")
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="of the query and the KV cache")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if not cpu_kernels.available():
        raise SystemExit("the CPU kernels are not available here (see the log above)")
    rng = random.Random(0)
    dtype = getattr(torch, args.dtype)
    print(f"{args.dtype}, threads {args.threads}, read {read_gbps():.1f} GB/s (torch.sum), load average {os.getloadavg()[0]:.1f}")
    print(f"{'batch':>5} {'context':>7} {'KV MB':>6} {'step ms':>8} {'GB/s':>6} {'hot ms':>7} {'hot GB/s':>8}")
    for shape in args.shapes:
        batch, context = (int(x) for x in shape.split("x"))
        kv_bytes = batch * context * LAYERS * KV_HEADS * HEAD_DIM * 2 * dtype.itemsize
        cold, hot = (step_s(batch, context, args.reps, h, rng, dtype) for h in (False, True))
        print(f"{batch:>5} {context:>7} {kv_bytes / 1e6:>6.0f} {cold * 1e3:>8.2f} {kv_bytes / cold / 1e9:>6.1f} "
              f"{hot * 1e3:>7.2f} {kv_bytes / hot / 1e9:>8.1f}")


if __name__ == "__main__":
    main()
