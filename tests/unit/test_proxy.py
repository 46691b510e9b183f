"""The P/D proxy against stand-in P and D servers over real HTTP, and the local cluster
launcher's command lines and process handling (with stand-in children)."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from kvbridge.config import KVRole
from kvbridge.launcher import cluster
from kvbridge.proxy.app import build_proxy_app
from kvbridge.proxy.bodies import prefill_body
from kvbridge.proxy.exchange import RetryPolicy
from kvbridge.proxy.routing import LeastOutstandingPolicy, RoundRobinPolicy, Upstream, make_policy
from tests.unit.proxy_cluster import COMPLETION, openai_client, pd_cluster, received_by

pytestmark = pytest.mark.timeout(60)

STAND_IN_CLI = (sys.executable, str(Path(__file__).with_name("proxy_upstreams.py")))




# ---- step 1 and step 2 bodies ------------------------------------------------------------
async def test_prefill_gets_one_token_unstreamed_request_asking_to_keep_kv():
    async with pd_cluster() as pd:
        body = {**COMPLETION, "stream": True, "stream_options": {"include_usage": True}, "min_tokens": 4}
        async with pd.http.stream("POST", "/v1/completions", json=body) as r:
            await r.aread()
        assert pd.prefill[0].received[0].body == {
            "model": "m", "prompt": "The capital of France is", "temperature": 0.0, "max_tokens": 1,
            "stream": False, "n": 1, "kv_transfer_params": {"do_remote_decode": True},
            "min_tokens": 1}  # P samples the first token: no stop token while min_tokens > 0


async def test_decode_gets_original_body_plus_prefill_kv_transfer_params():
    async with pd_cluster() as pd:
        body = {**COMPLETION, "min_tokens": 4, "kv_transfer_params": {"forged": True}}
        r = await pd.http.post("/v1/completions", json=body)
        assert r.status_code == 200
        request_id = pd.prefill[0].received[0].headers["x-request-id"]
        assert pd.decode[0].received[0].body == {
            **body, "kv_transfer_params": pd.prefill[0].kv_transfer_params(request_id)}


async def test_one_generated_request_id_is_shared_by_prefill_decode_and_client():
    async with pd_cluster() as pd:
        r = await pd.http.post("/v1/completions", json=COMPLETION)
        request_id = pd.prefill[0].received[0].headers["x-request-id"]
        assert request_id and pd.decode[0].received[0].headers["x-request-id"] == request_id
        assert r.headers["x-request-id"] == request_id


async def test_client_request_id_is_honoured():
    async with pd_cluster() as pd:
        await pd.http.post("/v1/completions", json=COMPLETION, headers={"X-Request-Id": "client-id-7"})
        assert pd.prefill[0].received[0].headers["x-request-id"] == "client-id-7"
        assert pd.decode[0].received[0].headers["x-request-id"] == "client-id-7"


def test_chat_prefill_caps_max_completion_tokens_too():
    body = {"model": "m", "messages": [], "max_completion_tokens": 50, "n": 3, "stream": True}
    sent = prefill_body(body)
    assert (sent["max_tokens"], sent["max_completion_tokens"], sent["n"], sent["stream"]) == (1, 1, 1, False)
    assert body["max_completion_tokens"] == 50  # the client's body is untouched


# ---- the official client, happy paths ------------------------------------------------------
async def test_openai_client_completion_and_chat_without_streaming():
    async with pd_cluster() as pd, openai_client(pd) as client:
        completion = await client.completions.create(model="m", prompt="Hi", max_tokens=5)
        chat = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}])
        assert completion.choices[0].text == "answer from decode-0"
        assert chat.choices[0].message.content == "answer from decode-0"
        assert [r.path for r in pd.prefill[0].received] == ["/v1/completions", "/v1/chat/completions"]


async def test_openai_client_completion_and_chat_streaming():
    async with pd_cluster() as pd, openai_client(pd) as client:
        stream = await client.completions.create(model="m", prompt="Hi", max_tokens=5, stream=True)
        text = "".join([chunk.choices[0].text async for chunk in stream])
        chat = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}],
                                                    stream=True)
        content = "".join([c.choices[0].delta.content or "" async for c in chat])
        assert text == content == "answer from decode-0"


async def test_stream_passthrough_is_byte_exact():
    async with pd_cluster() as pd:
        headers = {"X-Request-Id": "rid-1"}
        async with pd.http.stream("POST", "/v1/chat/completions", headers=headers,
                                  json={"model": "m", "messages": [], "stream": True}) as r:
            received = b"".join([chunk async for chunk in r.aiter_raw()])
        expected = pd.decode[0].stream_chunks("/v1/chat/completions", "rid-1")
        assert r.headers["content-type"].startswith("text/event-stream")
        assert received == b"".join(expected)
        assert [e + b"\n\n" for e in received.split(b"\n\n")[:-1]] == expected


# ---- errors pass through unchanged -----------------------------------------------------------
@pytest.mark.parametrize("status", [400, 500])
async def test_decode_error_status_and_body_reach_client_unchanged(status):
    async with pd_cluster() as pd:
        error = json.dumps({"error": {"message": "bad prompt", "type": "BadRequestError", "code": status}})
        pd.decode[0].error = (status, error.encode())
        r = await pd.http.post("/v1/completions", json={**COMPLETION, "stream": True})
        assert (r.status_code, r.content) == (status, error.encode())
        assert pd.prefill[0].releases == []  # D got the request: freeing P's KV is D's job


async def test_prefill_error_reaches_client_and_decode_is_never_called():
    async with pd_cluster() as pd, openai_client(pd) as client:
        error = b'{"error": {"message": "prompt too long", "type": "BadRequestError", "code": 400}}'
        pd.prefill[0].error = (400, error)
        r = await pd.http.post("/v1/completions", json=COMPLETION)
        assert (r.status_code, r.content) == (400, error)
        with pytest.raises(openai.BadRequestError, match="prompt too long"):
            await client.completions.create(model="m", prompt="Hi")
        assert pd.decode[0].received == []


async def test_prefill_without_kv_transfer_params_is_a_bad_gateway():
    async with pd_cluster(prefill_role="decode", retry=RetryPolicy(decode_only_fallback=False)) as pd:  # a "P"
        # that is not a producer; without the decode-only fallback its error reaches the client
        r = await pd.http.post("/v1/completions", json=COMPLETION)
        assert r.status_code == 502
        assert "kv_transfer_params" in r.json()["error"]["message"]
        assert pd.decode[0].received == []


async def test_invalid_json_is_a_bad_request():
    async with pd_cluster() as pd:
        r = await pd.http.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def body_of_size(size: int) -> bytes:
    """COMPLETION as JSON, its prompt padded to make the body exactly `size` bytes."""
    base = json.dumps({**COMPLETION, "prompt": ""}).encode()
    return json.dumps({**COMPLETION, "prompt": "x" * (size - len(base))}).encode()


async def status_of_unfinished_post(url: str, head: str, body: bytes) -> int:
    """POST over a raw connection that sends `head`'s headers and `body` and then nothing more
    (the request never ends): the status of the answer the proxy gives before the end."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                     f"{head}\r\n\r\n".encode() + body)
        await writer.drain()
        status_line = await reader.readline()  # the test's timeout bounds it
        return int(status_line.split()[1])
    finally:
        writer.close()


async def test_a_body_over_the_cap_gets_413_without_being_read_and_the_proxy_serves_on():
    cap = 4096
    async with pd_cluster(max_body_bytes=cap) as pd:
        headers = {"content-type": "application/json"}
        r = await pd.http.post("/v1/completions", content=body_of_size(cap + 1), headers=headers)
        assert r.status_code == 413, r.text
        error = r.json()["error"]
        assert (error["type"], error["code"]) == ("invalid_request_error", "request_too_large")
        assert str(cap) in error["message"] and r.headers["x-request-id"]
        # Refused from its Content-Length before a byte of it, or, chunked, once the bytes read pass the
        # cap: neither request ever ends, so reading it whole would never answer.
        assert await status_of_unfinished_post(pd.url, "Content-Length: 1000000000", b"") == 413
        chunk = b"x" * (cap + 1)
        assert await status_of_unfinished_post(pd.url, "Transfer-Encoding: chunked",
                                               f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n") == 413
        assert pd.prefill[0].received == [] and pd.decode[0].received == []
        r = await pd.http.post("/v1/completions", content=body_of_size(cap), headers=headers)  # at the cap: served
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "answer from decode-0"
        await pd.metrics_show('kvbridge_proxy_requests_total{route="/v1/completions",status="413"} 3.0')


def test_the_proxy_body_cap_defaults_to_the_instances_and_is_a_command_line_option():
    from kvbridge.cli import build_parser
    from kvbridge.openai_wire import MAX_BODY_BYTES
    assert MAX_BODY_BYTES == 32 << 20
    parser = build_parser()
    assert parser.parse_args(["proxy", "--decode", "http://d"]).max_body_bytes == MAX_BODY_BYTES
    assert parser.parse_args(["proxy", "--decode", "http://d", "--max-body-bytes", "1024"]).max_body_bytes == 1024
    with pytest.raises(ValueError):
        build_proxy_app([], ["http://d"], max_body_bytes=0)


# ---- selection policies ------------------------------------------------------------------------
def test_policies_by_name_and_unknown_name_is_refused():
    assert isinstance(make_policy("round_robin"), RoundRobinPolicy)
    assert isinstance(make_policy("least_outstanding"), LeastOutstandingPolicy)
    with pytest.raises(ValueError, match="least_outstanding"):
        make_policy("random")


def test_least_outstanding_breaks_ties_by_configured_order():
    a, b, c = Upstream("a", 0, True, 2), Upstream("b", 1, True, 1), Upstream("c", 2, True, 1)
    assert LeastOutstandingPolicy().choose([a, b, c]) is b


def test_round_robin_skips_instances_missing_from_candidates():
    a, b, c = (Upstream(n, i, True) for i, n in enumerate("abc"))
    policy = RoundRobinPolicy()
    assert [policy.choose(cands).url for cands in ([a, b, c], [a, c], [a, b, c], [a, b, c])] == list("acab")


async def test_round_robin_alternates_prefill_and_decode_instances():
    async with pd_cluster(2, 2) as pd:
        for _ in range(4):
            assert (await pd.http.post("/v1/completions", json=COMPLETION)).status_code == 200
        assert [len(p.received) for p in pd.prefill] == [2, 2]
        order = [(r.json()["choices"][0]["text"]) for r in
                 [await pd.http.post("/v1/completions", json=COMPLETION) for _ in range(2)]]
        assert order == ["answer from decode-0", "answer from decode-1"]


async def test_least_outstanding_picks_idle_decode_while_other_holds_slow_request():
    async with pd_cluster(1, 2, decode_policy="least_outstanding") as pd:
        pd.decode[0].hold.clear()
        slow = asyncio.create_task(pd.http.post("/v1/completions", json=COMPLETION))
        await received_by(pd.decode[0])
        for _ in range(2):  # round robin would send the second of these to decode-0
            r = await pd.http.post("/v1/completions", json=COMPLETION)
            assert r.json()["choices"][0]["text"] == "answer from decode-1"
        pd.decode[0].hold.set()
        assert (await slow).json()["choices"][0]["text"] == "answer from decode-0"


# ---- health --------------------------------------------------------------------------------------
async def test_instance_failing_health_is_dropped_then_readmitted():
    async with pd_cluster(1, 2, health_interval_s=0.05) as pd:
        pd.decode[0].healthy = False
        await pd.wait_health("decode", 0, healthy=False)
        texts = [(await pd.http.post("/v1/completions", json=COMPLETION)).json()["choices"][0]["text"]
                 for _ in range(3)]
        assert texts == ["answer from decode-1"] * 3
        pd.decode[0].healthy = True
        await pd.wait_health("decode", 0, healthy=True)
        texts = {(await pd.http.post("/v1/completions", json=COMPLETION)).json()["choices"][0]["text"]
                 for _ in range(2)}
        assert texts == {"answer from decode-0", "answer from decode-1"}


async def test_no_healthy_decode_answers_503_before_any_prefill():
    async with pd_cluster(health_interval_s=0.05) as pd:
        pd.decode[0].healthy = False
        await pd.wait_health("decode", 0, healthy=False)
        r = await pd.http.post("/v1/completions", json=COMPLETION)
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_healthy_instance"
        assert pd.prefill[0].received == []
        assert (await pd.http.get("/health")).status_code == 503


# ---- D unreachable after P succeeded ---------------------------------------------------------------
async def test_unreachable_decode_makes_proxy_release_prefill_kv_and_answer_502():
    async with pd_cluster(health_interval_s=60) as pd:
        await pd.servers["decode-0"].stop()
        r = await pd.http.post("/v1/completions", json=COMPLETION, headers={"X-Request-Id": "rid-9"})
        assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_unreachable"
        [release] = pd.prefill[0].releases
        assert release.body == {"kv_transfer_params": pd.prefill[0].kv_transfer_params("rid-9")}
        assert release.headers["x-request-id"] == "rid-9"
        assert (await pd.health())["decode"][0]["healthy"] is False
        assert 'kvbridge_proxy_kv_releases_total{outcome="ok"} 1.0' in (await pd.http.get("/metrics")).text


async def test_unreachable_decode_fails_over_to_another_decode_without_release():
    async with pd_cluster(1, 2, health_interval_s=60) as pd:
        await pd.servers["decode-0"].stop()
        r = await pd.http.post("/v1/completions", json=COMPLETION)
        assert r.json()["choices"][0]["text"] == "answer from decode-1"
        assert pd.prefill[0].releases == []


async def test_decode_timeout_answers_504_and_leaves_prefill_kv_to_decode():
    async with pd_cluster(timeout_s=1.0) as pd:
        pd.decode[0].hold.clear()
        try:
            r = await pd.http.post("/v1/completions", json=COMPLETION)
        finally:
            pd.decode[0].hold.set()
        assert (r.status_code, r.json()["error"]["message"]) == (504, "decode instance timed out")
        assert pd.prefill[0].releases == []  # D holds the request and may be reading P's blocks


# ---- client disconnect ----------------------------------------------------------------------------
async def test_client_request_id_that_servers_would_refuse_is_replaced():
    async with pd_cluster() as pd:
        await pd.http.post("/v1/completions", json=COMPLETION, headers={"X-Request-Id": "has spaces"})
        request_id = pd.prefill[0].received[0].headers["x-request-id"]
        assert request_id != "has spaces" and pd.decode[0].received[0].headers["x-request-id"] == request_id


async def test_client_disconnect_during_prefill_closes_prefill_call_and_skips_decode():
    async with pd_cluster() as pd:
        pd.prefill[0].hold.clear()
        call = asyncio.create_task(pd.http.post("/v1/completions", json=COMPLETION))
        await received_by(pd.prefill[0])
        call.cancel()  # the client hangs up
        await asyncio.wait_for(pd.prefill[0].disconnected_while_held.wait(), timeout=5)
        pd.prefill[0].hold.set()
        # Not a sleep: wait until the proxy has finished handling the request (it counts it,
        # as 499, only then); any call to decode would have been made before.
        await pd.metrics_show('kvbridge_proxy_requests_total{route="/v1/completions",status="499"} 1.0')
        assert pd.decode[0].received == []


async def test_client_disconnect_while_decode_works_closes_decode_call():
    async with pd_cluster() as pd:
        pd.decode[0].hold.clear()
        call = asyncio.create_task(pd.http.post("/v1/completions", json=COMPLETION))
        await received_by(pd.decode[0])
        call.cancel()
        await asyncio.wait_for(pd.decode[0].disconnected_while_held.wait(), timeout=5)
        assert pd.prefill[0].releases == []  # D has the request: freeing P's KV is D's job


async def test_client_disconnect_mid_stream_closes_decode_stream():
    async with pd_cluster() as pd:
        pd.decode[0].stall_after = 1
        async with pd.http.stream("POST", "/v1/completions", json={**COMPLETION, "stream": True}) as r:
            first = await r.aiter_raw().__anext__()
            assert first.startswith(b"data: ")
        await asyncio.wait_for(pd.decode[0].stream_closed_early.wait(), timeout=5)
        deadline = time.monotonic() + 5
        while (await pd.health())["decode"][0]["outstanding"] != 0:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)


# ---- auth, models, metrics --------------------------------------------------------------------------
async def test_api_key_is_checked_and_upstream_key_is_sent_upstream():
    async with pd_cluster(api_key="proxy-key", upstream_api_key="inner-key") as pd:
        assert (await pd.http.post("/v1/completions", json=COMPLETION)).status_code == 401
        async with openai_client(pd, api_key="wrong") as client:
            with pytest.raises(openai.AuthenticationError):
                await client.models.list()
        async with openai_client(pd, api_key="proxy-key") as client:
            await client.completions.create(model="m", prompt="Hi")
        assert pd.prefill[0].received[0].headers["authorization"] == "Bearer inner-key"
        assert pd.decode[0].received[0].headers["authorization"] == "Bearer inner-key"


@pytest.mark.parametrize("path", ["/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect"])
async def test_the_proxy_serves_no_api_docs_as_the_instances_serve_none(path):
    """With --api-key, docs would describe the API to anyone without a key: 404, as on an instance."""
    async with pd_cluster(api_key="proxy-key") as pd:
        for headers in ({}, {"Authorization": "Bearer proxy-key"}):
            assert (await pd.http.get(path, headers=headers)).status_code == 404


@pytest.mark.parametrize("method, path, status, allow", [
    ("GET", "/v1/no-such-route", 404, None), ("POST", "/nope", 404, None), ("GET", "/docs", 404, None),
    ("GET", "/v1/completions", 405, "POST"), ("DELETE", "/health", 405, "GET"), ("PUT", "/v1/models", 405, "GET")])
async def test_unknown_routes_and_methods_get_openais_error_body(method, path, status, allow):
    """As an instance answers them: {"error": {...}}, never FastAPI's {"detail": ...}; a 405 keeps its Allow."""
    async with pd_cluster() as pd:
        answer = await pd.http.request(method, path)
    assert answer.status_code == status and answer.headers.get("allow") == allow
    assert answer.json() == {"error": {"message": "Not Found" if status == 404 else "Method Not Allowed",
                                       "type": "invalid_request_error", "param": None,
                                       "code": "not_found" if status == 404 else "method_not_allowed"}}


async def test_client_authorization_is_forwarded_when_no_upstream_key():
    async with pd_cluster(api_key="shared-key") as pd, openai_client(pd, api_key="shared-key") as client:
        await client.completions.create(model="m", prompt="Hi")
        assert pd.decode[0].received[0].headers["authorization"] == "Bearer shared-key"


# ---- client headers the proxy's HTTP client may not send as they came -------------------------------
async def raw_request(url: str, method: str, path: str, header_lines: list[bytes],
                      body: dict | None = None) -> tuple[int, bytes]:
    """One request over a plain socket, with header bytes that HTTP client libraries refuse to send
    (httpx and so the official openai client; lm-eval's aiohttp and curl send them): its status and body."""
    target = httpx.URL(url)
    payload = b"" if body is None else json.dumps(body).encode()
    head = [f"{method} {path} HTTP/1.1".encode(), f"Host: {target.host}".encode(), b"Connection: close",
            b"Content-Type: application/json", b"Content-Length: %d" % len(payload), *header_lines]
    reader, writer = await asyncio.open_connection(target.host, target.port)
    try:
        writer.write(b"\r\n".join(head) + b"\r\n\r\n" + payload)
        answer = await reader.read()  # to the end: the server closes after its answer (Connection: close)
    finally:
        writer.close()
    status_line, _, rest = answer.partition(b"\r\n")
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]


def all_closed_and_healthy(health: dict) -> bool:
    return all(u["circuit"] == "closed" and u["healthy"] for kind in ("prefill", "decode") for u in health[kind])


@pytest.mark.parametrize("value, forwarded", [
    (b"Bearer ", "Bearer"),  # lm-eval without a key: the server's parser keeps the trailing space
    (b"Bearer \t \t", "Bearer"),
    (b"Bearer sk-1\t", "Bearer sk-1"),
    (b"", None), (b" \t ", None),
    (b"Bearer sk-\xc3\xa9", None),  # UTF-8: read as latin-1 text, which httpx sends only as ASCII
    (b"Bearer \xff\xfe", None)])  # obs-text bytes
async def test_no_client_authorization_can_open_a_breaker_and_what_cannot_be_sent_goes_on_trimmed_or_not_at_all(
        value: bytes, forwarded: str | None):
    """Issue 44.5: one `Authorization: Bearer ` request opened every breaker (one failure opens one
    here). Without --api-key the instances take any key, as a colocated server and vLLM do: the
    proxy forwards the client's value without the whitespace around it, or not at all when no
    HTTP client may send it, and the request is served."""
    async with pd_cluster(num_decode=2, breaker_failures=1) as pd:
        line = b"Authorization: " + value
        for _ in range(3):
            status, body = await raw_request(pd.url, "POST", "/v1/completions", [line], COMPLETION)
            assert status == 200, body
        assert (await raw_request(pd.url, "GET", "/v1/models", [line]))[0] == 200
        got = [r.headers.get("authorization") for i in pd.prefill + pd.decode for r in i.received]
        assert got == [forwarded] * 6
        assert all_closed_and_healthy(await pd.health())
        async with openai_client(pd) as client:  # and a clean client is served as ever
            answer = await client.completions.create(model="m", prompt="Hi")
        assert answer.choices[0].text.startswith("answer from decode-")


async def test_with_an_api_key_the_clients_authorization_must_match_it_and_goes_on_trimmed():
    """The proxy's --api-key is checked before anything is forwarded: a bad header is 401 and
    reaches no instance; the key with whitespace around it (not part of a header's value) matches."""
    async with pd_cluster(api_key="proxy-key", breaker_failures=1) as pd:
        for value in (b"Bearer ", b"Bearer \t", b"", b"Bearer \xff", b"Bearer proxy-key\xff", b"Bearer wrong"):
            status, body = await raw_request(pd.url, "POST", "/v1/completions", [b"Authorization: " + value],
                                             COMPLETION)
            assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key", (value, body)
        assert pd.prefill[0].received == pd.decode[0].received == []
        status, body = await raw_request(pd.url, "POST", "/v1/completions", [b"Authorization: Bearer proxy-key\t"],
                                         COMPLETION)
        assert status == 200, body
        assert [r.headers["authorization"] for r in pd.prefill[0].received + pd.decode[0].received] == [
            "Bearer proxy-key"] * 2
        assert all_closed_and_healthy(await pd.health())


class RefusingTransport(httpx.AsyncBaseTransport):
    """The proxy's real transport, but a POST to one of the `refuse` instances raises what httpx
    raises for a request it may not send (h11 refusing a header value) before any byte left."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner
        self.refuse: set[str] = set()  # instance URLs
        self.refused = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.method == "POST" and f"{request.url.scheme}://{request.url.netloc.decode()}" in self.refuse:
            self.refused += 1
            raise httpx.LocalProtocolError("Illegal header value b'Bearer '", request=request)
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


@pytest.mark.parametrize("leg", ["prefill", "decode", "colocated"])
async def test_a_request_the_http_client_may_not_send_is_the_clients_400_and_no_instances_failure(leg: str):
    """Behind the header rule: whatever the proxy's HTTP client refuses to send would fail the same
    on every instance. It is answered 400 at once: not retried, no decode-only fallback, nothing
    held against the instance (one failure would open a breaker here); P's KV is released when
    no D got the request."""
    transports: list[RefusingTransport] = []

    def wrap(inner: httpx.AsyncBaseTransport) -> httpx.AsyncBaseTransport:
        transports.append(RefusingTransport(inner))
        return transports[-1]

    async with pd_cluster(num_prefill=0 if leg == "colocated" else 2, num_decode=2, breaker_failures=1,
                          wrap_transport=wrap) as pd:
        refusing = pd.prefill if leg == "prefill" else pd.decode
        transports[0].refuse = {pd.servers[i.name].url for i in refusing}
        for _ in range(3):
            r = await pd.http.post("/v1/completions", json=COMPLETION)
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert (error["type"], error["code"]) == ("invalid_request_error", "unsendable_request")
        assert transports[0].refused == 3  # one attempt each
        assert all(i.received == [] for i in refusing)
        if leg == "decode":
            assert sum(len(p.releases) for p in pd.prefill) == 3
        assert all_closed_and_healthy(await pd.health())
        metrics = (await pd.http.get("/metrics")).text
        assert "kvbridge_proxy_retries_total{" not in metrics
        assert "kvbridge_proxy_decode_only_fallback_total 0.0" in metrics
        transports[0].refuse = set()
        assert (await pd.http.post("/v1/completions", json=COMPLETION)).status_code == 200


async def test_models_come_from_a_healthy_decode_instance():
    async with pd_cluster(1, 2, health_interval_s=0.05) as pd, openai_client(pd) as client:
        assert [m.id for m in (await client.models.list()).data] == ["model-of-decode-0"]
        pd.decode[0].healthy = False
        await pd.wait_health("decode", 0, healthy=False)
        assert [m.id for m in (await client.models.list()).data] == ["model-of-decode-1"]


async def test_metrics_use_the_proxy_prefix_in_a_registry_per_app():
    async with pd_cluster() as pd, pd_cluster() as other:
        await pd.http.post("/v1/completions", json=COMPLETION)
        text = (await pd.http.get("/metrics")).text
        assert 'kvbridge_proxy_requests_total{route="/v1/completions",status="200"} 1.0' in text
        assert 'kvbridge_proxy_healthy_instances{kind="decode"} 1.0' in text
        assert "kvbridge_proxy_requests_total{" not in (await other.http.get("/metrics")).text


def test_empty_url_list_is_refused():
    with pytest.raises(ValueError, match="decode"):
        build_proxy_app(["http://127.0.0.1:1"], [])


# ---- colocated mode: no prefill URLs ---------------------------------------------------------------
async def test_colocated_mode_sends_the_client_body_unchanged_to_decode_only():
    async with pd_cluster(num_prefill=0) as pd:
        body = {**COMPLETION, "min_tokens": 4, "n": 2, "stream_options": {"include_usage": True}}
        r = await pd.http.post("/v1/completions", json=body, headers={"X-Request-Id": "rid-c"})
        assert r.json()["choices"][0]["text"] == "answer from decode-0"
        [received] = pd.decode[0].received
        assert (received.body, received.headers["x-request-id"]) == (body, "rid-c")


async def test_colocated_mode_drops_client_kv_transfer_params():
    async with pd_cluster(num_prefill=0) as pd:
        await pd.http.post("/v1/completions", json={**COMPLETION, "kv_transfer_params": {"do_remote_prefill": True}})
        assert pd.decode[0].received[0].body == COMPLETION


async def test_colocated_mode_stream_passthrough_is_byte_exact_with_the_official_client():
    async with pd_cluster(num_prefill=0) as pd, openai_client(pd) as client:
        async with pd.http.stream("POST", "/v1/chat/completions", headers={"X-Request-Id": "rid-s"},
                                  json={"model": "m", "messages": [], "stream": True}) as r:
            received = b"".join([chunk async for chunk in r.aiter_raw()])
        assert received == b"".join(pd.decode[0].stream_chunks("/v1/chat/completions", "rid-s"))
        stream = await client.completions.create(model="m", prompt="Hi", max_tokens=5, stream=True)
        assert "".join([chunk.choices[0].text async for chunk in stream]) == "answer from decode-0"


async def test_colocated_mode_health_needs_only_decode_and_503_without_it():
    async with pd_cluster(num_prefill=0, health_interval_s=0.05) as pd:
        assert await pd.health() == {"status": "ok", "mode": "colocated", "prefill": [],
                                     "decode": [{"url": pd.servers["decode-0"].url, "healthy": True,
                                                 "outstanding": 0, "circuit": "closed"}]}
        pd.decode[0].healthy = False
        await pd.wait_health("decode", 0, healthy=False)
        r = await pd.http.post("/v1/completions", json=COMPLETION)
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_healthy_instance"
        assert (await pd.http.get("/health")).status_code == 503


async def test_colocated_mode_fails_over_between_decode_instances():
    async with pd_cluster(num_prefill=0, num_decode=2, health_interval_s=60) as pd:
        await pd.servers["decode-0"].stop()
        texts = [(await pd.http.post("/v1/completions", json=COMPLETION)).json()["choices"][0]["text"]
                 for _ in range(2)]
        assert texts == ["answer from decode-1"] * 2


def test_proxy_command_line_without_prefill_is_colocated():
    from kvbridge.cli import build_parser
    args = build_parser().parse_args(["proxy", "--decode", "http://d0"])
    assert (args.prefill, args.decode) == ([], ["http://d0"])


# ---- local cluster: command lines, environment, children --------------------------------------------
def test_serve_command_names_every_kv_option():
    spec = cluster.InstanceSpec("prefill-0", KVRole.PRODUCER, 9001, 9002, "prefill-0-abc", 2)
    argv = cluster.serve_command(("py", "-m", "kvbridge.cli"), "model.gguf", spec, host="127.0.0.1",
                                 kv_backend="tcp", num_threads=2, extra_args=["--dtype", "bfloat16"])
    assert argv == ["py", "-m", "kvbridge.cli", "serve", "model.gguf", "--host", "127.0.0.1", "--port", "9001",
                    "--kv-role", "producer", "--kv-backend", "tcp", "--kv-engine-id", "prefill-0-abc",
                    "--kv-side-channel-port", "9002", "--num-threads", "2", "--tensor-parallel-size", "2",
                    "--otlp-service-name", "kvbridge-prefill-0", "--dtype", "bfloat16"]


def test_plan_instances_gives_prefill_and_decode_their_own_tp_sizes():
    specs = cluster.plan_instances(2, 1, prefill_tp=2, decode_tp=3)
    assert [(s.name, s.tensor_parallel_size) for s in specs] == [("prefill-0", 2), ("prefill-1", 2), ("decode-0", 3)]


def test_proxy_command_lists_every_instance():
    argv = cluster.proxy_command(("kv",), ["http://p0", "http://p1"], ["http://d0"], host="127.0.0.1", port=8000)
    assert argv == ["kv", "proxy", "--prefill", "http://p0", "http://p1", "--decode", "http://d0",
                    "--host", "127.0.0.1", "--port", "8000"]


def test_plan_gives_distinct_ports_roles_and_engine_ids():
    specs = cluster.plan_instances(2, 3)
    assert [s.name for s in specs] == ["prefill-0", "prefill-1", "decode-0", "decode-1", "decode-2"]
    assert [s.role for s in specs] == [KVRole.PRODUCER] * 2 + [KVRole.CONSUMER] * 3
    ports = [p for s in specs for p in (s.port, s.side_channel_port)]
    assert len(set(ports)) == 10 and len({s.engine_id for s in specs}) == 5


def test_child_env_keeps_loopback_clusters_on_lo_and_threads_passive():
    base = {"PATH": "/bin", "UCX_NET_DEVICES": "eth0"}
    env = cluster.child_env(base, loopback_only=True, num_threads=1)
    assert (env["UCX_NET_DEVICES"], env["OMP_WAIT_POLICY"], env["OMP_NUM_THREADS"]) == ("lo", "PASSIVE", "1")
    assert env["PATH"] == "/bin" and base["UCX_NET_DEVICES"] == "eth0"
    assert "UCX_NET_DEVICES" not in cluster.child_env({}, loopback_only=False, num_threads=1)


def test_threads_are_split_between_engines():
    assert [cluster.threads_per_engine(n, cores=8) for n in (1, 2, 3, 16)] == [8, 4, 2, 1]


def _sleeper(tmp_path: Path, name: str, code: str = "import time; time.sleep(60)") -> cluster.ChildProcess:
    return cluster.spawn_child(name, [sys.executable, "-c", code], {}, tmp_path)


def _wait_ready(child: cluster.ChildProcess) -> None:
    deadline = time.monotonic() + 10
    while "ready" not in child.tail():
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_stop_children_interrupts_each_child_and_nothing_else(tmp_path):
    # SIGINT (stop now), not SIGTERM: an instance's SIGTERM starts a drain that may outlast the grace.
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    code = "import signal, time; signal.signal(signal.SIGINT, signal.SIG_DFL); print('ready', flush=True); time.sleep(60)"
    try:
        children = [_sleeper(tmp_path, "a", code), _sleeper(tmp_path, "b", code)]
        for child in children:
            _wait_ready(child)
        cluster.stop_children(children, grace_s=5)
        assert [c.popen.returncode for c in children] == [-signal.SIGINT, -signal.SIGINT]
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()


def test_stop_children_kills_a_child_that_ignores_sigint_after_grace(tmp_path):
    code = ("import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); "
            "print('ready', flush=True); time.sleep(60)")
    child = _sleeper(tmp_path, "stubborn", code)
    _wait_ready(child)
    started = time.monotonic()
    cluster.stop_children([child], grace_s=0.3)
    assert child.popen.returncode == -signal.SIGKILL
    assert time.monotonic() - started < 5


def test_local_cluster_starts_serves_and_stops_every_child(tmp_path):
    from kvbridge.cli import parse_args, up_proxy_args
    up = parse_args(["up", "--max-body-bytes", "4096"])
    with cluster.LocalCluster("fake", num_prefill=1, num_decode=2, port=0, cli=STAND_IN_CLI,
                              ready_timeout_s=60, log_dir=tmp_path, proxy_args=up_proxy_args(up)) as local:
        children = list(local.children)
        assert [c.name for c in children] == ["prefill-0", "decode-0", "decode-1", "proxy"]
        client = openai.OpenAI(base_url=local.urls.proxy + "/v1", api_key="x", max_retries=0,
                               http_client=httpx.Client(trust_env=False, timeout=10))
        completion = client.completions.create(model="m", prompt="Hi", max_tokens=3)
        assert completion.choices[0].text.startswith("answer from decode-")
        env = httpx.get(local.urls.decode[0] + "/debug/env", trust_env=False).json()
        assert env == {"UCX_NET_DEVICES": "lo", "OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "1"}
        too_long = httpx.post(local.urls.proxy + "/v1/completions", content=body_of_size(4097), trust_env=False)
        assert too_long.status_code == 413  # `up --max-body-bytes` reached the proxy
    assert all(not c.alive() for c in children)


def test_local_cluster_reports_child_that_dies_during_startup_and_stops_the_rest(tmp_path):
    local = cluster.LocalCluster("crash-on-consumer", port=0, cli=STAND_IN_CLI, ready_timeout_s=60,
                                 log_dir=tmp_path, stop_grace_s=5)
    with pytest.raises(cluster.ClusterStartError, match=r"decode-0 exited with code 3(.|\n)*cannot load"):
        local.start()
    assert [c.name for c in local.children] == ["prefill-0", "decode-0"]
    assert all(not c.alive() for c in local.children)


def test_run_cluster_stops_every_child_on_sigterm_and_exits_0():
    code = ("import sys; from kvbridge.launcher.cluster import run_cluster; "
            f"sys.exit(run_cluster('fake', port=0, ready_timeout_s=60, cli={STAND_IN_CLI!r}))")
    launcher = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        lines = []
        while not lines or not lines[-1].startswith("Ctrl-C"):
            line = launcher.stdout.readline()
            assert line, f"launcher ended early: {lines}"
            lines.append(line)
        output = "".join(lines)
        urls = list(dict.fromkeys(re.findall(r"http://127\.0\.0\.1:\d+", output)))  # proxy, P, D
        assert len(urls) == 3 and "curl " + urls[0] + "/v1/chat/completions" in output
        assert httpx.get(urls[0] + "/health", trust_env=False).status_code == 200
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=30) == 0
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    for url in urls:
        with pytest.raises(httpx.ConnectError):
            httpx.get(url + "/health", trust_env=False)
