"""P's engine loop wakes and polls promptly while a remote reader reads its blocks.

The first NIXL read from a new peer completes only after the target's agent has
progressed (UCX wire-up; so does any read that carries a NIXL notification). An idle
P holding leases backs off between steps, so a granted check_read must wake it. Here
the back-off is stretched to 30 s: only the wake-up can make P step within the test's
wait.
"""

import time

import httpx

from kvbridge.chaos import ThreadServer
from kvbridge.config import CacheConfig, EngineConfig, KVRole, KVTransferConfig
from kvbridge.engine.engine import LLMEngine
from kvbridge.engine.loader import load_model
from kvbridge.kv_transfer.connector.factory import build_connectors
from kvbridge.kv_transfer.control import ControlClient
from kvbridge.kv_transfer.params import parse_kv_transfer_params
from kvbridge.serving import async_engine
from kvbridge.serving.api_server import build_app
from kvbridge.serving.async_engine import AsyncEngine

MODEL = "SmolLM2-135M-Instruct"
WAIT_S = 10.0  # well under the stretched 30 s back-off


def test_a_granted_read_wakes_an_idle_prefill_engine(monkeypatch):
    monkeypatch.setattr(async_engine, "_MIN_BACKOFF_S", 30.0)
    monkeypatch.setattr(async_engine, "_MAX_BACKOFF_S", 30.0)
    loaded = load_model(MODEL)
    config = EngineConfig(cache=CacheConfig(num_blocks=32), max_model_len=256, num_threads=1,
                          kv_transfer=KVTransferConfig(role=KVRole.PRODUCER, backend="tcp", engine_id="P",
                                                       lease_seconds=60))
    llm = LLMEngine(config, loaded, build_connectors(config, loaded.arch, loaded.name))
    steps = []
    real_step = llm.step
    llm.step = lambda: (steps.append(time.monotonic()), real_step())[1]
    engine = AsyncEngine(llm)
    server = ThreadServer(build_app(engine))
    try:
        params = httpx.post(server.url + "/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": "Tell me about dragons.", "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True}}).json()["kv_transfer_params"]
        deadline = time.monotonic() + WAIT_S
        while (not steps or time.monotonic() - steps[-1] < 0.3) and time.monotonic() < deadline:
            time.sleep(0.05)  # until the loop settles into its (stretched) back-off
        settled = len(steps)
        assert engine.call_threadsafe(lambda e: e.transfers_in_flight()).result(timeout=WAIT_S) is False
        assert len(steps) == settled + 1  # that call woke nothing but itself: one step at most

        control = ControlClient(timeout_s=5.0)
        control.check_read(params["remote_host"], params["remote_port"], params["remote_request_id"],
                           params["lease_generation"], parse_kv_transfer_params(params).remote_block_ids)
        before = len(steps)
        while len(steps) == before and time.monotonic() < deadline + WAIT_S:
            time.sleep(0.01)
        assert len(steps) > before, "a granted read did not wake the prefill engine"
        assert engine.call_threadsafe(lambda e: e.transfers_in_flight()).result(timeout=WAIT_S) is True

        control.release(params["remote_host"], params["remote_port"], params["remote_request_id"],
                        params["lease_generation"])
        held = lambda: engine.call_threadsafe(lambda e: e.metrics().num_held_for_remote).result(timeout=WAIT_S)  # noqa: E731
        end = time.monotonic() + WAIT_S
        while held() and time.monotonic() < end:
            time.sleep(0.01)
        assert held() == 0
        assert engine.call_threadsafe(lambda e: e.transfers_in_flight()).result(timeout=WAIT_S) is False
    finally:
        server.stop()
        engine.shutdown()
