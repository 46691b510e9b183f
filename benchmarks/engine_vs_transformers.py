"""End-to-end benchmark: output tokens/s of kvbridge's LLMEngine vs Hugging Face transformers
`generate` on SmolLM2-135M-Instruct, in one process, same weights (the same GGUF), same threads.

Scenarios (greedy, every request produces exactly --new-tokens tokens):
  1 request      one --prompt-len prompt.
  N concurrent   N different prompts. kvbridge: all added at once, stepped to completion
                 (continuous batching). transformers: one batched `generate` (left padding and
                 an attention mask; the prompts have equal lengths so there is no padding) for
                 the headline ratio, and the same prompts one after another for reference.

Every repetition draws fresh random prompts (so kvbridge's prefix cache cannot help across
repetitions; its hit count is reported) and runs the systems back to back, alternating which
goes first (A B, then B A, ...), so slow drift in background load hits them alike. The
reported ratio is the median over repetitions of kvbridge's tok/s divided by transformers'
tok/s in the same repetition. Times are wall clock from submitting the prompts to the last token.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/engine_vs_transformers.py --json results.json
    .venv/bin/python benchmarks/engine_vs_transformers.py --quick   # smoke run: 16 new tokens, 1 rep
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

# Both must be set before torch (and transformers, which imports it) is first imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from kvbridge.config import EngineConfig, default_num_threads  # noqa: E402
from kvbridge.engine.engine import LLMEngine  # noqa: E402
from kvbridge.engine.loader import DEFAULT_MODEL, load_model, resolve_model  # noqa: E402
from kvbridge.engine.sampling_params import SamplingParams  # noqa: E402

KVBRIDGE = "kvbridge"
HF_BATCHED = "transformers_batched"
HF_SEQUENTIAL = "transformers_sequential"
TARGETS = {1: 1.0, 16: 3.0}  # the issue's targets: ratio vs transformers at 1 and 16 requests
TOKEN_RANGE = (100, 49000)  # prompt token ids: clear of the special tokens at the start of the vocab

Generator = Callable[[list[list[int]], int], list[list[int]]]  # (prompts, new tokens) -> outputs


@dataclass
class Measurement:
    """One system on one scenario: per-repetition wall seconds and output tokens."""

    seconds: list[float] = field(default_factory=list)
    output_tokens: int = 0  # per repetition (the same every time)

    def tok_per_s(self) -> list[float]:
        return [self.output_tokens / s for s in self.seconds]


@dataclass
class ScenarioResult:
    name: str
    num_requests: int
    systems: dict[str, Measurement]
    # Greedy agreement with transformers (informational: fp32 batching noise may flip near-ties).
    identical_outputs: list[int] = field(default_factory=list)  # per repetition, out of num_requests
    prefix_cache_hits: int = 0  # kvbridge cache hits over all repetitions (expected 0: fresh prompts)

    def ratio(self, other: str) -> float | None:
        """Median over repetitions of kvbridge tok/s / `other` tok/s in the same repetition."""
        if other not in self.systems:
            return None
        ours, theirs = self.systems[KVBRIDGE].seconds, self.systems[other].seconds
        return statistics.median(t / o for o, t in zip(ours, theirs))

    def median_tok_per_s(self, system: str) -> float | None:
        m = self.systems.get(system)
        return statistics.median(m.tok_per_s()) if m is not None and m.seconds else None


class KVBridgeRunner:
    """kvbridge: every prompt added at once, then `step()` until all are finished."""

    def __init__(self, threads: int) -> None:
        self.engine = LLMEngine(EngineConfig(num_threads=threads), load_model(DEFAULT_MODEL))
        self._next_id = 0

    def generate(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        ids = []
        for prompt in prompts:
            ids.append(f"bench-{self._next_id}")
            self._next_id += 1
            self.engine.add_request(ids[-1], prompt, params)
        outputs: dict[str, list[int]] = {rid: [] for rid in ids}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step().outputs:
                outputs[out.request_id].extend(out.new_token_ids)
        return [outputs[rid] for rid in ids]

    def prefix_cache_hits(self) -> int:
        return self.engine.metrics().prefix_cache_hits


class HFRunner:
    """transformers: `generate` on the same GGUF, dequantised to fp32 by transformers itself."""

    def __init__(self) -> None:
        from transformers import AutoModelForCausalLM
        path = resolve_model(DEFAULT_MODEL)
        self.model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
        cfg = self.model.generation_config
        self.pad_id = cfg.pad_token_id if cfg.pad_token_id is not None else cfg.eos_token_id

    @torch.inference_mode()
    def generate_batched(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):  # left padding: every prompt ends at the last column
            input_ids[row, width - len(prompt):] = torch.tensor(prompt)
            mask[row, width - len(prompt):] = 1
        # min_new_tokens == max_new_tokens: EOS is masked, so exactly new_tokens come out.
        out = self.model.generate(input_ids=input_ids, attention_mask=mask, do_sample=False,
                                  max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                  pad_token_id=self.pad_id)
        return out[:, width:].tolist()

    def generate_sequential(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        return [self.generate_batched([p], new_tokens)[0] for p in prompts]


def make_prompts(count: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(*TOKEN_RANGE, (count, length), generator=gen).tolist()


def timed(fn: Generator, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    gc.collect()  # so a collection triggered by the previous run is not charged to this one
    start = time.perf_counter()
    outputs = fn(prompts, new_tokens)
    elapsed = time.perf_counter() - start
    bad = [len(o) for o in outputs if len(o) != new_tokens]
    if bad:
        raise RuntimeError(f"expected {new_tokens} output tokens per request, got lengths {bad}")
    return elapsed, outputs


def run_benchmark(args: argparse.Namespace, kv: KVBridgeRunner, hf: HFRunner) -> list[ScenarioResult]:
    systems_by_scenario: list[tuple[str, int, dict[str, Generator]]] = [
        ("1 request", 1, {KVBRIDGE: kv.generate, HF_BATCHED: hf.generate_batched}),
        (f"{args.concurrency} concurrent", args.concurrency,
         {KVBRIDGE: kv.generate, HF_BATCHED: hf.generate_batched}
         | ({} if args.skip_sequential else {HF_SEQUENTIAL: hf.generate_sequential})),
    ]
    results = [ScenarioResult(name, n, {s: Measurement(output_tokens=n * args.new_tokens) for s in systems})
               for name, n, systems in systems_by_scenario]
    bar = tqdm(range(args.reps), desc="repetitions", unit="rep", file=sys.stderr)
    for rep in bar:
        for scen_index, ((name, n, systems), result) in enumerate(zip(systems_by_scenario, results)):
            prompts = make_prompts(n, args.prompt_len, seed=args.seed + 1000 * rep + scen_index)
            order = list(systems) if rep % 2 == 0 else list(reversed(systems))
            hits_before = kv.prefix_cache_hits()
            outputs: dict[str, list[list[int]]] = {}
            for system in order:
                bar.set_postfix_str(f"{name}: {system}")
                elapsed, outputs[system] = timed(systems[system], prompts, args.new_tokens)
                result.systems[system].seconds.append(elapsed)
            result.prefix_cache_hits += kv.prefix_cache_hits() - hits_before
            result.identical_outputs.append(
                sum(a == b for a, b in zip(outputs[KVBRIDGE], outputs[HF_BATCHED])))
    return results


def warm_up(kv: KVBridgeRunner, hf: HFRunner, concurrency: int, prompt_len: int) -> None:
    """One short run of each path, so one-time costs (allocator, thread pool) are not timed."""
    for n in (1, concurrency):
        prompts = make_prompts(n, prompt_len, seed=-1 - n)
        kv.generate(prompts, 4)
        hf.generate_batched(prompts, 4)


def render_table(results: list[ScenarioResult]) -> str:
    def num(x: float | None, fmt: str, suffix: str = "") -> str:
        return "-" if x is None else format(x, fmt) + suffix

    head = (f"{'scenario':<14} {'kvbridge':>9} {'HF batched':>10} {'HF one-by-one':>13} "
            f"{'ratio':>6} {'ratio vs 1-by-1':>15} {'target':>6} {'met':>4} {'same out':>8}")
    lines = ["output tokens/s (median over repetitions); ratio = kvbridge / transformers batched", head,
             "-" * len(head)]
    for r in results:
        ratio, target = r.ratio(HF_BATCHED), TARGETS.get(r.num_requests)
        met = "-" if target is None or ratio is None else ("yes" if ratio >= target else "NO")
        same = f"{min(r.identical_outputs)}/{r.num_requests}" if r.identical_outputs else "-"
        lines.append(
            f"{r.name:<14} {num(r.median_tok_per_s(KVBRIDGE), '.1f'):>9} "
            f"{num(r.median_tok_per_s(HF_BATCHED), '.1f'):>10} {num(r.median_tok_per_s(HF_SEQUENTIAL), '.1f'):>13} "
            f"{num(ratio, '.2f', 'x'):>6} {num(r.ratio(HF_SEQUENTIAL), '.2f', 'x'):>15} "
            f"{num(target, '.1f', 'x'):>6} {met:>4} {same:>8}")
    return "\n".join(lines)


def to_json(args: argparse.Namespace, results: list[ScenarioResult]) -> dict:
    import transformers
    return {
        "benchmark": "engine_vs_transformers",
        "model": DEFAULT_MODEL,
        "model_file": str(resolve_model(DEFAULT_MODEL)),
        "dtype": "float32",
        "device": "cpu",
        "threads": args.threads,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "reps": args.reps,
        "seed": args.seed,
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__},
        "load_average_at_end": list(os.getloadavg()),
        "scenarios": [{
            "name": r.name,
            "num_requests": r.num_requests,
            "systems": {s: {**asdict(m), "tok_per_s": m.tok_per_s(), "median_tok_per_s": r.median_tok_per_s(s)}
                        for s, m in r.systems.items()},
            "ratio_vs_transformers_batched": r.ratio(HF_BATCHED),
            "ratio_vs_transformers_sequential": r.ratio(HF_SEQUENTIAL),
            "target_ratio": TARGETS.get(r.num_requests),
            "target_met": (None if TARGETS.get(r.num_requests) is None
                           else r.ratio(HF_BATCHED) >= TARGETS[r.num_requests]),
            "identical_outputs_vs_transformers_batched": r.identical_outputs,
            "kvbridge_prefix_cache_hits": r.prefix_cache_hits,
        } for r in results],
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=None,
                        help="repetitions, the median is reported; default 3 (1 with --quick)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 16 new tokens and 1 repetition")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=None, help="default 128 (16 with --quick)")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--threads", type=int, default=default_num_threads(), help="torch threads, both systems")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-sequential", action="store_true",
                        help="do not run transformers one request after another (the slowest part)")
    parser.add_argument("--json", type=Path, default=None, help="write the results here as JSON")
    args = parser.parse_args(argv)
    if args.new_tokens is None:
        args.new_tokens = 16 if args.quick else 128
    if args.reps is None:
        args.reps = 1 if args.quick else 3
    if min(args.reps, args.prompt_len, args.new_tokens, args.concurrency, args.threads) < 1:
        parser.error("--reps, --prompt-len, --new-tokens, --concurrency and --threads must be >= 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    kv = KVBridgeRunner(args.threads)  # sets torch's thread count too, to the same value
    hf = HFRunner()
    if torch.get_num_threads() != args.threads:
        raise RuntimeError(f"torch uses {torch.get_num_threads()} threads, expected {args.threads}")
    print(f"{DEFAULT_MODEL} fp32 cpu, {args.threads} threads, prompt {args.prompt_len} tokens, "
          f"{args.new_tokens} new tokens, {args.reps} repetition(s)", flush=True)
    warm_up(kv, hf, args.concurrency, args.prompt_len)
    results = run_benchmark(args, kv, hf)
    print(render_table(results))
    if args.json is not None:
        args.json.write_text(json.dumps(to_json(args, results), indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
