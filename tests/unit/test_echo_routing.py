"""Issue 48 at the proxy, against stand-in P and D servers: a request whose answer needs the prompt's
logprobs (echo, vLLM's prompt_logprobs) is served by P alone with the client's body (path
prefill_only, reason prompt_logprobs; streamed and whole; each prompt of a list; the decode-only
fallback when no P can serve); a request D would refuse for a field P never sees as sent is refused
by the proxy before any P works on it."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvbridge.proxy.bodies import refused_by_decode, wants_prompt_logprobs
from tests.openai_errors import assert_openai_error
from tests.unit.proxy_cluster import COMPLETION, pd_cluster

pytestmark = pytest.mark.timeout(60)

ECHO = {**COMPLETION, "echo": True, "logprobs": 1, "max_tokens": 1}


@pytest.mark.parametrize("body, wants", [
    ({"echo": True}, True), ({"prompt_logprobs": 0}, True), ({"prompt_logprobs": None}, False),
    ({"echo": False}, False), ({"echo": "yes"}, False), ({}, False),
])
def test_which_bodies_need_the_prompts_logprobs(body: dict[str, Any], wants: bool) -> None:
    assert wants_prompt_logprobs(body) is wants


@pytest.mark.parametrize("body, field", [
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": -2}, "max_tokens"), ({"max_tokens": "5"}, "max_tokens"),
    ({"max_tokens": 2.0}, "max_tokens"), ({"max_tokens": True}, "max_tokens"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"), ({"stream": "yes"}, "stream"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": False, "stream_options": {}}, "stream_options"),
    ({"max_tokens": 2, "min_tokens": 3}, "min_tokens"),
    ({"max_completion_tokens": 2, "max_tokens": 9, "min_tokens": 3}, "min_tokens"),
])
def test_fields_p_never_sees_as_sent_are_checked_before_p(body: dict[str, Any], field: str) -> None:
    refused = refused_by_decode({**COMPLETION, **body})
    assert refused is not None and refused[0] == field


@pytest.mark.parametrize("body", [{}, {"max_tokens": 1}, {"stream": True, "stream_options": {"include_usage": True}},
                                  {"min_tokens": 20}, {"max_tokens": None}])
def test_what_d_accepts_passes(body: dict[str, Any]) -> None:
    assert refused_by_decode({**COMPLETION, **body}) is None


async def test_an_echo_request_is_served_by_p_alone_with_the_clients_body() -> None:
    async with pd_cluster() as pd:
        r = await pd.http.post("/v1/completions", json=ECHO, headers={"X-Request-Id": "rid-e"})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == "answer from prefill-0"
        assert r.headers["x-kvbridge-pd-path"] == "prefill_only"
        assert r.headers["x-kvbridge-pd-reason"] == "prompt_logprobs"
        (got,) = pd.prefill[0].received
        assert got.body == ECHO and got.headers["x-request-id"] == "rid-e"  # unchanged: no KV kept for a D
        assert not pd.decode[0].received and not pd.prefill[0].releases


async def test_a_streamed_prompt_logprobs_request_streams_ps_answer() -> None:
    async with pd_cluster() as pd:
        body = {**COMPLETION, "prompt_logprobs": 2, "stream": True}
        async with pd.http.stream("POST", "/v1/completions", json=body) as r:
            raw = await r.aread()
        assert r.status_code == 200 and raw == b"".join(pd.prefill[0].stream_chunks("/v1/completions",
                                                                                   r.headers["x-request-id"]))
        assert not pd.decode[0].received


async def test_a_list_of_echo_prompts_goes_to_p_one_prompt_each() -> None:
    async with pd_cluster() as pd:
        r = await pd.http.post("/v1/completions", json={**ECHO, "prompt": [[1, 2], [3, 4]]},
                               headers={"X-Request-Id": "rid-l"})
        assert r.status_code == 200, r.text
        assert [c["index"] for c in r.json()["choices"]] == [0, 1]
        got = sorted((x.body["prompt"], x.headers["x-request-id"]) for x in pd.prefill[0].received)
        assert got == [([1, 2], "rid-l-0"), ([3, 4], "rid-l-1")] and not pd.decode[0].received


async def test_p_refusing_an_echo_request_is_the_answer() -> None:
    async with pd_cluster() as pd:
        error = json.dumps({"error": {"message": "bad", "type": "invalid_request_error", "param": "prompt_logprobs",
                                      "code": None}}).encode()
        pd.prefill[0].error = (400, error)
        r = await pd.http.post("/v1/completions", json=ECHO)
        assert_openai_error(r, 400, param="prompt_logprobs")
        assert len(pd.prefill[0].received) == 1 and not pd.decode[0].received  # a 4xx is never retried


async def test_no_p_able_to_serve_falls_back_to_d_alone() -> None:
    async with pd_cluster(num_prefill=2) as pd:
        for p in pd.prefill:
            p.error = (500, b'{"error": {"message": "broken", "type": "server_error", "param": null, "code": null}}')
        r = await pd.http.post("/v1/completions", json=ECHO)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == "answer from decode-0"
        assert r.headers["x-kvbridge-pd-path"] == "decode_only" and r.headers["x-kvbridge-pd-reason"] == "prefill_failed"
        (got,) = pd.decode[0].received
        assert got.body == ECHO  # D computes the prompt itself: no kv_transfer_params


async def test_a_body_d_would_refuse_never_reaches_p() -> None:
    async with pd_cluster() as pd:
        r = await pd.http.post("/v1/completions", json={**COMPLETION, "max_tokens": 0})
        assert_openai_error(r, 400, param="max_tokens")
        r = await pd.http.post("/v1/completions", json={**COMPLETION, "prompt": ["a", "b"], "min_tokens": 30})
        assert_openai_error(r, 400, param="min_tokens")
        assert not pd.prefill[0].received and not pd.decode[0].received
