"""First token straight from prefill, end to end: a real `kvbridge proxy` in front of one
prefill and one decode `kvbridge serve` (SmolLM2, NIXL), beside a colocated `kvbridge serve`
behind a colocated-mode proxy: the same requests, streamed through the official openai
client, must give the same answers both ways.

- greedy and seeded streams (completions and chat): same text, finish reason and usage,
  and each was continued by D from P's token (counted by the proxy);
- P's token ends the request (max_tokens 1, a stop string in it, its id as a stop id, a chat
  without max_tokens whose prompt is one token short of the context): the same answers, served
  without a D leg (D sees no request);
- a request D refuses (too long for D's context) gets D's 400 before any byte, like colocated;
- a D killed mid-stream (after P's token went out): the stream ends with an error event.
Afterwards every block is free on every instance still alive.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

import httpx
import pytest
from openai import APIError, BadRequestError, OpenAI

from kvbridge.config import KVRole
from kvbridge.launcher.cluster import DEFAULT_CLI, free_ports, http_url
from tests.e2e.processes import metric
from tests.fleet import PROMPTS as PD_PROMPTS
from tests.fleet import SMOLLM2, Fleet, FleetSpec, Member, assert_settled

pytestmark = pytest.mark.timeout(600)
PROMPTS = [*PD_PROMPTS, "The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
CONTINUED = {"outcome": "continued"}
FINISHED = {"outcome": "finished_at_prefill"}


@dataclass(frozen=True)
class Answer:
    text: str
    finish_reason: str | None
    usage: tuple[int, int] | None  # prompt, completion tokens


@pytest.fixture(scope="module")
def fleet(fleets, smollm2_pd):
    """P and D: the session's shared cluster's (tests/e2e/conftest.py: NIXL, one thread each, a
    512-token context); the colocated instance, its proxy and the P/D proxy: the module's own."""
    shared = smollm2_pd.get()
    fleet = fleets.own(FleetSpec.of(SMOLLM2, "nixl", {"c": Member(None)}))
    fleet.adopt("p", shared.urls.prefill[0])
    fleet.adopt("d", shared.urls.decode[0])
    try:
        proxy_port = free_ports(1)[0]
        fleet.spawn("proxy-c", [*DEFAULT_CLI, "proxy", "--decode", fleet.urls["c"], "--host", "127.0.0.1",
                                "--port", str(proxy_port)], http_url("127.0.0.1", proxy_port))
        fleet.proxy("p", "d")
        yield fleet
    finally:
        fleet.stop()


@pytest.fixture(autouse=True)
def leases_expired_before(fleet):
    """`settled` counts only this test's expired leases on the shared P and D."""
    fleet.note_expired_leases()


def settled(fleet: Fleet, timeout_s: float = 15.0) -> None:
    """Every block free on P, D (no lease expired) and the colocated instance."""
    assert_settled(fleet, ["p", "d"], timeout_s)
    deadline = time.monotonic() + timeout_s
    c = fleet.urls["c"]
    while metric(c, "kvbridge_kv_cache_free_blocks") != metric(c, "kvbridge_kv_cache_total_blocks"):
        assert time.monotonic() < deadline, "blocks still held on the colocated instance"
        time.sleep(0.05)


def stream(url: str, chat: bool, prompt: str, **options) -> Answer:
    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    kwargs = dict(model=SMOLLM2, stream=True, stream_options={"include_usage": True}, **options)
    if chat:
        chunks = list(client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **kwargs))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        chunks = list(client.completions.create(prompt=prompt, **kwargs))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    usage = chunks[-1].usage
    return Answer(text, reasons[-1] if reasons else None,
                  (usage.prompt_tokens, usage.completion_tokens) if usage else None)


def both(fleet: Fleet, chat: bool, prompt: str, **options) -> tuple[Answer, Answer]:
    """(P/D through the first-token path, colocated) answers to one request."""
    return (stream(fleet.urls["proxy-p-d"], chat, prompt, **options),
            stream(fleet.urls["proxy-c"], chat, prompt, **options))


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_greedy_and_seeded_streams_equal_colocated_and_d_continues_p_s_token(fleet, chat):
    proxy = fleet.urls["proxy-p-d"]
    before = metric(proxy, "kvbridge_proxy_first_token_from_prefill_total", **CONTINUED)
    for prompt in PROMPTS:
        pd, colocated = both(fleet, chat, prompt, max_tokens=12, temperature=0)
        assert pd == colocated and pd.usage is not None and pd.usage[1] >= 2
    pd, colocated = both(fleet, chat, PROMPTS[1], max_tokens=12, temperature=0.9, top_p=0.95, seed=4321)
    assert pd == colocated
    requests = len(PROMPTS) + 1
    assert metric(proxy, "kvbridge_proxy_first_token_from_prefill_total", **CONTINUED) == before + requests
    settled(fleet)


def test_a_request_that_p_s_token_ends_is_answered_without_decode(fleet):
    prompt = PROMPTS[2]
    # P's own answer names its token (generated_token_ids); released at once, as the proxy would.
    with httpx.Client(base_url=fleet.urls["p"], timeout=60, trust_env=False) as http:
        answer = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, "temperature": 0,
                                                     "kv_transfer_params": {"do_remote_decode": True}}).json()
        assert http.post("/kvbridge/release_kv", json={"kv_transfer_params": answer["kv_transfer_params"]},
                         headers={"X-Request-Id": "first-token-probe"}).status_code == 200
    first_id, first_text = answer["kv_transfer_params"]["generated_token_ids"][0], answer["choices"][0]["text"]
    proxy, d = fleet.urls["proxy-p-d"], fleet.urls["d"]
    finished_before = metric(proxy, "kvbridge_proxy_first_token_from_prefill_total", **FINISHED)
    d_before = metric(d, "kvbridge_prompt_tokens_total")
    cases = [dict(max_tokens=1), dict(max_tokens=8, stop=[first_text.strip() or first_text]),
             dict(max_tokens=8, extra_body={"stop_token_ids": [first_id]})]
    for chat in (False, True):
        for options in cases if not chat else cases[:1]:
            pd, colocated = both(fleet, chat, prompt, temperature=0, **options)
            assert pd == colocated
            assert pd.usage is not None and pd.usage[1] == 1 and pd.finish_reason is not None
    assert metric(proxy, "kvbridge_proxy_first_token_from_prefill_total", **FINISHED) == finished_before + 4
    assert metric(d, "kvbridge_prompt_tokens_total") == d_before  # no D leg
    settled(fleet)


def chat_prompt_of(fleet: Fleet, tokens: int) -> str:
    """A user message whose chat prompt is exactly `tokens` tokens long (counted by the colocated
    instance: " hello" is one token, whatever precedes it)."""
    def count(message: str) -> int:
        r = httpx.post(fleet.urls["c"] + "/v1/chat/completions", timeout=60, trust_env=False,
                       json={"messages": [{"role": "user", "content": message}], "max_tokens": 1})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"]
    message = "hello" + " hello" * (tokens - count("hello"))
    assert count(message) == tokens
    return message


def test_a_chat_whose_prompt_leaves_one_token_of_context_is_finished_by_p_s_token(fleet):
    """No max_tokens and a prompt of the context less one token: P's token is the whole answer
    (finish "length", as one engine and the unstreamed path answer); D never got a continuation
    it must refuse (its 400 was what the stream answered)."""
    prompt = chat_prompt_of(fleet, 511)  # the fleet's --max-model-len is 512
    proxy, d = fleet.urls["proxy-p-d"], fleet.urls["d"]
    client = OpenAI(base_url=proxy + "/v1", api_key="unused", max_retries=0, timeout=120)
    whole = client.chat.completions.create(model=SMOLLM2, messages=[{"role": "user", "content": prompt}],
                                           temperature=0).choices[0]
    assert whole.finish_reason == "length" and whole.message.content
    finished_before = metric(proxy, "kvbridge_proxy_first_token_from_prefill_total", **FINISHED)
    d_before = metric(d, "kvbridge_prompt_tokens_total")
    pd, colocated = both(fleet, True, prompt, temperature=0)
    assert pd == colocated == Answer(whole.message.content, "length", (511, 1))
    assert metric(proxy, "kvbridge_proxy_first_token_from_prefill_total", **FINISHED) == finished_before + 1
    assert metric(d, "kvbridge_prompt_tokens_total") == d_before  # no D leg
    settled(fleet)  # P's blocks released by the proxy, as for any request P's token ends


def test_a_request_decode_refuses_gets_its_status_before_any_byte(fleet):
    for url in (fleet.urls["proxy-p-d"], fleet.urls["proxy-c"]):
        with pytest.raises(BadRequestError) as refused:
            stream(url, False, PROMPTS[1], max_tokens=500, temperature=0)  # past the 512-token context
        assert refused.value.status_code == 400 and refused.value.code == "context_length_exceeded"
    settled(fleet)


def test_a_decode_killed_mid_stream_ends_the_stream_with_an_error_event(fleet):
    """It kills a D of its own (P is shared: it serves on). The client has P's token and D's
    stream has started when D dies; the stream must end with an error event, never a silent
    truncation."""
    killed = "d-killed"
    fleet.add(killed, Member(KVRole.CONSUMER))
    client = OpenAI(base_url=fleet.proxy("p", killed) + "/v1", api_key="unused", max_retries=0, timeout=120)
    chunks = iter(client.completions.create(model=SMOLLM2, prompt=PROMPTS[1], max_tokens=300, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True}))
    assert next(chunks).choices[0].text  # P's token, sent by the proxy before D computed anything
    deadline = time.monotonic() + 60
    while metric(fleet.urls[killed], "kvbridge_num_requests_running") == 0:  # D read P's KV and decodes
        assert time.monotonic() < deadline, "D never ran the request"
        time.sleep(0.01)
    os.kill(fleet.child(killed).pid, signal.SIGKILL)
    with pytest.raises(APIError, match="decode instance stream failed"):
        for _ in chunks:
            pass
    assert_settled(fleet, ["p"])  # P's blocks were freed by D's read-done before D died
