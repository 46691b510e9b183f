"""KV events from real `kvbridge serve` processes (the default model, a small KV cache, loopback):
a router's subscriber and fleet index (kv_events/subscriber.py, index.py) learn exactly what each
instance cached; the hashes agree across instances and after a restart; eviction reaches the
index; GET /kvbridge/kv_events and /kvbridge/load answer per their contract."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from kvbridge.engine.setup.default_model import DEFAULT_MODEL
from kvbridge.kv_events.index import FleetIndex
from kvbridge.kv_events.subscriber import EventSubscriber

NUM_BLOCKS = 12
BLOCK = 16
READY = re.compile(r"kvbridge: serving \S+ at (http://127\.0\.0\.1:\d+)/v1")
EVENTS = '{"enable_kv_cache_events": true, "replay_endpoint": "tcp://127.0.0.1:*", "topic": "kv"}'


class Serve:
    def __init__(self, log: Path) -> None:
        self.log = log
        env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "UCX_NET_DEVICES": "lo"}
        with open(log, "w") as out:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "kvbridge.cli", "serve", "default", "--port", "0", "--num-threads", "1",
                 "--dtype", "float32", "--num-blocks", str(NUM_BLOCKS), "--kv-events-config", EVENTS],
                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + 180
        try:  # the log is the only readiness signal a `serve` on port 0 gives: polled, bounded
            while (m := READY.search(log.read_text())) is None:
                assert self.popen.poll() is None, f"serve exited:\n{log.read_text()}"
                assert time.monotonic() < deadline, f"serve not ready:\n{log.read_text()}"
                time.sleep(0.2)
        except BaseException:
            self.stop()  # not yet the fixture's: stopped here
            raise
        self.url = m.group(1)
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", timeout=60, max_retries=0)

    def get(self, path: str) -> dict:
        r = httpx.get(self.url + path, timeout=10)
        assert r.status_code == 200
        return r.json()

    def complete(self, prompt: list[int], max_tokens: int = 1) -> int:
        """The local prefix hit the instance reports for this prompt (usage.cached_tokens)."""
        r = self.client.completions.create(model=DEFAULT_MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0)
        return r.usage.prompt_tokens_details.cached_tokens

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGINT)
            try:
                self.popen.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=10)


def _subscribe(index: FleetIndex, name: str, info: dict) -> EventSubscriber:
    return EventSubscriber(name, index, info["endpoint"], info["replay_endpoint"], info["topic"], replay_timeout_s=5)


def _until(sub: EventSubscriber, done, timeout_s: float = 20.0) -> None:
    """Ingest `sub`'s messages until `done()` holds (each wait is the socket's, bounded)."""
    deadline = time.monotonic() + timeout_s
    sub.catch_up()  # a batch published before the subscription reached the PUB is only in the replay
    while not done():
        assert time.monotonic() < deadline, "the index did not get there in time"
        sub.run_once(0.5)


@pytest.fixture
def two(tmp_path):
    started: list[Serve] = []
    try:
        for i in range(2):
            started.append(Serve(tmp_path / f"serve{i}.log"))
        yield started, tmp_path
    finally:
        for s in started:
            s.stop()


def test_two_instances_publish_what_they_cached_alike_and_after_a_restart(two):
    (a, b), tmp_path = two
    ia, ib = a.get("/kvbridge/kv_events"), b.get("/kvbridge/kv_events")
    for info in (ia, ib):
        assert info["enabled"] is True and info["block_size"] == BLOCK and info["data_parallel_rank"] == 0
        assert re.fullmatch(r"tcp://127\.0\.0\.1:\d+", info["endpoint"]) and info["endpoint"] != info["replay_endpoint"]
    assert ia["hash_root"] == ib["hash_root"] and ia["endpoint"] != ib["endpoint"]
    index = FleetIndex(bytes.fromhex(ia["hash_root"]), BLOCK)
    subs = {"a": _subscribe(index, "a", ia), "b": _subscribe(index, "b", ib)}
    try:
        prompt = list(range(1000, 1050))  # 3 full blocks + 2 tokens
        assert a.complete(prompt) == 0 and b.complete(prompt) == 0
        cached = a.complete(prompt)  # the local hit the instance reports, in whole blocks
        assert cached == 3 * BLOCK and b.complete(prompt) == cached
        for name in ("a", "b"):
            _until(subs[name], lambda n=name: index.overlap(n, prompt) == cached // BLOCK)
        # Streamed chat reports its local hit too.
        chat = [{"role": "user", "content": "Name three colours of the rainbow, please, in one line."}]
        for _ in range(2):
            stream = a.client.chat.completions.create(model=DEFAULT_MODEL, messages=chat, max_tokens=2, temperature=0,
                                                      stream=True, stream_options={"include_usage": True})
            usage = [c.usage for c in stream if c.usage is not None][-1]
        assert usage.prompt_tokens_details.cached_tokens == (usage.prompt_tokens - 1) // BLOCK * BLOCK > 0
        # Eviction: a prompt that needs every block evicts the cached ones; the index follows.
        assert a.complete(list(range(2000, 2000 + BLOCK * NUM_BLOCKS - 1))) == 0
        _until(subs["a"], lambda: index.overlap("a", prompt) == 0)
        assert index.overlap("b", prompt) == 3
        load = a.get("/kvbridge/load")
        assert load["kv_blocks_total"] == NUM_BLOCKS and load["kv_blocks_free"] == NUM_BLOCKS
        assert load["waiting"] == load["running"] == load["waiting_prefill_tokens"] == 0
        assert load["prefill_tokens_per_s"] > 0 and load["decode_step_s"] > 0  # the chat decoded a token
        assert load["kv_pull_bytes_per_s"] is None and load["kv_bytes_per_token"] > 0
        # A restart of b: the same root, the same hashes from a fresh process.
        subs.pop("b").close()
        b.stop()
        b2 = Serve(tmp_path / "serve2.log")
        two[0].append(b2)
        ib2 = b2.get("/kvbridge/kv_events")
        assert ib2["hash_root"] == ia["hash_root"]
        index.reset("b")
        subs["b"] = _subscribe(index, "b", ib2)
        assert b2.complete(prompt) == 0
        _until(subs["b"], lambda: index.overlap("b", prompt) == 3)
    finally:
        for s in subs.values():
            s.close()


def test_bad_kv_events_config_is_a_cli_error(tmp_path):
    r = subprocess.run([sys.executable, "-m", "kvbridge.cli", "serve", "--kv-events-config", '{"publisher": "kafka"}'],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--kv-events-config: publisher" in r.stderr


def test_up_publishes_events_from_every_instance_and_pd_caches_on_both(smollm2_pd_cluster):
    urls = smollm2_pd_cluster.urls
    infos = {u: httpx.get(u + "/kvbridge/kv_events", timeout=10).json() for u in (*urls.prefill, *urls.decode)}
    assert all(i["enabled"] for i in infos.values())
    assert len({i["endpoint"] for i in infos.values()}) == len(infos)  # a port of its own each
    assert len({i["hash_root"] for i in infos.values()}) == 1
    first = next(iter(infos.values()))
    index = FleetIndex(bytes.fromhex(first["hash_root"]), first["block_size"])
    subs = {u: _subscribe(index, u, i) for u, i in infos.items()}
    try:
        bs = first["block_size"]
        prompt = list(range(3000, 3000 + 3 * bs + 2))
        client = openai.OpenAI(base_url=urls.proxy + "/v1", api_key="none", timeout=60, max_retries=0)
        client.completions.create(model=DEFAULT_MODEL, prompt=prompt, max_tokens=2, temperature=0)
        for u, sub in subs.items():  # P computed the prompt, D read it: both cached its full blocks
            _until(sub, lambda u=u: index.overlap(u, prompt) == 3)
    finally:
        for s in subs.values():
            s.close()
