"""KV-aware routing and per-request P/D against the other policies, same run: goodput and TTFT on
a mixed trace of multi-turn conversations, short chats and long documents.

Set-up, all on 127.0.0.1: one LocalCluster of `--prefill` P and `--decode` D `kvbridge serve`
(nixl, 1 torch thread each, KV events on) and one `kvbridge proxy` per policy in front of the
same instances:
* always: round-robin P and D, every request through P (kvbridge's default);
* never: round-robin D alone (no P);
* static: kv_aware P and D, Dynamo's rule (D alone when what it lacks is under 2048 tokens and
  under 0.7 of the prompt);
* prefix: the prompt-text prefix policy for P and D, every request through P;
* auto: kv_aware P and D, --pd-mode auto (measured costs).
Each policy's requests carry their own random words (no policy's traffic warms another's cache).

Trace, in rounds: each round sends every policy, one policy after the other (the order rotating),
a batch at once: `--conversations` conversations advancing one turn each (a short user message
of ~20 tokens appended to the history, answered in `--max-tokens`), one long document (~400
tokens) and two short chats (~30 tokens); a conversation runs `--turns` turns, then a new one
starts. Every request is a streaming greedy chat completion. TTFT: from sending to the first
chunk with text; ITL: the gaps between later chunks, its p90 per request. Goodput: the share of
requests with TTFT <= `--ttft-slo` and ITL p90 <= `--itl-slo` (state them with the figures).

    python benchmarks/kv_aware_routing.py --rounds 10 --json /tmp/kv_aware_routing.json
"""

from __future__ import annotations

import os

os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("UCX_MODULES", "^ib")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

import argparse  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import httpx  # noqa: E402

from kvbridge.launcher import cluster  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # fleet_proxies, also under `kvbridge bench`
from fleet_proxies import cpu_name, start_proxy  # noqa: E402

POLICIES = {
    "always": ["--prefill-policy", "round_robin", "--decode-policy", "round_robin", "--pd-mode", "always"],
    "never": ["--prefill-policy", "round_robin", "--decode-policy", "round_robin", "--pd-mode", "never"],
    "static": ["--prefill-policy", "kv_aware", "--decode-policy", "kv_aware", "--pd-mode", "static"],
    "prefix": ["--prefill-policy", "prefix", "--decode-policy", "prefix", "--pd-mode", "always"],
    "auto": ["--prefill-policy", "kv_aware", "--decode-policy", "kv_aware", "--pd-mode", "auto"],
}
WORDS = ("harbour ledger cargo invoice route vessel tariff customs pallet manifest carrier freight berth "
         "container crane depot schedule delay weather insurance claim parcel address refund river "
         "mountain season orchard lantern copper violet meadow").split()


def words(rng: random.Random, tokens: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(tokens * 3 // 4)) + "."


@dataclass
class Sample:
    policy: str
    kind: str  # turn1 | turnN | doc | chat
    ttft_s: float
    itl_p90_s: float
    path: str
    reason: str


def stream(http: httpx.Client, url: str, model: str, messages: list[dict], max_tokens: int) -> tuple[Sample, str]:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    times, text = [], []
    started = time.perf_counter()
    with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        path, reason = r.headers.get("x-kvbridge-pd-path", ""), r.headers.get("x-kvbridge-pd-reason", "")
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[len("data: "):])
            delta = event["choices"][0]["delta"].get("content") if event.get("choices") else None
            if delta:
                times.append(time.perf_counter())
                text.append(delta)
    gaps = sorted(b - a for a, b in zip(times, times[1:])) or [0.0]
    p90 = gaps[min(len(gaps) - 1, int(0.9 * len(gaps)))]
    return Sample("", "", times[0] - started if times else float("inf"), p90, path, reason), "".join(text)


class Traffic:
    """One policy's conversations and its own random words."""

    def __init__(self, policy: str, seed: int, conversations: int, turns: int) -> None:
        self.policy, self.rng, self.turns = policy, random.Random(f"{policy}-{seed}"), turns
        self.histories: list[list[dict]] = [[] for _ in range(conversations)]

    def batch(self) -> list[tuple[str, list[dict], int]]:
        """(kind, messages, conversation index or -1) for one round."""
        out = []
        for i, history in enumerate(self.histories):
            if len(history) >= 2 * self.turns:
                history.clear()
            kind = "turn1" if not history else "turnN"
            out.append((kind, [*history, {"role": "user", "content": words(self.rng, 20)}], i))
        out.append(("doc", [{"role": "user", "content": "Summarise: " + words(self.rng, 400)}], -1))
        out += [("chat", [{"role": "user", "content": words(self.rng, 30)}], -1) for _ in range(2)]
        return out


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--prefill", type=int, default=2)
    ap.add_argument("--decode", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--conversations", type=int, default=3)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--ttft-slo", type=float, default=2.0, help="seconds")
    ap.add_argument("--itl-slo", type=float, default=0.25, help="seconds")
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    log_dir = Path(tempfile.mkdtemp(prefix="kvbridge-kv-routing-"))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    fleet = cluster.LocalCluster(args.model, args.prefill, args.decode, port=0, kv_backend="nixl", num_threads=1,
                                 extra_serve_args=["--dtype", "float32", "--num-blocks", "512", "--max-model-len",
                                                   "2048", "--log-level", "warning"],
                                 log_dir=log_dir, ready_timeout_s=600)
    proxies: list[cluster.ChildProcess] = []
    http = httpx.Client(timeout=600, trust_env=False)
    samples: list[Sample] = []
    try:
        urls = fleet.start()
        proxy_urls = {}
        for policy in args.policies:
            child, proxy_urls[policy] = start_proxy(f"proxy-{policy}", urls,
                                                    [*POLICIES[policy], "--health-interval", "0.5"], log_dir, http)
            proxies.append(child)
        traffic = {p: Traffic(p, args.seed, args.conversations, args.turns) for p in args.policies}
        for p in args.policies:  # warm-up: one untimed chat per policy (rates get measured)
            stream(http, proxy_urls[p], args.model, [{"role": "user", "content": words(traffic[p].rng, 30)}], 4)
        order = list(args.policies)
        with ThreadPoolExecutor(max_workers=16) as pool:
            for rnd in range(args.rounds):
                for policy in order[rnd % len(order):] + order[:rnd % len(order)]:
                    batch = traffic[policy].batch()
                    futures = [pool.submit(stream, http, proxy_urls[policy], args.model, msgs, args.max_tokens)
                               for _, msgs, _ in batch]
                    for (kind, msgs, conv), future in zip(batch, futures):
                        sample, answer = future.result()
                        sample.policy, sample.kind = policy, kind
                        samples.append(sample)
                        if conv >= 0:
                            traffic[policy].histories[conv][:] = [*msgs, {"role": "assistant", "content": answer}]
                print(f"round {rnd + 1}/{args.rounds} done", file=sys.stderr)
    finally:
        http.close()
        cluster.stop_children(proxies, 10.0)
        fleet.stop()
    cpu = cpu_name()
    print(f"\n{cpu}, {args.prefill}P{args.decode}D, {args.rounds} rounds; goodput: TTFT <= {args.ttft_slo} s "
          f"and ITL p90 <= {args.itl_slo} s")
    print(f"{'policy':<8} {'n':>4} {'goodput':>8} {'TTFT p50':>9} {'p90':>7} {'turnN p50':>10} {'ITL p90':>8}  paths")
    summary = {}
    for policy in args.policies:
        mine = [s for s in samples if s.policy == policy]
        good = sum(s.ttft_s <= args.ttft_slo and s.itl_p90_s <= args.itl_slo for s in mine) / len(mine)
        ttft = [s.ttft_s for s in mine]
        later = [s.ttft_s for s in mine if s.kind == "turnN"]
        paths: dict[str, int] = {}
        for s in mine:
            paths[f"{s.path}/{s.reason}"] = paths.get(f"{s.path}/{s.reason}", 0) + 1
        summary[policy] = {"n": len(mine), "goodput": good, "ttft_p50": statistics.median(ttft),
                           "ttft_p90": pct(ttft, 0.9), "turn_n_ttft_p50": statistics.median(later) if later else None,
                           "itl_p90": pct([s.itl_p90_s for s in mine], 0.9), "paths": paths}
        print(f"{policy:<8} {len(mine):>4} {good:>8.2f} {statistics.median(ttft):>9.3f} {pct(ttft, 0.9):>7.3f} "
              f"{summary[policy]['turn_n_ttft_p50'] or float('nan'):>10.3f} {summary[policy]['itl_p90']:>8.3f}  "
              + ", ".join(f"{k} {v}" for k, v in sorted(paths.items())))
    best_other = max((summary[p]["goodput"] for p in args.policies if p != "auto"), default=None)
    if "auto" in summary and best_other:
        print(f"auto / best other goodput: {summary['auto']['goodput'] / best_other:.2f}")
    print("goodput at other targets (TTFT s, ITL p90 s), same samples:")
    for ttft_slo, itl_slo in ((1.0, 0.15), (0.8, 0.15), (0.6, 0.2), (1.0, 0.12)):
        shares = {p: sum(s.ttft_s <= ttft_slo and s.itl_p90_s <= itl_slo for s in samples if s.policy == p)
                  / max(1, sum(s.policy == p for s in samples)) for p in args.policies}
        print(f"  {ttft_slo:>4} {itl_slo:>5}  " + "  ".join(f"{p} {g:.2f}" for p, g in shares.items()))
    print("TTFT p50 by kind: " + "; ".join(
        f"{p}: " + ", ".join(f"{k} {statistics.median(v):.3f}" for k in ("turn1", "turnN", "doc", "chat")
                             if (v := [s.ttft_s for s in samples if s.policy == p and s.kind == k]))
        for p in args.policies))
    if args.json is not None:
        args.json.write_text(json.dumps({"config": {k: str(v) for k, v in vars(args).items()}, "summary": summary,
                                         "samples": [s.__dict__ for s in samples]}, indent=2))
    print(f"logs: {log_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
