"""Retained answers (--kv-retention-seconds, engine/retention.py): conversations whose next turn comes
after a burst of one-off long prompts, on an engine with retention against the same engine without,
in one process, rounds alternating between the arms, medians.

Each arm is one engine (role both, so it can hold prefixes; its pool sized so that the burst between
two turns cycles every unpinned block through the LRU). Each round: every conversation sends its
next turn (its history, prompt and answers, plus a new message; answered greedily), then the burst
(one-off prompts, one at a time); every request runs on one arm then the other, back to back
(pairs). Measured per next turn: TTFT alone on the engine and the tokens it found cached; per
burst prompt: TTFT (retention must not slow the others: their allocations end retentions before
anything waits). Medians, and the median of the pairs' ratios.

    python benchmarks/kv_retention.py --reps 2 --json /tmp/kv_retention.json
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("UCX_NET_DEVICES", "lo")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402

import torch  # noqa: E402

from kvbridge.config import CacheConfig, EngineConfig, KVRole, KVTransferConfig  # noqa: E402
from kvbridge.engine.engine import LLMEngine  # noqa: E402
from kvbridge.engine.kv_connector_factory import build_connectors  # noqa: E402
from kvbridge.engine.loader import LoadedModel, load_model  # noqa: E402
from kvbridge.engine.pacing import Pacer  # noqa: E402
from kvbridge.engine.sampling_params import SamplingParams  # noqa: E402
from kvbridge.engine.setup.dtype_choice import resolve_dtype  # noqa: E402
from kvbridge.kv_transfer.backends.fake import FakeFabric  # noqa: E402

from kv_tier import cpu_model  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
_seed = iter(range(50_000, 10_000_000))


def tokens(n: int) -> list[int]:
    g = torch.Generator().manual_seed(next(_seed))
    return torch.randint(100, 20000, (n,), generator=g).tolist()


def run_one(engine: LLMEngine, prompt: list[int], max_tokens: int) -> tuple[float, list[int], int]:
    """(TTFT, output tokens, cached prompt tokens) of one request alone on the engine."""
    rid = f"r{next(_seed)}"
    start = time.perf_counter()
    engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    ttft, out, cached, pacer = None, [], 0, Pacer()
    while True:
        step = engine.step()
        for o in step.outputs:
            if o.request_id != rid:
                continue
            if o.new_token_ids and ttft is None:
                ttft = time.perf_counter() - start
            out += o.new_token_ids
            if o.finished:
                cached = o.num_cached_tokens
                assert ttft is not None and o.error is None
                return ttft, out, cached
        pacer.sleep_after(step.next_step)


@dataclass
class Arm:
    name: str
    engine: LLMEngine
    histories: list[list[int]]
    turn_ttft: list[float] = field(default_factory=list)
    turn_cached: list[float] = field(default_factory=list)  # fraction of the history found cached
    burst_ttft: list[float] = field(default_factory=list)


def make_engine(loaded: LoadedModel, dtype: str, num_blocks: int, retention_s: float, fabric: FakeFabric,
                name: str, threads: int) -> LLMEngine:
    kv = KVTransferConfig(role=KVRole.BOTH, backend="fake", engine_id=name, retention_seconds=retention_s)
    config = EngineConfig(model=MODEL, dtype=dtype, num_threads=threads, kv_transfer=kv,
                          cache=CacheConfig(num_blocks=num_blocks))
    return LLMEngine(config, loaded, build_connectors(config, loaded.arch, loaded.name, fabric.create_agent(name)))


def round_of(arms: list[Arm], messages: list[list[int]], answer: int, burst: list[list[int]],
             first_turn: bool) -> None:
    """One turn of every conversation, then the burst; each request on one arm then on the other
    (paired: the machine's load changes little between the two)."""
    for i, message in enumerate(messages):
        for arm in arms:
            prompt = arm.histories[i] + message
            ttft, out, cached = run_one(arm.engine, prompt, answer)
            if not first_turn:
                arm.turn_ttft.append(ttft)
                arm.turn_cached.append(cached / len(arm.histories[i]))
            arm.histories[i] = prompt + out
    for doc in burst:
        for arm in arms:
            arm.burst_ttft.append(run_one(arm.engine, doc, 2)[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--conversations", type=int, default=2)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--first", type=int, default=128, help="tokens of a conversation's first prompt")
    ap.add_argument("--message", type=int, default=48, help="tokens of each later user message")
    ap.add_argument("--answer", type=int, default=32, help="tokens of each answer")
    ap.add_argument("--burst", type=int, default=4, help="one-off prompts between two turns")
    ap.add_argument("--burst-tokens", type=int, default=1100)
    ap.add_argument("--num-blocks", type=int, default=256, help="the pool: blocks of 16 tokens")
    ap.add_argument("--retention-seconds", type=float, default=600.0)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: every core)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    dtype = resolve_dtype(a.dtype, "cpu", MODEL).dtype
    threads = a.threads or len(os.sched_getaffinity(0))
    loaded = load_model(MODEL)
    fabric = FakeFabric(seed=1)
    totals: dict[str, Arm] = {}
    for rep in range(a.reps):
        arms = [Arm(name, make_engine(loaded, dtype, a.num_blocks, s, fabric, f"{name}-{rep}", threads), [])
                for name, s in (("off", 0.0), ("on", a.retention_seconds))]
        if rep % 2:
            arms.reverse()
        firsts = [tokens(a.first) for _ in range(a.conversations)]
        for arm in arms:
            arm.histories = [list(f) for f in firsts]
        for turn in range(a.turns):
            burst = [tokens(a.burst_tokens) for _ in range(a.burst)]
            message = [tokens(a.message) if turn else [] for _ in firsts]
            round_of(arms, message, a.answer, burst, first_turn=turn == 0)  # the same words for both arms
        for arm in arms:
            stats = arm.engine.connectors.worker.stats
            print(f"rep {rep} {arm.name}: lease outcomes {dict(arm.engine.lease_outcomes())}, "
                  f"retentions {stats.retentions}, renewed {stats.retentions_renewed}")
            total = totals.setdefault(arm.name, Arm(arm.name, arm.engine, []))
            total.turn_ttft += arm.turn_ttft
            total.turn_cached += arm.turn_cached
            total.burst_ttft += arm.burst_ttft
            arm.engine.shutdown()
    off, on = totals["off"], totals["on"]
    med = statistics.median
    # every request ran on both arms back to back: the median of the pairs' ratios
    paired_turns = med([b / a for a, b in zip(off.turn_ttft, on.turn_ttft)])
    paired_burst = med([b / a for a, b in zip(off.burst_ttft, on.burst_ttft)])
    result = {
        "cpu": cpu_model(), "dtype": dtype, "threads": threads, "args": vars(a),
        "next_turn_ttft_s": {"off": med(off.turn_ttft), "on": med(on.turn_ttft)},
        "next_turn_ttft_ratio_on_off": med(on.turn_ttft) / med(off.turn_ttft),
        "next_turn_ttft_paired_ratio_on_off": paired_turns,
        "history_cached_fraction": {"off": statistics.mean(off.turn_cached), "on": statistics.mean(on.turn_cached)},
        "burst_ttft_s": {"off": med(off.burst_ttft), "on": med(on.burst_ttft)},
        "burst_ttft_ratio_on_off": med(on.burst_ttft) / med(off.burst_ttft),
        "burst_ttft_paired_ratio_on_off": paired_burst,
        "next_turns": len(on.turn_ttft), "burst_prompts": len(on.burst_ttft),
    }
    print(json.dumps(result, indent=2))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
