"""Chaos run: many concurrent requests through a real proxy to real P and D API servers
(in this process, on loopback), with transfer faults injected at seeded random rates.

Every request must come back either correct (its greedy text equals the colocated
engine's) or as a clean error (HTTP 500 whose OpenAI error body says the KV transfer
failed; for a stream on the proxy's first-token path, whose first token came from P before
D read the KV, the same error as an event after a correct beginning of the text); no server
may crash, and at the end every KV block must be free on P and D.

Besides the transfer faults, a "swapped params" fault sits in front of D: at the fault
rate it holds a request briefly and, when another one arrives meanwhile, exchanges their
`kv_transfer_params` (a router's metadata collision). Each then names live blocks of
another prompt; P refuses those reads (content mismatch) and the policy applies.
`kvbridge chaos` runs it at a chosen scale and prints a summary table; the test suite
runs it small.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx
import uvicorn

from kvbridge.config import CacheConfig, EngineConfig, KVRole, KVTransferConfig, LoadFailurePolicy, SchedulerConfig
from kvbridge.http_protocol import server_config
from kvbridge.engine.engine import LLMEngine
from kvbridge.engine.kv_connector_factory import build_connectors
from kvbridge.engine.loader import LoadedModel, load_model
from kvbridge.engine.sampling_params import SamplingParams
from kvbridge.kv_transfer.backends.corrupting import CorruptingBackend
from kvbridge.kv_transfer.backends.fake import FakeFabric, FaultConfig
from kvbridge.proxy.app import build_proxy_app
from kvbridge.server.api_server import bind_socket, build_app
from kvbridge.server.async_engine import AsyncEngine

MODEL = "SmolLM2-135M-Instruct"
TOPICS = ["the sea", "mountains", "a city at night", "coffee", "trains", "the moon", "autumn", "bees",
          "libraries", "rain", "bridges", "chess"]


@dataclass
class ChaosReport:
    requests: int = 0
    outcomes: Counter = field(default_factory=Counter)  # correct | clean_error | bad
    failures_by_class: dict[str, int] = field(default_factory=dict)
    expired_leases: int = 0
    early_releases: int = 0
    blocks_free: bool = False
    servers_alive: bool = False
    seconds: float = 0.0
    bad_examples: list[str] = field(default_factory=list)
    swapped: int = 0  # requests that reached D with another request's kv_transfer_params
    content_mismatches: int = 0  # reads P refused because the blocks held another prompt's KV
    corrupted_reads: int = 0  # reads D's CorruptingBackend delivered wrong (--corrupt-rate)
    digest_caught: int = 0  # D's loads failed by the KV digest (kv_content_mismatch)

    @property
    def ok(self) -> bool:
        return self.outcomes["bad"] == 0 and self.blocks_free and self.servers_alive

    def table(self) -> str:
        rows = [("requests", self.requests), ("correct", self.outcomes["correct"]),
                ("clean errors (HTTP 500, KV transfer failed)", self.outcomes["clean_error"]),
                ("bad (wrong text, other status, crash)", self.outcomes["bad"])]
        rows += [(f"failed loads: {k}", v) for k, v in sorted(self.failures_by_class.items())]
        rows += [("requests sent to D with swapped params", self.swapped),
                 ("P reads refused for another prompt's KV", self.content_mismatches),
                 ("reads delivered corrupted (--corrupt-rate)", self.corrupted_reads),
                 ("loads caught by the KV digest", self.digest_caught),
                 ("P leases expired", self.expired_leases), ("P early releases", self.early_releases),
                 ("all KV blocks free on P and D", self.blocks_free), ("servers alive", self.servers_alive),
                 ("wall time (s)", f"{self.seconds:.1f}")]
        width = max(len(str(k)) for k, _ in rows)
        return "\n".join(f"| {str(k).ljust(width)} | {v} |" for k, v in rows)


class ThreadServer:
    """A uvicorn server for `app` on a background thread, on 127.0.0.1 and an OS-chosen port."""

    def __init__(self, app, start_timeout_s: float = 60.0) -> None:
        sock = bind_socket("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(server_config(app, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        # uvicorn sets `started` with no event to wait on: poll it, but never forever. A server
        # whose start-up failed ends its thread; one that hangs is given up at the deadline.
        deadline = time.monotonic() + start_timeout_s
        while not self.server.started:
            if not self.thread.is_alive():
                sock.close()
                raise RuntimeError(f"the server for {self.url} exited during start-up")
            if time.monotonic() > deadline:
                self.server.should_exit = True  # the thread is a daemon: not joined, it may hang
                raise TimeoutError(f"the server for {self.url} did not start in {start_timeout_s} s")
            self.thread.join(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)


class ParamSwapper:
    """ASGI middleware: exchanges the kv_transfer_params of concurrent requests to `app`.

    A request with do_remote_prefill is picked at `rate`; it waits up to `window_s` for a
    partner (another picked request whose params name as many blocks, so D's admission
    check passes), and the two go on with each other's params. Unpartnered, it goes on
    unchanged. Runs on the server's event loop only.
    """

    def __init__(self, app, rate: float, rng: random.Random, window_s: float = 0.3) -> None:
        self.app, self.rate, self.rng, self.window_s = app, rate, rng, window_s
        # block count -> (a waiting request's params, the future that gets its partner's)
        self._pending: dict[int, tuple[dict, asyncio.Future]] = {}
        self.swapped = 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or self.rate <= 0:
            return await self.app(scope, receive, send)
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return await self.app(scope, _replay(b"", receive, [message]), send)
            body += message.get("body", b"")
            more = message.get("more_body", False)
        body = await self._maybe_swap(body)
        headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"]
        scope = {**scope, "headers": headers + [(b"content-length", str(len(body)).encode())]}
        await self.app(scope, _replay(body, receive), send)

    async def _maybe_swap(self, body: bytes) -> bytes:
        try:
            obj = json.loads(body)
            params = obj["kv_transfer_params"]
            blocks = params["remote_block_ids"]
            key = len(blocks) if params.get("do_remote_prefill") else None
        except (ValueError, KeyError, TypeError):
            return body
        if key is None or self.rng.random() >= self.rate:
            return body
        waiting = self._pending.pop(key, None)
        if waiting is not None:
            other, partner = waiting
            partner.set_result(params)  # the partner goes on with ours, we with theirs
        else:
            mine: asyncio.Future = asyncio.get_running_loop().create_future()
            self._pending[key] = (params, mine)
            try:
                other = await asyncio.wait_for(asyncio.shield(mine), self.window_s)
            except asyncio.TimeoutError:
                if not mine.done():  # nobody came: withdraw and go on unchanged
                    del self._pending[key]
                    return body
                other = mine.result()  # a partner came just as the wait ended
        self.swapped += 1
        obj["kv_transfer_params"] = other
        return json.dumps(obj).encode()


def _replay(body: bytes, receive, first: list | None = None):
    """An ASGI receive that yields `first` messages (or `body` as one request message), then
    defers to the original receive (for the disconnect)."""
    queued = list(first) if first is not None else [{"type": "http.request", "body": body, "more_body": False}]

    async def replay():
        return queued.pop(0) if queued else await receive()
    return replay


def make_engine(loaded: LoadedModel, role: KVRole | None, backend, policy: LoadFailurePolicy, engine_id: str,
            lease_s: float, num_blocks: int) -> LLMEngine:
    kv = None if role is None else KVTransferConfig(
        role=role, backend="fake", engine_id=engine_id, lease_seconds=lease_s, load_failure_policy=policy,
        handshake_timeout_s=2.0)
    config = EngineConfig(cache=CacheConfig(num_blocks=num_blocks), kv_transfer=kv, num_threads=1,
                          scheduler=SchedulerConfig(max_num_seqs=32))
    conns = build_connectors(config, loaded.arch, loaded.name, backend) if kv is not None else None
    return LLMEngine(config, loaded, conns)


def run_chaos(num_requests: int = 32, concurrency: int = 8, fault_rate: float = 0.2, seed: int = 0,
              policy: str = "recompute", max_tokens: int = 4, lease_s: float = 2.0,
              loaded: LoadedModel | None = None, swap_rate: float | None = None,
              swap_window_s: float = 0.3, corrupt_rate: float = 0.0) -> ChaosReport:
    """`swap_rate`: the swapped-params fault's rate (default: `fault_rate`); `corrupt_rate`: the
    fraction of D's reads a CorruptingBackend delivers wrong (corrupt, truncate, shift, foreign)."""
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    loaded = loaded or load_model(MODEL)
    rng = random.Random(seed)
    tok = loaded.tokenizer
    prompts = [f"Write a short line about {TOPICS[i % len(TOPICS)]}, variation {i // len(TOPICS)}."
               for i in range(max(4, min(num_requests, 24)))]
    reference = make_engine(loaded, None, None, LoadFailurePolicy.RECOMPUTE, "ref", lease_s, 256)
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0)
    want = {p: tok.decode(out) for p, out in
            zip(prompts, reference.generate([tok.encode(p) for p in prompts], greedy))}

    fabric = FakeFabric(seed=seed)
    pol = LoadFailurePolicy(policy)
    p_engine = AsyncEngine(make_engine(loaded, KVRole.PRODUCER, fabric.create_agent("P"), pol, "P", lease_s, 256))
    corrupting = CorruptingBackend(fabric.create_agent("D", FaultConfig.chaos(fault_rate)), corrupt_rate,
                                   seed=seed + 2)
    d_engine = AsyncEngine(make_engine(loaded, KVRole.CONSUMER, corrupting, pol, "D", lease_s, 256))
    swapper = ParamSwapper(build_app(d_engine), fault_rate if swap_rate is None else swap_rate,
                           random.Random(seed + 1), swap_window_s)
    servers = [ThreadServer(build_app(p_engine)), ThreadServer(swapper)]
    servers.append(ThreadServer(build_proxy_app([servers[0].url], [servers[1].url], health_interval_s=0.5)))
    report = ChaosReport(requests=num_requests)
    start = time.monotonic()
    try:
        asyncio.run(_drive(servers[2].url, [rng.choice(prompts) for _ in range(num_requests)], want,
                           concurrency, max_tokens, rng, report))
        report.blocks_free = _wait_free([p_engine, d_engine], timeout_s=lease_s * 3 + 10)
        report.servers_alive = all(httpx.get(s.url + "/health", timeout=5).status_code == 200 for s in servers)
        d_stats = d_engine._engine.connectors.worker.stats
        p_stats = p_engine._engine.connectors.worker.stats
        report.failures_by_class = dict(d_stats.failed_transfers)
        report.expired_leases, report.early_releases = p_stats.expired_leases, p_stats.early_releases
        report.swapped, report.content_mismatches = swapper.swapped, p_stats.content_mismatches
        report.corrupted_reads = sum(corrupting.counts.values())
        report.digest_caught = d_stats.failed_transfers.get("kv_content_mismatch", 0)
    finally:
        report.seconds = time.monotonic() - start
        for s in servers:
            s.stop()
        for e in (p_engine, d_engine):
            e.shutdown()
    return report


async def _drive(proxy_url: str, prompts: list[str], want: dict[str, str], concurrency: int, max_tokens: int,
                 rng: random.Random, report: ChaosReport) -> None:
    sem = asyncio.Semaphore(concurrency)
    streams = [rng.random() < 0.5 for _ in prompts]
    async with httpx.AsyncClient(base_url=proxy_url, timeout=120) as client:
        async def one(prompt: str, stream: bool) -> None:
            async with sem:
                body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                        "stream": stream}
                outcome, detail = await _request(client, body, stream, want[prompt])
                report.outcomes[outcome] += 1
                if outcome == "bad" and len(report.bad_examples) < 5:
                    report.bad_examples.append(detail)
        await asyncio.gather(*(one(p, s) for p, s in zip(prompts, streams)))


async def _request(client: httpx.AsyncClient, body: dict, stream: bool, want: str) -> tuple[str, str]:
    try:
        if not stream:
            r = await client.post("/v1/completions", json=body)
            if r.status_code == 200:
                text = r.json()["choices"][0]["text"]
                return ("correct", "") if text == want else ("bad", f"wrong text {text!r} != {want!r}")
            return _classify_error(r.status_code, r.text)
        text, error = "", None
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return _classify_error(r.status_code, (await r.aread()).decode())
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    error = json.dumps(chunk)
                elif chunk.get("choices"):
                    text += chunk["choices"][0].get("text", "")
        if error is not None:
            if text and not want.startswith(text):
                return "bad", f"wrong text {text!r} then error: {error}"
            return _classify_error(500, error)
        return ("correct", "") if text == want else ("bad", f"wrong streamed text {text!r} != {want!r}")
    except httpx.HTTPError as exc:
        return "bad", f"{type(exc).__name__}: {exc}"


def _classify_error(status: int, body: str) -> tuple[str, str]:
    if status == 500 and "KV transfer failed" in body:
        return "clean_error", ""
    return "bad", f"HTTP {status}: {body[:300]}"


def _wait_free(engines: list[AsyncEngine], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ms = [e.call_threadsafe(lambda eng: eng.metrics()).result(timeout=10) for e in engines]
        if all(m.num_free_blocks == m.num_total_blocks for m in ms):
            return True
        time.sleep(0.1)
    return False


def main(argv: list[str] | None = None) -> int:
    import argparse
    ap = argparse.ArgumentParser(prog="kvbridge chaos", description=__doc__)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--fault-rate", type=float, default=0.2, help="rate of each injected transfer fault")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policy", choices=["recompute", "fail", "auto"], default="recompute")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--swap-rate", type=float, default=None,
                    help="rate of the swapped-params fault in front of D (default: --fault-rate)")
    ap.add_argument("--corrupt-rate", type=float, default=0.0,
                    help="fraction of D's KV reads delivered wrong (a byte flipped, truncated, shifted by a "
                         "block, another request's blocks): every one must be caught by the KV digest")
    a = ap.parse_args(argv)
    report = run_chaos(a.requests, a.concurrency, a.fault_rate, a.seed, a.policy, a.max_tokens,
                       swap_rate=a.swap_rate, corrupt_rate=a.corrupt_rate)
    print(f"kvbridge chaos: {a.requests} requests, concurrency {a.concurrency}, fault rate {a.fault_rate}, "
          f"seed {a.seed}, policy {a.policy}\n")
    print(report.table())
    for ex in report.bad_examples:
        print("bad:", ex)
    return 0 if report.ok else 1
