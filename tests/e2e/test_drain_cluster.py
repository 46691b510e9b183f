"""Drain with real processes (issue 29): a `kvbridge up` cluster (LocalCluster: one prefill and
one decode `kvbridge serve` of a tiny random-weight Llama, tcp backend, the real proxy), the
official openai client.

1. SIGTERM the prefill instance while 8 clients stream through the proxy: no client request
   fails (the proxy retries the refused prefills, then falls back to decode-only), the prefill
   process exits 0 once every lease it granted ended, none by expiry (its drained log line
   counts them), and every block is free on the decode instance.
2. SIGTERM the decode instance while a stream runs longer than its --drain-timeout-s: the stream
   ends with a drain_timeout error event and [DONE], and the process exits 0 with every block
   back in its pool.
"""

from __future__ import annotations

import json
import re
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from kvbridge.engine.loader import load_model
from kvbridge.engine.loader.synthetic import TINY_4_KV_HEADS, write_synthetic_folder
from kvbridge.launcher.cluster import ChildProcess, LocalCluster

SMOLLM2 = "SmolLM2-135M-Instruct"
CLIENTS = 8
DRAIN_TIMEOUT_S = 0.5
WAIT_S = 120.0  # the longest any one wait may take (a bug, not a slow machine)

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("tiny-drain")
    write_synthetic_folder(folder, load_model(SMOLLM2).tokenizer, **TINY_4_KV_HEADS)
    return str(folder)


def wait_for(what: str, condition: Callable[[], bool], timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


class Clients:
    """CLIENTS threads, each streaming one completion after another through the proxy until stopped."""

    def __init__(self, proxy: str, model: str) -> None:
        self.model = model
        self.client = OpenAI(base_url=proxy + "/v1", api_key="unused", max_retries=0, timeout=WAIT_S)
        self.lock = threading.Condition()
        self.completed = 0
        self.failures: list[str] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(CLIENTS)]
        for t in self.threads:
            t.start()

    def _run(self, i: int) -> None:
        n = 0
        while not self.stop.is_set():
            n += 1
            failure = self._one(f"Client {i}, request {n}: tell me about the sea and the sky.")
            with self.lock:
                if failure is None:
                    self.completed += 1
                else:
                    self.failures.append(failure)
                self.lock.notify_all()

    def _one(self, prompt: str) -> str | None:
        """None when the stream ended as a complete answer, else what went wrong."""
        try:
            stream = self.client.completions.create(model=self.model, prompt=prompt, max_tokens=32, temperature=0,
                                                    stream=True, extra_body={"ignore_eos": True})
            chunks = list(stream)
        except Exception as exc:  # noqa: BLE001 - every failure is the test's finding
            return f"{prompt}: {type(exc).__name__}: {exc}"
        reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        return None if reasons == ["length"] and text else f"{prompt}: finish reasons {reasons}, text {text!r}"

    def wait_completed(self, count: int) -> None:
        with self.lock:
            assert self.lock.wait_for(lambda: self.completed >= count or self.failures, WAIT_S), "clients stalled"
            assert not self.failures, self.failures[:3]

    def finish(self) -> list[str]:
        self.stop.set()
        for t in self.threads:
            t.join(WAIT_S)
        assert not any(t.is_alive() for t in self.threads)
        return self.failures


def drained_line(child: ChildProcess) -> str:
    lines = [line for line in child.log_path.read_text().splitlines() if "drained:" in line]
    assert len(lines) == 1, child.tail(40)
    return lines[0]


def load(url: str) -> dict:
    return httpx.get(url + "/kvbridge/load", timeout=10, trust_env=False).json()


def test_sigterm_drains_prefill_under_traffic_then_decode_past_its_timeout(model, tmp_path_factory) -> None:
    cluster = LocalCluster(model, port=0, kv_backend="tcp", num_threads=1, log_dir=tmp_path_factory.mktemp("logs"),
                           extra_serve_args=["--drain-timeout-s", str(DRAIN_TIMEOUT_S), "--num-blocks", "512"],
                           proxy_args=["--health-interval", "0.5"])
    with cluster:
        urls = cluster.urls
        prefill, decode = (next(c for c in cluster.children if c.name == name) for name in ("prefill-0", "decode-0"))
        served = load(urls.prefill[0])
        assert (served["role"], load(urls.decode[0])["role"]) == ("prefill", "decode")

        # 1. The prefill instance drains under traffic.
        served_name = Path(model).name  # the name a model folder is served under
        clients = Clients(urls.proxy, served_name)
        try:
            clients.wait_completed(CLIENTS)  # every client is in its stride: requests are in flight
            wait_for("P holds a lease", lambda: load(urls.prefill[0])["leases_held"] > 0)  # D reads under the drain
            prefill.popen.send_signal(signal.SIGTERM)
            assert prefill.popen.wait(timeout=WAIT_S) == 0, prefill.tail(40)
            clients.wait_completed(clients.completed + 2 * CLIENTS)  # served without P: decode-only fallback
        finally:
            failures = clients.finish()
        assert failures == []
        line = drained_line(prefill)
        outcomes = dict(re.findall(r"(\w+)=(\d+)", line.split("leases ended since start:", 1)[1]))
        assert int(outcomes.get("read_done", 0)) >= 1 and "expired" not in outcomes, line
        assert "kv_blocks_used=0" in line, line
        wait_for("every block free on D", lambda: load(urls.decode[0])["kv_blocks_used"] == 0)

        # 2. The decode instance drains with a stream that outlasts its drain timeout.
        body = {"model": served_name, "prompt": "Once upon a time", "max_tokens": 4000, "ignore_eos": True, "stream": True}
        events: list = []
        with httpx.stream("POST", urls.proxy + "/v1/completions", json=body, timeout=WAIT_S, trust_env=False) as r:
            assert r.status_code == 200
            lines = (line[len("data: "):] for line in r.iter_lines() if line.startswith("data: "))
            for data in lines:
                events.append(data if data == "[DONE]" else json.loads(data))
                if len(events) == 3:  # the stream runs: D drains under it
                    decode.popen.send_signal(signal.SIGTERM)
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "drain_timeout", events[-3:]
        assert len(events) < body["max_tokens"]  # cut by the drain timeout, not finished
        assert decode.popen.wait(timeout=WAIT_S) == 0, decode.tail(40)
        assert "kv_blocks_used=0" in drained_line(decode)
