"""Tensor parallelism with real rank processes: SmolLM2-135M (9 query heads, 3 KV heads) at TP 3.

- The engine at TP 3 gives TP 1's greedy text for the reference prompts, also with chunked
  prefill, prefix-cache hits and preemption (a small KV cache) in play; a rank of it killed
  turns /health 503 and fails requests with an error, not a hang.
- `kvbridge serve -tp 3` as a user runs it: the official client gets TP 1's answer; SIGTERM
  and Ctrl-C (SIGINT) leave no rank process behind; a rank killed with SIGKILL fails the
  engine cleanly (/health 503, then the server exits non-zero) and no rank is left.
- Impossible splits are refused at start-up with the reason.
- Each rank's main thread runs on the CPUs `--cpu-bind auto` gives it, gloo's threads anywhere;
  CPU lists naming a CPU this process may not use are refused before any rank starts.
"""

from __future__ import annotations

import fcntl
import os
import signal
import socket
import struct
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from kvbridge.chaos import ThreadServer
from kvbridge.config import CacheConfig, EngineConfig, KVRole, SchedulerConfig
from kvbridge.engine.engine import LLMEngine
from kvbridge.engine.loader import load_model
from kvbridge.engine.loader.synthetic import TINY_4_KV_HEADS, write_synthetic_folder
from kvbridge.engine.sampling_params import SamplingParams
from kvbridge.engine.tp.cpu_bind import rank_cpus
from kvbridge.engine.tp.executor import TPExecutorError
from kvbridge.server.api_server import build_app
from kvbridge.server.async_engine import AsyncEngine
from kvbridge.shape.tp_split import TPSplitError
from tests.e2e.processes import children, gone, listening, rank_pids
from tests.fleet import Fleets, FleetSpec, Member

MODEL = "SmolLM2-135M-Instruct"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
SHARED = "You are a helpful assistant. Answer briefly and precisely. " * 3  # a shared prefix (prefix hits)
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
WAIT_S = 240.0


@pytest.fixture(scope="module")
def loaded():
    return load_model(MODEL)


@pytest.fixture(scope="module")
def tp1_outputs(loaded):
    engine = LLMEngine(EngineConfig(cache=CacheConfig(num_blocks=128), num_threads=2), loaded)
    prompts = [loaded.tokenizer.encode(p) for p in PROMPTS + [SHARED + p for p in PROMPTS]]
    return prompts, [engine.generate([p], GREEDY)[0] for p in prompts]  # one at a time, nothing shared


# 14 blocks of 16 for six requests of 20-60 tokens: they cannot all run at once (preemption);
# a 24-token step budget chunks every longer prompt; the shared prefix hits the cache.
TP3_CONFIG = EngineConfig(cache=CacheConfig(num_blocks=14), num_threads=2, tensor_parallel_size=3,
                          scheduler=SchedulerConfig(max_num_batched_tokens=24))


class TP3Engine:
    """The module's in-process TP 3 engine (one per process: torch.distributed has one default
    group). Starting one spawns three rank processes (about 6 s), so the tests that leave it
    working share it; a test that kills a rank `take()`s it and shuts it down itself, and the
    next `get()` starts a new one, whatever the order the tests run in."""

    def __init__(self, loaded) -> None:
        self.loaded, self.engine = loaded, None

    def get(self) -> LLMEngine:
        if self.engine is None:
            self.engine = LLMEngine(TP3_CONFIG, self.loaded)
        return self.engine

    def take(self) -> LLMEngine:
        engine, self.engine = self.get(), None
        return engine

    def close(self) -> None:
        if self.engine is not None:
            self.engine, engine = None, self.engine
            engine.shutdown()


@pytest.fixture(scope="module")
def tp3(loaded):
    engines = TP3Engine(loaded)
    yield engines
    engines.close()


def test_tp3_greedy_text_equals_tp1_with_chunked_prefill_prefix_hits_and_preemption(loaded, tp1_outputs, tp3):
    prompts, want = tp1_outputs
    engine = tp3.get()
    try:
        before = engine.metrics()
        got = engine.generate(prompts, GREEDY)
        metrics = engine.metrics()
    except BaseException:
        tp3.close()  # in an unknown state: the next test gets a new engine
        raise
    for prompt, g, w in zip(prompts, got, want):
        assert g == w, (loaded.tokenizer.decode(prompt), loaded.tokenizer.decode(g), loaded.tokenizer.decode(w))
    assert metrics.num_preemptions > before.num_preemptions and metrics.prefix_cache_hits > before.prefix_cache_hits
    assert metrics.num_free_blocks == metrics.num_total_blocks


def test_each_rank_computes_on_the_cpus_cpu_bind_auto_gives_it_and_gloos_threads_run_anywhere(tp3):
    runner = tp3.get().runner
    everywhere = os.sched_getaffinity(0)
    want = rank_cpus("auto", 3, everywhere, ranks_on_cpu=True)  # on 2 CPUs: 0 | 1 | 0
    assert want is not None and runner.rank_cpus == want
    for pid, cpus in zip(runner.pids, want, strict=True):
        threads = {int(t): Path(f"/proc/{pid}/task/{t}/comm").read_text().strip() for t in os.listdir(f"/proc/{pid}/task")}
        gloo = {t for t, name in threads.items() if name.startswith(("gloo_", "pt_gloo"))}
        assert os.sched_getaffinity(pid) == cpus  # the main thread: the model's forward, the reads
        assert gloo and {t: os.sched_getaffinity(t) for t in gloo} == dict.fromkeys(gloo, everywhere)


def test_cpu_lists_naming_a_cpu_this_process_may_not_run_on_are_refused_before_any_rank_starts(loaded):
    missing = max(os.sched_getaffinity(0)) + 1
    config = EngineConfig(cache=CacheConfig(num_blocks=16), tensor_parallel_size=3, cpu_bind=f"0|0|{missing}")
    with pytest.raises(TPExecutorError, match=rf"rank 2's CPUs \[{missing}\] are not among"):
        LLMEngine(config, loaded)


@pytest.mark.parametrize("tp", [2, 4])
def test_a_split_the_model_cannot_take_is_refused_at_start(loaded, tp):
    with pytest.raises(TPSplitError, match="does not divide|not a multiple"):
        LLMEngine(EngineConfig(cache=CacheConfig(num_blocks=16), tensor_parallel_size=tp), loaded)


def test_a_dead_rank_makes_health_fail_and_requests_get_an_error_not_a_hang(tp3):
    engine = AsyncEngine(tp3.take())  # a rank of it is killed: no later test gets this engine
    server = ThreadServer(build_app(engine))
    try:
        body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0}
        assert httpx.post(server.url + "/v1/completions", json=body, timeout=120).status_code == 200
        os.kill(engine._engine.runner.pids[1], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while httpx.get(server.url + "/health", timeout=10).status_code != 503:
            assert time.monotonic() < deadline, "/health still 200 after a rank died"
            time.sleep(0.05)
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 503 and "rank 1" in r.json()["error"]["message"], r.text
    finally:
        server.stop()
        engine.shutdown()
    assert engine._engine.runner.pids and gone(engine._engine.runner.pids) == []


# ---- `kvbridge serve -tp 3`, a real process ------------------------------------------------

class Serve:
    """One `kvbridge serve` with its rank processes, from the tests' fleet builder (tests/fleet.py)."""

    def __init__(self, fleets: Fleets, member: Member = Member(None, 3), model: str = MODEL, backend: str = "nixl",
                 **options) -> None:
        self.fleet = fleets.own(FleetSpec.of(model, backend, {}, num_threads=2, **options))
        self.fleet.add("serve", member, wait=False)
        self.child = self.fleet.child("serve")
        self.proc, self.url = self.child.popen, self.fleet.urls["serve"]
        self.port = int(self.url.rsplit(":", 1)[1])

    def log(self) -> str:
        return self.child.log_path.read_text()

    def wait_healthy(self) -> list[int]:
        self.fleet.wait_healthy(["serve"], WAIT_S)
        return children(self.proc.pid)

    def wait_exit(self) -> int:
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"serve did not exit:\n{self.log()}") from None

    def close(self) -> None:
        ranks = children(self.proc.pid) if self.child.alive() else []
        self.fleet.stop()
        for pid in gone(ranks, timeout_s=10):  # a rank its server left behind (the test fails for it)
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_serve_tp3_answers_like_tp1_and_a_signal_leaves_no_rank_behind(fleets, tp1_outputs, loaded, sig):
    serve = Serve(fleets)
    try:
        ranks = serve.wait_healthy()
        assert len(ranks) >= 3, ranks  # three ranks (and perhaps multiprocessing's resource tracker)
        prompts, want = tp1_outputs
        client = OpenAI(base_url=serve.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.choices[0].text == loaded.tokenizer.decode(want[0])
        serve.proc.send_signal(sig)
        # uvicorn shuts down gracefully, then re-raises SIGTERM (exit by the signal, as a
        # SIGTERMed process does); SIGINT ends as a handled KeyboardInterrupt (exit 0).
        assert serve.wait_exit() in ((0, -signal.SIGTERM) if sig == signal.SIGTERM else (0,)), serve.log()
        assert gone(ranks) == []
    finally:
        serve.close()


def interface_address(name: str) -> str | None:
    """The IPv4 address of interface `name`, or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def test_a_tp_server_and_its_ranks_listen_on_loopback_only_and_name_their_tp_size(tmp_path, loaded, fleets):
    """The ranks' rendezvous (torch's TCPStore) listened on every interface (*:PORT) although it was
    given 127.0.0.1: anyone on the network could join it. Every socket of the server, of its rank
    processes (their gloo pairs, their tcp KV servers) and of its side channel is on 127.0.0.1."""
    folder = write_synthetic_folder(tmp_path / "tiny", loaded.tokenizer, **TINY_4_KV_HEADS)  # TP 2 splits it
    # gloo listens on the address this host's name resolves to, or on GLOO_SOCKET_IFNAME's interface:
    # naming a routable one stands for a host whose name resolves to its network address.
    routable = next((name for _, name in socket.if_nameindex() if interface_address(name) not in (None, "127.0.0.1")),
                    None)
    serve = Serve(fleets, Member(KVRole.PRODUCER, 2), model=str(folder), backend="tcp",
                  env=(("GLOO_SOCKET_IFNAME", routable),) if routable else ())
    try:
        children_ = serve.wait_healthy()
        sockets = {pid: listening(pid) for pid in [serve.proc.pid, *children_]}
        assert ("127.0.0.1", serve.port) in sockets[serve.proc.pid]
        ranks = rank_pids(serve.proc.pid)
        assert len(ranks) == 2 and all(sockets[pid] for pid in ranks), sockets  # each rank's KV server, gloo
        assert {address for found in sockets.values() for address, _ in found} == {"127.0.0.1"}, sockets
        # vLLM's P/D protocol: P's kv_transfer_params name its real TP size (a vLLM decode instance
        # plans its reads from it; kvbridge's P said 1 whatever its size).
        url = f"http://127.0.0.1:{serve.port}"
        answer = httpx.post(url + "/v1/completions", json={
            "prompt": "Say something about the sea", "max_tokens": 1, "temperature": 0,
            "kv_transfer_params": {"do_remote_decode": True}}, timeout=60).json()
        params = answer["kv_transfer_params"]
        assert params["tp_size"] == 2 and params["do_remote_prefill"] is True, params
        assert httpx.post(url + "/kvbridge/release_kv", json={"kv_transfer_params": params},
                          timeout=10).status_code == 200  # the blocks go back now (no D will read them)
    finally:
        serve.close()


def test_a_rank_killed_fails_the_engine_cleanly_and_serve_exits_nonzero(fleets):
    serve = Serve(fleets)
    try:
        ranks = serve.wait_healthy()
        rank_pids = [pid for pid in ranks if "spawn_main" in Path(f"/proc/{pid}/cmdline").read_text()]
        assert rank_pids, ranks
        os.kill(rank_pids[-1], signal.SIGKILL)
        # No hang: the server notices, answers 503 (or is already gone), and exits non-zero.
        code = serve.wait_exit()
        assert code != 0, serve.log()
        assert "rank" in serve.log() and "exited" in serve.log()
        assert gone(ranks) == []
    finally:
        serve.close()
