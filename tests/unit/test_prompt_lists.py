"""Issue 48, part 1, without a model: the prompt forms and the fields that name token ids as the
request models parse them, logit_bias and min_tokens in the sampler, what P is sent, and the
proxy's list path against stand-in P and D servers (split, merge, one prompt failing)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from kvbridge.engine.setup.generation_config import NO_DEFAULTS
from kvbridge.engine.sampling import Sampler, shape_logits
from kvbridge.engine.sampling_params import SamplingParams
from kvbridge.proxy import prompt_lists
from kvbridge.proxy.bodies import prefill_body
from kvbridge.server.protocol import MAX_PROMPTS, CompletionRequest
from tests.unit.proxy_cluster import COMPLETION, pd_cluster

pytestmark = pytest.mark.timeout(60)


# ---- the request models ------------------------------------------------------------------------------
@pytest.mark.parametrize("prompt, prompts", [
    ("hi", ["hi"]), ([1, 2], [[1, 2]]), (["a", "b"], ["a", "b"]), ([[1], [2, 3]], [[1], [2, 3]]),
])
def test_the_four_prompt_forms_list_their_prompts(prompt: Any, prompts: list[Any]) -> None:
    assert CompletionRequest.model_validate({"prompt": prompt}).prompts == prompts


@pytest.mark.parametrize("prompt", [[], "", ["a", ""], [[]], ["a", [1]], [1, "a"], [True], [[1.0]],
                                    [[1]] * (MAX_PROMPTS + 1), {"a": 1}])
def test_malformed_prompts_are_refused(prompt: Any) -> None:
    with pytest.raises(ValidationError, match="prompt"):
        CompletionRequest.model_validate({"prompt": prompt})


def test_logit_bias_keys_are_token_ids_and_values_are_clamped_like_vllm() -> None:
    request = CompletionRequest.model_validate({"prompt": "x", "logit_bias": {"7": 250.0, "3": -1e9, "5": 1}})
    assert request.logit_bias_pairs == ((3, -100.0), (5, 1.0), (7, 100.0))
    params = request.to_sampling_params(4, NO_DEFAULTS)
    assert params.logit_bias == ((3, -100.0), (5, 1.0), (7, 100.0))
    assert request.token_id_fields()["logit_bias"] == [3, 5, 7]


@pytest.mark.parametrize("bias", [{"x": 1}, {"1.0": 1}, {" 1": 1}, {"": 1}, {"1" * 11: 1}, {"1": "2"},
                                  {"1": True}, [[1, 1]]])
def test_bad_logit_bias_is_refused(bias: Any) -> None:
    with pytest.raises(ValidationError, match="logit_bias"):
        CompletionRequest.model_validate({"prompt": "x", "logit_bias": bias})


def test_min_tokens_reaches_the_sampling_params_and_is_checked_there() -> None:
    assert CompletionRequest.model_validate({"prompt": "x", "min_tokens": 3}).to_sampling_params(
        4, NO_DEFAULTS).min_tokens == 3
    with pytest.raises(ValidationError, match="min_tokens"):
        CompletionRequest.model_validate({"prompt": "x", "min_tokens": -1})
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=2, min_tokens=3)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=((1, 101.0),))


# ---- the sampler -------------------------------------------------------------------------------------------
def test_logit_bias_and_min_tokens_shape_one_row_in_place() -> None:
    row = torch.zeros(8)
    shape_logits(row, SamplingParams(logit_bias=((2, 5.0), (3, -1.0)), stop_token_ids=(6,), min_tokens=2), 1)
    assert row.tolist() == [0, 0, 5, -1, 0, 0, float("-inf"), 0]
    row = torch.zeros(8)
    shape_logits(row, SamplingParams(stop_token_ids=(6,), min_tokens=2), 2)  # min_tokens reached
    assert row.tolist() == [0.0] * 8


def test_the_sampler_obeys_logit_bias_and_min_tokens_and_reports_the_models_logprobs() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [0.0, 3.0, 1.0, 2.0]])
    params = [SamplingParams(temperature=0, logit_bias=((2, 10.0),), logprobs=0),
              SamplingParams(temperature=0, stop_token_ids=(1,), min_tokens=1)]
    out = Sampler().sample(logits, ["a", "b"], params, [0, 0])
    assert out.tokens == {"a": 2, "b": 3}
    assert out.logprobs["a"].logprob == pytest.approx(float(torch.log_softmax(logits[0], -1)[2]))
    assert logits[0, 2] == 1.0  # the caller's logits are never changed
    after = Sampler().sample(logits, ["b"], params[1:], [1])  # min_tokens reached: the stop token may come
    assert after.tokens == {"b": 1}


def test_a_sampled_row_with_a_bias_draws_the_biased_token() -> None:
    logits = torch.zeros(3, 64)
    params = [SamplingParams(temperature=1.0, logit_bias=((5, 100.0),)),
              SamplingParams(temperature=0.7, top_k=4, seed=3, logit_bias=((9, 100.0),)),
              SamplingParams(temperature=1.0, min_tokens=4, stop_token_ids=tuple(range(1, 64)))]
    out = Sampler().sample(logits, ["a", "b", "c"], params, [0, 0, 0])
    assert out.tokens == {"a": 5, "b": 9, "c": 0}


# ---- what P gets --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("min_tokens, sent", [(None, None), (0, None), (5, 1), (1, 1), (-2, -2), ("3", "3")])
def test_p_applies_min_tokens_to_its_one_token(min_tokens: Any, sent: Any) -> None:
    body = {**COMPLETION, "logit_bias": {"5": 3}}
    if min_tokens is not None:
        body["min_tokens"] = min_tokens
    out = prefill_body(body)
    assert out.get("min_tokens") == sent and out["logit_bias"] == {"5": 3} and out["max_tokens"] == 1


# ---- the proxy's list path -------------------------------------------------------------------------------------
@pytest.mark.parametrize("prompt, n", [(["a", "b"], 2), ([[1], [2], [3]], 3), (["a"], 1)])
def test_split_gives_one_body_per_prompt(prompt: Any, n: int) -> None:
    bodies = prompt_lists.split({**COMPLETION, "prompt": prompt})
    assert bodies is not None and [b["prompt"] for b in bodies] == prompt
    assert all(b["max_tokens"] == COMPLETION["max_tokens"] for b in bodies) and len(bodies) == n


@pytest.mark.parametrize("prompt", ["a", [1, 2], [], ["a", ""], ["a", [1]], [[1, "x"]], [[]], [[True]],
                                    [[1]] * (MAX_PROMPTS + 1)])
def test_split_leaves_one_prompt_and_malformed_lists_to_the_instance(prompt: Any) -> None:
    assert prompt_lists.split({**COMPLETION, "prompt": prompt}) is None


async def test_each_prompt_takes_its_own_pd_path_and_the_answers_merge_in_index_order() -> None:
    async with pd_cluster() as pd:
        r = await pd.http.post("/v1/completions", json={**COMPLETION, "prompt": ["a", "b", "c"]},
                               headers={"X-Request-Id": "rid-l"})
        assert r.status_code == 200, r.text
        body = r.json()
        assert [c["index"] for c in body["choices"]] == [0, 1, 2] and body["id"] == "cmpl-rid-l"
        assert body["usage"]["prompt_tokens"] == 15 and body["usage"]["completion_tokens"] == 9
        assert "kv_transfer_params" not in body
        got = sorted((x.body["prompt"], x.headers["x-request-id"]) for x in pd.prefill[0].received)
        assert got == [("a", "rid-l-0"), ("b", "rid-l-1"), ("c", "rid-l-2")]
        for received in pd.decode[0].received:  # each D request carries its own prompt's P params
            rid = received.headers["x-request-id"]
            assert received.body["kv_transfer_params"] == pd.prefill[0].kv_transfer_params(rid)
            assert received.body["prompt"] == {"rid-l-0": "a", "rid-l-1": "b", "rid-l-2": "c"}[rid]


async def test_a_streamed_list_merges_every_prompts_events_under_its_index() -> None:
    async with pd_cluster() as pd:
        body = {**COMPLETION, "prompt": ["a", "b"], "stream": True}
        async with pd.http.stream("POST", "/v1/completions", json=body, headers={"X-Request-Id": "rid-s"}) as r:
            raw = (await r.aread()).decode()
        events = [e.removeprefix("data: ") for e in raw.split("\n\n") if e]
        assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
        chunks = [json.loads(e) for e in events[:-1]]
        for index in (0, 1):
            text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"][0]["index"] == index)
            assert text == "answer from decode-0"
        assert {c["id"] for c in chunks} == {"cmpl-rid-s"}


async def test_one_prompt_failing_fails_the_list_and_stops_the_others() -> None:
    async with pd_cluster(num_prefill=2) as pd:
        error = json.dumps({"error": {"message": "too long", "type": "invalid_request_error", "param": "prompt",
                                      "code": "context_length_exceeded"}}).encode()
        pd.prefill[0].error = (400, error)
        pd.prefill[1].hold.clear()  # the other prompt's P leg is still running when the first fails
        r = await pd.http.post("/v1/completions", json={**COMPLETION, "prompt": ["a", "b"]})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        await asyncio.wait_for(pd.prefill[1].disconnected_while_held.wait(), 10)  # its P leg was stopped
        assert not pd.decode[0].received


# ---- what is not served is refused, never ignored (structured output's fields: test_structured_output.py) ----
@pytest.mark.parametrize("field, value", [("suffix", "!"), ("presence_penalty", 0.5), ("frequency_penalty", -1.0)])
def test_what_is_not_served_is_refused_naming_the_field(field: str, value: Any) -> None:
    with pytest.raises(ValidationError, match=field):
        CompletionRequest.model_validate({"prompt": "x", field: value})


def test_a_text_response_format_is_the_default_and_accepted() -> None:
    CompletionRequest.model_validate({"prompt": "x", "response_format": {"type": "text"}})


def test_merged_lists_number_each_prompts_n_choices_prompt_by_prompt() -> None:
    from fastapi.responses import Response

    def answer(texts: list[str]) -> Response:
        body = {"id": "x", "object": "text_completion", "created": 0, "model": "m",
                "choices": [{"index": j, "text": t, "finish_reason": "length"} for j, t in enumerate(texts)],
                "usage": {"prompt_tokens": 4, "completion_tokens": 2 * len(texts), "total_tokens": 4 + 2 * len(texts)}}
        return Response(json.dumps(body), media_type="application/json")

    merged = json.loads(bytes(prompt_lists.merge_whole([answer(["a0", "a1"]), answer(["b0", "b1"])], "rid", 2).body))
    assert [(c["index"], c["text"]) for c in merged["choices"]] == [(0, "a0"), (1, "a1"), (2, "b0"), (3, "b1")]
    assert merged["usage"]["prompt_tokens"] == 8 and merged["usage"]["completion_tokens"] == 8
    assert prompt_lists.choices_per_prompt({"n": 3}) == 3
    assert [prompt_lists.choices_per_prompt({"n": v}) for v in (None, 0, "2", 2.0, True)] == [1] * 5
