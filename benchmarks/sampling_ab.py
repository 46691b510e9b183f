"""Same-run A/B of the sampler before and after issue 48 (logit_bias and min_tokens): decode tokens
per second of the real engine (SmolLM2-135M-Instruct, in process) and the time of one
`Sampler.sample` call, for requests that use neither (the change must cost them nothing) and, with
the new sampler, for requests that use both (what they cost).

The old sampler is a file exported from git, loaded as its own module; the engine's runner takes one
sampler or the other between repetitions (the order alternating), all else shared: the same model,
engine and prompts.

    git show <rev before the change>:kvbridge/engine/sampling.py > /tmp/sampling_old.py
    OMP_WAIT_POLICY=PASSIVE python benchmarks/sampling_ab.py --old /tmp/sampling_old.py --reps 7

Decode rate: each repetition admits --batch requests (random --prompt-tokens-token prompts,
ignore_eos, --max-tokens), steps the engine until all finish and counts the tokens after every
request's first over the time from the step that gave the last first token to the end. Medians.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import importlib.util  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

from kvbridge.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from kvbridge.engine.engine import LLMEngine  # noqa: E402
from kvbridge.engine.loader import load_model  # noqa: E402
from kvbridge.engine.sampling import Sampler  # noqa: E402
from kvbridge.engine.sampling_params import SamplingParams  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"


def old_sampler_class(path: str) -> Any:
    spec = importlib.util.spec_from_file_location("sampling_old", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["sampling_old"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module.Sampler


def decode_rate(engine: LLMEngine, params: SamplingParams, batch: int, prompt_tokens: int, rng: random.Random,
                tag: str) -> float:
    ids = [f"{tag}-{i}-{rng.random()}" for i in range(batch)]
    for rid in ids:
        engine.add_request(rid, [rng.randrange(100, 40000) for _ in range(prompt_tokens)], params)
    started: set[str] = set()
    t0 = 0.0
    tokens = 0
    left = set(ids)
    while left:
        for out in engine.step().outputs:
            if out.request_id not in started and out.new_token_ids:
                started.add(out.request_id)
                if len(started) == batch:
                    t0 = time.perf_counter()
                continue
            if len(started) == batch:
                tokens += len(out.new_token_ids)
            if out.finished:
                left.discard(out.request_id)
    return tokens / (time.perf_counter() - t0)


def sample_ms(sampler: Any, params: list[SamplingParams], rows: int, vocab: int, calls: int) -> float:
    logits = torch.randn(rows, vocab)
    ids = [f"r{i}" for i in range(rows)]
    before = [3] * rows
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        sampler.sample(logits, ids, params, before, [()] * rows)
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", required=True, help="the sampler before the change (sampling.py exported from git)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    OldSampler = old_sampler_class(args.old)
    loaded = load_model(MODEL)
    engine = LLMEngine(EngineConfig(model=MODEL, max_model_len=512, num_threads=args.threads,
                                    cache=CacheConfig(num_blocks=64 + args.batch * 8, enable_prefix_caching=False),
                                    scheduler=SchedulerConfig(max_num_seqs=args.batch)), loaded)
    vocab = loaded.arch.vocab_size
    stops = tuple(sorted(engine.tokenizer.stop_token_ids))
    plain = {"greedy": SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True),
             "sampled": SamplingParams(max_tokens=args.max_tokens, temperature=0.8, ignore_eos=True)}
    used = SamplingParams(max_tokens=args.max_tokens, temperature=0.8, ignore_eos=True, stop_token_ids=stops,
                          min_tokens=args.max_tokens, logit_bias=((42, 1.5), (1000, -2.0)))
    arms = {"old": OldSampler(0), "new": Sampler(0)}
    rng = random.Random(0)
    rates: dict[str, list[float]] = {}
    decode_rate(engine, plain["greedy"], args.batch, args.prompt_tokens, rng, "warm")
    for rep in range(args.reps):
        order = list(arms) if rep % 2 == 0 else list(reversed(arms))
        for kind, params in plain.items():
            for arm in order:
                engine.runner.sampler = arms[arm]
                rates.setdefault(f"{arm} {kind}", []).append(
                    decode_rate(engine, params, args.batch, args.prompt_tokens, rng, arm))
        engine.runner.sampler = arms["new"]
        rates.setdefault("new sampled, logit_bias+min_tokens", []).append(
            decode_rate(engine, used, args.batch, args.prompt_tokens, rng, "used"))
    print(f"decode tok/s, batch {args.batch}, {args.max_tokens} tokens, {args.threads} threads, "
          f"median of {args.reps} (min-max):")
    for name, values in rates.items():
        print(f"  {name:38s} {statistics.median(values):8.1f}  ({min(values):.1f}-{max(values):.1f})")
    print("Sampler.sample, 64 rows x vocab, median of 60 calls (ms):")
    for kind, params in plain.items():
        row = [params] * 64
        times = {arm: [] for arm in arms}
        for _ in range(3):
            for arm, sampler in arms.items():
                times[arm].append(sample_ms(sampler, row, 64, vocab, 20))
        print(f"  {kind:8s} old {statistics.median(times['old']):7.2f}   new {statistics.median(times['new']):7.2f}")
    print(f"  sampled with logit_bias+min_tokens (new) {sample_ms(arms['new'], [used] * 64, 64, vocab, 60):7.2f}")


if __name__ == "__main__":
    main()
