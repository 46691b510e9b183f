"""Benchmark: decode step time at tensor-parallel size N vs 1, and where a TP step's time goes.

Drives `LLMEngine` directly (no HTTP), fp32 on CPU, greedy, in one process:

  synthetic  a random-weight Llama shaped like SmolLM2-135M (hidden 576, 30 layers, MLP 1536,
             vocab 49152, tied embeddings) but with 8 query heads of 72 and 4 KV heads, so TP 2
             can split it; written as a Hugging Face folder (config.json + model.safetensors +
             SmolLM2's tokenizer) in a temp dir. TP 1 vs TP 2.
  smollm2    SmolLM2-135M-Instruct itself (9 heads, 3 KV heads: its split is TP 3). TP 1 vs TP 3;
             on a 2-core machine that is 3 rank processes on 2 cores. `--skip-smollm2` leaves it out.

A measurement: `batch` fresh random `--prompt-len`-token prompts added at once, stepped until
every request has its first token (prefill), `--warmup-steps` decode steps, then
`--steps` timed decode steps (`engine.step()`, every request decoding one token), then the
requests are aborted. The TP 1 engine and the TP N engine live side by side (only one TP engine
may live in a process: torch.distributed has one default group), and every repetition runs both
at each batch size back to back, alternating which goes first. Per repetition: the median step
time of each; ratio = TP N / TP 1 of the same repetition; reported: medians over repetitions.

For TP N the engine's `TPExecutor.step_profile()` splits a step: the engine's own work
(scheduling, output processing: the step minus the round), the round (broadcast of the
scheduler output, the ranks' `runner.execute`, gather), each rank's compute (execute minus
its time inside all_reduce) and all_reduce time (transport and waiting for the slower peer),
and broadcast+gather overhead (the round minus the slowest rank's execute). For scale, after
each pair N bare processes (one thread each, nothing else to do) time gloo all_reduces of
the same shape (`floor/call`: their median per call; what the transport alone costs here).

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/tp_step.py --reps 3
    kvbridge bench tp_step --quick          # 1 repetition, 8 timed steps
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

# Before torch is first imported (the rank processes inherit the environment).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from kvbridge.config import CacheConfig, EngineConfig, default_num_threads  # noqa: E402
from kvbridge.engine.engine import LLMEngine  # noqa: E402
from kvbridge.engine.loader import DEFAULT_MODEL, LoadedModel, load_model  # noqa: E402
from kvbridge.engine.loader.synthetic import SMOLLM2_SHAPED_4_KV_HEADS, write_synthetic_folder  # noqa: E402
from kvbridge.engine.sampling_params import SamplingParams  # noqa: E402
from kvbridge.engine.tp.executor import TPExecutor, TPStepProfile  # noqa: E402

BLOCK_SIZE = 16
TOKEN_RANGE = (100, 49000)  # prompt token ids: clear of the special tokens at the start of the vocab


def _floor_rank(rank: int, world: int, store: str, rows: list[int], width: int, calls: int, queue) -> None:
    """A bare process of the all_reduce floor: gloo all_reduces of [rows, width] fp32, timed."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    medians = {}
    for r in rows:
        t = torch.randn(r, width)
        for _ in range(20):
            dist.all_reduce(t)
        times = []
        for _ in range(calls):
            t0 = time.perf_counter()
            dist.all_reduce(t)
            times.append(time.perf_counter() - t0)
        medians[r] = statistics.median(times)
    if rank == 0:
        queue.put(medians)
    dist.destroy_process_group()


def all_reduce_floor(world: int, rows: list[int], width: int, calls: int = 300) -> dict[int, float]:
    """Median seconds of one gloo all_reduce of [rows, width] between `world` bare processes."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="kvbridge-tp-floor-") as tmp:
        procs = [ctx.Process(target=_floor_rank, args=(r, world, f"{tmp}/store", rows, width, calls, queue))
                 for r in range(world)]
        for proc in procs:
            proc.start()
        medians = queue.get(timeout=300)
        for proc in procs:
            proc.join(timeout=30)
    return medians


@dataclass
class Sample:
    """One repetition of one engine at one batch size."""

    step_s: list[float]  # engine.step() per timed decode step
    profile: TPStepProfile | None = None  # TP > 1 only

    @property
    def median_s(self) -> float:
        return statistics.median(self.step_s)

    @property
    def engine_own_s(self) -> float:
        """Median over steps of the step minus its TP round: the engine process's own work."""
        assert self.profile is not None and len(self.profile.steps) == len(self.step_s)
        return statistics.median(t - st.wall_s for t, st in zip(self.step_s, self.profile.steps))


@dataclass
class Scenario:
    model: str
    tp: int
    batch: int
    threads_per_rank: int
    floor_s: float = 0.0  # one bare gloo all_reduce of this step's shape between tp processes
    tp1: list[Sample] = field(default_factory=list)
    tpn: list[Sample] = field(default_factory=list)

    def tp1_ms(self) -> float:
        return 1e3 * statistics.median(s.median_s for s in self.tp1)

    def tpn_ms(self) -> float:
        return 1e3 * statistics.median(s.median_s for s in self.tpn)

    def ratio(self) -> float:
        return statistics.median(n.median_s / o.median_s for o, n in zip(self.tp1, self.tpn))

    def breakdown_ms(self) -> dict[str, float | list[float]]:
        """Medians over repetitions of each repetition's medians over steps, ms."""
        profiles = [s.profile for s in self.tpn if s.profile is not None]

        def med(values: list[float]) -> float:
            return 1e3 * statistics.median(values)

        def per_rank(get) -> list[float]:
            return [med([get(p)[r] for p in profiles]) for r in range(self.tp)]

        calls = statistics.median(st.all_reduce_calls for p in profiles for st in p.steps)
        return {
            "step": self.tpn_ms(),
            "engine_own": med([s.engine_own_s for s in self.tpn]),
            "round": med([p.wall_s for p in profiles]),
            "rank_execute": per_rank(lambda p: p.execute_s),
            "rank_compute": per_rank(lambda p: p.compute_s),
            "rank_all_reduce": per_rank(lambda p: p.all_reduce_s),
            "all_reduce_calls": calls,
            "floor_per_call": 1e3 * self.floor_s,
            "broadcast_gather": med([p.overhead_s for p in profiles]),
        }


class Bench:
    def __init__(self, engine: LLMEngine, seed: int) -> None:
        self.engine = engine
        self.rng = random.Random(seed)
        self.next_id = 0

    def measure(self, batch: int, prompt_len: int, warmup: int, steps: int) -> Sample:
        engine = self.engine
        params = SamplingParams(max_tokens=warmup + steps + 8, temperature=0.0, ignore_eos=True)
        ids = []
        for _ in range(batch):
            ids.append(f"tp-bench-{self.next_id}")
            self.next_id += 1
            engine.add_request(ids[-1], [self.rng.randrange(*TOKEN_RANGE) for _ in range(prompt_len)], params)
        started: set[str] = set()
        while len(started) < batch:  # prefill (chunked if the prompts exceed a step's budget)
            started.update(o.request_id for o in engine.step().outputs if o.new_token_ids)
        for _ in range(warmup):
            engine.step()
        executor = engine.runner if isinstance(engine.runner, TPExecutor) else None
        if executor is not None:
            executor.reset_step_profile()
        gc.collect()
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            outs = engine.step().outputs
            times.append(time.perf_counter() - t0)
            if sum(len(o.new_token_ids) for o in outs) != batch:
                raise RuntimeError(f"a timed step produced {sum(len(o.new_token_ids) for o in outs)} tokens, "
                                   f"expected {batch} (one per request)")
        profile = executor.step_profile() if executor is not None else None
        for rid in ids:
            engine.abort_request(rid)
        while engine.has_unfinished_requests():
            engine.step()
        engine.step()  # hands the aborted ids to the runner(s)
        return Sample(times, profile)


def make_engine(model: str, loaded: LoadedModel, tp: int, threads: int, num_blocks: int,
                cpu_bind: str = "auto") -> LLMEngine:
    config = EngineConfig(model=model, device="cpu", num_threads=threads, tensor_parallel_size=tp,
                          cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks),
                          cpu_bind=cpu_bind)
    return LLMEngine(config, loaded)


def run_pair(label: str, model: str, loaded: LoadedModel, tp: int, args: argparse.Namespace) -> list[Scenario]:
    """TP 1 and TP `tp` engines of one model, interleaved repetitions at every batch size."""
    per_seq = -(-(args.prompt_len + args.warmup_steps + args.steps + 8) // BLOCK_SIZE)
    num_blocks = max(args.batches) * per_seq + 16
    print(f"[{label}] starting TP 1 and TP {tp} engines", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    tp1 = make_engine(model, loaded, 1, args.threads, num_blocks)
    tpn = make_engine(model, loaded, tp, args.threads, num_blocks, args.cpu_bind)
    print(f"[{label}] started in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    try:
        benches = {1: Bench(tp1, args.seed), tp: Bench(tpn, args.seed + 1)}
        scenarios = [Scenario(label, tp, b, max(1, args.threads // tp)) for b in args.batches]
        for scen in scenarios:  # warm-up: one short untimed round of each engine at each batch size
            for bench in benches.values():
                bench.measure(scen.batch, args.prompt_len, 1, 2)
        for rep in range(args.reps):
            for scen in scenarios:
                order = [1, tp] if rep % 2 == 0 else [tp, 1]
                for size in order:
                    sample = benches[size].measure(scen.batch, args.prompt_len, args.warmup_steps, args.steps)
                    (scen.tp1 if size == 1 else scen.tpn).append(sample)
                print(f"[{label}] rep {rep + 1}/{args.reps} batch {scen.batch}: TP 1 "
                      f"{scen.tp1[-1].median_s * 1e3:.1f} ms, TP {tp} {scen.tpn[-1].median_s * 1e3:.1f} ms",
                      file=sys.stderr, flush=True)
    finally:
        tpn.shutdown()  # before any other TP engine starts in this process
        tp1.shutdown()
    floor = all_reduce_floor(tp, args.batches, loaded.arch.hidden_size)
    for scen in scenarios:
        scen.floor_s = floor[scen.batch]
    return scenarios


def render(scenarios: list[Scenario], args: argparse.Namespace) -> str:
    def ranks(values: list[float]) -> str:
        return " / ".join(f"{v:.1f}" for v in values)

    lines = [f"decode step time (engine.step), ms: median over {args.reps} repetition(s) of each one's median "
             f"over {args.steps} steps; ratio = TP N / TP 1 in the same repetition",
             f"{'model':<10} {'batch':>5} {'TP N':>4} {'thr/rank':>8} {'TP 1 ms':>8} {'TP N ms':>8} {'ratio':>6}"]
    lines.append("-" * len(lines[-1]))
    for s in scenarios:
        lines.append(f"{s.model:<10} {s.batch:>5} {s.tp:>4} {s.threads_per_rank:>8} {s.tp1_ms():>8.1f} "
                     f"{s.tpn_ms():>8.1f} {s.ratio():>5.2f}x")
    lines += ["", "where a TP N step goes, ms (medians; per rank: rank 0 / rank 1 / ...; rank 0 also "
              "computes the logits and samples)",
              f"{'model':<10} {'batch':>5} {'TP N':>4} {'step':>6} {'engine':>6} {'round':>6} "
              f"{'rank compute':>20} {'rank all_reduce':>20} {'calls':>5} {'floor/call':>10} {'bcast+gather':>12}"]
    lines.append("-" * len(lines[-1]))
    for s in scenarios:
        b = s.breakdown_ms()
        lines.append(f"{s.model:<10} {s.batch:>5} {s.tp:>4} {b['step']:>6.1f} {b['engine_own']:>6.1f} "
                     f"{b['round']:>6.1f} {ranks(b['rank_compute']):>20} {ranks(b['rank_all_reduce']):>20} "
                     f"{b['all_reduce_calls']:>5.0f} {b['floor_per_call']:>10.2f} {b['broadcast_gather']:>12.1f}")
    lines += ["engine = the step minus the round (scheduling, output processing; TP 1 does it too); "
              "round = broadcast + the slowest rank's execute + gather;",
              "rank all_reduce includes waiting for the slower peer; floor/call = one all_reduce of the same shape "
              "between N bare processes;",
              "bcast+gather = round - slowest rank's execute"]
    return "\n".join(lines)


def to_json(scenarios: list[Scenario], args: argparse.Namespace) -> dict:
    return {
        "benchmark": "tp_step",
        "args": {k: v for k, v in vars(args).items() if k != "json"},
        "synthetic_config": SMOLLM2_SHAPED_4_KV_HEADS,
        "versions": {"python": platform.python_version(), "torch": torch.__version__},
        "cpus": len(os.sched_getaffinity(0)),
        "load_average_at_end": list(os.getloadavg()),
        "scenarios": [{
            "model": s.model, "tp": s.tp, "batch": s.batch, "threads_per_rank": s.threads_per_rank,
            "tp1_ms": s.tp1_ms(), "tpn_ms": s.tpn_ms(), "ratio": s.ratio(), "breakdown_ms": s.breakdown_ms(),
            "tp1_step_s": [x.step_s for x in s.tp1], "tpn_step_s": [x.step_s for x in s.tpn],
            "tpn_profiles": [[asdict(st) for st in x.profile.steps] for x in s.tpn if x.profile is not None],
        } for s in scenarios],
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=None, help="repetitions; default 3 (1 with --quick)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 repetition, 8 timed steps")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=None, help="timed decode steps per measurement; default 16")
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=default_num_threads(),
                        help="torch threads of the TP 1 engine; each of N ranks gets threads // N (at least 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cpu-bind", default="auto", help="the TP N engine's --cpu-bind (default: %(default)s)")
    parser.add_argument("--skip-smollm2", action="store_true", help="leave out SmolLM2-135M at TP 3")
    parser.add_argument("--json", type=Path, default=None, help="write the results here as JSON")
    args = parser.parse_args(argv)
    if args.reps is None:
        args.reps = 1 if args.quick else 3
    if args.steps is None:
        args.steps = 8 if args.quick else 16
    if min(args.reps, args.prompt_len, args.steps, args.threads, *args.batches) < 1 or args.warmup_steps < 0:
        parser.error("--reps, --prompt-len, --steps, --threads and --batches must be >= 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    default = load_model(DEFAULT_MODEL)
    print(f"fp32 cpu, {len(os.sched_getaffinity(0))} cpus, {args.threads} torch threads at TP 1, "
          f"prompts of {args.prompt_len} tokens, {args.warmup_steps} + {args.steps} decode steps, "
          f"{args.reps} repetition(s), TP N --cpu-bind {args.cpu_bind}", flush=True)
    scenarios: list[Scenario] = []
    with tempfile.TemporaryDirectory(prefix="kvbridge-tp-step-") as tmp:
        folder = Path(tmp) / "smollm2-shaped-8h4kv"
        write_synthetic_folder(folder, default.tokenizer, **SMOLLM2_SHAPED_4_KV_HEADS)
        synthetic = load_model(str(folder))
        scenarios += run_pair("synthetic", str(folder), synthetic, 2, args)
        del synthetic
        gc.collect()
    if not args.skip_smollm2:
        scenarios += run_pair("smollm2", DEFAULT_MODEL, default, 3, args)
    print(render(scenarios, args))
    if args.json is not None:
        args.json.write_text(json.dumps(to_json(scenarios, args), indent=2) + "\n")
        print(f"wrote {args.json}")
    print("command: OMP_WAIT_POLICY=PASSIVE python benchmarks/tp_step.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
