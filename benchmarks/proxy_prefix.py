"""Prefix-aware prefill routing vs round-robin: TTFT through the proxy on shared-prefix
traffic (and on traffic without shared prefixes), same run.

Set-up, all on 127.0.0.1: two identical local clusters (2 prefill + 1 decode `kvbridge serve`,
NIXL, 1 torch thread each), one proxy with `--prefill-policy prefix` in front of the first
and one with `round_robin` in front of the second (separate instances, so one policy's traffic
never warms the other's prefix caches). Each P's KV cache holds `--p-blocks` blocks of 16
tokens: fewer than every system prompt takes, about what half of them take.

Workloads (multi-turn chat style): `shared`: many requests, each a random one of
`--system-prompts` long system prompts (~`--system-tokens` tokens of text) plus a short
random user turn; `unique`: the same lengths with no shared part. Each request goes to both
set-ups one after the other in alternating order (ABBA). TTFT is measured by the client (a
streaming /v1/completions, greedy, max_tokens=2, to the first chunk with text). Figures:
p50 and p90 TTFT per policy and the ratio prefix / round-robin of the p50s, and each set-up's
prefill-side prefix-cache hit rate over the run (the Ps' kvbridge_prefix_cache_hits /
queries). Two untimed warm-up requests per set-up.

    python benchmarks/proxy_prefix.py --requests 48 --json /tmp/proxy_prefix.json
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
from pathlib import Path  # noqa: E402

import httpx  # noqa: E402

from pd_ttft import READY_TIMEOUT_S, REQUEST_TIMEOUT_S, metric  # noqa: E402  (this folder is on sys.path)
from kvbridge.launcher import cluster  # noqa: E402

POLICIES = ("prefix", "round_robin")
WORDS = ("harbour ledger cargo invoice route vessel tariff customs pallet manifest carrier freight berth "
         "container crane depot schedule delay weather insurance claim parcel address refund").split()


def text(rng: random.Random, tokens: int) -> str:
    """About `tokens` tokens of plain words (one word is roughly one to two tokens)."""
    return " ".join(rng.choice(WORDS) for _ in range(tokens * 3 // 4)) + "."


class Setup:
    """One cluster (2 P + 1 D) and a proxy of one policy in front of it."""

    def __init__(self, policy: str, model: str, p_blocks: int, log_dir: Path, http: httpx.Client) -> None:
        self.policy, self.http = policy, http
        self.cluster = cluster.LocalCluster(
            model, 2, 1, port=0, kv_backend="nixl", ready_timeout_s=READY_TIMEOUT_S, log_dir=log_dir / policy,
            num_threads=1, extra_serve_args=["--num-blocks", str(p_blocks), "--log-level", "warning"])
        self.proxy_child: cluster.ChildProcess | None = None
        self.url = ""

    def start(self) -> None:
        urls = self.cluster.start()
        self.prefills = list(urls.prefill)
        port = cluster.free_ports(1)[0]
        argv = [*cluster.DEFAULT_CLI, "proxy", "--prefill", *urls.prefill, "--decode", *urls.decode,
                "--prefill-policy", self.policy, "--host", "127.0.0.1", "--port", str(port)]
        env = cluster.child_env(os.environ, loopback_only=True, num_threads=1)
        self.proxy_child = cluster.spawn_child(f"proxy-{self.policy}", argv, env, self.cluster.log_dir)
        self.url = cluster.http_url("127.0.0.1", port)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            try:
                if self.http.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or not self.proxy_child.alive():
                raise RuntimeError(f"proxy {self.policy} not healthy:\n{self.proxy_child.tail()}")
            time.sleep(0.2)

    def ttft(self, model: str, prompt: str) -> float:
        body = {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0.0, "stream": True}
        started, first = time.perf_counter(), None
        with self.http.stream("POST", self.url + "/v1/completions", json=body) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if first is None and line.startswith("data: {"):
                    event = json.loads(line[len("data: "):])
                    if "error" in event:
                        raise RuntimeError(f"{self.policy}: the stream failed: {event['error']}")
                    if event["choices"] and event["choices"][0].get("text"):
                        first = time.perf_counter() - started
        if first is None:
            raise RuntimeError(f"{self.policy}: the stream had no text")
        return first

    def hit_rate(self) -> tuple[float, float]:
        """(prefix-cache hits, queries) summed over the Ps."""
        hits = sum(metric(self.http, u, "kvbridge_prefix_cache_hits_total") for u in self.prefills)
        queries = sum(metric(self.http, u, "kvbridge_prefix_cache_queries_total") for u in self.prefills)
        return hits, queries

    def stop(self) -> None:
        if self.proxy_child is not None:
            cluster.stop_children([self.proxy_child], grace_s=5.0)
        self.cluster.stop()


def workload(kind: str, args: argparse.Namespace, rng: random.Random) -> list[str]:
    systems = [f"System prompt {i}: " + text(rng, args.system_tokens) for i in range(args.system_prompts)]
    out = []
    for i in range(args.requests):
        user = f" User {i}: " + text(rng, 24)
        if kind == "shared":
            out.append(rng.choice(systems) + user)
        else:
            out.append(f"Unique {i}: " + text(rng, args.system_tokens) + user)
    return out


def run_workload(kind: str, setups: dict[str, Setup], args: argparse.Namespace, model: str) -> dict:
    rng = random.Random(f"{args.seed}-{kind}")
    prompts = workload(kind, args, rng)
    before = {p: s.hit_rate() for p, s in setups.items()}
    ttfts: dict[str, list[float]] = {p: [] for p in POLICIES}
    for i, prompt in enumerate(prompts):
        order = POLICIES if i % 4 in (0, 3) else POLICIES[::-1]  # ABBA
        for policy in order:
            ttfts[policy].append(setups[policy].ttft(model, prompt))
        print(f"\r{kind}: {i + 1}/{len(prompts)}", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    out = {}
    for policy, s in setups.items():
        hits, queries = (a - b for a, b in zip(s.hit_rate(), before[policy]))
        xs = sorted(ttfts[policy])
        out[policy] = {"p50_ms": statistics.median(xs) * 1e3, "p90_ms": xs[int(0.9 * (len(xs) - 1))] * 1e3,
                       "prefill_hit_rate": hits / queries if queries else 0.0}
    out["ratio_p50"] = out["prefix"]["p50_ms"] / out["round_robin"]["p50_ms"]
    out["ratio_p90"] = out["prefix"]["p90_ms"] / out["round_robin"]["p90_ms"]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--requests", type=int, default=48, help="requests per workload")
    ap.add_argument("--system-prompts", type=int, default=8)
    ap.add_argument("--system-tokens", type=int, default=768)
    ap.add_argument("--p-blocks", type=int, default=320, help="KV blocks (of 16 tokens) per instance")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    log_dir = Path(tempfile.mkdtemp(prefix="kvbridge-proxy-prefix-"))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    http = httpx.Client(timeout=REQUEST_TIMEOUT_S, trust_env=False)
    setups = {p: Setup(p, args.model, args.p_blocks, log_dir, http) for p in POLICIES}
    try:
        for s in setups.values():
            s.start()
        for s in setups.values():
            for i in range(2):
                s.ttft(args.model, f"warm-up {i}: " + text(random.Random(i), 64))
        results = {kind: run_workload(kind, setups, args, args.model) for kind in ("shared", "unique")}
    finally:
        for s in setups.values():
            s.stop()
        http.close()
    print(f"\nTTFT through the proxy, 2 P + 1 D per policy, {args.requests} requests per workload, "
          f"{args.system_prompts} system prompts of ~{args.system_tokens} tokens, {args.p_blocks} blocks per P")
    print(f"{'workload':<9} {'policy':<12} {'p50 ms':>8} {'p90 ms':>8} {'P hit rate':>11}")
    for kind, r in results.items():
        for policy in POLICIES:
            x = r[policy]
            print(f"{kind:<9} {policy:<12} {x['p50_ms']:>8.1f} {x['p90_ms']:>8.1f} {x['prefill_hit_rate']:>11.1%}")
        print(f"{kind:<9} prefix / round_robin: p50 {r['ratio_p50']:.3f}, p90 {r['ratio_p90']:.3f}")
    if args.json is not None:
        args.json.write_text(json.dumps({"config": {k: str(v) if isinstance(v, Path) else v
                                                    for k, v in vars(args).items()}, "results": results}, indent=2))
    print(f"server logs: {log_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
