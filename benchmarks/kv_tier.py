"""The KV tier below the pool (engine/kv_tier.py, --kv-offloading-size): an engine with it against
the same engine without it, in one process, arms alternating, medians.

1. hit: TTFT of a prompt whose history (1k, 4k, 8k tokens) the pool evicted. With the tier its
   blocks load back from the tier file (page cache) and verify; without it they are recomputed.
   (The tier-off arm forgets its prefix cache instead of running the evicting prompts: the same
   recompute, without their minutes of prefill.)
2. shared: 50 concurrent requests sharing one long prefix (2k tokens, 32 tokens of their own, 16
   generated), after prompts that pushed the prefix out of the pool: TTFT median and p90, and output
   tokens per second of the wave. With the tier the first request loads the prefix once and the
   rest wait for that load (vLLM's report of its offload at 50 requests: -40.7 % throughput, 2x TTFT);
   without it the first computes it and the rest wait for that (the prefix cache's leader).
3. churn: distinct 1k-token prompts, never reused, through full pools: what storing every evicted
   block (64 a prompt) costs when nothing is ever loaded back. Prompt tokens per second, tier on /
   off, arms alternating prompt by prompt (pairs), median of the pairs' ratios.

    python benchmarks/kv_tier.py --reps 3 --json /tmp/kv_tier.json
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from kvbridge.config import CacheConfig, EngineConfig  # noqa: E402
from kvbridge.engine.engine import LLMEngine  # noqa: E402
from kvbridge.engine.loader import load_model  # noqa: E402
from kvbridge.engine.model_runner import kv_bytes_per_block  # noqa: E402
from kvbridge.engine.pacing import Pacer  # noqa: E402
from kvbridge.engine.sampling_params import SamplingParams  # noqa: E402
from kvbridge.engine.setup.dtype_choice import resolve_dtype  # noqa: E402
from kvbridge.shape.dtypes import DTYPES  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
BS = 16
_seed = iter(range(10_000, 1_000_000))


def cpu_model() -> str:
    return next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name")), "unknown CPU")


def tokens(n: int) -> list[int]:
    g = torch.Generator().manual_seed(next(_seed))
    return torch.randint(100, 20000, (n,), generator=g).tolist()


def run_wave(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> tuple[list[float], float, int]:
    """All prompts at once; returns each one's TTFT, the wave's wall time and its output tokens."""
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    ids = [f"w{next(_seed)}" for _ in prompts]
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, p, sp)
    ttft: dict[str, float] = {}
    done, out_tokens, pacer = 0, 0, Pacer()
    while done < len(ids):
        step = engine.step()
        now = time.perf_counter()
        for out in step.outputs:
            if out.new_token_ids and out.request_id not in ttft:
                ttft[out.request_id] = now - start
            out_tokens += len(out.new_token_ids)
            done += out.finished
        pacer.sleep_after(step.next_step)
    return [ttft[r] for r in ids], time.perf_counter() - start, out_tokens


def evict(engine: LLMEngine, n_tokens: int) -> None:
    """Distinct prompts of 1k tokens totalling `n_tokens`, one at a time: whatever the pool held goes."""
    done = 0
    while done < n_tokens:
        run_wave(engine, [tokens(1024)], 1)
        done += 1024


def make(loaded, dtype: str, num_blocks: int, tier_gib: float) -> LLMEngine:
    return LLMEngine(EngineConfig(model=MODEL, dtype=dtype, num_threads=os.cpu_count() or 1, max_model_len=8192,
                                  cache=CacheConfig(block_size=BS, num_blocks=num_blocks,
                                                    kv_offloading_bytes=int(tier_gib * (1 << 30)))), loaded)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--contexts", default="1024,4096,8000")
    ap.add_argument("--parts", default="hit,shared,churn")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--shared-prefix", type=int, default=2048)
    ap.add_argument("--concurrency", type=int, default=50)
    ap.add_argument("--churn-pairs", type=int, default=24)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    loaded = load_model(MODEL)
    dtype = resolve_dtype(a.dtype, "cpu", MODEL).dtype
    contexts = [int(c) for c in a.contexts.split(",")]
    per_block = kv_bytes_per_block(loaded.arch, BS, DTYPES[dtype])
    pool = max(contexts) // BS + 200  # one context and a few more
    tier_gib = 3 * pool * per_block / (1 << 30)
    on, off = make(loaded, dtype, pool, tier_gib), make(loaded, dtype, pool, 0.0)
    print(f"CPU: {cpu_model()}, {os.cpu_count()} cores; {MODEL} {dtype}; pool {pool} blocks "
          f"({pool * per_block / 2**20:.0f} MiB), tier {tier_gib:.2f} GiB; reps {a.reps}", flush=True)
    run_wave(on, [tokens(256)], 2)  # warm both
    run_wave(off, [tokens(256)], 2)
    result: dict = {"cpu": cpu_model(), "dtype": dtype, "hit": {}, "shared": {}, "churn": {}}

    parts = set(a.parts.split(","))
    for ctx in contexts if "hit" in parts else []:
        t_on, t_off = [], []
        for rep in range(a.reps):
            history, turn = tokens(ctx), tokens(16)
            run_wave(on, [history], 1)
            evict(on, pool * BS)
            run_wave(off, [history], 1)
            off.reset_prefix_cache()
            loaded_before = on.kv_tier.counters.loaded_blocks
            for arm in ((0, 1) if rep % 2 == 0 else (1, 0)):
                engine = (on, off)[arm]
                ttft, _, _ = run_wave(engine, [history + turn], 1)
                (t_on, t_off)[arm].append(ttft[0])
            assert on.kv_tier.counters.loaded_blocks - loaded_before == ctx // BS, "the history did not load"
        m_on, m_off = statistics.median(t_on), statistics.median(t_off)
        result["hit"][ctx] = {"on_s": m_on, "off_s": m_off, "speedup": m_off / m_on}
        print(f"hit {ctx:5d} tokens: TTFT tier {m_on * 1e3:8.1f} ms, recompute {m_off * 1e3:8.1f} ms: "
              f"{m_off / m_on:5.1f}x", flush=True)

    rows: dict[str, list] = {"on": [], "off": []}
    for rep in range(a.reps if "shared" in parts else 0):
        prefix = tokens(a.shared_prefix)
        prompts = [prefix + tokens(32) for _ in range(a.concurrency)]
        for name, engine in ((("on", on), ("off", off)) if rep % 2 == 0 else (("off", off), ("on", on))):
            run_wave(engine, [prefix], 1)
            evict(engine, pool * BS)
            ttft, wall, n_out = run_wave(engine, prompts, 16)
            ttft.sort()
            rows[name].append((statistics.median(ttft), ttft[int(0.9 * len(ttft))], n_out / wall))
    for name in ("on", "off") if "shared" in parts else ():
        med = [statistics.median(col) for col in zip(*rows[name])]
        result["shared"][name] = {"ttft_median_s": med[0], "ttft_p90_s": med[1], "output_tok_s": med[2]}
    if "shared" in parts:
        s_on, s_off = result["shared"]["on"], result["shared"]["off"]
        print(f"shared {a.shared_prefix}-token prefix x {a.concurrency}: TTFT median on/off "
              f"{s_on['ttft_median_s'] / s_off['ttft_median_s']:.2f}, p90 "
              f"{s_on['ttft_p90_s'] / s_off['ttft_p90_s']:.2f}, output tok/s on/off "
              f"{s_on['output_tok_s'] / s_off['output_tok_s']:.2f} ({s_on['output_tok_s']:.0f} vs "
              f"{s_off['output_tok_s']:.0f})", flush=True)
    if "churn" in parts:
        churn(on, off, pool, a.churn_pairs, result)
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=2))
    on.shutdown()
    off.shutdown()


def churn(on: LLMEngine, off: LLMEngine, pool: int, n_pairs: int, result: dict) -> None:
    """Part 3 (module docstring), after both pools were filled with cached blocks."""
    evict(on, pool * BS)
    evict(off, pool * BS)
    stores = on.kv_tier.counters.stores
    pairs = []
    for i in range(n_pairs):
        arms = ((on, off) if i % 2 == 0 else (off, on))
        rate = {}
        for engine in arms:
            prompt = tokens(1024)
            start = time.perf_counter()
            run_wave(engine, [prompt], 1)
            rate[engine is on] = 1024 / (time.perf_counter() - start)
        pairs.append(rate[True] / rate[False])
    ratio = statistics.median(pairs)
    result["churn"] = {"ratio_median": ratio, "pairs": pairs, "stores": on.kv_tier.counters.stores,
                       "store_drops": on.kv_tier.counters.store_drops}
    q = statistics.quantiles(pairs, n=4)
    print(f"churn (distinct 1k prompts, every eviction stored: {on.kv_tier.counters.stores - stores} stores): "
          f"prompt tok/s on/off, median of {len(pairs)} pairs {ratio:.3f} (quartiles {q[0]:.3f}-{q[2]:.3f}); "
          f"tier counters {on.kv_tier.counters}", flush=True)


if __name__ == "__main__":
    main()
