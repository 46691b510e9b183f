"""kvbridge's CPU kernels per instruction set, op by op, each against its floor on this machine.

Every build this CPU runs (`KVBRIDGE_CPU_ISA`'s avx2, avx512, amx: layers/cpu_kernels.py) is loaded
into this one process and called through its own op namespace at the shapes of SmolLM2-135M
(hidden 576, 9 heads and 3 KV heads of 64, MLP 1536, 30 layers): a decode step at batch 1 and 16
(context 192 tokens, blocks of 16) and a 16 x 128 prefill step (2048 tokens; attention one
prompt at a time, as the layer calls it). Per op: the median time of one call (`--reps` calls,
the builds interleaved call round by call round, so load on the machine falls on all of them
alike), the time per step (x 30 layers, x 2 for the two norms), and the floor:

- memory: the bytes the op must read and write / memcpy GB/s (benchmarks/roofline.py's: a
  256 MiB torch copy, the best of 10); a decode step's per-layer tensors sit in cache, so those
  ops are far above this floor: the ratio says how much is call overhead;
- FMA (prefill attention): its FLOPs (4 x L^2 / 2 x heads x head_dim, causal) / the fp32 GEMM
  peak (torch.mm at 2048, the best of 10), halved for the avx2 build (8 lanes instead of 16 on
  the same FMA ports; a machine without AVX-512 gets the GEMM peak as is).

The CPU's model and flags, and the load average, are printed first. The linears (torch / oneDNN)
are the same for every build and are not here (benchmarks/roofline.py times the whole step).

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/isa_paths.py --threads 2 --reps 200
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from roofline import gemm_gflops, memcpy_gbps  # noqa: E402

from kvbridge.engine.layers import cpu_kernels  # noqa: E402

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, LAYERS = 576, 9, 3, 64, 1536, 30
BLOCK, CONTEXT = 16, 192


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.partition(":")[2].strip()
    return platform.processor() or "unknown"


def cases(batch: int | None, prompts: int, length: int, dtype: torch.dtype) -> list[tuple[str, int, int, Callable]]:
    """(op, calls per step, bytes moved per call, call(ops, isa)) for a decode step (batch) or a prefill step."""
    gen = torch.Generator().manual_seed(0)
    rows = batch if batch is not None else prompts * length
    size = torch.finfo(dtype).bits // 8

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    x, w, delta = rand(rows, HIDDEN), rand(HIDDEN), rand(rows, HIDDEN)
    residual = rand(rows, HIDDEN)
    qk = rand(rows, HEADS + KV_HEADS, HEAD_DIM)
    # A true rotation (rotate_half's sign in the sine table), so that the in-place calls repeated on
    # one tensor keep its norm (random tables grew or shrank it into infinities or subnormals).
    angles = torch.rand(rows, 1, HEAD_DIM // 2, generator=gen) * 6.28
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(dtype)
    sin = torch.cat([-angles.sin(), angles.sin()], -1).to(dtype)
    gate_up = rand(rows, 2 * INTER)
    contexts = [CONTEXT] * rows if batch is not None else [length] * prompts
    blocks_per_seq = (max(contexts) + BLOCK) // BLOCK
    n_blocks = len(contexts) * blocks_per_seq
    kv = rand(n_blocks, KV_HEADS, 2, BLOCK, HEAD_DIM).permute(0, 2, 3, 1, 4)  # the cache's layer view
    k, v = rand(rows, KV_HEADS, HEAD_DIM), rand(rows, KV_HEADS, HEAD_DIM)
    slots = torch.randperm(n_blocks * BLOCK, generator=gen)[:rows]
    out: list[tuple[str, int, int, Callable]] = [
        ("rms_norm", 1, 3 * rows * HIDDEN * size, lambda o: o.rms_norm(x, w, 1e-5)),
        ("add_rms_norm_", 2, 4 * rows * HIDDEN * size, lambda o: o.add_rms_norm_(residual, delta, w, 1e-5)),
        ("rotary_ (q and k)", 1, 2 * rows * (HEADS + KV_HEADS + 2) * HEAD_DIM * size, lambda o: o.rotary_(qk, cos, sin)),
        ("write_kv_", 1, 4 * rows * KV_HEADS * HEAD_DIM * size, lambda o: o.write_kv_(kv, k, v, slots)),
        ("silu_and_mul", 1, 3 * rows * INTER * size, lambda o: o.silu_and_mul(gate_up)),
    ]
    if batch is not None:
        q = rand(batch, HEADS, HEAD_DIM)
        table = torch.arange(n_blocks).view(batch, blocks_per_seq)
        lens = torch.tensor(contexts)
        kv_bytes = 2 * sum(contexts) * KV_HEADS * HEAD_DIM * size
        out.append(("paged_decode_attention", 1, kv_bytes + 2 * q.numel() * size,
                    lambda o: o.paged_decode_attention(q, kv, table, lens, 0, HEAD_DIM ** -0.5)))
    elif dtype == torch.float32:
        pq = rand(length, HEADS, HEAD_DIM)
        pk, pv = rand(length, KV_HEADS, HEAD_DIM), rand(length, KV_HEADS, HEAD_DIM)
        out.append(("prefill_attention", prompts, -1, lambda o: o.prefill_attention(pq, pk, pv, HEAD_DIM ** -0.5)))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=200, help="calls per op and build (default 200)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--isas", nargs="+", default=None, help="builds to compare (default: every one this CPU runs)")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    dtype = getattr(torch, a.dtype)
    isas = a.isas or cpu_kernels.runnable_isas()
    for isa in isas:
        cpu_kernels.load(isa)
    flags = sorted(f for f in cpu_kernels.cpu_flags() if f.startswith(("avx", "amx", "fma", "f16c")))
    print(f"CPU: {cpu_model()}; {os.cpu_count()} cores, {a.threads} threads; flags: {' '.join(flags)}")
    print(f"load average at start: {' '.join(f'{x:.1f}' for x in os.getloadavg())}; torch {torch.__version__}; "
          f"{a.dtype}; builds: {', '.join(isas)}")
    gbps = memcpy_gbps()
    peak = gemm_gflops(2048)
    print(f"memcpy {gbps:.1f} GB/s, fp32 GEMM {peak:.0f} GFLOP/s (avx2 FMA floor: half of it where the CPU has AVX-512)")
    has512 = "avx512f" in cpu_kernels.cpu_flags()
    steps = [("decode, batch 1", 1, 0, 0), ("decode, batch 16", 16, 0, 0), ("prefill, 16 x 128", None, 16, 128)]
    for title, batch, prompts, length in steps:
        rows = cases(batch, prompts, length, dtype)
        print(f"\n## {title} ({a.dtype})\n")
        print("| op | calls/step | " + " | ".join(f"{isa} us/call | {isa} ms/step | {isa} / floor" for isa in isas) + " |")
        print("|---|---|" + "---|---|---|" * len(isas))
        totals = dict.fromkeys(isas, 0.0)
        for name, per_layer, nbytes, call in rows:
            namespaces = {isa: cpu_kernels.ops(isa) for isa in isas}
            for isa in isas:
                call(namespaces[isa])  # warm
            times: dict[str, list[float]] = {isa: [] for isa in isas}
            for _ in range(a.reps):
                for isa in isas:
                    start = time.perf_counter()
                    call(namespaces[isa])
                    times[isa].append(time.perf_counter() - start)
            cells = []
            for isa in isas:
                t = statistics.median(times[isa])
                if nbytes >= 0:
                    floor = nbytes / gbps / 1e9
                else:  # prefill attention: causal FLOPs over the FMA peak
                    flops = 4 * length * (length + 1) / 2 * HEADS * HEAD_DIM
                    floor = flops / (peak * (0.5 if isa == "avx2" and has512 else 1.0) * 1e9)
                step_ms = t * LAYERS * (prompts if nbytes < 0 else per_layer) * 1e3
                totals[isa] += step_ms
                cells.append(f"{t * 1e6:.1f} | {step_ms:.2f} | {t / floor:.1f}x")
            calls = prompts if nbytes < 0 else per_layer
            print(f"| {name} | {calls} x {LAYERS} | " + " | ".join(cells) + " |")
        print("| **all these ops** | | " + " | ".join(f" | **{totals[isa]:.2f}** | " for isa in isas) + " |")


if __name__ == "__main__":
    main()
