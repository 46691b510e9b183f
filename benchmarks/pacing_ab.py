"""Same-run A/B of two kvbridge trees through the P/D proxy: time to first token and decode tokens
per second, e.g. the engine's pacing before and after issue 46 (step() slept; now it answers when
the next step is due and the loop waits).

Set-up, on 127.0.0.1: one LocalCluster (1 prefill + 1 decode `kvbridge serve`, nixl, 1 torch thread
each, and its proxy) per tree, all up at once; each cluster's processes import kvbridge from their
tree only (`python -P`, PYTHONPATH=<tree>). Export the trees without touching the repository's
state (the new one defaults to this checkout), e.g. the engine before a change and after it, all
else equal:

    mkdir -p /tmp/ab-new /tmp/ab-old && git archive HEAD | tar -x -C /tmp/ab-new
    git archive HEAD | tar -x -C /tmp/ab-old && rm -r /tmp/ab-old/kvbridge/engine /tmp/ab-old/kvbridge/kv_transfer
    git archive <rev> kvbridge/engine kvbridge/kv_transfer kvbridge/server/async_engine.py | tar -x -C /tmp/ab-old
    python benchmarks/pacing_ab.py --old-tree /tmp/ab-old --new-tree /tmp/ab-new --reps 20

Each repetition sends every tree one streaming greedy request with a fresh random prompt
(--tokens; no prefix cache hits), the order alternating per repetition. TTFT: from sending the
request to its first chunk with text. Decode rate: the chunks with text after the first, over the
time from the first to the last (`ignore_eos`, --max-tokens tokens). Medians; one untimed warm-up
request per tree.
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
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import httpx  # noqa: E402

from kvbridge.launcher import cluster  # noqa: E402

NEW_TREE = Path(__file__).resolve().parents[1]
READY_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Sample:
    tree: str
    rep: int
    ttft_s: float
    decode_tok_s: float


def tree_cli(tree: Path) -> tuple[str, ...]:
    """The kvbridge CLI of `tree`: its package first on the path, not the installed one."""
    return ("env", f"PYTHONPATH={tree}", sys.executable, "-P", "-m", "kvbridge.cli")


def has_pacing(tree: Path) -> bool:
    """Whether `tree`'s kvbridge has engine/pacing.py (printed, to show which code each cluster runs)."""
    probe = "import importlib.util, kvbridge; print(kvbridge.__file__, importlib.util.find_spec('kvbridge.engine.pacing') is not None)"
    out = subprocess.run([*tree_cli(tree)[:-2], "-c", probe], capture_output=True, text=True, check=True).stdout
    print(f"{tree}: {out.strip()}")
    return out.strip().endswith("True")


def has_kv_events(tree: Path) -> bool:
    """Whether `tree`'s kvbridge publishes KV events (`serve --kv-events-config`, which the launcher
    passes to every instance)."""
    return "--kv-events-config" in (tree / "kvbridge" / "cli.py").read_text()


class WithoutKVEvents(cluster.LocalCluster):
    """A cluster of a tree from before KV events: this launcher must not pass it --kv-events-config."""

    def _kv_events_args(self) -> list[str]:
        return []


def stream(http: httpx.Client, proxy: str, model: str, prompt: list[int], max_tokens: int) -> Sample:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "ignore_eos": True}
    times: list[float] = []
    started = time.perf_counter()
    with http.stream("POST", proxy + "/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[len("data: "):])
            if "error" in event:
                raise RuntimeError(f"the stream failed: {event['error']}")
            if event["choices"] and event["choices"][0].get("text"):
                times.append(time.perf_counter())
    if len(times) < 2:
        raise RuntimeError(f"the stream had {len(times)} chunks with text")
    return Sample("", 0, times[0] - started, (len(times) - 1) / (times[-1] - times[0]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old-tree", type=Path, required=True, help="the tree to compare with --new-tree")
    ap.add_argument("--new-tree", type=Path, default=NEW_TREE, help="default: this checkout")
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--tokens", type=int, default=1024, help="prompt length")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    trees = {"old": args.old_tree.resolve(), "new": args.new_tree.resolve()}
    print({name: has_pacing(tree) for name, tree in trees.items()})
    log_dir = Path(tempfile.mkdtemp(prefix="kvbridge-pacing-ab-"))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so `finally` stops every process
    # Both sides alike: when one tree predates KV events, the other runs with them off.
    events = {name: has_kv_events(tree) for name, tree in trees.items()}
    off = ["--kv-events-config", json.dumps({"enable_kv_cache_events": False})] if not all(events.values()) else []
    clusters = {name: (cluster.LocalCluster if events[name] else WithoutKVEvents)(
                    args.model, 1, 1, port=0, kv_backend="nixl", cli=tree_cli(tree),
                    extra_serve_args=["--kv-cache-memory-gb", "0.5", "--log-level", "warning",
                                      *(off if events[name] else [])],
                    ready_timeout_s=READY_TIMEOUT_S, log_dir=log_dir / name, num_threads=1)
                for name, tree in trees.items()}
    print(f"KV events: {'on in both' if not off else 'off in both (a tree predates them)'}")
    rng = random.Random(args.seed)
    samples: list[Sample] = []
    http = httpx.Client(timeout=300, trust_env=False)
    try:
        proxies = {name: c.start().proxy for name, c in clusters.items()}
        for name, proxy in proxies.items():
            stream(http, proxy, args.model, [rng.randrange(100, 40000) for _ in range(args.tokens)], args.max_tokens)
        for rep in range(args.reps):
            for name in (("old", "new") if rep % 2 == 0 else ("new", "old")):
                prompt = [rng.randrange(100, 40000) for _ in range(args.tokens)]
                s = stream(http, proxies[name], args.model, prompt, args.max_tokens)
                samples.append(Sample(name, rep, s.ttft_s, s.decode_tok_s))
                print(f"rep {rep} {name}: TTFT {s.ttft_s * 1e3:.1f} ms, decode {s.decode_tok_s:.1f} tok/s",
                      file=sys.stderr)
    finally:
        http.close()
        for c in clusters.values():
            c.stop()
    print(f"\nP/D through the proxy (nixl, 1 torch thread per engine), {args.tokens}-token prompts, "
          f"{args.max_tokens} tokens, medians of {args.reps} alternating repetitions")
    print(f"{'tree':<5} {'TTFT ms':>9} {'min':>8} {'max':>8} {'decode tok/s':>13} {'min':>7} {'max':>7}")
    summary = {}
    for name in trees:
        ttft = [x.ttft_s * 1e3 for x in samples if x.tree == name]
        rate = [x.decode_tok_s for x in samples if x.tree == name]
        summary[name] = {"ttft_ms": statistics.median(ttft), "decode_tok_s": statistics.median(rate)}
        print(f"{name:<5} {statistics.median(ttft):>9.1f} {min(ttft):>8.1f} {max(ttft):>8.1f} "
              f"{statistics.median(rate):>13.1f} {min(rate):>7.1f} {max(rate):>7.1f}")
    by = {(x.tree, x.rep): x for x in samples}
    paired = [by[("new", r)].ttft_s / by[("old", r)].ttft_s for r in range(args.reps)]
    print(f"new/old TTFT, median of per-repetition ratios: {statistics.median(paired):.3f}")
    if args.json is not None:
        args.json.write_text(json.dumps({"config": {k: str(v) for k, v in vars(args).items()}, "summary": summary,
                                         "samples": [x.__dict__ for x in samples]}, indent=2))
    print(f"server logs: {log_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
