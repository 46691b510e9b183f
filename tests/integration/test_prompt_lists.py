"""Issue 48, part 1, on one instance with the real default model and the official `openai` client:
a completion's `prompt` in OpenAI's four forms (each choice equal to the single prompt's answer, with
its index, usage summed, streamed and not), vLLM's /tokenize and /detokenize, logit_bias, min_tokens
and stop_token_ids checked against the vocabulary. Bad input is refused with an OpenAI error body
naming the field and changes nothing (every KV block back in the pool after each test)."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch is imported

import json
from typing import Any

import httpx
import pytest

from kvbridge.server.protocol import MAX_PROMPTS
from tests.integration.api_instance import MODEL, REMOTE_PREFILL, InstrumentedEngine, Instance, inst, llm, loaded, post, stream_events, blocks_back
from tests.openai_errors import assert_openai_error

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("blocks_back")]

PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3, 4,"]
GREEDY: dict[str, Any] = {"max_tokens": 6, "temperature": 0}



def single(inst: Instance, prompt: str | list[int], **kwargs: Any) -> Any:
    return inst.client().completions.create(model=MODEL, prompt=prompt, **{**GREEDY, **kwargs})


# ------------------------------------------------------------------------ the four forms


def test_a_list_of_texts_answers_each_prompt_as_alone_with_its_index_and_usage_summed(inst: Instance) -> None:
    alone = [single(inst, p) for p in PROMPTS]
    r = inst.client().completions.create(model=MODEL, prompt=PROMPTS, **GREEDY)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [a.choices[0].text for a in alone]
    assert [c.finish_reason for c in r.choices] == [a.choices[0].finish_reason for a in alone]
    assert r.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert r.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.id.startswith("cmpl-")


def test_token_id_forms_equal_their_texts(inst: Instance, llm: InstrumentedEngine) -> None:
    ids = [llm.tokenizer.encode(p, add_special_tokens=True) for p in PROMPTS]
    by_text = inst.client().completions.create(model=MODEL, prompt=PROMPTS, **GREEDY)
    by_ids = inst.client().completions.create(model=MODEL, prompt=ids, **GREEDY)
    assert [c.text for c in by_ids.choices] == [c.text for c in by_text.choices]
    one = single(inst, ids[1])  # a list of token ids: one prompt
    assert len(one.choices) == 1 and one.choices[0].index == 0 and one.choices[0].text == by_text.choices[1].text
    wrapped = inst.client().completions.create(model=MODEL, prompt=[PROMPTS[2]], **GREEDY)  # a list of one
    assert [c.text for c in wrapped.choices] == [by_text.choices[2].text]


def test_a_streamed_list_carries_each_prompts_chunks_under_its_index_then_one_summed_usage(inst: Instance) -> None:
    whole = inst.client().completions.create(model=MODEL, prompt=PROMPTS, **GREEDY)
    events = stream_events(inst, {"model": MODEL, "prompt": PROMPTS, "stream": True,
                                  "stream_options": {"include_usage": True}, **GREEDY})
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = [e for e in events[:-1] if e["choices"]]
    texts = {i: "".join(c["choices"][0]["text"] for c in chunks if c["choices"][0]["index"] == i) for i in range(3)}
    assert texts == {c.index: c.text for c in whole.choices}
    finishes = {c["choices"][0]["index"]: c["choices"][0]["finish_reason"] for c in chunks
                if c["choices"][0]["finish_reason"]}
    assert finishes == {c.index: c.finish_reason for c in whole.choices}
    assert len({e["id"] for e in events[:-1]}) == 1
    usage = events[-2]["usage"]
    assert events[-2]["choices"] == [] and usage["prompt_tokens"] == whole.usage.prompt_tokens
    assert usage["completion_tokens"] == whole.usage.completion_tokens


def test_the_official_client_streams_a_list(inst: Instance) -> None:
    texts = {0: "", 1: ""}
    for chunk in inst.client().completions.create(model=MODEL, prompt=PROMPTS[:2], stream=True, **GREEDY):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert [texts[0], texts[1]] == [single(inst, p).choices[0].text for p in PROMPTS[:2]]


# ------------------------------------------------------------------------ refusals


@pytest.mark.parametrize("prompt, says", [
    ([], "prompt must not be empty"),
    ("", "prompt must not be empty"),
    (["a", ""], "empty prompt"),
    ([[1, 2], []], "empty prompt"),
    (["a", [1, 2]], None),  # mixed
    ([1, "a"], None),
    ([[1, "a"]], None),
    ([True, 2], None),
    ([1.5], None),
])
def test_malformed_prompts_are_400_naming_prompt(inst: Instance, prompt: Any, says: str | None) -> None:
    r = post(inst, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 2})
    assert_openai_error(r, 400)
    error = r.json()["error"]
    assert error["param"] == "prompt", error
    assert says is None or says in error["message"], error


def test_too_many_prompts_are_refused(inst: Instance) -> None:
    r = post(inst, "/v1/completions", {"model": MODEL, "prompt": [[1]] * (MAX_PROMPTS + 1), "max_tokens": 1})
    assert_openai_error(r, 400)
    assert r.json()["error"]["param"] == "prompt"


def test_an_out_of_vocabulary_id_in_any_prompt_refuses_the_list_and_admits_none(
        inst: Instance, llm: InstrumentedEngine) -> None:
    vocab = llm.tokenizer.vocab_size
    for prompt in ([[1, 2], [3, vocab]], [5, vocab + 7], [[-1]]):
        r = post(inst, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 2})
        assert_openai_error(r, 400)
        message = r.json()["error"]["message"]
        assert r.json()["error"]["param"] == "prompt"
        assert "out-of-vocab" in message or "greater than or equal to 0" in message, message


def test_one_prompt_too_long_refuses_the_whole_list(inst: Instance) -> None:
    r = post(inst, "/v1/completions", {"model": MODEL, "prompt": [[1] * 10, [1] * 600], "max_tokens": 2})
    assert_openai_error(r, 400)
    assert r.json()["error"]["code"] == "context_length_exceeded"


def test_a_list_with_kv_transfer_params_is_refused_and_p_told(inst: Instance, llm: InstrumentedEngine) -> None:
    r = post(inst, "/v1/completions", {"model": MODEL, "prompt": ["a", "b"], "max_tokens": 2,
                                       "kv_transfer_params": REMOTE_PREFILL})
    assert_openai_error(r, 400)
    assert r.json()["error"]["param"] == "prompt"
    assert [params.remote_request_id for _, params in llm.notified] == ["p-req-7"]


def test_a_client_leaving_a_streamed_list_frees_every_prompt(inst: Instance) -> None:
    body = {"model": MODEL, "prompt": PROMPTS, "stream": True, "max_tokens": 200, "ignore_eos": True}
    with httpx.stream("POST", inst.url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break  # leave after the first chunk; the fixture checks every block is back


# ------------------------------------------------------------------------ logit_bias, min_tokens, stop_token_ids


def test_logit_bias_forces_a_token_and_is_clamped(inst: Instance, llm: InstrumentedEngine) -> None:
    token = llm.tokenizer.encode(" banana")[0]
    r = single(inst, "The capital of France is", max_tokens=4, logit_bias={str(token): 100})
    assert r.choices[0].text == llm.tokenizer.decode([token] * 4)
    clamped = single(inst, "The capital of France is", max_tokens=4, logit_bias={str(token): 1e9})
    assert clamped.choices[0].text == r.choices[0].text
    banned = single(inst, "The capital of France is", max_tokens=4)
    first = llm.tokenizer.encode(banned.choices[0].text)[0]
    other = single(inst, "The capital of France is", max_tokens=4, logit_bias={str(first): -100})
    assert llm.tokenizer.encode(other.choices[0].text)[0] != first


@pytest.mark.parametrize("bias, says", [
    ({"49152": 1}, "out-of-vocab"), ({"-1": 1}, "out-of-vocab"), ({"x": 1}, "integer"), ({"1.0": 1}, "integer"),
    ({"1": "2"}, None), ({"1": True}, None),
])
def test_bad_logit_bias_is_400_naming_it(inst: Instance, bias: dict[str, Any], says: str | None) -> None:
    r = post(inst, "/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": 2, "logit_bias": bias})
    assert_openai_error(r, 400)
    assert r.json()["error"]["param"] == "logit_bias"
    assert says is None or says in r.json()["error"]["message"]


def test_min_tokens_holds_off_the_end_of_turn(inst: Instance) -> None:
    messages = [{"role": "user", "content": "Name the capital of France."}]
    client = inst.client()
    short = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=60, temperature=0)
    assert short.choices[0].finish_reason == "stop"
    n = short.usage.completion_tokens + 5
    held = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=n, temperature=0,
                                          extra_body={"min_tokens": n})
    assert held.usage.completion_tokens == n and held.choices[0].finish_reason == "length"
    assert held.choices[0].message.content.startswith(short.choices[0].message.content)


def test_min_tokens_holds_off_stop_strings_and_stop_token_ids(inst: Instance, llm: InstrumentedEngine) -> None:
    free = single(inst, "1, 2, 3, 4,", max_tokens=12)
    ids = llm.tokenizer.encode(free.choices[0].text)
    stopped = single(inst, "1, 2, 3, 4,", max_tokens=12, extra_body={"stop_token_ids": [ids[0]]})
    assert stopped.usage.completion_tokens == 1 and stopped.choices[0].finish_reason == "stop"
    held = single(inst, "1, 2, 3, 4,", max_tokens=12, extra_body={"stop_token_ids": [ids[0]], "min_tokens": 3})
    assert held.usage.completion_tokens >= 3
    word = free.choices[0].text.strip()[:1]
    by_string = single(inst, "1, 2, 3, 4,", max_tokens=12, stop=[word], extra_body={"min_tokens": 4})
    assert by_string.usage.completion_tokens >= 4


@pytest.mark.parametrize("extra, param", [
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"), ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": "2"}, "min_tokens"), ({"stop_token_ids": [49152]}, "stop_token_ids"),
    ({"stop_token_ids": [-3]}, "stop_token_ids"),
])
def test_bad_min_tokens_and_stop_token_ids_are_400_naming_them(inst: Instance, extra: dict[str, Any],
                                                                param: str) -> None:
    r = post(inst, "/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": 4, **extra})
    assert_openai_error(r, 400)
    assert r.json()["error"]["param"] == param


# ------------------------------------------------------------------------ /tokenize and /detokenize


def test_tokenize_and_detokenize_speak_vllms_fields(inst: Instance, llm: InstrumentedEngine) -> None:
    prompt = "The capital of France is"
    r = post(inst, "/tokenize", {"model": MODEL, "prompt": prompt})
    assert r.status_code == 200
    body = r.json()
    assert set(body) == {"count", "max_model_len", "tokens", "token_strs"}
    assert body["tokens"] == llm.tokenizer.encode(prompt, add_special_tokens=True)
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == inst.engine.max_model_len
    assert body["token_strs"] is None
    strs = post(inst, "/tokenize", {"prompt": prompt, "add_special_tokens": False, "return_token_strs": True}).json()
    assert strs["tokens"] == llm.tokenizer.encode(prompt) and "".join(strs["token_strs"]) == prompt
    back = post(inst, "/detokenize", {"model": MODEL, "tokens": strs["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": prompt}


def test_tokenize_chat_counts_what_a_chat_request_prefills(inst: Instance) -> None:
    messages = [{"role": "user", "content": "Name the capital of France."}]
    counted = post(inst, "/tokenize", {"model": MODEL, "messages": messages}).json()
    answer = inst.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=1, temperature=0)
    assert counted["count"] == answer.usage.prompt_tokens


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {"prompt": 3}, 400, "prompt"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": "a", "model": "nope"}, 404, "model"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"messages": [{"role": "user", "content": "Hi"}], "continue_final_message": True}, 400,
     "continue_final_message"),
    ("/detokenize", {"tokens": [1, 49152]}, 400, "tokens"),
    ("/detokenize", {"tokens": ["1"]}, 400, "tokens"),
    ("/detokenize", {"tokens": [1], "model": "nope"}, 404, "model"),
])
def test_tokenize_refusals_are_openai_errors(inst: Instance, path: str, body: dict[str, Any], status: int,
                                             param: str) -> None:
    r = post(inst, path, body)
    assert_openai_error(r, status)
    assert r.json()["error"]["param"] == param


# ------------------------------------------------------------------------ one prompt failing in the engine


@pytest.mark.parametrize("stream", [False, True])
def test_one_prompt_failing_in_the_engine_fails_the_list_and_ends_the_others(
        inst: Instance, llm: InstrumentedEngine, stream: bool) -> None:
    rid = f"list-fails-{stream}"
    llm.fail_requests[f"{rid}-1"] = "injected failure of one prompt"
    body = {"model": MODEL, "prompt": PROMPTS, "max_tokens": 100, "ignore_eos": True, "stream": stream}
    try:
        if not stream:
            r = post(inst, "/v1/completions", body, headers={"X-Request-Id": rid})
            assert_openai_error(r, 500)
            assert "injected failure" in r.json()["error"]["message"]
            return
        evts = []
        with httpx.stream("POST", inst.url + "/v1/completions", json=body, headers={"X-Request-Id": rid},
                          timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    data = line[len("data: "):]
                    evts.append(data if data == "[DONE]" else json.loads(data))
        assert evts[-1] == "[DONE]" and evts.count("[DONE]") == 1
        assert "injected failure" in evts[-2]["error"]["message"]
        finished = [e for e in evts[:-2] if e["choices"] and e["choices"][0]["finish_reason"]]
        assert len(finished) < 3  # the list ended at the failure, not after every prompt's 100 tokens
    finally:
        llm.fail_requests.clear()
