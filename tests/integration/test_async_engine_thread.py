"""AsyncEngine built on its own thread (`from_config`, `build=`): the thread that steps the
engine also built it, so one thread runs every torch op of the engine (OpenMP keeps a team of
workers per thread that ran a parallel region; two teams on two cores made every decode step
about 20% slower). A failing build raises from the constructor; a real request is served."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch is imported

import asyncio  # noqa: E402
import threading  # noqa: E402

import pytest  # noqa: E402

from kvbridge.config import CacheConfig, EngineConfig  # noqa: E402
from kvbridge.engine.engine import LLMEngine  # noqa: E402
from kvbridge.engine.loader import LoadedModel, load_model  # noqa: E402
from kvbridge.engine.sampling_params import SamplingParams  # noqa: E402
from kvbridge.server.async_engine import AsyncEngine  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
CONFIG = EngineConfig(model=MODEL, max_model_len=256, cache=CacheConfig(num_blocks=32))


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model(MODEL)


class ThreadRecordingEngine(LLMEngine):
    """The real engine, noting which threads built it and stepped it."""

    def __init__(self, *args, **kwargs) -> None:
        self.built_on = threading.current_thread()
        self.stepped_on: set[threading.Thread] = set()
        super().__init__(*args, **kwargs)

    def step(self):
        self.stepped_on.add(threading.current_thread())
        return super().step()


def test_built_on_the_engine_thread_which_alone_steps_it(loaded: LoadedModel) -> None:
    built: list[ThreadRecordingEngine] = []

    def build() -> LLMEngine:
        built.append(ThreadRecordingEngine(CONFIG, loaded))
        return built[0]

    engine = AsyncEngine(build=build, thread_name="engine-under-test")
    try:
        assert engine.model_name == built[0].model_name and engine.max_model_len == 256

        async def one() -> list[int]:
            params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
            return [t async for out in engine.generate("r", [1, 2, 3, 4], params) for t in out.new_token_ids]

        assert len(asyncio.run(one())) == 4
    finally:
        engine.shutdown()
    (recorder,) = built
    assert recorder.built_on.name == "engine-under-test"
    assert recorder.stepped_on == {recorder.built_on}
    assert threading.current_thread() is not recorder.built_on


def test_a_build_that_raises_raises_from_the_constructor_and_ends_the_thread() -> None:
    started = threading.Event()

    def build() -> LLMEngine:
        started.set()
        raise ValueError("no such model: nowhere")

    with pytest.raises(ValueError, match="no such model"):
        AsyncEngine(build=build)
    assert started.is_set()
    assert not any(t.name == "kvbridge-engine" and t.is_alive() for t in threading.enumerate())


def test_an_engine_or_a_build_function_not_both_nor_neither(loaded: LoadedModel) -> None:
    with pytest.raises(TypeError, match="not both"):
        AsyncEngine()
    engine = LLMEngine(CONFIG, loaded)
    try:
        with pytest.raises(TypeError, match="not both"):
            AsyncEngine(engine, build=lambda: engine)
    finally:
        engine.shutdown()


def test_from_config_builds_on_the_engine_thread(loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """What `kvbridge serve` uses (api_server.run_server)."""
    built: list[ThreadRecordingEngine] = []

    def from_config(config: EngineConfig) -> LLMEngine:
        built.append(ThreadRecordingEngine(config, loaded))
        return built[-1]

    monkeypatch.setattr(LLMEngine, "from_config", staticmethod(from_config))
    engine = AsyncEngine.from_config(CONFIG)
    engine.shutdown()
    assert [e.built_on.name for e in built] == ["kvbridge-engine"]
