"""Issue 48, part 1, through P/D: a real P and D (SmolLM2, TCP transfer backend, real API servers on
loopback) behind the real proxy. Each prompt of a list takes its own P/D path; the merged answer
equals the colocated one (D asked without kv_transfer_params), streamed (the first token from P)
and not. P samples the first token, so logit_bias and min_tokens must hold there too. One prompt's
failure fails the list and leaves nothing held on P. /tokenize and /detokenize through the proxy."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch is imported
os.environ.setdefault("UCX_NET_DEVICES", "lo")

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from kvbridge.chaos import ThreadServer
from kvbridge.config import CacheConfig, EngineConfig, KVRole, KVTransferConfig
from kvbridge.engine.engine import LLMEngine
from kvbridge.engine.kv_connector_factory import build_connectors
from kvbridge.engine.loader import LoadedModel, load_model
from kvbridge.proxy.app import build_proxy_app
from kvbridge.server.api_server import build_app
from kvbridge.server.async_engine import AsyncEngine
from tests.openai_errors import assert_openai_error

MODEL = "SmolLM2-135M-Instruct"
PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3, 4,"]
GREEDY: dict[str, Any] = {"model": MODEL, "max_tokens": 6, "temperature": 0}
FRANCE = [{"role": "user", "content": "Name the capital of France."}]
WAIT_S = 20.0

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model(MODEL)


def _engine(loaded: LoadedModel, role: KVRole, engine_id: str) -> AsyncEngine:
    config = EngineConfig(cache=CacheConfig(num_blocks=96), max_model_len=512, num_threads=1,
                          kv_transfer=KVTransferConfig(role=role, backend="tcp", engine_id=engine_id, lease_seconds=60))
    return AsyncEngine(LLMEngine(config, loaded, build_connectors(config, loaded.arch, loaded.name)))


class World:
    def __init__(self, p: AsyncEngine, d: AsyncEngine, servers: list[ThreadServer]) -> None:
        self.p, self.d = p, d
        self.p_url, self.d_url, self.proxy_url = (s.url for s in servers)

    def held_on_p(self) -> int:
        return self.p.call_threadsafe(lambda e: e.metrics().num_held_for_remote).result(timeout=30)

    def expired_on_p(self) -> int:
        return self.p.call_threadsafe(lambda e: e.connectors.worker.stats.expired_leases).result(timeout=30)

    def settled(self) -> None:
        """Nothing held on P for a reader, every block of both free (polled: releases land a moment late)."""
        deadline = time.monotonic() + WAIT_S
        for engine in (self.p, self.d):
            while True:
                m = engine.call_threadsafe(lambda e: e.metrics()).result(timeout=30)
                done = (m.num_free_blocks == m.num_total_blocks and m.num_running == 0 and m.num_waiting == 0
                        and (engine is self.d or self.held_on_p() == 0))
                if done:
                    break
                assert time.monotonic() < deadline, m
                time.sleep(0.02)

    def client(self, url: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def world(loaded: LoadedModel) -> Iterator[World]:
    p = _engine(loaded, KVRole.PRODUCER, "P-lists")
    d = _engine(loaded, KVRole.CONSUMER, "D-lists")
    p_server, d_server = ThreadServer(build_app(p)), ThreadServer(build_app(d))
    proxy = ThreadServer(build_proxy_app([p_server.url], [d_server.url], health_interval_s=0.5))
    yield World(p, d, [p_server, d_server, proxy])
    proxy.stop()
    p_server.stop()
    d_server.stop()
    p.shutdown()
    d.shutdown()


@pytest.fixture(autouse=True)
def settled_after_each_test(world: World) -> Iterator[None]:
    expired = world.expired_on_p()
    yield
    world.settled()
    assert world.expired_on_p() == expired, "a lease expired: P held KV nobody released"


def events(url: str, body: dict[str, Any]) -> list[Any]:
    out = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: "):]
                out.append(data if data == "[DONE]" else json.loads(data))
    return out


def texts_by_index(evts: list[Any]) -> dict[int, str]:
    out: dict[int, str] = {}
    for e in evts:
        if e != "[DONE]":
            for c in e["choices"]:
                out[c["index"]] = out.get(c["index"], "") + c["text"]
    return out


@pytest.mark.parametrize("form", ["texts", "token_ids"])
def test_a_list_through_pd_equals_the_colocated_answer(world: World, loaded: LoadedModel, form: str) -> None:
    prompts: Any = PROMPTS if form == "texts" else [world.p.tokenizer.encode(p, add_special_tokens=True)
                                                    for p in PROMPTS]
    colocated = world.client(world.d_url).completions.create(prompt=prompts, **GREEDY)
    pd = world.client(world.proxy_url).completions.create(prompt=prompts, **GREEDY)
    assert [c.index for c in pd.choices] == [0, 1, 2]
    assert [c.text for c in pd.choices] == [c.text for c in colocated.choices]
    assert [c.finish_reason for c in pd.choices] == [c.finish_reason for c in colocated.choices]
    assert (pd.usage.prompt_tokens, pd.usage.completion_tokens) == (colocated.usage.prompt_tokens,
                                                                     colocated.usage.completion_tokens)


def test_a_streamed_list_through_pd_equals_the_colocated_stream(world: World) -> None:
    body = {**GREEDY, "prompt": PROMPTS, "stream": True, "stream_options": {"include_usage": True}}
    colocated, pd = events(world.d_url, body), events(world.proxy_url, body)
    assert texts_by_index(pd) == texts_by_index(colocated) and len(texts_by_index(pd)) == 3
    assert pd[-1] == "[DONE]" and pd.count("[DONE]") == 1
    assert pd[-2]["choices"] == [] and pd[-2]["usage"]["completion_tokens"] == colocated[-2]["usage"][
        "completion_tokens"]
    assert pd[-2]["usage"]["prompt_tokens"] == colocated[-2]["usage"]["prompt_tokens"]
    assert len({e["id"] for e in pd[:-1]}) == 1


def test_one_prompt_refused_fails_the_list_and_nothing_stays_held(world: World) -> None:
    r = httpx.post(world.proxy_url + "/v1/completions", timeout=60,
                   json={**GREEDY, "prompt": [PROMPTS[0], "word " * 600], "max_tokens": 50})
    assert_openai_error(r, 400, code="context_length_exceeded")


def test_a_client_leaving_a_streamed_list_through_pd_frees_everything(world: World) -> None:
    body = {**GREEDY, "prompt": PROMPTS, "stream": True, "max_tokens": 200, "ignore_eos": True}
    with httpx.stream("POST", world.proxy_url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break


@pytest.mark.parametrize("stream", [False, True])
def test_logit_bias_holds_for_ps_first_token(world: World, stream: bool) -> None:
    token = world.p.tokenizer.encode(" banana")[0]
    body = {**GREEDY, "prompt": PROMPTS[0], "max_tokens": 3, "logit_bias": {str(token): 100}, "stream": stream}
    expected = world.p.tokenizer.decode([token] * 3)
    if stream:
        assert texts_by_index(events(world.proxy_url, body)) == {0: expected}
    else:
        r = httpx.post(world.proxy_url + "/v1/completions", json=body, timeout=60)
        assert r.json()["choices"][0]["text"] == expected


def test_min_tokens_holds_for_ps_first_token(world: World) -> None:
    """A stop token id that is the greedy first token ends the request at P; min_tokens 2 must
    keep P from sampling it, streamed (P's token goes straight to the client) and not."""
    free = world.client(world.d_url).completions.create(prompt=PROMPTS[2], **GREEDY)
    first = world.p.tokenizer.encode(free.choices[0].text)[0]
    extra = {"stop_token_ids": [first], "min_tokens": 2}
    colocated = world.client(world.d_url).completions.create(prompt=PROMPTS[2], **GREEDY, extra_body=extra)
    assert colocated.usage.completion_tokens >= 2
    pd = world.client(world.proxy_url).completions.create(prompt=PROMPTS[2], **GREEDY, extra_body=extra)
    assert pd.choices[0].text == colocated.choices[0].text
    streamed = events(world.proxy_url, {**GREEDY, "prompt": PROMPTS[2], "stream": True, **extra})
    assert texts_by_index(streamed) == {0: colocated.choices[0].text}
    stopped = world.client(world.proxy_url).completions.create(prompt=PROMPTS[2], **GREEDY,
                                                               extra_body={"stop_token_ids": [first]})
    assert stopped.usage.completion_tokens == 1 and stopped.choices[0].finish_reason == "stop"


def test_min_tokens_holds_off_the_end_of_turn_through_pd(world: World) -> None:
    short = world.client(world.proxy_url).chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=60,
                                                                  temperature=0)
    n = short.usage.completion_tokens + 4
    held = world.client(world.proxy_url).chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=n,
                                                                 temperature=0, extra_body={"min_tokens": n})
    assert held.usage.completion_tokens == n


def test_tokenize_and_detokenize_through_the_proxy(world: World) -> None:
    direct = httpx.post(world.d_url + "/tokenize", json={"model": MODEL, "prompt": PROMPTS[0]}, timeout=30).json()
    r = httpx.post(world.proxy_url + "/tokenize", json={"model": MODEL, "prompt": PROMPTS[0]}, timeout=30)
    assert r.status_code == 200 and r.json() == direct
    back = httpx.post(world.proxy_url + "/detokenize", json={"tokens": direct["tokens"]}, timeout=30)
    assert back.json() == {"prompt": PROMPTS[0]}
    bad = httpx.post(world.proxy_url + "/detokenize", json={"tokens": [10 ** 6]}, timeout=30)
    assert_openai_error(bad, 400, param="tokens")
