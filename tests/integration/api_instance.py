"""One kvbridge instance for the server's integration tests: the real default model through the
real engine, wrapped by InstrumentedEngine (LLMEngine's public API only: it records pre-admission
rejection notices, can fail a chosen request the way a KV transfer failure under policy "fail"
does, or fail the whole step like a broken device), behind a uvicorn server on 127.0.0.1 with a
port from the OS (`Instance`). The module-scoped fixtures `loaded`, `llm` and `inst` (and the per-test `blocks_back`) are
defined here once; a test module takes them by importing them."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from kvbridge.config import CacheConfig, EngineConfig, SchedulerConfig
from kvbridge.engine.engine import EngineMetrics, EngineStep, LLMEngine
from kvbridge.engine.loader import LoadedModel, load_model
from kvbridge.engine.outputs import RequestOutput
from kvbridge.engine.request import FinishReason
from kvbridge.kv_transfer.params import KVTransferParams, parse_kv_transfer_params
from kvbridge.server.api_server import bind_socket, build_app
from kvbridge.server.async_engine import AsyncEngine

MODEL = "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 512
CONFIG = EngineConfig(model=MODEL, max_model_len=MAX_MODEL_LEN, cache=CacheConfig(num_blocks=96),
                      scheduler=SchedulerConfig(max_num_seqs=4, max_waiting=4))
API_KEY = "sk-kvbridge-test"
# What a decode instance receives from the proxy: blocks a prefill instance holds for it.
REMOTE_PREFILL = {"do_remote_prefill": True, "remote_block_ids": [3, 4], "remote_engine_id": "prefill-0",
                  "remote_request_id": "p-req-7", "remote_host": "127.0.0.1", "remote_port": 5600}


class InstrumentedEngine:
    """A real LLMEngine plus test knobs, through its public API only."""

    def __init__(self, inner: LLMEngine) -> None:
        self.inner = inner
        self.has_kv_connector = True  # so rejections notify; the inner engine's notify is a no-op
        self.notified: list[tuple[str, KVTransferParams]] = []
        self.fail_requests: dict[str, str] = {}  # request id -> error, like a failed KV load
        self.explode = False  # the next step raises, like a broken device
        self.returned_params: dict[str, dict] = {}  # request id -> kv_transfer_params' JSON, like P's answer
        self._failed: set[str] = set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def notify_kv_transfer_rejected(self, request_id: str, params: KVTransferParams) -> None:
        self.notified.append((request_id, params))
        self.inner.notify_kv_transfer_rejected(request_id, params)

    def step(self) -> EngineStep:
        if self.explode:
            raise RuntimeError("injected device failure")
        outputs = []
        step = self.inner.step()
        for out in step.outputs:
            if out.request_id in self._failed:
                continue  # the abort that freed a failed request's blocks
            if out.finished and out.request_id in self.returned_params:
                out.kv_transfer_params = parse_kv_transfer_params(self.returned_params[out.request_id])
            error = self.fail_requests.get(out.request_id)
            if error is None:
                outputs.append(out)
                continue
            self._failed.add(out.request_id)
            if not out.finished:
                self.inner.abort_request(out.request_id)
            outputs.append(RequestOutput(out.request_id, [], "", True, FinishReason.ERROR,
                                         num_prompt_tokens=out.num_prompt_tokens, error=error))
        return EngineStep(outputs, step.next_step)


class Instance:
    """An AsyncEngine behind a uvicorn server running on a background thread."""

    def __init__(self, engine: AsyncEngine, api_key: str | None = None) -> None:
        self.engine = engine
        sock = bind_socket("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(build_app(engine, api_key), log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            assert self.thread.is_alive(), "server thread died"
            time.sleep(0.01)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)

    def engine_metrics(self) -> EngineMetrics:
        return self.engine.call_threadsafe(lambda e: e.metrics()).result(timeout=10)

    def wait_all_blocks_free(self, timeout_s: float = 10.0) -> EngineMetrics:
        deadline = time.monotonic() + timeout_s
        while True:
            m = self.engine_metrics()
            if m.num_free_blocks == m.num_total_blocks or time.monotonic() > deadline:
                return m
            time.sleep(0.05)

    def wait_metric(self, name: str, value: float, timeout_s: float = 30.0, **labels: str) -> float:
        """The metric once it reaches `value` (it is bumped on another thread), or its last value."""
        deadline = time.monotonic() + timeout_s
        while (got := self.metric(name, **labels)) != value and time.monotonic() < deadline:
            time.sleep(0.05)
        return got

    def metric(self, name: str, **labels: str) -> float:
        text = httpx.get(self.url + "/metrics", timeout=10).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    return sample.value
        raise AssertionError(f"{name}{labels} not in /metrics")

    def client(self, **kwargs: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60,
                             **kwargs)


def new_engine(loaded: LoadedModel) -> InstrumentedEngine:
    return InstrumentedEngine(LLMEngine(CONFIG, loaded))


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model(MODEL)


@pytest.fixture(scope="module")
def llm(loaded: LoadedModel) -> InstrumentedEngine:
    return new_engine(loaded)


@pytest.fixture(scope="module")
def inst(llm: InstrumentedEngine) -> Iterator[Instance]:
    engine = AsyncEngine(llm)
    instance = Instance(engine)
    yield instance
    instance.close()
    engine.shutdown()


def post(inst: Instance, path: str, body: Any, **kwargs: Any) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    headers = {"Content-Type": "application/json", **kwargs.pop("headers", {})}
    return httpx.post(inst.url + path, content=content, headers=headers, **{"timeout": 60, **kwargs})


def stream_events(inst: Instance, body: dict[str, Any]) -> list[Any]:
    """A streamed /v1/completions answer's events: each chunk parsed, and the final "[DONE]"."""
    events: list[Any] = []
    with httpx.stream("POST", inst.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: "):]
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


@pytest.fixture
def blocks_back(inst: Instance, llm: InstrumentedEngine) -> Iterator[None]:
    """After the test, every KV block is back in the pool and nothing runs or waits (a module takes
    it for each test: `pytestmark = pytest.mark.usefixtures("blocks_back")`, importing it)."""
    llm.notified.clear()
    yield
    m = inst.wait_all_blocks_free()
    assert m.num_free_blocks == m.num_total_blocks, m
    assert m.num_running == 0 and m.num_waiting == 0, m
