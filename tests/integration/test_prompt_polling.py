"""P's engine loop wakes and polls promptly while a remote reader reads its blocks.

The first NIXL read from a new peer completes only after the target's agent has
progressed (UCX wire-up; so does any read that carries a NIXL notification). An idle
P holding leases backs off between steps, so a granted check_read must wake it. Here
the back-off is stretched to 30 s: only the wake-up can make P step within the test's
wait.

The test counts P's steps with a condition the step notifies, and takes each count
only once the engine thread has done what the previous call caused (never a count
taken after the fact, when the step it waits for may already have happened).
"""

import dataclasses
import threading
import time

import httpx

from kvbridge.chaos import ThreadServer
from kvbridge.config import CacheConfig, EngineConfig, KVRole, KVTransferConfig
from kvbridge.engine import pacing
from kvbridge.engine.engine import LLMEngine
from kvbridge.engine.kv_connector_factory import build_connectors
from kvbridge.engine.loader import load_model
from kvbridge.kv_transfer.side_channel.control import ControlClient
from kvbridge.kv_transfer.lease import content_digest
from kvbridge.kv_transfer.params import parse_kv_transfer_params
from kvbridge.server.api_server import build_app
from kvbridge.server.async_engine import AsyncEngine

MODEL = "SmolLM2-135M-Instruct"
WAIT_S = 10.0  # well under the stretched 30 s back-off


class StepCounter:
    """Counts an engine's steps; a test thread waits for a count instead of sleeping."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.count = 0
        self.last = 0.0

    def record(self) -> None:
        with self._cond:
            self.count += 1
            self.last = time.monotonic()
            self._cond.notify_all()

    def wait_for(self, count: int, timeout_s: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self.count >= count, timeout_s)

    def wait_quiet(self, quiet_s: float, timeout_s: float) -> bool:
        """Until no step has happened for quiet_s (the loop sits in its back-off)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while time.monotonic() - self.last < quiet_s:
                if time.monotonic() > deadline:
                    return False
                self._cond.wait(max(quiet_s - (time.monotonic() - self.last), 0.001))
            return True


def test_a_granted_read_wakes_an_idle_prefill_engine(monkeypatch):
    monkeypatch.setattr(pacing, "BACKOFF_MIN_S", 30.0)
    monkeypatch.setattr(pacing, "BACKOFF_MAX_S", 30.0)
    loaded = load_model(MODEL)
    config = EngineConfig(cache=CacheConfig(num_blocks=32), max_model_len=256, num_threads=1,
                          kv_transfer=KVTransferConfig(role=KVRole.PRODUCER, backend="tcp", engine_id="P",
                                                       lease_seconds=60))
    llm = LLMEngine(config, loaded, build_connectors(config, loaded.arch, loaded.name))
    steps = StepCounter()
    real_step = llm.step
    llm.step = lambda: (steps.record(), real_step())[1]
    engine = AsyncEngine(llm)
    server = ThreadServer(build_app(engine))
    try:
        prompt = loaded.tokenizer.encode("Tell me about dragons.", add_special_tokens=True)
        params = httpx.post(server.url + "/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": prompt, "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True}}).json()["kv_transfer_params"]
        assert steps.wait_quiet(0.3, WAIT_S), "the engine never settled into its back-off"
        settled = steps.count
        assert engine.call_threadsafe(lambda e: e.worker_status().transfers_in_flight).result(timeout=WAIT_S) is False
        # The call ends the back-off wait and the loop steps once after running it: wait for
        # that step, so it cannot be mistaken below for a step the granted read caused.
        assert steps.wait_for(settled + 1, WAIT_S), "the engine did not step after a call"
        before = steps.count
        assert before == settled + 1  # that call woke nothing but itself: one step

        control = ControlClient(timeout_s=5.0)
        control.check_read(params["remote_host"], params["remote_port"], params["remote_request_id"],
                           params["lease_generation"], parse_kv_transfer_params(params).remote_block_ids,
                           content_digest(prompt))
        # The wake-up is sent while check_read is answered; `before` was taken earlier, so a
        # step that happens before check_read returns still counts.
        assert steps.wait_for(before + 1, WAIT_S), "a granted read did not wake the prefill engine"
        assert engine.call_threadsafe(lambda e: e.worker_status().transfers_in_flight).result(timeout=WAIT_S) is True

        control.release(params["remote_host"], params["remote_port"], params["remote_request_id"],
                        params["lease_generation"])
        held = lambda: engine.call_threadsafe(lambda e: e.metrics().num_held_for_remote).result(timeout=WAIT_S)  # noqa: E731
        end = time.monotonic() + WAIT_S
        while held() and time.monotonic() < end:
            time.sleep(0.01)
        assert held() == 0
        assert engine.call_threadsafe(lambda e: e.worker_status().transfers_in_flight).result(timeout=WAIT_S) is False
    finally:
        server.stop()
        engine.shutdown()


def test_commands_for_the_ranks_ride_the_next_step_without_back_off(monkeypatch):
    """D plans a read when P's check_read answer is in; when that happens after the ranks ran,
    its commands wait for the next step, which the loop must run at once: a back-off there
    was 0.5-0.7 ms of a 7 ms read. Without such commands the loop backs off (30 s here)."""
    monkeypatch.setattr(pacing, "BACKOFF_MIN_S", 30.0)
    monkeypatch.setattr(pacing, "BACKOFF_MAX_S", 30.0)
    loaded = load_model(MODEL)
    llm = LLMEngine(EngineConfig(cache=CacheConfig(num_blocks=32), max_model_len=256, num_threads=1), loaded)
    steps = StepCounter()
    busy = threading.Event()
    queued = {"steps": 0}  # commands wait for the ranks until this many more steps have run
    real_step = llm.step

    def step():
        out = real_step()
        queued["steps"] = max(queued["steps"] - 1, 0)
        steps.record()
        return dataclasses.replace(out, next_step=pacing.NextStep.NOW) if queued["steps"] > 0 else out
    llm.step = step
    llm.has_pending_work = busy.is_set  # a step with nothing scheduled, as while D waits for P
    engine = AsyncEngine(llm)
    try:
        queued["steps"] = 3
        busy.set()
        engine.call_threadsafe(lambda e: None).result(timeout=WAIT_S)  # ends the idle wait
        assert steps.wait_for(3, WAIT_S), f"the loop backed off while commands waited for the ranks ({steps.count})"
        assert steps.wait_quiet(0.3, WAIT_S), "the loop did not back off once no commands waited"
        assert steps.count == 3
    finally:
        busy.clear()
        engine.shutdown()
