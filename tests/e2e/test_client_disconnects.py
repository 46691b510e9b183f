"""Clients that hang up, end to end (issue 27): `kvbridge up`'s cluster (a real proxy, one P and
one D `kvbridge serve`, SmolLM2, NIXL, on loopback).

A client that closed its stream right after the status line killed D: D's abort while the
request's KV load was in flight sent the abort's final output, and when the load settled the
scheduler handed the request to the output stage again (KeyError in detokenize, engine dead).

- Through the proxy: streams closed right after the status line (D admitted the request, its
  read may be in flight); straight to D with P's real kv_transfer_params, plain and continued
  from P's token (`continue_from_token_ids`), closed the same way.
- A storm: 64 concurrent streams through the proxy, half of them closed at seeded random points
  (right after the headers, after a few chunks, mid-way); every stream read to its end answers
  what one colocated engine answers.
After each: P, D and the proxy healthy, D and P never logged a request touched after its final
output or a traceback, every block back in its pool on P and on D, no lease expired (P's leases
ended early, by D's release or read-done), and a normal request answers the colocated text.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from dataclasses import dataclass

import httpx
import pytest

from kvbridge.config import CacheConfig, EngineConfig
from kvbridge.engine.engine import LLMEngine
from kvbridge.engine.loader import load_model
from kvbridge.engine.sampling_params import SamplingParams
from kvbridge.launcher.cluster import LocalCluster
from tests.e2e.processes import metric

pytestmark = pytest.mark.timeout(600)

MODEL = "SmolLM2-135M-Instruct"
MAX_TOKENS = 24
# The "fresh timestamp", fixed so that the answers are too: every prompt of the module is
# its own (no other test's prompt has it), so none hits D's prefix cache and D reads P's KV.
TAG = 1764158400123456789
ANIMALS = ["cat", "dog", "fox", "owl", "whale", "horse", "otter", "crow"]
LONG_TAIL = (" It lived in a lighthouse on a rocky island, where storms came every winter and the keeper "
             "told it stories of ships, sailors, lost maps and a treasure nobody ever found. One night")


def story(i: int, long: bool = False) -> str:
    """The issue's prompt, numbered and fresh; `long` makes it several blocks (a longer read)."""
    return f"Tell me a story number {i} {TAG} about a {ANIMALS[i % len(ANIMALS)]}" + (LONG_TAIL if long else "")


# Issue 27's requests: through the proxy, then straight to D (plain, continued from P's token).
# On the old code D died within the first five of them through the proxy (in each of 7 tries),
# within the first three straight to D (6 tries).
VIA_PROXY = [story(i, long=i % 2 == 1) for i in range(1, 13)]
TO_D = [story(100 + i, long=i % 2 == 1) for i in range(6)]
TO_D_CONTINUED = [story(200 + i, long=i % 2 == 1) for i in range(6)]
NORMAL = [f"Write {k + 3} facts about the moon ({TAG}), one per line:" for k in range(3)]
# The storm: varied prompts (short and multi-block), greedy, 16 to 24 tokens.
STORM = [(story(1000 + i, long=i % 3 == 0) if i % 2 else
          f"Write {i % 5 + 2} facts about the number {i} ({TAG}), one per line:", 16 + 4 * (i % 3))
         for i in range(64)]
STORM_SEED = 27


class Want(dict):
    """(prompt, max_tokens) -> one colocated engine's greedy text; `tokens`: how many it has."""
    tokens: dict[tuple[str, int], int]


@pytest.fixture(scope="module")
def want() -> Want:
    loaded = load_model(MODEL)
    engine = LLMEngine(EngineConfig(cache=CacheConfig(num_blocks=320), num_threads=1), loaded)
    tok = loaded.tokenizer
    cases = sorted({*((p, MAX_TOKENS) for p in NORMAL + VIA_PROXY + TO_D + TO_D_CONTINUED), *STORM})
    outs = engine.generate([tok.encode(p) for p, _ in cases],
                           [SamplingParams(max_tokens=n, temperature=0) for _, n in cases])
    found = Want({case: tok.decode(out) for case, out in zip(cases, outs)})
    found.tokens = {case: len(out) for case, out in zip(cases, outs)}
    assert all(found.tokens[p, MAX_TOKENS] == MAX_TOKENS for p in NORMAL)  # a normal request says something
    # D still has tokens to compute after P's (each hang-up below is one abort on D)
    assert all(found.tokens[p, MAX_TOKENS] >= 4 for p in VIA_PROXY + TO_D + TO_D_CONTINUED)
    return found


@pytest.fixture
def cluster(smollm2_pd_cluster):
    """The session's shared cluster (tests/e2e/conftest.py: NIXL, one thread each, 320 blocks, a
    512-token context), every process healthy; checked after each test (blocks free, no lease expired)."""
    return smollm2_pd_cluster


def p_url(c: LocalCluster) -> str:
    return c.urls.prefill[0]


def d_url(c: LocalCluster) -> str:
    return c.urls.decode[0]


@dataclass(frozen=True)
class Counters:
    """What must not change while clients hang up (leases expired, requests failed on P or D), and
    D's aborted requests (one per client that left before its answer ended)."""

    expired_leases: tuple[float, float]  # P, D
    errors: tuple[float, float]  # P, D
    d_aborts: float
    log_sizes: dict[str, int]  # where each process's log stood

    @classmethod
    def read(cls, c: LocalCluster) -> Counters:
        try:
            return cls((metric(p_url(c), "kvbridge_kv_expired_leases_total"),
                        metric(d_url(c), "kvbridge_kv_expired_leases_total")),
                       (metric(p_url(c), "kvbridge_requests_total", outcome="error"),
                        metric(d_url(c), "kvbridge_requests_total", outcome="error")),
                       metric(d_url(c), "kvbridge_requests_total", outcome="abort"),
                       {ch.name: ch.log_path.stat().st_size for ch in c.children})
        except httpx.HTTPError as exc:
            pytest.fail(f"/metrics failed ({exc!r}):\n{logs(c)}")


def logs(c: LocalCluster) -> str:
    return "\n".join(f"--- {ch.name} ({ch.log_path}):\n{ch.tail(30)}" for ch in c.children)


def assert_healthy(c: LocalCluster) -> None:
    """Every process alive and its /health 200 (an engine that died answers 503)."""
    with httpx.Client(timeout=10, trust_env=False) as http:
        for child, url in zip(c.children, (*c.urls.prefill, *c.urls.decode, c.urls.proxy)):
            assert child.alive(), f"{child.name} exited with code {child.popen.returncode}:\n{logs(c)}"
            try:
                r = http.get(url + "/health")
            except httpx.HTTPError as exc:
                pytest.fail(f"{child.name}: /health failed ({exc!r}):\n{logs(c)}")
            assert r.status_code == 200, f"{child.name}: /health {r.status_code} {r.text}\n{logs(c)}"


def assert_settled(c: LocalCluster, timeout_s: float = 20.0) -> None:
    """Every block back in its pool on P and on D (polled: aborts and releases land a moment after
    the client hung up), well before P's 30 s lease could free one."""
    deadline = time.monotonic() + timeout_s
    while True:
        dead = c.first_dead_child()
        assert dead is None, f"{dead.name} exited with code {dead.popen.returncode}:\n{logs(c)}"
        try:
            state = {u: (metric(u, "kvbridge_kv_cache_free_blocks"), metric(u, "kvbridge_kv_cache_total_blocks"))
                     for u in (p_url(c), d_url(c))}
        except httpx.HTTPError as exc:
            pytest.fail(f"/metrics failed ({exc!r}):\n{logs(c)}")
        if all(free == total for free, total in state.values()):
            return
        assert time.monotonic() < deadline, f"KV blocks still allocated (free, total): {state}\n{logs(c)}"
        time.sleep(0.1)


def assert_no_second_output(c: LocalCluster, log_sizes: dict[str, int]) -> None:
    """Since the logs stood at `log_sizes`: no request was handed to the output stage after its
    final output (the engine's guard keeps D alive then, so only its log tells), and nothing
    raised in P, D or the proxy."""
    for child in c.children:
        with open(child.log_path, "rb") as log:
            log.seek(log_sizes[child.name])
            text = log.read().decode(errors="replace")
        for bad in ("after its final output", "building its output failed", "Traceback"):
            assert bad not in text, f"{child.name} logged {bad!r}:\n{child.tail(60)}"


def assert_unharmed(c: LocalCluster, before: Counters, hung_up: tuple[int, int]) -> None:
    """After clients hung up: P and D alive and healthy, every block free, no lease expired
    (each ended early, by D's release or read-done), no request failed, and between
    hung_up[0] and hung_up[1] requests aborted on D."""
    assert_settled(c)
    assert_healthy(c)
    assert_no_second_output(c, before.log_sizes)
    after = Counters.read(c)
    assert after.expired_leases == before.expired_leases, "a lease expired: D's release or read-done should end it"
    assert after.errors == before.errors, f"requests failed on P or D: {before} -> {after}\n{logs(c)}"
    assert hung_up[0] <= after.d_aborts - before.d_aborts <= hung_up[1], (before, after, hung_up)


def stream_text(url: str, prompt: str) -> str:
    """A streamed completion read to its end: its text."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    text = []
    with httpx.Client(timeout=120, trust_env=False) as http, http.stream("POST", url + "/v1/completions",
                                                                          json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[len("data: "):])
                assert "error" not in event, event
                text += [ch["text"] for ch in event["choices"]]
    return "".join(text)


def assert_serves_normally(c: LocalCluster, want: Want, prompt: str) -> None:
    """A streamed and an unstreamed request through the proxy answer the colocated text, and
    leave every block free."""
    assert stream_text(c.urls.proxy, prompt) == want[prompt, MAX_TOKENS]
    r = httpx.post(c.urls.proxy + "/v1/completions", timeout=120, trust_env=False,
                   json={"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want[prompt, MAX_TOKENS], r.text
    assert_settled(c)


def hang_up_after_status(c: LocalCluster, url: str, body: dict, headers: dict[str, str] | None = None) -> None:
    """POST a streamed request and close the connection as soon as the status line is in: D has
    admitted the request and its KV read may be in flight."""
    with httpx.Client(timeout=120, trust_env=False) as http:
        try:
            with http.stream("POST", url + "/v1/completions", json=body, headers=headers) as r:
                assert r.status_code == 200, f"{r.status_code} {r.read()!r}\n{logs(c)}"
            # leaving the block before reading the body closes the connection (never pooled)
        except httpx.HTTPError as exc:
            pytest.fail(f"{url}: {exc!r}\n{logs(c)}")


def streamed_body(prompt: str) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}


def test_streams_closed_after_the_status_line_through_the_proxy_leave_d_alive(cluster, want):
    assert_healthy(cluster)
    before = Counters.read(cluster)
    for prompt in VIA_PROXY:
        hang_up_after_status(cluster, cluster.urls.proxy, streamed_body(prompt))
    assert_unharmed(cluster, before, (len(VIA_PROXY), len(VIA_PROXY)))
    assert_serves_normally(cluster, want, NORMAL[0])


def prefill_on_p(c: LocalCluster, prompt: str, request_id: str) -> dict:
    """P's real kv_transfer_params for `prompt`, asked as the proxy asks (proxy.prefill_body)."""
    r = httpx.post(p_url(c) + "/v1/completions", timeout=120, trust_env=False, headers={"X-Request-Id": request_id},
                   json={"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": False,
                         "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 200, r.text
    params = r.json()["kv_transfer_params"]
    assert params["do_remote_prefill"] and params["generated_token_ids"], params
    return params


@pytest.mark.parametrize("continued", [False, True], ids=["plain", "continued_from_p"])
def test_streams_closed_after_the_status_line_straight_to_d_leave_d_alive(cluster, want, continued):
    """As the proxy would send them (same X-Request-Id on P and D), with and without P's token."""
    assert_healthy(cluster)
    before = Counters.read(cluster)
    prompts = TO_D_CONTINUED if continued else TO_D
    for prompt in prompts:
        request_id = f"issue27-{uuid.uuid4().hex}"
        params = prefill_on_p(cluster, prompt, request_id)
        body = {**streamed_body(prompt), "kv_transfer_params": params}
        if continued:
            body["continue_from_token_ids"] = params["generated_token_ids"]
        hang_up_after_status(cluster, d_url(cluster), body, {"X-Request-Id": request_id})
    assert_unharmed(cluster, before, (len(prompts), len(prompts)))
    assert_serves_normally(cluster, want, NORMAL[1])


async def storm_stream(http: httpx.AsyncClient, url: str, prompt: str, max_tokens: int,
                       quit_after: int | None) -> str | None:
    """One streamed request: its text read to the end, or None when it hung up after
    `quit_after` events (0: right after the headers)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    text, events = [], 0
    async with http.stream("POST", url + "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        if quit_after == 0:
            return None
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            assert line != "data: [DONE]" or quit_after is None, f"ended before event {quit_after}: {prompt!r}"
            if line == "data: [DONE]":
                break
            event = json.loads(line[len("data: "):])
            assert "error" not in event, event
            text += [ch["text"] for ch in event["choices"]]
            events += 1
            if quit_after is not None and events >= quit_after:
                return None  # leaving the block closes the connection mid-stream
    return "".join(text)


def test_a_storm_of_streams_half_of_them_hanging_up(cluster, want):
    """64 concurrent streams; a seeded half hangs up right after the headers, after a few events
    (P's token is the first) or mid-way (half the colocated answer's tokens: before its end)."""
    rng = random.Random(STORM_SEED)
    quitters = set(rng.sample(range(len(STORM)), len(STORM) // 2))
    quit_after: list[int | None] = []
    for i, case in enumerate(STORM):
        half = max(1, want.tokens[case] // 2)
        quit_after.append(rng.choice([0, rng.randint(1, min(3, half)), half]) if i in quitters else None)
    assert_healthy(cluster)
    before = Counters.read(cluster)

    async def storm() -> list[str | None]:
        limits = httpx.Limits(max_connections=len(STORM) + 8, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=180, trust_env=False, limits=limits) as http:
            return await asyncio.gather(*(storm_stream(http, cluster.urls.proxy, prompt, max_tokens, quit_after[i])
                                          for i, (prompt, max_tokens) in enumerate(STORM)))

    texts = asyncio.run(storm())
    read = [i for i, q in enumerate(quit_after) if q is None]
    wrong = {i: (texts[i], want[STORM[i]]) for i in read if texts[i] != want[STORM[i]]}
    assert not wrong, f"{len(wrong)} of {len(read)} streams read to the end differ from colocated: {wrong}"
    # A stream closed after some events may have been answered whole by D before it noticed.
    at_headers = sum(q == 0 for q in quit_after)
    assert_unharmed(cluster, before, (at_headers, len(quitters)))
    assert_serves_normally(cluster, want, NORMAL[2])


# ---------------------------------------------------------------- clients gone during the P leg (issue 44)

P_LEG = [story(300 + i, long=i % 2 == 1) for i in range(8)]
P_LEG_STORM = [story(400 + i, long=i % 3 == 0) for i in range(32)]
P_LEG_SEED = 44


def leases_held(c: LocalCluster) -> float:
    return metric(p_url(c), "kvbridge_leases_held")


async def close_after(url: str, body: dict, delay_s: float) -> None:
    """Write a whole request on a raw connection, wait `delay_s` (0: not at all), close it."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    payload = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: " + host.encode() + b"\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
    await writer.drain()
    if delay_s:
        await asyncio.sleep(delay_s)
    writer.close()
    await writer.wait_closed()


def test_clients_gone_while_p_prefills_leave_no_lease_held(cluster, want):
    """Issue 44: eight streams, each closed right after its request was written. The proxy cancels
    its P call; P's lease used to end only by expiry (30 s) when P's engine had finished first."""
    assert_healthy(cluster)
    before = Counters.read(cluster)

    async def hang_ups() -> None:
        for prompt in P_LEG:
            await close_after(cluster.urls.proxy, streamed_body(prompt), 0)
    asyncio.run(hang_ups())
    assert_unharmed(cluster, before, (0, len(P_LEG)))
    assert leases_held(cluster) == 0
    assert_serves_normally(cluster, want, NORMAL[0])


def test_a_storm_cut_at_random_points_of_the_p_leg_leaves_no_lease_held(cluster, want):
    """32 concurrent streams, each closed at a seeded random point between its request written and
    well past P's answer (P prefills a short prompt in tens of ms here): before P admits it, during
    the prefill, between P's answer and D, during D's read or stream."""
    rng = random.Random(P_LEG_SEED)
    delays = [rng.choice([0.0, rng.uniform(0, 0.05), rng.uniform(0.05, 0.4), rng.uniform(0.4, 1.5)])
              for _ in P_LEG_STORM]
    assert_healthy(cluster)
    before = Counters.read(cluster)

    async def storm() -> None:
        await asyncio.gather(*(close_after(cluster.urls.proxy, streamed_body(p), d)
                               for p, d in zip(P_LEG_STORM, delays)))
    asyncio.run(storm())
    assert_unharmed(cluster, before, (0, len(P_LEG_STORM)))
    assert leases_held(cluster) == 0
    assert_serves_normally(cluster, want, NORMAL[1])


LONG_PROMPT = " ".join(story(500 + i, long=True) for i in range(5))  # several hundred tokens: a prefill of ~0.1 s+


async def until_running(url: str, timeout_s: float = 60.0) -> None:
    """Until the instance at `url` runs a request (polled every few ms: an event, not a delay)."""
    deadline = time.monotonic() + timeout_s
    while await asyncio.to_thread(metric, url, "kvbridge_num_requests_running") == 0:
        assert time.monotonic() < deadline, f"{url} never ran the request"
        await asyncio.sleep(0.002)


@pytest.mark.parametrize("cut", ["written", "0.03s", "d_decoding"])
def test_a_proxy_killed_during_the_p_leg_leaves_no_lease_held(cluster, tmp_path, cut):
    """Issue 44, the proxy itself as the event: a second `kvbridge proxy` in front of the shared P
    and D is SIGKILLed at a cut point of a long prompt's request: right after it was written to the
    proxy, 30 ms later (before P admits it or while P prefills it: P's prefill of this prompt takes
    0.1-0.25 s here), and while D decodes it (P's answer read, the KV read: the cut waits for
    D's running request). Its connections close, and whatever P had granted ends at once (no
    expiry), by P's own release or by D's. No cut is a fixed time past P's answer: it could land in
    the instants between the proxy reading P's answer and D receiving the request, where a
    SIGKILLed proxy leaves P's lease to expire by design (docs/architecture.md, "Leases"; a 0.3 s
    cut did once under load, a 0.1 s cut on a quiet machine from a clean clone, where P answered
    within 0.1 s)."""
    import signal
    import subprocess
    import sys

    assert_healthy(cluster)
    before = Counters.read(cluster)
    log = open(tmp_path / "proxy.log", "w+")
    proxy = subprocess.Popen([sys.executable, "-m", "kvbridge.cli", "proxy", "--prefill", p_url(cluster), "--decode",
                              d_url(cluster), "--host", "127.0.0.1", "--port", "0"], stdout=subprocess.PIPE,
                             stderr=log, text=True)
    try:
        line = proxy.stdout.readline()  # printed once it serves
        assert line.startswith("kvbridge proxy: http://"), line
        url = line.split()[2]

        async def send_and_kill() -> None:
            # D decodes long enough (ignore_eos) for its running request to be seen
            body = {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 64, "ignore_eos": True, "temperature": 0,
                    "stream": True}
            task = asyncio.ensure_future(close_after(url, body, 60))
            if cut == "d_decoding":
                await until_running(d_url(cluster))
            else:  # a cut point, not a synchronisation
                await asyncio.sleep({"written": 0.01, "0.03s": 0.03}[cut])
            proxy.send_signal(signal.SIGKILL)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        asyncio.run(send_and_kill())
        proxy.wait(30)
    finally:
        if proxy.poll() is None:
            proxy.kill()
            proxy.wait()
        log.close()
    assert_unharmed(cluster, before, (0, 1))
    assert leases_held(cluster) == 0
