"""--generation-config on a real server: one engine (a small random-weight Llama folder carrying a
generation_config.json) behind three real servers on loopback, one per mode (auto: the folder's
file; vllm: none; FOLDER: another folder's), spoken to with the official openai client and httpx.

The model folder's generation_config.json asks for top_k 1 (so an omitted sampling is greedy,
whatever the temperature) and max_new_tokens 5; the other folder's for greedy decoding with a
repetition penalty and 8 tokens (the default model shows the penalty at work). Omitted fields must take these values, in completions and chat,
streamed and not; a request's own values must win; `vllm` must ignore the folder."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch is imported

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import uvicorn

from kvbridge.config import CacheConfig, EngineConfig, SchedulerConfig
from kvbridge.engine.engine import LLMEngine
from kvbridge.engine.setup.generation_config import SamplingDefaults, sampling_defaults
from kvbridge.engine.loader import load_model
from kvbridge.engine.loader.synthetic import TINY_4_KV_HEADS, write_synthetic_folder
from kvbridge.engine.sampling_params import SamplingParams
from kvbridge.server.api_server import bind_socket, build_app
from kvbridge.server.async_engine import AsyncEngine

pytestmark = pytest.mark.timeout(300)

MODEL_DEFAULTS = {"temperature": 0.7, "top_k": 1, "max_new_tokens": 5, "do_sample": True, "bos_token_id": 1}
OTHER_DEFAULTS = {"temperature": 0.0, "repetition_penalty": 3.0, "max_new_tokens": 8}
PROMPT = "The history of the Roman Empire spans many centuries, from the founding of the city"
CHAT = [{"role": "user", "content": "Tell me about the Roman Empire and its emperors."}]
SEEDED = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "seed": 11}  # every sampling field a default may set
EXTENSIONS = ("top_k", "min_p", "repetition_penalty")  # vLLM's fields, which the openai client sends in extra_body


def openai_args(fields: dict[str, Any]) -> dict[str, Any]:
    extra = {"ignore_eos": True, **{k: v for k, v in fields.items() if k in EXTENSIONS}}
    return {**{k: v for k, v in fields.items() if k not in EXTENSIONS}, "extra_body": extra}


class Server:
    """A uvicorn server for `engine` with `defaults`, on a background thread."""

    def __init__(self, engine: AsyncEngine, defaults: SamplingDefaults) -> None:
        sock = bind_socket("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(build_app(engine, None, defaults), log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.01)
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)

    def complete(self, **fields: Any) -> tuple[str, int]:
        r = self.client.completions.create(model=MODEL, prompt=PROMPT, **openai_args(fields))
        return r.choices[0].text, r.usage.completion_tokens

    def complete_streamed(self, **fields: Any) -> str:
        chunks = self.client.completions.create(model=MODEL, prompt=PROMPT, stream=True, **openai_args(fields))
        return "".join(c.choices[0].text for c in chunks if c.choices)

    def chat(self, **fields: Any) -> tuple[str, int]:
        r = self.client.chat.completions.create(model=MODEL, messages=CHAT, **openai_args(fields))
        return r.choices[0].message.content, r.usage.completion_tokens

    def chat_streamed(self, **fields: Any) -> str:
        chunks = self.client.chat.completions.create(model=MODEL, messages=CHAT, stream=True, **openai_args(fields))
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("models")
    model = write_synthetic_folder(root / MODEL, load_model("SmolLM2-135M-Instruct").tokenizer, **TINY_4_KV_HEADS)
    (model / "generation_config.json").write_text(json.dumps(MODEL_DEFAULTS))
    other = root / "other-generation-config"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps(OTHER_DEFAULTS))
    return model, other


@pytest.fixture(scope="module")
def servers(folders: tuple[Path, Path]) -> Iterator[dict[str, Server]]:
    model, other = folders
    config = EngineConfig(model=str(model), max_model_len=256, cache=CacheConfig(num_blocks=128),
                          scheduler=SchedulerConfig(max_num_seqs=4))
    engine = AsyncEngine(LLMEngine.from_config(config))
    running = {mode: Server(engine, sampling_defaults(mode if mode != "folder" else str(other), str(model)))
               for mode in ("auto", "vllm", "folder")}
    yield running
    for server in running.values():
        server.close()
    engine.shutdown()


def test_auto_applies_the_folders_defaults_to_completions_and_chat_streamed_or_not(servers) -> None:
    auto = servers["auto"]
    greedy, n = auto.complete(max_tokens=5, temperature=0)
    assert n == 5
    assert auto.complete() == (greedy, 5)  # max_new_tokens 5; top_k 1 samples the likeliest token
    assert auto.complete_streamed() == greedy
    greedy_chat, n = auto.chat(max_tokens=5, temperature=0)
    assert n == 5
    assert auto.chat() == (greedy_chat, 5)
    assert auto.chat_streamed() == greedy_chat


def test_a_requests_own_values_win_over_the_folders(servers) -> None:
    auto, vllm = servers["auto"], servers["vllm"]
    assert auto.complete(max_tokens=3)[1] == 3
    assert auto.chat(max_tokens=2)[1] == 2
    # With every sampling field given, the defaults play no part: the same engine answers the same
    # seeded request alike behind either server.
    sampled = vllm.complete(max_tokens=12, **SEEDED)
    assert auto.complete(max_tokens=12, **SEEDED) == sampled
    assert auto.complete_streamed(max_tokens=12, **SEEDED) == sampled[0]
    greedy = auto.complete(max_tokens=12, temperature=0)
    assert sampled[0] != greedy[0]  # what top_k 1 would have made of it


def test_vllm_ignores_the_folders_generation_config(servers) -> None:
    vllm = servers["vllm"]
    text, n = vllm.complete(seed=11)
    assert n == 16  # OpenAI's default, not the folder's 5
    assert text == vllm.complete(max_tokens=16, **SEEDED)[0]  # temperature 1, no top-k
    assert text != vllm.complete(max_tokens=16, temperature=0)[0]


def test_a_folder_gives_its_generation_config(servers) -> None:
    folder, vllm = servers["folder"], servers["vllm"]
    penalised, n = folder.complete()
    assert n == 8
    assert penalised == vllm.complete(max_tokens=8, temperature=0, repetition_penalty=3.0)[0]
    assert folder.complete_streamed() == penalised
    assert folder.chat()[1] == 8


def test_the_repetition_penalty_reaches_the_sampler() -> None:
    """Through the scheduler, which hands the sampler a penalised request's prompt and output: the
    default model continues a repetitive prompt greedily, and leaves it with a penalty."""
    engine = LLMEngine.from_config(EngineConfig(model="SmolLM2-135M-Instruct", max_model_len=256,
                                                cache=CacheConfig(num_blocks=32)))
    prompt = engine.tokenizer.encode("one, two, one, two, one, two, one, two, one,")

    def greedy(request_id: str, penalty: float) -> str:
        engine.add_request(request_id, prompt, SamplingParams(max_tokens=8, temperature=0, repetition_penalty=penalty))
        tokens = []
        while engine.has_unfinished_requests():
            tokens += [t for out in engine.step().outputs for t in out.new_token_ids]
        return engine.tokenizer.decode(tokens)

    assert greedy("plain", 1.0) == " two, one, two, one,"
    assert "one" not in greedy("penalised", 1.5)


def test_a_default_max_tokens_is_cut_to_what_the_context_leaves(servers) -> None:
    folder = servers["folder"]
    prompt = [1] * (256 - 3)  # 3 tokens of context left: the default 8 becomes 3, not a 400
    r = httpx.post(folder.url + "/v1/completions", json={"prompt": prompt, "ignore_eos": True}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3
