"""The pure half of the first-token path (proxy/first_token.py): which requests it
serves, what text goes to the client for P's token, and when P's token ends the request.
The path itself, with real P, D and colocated servers: tests/e2e/test_first_token_from_prefill.py."""

from __future__ import annotations

import json

import pytest

from kvbridge.proxy.first_token import CHAT_ROUTE, eligible, plan, streamed_text
from tests.unit.proxy_cluster import STREAMED, offer_token, pd_cluster

COMPLETIONS = "/v1/completions"
PARAMS = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [1, 2],
          "remote_engine_id": "p0", "remote_request_id": "r1", "remote_host": "127.0.0.1", "remote_port": 5601,
          "tp_size": 1, "lease_generation": 3, "generated_token_ids": [17]}


def p_answer(text: str, reason: str, chat: bool = False) -> bytes:
    choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason} if chat
              else {"index": 0, "text": text, "finish_reason": reason})
    return json.dumps({"id": "cmpl-r1", "object": "x", "created": 5, "model": "m", "choices": [choice],
                       "usage": {"prompt_tokens": 9, "completion_tokens": 1, "total_tokens": 10},
                       "kv_transfer_params": PARAMS}).encode()


def events(raw: bytes) -> list[dict | str]:
    out = []
    for block in raw.decode().split("\n\n"):
        if block:
            data = block.removeprefix("data: ")
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


@pytest.mark.parametrize("body,route,want", [
    ({"prompt": "hi", "stream": True}, COMPLETIONS, True),
    ({"prompt": [1, 2, 3], "stream": True, "max_tokens": 4}, COMPLETIONS, True),
    ({"messages": [], "stream": True}, CHAT_ROUTE, True),  # no max_tokens: the context limits it
    ({"prompt": "hi"}, COMPLETIONS, False),  # not streamed: nothing to send early
    ({"prompt": "hi", "stream": True, "n": 2}, COMPLETIONS, False),
    ({"prompt": "hi", "stream": True, "logprobs": 0}, COMPLETIONS, False),
    ({"messages": [], "stream": True, "logprobs": True}, CHAT_ROUTE, False),
    ({"prompt": ["a", "b"], "stream": True}, COMPLETIONS, False),  # a batch
    ({"prompt": [[1], [2]], "stream": True}, COMPLETIONS, False),
    ({"prompt": "hi", "stream": True, "max_tokens": 0}, COMPLETIONS, False),  # D answers the 400
    ({"prompt": "hi", "stream": True, "max_tokens": "8"}, COMPLETIONS, False),
    ({"prompt": "hi", "stream": True, "max_tokens": True}, COMPLETIONS, False),
])
def test_only_streamed_single_choice_requests_without_logprobs_take_the_path(body, route, want):
    assert eligible(body, route) is want


@pytest.mark.parametrize("text,stops,want", [
    (" Paris", (), " Paris"),
    (" Pa\ufffd", (), ""),  # a partial UTF-8 character: D emits it once complete
    (" Paris", ("is the",), " Par"),  # "is" may start the stop string: held back for D to decide
    (" Paris", ("xyz",), " Paris"),
])
def test_the_text_sent_for_p_s_token_is_what_a_stream_emits_after_it(text, stops, want):
    assert streamed_text(text, stops) == want


def test_an_answer_without_p_s_token_takes_the_ordinary_path():
    answer = json.loads(p_answer(" Paris", "length"))
    answer["kv_transfer_params"] = {k: v for k, v in PARAMS.items() if k != "generated_token_ids"}
    assert plan({"stream": True}, COMPLETIONS, json.dumps(answer).encode(), answer["kv_transfer_params"]) is None
    assert plan({"stream": True}, COMPLETIONS, b"not json", PARAMS) is None


def test_decode_continues_with_the_token_sent_first():
    got = plan({"stream": True, "max_tokens": 8, "stop": "is the"}, COMPLETIONS, p_answer(" Paris", "length"), PARAMS)
    assert got is not None and not got.finished
    assert got.continued == [17] and got.decode_body({"prompt": "x"}) == {"prompt": "x", "continue_from_token_ids": [17]}
    assert events(got.events) == [{"id": "cmpl-r1", "object": "text_completion", "created": 5, "model": "m",
                                   "choices": [{"index": 0, "text": " Par", "logprobs": None,
                                                "finish_reason": None}]}]


def test_chat_sends_the_role_chunk_then_p_s_text():
    got = plan({"stream": True}, CHAT_ROUTE, p_answer("Hi", "length", chat=True), PARAMS, context_len=2048)
    assert got is not None and not got.finished
    deltas = [e["choices"][0]["delta"] for e in events(got.events)]
    assert deltas == [{"role": "assistant", "content": ""}, {"role": None, "content": "Hi"}]


@pytest.mark.parametrize("body,reason", [
    ({"stream": True, "max_tokens": 1}, "length"),  # the client asked for one token
    ({"stream": True, "max_tokens": 8}, "stop"),  # EOS, a stop id or a stop string ended it at P
])
def test_a_request_p_s_token_ends_is_the_whole_stream(body, reason):
    body = {**body, "stream_options": {"include_usage": True}}
    got = plan(body, COMPLETIONS, p_answer(" Paris", reason), PARAMS)
    assert got is not None and got.finished
    *chunks, done = events(got.events)
    assert done == "[DONE]"
    assert [c["choices"][0]["text"] for c in chunks[:2]] == [" Paris", ""]
    assert chunks[1]["choices"][0]["finish_reason"] == reason and chunks[0]["usage"] is None
    assert chunks[2]["choices"] == [] and chunks[2]["usage"]["completion_tokens"] == 1


@pytest.mark.parametrize("body,context_len,want", [
    ({"stream": True}, 10, True),  # P's 9-token prompt and its token fill the context: nothing left
    ({"stream": True}, 11, False),  # one token left: D continues
    ({"stream": True}, None, None),  # unknown: the ordinary path (D alone knows)
    ({"stream": True}, 0, None),
    ({"stream": True, "max_tokens": 4}, 10, False),  # the client's limit, not the context (D answers a 400)
    ({"stream": True, "max_completion_tokens": 1}, None, True),
])
def test_a_chat_the_context_limits_ends_at_p_when_p_s_token_fills_it(body, context_len, want):
    got = plan(body, CHAT_ROUTE, p_answer("Hi", "length", chat=True), PARAMS, context_len)
    assert (got.finished if got is not None else None) is want
    if want:
        assert events(got.events)[-2]["choices"][0]["finish_reason"] == "length"


def test_usage_is_left_out_unless_the_client_asked_for_it():
    got = plan({"stream": True, "max_tokens": 1}, COMPLETIONS, p_answer(" Paris", "length"), PARAMS)
    assert got is not None and all("usage" not in e for e in events(got.events) if isinstance(e, dict))


# ---- the path through the proxy, with stand-in P and D servers (tests/unit/proxy_upstreams.py) ----



async def streamed(pd, body: dict) -> tuple[int, bytes]:
    async with pd.http.stream("POST", "/v1/completions", json=body) as r:
        return r.status_code, await r.aread()




async def test_d_continues_from_p_s_token_which_the_client_gets_first():
    async with pd_cluster() as pd:
        offer_token(pd.prefill[0])
        status, raw = await streamed(pd, STREAMED)
        sent = pd.decode[0].received[0].body
        assert sent["continue_from_token_ids"] == [17] and sent["kv_transfer_params"]["generated_token_ids"] == [17]
        first = events(raw)[0]
        assert status == 200 and first["choices"][0]["text"] == "answer from prefill-0"
        assert raw.endswith(b"".join(pd.decode[0].stream_chunks("/v1/completions", first["id"][len("cmpl-"):])))
        await pd.metrics_show('kvbridge_proxy_first_token_from_prefill_total{outcome="continued"} 1.0')


async def test_with_the_path_off_d_gets_p_s_params_unchanged_and_the_stream_is_d_s():
    async with pd_cluster(first_token_from_prefill=False) as pd:
        offer_token(pd.prefill[0])
        status, raw = await streamed(pd, {**STREAMED, "continue_from_token_ids": [99]})  # a client's is dropped
        assert "continue_from_token_ids" not in pd.decode[0].received[0].body
        assert status == 200 and b"prefill-0" not in raw


async def test_a_request_p_s_token_ends_never_reaches_d_and_p_releases_its_kv():
    async with pd_cluster() as pd:
        offer_token(pd.prefill[0])
        status, raw = await streamed(pd, {**STREAMED, "max_tokens": 1})
        assert status == 200 and events(raw)[-1] == "[DONE]" and pd.decode[0].received == []
        assert len(pd.prefill[0].releases) == 1


CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "stream": True}


@pytest.mark.parametrize("context_len", [8, None])
async def test_a_chat_whose_prompt_p_s_token_fills_the_context_never_reaches_d(context_len):
    """The stand-in P's prompt and token are 8 tokens (its usage): with a context of 8 its token is
    the answer (P releases its KV); a P whose /v1/models names no context gets the ordinary path."""
    async with pd_cluster() as pd:
        offer_token(pd.prefill[0])
        pd.prefill[0].max_model_len = context_len
        for _ in range(2):
            async with pd.http.stream("POST", "/v1/chat/completions", json=CHAT) as r:
                raw = await r.aread()
            assert r.status_code == 200 and events(raw)[-1] == "[DONE]"
        if context_len is not None:
            assert events(raw)[-2]["choices"][0]["finish_reason"] == "length"
            assert pd.decode[0].received == [] and len(pd.prefill[0].releases) == 2
        else:
            assert [r.body.get("continue_from_token_ids") for r in pd.decode[0].received] == [None, None]
        assert pd.prefill[0].models_asked == 1  # once per P while it stays healthy


async def test_a_request_d_refuses_gets_d_s_status_and_body_and_nothing_from_p():
    async with pd_cluster() as pd:
        offer_token(pd.prefill[0])
        error = b'{"error": {"message": "too long", "type": "invalid_request_error", "code": "context_length_exceeded"}}'
        pd.decode[0].error = (400, error)
        status, raw = await streamed(pd, STREAMED)
        assert (status, raw) == (400, error)
