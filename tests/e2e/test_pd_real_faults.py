"""Real faults between real processes on loopback (nixl backend): a prefill process
killed with SIGKILL before D reads, a prefill restarted under the same address, and a
wrong side-channel port. D follows its policy: recompute answers exactly what a clean
transfer would; fail answers HTTP 500 with an OpenAI error body. D stays alive."""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import httpx
import pytest

from kvbridge.config import CacheConfig, EngineConfig
from kvbridge.engine.engine import LLMEngine
from kvbridge.engine.loader import load_model
from kvbridge.engine.sampling_params import SamplingParams
from kvbridge.launcher.cluster import child_env, free_ports, spawn_child, stop_children

import os

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "Write one sentence about the moon and its influence on the tides of the ocean."
BODY = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0}


class Instance:
    def __init__(self, name: str, args: list[str], log_dir: Path, port: int | None = None) -> None:
        self.port = port or free_ports(1)[0]
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [sys.executable, "-m", "kvbridge.cli", "serve", MODEL, "--port", str(self.port),
                "--num-blocks", "64", "--max-model-len", "512", "--num-threads", "1", "--dtype", "float32", *args]
        self.child = spawn_child(name, argv, child_env(os.environ, loopback_only=True, num_threads=1), log_dir)

    def wait_healthy(self, timeout_s: float = 180) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.child.alive(), self.child.log_path.read_text()[-2000:]
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{self.url} not healthy")

    def metric(self, name: str) -> float:
        text = httpx.get(self.url + "/metrics", timeout=10).text
        return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.M))


@pytest.fixture(scope="module")
def want():
    loaded = load_model(MODEL)
    e = LLMEngine(EngineConfig(cache=CacheConfig(num_blocks=64)), loaded)
    return loaded.tokenizer.decode(e.generate([loaded.tokenizer.encode(PROMPT)],
                                              SamplingParams(max_tokens=6, temperature=0))[0])


@pytest.fixture(scope="module")
def procs(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("logs")
    started: list[Instance] = []

    def start(name, args, port=None):
        inst = Instance(name, args, log_dir, port)
        started.append(inst)
        return inst
    yield start
    stop_children([i.child for i in started], grace_s=10)


def spawn_prefill(procs, name, port=None, sc_port=None) -> tuple[Instance, int]:
    sc_port = sc_port or free_ports(1)[0]
    p = procs(name, ["--kv-role", "producer", "--kv-backend", "nixl", "--kv-engine-id", "P",
                     "--kv-side-channel-port", str(sc_port), "--kv-lease-seconds", "5"], port)
    return p, sc_port


@pytest.fixture(scope="module")
def spare_prefills(procs) -> list[tuple[Instance, int]]:
    """A fresh prefill for each test (each kills its own), started with the decoders: a server
    spends its seconds of start-up on about one core, so started together they use both."""
    return [spawn_prefill(procs, f"prefill-{i}") for i in range(2)]


@pytest.fixture(scope="module")
def decoders(procs, spare_prefills):
    d_re = procs("d-recompute", ["--kv-role", "consumer", "--kv-backend", "nixl", "--kv-engine-id", "D1",
                                 "--kv-handshake-timeout", "2"])
    d_fail = procs("d-fail", ["--kv-role", "consumer", "--kv-backend", "nixl", "--kv-engine-id", "D2",
                              "--kv-load-failure-policy", "fail", "--kv-handshake-timeout", "2"])
    d_re.wait_healthy()
    d_fail.wait_healthy()
    return d_re, d_fail


def start_prefill(procs, spares, port=None, sc_port=None):
    """A spare prefill not used yet, or (with the ports of one killed: a restart) a new one."""
    if port is None and sc_port is None and spares:
        p, sc_port = spares.pop(0)
    else:
        p, sc_port = spawn_prefill(procs, f"prefill-on-{port}", port, sc_port)
    p.wait_healthy()
    return p, sc_port


def prefill(p: Instance) -> dict:
    r = httpx.post(p.url + "/v1/completions", timeout=60,
                   json={**BODY, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 200, r.text
    return r.json()["kv_transfer_params"]


def decode(d: Instance, params: dict) -> httpx.Response:
    return httpx.post(d.url + "/v1/completions", json={**BODY, "kv_transfer_params": params}, timeout=60)


def test_killed_prefill_and_wrong_port_follow_each_policy(procs, decoders, spare_prefills, want):
    d_re, d_fail = decoders
    p, _ = start_prefill(procs, spare_prefills)
    params = prefill(p)
    assert decode(d_re, params).json()["choices"][0]["text"] == want  # a clean transfer first

    # A wrong side-channel port: the handshake is refused.
    bad = {**prefill(p), "remote_port": free_ports(1)[0]}
    assert decode(d_re, bad).json()["choices"][0]["text"] == want
    r = decode(d_fail, {**prefill(p), "remote_port": bad["remote_port"]})
    assert r.status_code == 500 and "KV transfer failed" in r.json()["error"]["message"]
    assert r.json()["error"]["code"] == "kv_transfer_failed"  # the proxy tells it from D's own failures

    # P dies with SIGKILL after answering, before D reads.
    params_re, params_fail = prefill(p), prefill(p)
    p.child.popen.kill()
    p.child.popen.wait()
    assert decode(d_re, params_re).json()["choices"][0]["text"] == want
    r = decode(d_fail, params_fail)
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    assert "retried" in r.json()["error"]["message"]
    for d in decoders:  # alive, counted, and nothing left allocated
        assert httpx.get(d.url + "/health").status_code == 200
        assert d.metric("kvbridge_kv_failed_transfers_total") >= 2
        assert d.metric("kvbridge_kv_cache_free_blocks") == d.metric("kvbridge_kv_cache_total_blocks")


def test_prefill_restarted_under_the_same_address(procs, decoders, spare_prefills, want):
    d_re, _ = decoders
    p, sc_port = start_prefill(procs, spare_prefills)
    assert decode(d_re, prefill(p)).json()["choices"][0]["text"] == want  # D handshakes with P
    port = p.port
    p.child.popen.kill()
    p.child.popen.wait()
    p2, _ = start_prefill(procs, spare_prefills, port=port, sc_port=sc_port)  # same engine id, same ports
    before = d_re.metric("kvbridge_kv_failed_transfers_total")
    assert decode(d_re, prefill(p2)).json()["choices"][0]["text"] == want
    assert d_re.metric("kvbridge_kv_failed_transfers_total") == before  # re-handshook, no failure
    deadline = time.monotonic() + 10
    while p2.metric("kvbridge_kv_held_blocks") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert p2.metric("kvbridge_kv_held_blocks") == 0
