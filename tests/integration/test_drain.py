"""Load and drain of one instance (issue 29), through real API servers on loopback: prefill,
decode and colocated instances of the real default model in this process, the tcp backend
between P and D, httpx and the official openai client.

- GET /kvbridge/load names the instance's role, its queue (requests, prompt tokens not yet
  computed, the oldest wait), its KV blocks and the leases it holds, and /metrics the same;
- POST /kvbridge/drain (or SIGTERM: the process tests at the end) refuses new work (503
  "draining" on /health and on generation requests) while admitted requests run to completion;
- past --drain-timeout-s a stream ends with a drain_timeout error event and [DONE], an
  unstreamed request gets a 503 body, and their blocks are freed;
- a draining P keeps serving its leases (D's reads, read-done, the proxy's release_kv) and is
  drained only once every lease ended, none by expiry.
After every test every KV block is back in its pool.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch is imported

import json
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import httpx
import openai
import pytest

from kvbridge.chaos import ThreadServer
from kvbridge.config import CacheConfig, EngineConfig, KVRole, KVTransferConfig, SchedulerConfig
from kvbridge.engine.engine import LLMEngine
from kvbridge.engine.kv_connector_factory import build_connectors
from kvbridge.engine.loader import LoadedModel, load_model
from kvbridge.server.api_server import build_app
from kvbridge.server.async_engine import AsyncEngine

MODEL = "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 512
NUM_BLOCKS = 64
LONG = {"max_tokens": 400, "ignore_eos": True}  # seconds on 2 cores: still running when the test acts
WAIT_S = 60.0  # the longest any one wait may take (a bug, not a slow machine)
START_S = 240.0  # a served process loads the model (seconds; minutes on a machine this busy)

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model(MODEL)


class Served:
    """One instance: an AsyncEngine and its app on a uvicorn thread."""

    def __init__(self, loaded: LoadedModel, role: KVRole | None, name: str, *, max_num_seqs: int = 4,
                 drain_timeout_s: float = 30.0, lease_seconds: float = 60.0, retention_seconds: float = 0.0) -> None:
        kv = (KVTransferConfig(role=role, backend="tcp", engine_id=name, lease_seconds=lease_seconds,
                               retention_seconds=retention_seconds)
              if role is not None else None)
        config = EngineConfig(model=MODEL, max_model_len=MAX_MODEL_LEN, num_threads=1, kv_transfer=kv,
                              cache=CacheConfig(num_blocks=NUM_BLOCKS),
                              scheduler=SchedulerConfig(max_num_seqs=max_num_seqs))
        connectors = build_connectors(config, loaded.arch, loaded.name) if kv is not None else None
        self.engine = AsyncEngine(LLMEngine(config, loaded, connectors))
        self.server = ThreadServer(build_app(self.engine, drain_timeout_s=drain_timeout_s))
        self.url = self.server.url

    def load(self) -> dict:
        r = httpx.get(self.url + "/kvbridge/load", timeout=10)
        assert r.status_code == 200, r.text
        return r.json()

    def stats(self) -> tuple[int, int, int]:
        """This instance's KV counters: (early releases, expired leases, KV reads completed)."""
        return self.engine.call_threadsafe(lambda e: (
            e.connectors.worker.stats.early_releases, e.connectors.worker.stats.expired_leases,
            e.connectors.worker.stats.transfers)).result(timeout=10)

    def close(self) -> None:
        self.engine.shutdown()  # first: it ends open streams, so the server's connections close
        self.server.stop()

    def assert_all_blocks_free(self) -> None:
        wait_for(f"{self.url}: every block free", lambda: self.load()["kv_blocks_used"] == 0)


def wait_for(what: str, condition: Callable[[], bool], timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def sse_events(lines: Iterator[str]) -> Iterator[dict | str]:
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            yield data if data == "[DONE]" else json.loads(data)


class Stream:
    """A streamed request on a thread of its own: `started` is set at its first content chunk."""

    def __init__(self, url: str, path: str, body: dict) -> None:
        self.started = threading.Event()
        self.events: list[dict | str] = []
        self.status: int | None = None
        self._thread = threading.Thread(target=self._run, args=(url + path, {**body, "stream": True}), daemon=True)
        self._thread.start()

    def _run(self, url: str, body: dict) -> None:
        try:
            with httpx.stream("POST", url, json=body, timeout=WAIT_S) as r:
                self.status = r.status_code
                for event in sse_events(r.iter_lines()):
                    self.events.append(event)
                    if isinstance(event, dict) and any(c.get("text") or c.get("delta", {}).get("content")
                                                       for c in event.get("choices", ())):
                        self.started.set()
        finally:
            self.started.set()

    def result(self) -> list[dict | str]:
        self._thread.join(4 * WAIT_S)
        assert not self._thread.is_alive(), "the stream never ended"
        return self.events


def assert_draining_answers(url: str) -> None:
    """/health and new generation requests answer 503 draining; the official client sees code draining."""
    health = httpx.get(url + "/health", timeout=10)
    assert (health.status_code, health.json()) == (503, {"status": "draining"})
    r = httpx.post(url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 4}, timeout=30)
    assert r.status_code == 503 and r.json()["error"]["code"] == "draining", r.text
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert caught.value.status_code == 503 and caught.value.code == "draining"


# ------------------------------------------------------------------ load


def test_load_names_role_blocks_and_leases_and_metrics_export_them(loaded) -> None:
    p, d, c = (Served(loaded, KVRole.PRODUCER, "P"), Served(loaded, KVRole.CONSUMER, "D"),
               Served(loaded, None, "C"))
    try:
        for inst, role in ((p, "prefill"), (d, "decode"), (c, "both")):
            load = inst.load()
            assert load.pop("kv_bytes_per_token") > 0  # the model's (the router's transfer cost)
            assert load == {"role": role, "running": 0, "waiting": 0, "queued_prompt_tokens": 0,
                            "oldest_wait_s": 0.0, "kv_blocks_total": NUM_BLOCKS, "kv_blocks_used": 0,
                            "leases_held": 0, "draining": False, "kv_blocks_retained": 0,
                            # the rates a router's cost model reads: none measured before a step
                            "waiting_prefill_tokens": 0, "kv_blocks_free": NUM_BLOCKS,
                            "prefill_tokens_per_s": None, "decode_step_s": None, "kv_pull_bytes_per_s": None}
        body = {"model": MODEL, "prompt": "Tell me about dragons.", "max_tokens": 8, "temperature": 0}
        params = httpx.post(p.url + "/v1/completions", timeout=60, json={
            **body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}).json()["kv_transfer_params"]
        held = p.load()
        assert held["leases_held"] == 1 and held["kv_blocks_used"] > 0 and held["running"] == 0
        metrics = httpx.get(p.url + "/metrics", timeout=10).text
        for line in ("kvbridge_leases_held 1.0", "kvbridge_draining 0.0", "kvbridge_queued_prompt_tokens 0.0",
                     "kvbridge_oldest_wait_seconds 0.0", 'kvbridge_instance_role{role="prefill"} 1.0'):
            assert line in metrics.splitlines(), line
        r = httpx.post(d.url + "/v1/completions", json={**body, "kv_transfer_params": params}, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"]
        wait_for("P's lease ended by D's read-done", lambda: p.load()["leases_held"] == 0)
        assert p.stats()[:2] == (0, 0) and d.stats()[2] == 1  # read (not recomputed), no release, no expiry
        for inst in (p, d, c):
            inst.assert_all_blocks_free()
    finally:
        for inst in (p, d, c):
            inst.close()


def test_load_counts_the_queue_prompt_tokens_and_the_oldest_wait(loaded) -> None:
    c = Served(loaded, None, "C", max_num_seqs=1)  # one request runs, the next one waits
    try:
        running = Stream(c.url, "/v1/completions", {"prompt": "Once upon a time", **LONG})
        assert running.started.wait(WAIT_S)
        queued_prompt = "The quick brown fox jumps over the lazy dog."
        queued = Stream(c.url, "/v1/completions", {"prompt": queued_prompt, **LONG})
        wait_for("the second request waits", lambda: c.load()["waiting"] == 1)
        first = c.load()
        assert first["running"] == 1
        assert first["queued_prompt_tokens"] == len(loaded.tokenizer.encode(queued_prompt, add_special_tokens=True))
        assert first["oldest_wait_s"] > 0.0
        wait_for("the wait grows", lambda: c.load()["oldest_wait_s"] > first["oldest_wait_s"])
        assert httpx.get(c.url + "/metrics", timeout=10).text.count("kvbridge_queued_prompt_tokens "
                                                                   f"{float(first['queued_prompt_tokens'])}") == 1
    finally:
        c.close()  # fails both streams: the engine shuts down
    assert running.result()[-1] == "[DONE]" and queued.result()[-1] == "[DONE]"
    m = c.engine._engine.metrics()  # the engine thread is gone: ours to read
    assert m.num_free_blocks == m.num_total_blocks


# ------------------------------------------------------------------ drain


def test_drain_refuses_new_work_and_lets_admitted_requests_finish(loaded) -> None:
    c = Served(loaded, None, "C", drain_timeout_s=300.0)  # a bound this test never reaches
    try:
        # Long enough that both still run when the drain starts, short enough to finish well within it.
        stream = Stream(c.url, "/v1/chat/completions",
                        {"messages": [{"role": "user", "content": "Count to twenty."}], "max_tokens": 100,
                         "ignore_eos": True})
        with ThreadPoolExecutor(1) as pool:
            assert stream.started.wait(WAIT_S)
            unstreamed: Future = pool.submit(httpx.post, c.url + "/v1/completions",
                                             json={"prompt": "Once upon a time", "max_tokens": 100,
                                                   "ignore_eos": True}, timeout=4 * WAIT_S)
            wait_for("both requests run", lambda: c.load()["running"] == 2)
            r = httpx.post(c.url + "/kvbridge/drain", timeout=10)
            assert (r.status_code, r.json()) == (202, {"draining": True, "drain_timeout_s": 300.0})
            assert c.load()["draining"] is True
            assert_draining_answers(c.url)
            again = httpx.post(c.url + "/kvbridge/drain", timeout=10)  # idempotent
            assert again.status_code == 202
            answer = unstreamed.result(4 * WAIT_S)
        assert answer.status_code == 200 and answer.json()["choices"][0]["finish_reason"] == "length"
        events = stream.result()
        assert events[-1] == "[DONE]" and not any(isinstance(e, dict) and "error" in e for e in events)
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        assert c.engine.wait_drained(WAIT_S)
        assert c.load()["draining"] is True
        c.assert_all_blocks_free()
    finally:
        c.close()


def test_a_drain_ends_retained_answers_and_retains_none_after(loaded) -> None:
    """--kv-retention-seconds far beyond the test: only the drain frees the retained blocks, and an answer
    that finishes while the instance drains is not retained."""
    c = Served(loaded, KVRole.BOTH, "R", retention_seconds=3600.0, drain_timeout_s=300.0)  # a bound never reached
    try:
        r = httpx.post(c.url + "/v1/completions", json={"prompt": "Once upon a time " * 12, "max_tokens": 20,
                                                        "ignore_eos": True}, timeout=60)
        assert r.status_code == 200
        retained = c.load()
        assert retained["kv_blocks_retained"] > 0 and retained["kv_blocks_used"] == 0  # reclaimable: not used
        assert "kvbridge_kv_retained_blocks" in httpx.get(c.url + "/metrics", timeout=10).text
        stream = Stream(c.url, "/v1/completions", {"prompt": "Tell me a story " * 12, "max_tokens": 100,
                                                   "ignore_eos": True})
        assert stream.started.wait(WAIT_S)
        assert httpx.post(c.url + "/kvbridge/drain", timeout=10).status_code == 202
        events = stream.result()  # finishes while draining: not retained
        assert events[-1] == "[DONE]" and not any(isinstance(e, dict) and "error" in e for e in events)
        assert c.engine.wait_drained(WAIT_S)
        outcomes = c.engine.call_threadsafe(lambda e: dict(e.lease_outcomes())).result(timeout=10)
        assert outcomes == {"release": 1}  # the first answer's retention, ended by the drain
        c.assert_all_blocks_free()
        assert c.load()["kv_blocks_retained"] == 0
    finally:
        c.close()


def test_drain_timeout_ends_streams_with_an_error_event_and_unstreamed_requests_with_503(loaded) -> None:
    c = Served(loaded, None, "C", drain_timeout_s=0.5)
    try:
        stream = Stream(c.url, "/v1/completions", {"prompt": "Once upon a time", **LONG})
        with ThreadPoolExecutor(1) as pool:
            assert stream.started.wait(WAIT_S)
            unstreamed: Future = pool.submit(httpx.post, c.url + "/v1/chat/completions",
                                             json={"messages": [{"role": "user", "content": "Hi"}], **LONG},
                                             timeout=WAIT_S)
            wait_for("both requests run", lambda: c.load()["running"] == 2)
            assert httpx.post(c.url + "/kvbridge/drain", timeout=10).status_code == 202
            answer = unstreamed.result(WAIT_S)
        assert answer.status_code == 503 and answer.json()["error"]["code"] == "drain_timeout", answer.text
        events = stream.result()
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "drain_timeout", events[-3:]
        assert c.engine.wait_drained(WAIT_S)
        c.assert_all_blocks_free()
    finally:
        c.close()


def test_a_draining_prefill_serves_its_leases_until_each_ended(loaded) -> None:
    p, d = Served(loaded, KVRole.PRODUCER, "P"), Served(loaded, KVRole.CONSUMER, "D")
    try:
        body = {"model": MODEL, "max_tokens": 8, "temperature": 0}

        def prefill(prompt: str) -> dict:
            r = httpx.post(p.url + "/v1/completions", timeout=60, json={
                **body, "prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
            assert r.status_code == 200, r.text
            return r.json()["kv_transfer_params"]
        read, released = prefill("Tell me about dragons."), prefill("Tell me about the sea.")
        assert httpx.post(p.url + "/kvbridge/drain", timeout=10).status_code == 202
        assert_draining_answers(p.url)
        assert p.load()["leases_held"] == 2 and not p.engine.drained
        # D reads the first lease's blocks from the draining P; its read-done ends the lease.
        r = httpx.post(d.url + "/v1/completions", json={**body, "prompt": "Tell me about dragons.",
                                                        "kv_transfer_params": read}, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"]
        wait_for("the read lease ended", lambda: p.load()["leases_held"] == 1)
        assert not p.engine.drained
        # The proxy's release (no D took the request) still reaches the draining P.
        r = httpx.post(p.url + "/kvbridge/release_kv", json={"kv_transfer_params": released}, timeout=10)
        assert r.json() == {"released": True}
        assert p.engine.wait_drained(WAIT_S)
        early, expired, _ = p.stats()
        assert (early, expired) == (1, 0) and d.stats()[2] == 1
        p.assert_all_blocks_free()
        d.assert_all_blocks_free()
    finally:
        p.close()
        d.close()


# ------------------------------------------------------------------ the process: SIGTERM


def start_server(drain_timeout_s: float) -> tuple[subprocess.Popen, str]:
    code = ("from kvbridge.config import CacheConfig, EngineConfig\n"
            "from kvbridge.server.api_server import run_server\n"
            "import sys\n"
            f"sys.exit(run_server(EngineConfig(model={MODEL!r}, max_model_len={MAX_MODEL_LEN}, num_threads=1, "
            f"cache=CacheConfig(num_blocks={NUM_BLOCKS})), '127.0.0.1', 0, None, 'warning', "
            f"drain_timeout_s={drain_timeout_s}))\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})
    return proc, printed_url(proc, START_S)


def printed_url(proc: subprocess.Popen, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    seen = []
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], deadline - time.monotonic())
        if not ready:
            break
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if line.startswith("kvbridge: serving"):
            return line.split(" at ", 1)[1].strip().removesuffix("/v1")
    raise AssertionError("no URL printed:\n" + "".join(seen))


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    proc.stdout.close()


def test_sigterm_drains_the_process_streams_finish_and_it_exits_0() -> None:
    proc, url = start_server(drain_timeout_s=60.0)
    try:
        stream = Stream(url, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 40,
                                                 "ignore_eos": True})
        assert stream.started.wait(WAIT_S)
        proc.send_signal(signal.SIGTERM)
        events = stream.result()
        assert events[-1] == "[DONE]" and not any(isinstance(e, dict) and "error" in e for e in events)
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        assert proc.wait(timeout=WAIT_S) == 0
    finally:
        stop(proc)


def test_a_second_sigterm_while_draining_stops_at_once() -> None:
    proc, url = start_server(drain_timeout_s=600.0)
    try:
        stream = Stream(url, "/v1/completions", {"prompt": "Once upon a time", **LONG})
        assert stream.started.wait(WAIT_S)
        proc.send_signal(signal.SIGTERM)
        wait_for("draining", lambda: httpx.get(url + "/health", timeout=10).status_code == 503)
        assert httpx.get(url + "/kvbridge/load", timeout=10).json()["draining"] is True
        proc.send_signal(signal.SIGTERM)
        events = stream.result()
        assert events[-1] == "[DONE]" and "shutting down" in events[-2]["error"]["message"]
        assert proc.wait(timeout=WAIT_S) == -signal.SIGTERM  # today's immediate shutdown: uvicorn re-raises it
    finally:
        stop(proc)
