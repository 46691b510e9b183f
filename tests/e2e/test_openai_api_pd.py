"""Issue 48 against `kvbridge up`'s cluster (real proxy, P and D processes, NIXL, the default model)
with the official openai client, each feature through P/D against one instance serving alone (the
cluster's D asked directly: colocated): a completion's list of prompts (as lm-eval batches) answers
each prompt as that prompt alone does (streamed and not, texts and token ids), usage summed;
logit_bias and min_tokens hold; /tokenize and /detokenize through the proxy; echo and prompt
logprobs (served by P alone); n and best_of (P prefills once, D samples the n); a JSON schema (P's
first token under the grammar, D continuing it). The shared cluster's fixture checks every block
back on P and D and no lease expired."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from openai import OpenAI

from kvbridge.launcher.cluster import LocalCluster

MODEL = "SmolLM2-135M-Instruct"
PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3, 4,", "The best way to learn is"]
GREEDY: dict[str, Any] = {"model": MODEL, "max_tokens": 8, "temperature": 0}

pytestmark = pytest.mark.timeout(480)


def client(c: LocalCluster) -> OpenAI:
    return OpenAI(base_url=c.urls.proxy + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.mark.parametrize("stream", [False, True])
def test_a_batch_of_four_answers_each_prompt_as_alone(smollm2_pd_cluster: LocalCluster, stream: bool) -> None:
    c = smollm2_pd_cluster
    alone = [client(c).completions.create(prompt=p, **GREEDY) for p in PROMPTS]
    if stream:
        texts: dict[int, str] = {}
        for chunk in client(c).completions.create(prompt=PROMPTS, stream=True, **GREEDY):
            for choice in chunk.choices:
                texts[choice.index] = texts.get(choice.index, "") + choice.text
        assert [texts[i] for i in range(4)] == [a.choices[0].text for a in alone]
        return
    batch = client(c).completions.create(prompt=PROMPTS, **GREEDY)
    assert [ch.index for ch in batch.choices] == [0, 1, 2, 3]
    assert [ch.text for ch in batch.choices] == [a.choices[0].text for a in alone]
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batch.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)


def test_token_id_lists_via_tokenize_equal_the_texts(smollm2_pd_cluster: LocalCluster) -> None:
    c = smollm2_pd_cluster
    ids = [httpx.post(c.urls.proxy + "/tokenize", json={"model": MODEL, "prompt": p}, timeout=60).json()["tokens"]
           for p in PROMPTS]
    by_ids = client(c).completions.create(prompt=ids, **GREEDY)
    by_text = client(c).completions.create(prompt=PROMPTS, **GREEDY)
    assert [ch.text for ch in by_ids.choices] == [ch.text for ch in by_text.choices]
    back = httpx.post(c.urls.proxy + "/detokenize", json={"model": MODEL, "tokens": ids[0]}, timeout=60)
    assert back.json() == {"prompt": PROMPTS[0]}


def test_logit_bias_and_min_tokens_hold_through_pd(smollm2_pd_cluster: LocalCluster) -> None:
    c = smollm2_pd_cluster
    token = httpx.post(c.urls.proxy + "/tokenize", json={"prompt": " banana", "add_special_tokens": False},
                       timeout=60).json()["tokens"][0]
    forced = httpx.post(c.urls.proxy + "/detokenize", json={"tokens": [token] * 3}, timeout=60).json()["prompt"]
    body = {**GREEDY, "prompt": PROMPTS[0], "max_tokens": 3, "logit_bias": {str(token): 100}, "stream": True}
    text = ""
    with httpx.stream("POST", c.urls.proxy + "/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                text += "".join(ch["text"] for ch in json.loads(line[6:])["choices"])
    assert text == forced
    messages = [{"role": "user", "content": "Name the capital of France."}]
    short = client(c).chat.completions.create(model=MODEL, messages=messages, max_tokens=60, temperature=0)
    n = short.usage.completion_tokens + 3
    held = client(c).chat.completions.create(model=MODEL, messages=messages, max_tokens=n, temperature=0,
                                             extra_body={"min_tokens": n})
    assert held.usage.completion_tokens == n


# ---- echo and prompt logprobs (lm-eval's loglikelihood requests) ------------------------------------------------
def test_echo_logprobs_through_pd_equal_a_colocated_instances(smollm2_pd_cluster: LocalCluster) -> None:
    """P serves them alone (it computes the prompt); the answer equals what an instance that serves the
    request by itself (the D, asked directly) answers."""
    c = smollm2_pd_cluster
    ids = httpx.post(c.urls.proxy + "/tokenize", json={"model": MODEL, "prompt": PROMPTS[3] + " by doing"},
                     timeout=60).json()["tokens"]
    body = {"model": MODEL, "prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0}
    through = httpx.post(c.urls.proxy + "/v1/completions", json=body, timeout=120)
    alone = httpx.post(c.urls.decode[0] + "/v1/completions", json=body, timeout=120)
    assert through.status_code == alone.status_code == 200, (through.text, alone.text)
    assert through.headers["x-kvbridge-pd-path"] == "prefill_only"
    got, want = through.json()["choices"][0], alone.json()["choices"][0]
    assert got["text"] == want["text"] and got["logprobs"]["tokens"] == want["logprobs"]["tokens"]
    assert got["logprobs"]["token_logprobs"][0] is None and len(got["logprobs"]["tokens"]) == len(ids) + 1
    assert got["logprobs"]["token_logprobs"][1:] == pytest.approx(want["logprobs"]["token_logprobs"][1:], abs=1e-4)
    streamed = ""
    for chunk in client(c).completions.create(stream=True, **body):
        streamed += "".join(ch.text for ch in chunk.choices)
    assert streamed == got["text"]


def test_a_batch_of_echo_prompts_without_generation_through_pd(smollm2_pd_cluster: LocalCluster) -> None:
    c = smollm2_pd_cluster
    batch = client(c).completions.create(model=MODEL, prompt=PROMPTS, echo=True, logprobs=0, max_tokens=0)
    assert [ch.text for ch in sorted(batch.choices, key=lambda ch: ch.index)] == PROMPTS
    assert all(ch.logprobs.token_logprobs[0] is None for ch in batch.choices) and batch.usage.completion_tokens == 0
    refused = httpx.post(c.urls.proxy + "/v1/completions", json={**GREEDY, "prompt": PROMPTS[0], "max_tokens": 0},
                         timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"


# ---- n > 1 and best_of: P prefills once, D samples the n sequences sharing the prompt's blocks ---------------------
@pytest.mark.parametrize("extra", [{"n": 3}, {"n": 2, "best_of": 3}, {"n": 2, "prompt": PROMPTS[:2]}])
def test_n_and_best_of_through_pd_equal_a_colocated_instances(smollm2_pd_cluster: LocalCluster,
                                                              extra: dict[str, Any]) -> None:
    c = smollm2_pd_cluster
    body = {"model": MODEL, "prompt": PROMPTS[0] * 3, "max_tokens": 6, "temperature": 1.0, "seed": 5, **extra}
    through = httpx.post(c.urls.proxy + "/v1/completions", json=body, timeout=120)
    alone = httpx.post(c.urls.decode[0] + "/v1/completions", json=body, timeout=120)
    assert through.status_code == alone.status_code == 200, (through.text, alone.text)
    if "prompt" not in extra:  # a list's answer is merged from its prompts' paths
        assert through.headers["x-kvbridge-pd-path"] == "prefill_decode"
    got, want = through.json(), alone.json()
    assert [(ch["index"], ch["text"]) for ch in got["choices"]] == [(ch["index"], ch["text"]) for ch in want["choices"]]
    assert got["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"]
    assert got["usage"]["completion_tokens"] == want["usage"]["completion_tokens"]
    if "best_of" not in extra:
        texts: dict[int, str] = {}
        for chunk in client(c).completions.create(stream=True, **body):
            for ch in chunk.choices:
                texts[ch.index] = texts.get(ch.index, "") + ch.text
        assert [texts[i] for i in sorted(texts)] == [ch["text"] for ch in want["choices"]]


# ---- structured output: P's first token obeys the grammar, D continues under it ------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_a_json_schema_through_pd_equals_a_colocated_instances(smollm2_pd_cluster: LocalCluster, stream: bool) -> None:
    c = smollm2_pd_cluster
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "country": {"type": "string", "maxLength": 20}},
              "required": ["city", "country"], "additionalProperties": False}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Name a big city and its country as JSON."}],
            "max_tokens": 50, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "place", "schema": schema}}}
    alone = httpx.post(c.urls.decode[0] + "/v1/chat/completions", json=body, timeout=120)
    assert alone.status_code == 200, alone.text
    want = alone.json()["choices"][0]["message"]["content"]
    assert set(json.loads(want)) == {"city", "country"}
    if not stream:
        through = httpx.post(c.urls.proxy + "/v1/chat/completions", json=body, timeout=120)
        assert through.status_code == 200 and through.headers["x-kvbridge-pd-path"] == "prefill_decode"
        assert through.json()["choices"][0]["message"]["content"] == want
        return
    text = ""  # streamed: the first token is P's (first-token path), the rest D's, continuing P's grammar state
    for chunk in client(c).chat.completions.create(stream=True, **body):
        text += "".join(ch.delta.content or "" for ch in chunk.choices)
    assert text == want
