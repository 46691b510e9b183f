"""Soak: varied traffic against `kvbridge serve` or `kvbridge up` for a while, each process's
resident memory (RSS) read once a period, and the growth after warm-up (issue 33).

Traffic: `--clients` threads (default 8), each sending one request after another to
/v1/completions: a prompt of random words with a fresh prefix (a random nonce first, so no
prefix cache hits), `--mix varied` 5-300 words, `--mix long` a third of them 800-1500 words
(several chunks at the default 2048-token budget), the rest 5-300; 1-32 output tokens
(ignore_eos), half streamed, half greedy and half at temperature 0.7.

Memory: the VmRSS and RssAnon of every process of the set-up (the server; for `up` the proxy,
each P and D, and any child of theirs, e.g. TP ranks), from /proc, read six times a period under
load; each `--period-s` (60: each minute) prints their median (glibc keeps up to tens of MB
freed at its heap's top for a while: single reads jump by that much). Growth after warm-up:
from the period at `--warmup-minutes` to the last.

Before / after in the same run: `--compare-src DIR` starts a second, identical set-up whose
processes import kvbridge from DIR (PYTHONPATH, and DIR as working directory; e.g. the previous
commit, `git archive HEAD~1 | tar -x -C DIR`); `--compare-env KEY=VALUE` gives the second set-up
(of DIR, or of this tree) that environment variable (an allocator in LD_PRELOAD, a cache size). Both stay up; the traffic goes to one at a time, switching every period
(A-B, then B-A: neither always goes second), so both see the same machine and the same minutes; each one's minutes and tok/s are its loaded
periods only. Completion tokens per second come from the server's usage counts.

    python benchmarks/soak.py --setup serve --minutes 10
    python benchmarks/soak.py --setup up --minutes 10 --compare-src /tmp/kvbridge-before --json /tmp/soak.json
    python benchmarks/soak.py --setup serve --mix long --minutes 5 -- --dtype bfloat16

Arguments after `--` go to every `kvbridge serve` / `kvbridge up` (default: --kv-cache-memory-gb 0.25).
Run it under `nice -n 19` on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kvbridge.launcher.cluster import free_ports

READY_TIMEOUT_S = 600.0
SAMPLES_PER_PERIOD = 6  # RSS read under load six times a period; the period's figure is their median
REQUEST_TIMEOUT_S = 300.0
WORDS = ("the of and to in is was for on that with as by at from his her they be this an which have are "
         "river mountain city garden window music engine harbor lantern forest winter summer market bridge "
         "silver copper paper stone glass cloud thunder letter story question answer number colour planet "
         "orange purple quiet rapid gentle ancient modern distant narrow golden hollow bright").split()


def proc_memory_mb(pid: int) -> tuple[float, float] | None:
    """(VmRSS, RssAnon) in MB, or None if the process is gone."""
    try:
        fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    except OSError:
        return None
    kb = lambda name: float(fields.get(name, "0 kB").split()[0]) / 1024  # noqa: E731
    return kb("VmRSS"), kb("RssAnon")


def children_of(pid: int) -> list[int]:
    kids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(entry.name))
    return sorted(kids)


def cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def label(pid: int) -> str:
    argv = cmdline(pid)
    if "proxy" in argv:
        return "proxy"
    if "--kv-role" in argv:
        role = argv[argv.index("--kv-role") + 1]
        return {"producer": "P", "consumer": "D"}.get(role, role)
    return "server" if "serve" in argv else "child"


@dataclass
class SetUp:
    """One `kvbridge serve` or `kvbridge up`, its processes and its traffic counters."""

    name: str
    argv: list[str]
    env: dict[str, str]
    port: int
    log: Path
    cwd: str | None = None  # `python -m` puts the working directory first on sys.path
    popen: subprocess.Popen | None = None
    processes: dict[str, int] = field(default_factory=dict)  # label -> pid
    samples: list[dict[str, tuple[float, float]]] = field(default_factory=list)  # per loaded period
    requests: int = 0
    errors: int = 0
    tokens: int = 0
    busy_s: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.popen = subprocess.Popen(self.argv, env=self.env, cwd=self.cwd, stdin=subprocess.DEVNULL,
                                      stdout=self.log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, model: str) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        with httpx.Client(timeout=30) as http:
            while time.monotonic() < deadline:
                if self.popen.poll() is not None:
                    raise RuntimeError(f"{self.name} exited: see {self.log}")
                try:
                    r = http.post(self.url + "/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 1})
                    if r.status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(2)
            else:
                raise RuntimeError(f"{self.name} not ready after {READY_TIMEOUT_S:.0f} s: see {self.log}")
        self.find_processes()

    def find_processes(self) -> None:
        """The set-up's processes: for `up`, its children (proxy, P, D) and theirs; for serve, itself and its children."""
        top = self.popen.pid
        roots = children_of(top) if "up" in self.argv else [top]
        names: dict[str, int] = {}
        for root in roots:
            base = label(root)
            n = sum(1 for k in names if k.rstrip("0123456789") == base)
            key = f"{base}{n}" if base in ("P", "D") else base
            names[key] = root
            for i, kid in enumerate(children_of(root)):
                names[f"{key}/child{i}"] = kid
        self.processes = names

    def sample(self) -> dict[str, tuple[float, float]]:
        out = {}
        for name, pid in self.processes.items():
            mem = proc_memory_mb(pid)
            if mem is not None:
                out[name] = mem
        return out

    def stop(self) -> None:
        if self.popen is None or self.popen.poll() is not None:
            return
        self.popen.send_signal(signal.SIGINT)  # `up` stops its children on Ctrl-C; serve exits
        try:
            self.popen.wait(60)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()


def make_request(rng: random.Random, mix: str) -> tuple[dict, bool]:
    long = mix == "long" and rng.random() < 1 / 3
    words = rng.randint(800, 1500) if long else rng.randint(5, 300)
    prompt = f"{rng.getrandbits(64):016x} " + " ".join(rng.choice(WORDS) for _ in range(words))
    stream = rng.random() < 0.5
    body = {"prompt": prompt, "max_tokens": rng.randint(1, 32), "ignore_eos": True, "stream": stream,
            "temperature": rng.choice([0.0, 0.7])}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body, stream


def send(http: httpx.Client, target: SetUp, body: dict, stream: bool) -> int:
    """Completion tokens of one request (raises on any failure)."""
    if not stream:
        r = http.post(target.url + "/v1/completions", json=body)
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"]
    tokens = None
    with http.stream("POST", target.url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    if tokens is None:
        raise RuntimeError("stream ended without usage")
    return tokens


class Traffic:
    """`clients` threads sending to whichever set-up is `active` (None: pause)."""

    def __init__(self, clients: int, mix: str, model: str, seed: int) -> None:
        self.active: SetUp | None = None
        self.stop = threading.Event()
        self.mix, self.model = mix, model
        self.threads = [threading.Thread(target=self._client, args=(seed + i,), daemon=True) for i in range(clients)]
        for t in self.threads:
            t.start()

    def _client(self, seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(timeout=REQUEST_TIMEOUT_S) as http:
            while not self.stop.is_set():
                target = self.active
                if target is None:
                    time.sleep(0.05)
                    continue
                body, stream = make_request(rng, self.mix)
                body["model"] = self.model
                try:
                    tokens = send(http, target, body, stream)
                    with target.lock:
                        target.requests += 1
                        target.tokens += tokens
                except Exception as exc:  # noqa: BLE001 - counted, the soak goes on
                    if self.stop.is_set():
                        return  # the set-ups are stopping under it: not the soak's
                    with target.lock:
                        target.errors += 1
                        if target.errors <= 3:
                            print(f"  {target.name}: request failed: {type(exc).__name__}: {exc}", flush=True)

    def drain(self, timeout_s: float = REQUEST_TIMEOUT_S) -> None:
        """Pause and give requests in flight time to finish (they count for the set-up they went to)."""
        self.active = None
        time.sleep(min(timeout_s, 2.0))

    def close(self) -> None:
        self.stop.set()
        self.active = None


def serve_argv(setup: str, port: int, extra: list[str]) -> list[str]:
    base = [sys.executable, "-m", "kvbridge.cli", setup, "--port", str(port)]
    return base + extra


def fmt_sample(sample: dict[str, tuple[float, float]]) -> str:
    return "  ".join(f"{k}={v[0]:.0f}" for k, v in sample.items())


def growth(samples: list[dict[str, tuple[float, float]]], warmup: int) -> dict[str, dict[str, float]]:
    """Per process: RSS at the end of period `warmup` (1-based; 0: the first) and at the last, and the
    growth (MB, %)."""
    start = max(0, warmup - 1)
    if len(samples) <= start + 1:
        return {}
    first, last = samples[start], samples[-1]
    out = {}
    for name in last:
        if name in first:
            a, b = first[name][0], last[name][0]
            out[name] = {"from_mb": a, "to_mb": b, "growth_mb": b - a, "growth_pct": 100 * (b - a) / a}
    return out


def main() -> int:
    argv = sys.argv[1:]
    extra = []
    if "--" in argv:
        extra = argv[argv.index("--") + 1:]
        argv = argv[:argv.index("--")]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--setup", choices=["serve", "up"], default="serve")
    p.add_argument("--minutes", type=float, default=10.0, help="loaded minutes per set-up (default: %(default)s)")
    p.add_argument("--period-s", type=float, default=60.0, help="seconds between samples (and between switches)")
    p.add_argument("--warmup-minutes", type=float, default=2.0, help="growth is measured from this sample on")
    p.add_argument("--mix", choices=["varied", "long"], default="varied")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--compare-src", default=None, help="a second set-up importing kvbridge from this tree")
    p.add_argument("--compare-env", action="append", default=[], metavar="KEY=VALUE",
                   help="a second set-up (of --compare-src, or of this tree) with this in its environment; repeatable")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the samples and the summary here")
    p.add_argument("--log-dir", default=None)
    args = p.parse_args(argv)
    extra = extra or ["--kv-cache-memory-gb", "0.25"]
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="kvbridge-soak-"))
    log_dir.mkdir(parents=True, exist_ok=True)

    base_env = dict(os.environ)
    base_env.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # two set-ups may share the machine
    base_env.setdefault("UCX_NET_DEVICES", "lo")
    base_env.setdefault("UCX_MODULES", "^ib")
    setups = [SetUp("this tree", serve_argv(args.setup, port := free_ports(1)[0], [args.model] + extra), dict(base_env),
                    port, log_dir / "a.log")]
    if args.compare_src or args.compare_env:
        env, cwd, name = dict(base_env), None, []
        if args.compare_src:
            cwd = os.path.abspath(args.compare_src)
            env["PYTHONPATH"] = cwd + os.pathsep + env.get("PYTHONPATH", "")
            name.append(f"--compare-src {args.compare_src}")
        for item in args.compare_env:
            key, _, value = item.partition("=")
            env[key] = value
            name.append(item)
        setups.append(SetUp(" ".join(name), serve_argv(args.setup, port := free_ports(1)[0], [args.model] + extra), env,
                            port, log_dir / "b.log", cwd=cwd))
    print(f"soak: {args.setup}, mix {args.mix}, {args.clients} clients, {args.minutes:g} loaded minutes per set-up, "
          f"serve args {' '.join(extra)}; logs in {log_dir}", flush=True)
    traffic = None
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # stop the set-ups on kill too (finally below)
    try:
        for s in setups:
            s.start()
        for s in setups:
            s.wait_ready(args.model)
            print(f"{s.name}: ready, processes {s.processes}, RSS MB {fmt_sample(s.sample())}", flush=True)
        traffic = Traffic(args.clients, args.mix, args.model, args.seed)
        periods = max(1, round(args.minutes * 60 / args.period_s))
        warmup = round(args.warmup_minutes * 60 / args.period_s)
        for period in range(periods):
            # A-B, B-A, A-B...: neither set-up always follows the other (every earlier run with a
            # fixed order, five of them, gave the second set-up the higher tok/s, by 1.5-15%, whichever it was).
            for s in (setups if period % 2 == 0 else setups[::-1]):
                traffic.active = s
                started = time.monotonic()
                reads = []
                for _ in range(SAMPLES_PER_PERIOD):
                    time.sleep(args.period_s / SAMPLES_PER_PERIOD)
                    reads.append(s.sample())
                traffic.drain()
                s.busy_s += time.monotonic() - started
                sample = {k: tuple(statistics.median(r[k][i] for r in reads if k in r) for i in (0, 1))
                          for k in reads[-1]}
                s.samples.append(sample)
                missing = set(s.processes) - set(sample)
                print(f"[{s.name}] minute {(period + 1) * args.period_s / 60:5.1f}: {s.requests} requests, {s.errors} errors, "
                      f"RSS MB {fmt_sample(sample)}" + (f"  GONE: {sorted(missing)}" if missing else ""), flush=True)
        summary = {}
        print(f"\ngrowth from the end of minute {warmup * args.period_s / 60:g} to the end (VmRSS, MB):")
        for s in setups:
            g = growth(s.samples, warmup)
            tok_s = s.tokens / s.busy_s if s.busy_s else 0.0
            summary[s.name] = {"requests": s.requests, "errors": s.errors, "completion_tokens": s.tokens,
                               "loaded_s": s.busy_s, "tok_s": tok_s, "growth": g,
                               "samples": [{k: {"rss_mb": v[0], "anon_mb": v[1]} for k, v in x.items()} for x in s.samples]}
            print(f"  {s.name}: {s.requests} requests, {s.errors} errors, {tok_s:.1f} completion tok/s over "
                  f"{s.busy_s / 60:.1f} loaded minutes")
            for name, x in g.items():
                print(f"    {name:8s} {x['from_mb']:7.0f} -> {x['to_mb']:7.0f}  {x['growth_mb']:+7.1f} MB  "
                      f"{x['growth_pct']:+6.2f}%")
        if args.json:
            Path(args.json).write_text(json.dumps({"args": vars(args), "serve_args": extra, "setups": summary}, indent=1))
        return 0
    finally:
        if traffic is not None:
            traffic.close()
        for s in setups:
            s.stop()


if __name__ == "__main__":
    sys.exit(main())
