"""P/D between engines of different tensor-parallel sizes, end to end: real `kvbridge serve`
processes (with their rank processes), a real `kvbridge proxy` per pairing, the official
openai client, on loopback.

- A random-weight Llama with 4 KV heads (TP 1, 2 and 4 split it): P TP 2 -> D TP 1,
  P TP 1 -> D TP 2 and P TP 2 -> D TP 2, over NIXL and over tcp.
- SmolLM2-135M (3 KV heads): P TP 3 -> D TP 1 and P TP 1 -> D TP 3, over NIXL.
Greedy text equals one colocated TP 1 engine's; afterwards every block is free on every
instance, no lease expired, and every request's KV was read (no recompute, no failure).
- A P rank process killed with SIGKILL after its prefill: D recomputes (the default policy)
  and answers what the colocated engine answers, frees its blocks and serves the next request.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from kvbridge.config import CacheConfig, EngineConfig, KVRole
from kvbridge.engine.engine import LLMEngine
from kvbridge.engine.loader import load_model
from kvbridge.engine.loader.synthetic import TINY_4_KV_HEADS, write_synthetic_folder
from kvbridge.engine.sampling_params import SamplingParams
from kvbridge.launcher.cluster import (DEFAULT_CLI, ChildProcess, InstanceSpec, child_env, free_ports, http_url,
                                      proxy_command, serve_command, spawn_child, stop_children)
from tests.e2e.processes import gone, metric, rank_pids

SMOLLM2 = "SmolLM2-135M-Instruct"
MAX_TOKENS = 8
PROMPTS = ["Hello there",  # less than one block
           "The history of the Roman Empire spans many centuries, from the founding of the city to the fall "
           "of Constantinople. Summarise its three most important turning points:"]  # several blocks
START_S = 300.0


class Fleet:
    """Serve instances of one model (name -> role, TP size[, extra `kvbridge serve` arguments])
    and proxies between pairs of them."""

    def __init__(self, model: str, backend: str, instances: dict[str, tuple], log_dir: Path) -> None:
        self.model, self.log_dir = model, log_dir
        self.env = child_env(os.environ, loopback_only=True, num_threads=1)
        self.children: list[ChildProcess] = []
        self.urls: dict[str, str] = {}
        self.shared: set[str] = set()  # instances of the session's shared cluster (tests/e2e/conftest.py)
        self.expired_leases: dict[str, float] = {}  # name -> its expired leases before the test (shared ones)
        ports = free_ports(2 * len(instances))
        try:
            for k, (name, (role, tp, *extra)) in enumerate(instances.items()):
                spec = InstanceSpec(name, role, ports[2 * k], ports[2 * k + 1], f"{name}-{os.getpid()}", tp)
                argv = serve_command(DEFAULT_CLI, model, spec, host="127.0.0.1", kv_backend=backend, num_threads=1,
                                     extra_args=["--num-blocks", "64", "--max-model-len", "512", "--dtype", "float32",
                                                 *(extra or [[]])[0]])
                self._spawn(name, argv, http_url("127.0.0.1", spec.port))
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise

    def _spawn(self, name: str, argv: list[str], url: str) -> None:
        self.children.append(spawn_child(name, argv, self.env, self.log_dir))
        self.urls[name] = url

    def proxy(self, prefill: str, decode: str) -> str:
        name = f"proxy-{prefill}-{decode}"
        if name not in self.urls:
            port = free_ports(1)[0]
            self._spawn(name, proxy_command(DEFAULT_CLI, [self.urls[prefill]], [self.urls[decode]],
                                            host="127.0.0.1", port=port), http_url("127.0.0.1", port))
            self.wait_healthy([name])
        return self.urls[name]

    def adopt(self, name: str, url: str) -> None:
        """Name an instance this fleet did not start (one of the session's shared cluster's)."""
        self.urls[name] = url
        self.shared.add(name)

    def note_expired_leases(self) -> None:
        """Before a test: the shared instances' expired leases so far (earlier tests' own)."""
        self.expired_leases = {n: metric(self.urls[n], "kvbridge_kv_expired_leases_total") for n in self.shared}

    def child(self, name: str) -> ChildProcess:
        return next(c for c in self.children if c.name == name)

    def wait_healthy(self, names: list[str] | None = None, timeout_s: float = START_S) -> None:
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=5) as client:
            for child in self.children if names is None else map(self.child, names):
                while True:
                    assert child.alive(), f"{child.name} exited:\n{child.tail()}"
                    try:
                        if client.get(self.urls[child.name] + "/health").status_code == 200:
                            break
                    except httpx.HTTPError:
                        pass
                    assert time.monotonic() < deadline, f"{child.name} not healthy:\n{child.tail()}"
                    time.sleep(0.2)

    def stop(self) -> None:
        stop_children(self.children)


def assert_settled(fleet: Fleet, names: list[str], timeout_s: float = 15.0) -> None:
    """Every block free on every instance named, and no lease expired on any of them (on a shared
    instance: none since `note_expired_leases`)."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = {n: (metric(fleet.urls[n], "kvbridge_kv_cache_free_blocks"),
                     metric(fleet.urls[n], "kvbridge_kv_cache_total_blocks")) for n in names}
        if all(free == total for free, total in state.values()):
            break
        assert time.monotonic() < deadline, f"KV blocks still allocated: {state}"
        time.sleep(0.1)
    for n in names:
        assert metric(fleet.urls[n], "kvbridge_kv_expired_leases_total") == fleet.expired_leases.get(n, 0), n


def complete(url: str, model: str, prompt: str) -> str:
    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    return client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0).choices[0].text


class Reference:
    """One colocated TP 1 engine of the model, in this process: the answers P/D must give."""

    def __init__(self, model: str) -> None:
        self.loaded = load_model(model)
        self.engine = LLMEngine(EngineConfig(cache=CacheConfig(num_blocks=64), num_threads=1), self.loaded)

    def __call__(self, prompt: str) -> str:
        tok = self.loaded.tokenizer
        return tok.decode(self.engine.generate([tok.encode(prompt)], SamplingParams(max_tokens=MAX_TOKENS,
                                                                                    temperature=0))[0])


def check_pairing(fleet: Fleet, served: str, want: Reference, prefill: str, decode: str) -> None:
    """The prompts, made unique to the pairing (no prefix-cache hit from another pairing on D)."""
    reads_before = metric(fleet.urls[decode], "kvbridge_kv_transfers_total")
    url = fleet.proxy(prefill, decode)
    for prompt in PROMPTS:
        prompt = f"[{prefill} to {decode}] {prompt}"
        assert complete(url, served, prompt) == want(prompt), (prefill, decode, prompt)
    assert metric(fleet.urls[decode], "kvbridge_kv_transfers_total") == reads_before + len(PROMPTS)


# ---- the 4-KV-head model, NIXL and tcp ------------------------------------------------------

TINY = {"p1": (KVRole.PRODUCER, 1), "p2": (KVRole.PRODUCER, 2), "d1": (KVRole.CONSUMER, 1),
        "d2": (KVRole.CONSUMER, 2)}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("tiny-4-kv-heads")
    write_synthetic_folder(folder, load_model(SMOLLM2).tokenizer, **TINY_4_KV_HEADS)
    return str(folder)


@pytest.fixture(scope="module")
def tiny_want(tiny_model) -> Reference:
    return Reference(tiny_model)


@pytest.fixture(scope="module", params=["nixl", "tcp"])
def tiny_fleet(request, tiny_model, tmp_path_factory):
    fleet = Fleet(tiny_model, request.param, TINY, tmp_path_factory.mktemp(f"logs-{request.param}"))
    try:
        yield fleet
    finally:
        fleet.stop()


@pytest.mark.parametrize("prefill, decode", [("p2", "d1"), ("p1", "d2"), ("p2", "d2")])
def test_tiny_model_pairings_answer_like_one_tp1_engine(tiny_fleet, tiny_model, tiny_want, prefill, decode):
    check_pairing(tiny_fleet, Path(tiny_model).name, tiny_want, prefill, decode)
    assert_settled(tiny_fleet, list(TINY))
    assert metric(tiny_fleet.urls[decode], "kvbridge_kv_recomputed_requests_total") == 0


# ---- SmolLM2 at its natural split, TP 3 ----------------------------------------------------

SMOL = {"p1": (KVRole.PRODUCER, 1), "p3": (KVRole.PRODUCER, 3), "d1": (KVRole.CONSUMER, 1),
        "d3": (KVRole.CONSUMER, 3)}
SMOL_TP3 = {name: SMOL[name] for name in ("p3", "d3")}  # p1 and d1: the session's shared cluster's


@pytest.fixture(scope="module")
def smol_want() -> Reference:
    return Reference(SMOLLM2)


@pytest.fixture(scope="module")
def smol_fleet(tmp_path_factory, smollm2_pd):
    shared = smollm2_pd.get()  # tests/e2e/conftest.py: TP 1 P and D, NIXL, one thread each
    fleet = Fleet(SMOLLM2, "nixl", SMOL_TP3, tmp_path_factory.mktemp("logs-smollm2"))
    fleet.adopt("p1", shared.urls.prefill[0])
    fleet.adopt("d1", shared.urls.decode[0])
    try:
        yield fleet
    finally:
        fleet.stop()


@pytest.mark.parametrize("prefill, decode", [("p3", "d1"), ("p1", "d3")])
def test_smollm2_tp3_pairings_answer_like_one_tp1_engine(smol_fleet, smol_want, prefill, decode):
    smol_fleet.note_expired_leases()
    recomputed = metric(smol_fleet.urls[decode], "kvbridge_kv_recomputed_requests_total")
    check_pairing(smol_fleet, SMOLLM2, smol_want, prefill, decode)
    assert_settled(smol_fleet, list(SMOL))
    assert metric(smol_fleet.urls[decode], "kvbridge_kv_recomputed_requests_total") == recomputed


# ---- a P rank killed between its prefill and D's read (last: it takes p2 down) ---------------

def test_a_p_rank_killed_before_the_read_makes_d_recompute_and_serve_on(tiny_fleet, tiny_model, tiny_want):
    served = Path(tiny_model).name
    p2, d1 = tiny_fleet.urls["p2"], tiny_fleet.urls["d1"]
    prompt = "[killed] " + PROMPTS[1]
    body = {"model": served, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    first = httpx.post(p2 + "/v1/completions", timeout=60,
                       json={**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    assert first.status_code == 200, first.text
    params = first.json()["kv_transfer_params"]
    ranks = rank_pids(tiny_fleet.child("p2").pid)
    assert len(ranks) == 2
    recomputed = metric(d1, "kvbridge_kv_recomputed_requests_total")
    os.kill(ranks[1], signal.SIGKILL)
    assert tiny_fleet.child("p2").popen.wait(timeout=60) != 0  # P fails cleanly and exits non-zero
    answer = httpx.post(d1 + "/v1/completions", json={**body, "kv_transfer_params": params}, timeout=120)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["text"] == tiny_want(prompt)  # recomputed on D, per the default policy
    assert metric(d1, "kvbridge_kv_recomputed_requests_total") == recomputed + 1
    check_pairing(tiny_fleet, served, tiny_want, "p1", "d1")  # D serves on, reading KV again
    assert_settled(tiny_fleet, ["p1", "d1", "d2"])
    assert gone(ranks) == []
