"""Time to first token through the proxy: P/D (prefill on P, KV read by D over nixl)
divided by one colocated engine behind the same proxy code (colocated mode), with the
proxy's first-token path (P's token streamed at once, D continues from it: the default) and
without it (`--no-first-token-from-prefill`: D recomputes the last prompt token, vLLM's way).

Set-up, all on 127.0.0.1 and up at once, each engine with 1 torch thread (2 cores: one
request is in flight at a time, so each prefill and each decode step gets one core in
both set-ups, and the other core serves HTTP, the proxies and the client):
* P/D: a LocalCluster (1 prefill + 1 decode `kvbridge serve`, nixl, and its proxy);
* P/D recompute: a second proxy in front of the same P and D, with
  --no-first-token-from-prefill;
* colocated: one plain `kvbridge serve` and `kvbridge proxy --decode URL` (no
  --prefill: the proxy forwards each request straight to it, same client and SSE path).
Every engine gets the same serve options.

Each repetition sends a fresh random prompt (1k tokens unless --tokens; one per set-up, since
both P/D set-ups share P and D: no prefix cache anywhere hits) to every set-up, one after the
other, the order rotating per repetition. TTFT is
measured by the client: from sending a streaming /v1/completions request (greedy,
max_tokens=2) to the first SSE chunk with non-empty text. The P/D rows also show,
per request, P's answer time (the proxy's kvbridge_proxy_prefill_seconds), D's KV
READ time (D's kvbridge_kv_transfer_duration_seconds; the first-token path's READ may end
after its first chunk) and TTFT minus P's answer time (what P/D adds after P's prefill:
recompute: proxy -> D, KV read, D's first step, streaming back; first token: proxy -> D's
admission, streaming back). Figures are medians; ratio = median P/D TTFT / median colocated TTFT. Two untimed
warm-up requests per set-up. The engines' own prefill times vary by a few per cent
between processes on a shared 2-core machine, so the ratio carries that noise; the
"after P" column is the P/D cost measured within one request.

    python benchmarks/pd_ttft.py --reps 16 --json /tmp/pd_ttft.json
"""

from __future__ import annotations

import os

os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("UCX_MODULES", "^ib")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # NIXL logs every agent start at INFO

import argparse  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import httpx  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from tqdm import tqdm  # noqa: E402

from kvbridge.launcher import cluster  # noqa: E402

READY_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 300.0
WARMUP = 2
PD, PD_RECOMPUTE, COLOCATED = "pd", "pd_recompute", "colocated"
SETUPS = (PD, PD_RECOMPUTE, COLOCATED)


@dataclass(frozen=True)
class Sample:
    setup: str
    rep: int
    ttft_s: float
    prefill_s: float | None  # P/D: the proxy's wait for P's answer
    kv_read_s: float | None  # P/D: D's connector READ duration


def metric(http: httpx.Client, url: str, name: str) -> float:
    """The value of one sample (e.g. a histogram's `_sum`) on a /metrics page; 0 if absent."""
    for family in text_string_to_metric_families(http.get(url + "/metrics").text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    return 0.0


class Setups:
    """Both set-ups' processes; stop() ends every one of them by pid."""

    def __init__(self, model: str, backend: str, serve_args: list[str], log_dir: Path) -> None:
        self.model, self.log_dir = model, log_dir
        self.pd = cluster.LocalCluster(model, 1, 1, port=0, kv_backend=backend, extra_serve_args=serve_args,
                                       ready_timeout_s=READY_TIMEOUT_S, log_dir=log_dir / "pd", num_threads=1)
        self.colocated_children: list[cluster.ChildProcess] = []
        self.serve_args = serve_args
        self.proxies: dict[str, str] = {}
        self.http = httpx.Client(timeout=REQUEST_TIMEOUT_S, trust_env=False)

    def start(self) -> None:
        urls = self.pd.start()
        self.proxies[PD] = urls.proxy
        serve_port, proxy_port, recompute_port = cluster.free_ports(3)
        env = cluster.child_env(os.environ, loopback_only=True, num_threads=1)
        serve_url, proxy_url = cluster.http_url("127.0.0.1", serve_port), cluster.http_url("127.0.0.1", proxy_port)
        (self.log_dir / "colocated").mkdir(parents=True, exist_ok=True)
        commands = {  # the commands LocalCluster runs, without a KV role and without --prefill
            "serve": [*cluster.DEFAULT_CLI, "serve", self.model, "--host", "127.0.0.1", "--port", str(serve_port),
                      "--num-threads", "1", *self.serve_args],
            "proxy": [*cluster.DEFAULT_CLI, "proxy", "--decode", serve_url, "--host", "127.0.0.1",
                      "--port", str(proxy_port)],
            "proxy-recompute": [*cluster.DEFAULT_CLI, "proxy", "--prefill", *urls.prefill, "--decode", *urls.decode,
                                "--host", "127.0.0.1", "--port", str(recompute_port),
                                "--no-first-token-from-prefill"]}
        deadline = time.monotonic() + READY_TIMEOUT_S
        for name, argv in commands.items():
            child = cluster.spawn_child(name, argv, env, self.log_dir / "colocated")
            self.colocated_children.append(child)
            url = {"serve": serve_url, "proxy": proxy_url}.get(name, cluster.http_url("127.0.0.1", recompute_port))
            self._wait_healthy(child, url, deadline)
        self.proxies[COLOCATED] = proxy_url
        self.proxies[PD_RECOMPUTE] = cluster.http_url("127.0.0.1", recompute_port)

    def _wait_healthy(self, child: cluster.ChildProcess, url: str, deadline: float) -> None:
        while True:
            if not child.alive():
                raise RuntimeError(f"{child.name} exited during start-up:\n{child.tail()}")
            try:
                if self.http.get(url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{child.name} not healthy in time:\n{child.tail()}")
            time.sleep(0.2)

    def ttft(self, setup: str, prompt: list[int]) -> float:
        """Client-side seconds to the first streamed chunk with text; drains the stream."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": 2, "temperature": 0.0, "stream": True}
        first = None
        started = time.perf_counter()
        with self.http.stream("POST", self.proxies[setup] + "/v1/completions", json=body) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if first is None and line.startswith("data: {"):
                    event = json.loads(line[len("data: "):])
                    if "error" in event:
                        raise RuntimeError(f"{setup}: the stream failed: {event['error']}")
                    if event["choices"] and event["choices"][0].get("text"):
                        first = time.perf_counter() - started
        if first is None:
            raise RuntimeError(f"{setup}: the stream had no text")
        return first

    def measure(self, setup: str, rep: int, prompt: list[int]) -> Sample:
        if setup == COLOCATED:
            return Sample(setup, rep, self.ttft(setup, prompt), None, None)
        proxy, decode = self.proxies[setup], self.pd.urls.decode[0]
        names = ("kvbridge_proxy_prefill_seconds_sum", "kvbridge_kv_transfer_duration_seconds_sum")
        before = (metric(self.http, proxy, names[0]), metric(self.http, decode, names[1]))
        ttft = self.ttft(setup, prompt)
        # D's READ ended before its first chunk; the proxy observed P's time before calling D.
        after = (metric(self.http, proxy, names[0]), metric(self.http, decode, names[1]))
        return Sample(setup, rep, ttft, after[0] - before[0], after[1] - before[1])

    def stop(self) -> None:
        self.http.close()
        cluster.stop_children(list(reversed(self.colocated_children)), grace_s=10.0)
        self.pd.stop()


def make_prompt(tokens: int, rng: random.Random) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(tokens)]


def summarize(samples: list[Sample]) -> dict:
    """Per P/D set-up: median TTFT, its ratio to colocated's, the median per-repetition ratio,
    and the medians of P's answer time, D's KV read and the time after P answered."""
    colocated = statistics.median(x.ttft_s for x in samples if x.setup == COLOCATED)
    by_rep = {(x.setup, x.rep): x.ttft_s for x in samples}
    reps = sorted({x.rep for x in samples})
    out: dict = {"colocated_ttft_ms": colocated * 1e3, "reps": len(reps)}
    for setup in (PD, PD_RECOMPUTE):
        rows = [x for x in samples if x.setup == setup]
        med = statistics.median(x.ttft_s for x in rows)
        out[setup] = {"ttft_ms": med * 1e3, "ratio": med / colocated,
                      "paired_ratio": statistics.median(by_rep[(setup, r)] / by_rep[(COLOCATED, r)] for r in reps),
                      "prefill_ms": statistics.median(x.prefill_s for x in rows) * 1e3,
                      "kv_read_ms": statistics.median(x.kv_read_s for x in rows) * 1e3,
                      "after_prefill_ms": statistics.median(x.ttft_s - x.prefill_s for x in rows) * 1e3}
    return out


def print_table(samples: list[Sample], summary: dict, tokens: int) -> None:
    print(f"{'setup':<13} {'tokens':>6} {'reps':>5} {'TTFT ms (median)':>17} {'min':>8} {'max':>8} "
          f"{'ratio':>6} {'paired':>7} {'P answer ms':>12} {'KV read ms':>11} {'after P ms':>11}")
    for setup in (COLOCATED, PD_RECOMPUTE, PD):
        ttfts = [x.ttft_s * 1e3 for x in samples if x.setup == setup]
        s = summary.get(setup)
        extra = (f"{s['ratio']:>6.3f} {s['paired_ratio']:>7.3f} {s['prefill_ms']:>12.1f} {s['kv_read_ms']:>11.2f} "
                 f"{s['after_prefill_ms']:>11.1f}" if s else f"{'-':>6} {'-':>7} {'-':>12} {'-':>11} {'-':>11}")
        print(f"{setup:<13} {tokens:>6} {len(ttfts):>5} {statistics.median(ttfts):>17.1f} {min(ttfts):>8.1f} "
              f"{max(ttfts):>8.1f} {extra}")
    print("ratio: median P/D TTFT / median colocated TTFT; paired: median of per-repetition ratios")


def run(args: argparse.Namespace, setups: Setups) -> list[Sample]:
    rng = random.Random(args.seed)
    samples: list[Sample] = []
    with tqdm(total=len(SETUPS) * (WARMUP + args.reps), desc="pd_ttft", unit="req", file=sys.stderr) as bar:
        for i in range(WARMUP):
            for setup in SETUPS:
                bar.set_postfix_str(f"warm-up {setup}")
                setups.ttft(setup, make_prompt(args.tokens, rng))
                bar.update()
        for rep in range(args.reps):
            order = SETUPS[rep % 3:] + SETUPS[:rep % 3]  # each set-up first, second and last in turn
            for setup in order:
                bar.set_postfix_str(f"rep {rep + 1} {setup}")
                # Fresh for each set-up (both P/D set-ups share P and D): a full prefill everywhere.
                samples.append(setups.measure(setup, rep, make_prompt(args.tokens, rng)))
                bar.update()
    return samples


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--tokens", type=int, default=1024, help="prompt length")
    ap.add_argument("--reps", type=int, default=16)
    ap.add_argument("--quick", action="store_true", help="4 repetitions")
    ap.add_argument("--backend", default="nixl", choices=["nixl", "tcp"], help="P/D transfer backend")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None, help="write samples and summary here")
    ap.add_argument("--log-dir", type=Path, default=None, help="server logs (default: a temp dir)")
    args = ap.parse_args()
    if args.quick:
        args.reps = min(args.reps, 4)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="kvbridge-pd-ttft-"))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so `finally` stops every process
    setups = Setups(args.model, args.backend, ["--kv-cache-memory-gb", "0.5", "--log-level", "warning"], log_dir)
    try:
        setups.start()
        samples = run(args, setups)
    finally:
        setups.stop()
    summary = summarize(samples)
    print(f"\nTTFT through the proxy, {args.tokens}-token prompt, medians of {args.reps} interleaved "
          f"repetitions (P/D over {args.backend}; 1 torch thread per engine)")
    print_table(samples, summary, args.tokens)
    if args.json is not None:
        args.json.write_text(json.dumps({"config": {k: str(v) if isinstance(v, Path) else v
                                                    for k, v in vars(args).items()},
                                         "summary": summary, "samples": [asdict(s) for s in samples]}, indent=2))
        print(f"wrote {args.json}")
    print(f"server logs: {log_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
