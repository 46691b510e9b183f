"""The OpenAI-compatible server of one kvbridge instance, spoken to by real clients.

One uvicorn server per module, on 127.0.0.1 with a port from the OS, serves the real
default model (SmolLM2-135M-Instruct) through the real engine. The official `openai`
client (sync and async) covers what applications do; httpx covers what a client
library would never send (malformed JSON, wrong types) and disconnects. After every
test all KV blocks must be back in the pool.

The engine is wrapped by InstrumentedEngine (api_instance.py, with the instance and the
fixtures this module shares with test_prompt_lists.py), which uses only LLMEngine's public API.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch is imported

import asyncio
import json
import re
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from kvbridge.engine.loader import LoadedModel
from kvbridge.kv_transfer.params import parse_kv_transfer_params, to_wire
from kvbridge.server.async_engine import AsyncEngine
from tests.integration.api_instance import (API_KEY, MAX_MODEL_LEN, MODEL, REMOTE_PREFILL, InstrumentedEngine, Instance,
                                            inst, llm, loaded, new_engine, post)
from tests.openai_errors import assert_openai_error

# Long enough (seconds on 2 cores) that a request is still running when the test acts on it.
LONG = {"max_tokens": 400, "ignore_eos": True}
FRANCE = [{"role": "user", "content": "Name the capital of France."}]  # README's question: a clear greedy answer in bf16 and fp32

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def keyed(inst: Instance) -> Iterator[Instance]:
    """A second server, with an API key, on the same engine."""
    instance = Instance(inst.engine, api_key=API_KEY)
    yield instance
    instance.close()


@pytest.fixture(autouse=True)
def all_blocks_free_after_each_test(inst: Instance, llm: InstrumentedEngine) -> Iterator[None]:
    yield
    llm.notified.clear()
    llm.fail_requests.clear()
    llm.returned_params.clear()
    llm.has_kv_connector = True
    m = inst.wait_all_blocks_free()
    assert m.num_free_blocks == m.num_total_blocks, m
    assert m.num_running == 0 and m.num_waiting == 0, m


def sse_events(lines: Iterator[str]) -> Iterator[Any]:
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            yield data if data == "[DONE]" else json.loads(data)


# ------------------------------------------------------------------------ happy paths


def test_greedy_completion_is_sensible_text_with_exact_usage(inst: Instance, llm: InstrumentedEngine) -> None:
    prompt = "The capital of France is"
    r = inst.client().completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    assert r.object == "text_completion" and r.model == MODEL and r.id.startswith("cmpl-")
    assert "Paris" in r.choices[0].text
    assert r.usage.prompt_tokens == len(llm.tokenizer.encode(prompt, add_special_tokens=True))
    assert r.usage.completion_tokens == 8 and r.choices[0].finish_reason == "length"
    assert r.usage.total_tokens == r.usage.prompt_tokens + 8


def test_greedy_chat_answers_the_question(inst: Instance) -> None:
    r = inst.client().chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=30, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant"
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert 0 < r.usage.completion_tokens <= 30


def test_token_id_prompt_gives_the_same_answer_as_its_text(inst: Instance, llm: InstrumentedEngine) -> None:
    prompt = "The capital of France is"
    ids = llm.tokenizer.encode(prompt, add_special_tokens=True)
    client = inst.client()
    by_text = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
    by_ids = client.completions.create(model=MODEL, prompt=[ids], max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text


def test_completion_stream_concatenates_to_the_non_streamed_text(inst: Instance) -> None:
    client = inst.client()
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0)
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_chat_stream_has_role_then_content_then_finish_then_usage(inst: Instance) -> None:
    client = inst.client()
    whole = client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=16, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=16,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.id == chunks[0].id and c.object == "chat.completion.chunk" for c in chunks)
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishing) == 1 and finishing[0].choices[0].finish_reason == whole.choices[0].finish_reason
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_stream_without_usage_option_has_no_usage_and_ends_with_done(inst: Instance) -> None:
    body = {"model": MODEL, "messages": FRANCE, "max_tokens": 4, "stream": True}
    with httpx.stream("POST", inst.url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = list(sse_events(r.iter_lines()))
    assert events[-1] == "[DONE]"
    assert all("usage" not in e for e in events[:-1])


async def test_concurrent_async_streams_match_their_sequential_answers(inst: Instance) -> None:
    prompts = ["The capital of France is", "My favourite colour is", "1, 2, 3, 4,"]
    client = openai.AsyncOpenAI(base_url=inst.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    alone = [(await client.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0))
             .choices[0].text for p in prompts]

    async def streamed(prompt: str) -> str:
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=8,
                                                 temperature=0, stream=True)
        return "".join([c.choices[0].text async for c in stream])

    together = await asyncio.gather(*(streamed(p) for p in prompts))
    await client.close()
    assert list(together) == alone


def test_completion_logprobs_cover_every_token(inst: Instance) -> None:
    r = inst.client().completions.create(model=MODEL, prompt="Hello, my name is", max_tokens=5,
                                         temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == r.choices[0].text
    assert all(x <= 0 for x in lp.token_logprobs)
    assert all(1 <= len(top) <= 3 for top in lp.top_logprobs)
    # greedy: the chosen token is the most likely one
    assert all(abs(max(top.values()) - chosen) < 1e-4
               for top, chosen in zip(lp.top_logprobs, lp.token_logprobs))
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


def test_chat_logprobs_when_asked_and_not_otherwise(inst: Instance) -> None:
    client = inst.client()
    r = client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=5, temperature=0,
                                       logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    plain = client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=5, temperature=0)
    assert plain.choices[0].logprobs is None


def test_stop_string_ends_the_text_before_it(inst: Instance) -> None:
    client = inst.client()
    kwargs = dict(model=MODEL, prompt="1, 2, 3, 4, 5,", max_tokens=12, temperature=0)
    free = client.completions.create(**kwargs).choices[0].text
    stop = free[len(free) // 2:len(free) // 2 + 2]
    assert stop.strip(), f"pick another prompt: {free!r}"
    stopped = client.completions.create(**kwargs, stop=[stop]).choices[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == free[:free.index(stop)]
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kwargs, stop=stop, stream=True))
    assert streamed == stopped.text


def test_request_id_header_is_honoured_and_echoed(inst: Instance) -> None:
    r = post(inst, "/v1/completions", {"prompt": "Hi", "max_tokens": 1}, headers={"X-Request-Id": "shared-id-42"})
    assert r.status_code == 200
    assert r.headers["x-request-id"] == "shared-id-42" and r.json()["id"] == "cmpl-shared-id-42"
    generated = post(inst, "/v1/completions", {"prompt": "Hi", "max_tokens": 1})
    assert generated.json()["id"] == "cmpl-" + generated.headers["x-request-id"]


def test_kv_transfer_params_from_the_engine_are_returned_at_the_top_level(inst: Instance,
                                                                         llm: InstrumentedEngine) -> None:
    params = to_wire(parse_kv_transfer_params({**REMOTE_PREFILL, "remote_request_id": "kvp-1"}))
    llm.returned_params.update({"kvp-1": params, "kvp-2": params})
    body = {"prompt": "Hi", "max_tokens": 2, "kv_transfer_params": {"do_remote_decode": True}}
    r = post(inst, "/v1/completions", body, headers={"X-Request-Id": "kvp-1"})
    assert r.status_code == 200 and r.json()["kv_transfer_params"] == params
    with httpx.stream("POST", inst.url + "/v1/chat/completions", timeout=60, headers={"X-Request-Id": "kvp-2"},
                      json={"messages": FRANCE, "max_tokens": 2, "stream": True}) as streamed:
        chunks = [e for e in sse_events(streamed.iter_lines()) if e != "[DONE]"]
    assert [c.get("kv_transfer_params") for c in chunks if c["choices"][0]["finish_reason"]] == [params]
    assert all("kv_transfer_params" not in c for c in chunks if not c["choices"][0]["finish_reason"])
    plain = post(inst, "/v1/completions", {"prompt": "Hi", "max_tokens": 1})
    assert plain.json()["kv_transfer_params"] is None


def test_models_health_and_metrics(inst: Instance) -> None:
    models = inst.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert inst.client().models.retrieve(MODEL).id == MODEL
    assert httpx.get(inst.url + "/health").status_code == 200
    before = inst.metric("kvbridge_requests_total", outcome="length")
    inst.client().completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    text = httpx.get(inst.url + "/metrics").text
    for name in ("kvbridge_requests_total", "kvbridge_time_to_first_token_seconds_bucket",
                 "kvbridge_inter_token_latency_seconds_bucket", "kvbridge_e2e_request_latency_seconds_count",
                 "kvbridge_prompt_tokens_total", "kvbridge_generation_tokens_total",
                 "kvbridge_num_requests_running", "kvbridge_num_requests_waiting",
                 "kvbridge_kv_cache_usage_ratio", "kvbridge_prefix_cache_queries_total",
                 "kvbridge_prefix_cache_hits_total", "kvbridge_engine_healthy"):
        assert name in text, name
    assert inst.metric("kvbridge_requests_total", outcome="length") == before + 1
    assert inst.metric("kvbridge_kv_cache_total_blocks") == 96


# ------------------------------------------------------------------------ bad input


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", b'{"prompt": "Hi", ', None),  # malformed JSON
    ("/v1/completions", b'\xff\xfe', None),  # not even text
    ("/v1/completions", [1, 2], None),  # JSON, not an object
    ("/v1/completions", {"max_tokens": 3}, "prompt"),  # missing prompt
    ("/v1/completions", {"prompt": "Hi", "max_tokens": "5"}, "max_tokens"),  # wrong type
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": -3}, "max_tokens"),
    ("/v1/completions", {"prompt": "Hi", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"prompt": "Hi", "temperature": 7}, "temperature"),
    ("/v1/completions", {"prompt": 42}, "prompt"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": ["a", ""]}, "prompt"),  # a batch holding an empty prompt
    ("/v1/completions", {"prompt": [-1]}, "prompt"),
    ("/v1/completions", {"prompt": "Hi", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "Hi", "n": 2, "best_of": 1}, "best_of"),
    ("/v1/completions", {"prompt": "Hi", "best_of": 3, "stream": True}, "best_of"),
    ("/v1/completions", {"prompt": ["a", "b"], "n": 600}, "n"),  # 1200 sequences
    ("/v1/completions", {"prompt": "Hi", "echo": False, "max_tokens": 0}, "max_tokens"),  # 0 needs echo
    ("/v1/completions", {"prompt": "Hi", "prompt_logprobs": 21}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "Hi", "prompt_logprobs": -1}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "Hi", "echo": "yes"}, "echo"),
    ("/v1/completions", {"prompt": "Hi", "suffix": "!"}, "suffix"),
    ("/v1/completions", {"prompt": "Hi", "logprobs": 50}, "logprobs"),
    ("/v1/completions", {"prompt": "Hi", "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/completions", {"prompt": "Hi", "stop": ""}, "stop"),
    ("/v1/completions", {"prompt": "Hi", "kv_transfer_params": {"do_remote_prefill": True}},
     "kv_transfer_params"),
    ("/v1/completions", {"prompt": "Hi", "kv_transfer_params": "yes"}, "kv_transfer_params"),
    ("/v1/completions", {"prompt": "Hi", "continue_from_token_ids": [-1]}, "continue_from_token_ids"),
    ("/v1/completions", {"prompt": "Hi", "continue_from_token_ids": [5]}, None),  # no prefill's params
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": "Hi"}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "Hi"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages"),
    ("/v1/chat/completions", {"messages": FRANCE, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": FRANCE, "max_completion_tokens": 0}, "max_completion_tokens"),
])
def test_bad_request_is_400_with_openai_error_body(inst: Instance, path: str, body: Any,
                                                   param: str | None) -> None:
    assert_openai_error(post(inst, path, body), 400, param=param)


def test_token_id_outside_the_vocabulary_is_400(inst: Instance, llm: InstrumentedEngine) -> None:
    error = assert_openai_error(post(inst, "/v1/completions", {"prompt": [llm.tokenizer.vocab_size + 5]}), 400)
    assert "token" in error["message"]


def test_prompt_longer_than_the_context_is_400_saying_so(inst: Instance) -> None:
    words = "hello " * (MAX_MODEL_LEN + 10)
    error = assert_openai_error(post(inst, "/v1/completions", {"prompt": words}), 400,
                                code="context_length_exceeded")
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in error["message"]
    chat = post(inst, "/v1/chat/completions", {"messages": [{"role": "user", "content": words}]})
    assert_openai_error(chat, 400, param="messages", code="context_length_exceeded")
    fits_alone = post(inst, "/v1/completions", {"prompt": "hello " * 300, "max_tokens": 300})
    assert_openai_error(fits_alone, 400, param="max_tokens", code="context_length_exceeded")


def test_unknown_model_is_404(inst: Instance) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        inst.client().completions.create(model="gpt-17", prompt="Hi", max_tokens=1)
    assert caught.value.body["code"] == "model_not_found"
    assert_openai_error(post(inst, "/v1/chat/completions", {"model": "gpt-17", "messages": FRANCE}), 404,
                        param="model", code="model_not_found")
    assert httpx.get(inst.url + "/v1/models/gpt-17").status_code == 404
    assert_openai_error(httpx.get(inst.url + "/v1/no-such-route"), 404)


@pytest.mark.parametrize("method, path, allow", [
    ("GET", "/v1/completions", "POST"), ("DELETE", "/health", "GET"), ("PUT", "/v1/models", "GET")])
def test_a_route_asked_with_the_wrong_method_is_405_with_its_code_and_allow_header(inst: Instance, method: str,
                                                                                  path: str, allow: str) -> None:
    """As the proxy answers it: code method_not_allowed, and the Allow header naming what the route takes."""
    answer = httpx.request(method, inst.url + path)
    assert_openai_error(answer, 405, code="method_not_allowed")
    assert answer.headers.get("allow") == allow


def test_api_key_is_required_when_set_but_health_stays_open(keyed: Instance) -> None:
    body = {"prompt": "Hi", "max_tokens": 1}
    assert_openai_error(post(keyed, "/v1/completions", body), 401, code="invalid_api_key")
    wrong = post(keyed, "/v1/completions", body, headers={"Authorization": "Bearer sk-wrong"})
    assert_openai_error(wrong, 401, code="invalid_api_key")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=keyed.url + "/v1", api_key="sk-wrong", max_retries=0).models.list()
    assert keyed.client().completions.create(model=MODEL, prompt="Hi", max_tokens=1).usage.completion_tokens == 1
    assert httpx.get(keyed.url + "/health").status_code == 200


# ------------------------------------------------------------------------ pre-admission rejection (seed 002)


@pytest.mark.parametrize("path, body, status", [
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 0}, 400),
    ("/v1/completions", {"prompt": "Hi", "temperature": "hot"}, 400),
    ("/v1/completions", {"prompt": "Hi", "n": 0}, 400),
    ("/v1/completions", {"prompt": "hello " * (MAX_MODEL_LEN + 10)}, 400),
    ("/v1/completions", {"prompt": [10 ** 7]}, 400),  # refused by the engine's own check
    ("/v1/completions", {"model": "other", "prompt": "Hi"}, 404),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "Hi"}]}, 400),
])
def test_rejected_remote_prefill_request_notifies_the_prefill_instance(
        inst: Instance, llm: InstrumentedEngine, path: str, body: dict, status: int) -> None:
    r = post(inst, path, {**body, "kv_transfer_params": REMOTE_PREFILL}, headers={"X-Request-Id": "d-req-1"})
    assert_openai_error(r, status)
    assert [(rid, p.remote_request_id, p.remote_engine_id) for rid, p in llm.notified] == \
        [("d-req-1", "p-req-7", "prefill-0")]


def test_rejection_notifies_only_with_a_connector_and_a_remote_prefill(inst: Instance,
                                                                      llm: InstrumentedEngine) -> None:
    bad = {"prompt": "Hi", "max_tokens": 0}
    assert post(inst, "/v1/completions", bad).status_code == 400  # no kv_transfer_params
    decode_side = {**bad, "kv_transfer_params": {"do_remote_decode": True}}
    assert post(inst, "/v1/completions", decode_side).status_code == 400
    llm.has_kv_connector = False
    assert post(inst, "/v1/completions", {**bad, "kv_transfer_params": REMOTE_PREFILL}).status_code == 400
    assert llm.notified == []


def test_unauthenticated_request_causes_no_notification(keyed: Instance, llm: InstrumentedEngine) -> None:
    r = post(keyed, "/v1/completions", {"prompt": "Hi", "kv_transfer_params": REMOTE_PREFILL})
    assert r.status_code == 401 and llm.notified == []


async def test_overload_is_503_with_retry_after_and_notifies(inst: Instance, llm: InstrumentedEngine) -> None:
    # 4 running + 4 waiting fit; more concurrent requests must be refused, not queued.
    body = {"messages": FRANCE, "stream": True, "kv_transfer_params": REMOTE_PREFILL, **LONG}
    async with httpx.AsyncClient(base_url=inst.url, timeout=60) as client:
        async def start(i: int) -> tuple[httpx.Response, bytes]:
            request = client.build_request("POST", "/v1/chat/completions", json=body,
                                           headers={"X-Request-Id": f"over-{i}"})
            response = await client.send(request, stream=True)
            first = await response.aiter_raw().__anext__()
            return response, first

        started = await asyncio.gather(*(start(i) for i in range(11)))
        refused = [(r, first) for r, first in started if r.status_code == 503]
        assert len(refused) >= 3 and all(r.status_code in (200, 503) for r, _ in started)
        for response, first in refused:
            assert response.headers["retry-after"] == "1"
            assert json.loads(first)["error"]["code"] == "overloaded"
        assert sorted(rid for rid, _ in llm.notified) == sorted(r.headers["x-request-id"] for r, _ in refused)
        for response, _ in started:
            await response.aclose()  # the admitted ones disconnect: their blocks must come back


# ------------------------------------------------------------------------ failures and disconnects


def test_request_failed_by_the_engine_is_500_with_its_message(inst: Instance, llm: InstrumentedEngine) -> None:
    message = "KV transfer from prefill-0 failed (handshake timed out); the request may be retried"
    llm.fail_requests["fail-1"] = message
    r = post(inst, "/v1/completions", {"prompt": "Hi", "max_tokens": 5}, headers={"X-Request-Id": "fail-1"})
    assert assert_openai_error(r, 500)["message"] == message
    llm.fail_requests["fail-2"] = message
    with pytest.raises(openai.APIError, match="may be retried"):
        for _ in inst.client().chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=5, stream=True,
                                                       extra_headers={"X-Request-Id": "fail-2"}):
            pass
    assert inst.metric("kvbridge_requests_total", outcome="error") >= 2


def test_stream_failing_midway_ends_with_an_error_event_then_done(inst: Instance, llm: InstrumentedEngine) -> None:
    body = {"prompt": "Once upon a time", "stream": True, **LONG}
    with httpx.stream("POST", inst.url + "/v1/completions", json=body, timeout=60,
                      headers={"X-Request-Id": "midway"}) as r:
        events = sse_events(r.iter_lines())
        assert "choices" in next(events)
        llm.fail_requests["midway"] = "KV transfer failed; the request may be retried"
        rest = list(events)
    assert rest[-1] == "[DONE]" and rest[-2]["error"]["type"] == "server_error"
    assert "may be retried" in rest[-2]["error"]["message"]


def test_streaming_client_that_disconnects_aborts_its_request(inst: Instance) -> None:
    aborted = inst.metric("kvbridge_requests_total", outcome="abort")
    body = {"prompt": "Once upon a time", "stream": True, **LONG}
    with httpx.stream("POST", inst.url + "/v1/completions", json=body, timeout=60) as r:
        assert "choices" in next(sse_events(r.iter_lines()))
    # the connection is closed mid-stream; the request would run for seconds more
    # The abort is counted on the server's loop after the engine thread freed the blocks: wait
    # for the count (an abort proves the request did not run its 400 tokens), then the blocks.
    assert inst.wait_metric("kvbridge_requests_total", aborted + 1, outcome="abort") == aborted + 1
    m = inst.wait_all_blocks_free(timeout_s=30)
    assert m.num_free_blocks == m.num_total_blocks


def test_non_streaming_client_that_disconnects_aborts_its_request(inst: Instance) -> None:
    aborted = inst.metric("kvbridge_requests_total", outcome="abort")
    with pytest.raises(httpx.ReadTimeout):
        post(inst, "/v1/completions", {"prompt": "Once upon a time", **LONG}, timeout=httpx.Timeout(60, read=1.0))
    # The abort is counted on the server's loop after the engine thread freed the blocks: wait
    # for the count (an abort proves the request did not run its 400 tokens), then the blocks.
    assert inst.wait_metric("kvbridge_requests_total", aborted + 1, outcome="abort") == aborted + 1
    m = inst.wait_all_blocks_free(timeout_s=30)
    assert m.num_free_blocks == m.num_total_blocks


@pytest.fixture
def doomed(loaded: LoadedModel) -> Iterator[tuple[Instance, InstrumentedEngine]]:
    """A server of its own, for tests that end its engine."""
    llm = new_engine(loaded)
    engine = AsyncEngine(llm)
    instance = Instance(engine)
    yield instance, llm
    instance.close()
    engine.shutdown()


def test_engine_failure_fails_in_flight_requests_and_turns_health_503(
        doomed: tuple[Instance, InstrumentedEngine]) -> None:
    inst, llm = doomed
    body = {"prompt": "Once upon a time", "stream": True, **LONG}
    with httpx.stream("POST", inst.url + "/v1/completions", json=body, timeout=60) as r:
        events = sse_events(r.iter_lines())
        assert "choices" in next(events)
        llm.explode = True
        rest = list(events)
    assert rest[-1] == "[DONE]" and "injected device failure" in rest[-2]["error"]["message"]
    health = httpx.get(inst.url + "/health", timeout=10)
    assert_openai_error(health, 503)
    assert "injected device failure" in health.json()["error"]["message"]
    assert_openai_error(post(inst, "/v1/completions", {"prompt": "Hi"}), 503)
    assert inst.metric("kvbridge_engine_healthy") == 0


def test_shutdown_fails_in_flight_requests_refuses_new_ones_and_frees_blocks(
        doomed: tuple[Instance, InstrumentedEngine]) -> None:
    inst, llm = doomed
    body = {"messages": FRANCE, "stream": True, **LONG}
    with httpx.stream("POST", inst.url + "/v1/chat/completions", json=body, timeout=60) as r:
        events = sse_events(r.iter_lines())
        next(events), next(events)  # the role chunk, then the first token
        inst.engine.begin_shutdown()
        rest = list(events)
    assert rest[-1] == "[DONE]" and "shutting down" in rest[-2]["error"]["message"]
    assert_openai_error(httpx.get(inst.url + "/health", timeout=10), 503)
    assert_openai_error(post(inst, "/v1/chat/completions", {"messages": FRANCE}), 503)
    inst.engine.shutdown()
    m = llm.metrics()  # the engine thread is gone: the engine is ours to read
    assert m.num_free_blocks == m.num_total_blocks


def test_run_server_prints_its_url_and_stops_on_sigint_failing_open_streams() -> None:
    # SIGTERM drains instead (tests/integration/test_drain.py); SIGINT stops at once, as before.
    code = ("from kvbridge.config import CacheConfig, EngineConfig\n"
            "from kvbridge.server.api_server import run_server\n"
            f"run_server(EngineConfig(model={MODEL!r}, max_model_len={MAX_MODEL_LEN}, "
            "cache=CacheConfig(num_blocks=64)), '127.0.0.1', 0, None, 'warning')\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})
    try:
        url = printed_url(proc, timeout_s=60)
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        body = {"prompt": "Once upon a time", "stream": True, **LONG}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            events = sse_events(r.iter_lines())
            assert "choices" in next(events)
            proc.send_signal(signal.SIGINT)
            rest = list(events)
        assert rest[-1] == "[DONE]" and "shutting down" in rest[-2]["error"]["message"]
        assert proc.wait(timeout=30) == 0  # uvicorn re-raises the SIGINT it handled: a KeyboardInterrupt, caught
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()


def printed_url(proc: subprocess.Popen, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    seen = []
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], deadline - time.monotonic())
        line = proc.stdout.readline() if ready else ""
        match = re.search(r"(http://127\.0\.0\.1:\d+)/v1", line)
        if match:
            return match.group(1)
        assert line or proc.poll() is None, "".join(seen)
        seen.append(line)
    raise AssertionError("no URL printed: " + "".join(seen))
