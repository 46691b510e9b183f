"""The Ray path (`kvbridge up --ray`) against `kvbridge up` on the same box, model and run
(issue 29, "Performance"), and the Ray application's scale timings.

Set-up, all on 127.0.0.1, both up at once for the whole run: `kvbridge up` (a LocalCluster:
1 prefill + 1 decode `kvbridge serve`, nixl, and its proxy) and `kvbridge up --ray` (an
embedded Ray, the router ingress and one prefill and one decode replica), each with the same
`--kv-cache-memory-gb 0.25 --num-threads 1 --dtype DTYPE`. Both are started as a user starts
them (subprocesses, in sessions of their own) and stopped with SIGINT at the end (SIGKILL of
every process they started if that fails), on failure and Ctrl-C too.

1. Load: per repetition and concurrency (1 and 16), the same workload goes through each front
   door, the order alternating (A B, B A, ...): `--requests-per-client` requests per client,
   each a streaming /v1/completions of 128 random token ids (a fresh random prefix: no prefix
   cache hits anywhere), greedy, `ignore_eos`, 64-128 output tokens (drawn per request, the
   same draws for both set-ups). The official openai client; TTFT from sending the request to
   the first chunk with text; output tok/s = the completion tokens (the usage chunk) of the
   batch / its wall time. Per concurrency: medians over `--reps` of each batch's TTFT p50 and
   tok/s, and the ratio Ray/up. One untimed warm-up batch per set-up.
2. Scale (on the Ray app, `--scale-reps` cycles, with 4 clients streaming throughout): from
   the scale-up decision (app.scale to 2P2D, what `kvbridge ray scale` calls, from this process
   joined to the app's Ray as a driver) to (a) app.scale's return (Serve: every replica
   healthy), (b) the router listing the new replicas healthy (its /health), (c) each new
   replica's first served request (its `kvbridge_prompt_tokens_total` > 0); and from the
   scale-down decision (back to 1P1D) to (d) the router dropping the leaving replicas and
   (e) their engines' exit (the drain: the `kvbridge serve` processes gone).

    nice -n 10 python benchmarks/ray_vs_up.py --reps 3 --json /tmp/ray_vs_up.json

Needs the ray extra (`pip install -e .[ray]`). Prints the load averages before and after.
"""

from __future__ import annotations

import os

os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("UCX_MODULES", "^ib")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# Ray's OOM killer judges the whole host's memory: on a shared box it kills replicas for others' use.
os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")

import argparse  # noqa: E402
import asyncio  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import re  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import httpx  # noqa: E402
from openai import AsyncOpenAI  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.e2e.processes
from kvbridge.launcher.cluster import DEFAULT_CLI, free_ports  # noqa: E402
from tests.e2e.processes import children, gone  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
APP_NAME = "kvbridge"
UP, RAY = "up", "ray"
READY_TIMEOUT_S = 600.0
REQUEST_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 180.0
PROMPT_TOKENS = 128
TOKEN_IDS = (1000, 40000)  # ordinary tokens of SmolLM2's 49152-token vocabulary
SCALE_CLIENTS = 4


# ---- the two set-ups, as subprocesses ---------------------------------------------------------
class Server:
    """One `kvbridge up [--ray]` subprocess in a session of its own; its stdout read on a thread."""

    def __init__(self, name: str, command: list[str], log: Path) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)  # `up --ray` sets it itself
        self.name, self.log = name, log
        self.lines: list[str] = []
        self.cond = threading.Condition()
        self.closed = False
        self.seen: set[int] = set()  # every descendant seen: killed if the orderly stop fails
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=env, start_new_session=True)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        with self.log.open("w") as out:
            for line in self.proc.stdout:
                out.write(line)
                out.flush()
                with self.cond:
                    self.lines.append(line)
                    self.cond.notify_all()
        with self.cond:
            self.closed = True
            self.cond.notify_all()

    def wait_for(self, pattern: str, timeout_s: float) -> re.Match:
        found: list[re.Match] = []

        def seen() -> bool:
            found[:] = [m for m in (re.search(pattern, line) for line in self.lines) if m][:1]
            return bool(found) or self.closed
        with self.cond:
            self.cond.wait_for(seen, timeout_s)
            if not found:
                raise RuntimeError(f"{self.name}: no line matching {pattern!r} in {timeout_s:.0f} s; "
                                   f"output ({self.log}):\n{''.join(self.lines[-40:])}")
            return found[0]

    def remember_children(self) -> None:
        if self.proc.poll() is None:
            self.seen.update(children(self.proc.pid))

    def stop(self) -> None:
        """SIGINT (the user's Ctrl-C) and wait; SIGKILL to every process it started if that fails."""
        self.remember_children()
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                print(f"{self.name}: no exit {STOP_TIMEOUT_S:.0f} s after SIGINT: SIGKILL", file=sys.stderr)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        left = gone(sorted(self.seen), 60)
        for pid in left:
            print(f"{self.name}: process {pid} left behind: SIGKILL", file=sys.stderr)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def engine_args(a: argparse.Namespace) -> list[str]:
    return ["--num-threads", "1", "--kv-cache-memory-gb", "0.25", "--dtype", a.dtype,
            "--max-model-len", "1024"]


def start_up(a: argparse.Namespace, log_dir: Path) -> tuple[Server, str]:
    port = free_ports(1)[0]
    server = Server(UP, [*DEFAULT_CLI, "up", MODEL, "--port", str(port), *engine_args(a)], log_dir / "up.log")
    url = server.wait_for(r"kvbridge cluster ready: proxy (http://\S+)", READY_TIMEOUT_S).group(1)
    return server, url


def start_ray(a: argparse.Namespace, log_dir: Path) -> tuple[Server, str, str]:
    server = Server(RAY, [*DEFAULT_CLI, "up", MODEL, "--ray", "--port", "0", *engine_args(a)], log_dir / "ray.log")
    ready = server.wait_for(r"router (http://127\.0\.0\.1:\d+) .*Ray at (127\.0\.0\.1:\d+)", READY_TIMEOUT_S)
    return server, ready.group(1), ready.group(2)


# ---- load ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Batch:
    setup: str
    concurrency: int
    rep: int
    ttft_p50_s: float
    tok_s: float
    requests: int
    completion_tokens: int
    wall_s: float
    ttfts_s: tuple[float, ...]


def workload(rng: random.Random, count: int) -> list[tuple[list[int], int]]:
    """`count` (prompt token ids, max_tokens): 128 random ids each, 64-128 output tokens."""
    return [([rng.randint(*TOKEN_IDS) for _ in range(PROMPT_TOKENS)], rng.randint(64, 128)) for _ in range(count)]


async def one(client: AsyncOpenAI, prompt: list[int], max_tokens: int) -> tuple[float, int]:
    """(TTFT, completion tokens) of one streaming greedy completion."""
    sent = time.perf_counter()
    ttft, tokens = None, 0
    stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             stream=True, stream_options={"include_usage": True},
                                             extra_body={"ignore_eos": True})
    async for chunk in stream:
        if ttft is None and chunk.choices and chunk.choices[0].text:
            ttft = time.perf_counter() - sent
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    if ttft is None or tokens != max_tokens:
        raise RuntimeError(f"a completion gave {tokens} of {max_tokens} tokens (first text: {ttft})")
    return ttft, tokens


async def run_batch(url: str, work: list[tuple[list[int], int]], concurrency: int) -> tuple[list[float], int, float]:
    """`concurrency` clients taking the workload's requests in turn: (TTFTs, tokens, wall time)."""
    queue = list(reversed(work))
    ttfts: list[float] = []
    tokens = 0
    async with AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                           timeout=REQUEST_TIMEOUT_S) as client:
        async def worker() -> None:
            nonlocal tokens
            while queue:
                prompt, max_tokens = queue.pop()
                ttft, n = await one(client, prompt, max_tokens)
                ttfts.append(ttft)
                tokens += n
        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return ttfts, tokens, time.perf_counter() - started


def batch(setup: str, url: str, work: list[tuple[list[int], int]], concurrency: int, rep: int) -> Batch:
    ttfts, tokens, wall = asyncio.run(run_batch(url, work, concurrency))
    return Batch(setup, concurrency, rep, statistics.median(ttfts), tokens / wall, len(ttfts), tokens, wall,
                 tuple(ttfts))


def summarize(batches: list[Batch], concurrencies: list[int]) -> list[dict]:
    rows = []
    for c in concurrencies:
        med = {s: {k: statistics.median(getattr(b, k) for b in batches if b.setup == s and b.concurrency == c)
                   for k in ("ttft_p50_s", "tok_s")} for s in (UP, RAY)}
        rows.append({"concurrency": c, "up_ttft_p50_ms": med[UP]["ttft_p50_s"] * 1e3,
                     "ray_ttft_p50_ms": med[RAY]["ttft_p50_s"] * 1e3,
                     "ttft_ratio": med[RAY]["ttft_p50_s"] / med[UP]["ttft_p50_s"],
                     "up_tok_s": med[UP]["tok_s"], "ray_tok_s": med[RAY]["tok_s"],
                     "tok_s_ratio": med[RAY]["tok_s"] / med[UP]["tok_s"],
                     # paired: each repetition's Ray/up (the same workload, back to back)
                     "ttft_ratio_per_rep": paired(batches, c, "ttft_p50_s"),
                     "tok_s_ratio_per_rep": paired(batches, c, "tok_s")})
    return rows


def paired(batches: list[Batch], concurrency: int, key: str) -> list[float]:
    by = {(b.setup, b.rep): getattr(b, key) for b in batches if b.concurrency == concurrency}
    return [by[RAY, rep] / by[UP, rep] for rep in sorted({r for _, r in by})]


def print_table(rows: list[dict]) -> None:
    print("| concurrency | TTFT p50 up (ms) | TTFT p50 Ray (ms) | Ray/up | per rep | tok/s up | tok/s Ray | Ray/up "
          "| per rep |")
    print("|---:|---:|---:|---:|---|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['concurrency']} | {r['up_ttft_p50_ms']:.0f} | {r['ray_ttft_p50_ms']:.0f} | "
              f"{r['ttft_ratio']:.3f} | {' '.join(f'{x:.2f}' for x in r['ttft_ratio_per_rep'])} | "
              f"{r['up_tok_s']:.1f} | {r['ray_tok_s']:.1f} | {r['tok_s_ratio']:.3f} | "
              f"{' '.join(f'{x:.2f}' for x in r['tok_s_ratio_per_rep'])} |")


# ---- scale timings ------------------------------------------------------------------------------
class Background:
    """`clients` clients streaming short greedy completions through `url` until stopped; failures counted."""

    def __init__(self, url: str, clients: int, seed: int) -> None:
        self.url, self.clients, self.rng = url, clients, random.Random(seed)
        self.done, self.failed = 0, []
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _run(self) -> None:
        async with AsyncOpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0,
                               timeout=REQUEST_TIMEOUT_S) as client:
            async def worker() -> None:
                while not self.stopping.is_set():
                    (prompt, _), = workload(self.rng, 1)
                    try:
                        await one(client, prompt, 16)
                        self.done += 1
                    except Exception as exc:  # counted and reported
                        self.failed.append(repr(exc))
            await asyncio.gather(*(worker() for _ in range(self.clients)))

    def __enter__(self) -> Background:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        self.thread.join(REQUEST_TIMEOUT_S)


def router_members(http: httpx.Client, url: str) -> dict[str, list[dict]]:
    report = http.get(url + "/health").json()
    return {role: report.get(role, []) for role in ("prefill", "decode")}


def served(http: httpx.Client, url: str) -> bool:
    """Whether the engine at url has served a request (its prompt token counter moved)."""
    with contextlib.suppress(httpx.HTTPError):
        m = re.search(r"^kvbridge_prompt_tokens_total ([0-9.e+]+)$", http.get(url + "/metrics").text, re.M)
        return bool(m) and float(m.group(1)) > 0
    return False


def engine_pid(server: Server, url: str) -> int:
    """The pid of the `kvbridge serve` process listening on url's port (a descendant of `up --ray`)."""
    port = url.rsplit(":", 1)[1].encode()
    for pid in children(server.proc.pid):
        with contextlib.suppress(OSError):
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            if b"\x00serve\x00" in cmd and b"--port\x00" + port + b"\x00" in cmd:
                return pid
    raise RuntimeError(f"no `kvbridge serve` process for {url} under `up --ray`")


def poll(predicate, timeout_s: float, what: str, step_s: float = 0.05) -> float:
    """Wait until predicate(); the monotonic time it first held."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"not within {timeout_s:.0f} s: {what}")
        time.sleep(step_s)
    return time.monotonic()


class Scaling:
    """app.scale(...) on a thread of its own (it returns once Serve has every replica healthy or
    gone), so that the router and the engines are watched meanwhile; `returned` its return time."""

    def __init__(self, prefill: int, decode: int) -> None:
        from kvbridge.ray import app
        self.returned: float | None = None
        self.error: BaseException | None = None

        def run() -> None:
            try:
                app.scale(APP_NAME, app.PoolSize(prefill, prefill), app.PoolSize(decode, decode),
                          timeout_s=READY_TIMEOUT_S)
                self.returned = time.monotonic()
            except BaseException as exc:  # reported by wait()
                self.error = exc
        self.decided = time.monotonic()
        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def wait(self) -> float:
        """Seconds from the decision to app.scale's return."""
        self.thread.join(READY_TIMEOUT_S + 60)
        if self.error is not None or self.returned is None:
            raise RuntimeError(f"app.scale failed: {self.error!r}")
        return self.returned - self.decided


def scale_cycle(server: Server, url: str, rep: int) -> dict:
    with httpx.Client(timeout=10, trust_env=False) as http, Background(url, SCALE_CLIENTS, 1000 + rep) as load:
        poll(lambda: load.done >= SCALE_CLIENTS, 300, "the background load's first answers")
        first = {m["url"] for r in router_members(http, url).values() for m in r}
        up = Scaling(2, 2)
        decided = up.decided
        new: list[str] = []

        def router_has_new() -> bool:
            members = router_members(http, url)
            healthy = {m["url"] for r in members.values() for m in r if m["healthy"]}
            new[:] = sorted({m["url"] for r in members.values() for m in r} - first)
            return len(new) == 2 and set(new) <= healthy
        in_router = poll(router_has_new, 300, "the router lists 2 new healthy replicas")
        first_served = {u: poll(lambda u=u: served(http, u), 300, f"{u} serves a request") for u in new}
        serve_ready_s = up.wait()
        server.remember_children()
        mid_done = load.done

        before_down = {m["url"] for r in router_members(http, url).values() for m in r}
        pids = {u: engine_pid(server, u) for u in before_down}  # Serve picks which replicas leave
        down = Scaling(1, 1)
        decided_down = down.decided
        leaving: list[str] = []

        def router_dropped() -> bool:
            members = {m["url"] for r in router_members(http, url).values() for m in r}
            leaving[:] = sorted(before_down - members)
            return len(members) == 2
        dropped = poll(router_dropped, 300, "the router lists 1 P and 1 D")
        left = gone([pids[u] for u in leaving], 300)
        if left:
            raise RuntimeError(f"leaving engines {left} did not exit within 300 s")
        exited = time.monotonic()
        serve_down_s = down.wait()
    if load.failed:
        raise RuntimeError(f"{len(load.failed)} failed requests during scaling, e.g. {load.failed[:2]}")
    return {"rep": rep, "up_serve_healthy_s": serve_ready_s, "up_router_s": in_router - decided,
            "up_first_served_s": max(first_served.values()) - decided,
            "down_serve_done_s": serve_down_s, "down_router_s": dropped - decided_down,
            "down_exit_s": exited - decided_down, "original_replicas_left": len(set(leaving) & first),
            "answers_during_up": mid_done, "answers_total": load.done}


# ---- main ---------------------------------------------------------------------------------------
def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=3, help="load repetitions (default: %(default)s)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    p.add_argument("--requests-per-client", type=int, default=2,
                   help="requests per client and batch (default: %(default)s)")
    p.add_argument("--min-requests", type=int, default=4,
                   help="at least this many requests a batch (default: %(default)s)")
    p.add_argument("--scale-reps", type=int, default=2, help="scale-up/down cycles; 0: none (default: %(default)s)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"],
                   help="both set-ups' --dtype (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", type=Path, default=None, help="the servers' output (default: a temp folder)")
    p.add_argument("--json", type=Path, default=None, help="write every figure here")
    return p.parse_args()


def _interrupt(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


def main() -> int:
    a = parse_args()
    for sig in (signal.SIGINT, signal.SIGTERM):  # also where SIGINT came ignored (a background job)
        signal.signal(sig, _interrupt)
    import tempfile
    log_dir = a.log_dir or Path(tempfile.mkdtemp(prefix="ray_vs_up-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    servers: list[Server] = []
    result: dict = {"model": MODEL, "dtype": a.dtype, "reps": a.reps, "log_dir": str(log_dir),
                    "loadavg_start": loadavg()}
    print(f"load average at start {result['loadavg_start']}; logs in {log_dir}", flush=True)
    try:
        # One after the other: start-up is CPU-bound.
        up, up_url = start_up(a, log_dir)
        servers.append(up)
        print(f"kvbridge up: {up_url}", flush=True)
        ray, ray_url, ray_address = start_ray(a, log_dir)
        servers.append(ray)
        print(f"kvbridge up --ray: {ray_url} (Ray at {ray_address})", flush=True)
        urls = {UP: up_url, RAY: ray_url}
        rng = random.Random(a.seed)
        for setup in (UP, RAY):  # warm-up, untimed
            batch(setup, urls[setup], workload(random.Random(-1), 4), 4, -1)
        batches: list[Batch] = []
        for rep in range(a.reps):
            for i, c in enumerate(a.concurrency):
                work = workload(rng, max(c * a.requests_per_client, a.min_requests))
                for setup in ((UP, RAY) if (rep + i) % 2 == 0 else (RAY, UP)):  # A B, B A, ... per concurrency
                    b = batch(setup, urls[setup], work, c, rep)
                    batches.append(b)
                    print(f"rep {rep} c={c} {setup}: TTFT p50 {b.ttft_p50_s * 1e3:.0f} ms, {b.tok_s:.1f} tok/s "
                          f"({b.completion_tokens} tokens in {b.wall_s:.1f} s; load {loadavg()})", flush=True)
        result["loadavg_after_load"] = loadavg()
        rows = summarize(batches, a.concurrency)
        result.update(batches=[asdict(b) for b in batches], summary=rows)
        print_table(rows)
        print(f"load average after the load runs {result['loadavg_after_load']}", flush=True)

        if a.scale_reps:
            from kvbridge.ray import app
            up.stop()  # the scale timings are the Ray app's alone: `up` leaves the cores to it
            servers.remove(up)
            app.connect(ray_address)
            cycles = []
            for rep in range(a.scale_reps):
                cycle = scale_cycle(ray, ray_url, rep)
                cycles.append(cycle)
                print(f"scale cycle {rep}: " + ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}"
                                                         for k, v in cycle.items()) + f" (load {loadavg()})",
                      flush=True)
            keys = [k for k in cycles[0] if k.endswith("_s")]
            result["scale"] = {"cycles": cycles, "median": {k: statistics.median(c[k] for c in cycles) for k in keys}}
            print("| scale step (s after the decision) | median | runs |\n|---|---:|---|")
            for k in keys:
                print(f"| {k} | {result['scale']['median'][k]:.1f} | "
                      f"{', '.join(f'{c[k]:.1f}' for c in cycles)} |")
        result["loadavg_end"] = loadavg()
        print(f"load average at the end {result['loadavg_end']}", flush=True)
        if a.json:
            a.json.write_text(json.dumps(result, indent=2))
        return 0
    except KeyboardInterrupt:
        print("interrupted: stopping everything", file=sys.stderr, flush=True)
        return 130
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):  # a second Ctrl-C must not cut the cleanup
            signal.signal(sig, signal.SIG_IGN)
        if "ray" in sys.modules:
            import ray as ray_module
            if ray_module.is_initialized():
                ray_module.shutdown()
        for server in reversed(servers):
            server.stop()


if __name__ == "__main__":
    sys.exit(main())
