"""P/D KV transfer efficiency: one request's KV read through the real connector, divided
by a raw backend READ of the same number of bytes as one buffer, measured interleaved.

Set-up (per backend, nixl and tcp): a prefill server P and a decode server D, real
`kvbridge serve` processes started with the commands LocalCluster uses (fp32, block
size 16, 2 torch threads each: only one of them computes at a time). P keeps prefix
caching, so repeating a prompt costs it one block of prefill; D runs with
--no-prefix-caching, so every request makes D read the whole prompt's KV from P. A
request is the proxy's protocol without the proxy: P answers `max_tokens=1` with
`kv_transfer_params`, then D gets the prompt plus those params.

What is timed:
* P/D: the connector's own READ duration (`KVTransferStats.record_transfer`, read
  from D's /metrics as the change of `kvbridge_kv_transfer_duration_seconds_sum`
  over the request, with the bytes and descriptor counters). The interval starts on
  D's engine thread just before the two descriptor lists are prepared
  (`prep_descs` x2, after the block runs are computed and P's check_read reply is
  in) and ends at the first engine-step poll (`check_state`) that sees DONE. It
  excludes the handshake, the check_read round trip and releasing the handle.
* raw: `raw_transfer.RawPair(backend, capacity).read_gbps(nbytes, reps=3)` with the
  same byte count as one descriptor: a target process (polling get_new_notifs every
  1 ms while measured) and a reader agent, started once per backend before the servers
  and kept for the whole run; per repetition one untimed read, then the median of 3
  reads, each timed from `read()` to a DONE poll (descriptors prepared before).
* raw@descs (diagnostic): the same, with as many equal descriptors as the request's
  read used (or the nearest count below that divides the bytes evenly), remote ones
  in reverse order so that none merge.

Each (backend, TP pairing) gets its own P and D servers, started after the previous
pair's have stopped. Per pair: a warm-up request per size (P's prefill, handshake, UCX
wire-up), not counted; raw reads; the repetitions (P/D per prompt size); raw reads again.
Figures are medians; ratio = median P/D GB/s / median raw GB/s.

    UCX_NET_DEVICES=lo python benchmarks/pd_transfer.py --reps 5 --json /tmp/pd_transfer.json

Hetero-TP (a random-weight SmolLM2-shaped model with 4 KV heads, which TP 2 splits):

    python benchmarks/pd_transfer.py --synthetic --pairings 1:1 2:1 1:2 --backends nixl --reps 5 --kv-cache-gb 1
"""

from __future__ import annotations

import os

os.environ.setdefault("UCX_NET_DEVICES", "lo")  # every NIXL process stays on loopback
os.environ.setdefault("UCX_MODULES", "^ib")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # NIXL logs every agent start at INFO

import argparse  # noqa: E402
import contextlib  # noqa: E402
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

sys.path.insert(0, str(Path(__file__).resolve().parent))  # raw_transfer, also under `kvbridge bench`
from raw_transfer import RawPair  # noqa: E402

from kvbridge.serving import cluster  # noqa: E402

READY_TIMEOUT_S = 300.0
BLOCK_SIZE = 16  # the servers' (kvbridge serve's default)
REQUEST_TIMEOUT_S = 600.0  # an 8k-token prefill on a busy 2-core machine
RAW_READS = 3  # timed raw reads per repetition (their median), after RawPair.read_gbps's warm-up read
METRICS = {"kvbridge_kv_transfer_duration_seconds": "sum", "kvbridge_kv_transfer_bytes": "total",
           "kvbridge_kv_transfer_descriptors": "total", "kvbridge_kv_transfers": "total"}


@dataclass(frozen=True)
class Sample:
    backend: str
    tokens: int
    rep: int
    nbytes: int
    descs: int
    pd_s: float  # the connector's READ duration

    @property
    def pd_gbps(self) -> float:
        return self.nbytes / self.pd_s / 1e9


@dataclass(frozen=True)
class RawSample:
    backend: str
    tokens: int
    when: str  # "before" / "after" the P/D repetitions, or "rep N" when interleaved
    raw_gbps: float  # median of RAW_READS reads
    raw_descs_gbps: float | None  # raw with about the request's descriptor count (None: one descriptor)


class PDPair:
    """One P and one D `kvbridge serve` process for one backend; stop() ends both by pid."""

    def __init__(self, backend: str, model: str, log_dir: Path, num_threads: int, kv_cache_gb: float,
                 prefill_tp: int = 1, decode_tp: int = 1) -> None:
        self.backend, self.model = backend, model
        self.served = Path(model).name if Path(model).is_dir() else model  # the name `serve` gives a folder
        self.label = backend if (prefill_tp, decode_tp) == (1, 1) else f"{backend} P{prefill_tp}>D{decode_tp}"
        specs = cluster.plan_instances(1, 1, prefill_tp=prefill_tp, decode_tp=decode_tp)
        env = cluster.child_env(os.environ, loopback_only=True, num_threads=num_threads)
        extra = {"prefill": ["--kv-cache-memory-gb", str(kv_cache_gb), "--log-level", "warning"],
                 "decode": ["--kv-cache-memory-gb", str(kv_cache_gb), "--log-level", "warning",
                            "--no-prefix-caching"]}
        self.children: list[cluster.ChildProcess] = []
        self.urls: dict[str, str] = {}
        for spec in specs:
            kind = spec.name.split("-")[0]
            argv = cluster.serve_command(cluster.DEFAULT_CLI, model, spec, host="127.0.0.1", kv_backend=backend,
                                         num_threads=num_threads, extra_args=extra[kind])
            self.children.append(cluster.spawn_child(f"{self.label.replace(' ', '-')}-{spec.name}", argv, env,
                                                     log_dir))
            self.urls[kind] = cluster.http_url("127.0.0.1", spec.port)
        self.http = httpx.Client(timeout=REQUEST_TIMEOUT_S, trust_env=False)

    def wait_healthy(self, deadline: float) -> None:
        pending = dict(zip(self.urls.values(), self.children))
        while pending:
            for url, child in list(pending.items()):
                if not child.alive():
                    raise RuntimeError(f"{child.name} exited during start-up:\n{child.tail()}")
                try:
                    if self.http.get(url + "/health", timeout=2).status_code == 200:
                        del pending[url]
                except httpx.HTTPError:
                    pass
            if pending and time.monotonic() > deadline:
                raise RuntimeError(f"not healthy in time: {', '.join(c.name for c in pending.values())}")
            time.sleep(0.2)

    def d_counters(self) -> dict[str, float]:
        text = self.http.get(self.urls["decode"] + "/metrics").text
        out = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                for name, suffix in METRICS.items():
                    if sample.name == f"{name}_{suffix}":
                        out[name] = sample.value
        return out

    def request(self, prompt: list[int]) -> tuple[float, int, int]:
        """One P/D request; returns D's (READ seconds, bytes, descriptors) for it."""
        body = {"model": self.served, "prompt": prompt, "max_tokens": 1, "temperature": 0.0}
        r = self.http.post(self.urls["prefill"] + "/v1/completions",
                           json={**body, "kv_transfer_params": {"do_remote_decode": True}})
        r.raise_for_status()
        params = r.json()["kv_transfer_params"]
        before = self.d_counters()
        r = self.http.post(self.urls["decode"] + "/v1/completions", json={**body, "kv_transfer_params": params})
        r.raise_for_status()
        after = self.d_counters()
        delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in METRICS}
        if delta["kvbridge_kv_transfers"] != 1:
            raise RuntimeError(f"D completed {delta['kvbridge_kv_transfers']:.0f} reads for one request "
                               f"(a prefix-cache hit, or a failed load?)")
        return (delta["kvbridge_kv_transfer_duration_seconds"], int(delta["kvbridge_kv_transfer_bytes"]),
                int(delta["kvbridge_kv_transfer_descriptors"]))

    def stop(self) -> None:
        self.http.close()
        cluster.stop_children(list(reversed(self.children)), grace_s=10.0)


def make_prompt(tokens: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(tokens)]


def near_divisor(nbytes: int, n: int) -> int:
    """The largest descriptor count <= n that splits nbytes evenly (RawPair.read_gbps needs equal sizes)."""
    return next(d for d in range(n, 0, -1) if nbytes % d == 0)


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def summarize(samples: list[Sample], raws: list[RawSample]) -> list[dict]:
    rows = []
    for backend, tokens in dict.fromkeys((s.backend, s.tokens) for s in samples):
        group = [s for s in samples if (s.backend, s.tokens) == (backend, tokens)]
        raw_group = [r for r in raws if (r.backend, r.tokens) == (backend, tokens)]
        pd, raw = median([s.pd_gbps for s in group]), median([r.raw_gbps for r in raw_group])
        at_descs = [r.raw_descs_gbps for r in raw_group if r.raw_descs_gbps is not None]
        rows.append({"backend": backend, "tokens": tokens, "reps": len(group), "raw_samples": len(raw_group),
                     "MiB": group[0].nbytes / 2**20,
                     "descs": median([s.descs for s in group]), "descs_min": min(s.descs for s in group),
                     "descs_max": max(s.descs for s in group), "pd_ms": median([s.pd_s * 1e3 for s in group]),
                     "pd_gbps": pd, "raw_gbps": raw, "raw_descs_gbps": median(at_descs) if at_descs else None,
                     "ratio": pd / raw})
    return rows


def print_table(rows: list[dict]) -> None:
    head = (f"{'backend':<7} {'tokens':>6} {'MiB':>6} {'descs (min-max)':>16} {'P/D ms':>7} {'P/D GB/s':>9} "
            f"{'raw GB/s':>9} {'raw@descs':>9} {'ratio':>6}")
    print(head)
    for r in rows:
        descs = f"{r['descs']:.0f} ({r['descs_min']}-{r['descs_max']})"
        at = f"{r['raw_descs_gbps']:.2f}" if r["raw_descs_gbps"] is not None else "-"
        print(f"{r['backend']:<7} {r['tokens']:>6} {r['MiB']:>6.1f} {descs:>16} {r['pd_ms']:>7.2f} "
              f"{r['pd_gbps']:>9.2f} {r['raw_gbps']:>9.2f} {at:>9} {r['ratio']:>6.2f}")


def read_capacity(model: str, tokens: list[int], block_size: int = BLOCK_SIZE) -> int:
    """Bytes of the largest request's KV read: every block of the longest prompt (fp32)."""
    import torch

    from kvbridge.engine.loader import load_model
    from kvbridge.engine.model_runner import kv_bytes_per_block

    arch = load_model(model).arch
    return kv_bytes_per_block(arch, block_size, torch.float32) * -(-max(tokens) // block_size)


def raw_sample(raw_pair: RawPair, backend: str, tokens: int, when: str, nbytes: int, descs: int,
               args: argparse.Namespace) -> RawSample:
    raw = raw_pair.read_gbps(nbytes, reps=RAW_READS)
    at_descs = (raw_pair.read_gbps(nbytes, reps=RAW_READS, num_descs=near_divisor(nbytes, descs))
                if descs > 1 and not args.no_desc_baseline else None)
    return RawSample(backend, tokens, when, raw, at_descs)


def run(args: argparse.Namespace, pairs: dict[str, PDPair],
        raw_pairs: dict[str, RawPair]) -> tuple[list[Sample], list[RawSample]]:
    prompts = {n: make_prompt(n, seed=n) for n in args.tokens}
    steps = len(args.tokens) * len(pairs) * (args.reps + 1)
    samples: list[Sample] = []
    raws: list[RawSample] = []
    shape: dict[tuple[str, int], tuple[int, int]] = {}  # (backend, tokens) -> (bytes, descriptors) read

    def bracket(when: str) -> None:
        for (label, n), (nbytes, descs) in shape.items():
            seen = [x.descs for x in samples if (x.backend, x.tokens) == (label, n)]
            descs = round(median(seen)) if seen else 1  # raw@descs: after the repetitions only
            raws.append(raw_sample(raw_pairs[pairs[label].backend], label, n, when, nbytes, descs, args))

    with tqdm(total=steps, desc="pd_transfer", unit="read", file=sys.stderr) as bar:
        for backend, pair in pairs.items():  # warm-up: P's prefill, handshake, wire-up
            for n in args.tokens:
                bar.set_postfix_str(f"warm-up {backend} {n} tokens")
                shape[backend, n] = pair.request(prompts[n])[1:]
                bar.update()
        if not args.interleaved:
            bar.set_postfix_str("raw reads before")
            bracket("before")
        for rep in range(args.reps):
            for n in args.tokens:
                for backend, pair in pairs.items():
                    bar.set_postfix_str(f"rep {rep + 1} {backend} {n} tokens")
                    seconds, nbytes, descs = pair.request(prompts[n])
                    samples.append(Sample(backend, n, rep, nbytes, descs, seconds))
                    if args.interleaved:
                        raws.append(raw_sample(raw_pairs[pair.backend], backend, n, f"rep {rep + 1}", nbytes, descs,
                                               args))
                    bar.update()
        if not args.interleaved:
            bar.set_postfix_str("raw reads after")
            bracket("after")
    return samples, raws


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--pairings", nargs="+", default=["1:1"], metavar="P:D",
                    help="prefill:decode tensor parallel sizes, e.g. 1:1 2:1 1:2 (default: %(default)s)")
    ap.add_argument("--synthetic", action="store_true",
                    help="serve a random-weight SmolLM2-shaped model with 8 heads and 4 KV heads instead of "
                         "--model (SmolLM2's 3 KV heads do not split over TP 2)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 8000], help="prompt lengths")
    ap.add_argument("--backends", nargs="+", default=["nixl", "tcp"], choices=["nixl", "tcp"])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="1k-token prompts only, 3 repetitions")
    ap.add_argument("--no-desc-baseline", action="store_true", help="skip the raw@descs diagnostic")
    ap.add_argument("--interleaved", action="store_true",
                    help="raw reads after every P/D request instead of before and after all of them")
    ap.add_argument("--threads", type=int, default=2, help="torch threads per engine")
    ap.add_argument("--kv-cache-gb", type=float, default=0.5, help="KV cache per engine (8k tokens: 0.37 GB)")
    ap.add_argument("--json", type=Path, default=None, help="write samples and summary here")
    ap.add_argument("--log-dir", type=Path, default=None, help="server logs (default: a temp dir)")
    args = ap.parse_args()
    if args.quick:
        args.tokens, args.reps = [1024], min(args.reps, 3)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="kvbridge-pd-transfer-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    if args.synthetic:
        from kvbridge.engine.loader import load_model
        from kvbridge.engine.loader.synthetic import SMOLLM2_SHAPED_4_KV_HEADS, write_synthetic_folder
        args.model = str(write_synthetic_folder(log_dir / "synthetic-4-kv-heads", load_model(args.model).tokenizer,
                                                **SMOLLM2_SHAPED_4_KV_HEADS))
    tp_pairs = [tuple(int(x) for x in p.split(":")) for p in args.pairings]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so `finally` stops the servers
    with contextlib.ExitStack() as raw_stack:
        # The raw pairs (one per backend, kept for the whole run) allocate their buffers
        # before the servers start: allocated after them, P/D reads ran ~40% slower from
        # then on (RawPair in raw_transfer.py; figures in benchmarks/README.md).
        capacity = read_capacity(args.model, args.tokens)
        raw_pairs = {b: raw_stack.enter_context(RawPair(b, capacity)) for b in args.backends}
        samples, raws = [], []
        for backend in args.backends:
            for p_tp, d_tp in tp_pairs:
                # One pair of servers at a time: idle TP engines' processes still take a share of
                # the two cores (a TP 1 pair measured 0.54 beside two TP 2 pairs, 1.03 alone).
                pair = PDPair(backend, args.model, log_dir, args.threads, args.kv_cache_gb, p_tp, d_tp)
                try:
                    pair.wait_healthy(time.monotonic() + READY_TIMEOUT_S)
                    got, got_raw = run(args, {pair.label: pair}, raw_pairs)
                finally:
                    pair.stop()
                samples += got
                raws += got_raw
    rows = summarize(samples, raws)
    raw_when = "after each P/D request" if args.interleaved else "before and after the P/D repetitions"
    print(f"\nKV transfer efficiency, medians of {args.reps} P/D repetitions, raw reads {raw_when} "
          f"(P/D: connector READ on D; raw: one descriptor; raw@descs: the request's descriptor count)")
    print_table(rows)
    if args.json is not None:
        args.json.write_text(json.dumps({"config": {k: str(v) if isinstance(v, Path) else v
                                                    for k, v in vars(args).items()},
                                         "summary": rows, "samples": [asdict(s) for s in samples],
                                         "raw_samples": [asdict(r) for r in raws]}, indent=2))
        print(f"wrote {args.json}")
    print(f"server logs: {log_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
