"""KV verification's cost as a client sees it: two `kvbridge up`-shaped clusters side by side in one
run (LocalCluster: 1 prefill + 1 decode `kvbridge serve` over NIXL and the proxy, one torch thread per
engine), the same except `--kv-verify on` / `off`, each P and D in its own process (the product's
shape: no GIL shared between P, D and the proxy, unlike benchmarks/kv_verify.py's in-process pair).

Each repetition sends a fresh random prompt (no prefix-cache hit anywhere) to both clusters, the order
alternating, streaming, greedy, 4 tokens, and the client times the first and the second chunk with
text. Through the proxy's default first-token path the first chunk is P's token (P digests its blocks
at the grant, before it answers: on the path), the second is D's first (D reads the KV and checks the
digests before its first step: on the path); with --no-first-token (vLLM's way) D's first token is the
first chunk, both digests on its path. Medians; ratio on / off, and the median of paired ratios.

    python benchmarks/kv_verify_ttft.py --tokens 1024 4096 --reps 9
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
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import httpx  # noqa: E402

from kvbridge.launcher.cluster import LocalCluster  # noqa: E402

READY_TIMEOUT_S = 300.0
ARMS = ("on", "off")


def chunk_times(http: httpx.Client, url: str, model: str, prompt: list[int]) -> tuple[float, float]:
    """Seconds from sending to the first and to the second streamed chunk with text."""
    body = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0.0, "stream": True,
            "ignore_eos": True}
    times: list[float] = []
    started = time.perf_counter()
    with http.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[len("data: "):])
                if "error" in event:
                    raise RuntimeError(f"the stream failed: {event['error']}")
                if event["choices"] and event["choices"][0].get("text"):
                    times.append(time.perf_counter() - started)
    if len(times) < 2:
        raise RuntimeError(f"fewer than two chunks with text: {times}")
    return times[0], times[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--dtype", default="auto", help="every engine's --dtype (auto: bf16 where the CPU has it)")
    ap.add_argument("--no-first-token", action="store_true", help="the proxies without the first-token path")
    ap.add_argument("--off-first", action="store_true", help="start the unverified cluster first (placement check)")
    ap.add_argument("--json", help="write the samples and the summary here")
    a = ap.parse_args()
    starts = ARMS[::-1] if a.off_first else ARMS
    serve = ["--kv-cache-memory-gb", "0.5", "--dtype", a.dtype, "--max-model-len", str(max(a.tokens) + 64)]
    proxy = ["--no-first-token-from-prefill"] if a.no_first_token else []
    log_dir = Path(tempfile.mkdtemp(prefix="kv_verify_ttft-"))
    clusters = {arm: LocalCluster(a.model, 1, 1, port=0, extra_serve_args=[*serve, "--kv-verify", arm],
                                  proxy_args=proxy, ready_timeout_s=READY_TIMEOUT_S, log_dir=log_dir / arm,
                                  num_threads=1) for arm in starts}
    rng = random.Random(7)
    samples: list[dict] = []
    http = httpx.Client(timeout=600, trust_env=False)
    try:
        urls = {arm: c.start().proxy for arm, c in clusters.items()}
        for arm in ARMS:  # warm-up: kernels, NIXL handshakes
            for tokens in a.tokens:
                chunk_times(http, urls[arm], a.model, [rng.randrange(100, 40000) for _ in range(tokens)])
        for tokens in a.tokens:
            for rep in range(a.reps):
                order = ARMS if rep % 2 == 0 else ARMS[::-1]
                for arm in order:
                    prompt = [rng.randrange(100, 40000) for _ in range(tokens)]
                    first, second = chunk_times(http, urls[arm], a.model, prompt)
                    samples.append({"arm": arm, "tokens": tokens, "rep": rep, "first_s": first, "second_s": second})
    finally:
        http.close()
        for c in clusters.values():
            c.stop()
    summary = {}
    print(f"{'tokens':>6} {'chunk':>6} {'on ms':>9} {'off ms':>9} {'ratio':>7} {'paired':>7}")
    for tokens in a.tokens:
        for key in ("first_s", "second_s"):
            by = {arm: {s["rep"]: s[key] for s in samples if s["arm"] == arm and s["tokens"] == tokens} for arm in ARMS}
            on, off = statistics.median(by["on"].values()), statistics.median(by["off"].values())
            paired = statistics.median(by["on"][r] / by["off"][r] for r in by["on"])
            summary[f"{tokens}_{key}"] = {"on_ms": on * 1e3, "off_ms": off * 1e3, "ratio": on / off, "paired": paired}
            print(f"{tokens:>6} {key[:-2]:>6} {on * 1e3:>9.1f} {off * 1e3:>9.1f} {on / off:>7.3f} {paired:>7.3f}")
    if a.json:
        Path(a.json).write_text(json.dumps({"samples": samples, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
