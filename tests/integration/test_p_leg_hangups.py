"""Every way P's answer can fail to reach its caller ends P's lease at once (issue 44).

A client that hung up during the P leg used to pin P's blocks until the lease expired: the
proxy cancelled its P call, P's abort landed after its engine had finished the short prefill and
granted the lease, and nobody ever learned the params. Here the P leg's phases, each with the
event injected there, through real API servers on loopback (SmolLM2, TCP transfer backend,
60 s leases, so a lease that ends within the test's wait ended early):

- on P, the caller's connection closed: before admission (P's engine thread held so the request
  waits to be added), during a chunked prefill, after the grant but before the answer is written,
  and between the answer's status line and its body; unstreamed and streamed;
- the caller gave up after P wrote the answer, without reading it (its release key);
  and a release that overtook the answer;
- through the proxy: the client gone while the proxy reads P's written answer, and P's
  connection reset mid-read (the proxy then serves from D alone).

After each: nothing held on P (its leases_held 0, every block free), no lease expired, P still
serves, and a lease that was granted ended as an undelivered-answer release.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import socket
import threading
import time
from collections.abc import Callable

import httpx
import pytest

from kvbridge.chaos import ThreadServer
from kvbridge.config import CacheConfig, EngineConfig, KVRole, KVTransferConfig, SchedulerConfig
from kvbridge.engine.engine import LLMEngine
from kvbridge.engine.kv_connector_factory import build_connectors
from kvbridge.engine.loader import load_model
from kvbridge.openai_wire import RELEASE_KEY_HEADER
from kvbridge.proxy.app import proxy_app
from kvbridge.proxy.proxy import PDProxy
from kvbridge.proxy.routing import UpstreamKind, UpstreamPool, make_policy
from kvbridge.server.api_server import build_app
from kvbridge.server.async_engine import AsyncEngine

pytestmark = pytest.mark.timeout(300)

MODEL = "SmolLM2-135M-Instruct"
WAIT_S = 20.0  # far below the 60 s lease: a lease gone within it ended early
SHORT = "Tell me a story about a lighthouse keeper and the storm of {n}."
LONG = ("Once upon a time in a small village by the sea there lived an old fisherman who told the children "
        "stories about the storms he had seen and the ships he had saved. ") * 4 + "Story {n}:"


class Gate:
    """ASGI middleware on P: sees a completions request arrive, its disconnect reach the server,
    and can hold one of its answer's messages (`hold`: "start", the status line; "body", the
    first body message after it; "params", the first body message naming kv_transfer_params)
    until the test lets it go. One gated request at a time."""

    def __init__(self, app) -> None:
        self.app = app
        self.hold: str | None = None
        self.arrived = threading.Event()
        self.holding = threading.Event()
        self.disconnected = threading.Event()
        self.go = threading.Event()

    def arm(self, hold: str | None) -> None:
        self.hold = hold
        for event in (self.arrived, self.holding, self.disconnected, self.go):
            event.clear()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not scope["path"].endswith("/completions"):
            return await self.app(scope, receive, send)
        self.arrived.set()
        started = False

        async def watched_receive():
            message = await receive()
            if message["type"] == "http.disconnect":
                self.disconnected.set()
            return message

        async def held_send(message) -> None:
            nonlocal started
            body = message.get("body", b"")
            if (self.hold == "start" and message["type"] == "http.response.start"
                    or self.hold == "body" and started and message["type"] == "http.response.body"
                    or self.hold == "params" and b'"kv_transfer_params"' in body):
                self.hold = None
                # The request's body was read: the server's next message is the disconnect.
                heard = asyncio.ensure_future(watched_receive())
                self.holding.set()
                assert await asyncio.to_thread(self.go.wait, 60), "the test never let the answer go"
                heard.cancel()
            started = started or message["type"] == "http.response.start"
            await send(message)

        await self.app(scope, watched_receive, held_send)


@pytest.fixture(scope="module")
def loaded():
    return load_model(MODEL)


def _engine(loaded, role: KVRole, engine_id: str, **engine_args) -> AsyncEngine:
    config = EngineConfig(cache=CacheConfig(num_blocks=64), max_model_len=512, num_threads=1, **engine_args,
                          kv_transfer=KVTransferConfig(role=role, backend="tcp", engine_id=engine_id,
                                                       lease_seconds=60))
    return AsyncEngine(LLMEngine(config, loaded, build_connectors(config, loaded.arch, loaded.name)))


class P:
    def __init__(self, engine: AsyncEngine, gate: Gate, server: ThreadServer) -> None:
        self.engine, self.gate, self.server, self.url = engine, gate, server, server.url

    def stat(self, read: Callable) -> object:
        return self.engine.call_threadsafe(read).result(timeout=30)

    def held(self) -> int:
        return self.stat(lambda e: e.metrics().num_held_for_remote)

    def _sample(self, name: str) -> float:
        """The sum of a counter's samples on P's /metrics."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        return sum(float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith(name))

    def counters(self) -> tuple[int, float, float]:
        """Leases expired, undelivered answers released, requests ended (any outcome)."""
        expired = self.stat(lambda e: e.connectors.worker.stats.expired_leases)
        return (expired, self._sample("kvbridge_undelivered_answer_releases_total"),
                self._sample("kvbridge_requests_total"))

    def settled(self, before: tuple[int, float, float], released: int | None = None) -> None:
        """Once the test's request ended on P (counted; or, given `released`, once that many
        undelivered answers' leases ended): nothing held, every block free, no lease expired.
        Polled (a release lands a moment after the hang-up), well inside the lease."""
        deadline = time.monotonic() + WAIT_S
        if released is not None:
            self.released(before, released)
        else:
            while self._sample("kvbridge_requests_total") <= before[2] and time.monotonic() < deadline:
                time.sleep(0.01)
            assert self._sample("kvbridge_requests_total") > before[2], "P never ended the request"
        while self.held() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert self.held() == 0, "P still holds blocks for a reader that will never come"
        free, total = self.stat(lambda e: (e.metrics().num_free_blocks, e.metrics().num_total_blocks))
        assert free == total
        assert self.counters()[0] == before[0], "a lease expired"

    def released(self, before: tuple[int, float, float], n: int) -> None:
        """`n` undelivered answers' leases ended since `before` (counted after the release: polled)."""
        deadline = time.monotonic() + WAIT_S
        while self.counters()[1] < before[1] + n and time.monotonic() < deadline:
            time.sleep(0.01)
        assert self.counters()[1] == before[1] + n


@pytest.fixture(scope="module")
def p(loaded):
    engine = _engine(loaded, KVRole.PRODUCER, "P-hangups", scheduler=SchedulerConfig(max_num_batched_tokens=32))
    gate = Gate(build_app(engine))
    server = ThreadServer(gate)
    yield P(engine, gate, server)
    server.stop()
    engine.shutdown()


@pytest.fixture(scope="module")
def d_url(loaded):
    engine = _engine(loaded, KVRole.CONSUMER, "D-hangups")
    server = ThreadServer(build_app(engine))
    yield server.url
    server.stop()
    engine.shutdown()


def p_body(prompt: str, stream: bool = False) -> dict:
    """What the proxy sends P (proxy.prefill_body)."""
    return {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": stream,
            "kv_transfer_params": {"do_remote_decode": True}}


def raw_request(url: str, body: dict, headers: dict[str, str] | None = None, partial: bool = False) -> socket.socket:
    """A connection with the request written on it (`partial`: its body cut short), left open."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    payload = json.dumps(body).encode()
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n{extra}"
                 f"Content-Length: {len(payload)}\r\n\r\n".encode() + (payload[:10] if partial else payload))
    return sock


def serves(p: P) -> None:
    r = httpx.post(p.url + "/v1/completions", json=p_body(SHORT.format(n="again")), timeout=60)
    assert r.status_code == 200 and r.json()["kv_transfer_params"]["remote_block_ids"], r.text
    params = r.json()["kv_transfer_params"]
    released = httpx.post(p.url + "/kvbridge/release_kv", json={"kv_transfer_params": params}, timeout=30)
    assert released.json() == {"released": True}


def test_caller_gone_before_admission(p):
    before = p.counters()
    p.gate.arm(None)
    blocker = threading.Event()
    p.engine.call_threadsafe(lambda e: blocker.wait(60))  # P's engine thread: busy, adds nothing
    try:
        sock = raw_request(p.url, p_body(SHORT.format(n=1)))
        assert p.gate.arrived.wait(30)
        sock.close()
    finally:
        blocker.set()
    p.settled(before)
    serves(p)


def test_caller_gone_with_its_body_half_sent(p, caplog):
    before = p.counters()
    p.gate.arm(None)
    sock = raw_request(p.url, p_body(SHORT.format(n=2)), partial=True)
    assert p.gate.arrived.wait(30)
    sock.close()
    p.settled(before)
    p.released(before, 0)  # never admitted: nothing was leased
    # a caller gone mid-body is no server error (it was logged as "unexpected", with a traceback)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    serves(p)


def test_caller_gone_during_a_chunked_prefill(p):
    before = p.counters()
    p.gate.arm(None)
    sock = raw_request(p.url, p_body(LONG.format(n=3)))
    deadline = time.monotonic() + 30
    while not p.stat(lambda e: e.scheduler.has_unfinished()) and time.monotonic() < deadline:
        time.sleep(0.002)  # admitted: its prompt takes several 32-token steps
    sock.close()
    p.settled(before)
    serves(p)


@pytest.mark.parametrize("stream", [False, True], ids=["unstreamed", "streamed"])
@pytest.mark.parametrize("hold", ["start", "body"], ids=["before_the_answer", "between_status_and_body"])
def test_caller_gone_after_the_grant_before_the_answer_is_out(p, hold, stream):
    if stream and hold == "body":
        hold = "params"  # a stream's body comes in chunks: hold the one naming the lease
    before = p.counters()
    p.gate.arm(hold)
    sock = raw_request(p.url, p_body(SHORT.format(n=f"4-{hold}-{stream}"), stream))
    try:
        assert p.gate.holding.wait(60), "P never answered"
        assert p.held() == 1  # granted, its answer not handed over
        sock.close()
        assert p.gate.disconnected.wait(30), "P's server never heard of the hang-up"
    finally:
        p.gate.go.set()
    p.settled(before, released=1)  # a stream cut before its first chunk is not counted as a request
    serves(p)


def test_caller_that_gives_up_after_the_answer_was_written_releases_it_by_key(p):
    before = p.counters()
    p.gate.arm(None)
    key = secrets.token_hex(16)
    r = httpx.post(p.url + "/v1/completions", json=p_body(SHORT.format(n=5)), headers={RELEASE_KEY_HEADER: key},
                   timeout=60)
    assert r.status_code == 200 and p.held() == 1
    released = httpx.post(p.url + "/kvbridge/release_kv", json={"release_key": key}, timeout=30)
    assert released.json() == {"released": True}
    assert httpx.post(p.url + "/kvbridge/release_kv", json={"release_key": key}, timeout=30).json() == {
        "released": False}  # idempotent
    p.settled(before)
    p.released(before, 1)


def test_a_release_that_overtakes_its_answer_ends_the_lease_when_granted(p):
    before = p.counters()
    p.gate.arm(None)
    key = secrets.token_hex(16)
    assert httpx.post(p.url + "/kvbridge/release_kv", json={"release_key": key}, timeout=30).json() == {
        "released": False}
    r = httpx.post(p.url + "/v1/completions", json=p_body(SHORT.format(n=6)), headers={RELEASE_KEY_HEADER: key},
                   timeout=60)
    assert r.status_code == 200
    p.settled(before)
    p.released(before, 1)


@pytest.mark.parametrize("key", ["", "xyz", "A" * 32, "0" * 65, 7, None])
def test_a_bad_release_key_is_a_400_and_changes_nothing(p, key):
    r = httpx.post(p.url + "/kvbridge/release_kv", json={"release_key": key}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "release_key", r.text


# ---------------------------------------------------------------- through the proxy


class HoldP:
    """The proxy's upstream transport, wrapped: a P answer (the request carries a release key)
    is received whole from the real P, then its body is held from the proxy until the test says
    (`reset`: the read then fails as a reset connection would)."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner
        self.answered = threading.Event()
        self.go = threading.Event()
        self.reset = False

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        if RELEASE_KEY_HEADER.lower() not in request.headers:
            return response
        body = await response.aread()  # P wrote it all: from P's side, the answer is delivered
        await response.aclose()
        self.answered.set()
        hold = self

        class Held(httpx.AsyncByteStream):
            async def __aiter__(self):
                assert await asyncio.to_thread(hold.go.wait, 60), "the test never let the answer go"
                if hold.reset:
                    raise httpx.ReadError("connection reset by peer (injected)")
                yield body

        return httpx.Response(response.status_code, headers=response.headers, stream=Held(), request=request)

    async def aclose(self) -> None:
        await self.inner.aclose()


@pytest.fixture
def proxy(p, d_url):
    holds: list[HoldP] = []

    def wrap(inner):
        holds.append(HoldP(inner))
        return holds[-1]
    pd = PDProxy(UpstreamPool(UpstreamKind.PREFILL, [p.url], make_policy("round_robin")),
                 UpstreamPool(UpstreamKind.DECODE, [d_url], make_policy("round_robin")),
                 health_interval_s=60, health_timeout_s=5, timeout_s=60, connect_timeout_s=5, api_key=None,
                 upstream_api_key=None, wrap_transport=wrap)
    server = ThreadServer(proxy_app(pd))
    yield server.url, holds[0]
    holds[0].go.set()
    server.stop()


def test_client_gone_while_the_proxy_reads_ps_written_answer(p, proxy):
    url, hold = proxy
    before = p.counters()
    p.gate.arm(None)
    body = {"model": MODEL, "prompt": SHORT.format(n=7), "max_tokens": 8, "temperature": 0, "stream": True}
    sock = raw_request(url, body)
    try:
        assert hold.answered.wait(60), "P never answered"
        assert p.held() == 1
        sock.close()  # the proxy cancels its P call, the answer unread
        p.settled(before)
    finally:
        hold.go.set()
    p.released(before, 1)


def test_ps_connection_reset_mid_read_ends_the_lease_and_d_serves_alone(p, proxy):
    url, hold = proxy
    before = p.counters()
    p.gate.arm(None)
    hold.reset = True
    hold.go.set()
    body = {"model": MODEL, "prompt": SHORT.format(n=8), "max_tokens": 8, "temperature": 0}
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text  # the decode-only fallback
    p.settled(before)
    p.released(before, 1)
