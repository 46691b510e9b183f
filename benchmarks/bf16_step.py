"""bf16 model steps on CPU before and after issue 31's first part, beside fp32, in one process.

SmolLM2-135M's shapes with random weights (benchmarks/model_step.py's), the same weights in three
kvbridge models, each step run by all three in a rotated order (background load hits all alike),
medians of --reps:

- **fp32**: today's fp32 path (oneDNN-prepacked linears, the fp32 attention kernels);
- **bf16 before**: bf16 as it ran before: torch's `F.linear` in bf16 and gather + SDPA attention
  (the linears' prepacked weights dropped, `cpu_kernels.DECODE_DTYPES` narrowed to fp32 for its calls);
- **bf16 torch ops**: bf16 as it ran before the one-pass ops took bf16: everything of "bf16 now"
  but rms_norm, add_rms_norm_, rotary_, write_kv_ and SiLU * up on torch's ops
  (`cpu_kernels.ELEMENTWISE_DTYPES` narrowed to fp32 for its calls);
- **bf16 now**: bf16 linears prepacked for oneDNN (AMX), the attention kernels reading bf16, the
  one-pass ops in bf16.

Decode: one step of `batch` sequences of --context tokens (blocks interleaved), logits included.
Prefill: one --prefill-token prompt into an empty cache, with its last row's logits.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/bf16_step.py --batches 1 16 64 --context 256 --prefill 1024
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from kvbridge.engine.layers import cpu_kernels  # noqa: E402
from kvbridge.engine.layers.attention import AttentionMetadata  # noqa: E402
from kvbridge.engine.layers.linear import Linear  # noqa: E402
from kvbridge.engine.models import build_model, kv_cache_shape  # noqa: E402
from model_step import BLOCK_SIZE, OursDecoder, build_pair  # noqa: E402

CONFIGS = ("fp32", "bf16 before", "bf16 torch ops", "bf16 now")


@contextlib.contextmanager
def kernels_fp32_only(*names: str) -> Iterator[None]:
    """cpu_kernels' dtype tuples `names` narrowed to fp32 while inside."""
    saved = {n: getattr(cpu_kernels, n) for n in names}
    for n in names:
        setattr(cpu_kernels, n, (torch.float32,))
    try:
        yield
    finally:
        for n, value in saved.items():
            setattr(cpu_kernels, n, value)


def guard(config: str) -> contextlib.AbstractContextManager:
    if config == "bf16 before":
        return kernels_fp32_only("DECODE_DTYPES", "ELEMENTWISE_DTYPES")
    if config == "bf16 torch ops":
        return kernels_fp32_only("ELEMENTWISE_DTYPES")
    return contextlib.nullcontext()


def unpack(model: torch.nn.Module) -> None:
    """The bf16 linears back on torch's F.linear (before issue 31 they were never prepacked)."""
    for module in model.modules():
        if isinstance(module, Linear):
            module._packed = None
    model._packed_head = None


def rotated_medians(calls: dict[str, Callable[[], float]], reps: int) -> dict[str, float]:
    """Each call returns its own time in seconds; medians over reps rounds in a rotated order."""
    names, times = list(calls), {n: [] for n in calls}
    for r in range(reps):
        for n in names[r % len(names):] + names[:r % len(names)]:
            times[n].append(calls[n]())
    return {n: statistics.median(t) for n, t in times.items()}


def run_as(config: str, fn: Callable[[], object]) -> float:
    with guard(config):
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0


def prefill_call(model, arch, dtype: torch.dtype, prompt: torch.Tensor) -> Callable[[], object]:
    n = prompt.shape[0]
    blocks = -(-n // BLOCK_SIZE)
    cache = torch.zeros(kv_cache_shape(arch, blocks, BLOCK_SIZE), dtype=dtype)
    positions = torch.arange(n)

    def call() -> object:
        attn = AttentionMetadata.build([n], [n], [list(range(blocks))], BLOCK_SIZE, "cpu")
        return model.compute_logits(model(prompt, positions, attn, cache)[-1:])
    return call


def report(label: str, t: dict[str, float], unit: Callable[[float], str]) -> None:
    print(f"{label:<18}" + "".join(f"{unit(t[c]):>14}" for c in CONFIGS)
          + f"{t['bf16 before'] / t['bf16 now']:>10.2f}x{t['bf16 torch ops'] / t['bf16 now']:>10.2f}x"
          + f"{t['fp32'] / t['bf16 now']:>10.2f}x", flush=True)


@torch.inference_mode()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--prefill", type=int, default=1024)
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    assert cpu_kernels.available(), "the CPU kernels did not build"
    hf, fp32_model, arch = build_pair(torch.float32, torch.device("cpu"))
    weights = {k: v.bfloat16() for k, v in hf.state_dict().items()}
    del hf
    models = {"fp32": fp32_model}
    for config in CONFIGS[1:]:
        models[config] = build_model(arch, torch.bfloat16, torch.device("cpu"))
        models[config].load_weights(dict(weights))
    unpack(models["bf16 before"])
    dtypes = {c: torch.float32 if c == "fp32" else torch.bfloat16 for c in CONFIGS}
    print(f"torch {torch.__version__}, {args.threads} threads, medians of {args.reps} rotated rounds; "
          f"ratios: bf16 before / now, bf16 torch ops / now, fp32 / bf16 now")
    print(f"{'':<18}" + "".join(f"{c:>14}" for c in CONFIGS) + f"{'vs before':>11}{'vs ops':>11}{'vs fp32':>11}")
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, arch.vocab_size, (args.prefill,), generator=gen)
    calls = {c: prefill_call(models[c], arch, dtypes[c], prompt) for c in CONFIGS}
    t = rotated_medians({c: (lambda c=c: run_as(c, calls[c])) for c in CONFIGS}, max(3, args.reps // 2))
    report(f"prefill {args.prefill}", t, lambda s: f"{s * 1e3:.0f} ms")
    for batch in args.batches:
        prompts = torch.randint(0, arch.vocab_size, (batch, args.context), generator=gen)
        decoders = {}
        for c in CONFIGS:
            with guard(c):
                decoders[c] = OursDecoder(models[c], arch, prompts, args.reps + 3, torch.device("cpu"), dtypes[c])
        for c in CONFIGS:  # one warm-up step each
            run_as(c, decoders[c].step)
        t = rotated_medians({c: (lambda c=c: run_as(c, decoders[c].step)) for c in CONFIGS}, args.reps)
        report(f"decode batch {batch}", t, lambda s, b=batch: f"{b / s:.0f} tok/s")
        decoders.clear()  # their KV caches


if __name__ == "__main__":
    main()
