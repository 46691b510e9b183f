"""Hostile input against a real instance (the default model) and a real proxy in front of
it (colocated mode), over HTTP (issue 14, findings 2, 7 and 8).

- Sampling values that overflowed the sampler (a temperature of 1e-300, a seed past 64
  bits) killed the engine for good; now the temperature is served and the seed is a 400,
  and a request whose sampling fails anyway fails alone. A repetition penalty of 1e-300 was a
  500 (issue 44); now it is served.
- Bad JSON (lone surrogates, deep nesting, NaN/Infinity/1e400) was a 500 (plain text on
  the proxy); it must be a 400 with OpenAI's error body on both.
- A huge prompt was tokenised on the event loop (/health stalled for seconds); now it is
  tokenised on a worker thread, and a prompt with more bytes than the context can hold is
  refused before it is tokenised at all.

The tests wait on events and futures, never on time: a tokenizer with a gate shows that
/health answers while a prompt's tokenisation is held open.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch is imported

import asyncio
import dataclasses
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from kvbridge.chaos import ThreadServer
from kvbridge.config import CacheConfig, EngineConfig, SchedulerConfig
from kvbridge.engine.engine import LLMEngine
from kvbridge.engine.loader import LoadedModel, load_model
from kvbridge.engine.request import FinishReason
from kvbridge.engine.sampling_params import SamplingParams
from kvbridge.engine.tokenizer import Tokenizer
from kvbridge.openai_wire import MAX_BODY_BYTES
from kvbridge.proxy.app import build_proxy_app
from kvbridge.server.api_server import build_app
from kvbridge.server.async_engine import AsyncEngine
from tests.openai_errors import assert_openai_error

MODEL = "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 512
CONFIG = EngineConfig(model=MODEL, max_model_len=MAX_MODEL_LEN, cache=CacheConfig(num_blocks=64),
                      scheduler=SchedulerConfig(max_num_seqs=4, max_waiting=8), num_threads=1)
PROMPT = {"prompt": "The capital of France is", "max_tokens": 4}

pytestmark = pytest.mark.timeout(180)


class GatedTokenizer:
    """The engine's tokenizer, counting `encode` calls; while `gate` is clear, an encode
    waits in it (after setting `entered`), as a long tokenisation would."""

    def __init__(self, inner: Tokenizer) -> None:
        self.inner = inner
        self.calls = 0
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.gate.set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        self.calls += 1
        self.entered.set()
        assert self.gate.wait(120), "the test never opened the gate"
        return self.inner.encode(text, add_special_tokens)


@dataclasses.dataclass
class Servers:
    engine: AsyncEngine
    instance: ThreadServer
    proxy: ThreadServer
    proxy_app: FastAPI

    def url(self, target: str) -> str:
        return self.instance.url if target == "instance" else self.proxy.url

    def assert_healthy_and_serving(self) -> None:
        assert httpx.get(self.instance.url + "/health", timeout=30).status_code == 200
        for target in ("instance", "proxy"):
            r = post(self.url(target), "/v1/completions", {**PROMPT, "temperature": 0})
            assert r.status_code == 200, r.text
            assert "Paris" in r.json()["choices"][0]["text"]


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model(MODEL)


@pytest.fixture(scope="module")
def servers(loaded: LoadedModel) -> Iterator[Servers]:
    engine = AsyncEngine(LLMEngine(CONFIG, loaded))
    instance = ThreadServer(build_app(engine))
    proxy_app = build_proxy_app([], [instance.url], health_interval_s=0.5)
    proxy = ThreadServer(proxy_app)
    yield Servers(engine, instance, proxy, proxy_app)
    proxy.stop()
    instance.stop()
    engine.shutdown()


@pytest.fixture
def gated(servers: Servers) -> Iterator[GatedTokenizer]:
    real = servers.engine.tokenizer
    wrapper = GatedTokenizer(real)
    servers.engine.tokenizer = wrapper  # type: ignore[assignment]
    try:
        yield wrapper
    finally:
        wrapper.gate.set()
        servers.engine.tokenizer = real


def post(url: str, path: str, body: Any, timeout: float = 60) -> httpx.Response:
    content = body if isinstance(body, bytes) else httpx.Request("POST", url, json=body).content
    return httpx.post(url + path, content=content, headers={"Content-Type": "application/json"},
                      timeout=timeout)


TARGETS = ["instance", "proxy"]


# ------------------------------------------------------------------ finding 2: sampling values


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("temperature", [1e-300, 5e-324, 1e-7])
def test_a_vanishing_temperature_is_served_greedily(servers: Servers, target: str, temperature: float) -> None:
    url = servers.url(target)
    greedy = post(url, "/v1/completions", {**PROMPT, "temperature": 0})
    cold = post(url, "/v1/completions", {**PROMPT, "temperature": temperature, "seed": 3})
    assert cold.status_code == 200, cold.text
    assert cold.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]
    servers.assert_healthy_and_serving()


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("seed", [2 ** 64, -(2 ** 63) - 1, 10 ** 40])
def test_a_seed_past_64_bits_is_400_and_the_engine_lives(servers: Servers, target: str, seed: int) -> None:
    r = post(servers.url(target), "/v1/completions", {**PROMPT, "temperature": 1.0, "seed": seed})
    assert_openai_error(r, 400, param="seed")
    servers.assert_healthy_and_serving()


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("penalty", [1e-300, 1e300])
@pytest.mark.parametrize("seed", [None, 5])
def test_an_extreme_repetition_penalty_is_served(servers: Servers, target: str, penalty: float,
                                                 seed: int | None) -> None:
    """vLLM accepts any repetition_penalty > 0. 1e-300 at temperature 1 took the prompt's tokens'
    logits to inf (a NaN softmax): HTTP 500 (issue 44). Now the row is computed wider and samples."""
    body = {**PROMPT, "temperature": 1.0, "repetition_penalty": penalty, **({"seed": seed} if seed else {})}
    r = post(servers.url(target), "/v1/completions", body)
    assert r.status_code == 200, r.text
    servers.assert_healthy_and_serving()


def test_the_largest_64_bit_seed_samples(servers: Servers) -> None:
    body = {**PROMPT, "temperature": 1.0, "seed": 2 ** 64 - 1}
    first = post(servers.instance.url, "/v1/completions", body)
    assert first.status_code == 200, first.text
    assert post(servers.instance.url, "/v1/completions", body).json()["choices"] == first.json()["choices"]


def test_a_request_whose_sampling_fails_fails_alone(servers: Servers, loaded: LoadedModel) -> None:
    """Parameters that slipped past validation (here a seed torch cannot take) make the
    sampler fail for that request: it ends with FinishReason.ERROR, the request beside it
    in the batch completes, and the engine stays healthy."""
    ids = loaded.tokenizer.encode("Once upon a time", add_special_tokens=True)
    broken = SamplingParams(max_tokens=8, temperature=1.0, seed=1)
    object.__setattr__(broken, "seed", 2 ** 64)  # past SamplingParams' own check
    fine = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)

    async def run() -> tuple[list, list]:
        async def collect(rid: str, params: SamplingParams) -> list:
            return [out async for out in servers.engine.generate(rid, ids, params)]
        return await asyncio.gather(collect("hostile-broken", broken), collect("hostile-fine", fine))

    bad, good = asyncio.run(run())
    assert bad[-1].finished and bad[-1].finish_reason is FinishReason.ERROR
    assert "sampl" in (bad[-1].error or "")
    assert good[-1].finish_reason is FinishReason.LENGTH
    assert sum(len(out.new_token_ids) for out in good) == 8
    servers.assert_healthy_and_serving()


# ------------------------------------------------------------------ finding 7: bad JSON


def nested(depth: int) -> bytes:
    return b'{"prompt": "hi", "max_tokens": 1, "extra": ' + b"[" * depth + b"]" * depth + b"}"


BAD_JSON = {
    "lone high surrogate": b'{"prompt": "\\ud800", "max_tokens": 1}',
    "lone low surrogate": b'{"prompt": "a\\udc00b", "max_tokens": 1}',
    "surrogate in chat content": b'{"messages": [{"role": "user", "content": "\\ud83d"}], "max_tokens": 1}',
    "surrogate in a key": b'{"prompt": "hi", "max_tokens": 1, "\\udfff": 1}',
    "surrogate as raw bytes": b'{"prompt": "\xed\xa0\x80", "max_tokens": 1}',
    "nested 100k deep": nested(100_000),
    "nested 900 deep": nested(900),
    "nested 200 deep": nested(200),
    "NaN": b'{"prompt": "hi", "max_tokens": 1, "temperature": NaN}',
    "Infinity": b'{"prompt": "hi", "max_tokens": 1, "top_p": Infinity}',
    "-Infinity": b'{"prompt": "hi", "max_tokens": 1, "extra": -Infinity}',
    "1e400": b'{"prompt": "hi", "max_tokens": 1, "temperature": 1e400}',
    "-1e400 in an ignored field": b'{"prompt": "hi", "max_tokens": 1, "extra": [-1e400]}',
    "1e400 as max_tokens": b'{"prompt": "hi", "max_tokens": 1e400}',
}


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("case", list(BAD_JSON))
def test_bad_json_is_400_with_an_openai_error_body(servers: Servers, target: str, case: str) -> None:
    path = "/v1/chat/completions" if b"messages" in BAD_JSON[case] else "/v1/completions"
    assert_openai_error(post(servers.url(target), path, BAD_JSON[case]), 400)
    assert httpx.get(servers.instance.url + "/health", timeout=30).status_code == 200


@pytest.mark.parametrize("target", TARGETS)
def test_valid_escapes_and_moderate_nesting_are_still_served(servers: Servers, target: str) -> None:
    """A surrogate pair is one character (json.dumps writes every emoji so), and a few
    levels of nesting in a field the server ignores are fine."""
    body = (b'{"prompt": "Say \\ud83d\\ude00 and \\u00e9", "max_tokens": 2, "temperature": 0, '
            b'"extra": [[[{"a": [1.5, -2e10]}]]]}')
    r = post(servers.url(target), "/v1/completions", body)
    assert r.status_code == 200, r.text


def test_an_unexpected_error_in_the_proxy_is_an_openai_500_not_plain_text(servers: Servers) -> None:
    pd = servers.proxy_app.state.proxy

    async def broken(request: Any, route: str) -> Any:
        raise RuntimeError("a bug in the proxy")

    pd.handle = broken
    try:
        assert_openai_error(post(servers.proxy.url, "/v1/completions", PROMPT), 500, code="internal_error")
    finally:
        del pd.handle


# ------------------------------------------------------------------ finding 8: huge prompts


def test_health_answers_while_a_prompt_is_being_tokenised(servers: Servers, gated: GatedTokenizer) -> None:
    """The gate holds the tokenisation open: /health must answer meanwhile. Tokenised on
    the event loop, the loop is stuck in the gate and /health times out."""
    gated.gate.clear()
    with ThreadPoolExecutor(1) as pool:
        try:
            pending = pool.submit(post, servers.instance.url, "/v1/completions", {**PROMPT, "temperature": 0})
            assert gated.entered.wait(60), "the request never reached the tokenizer"
            assert httpx.get(servers.instance.url + "/health", timeout=30).status_code == 200
            assert not pending.done()
        finally:
            gated.gate.set()
        answer = pending.result(timeout=60)
    assert answer.status_code == 200 and "Paris" in answer.json()["choices"][0]["text"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_prompt_with_more_bytes_than_the_context_holds_is_400_untokenised(
        servers: Servers, gated: GatedTokenizer, path: str) -> None:
    text = "All work and no play makes Jack a dull boy. " * ((10 << 20) // 44)  # 10 MB
    body: dict[str, Any] = ({"prompt": text} if path == "/v1/completions"
                            else {"messages": [{"role": "user", "content": text}]})
    r = post(servers.instance.url, path, {**body, "max_tokens": 1})
    error = assert_openai_error(r, 400, param="prompt" if path == "/v1/completions" else "messages",
                                code="context_length_exceeded")
    assert f"{MAX_MODEL_LEN} tokens" in error["message"]
    assert gated.calls == 0, "the oversized prompt was tokenised"
    assert_openai_error(post(servers.proxy.url, path, {**body, "max_tokens": 1}), 400,
                        code="context_length_exceeded")


def test_a_prompt_of_long_tokens_that_fits_the_context_is_served(servers: Servers, loaded: LoadedModel) -> None:
    """The byte bound never refuses a prompt that fits: 500 tokens of 81 bytes each (a newline
    and 80 spaces is one token) are served."""
    text = ("\n" + " " * 80) * 500
    assert len(loaded.tokenizer.encode(text, add_special_tokens=True)) < MAX_MODEL_LEN - 1
    r = post(servers.instance.url, "/v1/completions", {"prompt": text, "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200, r.text


# ------------------------------------------------------------------ issue 27: request bodies past the cap


@pytest.mark.parametrize("target", TARGETS)
def test_a_body_one_byte_over_32_mib_is_413_on_the_instance_and_the_proxy(servers: Servers, target: str) -> None:
    """The proxy read any body whole (300 MB took it from 88 MB to 1.47 GB); both now stop at 32 MiB."""
    base = httpx.Request("POST", servers.instance.url, json={**PROMPT, "prompt": ""}).content
    body = httpx.Request("POST", servers.instance.url,
                         json={**PROMPT, "prompt": "x" * (MAX_BODY_BYTES + 1 - len(base))}).content
    assert len(body) == MAX_BODY_BYTES + 1
    error = assert_openai_error(post(servers.url(target), "/v1/completions", body), 413)
    assert str(MAX_BODY_BYTES) in error["message"]
    assert error["code"] == "request_too_large"  # the same body from the instance as from the proxy
    servers.assert_healthy_and_serving()
