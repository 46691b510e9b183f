"""Throughput cost of the native-memory fix (issue 33), interleaved A/B in fresh processes.

Each run is a fresh process (oneDNN reads its cache capacity at the process's first primitive)
with one configuration's environment, running an in-process LLMEngine (SmolLM2, fp32 or bf16,
`--threads` threads) over a fixed, seeded request set shaped like benchmarks/soak.py's traffic:
`--concurrency` requests in flight (a new one added as one finishes), prompts of random tokens,
12-660 long (soak's 5-300 words behind a nonce), 1-32 greedy output tokens with ignore_eos, no
prefix-cache hits. The first `--warmup` requests fill the caches; the next `--requests` are timed:
wall time, the process's CPU time, generated tokens, steps, the time inside malloc_trim, and
every step's row count (for an LRU count of oneDNN cache misses at a capacity). The runs go
config by config within a repetition, the order rotated each repetition, under `nice`, so every
configuration sees the same machine; the summary gives medians and ratios to the first config.
Every run's greedy outputs are hashed: all configurations must produce the same tokens.

    python benchmarks/native_memory_ab.py --reps 3 --config off --config fix --config trim-only --config bound-only
    python benchmarks/native_memory_ab.py --reps 3 --config off --config fix -- --dtype bfloat16

Configurations (name=ENV,... or one of the named ones below):
  off        the fix turned off: both caches at oneDNN's and ideep's default 1024, no malloc_trim
  fix        the engine's defaults (whatever native_memory.py sets)
  trim-only  caches at 1024, malloc_trim on (the default interval)
  bound-only caches at the engine's bound, no malloc_trim
  no-buckets the engine's defaults but bf16 matmuls on exact row counts (KVBRIDGE_ROW_BUCKETS=0;
             before bf16 row buckets, kvbridge/engine/layers/linear.py)

`--count-creations` adds one untimed run per configuration with ONEDNN_VERBOSE=profile_create and
counts oneDNN's primitive creations (cache misses) during the timed requests: the cost the caches'
bound and the row buckets are about, counted rather than timed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections import OrderedDict

NAMED = {
    "off": {"KVBRIDGE_MALLOC_TRIM_S": "0", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "1024", "LRU_CACHE_CAPACITY": "1024"},
    "fix": {},
    "trim-only": {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "1024", "LRU_CACHE_CAPACITY": "1024"},
    "bound-only": {"KVBRIDGE_MALLOC_TRIM_S": "0"},
    "no-buckets": {"KVBRIDGE_ROW_BUCKETS": "0"},
}
CLEARED = ("KVBRIDGE_MALLOC_TRIM_S", "ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY", "KVBRIDGE_ROW_BUCKETS",
           "ONEDNN_VERBOSE")
TIMED_MARK = "KVBRIDGE-AB-TIMED-FROM-HERE"


def requests(seed: int, n: int, vocab: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = 8 + int(rng.randint(5, 300) * rng.uniform(0.9, 2.2))  # nonce + words, ~1-2 tokens a word
        out.append(([rng.randrange(100, vocab) for _ in range(length)], rng.randint(1, 32)))
    return out


def child(args: argparse.Namespace) -> None:
    import torch

    from kvbridge.config import CacheConfig, EngineConfig, SchedulerConfig
    from kvbridge.engine.setup import native_memory
    from kvbridge.engine.engine import LLMEngine
    from kvbridge.engine.loader import load_model
    from kvbridge.engine.sampling_params import SamplingParams

    trim_s = [0.0]
    real_trim = native_memory._malloc_trim
    if real_trim is not None:
        def timed_trim(pad: int) -> int:
            t = time.perf_counter()
            try:
                return real_trim(pad)
            finally:
                trim_s[0] += time.perf_counter() - t
        native_memory._malloc_trim = timed_trim

    loaded = load_model(args.model)
    engine = LLMEngine(EngineConfig(dtype=args.dtype, num_threads=args.threads,
                                    cache=CacheConfig(kv_cache_memory_bytes=int(args.kv_gb * 2**30),
                                                      enable_prefix_caching=False),
                                    scheduler=SchedulerConfig()), loaded)
    rows: list[int] = []
    execute = engine.runner.execute

    def counted(sched):
        rows.append(sum(len(s.token_ids) for s in sched.scheduled))
        return execute(sched)
    engine.runner.execute = counted

    work = requests(args.seed, args.warmup + args.requests, loaded.arch.vocab_size)
    outputs: dict[str, list[int]] = {}

    def run(batch: list[tuple[list[int], int]], tag: str) -> None:
        queue = list(enumerate(batch))[::-1]
        live = 0
        while queue or live:
            while queue and live < args.concurrency:
                i, (prompt, max_tokens) = queue.pop()
                rid = f"{tag}{i}"
                outputs[rid] = []
                engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
                live += 1
            for out in engine.step().outputs:
                outputs[out.request_id].extend(out.new_token_ids)
                live -= out.finished

    run(work[:args.warmup], "w")
    print(TIMED_MARK, flush=True)  # oneDNN's verbose lines (when on) after it are the timed requests'
    timed_from = len(rows)
    trim_s[0] = 0.0
    trims0 = engine.runner.heap_trimmer.trims
    wall0, cpu0 = time.perf_counter(), time.process_time()
    run(work[args.warmup:], "m")
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    measured = [outputs[f"m{i}"] for i in range(args.requests)]
    tokens = sum(len(o) for o in measured)
    digest = hashlib.sha256(json.dumps([outputs[k] for k in sorted(outputs)]).encode()).hexdigest()[:16]
    with open(f"/proc/{os.getpid()}/status") as f:
        rss = next(float(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS"))
    print(json.dumps({"wall_s": wall, "cpu_s": cpu, "tokens": tokens, "steps": len(rows) - timed_from, "rows": rows,
                      "timed_from": timed_from,
                      "trims": engine.runner.heap_trimmer.trims - trims0, "trim_s": trim_s[0],
                      "rss_mb": rss, "digest": digest, "torch": torch.__version__}))


def lru_misses(rows: list[int], capacity_rows: int, count_from: int = 0) -> int:
    """Misses from step `count_from` on of an LRU cache keyed by row count holding `capacity_rows` row counts."""
    cache: OrderedDict[int, None] = OrderedDict()
    misses = 0
    for i, m in enumerate(rows):
        if m in cache:
            cache.move_to_end(m)
        else:
            misses += i >= count_from
            cache[m] = None
            if len(cache) > capacity_rows:
                cache.popitem(last=False)
    return misses


def count_creations(verbose_stdout: str) -> int:
    """oneDNN primitive creations (cache misses) printed after the child's timed mark."""
    _, _, timed = verbose_stdout.partition(TIMED_MARK)
    return sum(1 for line in timed.splitlines() if line.startswith("onednn_verbose") and "create:cache_miss" in line)


def parse_config(text: str) -> tuple[str, dict[str, str]]:
    if text in NAMED:
        return text, NAMED[text]
    name, _, spec = text.partition("=")
    env = dict(item.split(":", 1) for item in spec.split(",") if item)
    return name, env


def main() -> int:
    argv = sys.argv[1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--config", action="append", default=[],
                   help="off, fix, trim-only, bound-only, or NAME=KEY:VALUE,KEY:VALUE (repeatable; first is the base)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--warmup", type=int, default=150, help="requests before the timed ones")
    p.add_argument("--requests", type=int, default=150, help="timed requests")
    p.add_argument("--kv-gb", type=float, default=0.25)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--nice", type=int, default=5)
    p.add_argument("--json", default=None)
    p.add_argument("--count-creations", action="store_true",
                   help="also one untimed run per config counting oneDNN primitive creations in the timed part")
    args = p.parse_args(argv)
    if args.child:
        child(args)
        return 0
    configs = [parse_config(c) for c in (args.config or ["off", "fix"])]
    base_env = {k: v for k, v in os.environ.items() if k not in CLEARED}
    base_env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    passthrough = ["--model", args.model, "--dtype", args.dtype, "--threads", str(args.threads),
                   "--concurrency", str(args.concurrency), "--warmup", str(args.warmup),
                   "--requests", str(args.requests), "--kv-gb", str(args.kv_gb), "--seed", str(args.seed)]
    results: dict[str, list[dict]] = {name: [] for name, _ in configs}
    for rep in range(args.reps):
        order = configs[rep % len(configs):] + configs[:rep % len(configs)]
        for name, env in order:
            cmd = ["nice", "-n", str(args.nice), sys.executable, os.path.abspath(__file__), "--child", *passthrough]
            t = time.time()
            done = subprocess.run(cmd, env={**base_env, **env}, capture_output=True, text=True, timeout=3600)
            if done.returncode != 0:
                print(done.stderr[-3000:], file=sys.stderr)
                return 1
            r = json.loads(done.stdout.strip().splitlines()[-1])
            r["load"] = os.getloadavg()[0]
            results[name].append(r)
            print(f"rep {rep + 1} {name:11s} {r['tokens'] / r['wall_s']:6.1f} tok/s wall, "
                  f"{r['tokens'] / r['cpu_s']:6.1f} tok/cpu-s, {r['steps']} steps, {r['trims']} trims "
                  f"({1000 * r['trim_s']:.0f} ms), RSS {r['rss_mb']:.0f} MB, load {r['load']:.1f}, "
                  f"{time.time() - t:.0f} s, outputs {r['digest']}", flush=True)
    creations: dict[str, int] = {}
    if args.count_creations:
        for name, env in configs:
            cmd = ["nice", "-n", str(args.nice), sys.executable, os.path.abspath(__file__), "--child", *passthrough]
            done = subprocess.run(cmd, env={**base_env, **env, "ONEDNN_VERBOSE": "profile_create"},
                                  capture_output=True, text=True, timeout=3600)
            if done.returncode != 0:
                print(done.stderr[-3000:], file=sys.stderr)
                return 1
            creations[name] = count_creations(done.stdout)
            print(f"{name:11s} oneDNN primitive creations during the timed requests: {creations[name]}", flush=True)
    base = configs[0][0]
    med = {name: {"wall": statistics.median(r["tokens"] / r["wall_s"] for r in rs),
                  "cpu": statistics.median(r["tokens"] / r["cpu_s"] for r in rs)} for name, rs in results.items()}
    print(f"\nmedians of {args.reps} ({args.dtype}, {args.threads} thread(s)); ratio to {base}:")
    for name, rs in results.items():
        walls = ", ".join(f"{r['tokens'] / r['wall_s']:.1f}" for r in rs)
        print(f"  {name:11s} tok/s {med[name]['wall']:6.1f} ({med[name]['wall'] / med[base]['wall']:.3f}x; reps {walls})  "
              f"tok/cpu-s {med[name]['cpu']:6.1f} ({med[name]['cpu'] / med[base]['cpu']:.3f}x)")
    rows, start = results[base][0]["rows"], results[base][0]["timed_from"]
    # A new row count is 4 primitives in a Llama layer stack (qkv, o, gate_up, down; the head's rows are the
    # batch size): 256 entries hold 64 row counts, 1024 hold 256.
    print(f"  timed steps {len(rows) - start}, distinct row counts {len(set(rows[start:]))}; LRU misses at 64 / 256 "
          f"row counts (256 / 1024 entries): {lru_misses(rows, 64, start)} / {lru_misses(rows, 256, start)}")
    digests = {r["digest"] for rs in results.values() for r in rs}
    print(f"  greedy outputs identical across all runs: {len(digests) == 1}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results, "creations": creations}, f)
    return 0 if len(digests) == 1 else 2


if __name__ == "__main__":
    sys.exit(main())
