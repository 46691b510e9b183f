"""The proxy's spans (issue 30, proxy/tracing_spans.py) through the real proxy app, with stand-in P
and D servers over real HTTP (tests/unit/proxy_upstreams.py) and an in-memory exporter: names,
parents, attributes, the traceparent each upstream receives, retries, the first-token path, the
children tiling proxy.request, and tracing off costing nothing."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

import httpx
import pytest
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace import Tracer as SdkTracer
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from kvbridge.proxy import tracing_spans
from kvbridge.proxy.app import build_proxy_app
from kvbridge.proxy.proxy import RetryPolicy
from kvbridge.tracing import Tracing, parse_traceparent
from tests.unit.proxy_upstreams import FakeInstance, RunningServer, serve
from tests.unit.proxy_cluster import COMPLETION, PD, STREAMED, offer_token, pd_cluster, received_by

pytestmark = pytest.mark.timeout(60)
CLIENT_TP = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
ERROR = b'{"error": {"message": "engine failed", "type": "server_error", "code": 500}}'


class Recorder(SpanProcessor):
    """The proxy's finished spans (in memory), and an event for each proxy.request that ends
    (the proxy ends it after the client may already have its answer)."""

    def __init__(self) -> None:
        self.exporter = InMemorySpanExporter()
        self._export = SimpleSpanProcessor(self.exporter)
        provider = TracerProvider()
        provider.add_span_processor(self)
        self.tracing = Tracing(provider, "kvbridge-proxy")
        self._ended = asyncio.Event()

    def on_end(self, span: ReadableSpan) -> None:
        self._export.on_end(span)
        if span.name == "proxy.request":
            self._ended.set()

    @property
    def spans(self) -> list[ReadableSpan]:
        return list(self.exporter.get_finished_spans())

    async def requests(self, n: int = 1) -> list[ReadableSpan]:
        """Once `n` proxy.request spans ended: them, in the order they ended."""
        while len(done := [s for s in self.spans if s.name == "proxy.request"]) < n:
            self._ended.clear()
            await asyncio.wait_for(self._ended.wait(), 10)
        return done

    def children(self, parent: ReadableSpan, name: str | None = None) -> list[ReadableSpan]:
        """`parent`'s children in start order (those named `name`)."""
        found = [s for s in self.spans if s.parent is not None and s.parent.span_id == parent.context.span_id
                 and (name is None or s.name == name)]
        return sorted(found, key=lambda s: s.start_time)


class Delayed:
    """An instance's app whose completions take `delay_s` longer (the model's work)."""

    def __init__(self, app, delay_s: float) -> None:
        self.app, self.delay_s = app, delay_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/") and scope["method"] == "POST":
            await asyncio.sleep(self.delay_s)
        await self.app(scope, receive, send)


@asynccontextmanager
async def delayed_cluster(recorder: Recorder, delay_s: float, **proxy_kwargs) -> AsyncIterator[PD]:
    """One P and one D whose completions take `delay_s`, behind a traced proxy."""
    p, d = FakeInstance("prefill-0", "prefill"), FakeInstance("decode-0", "decode")
    async with AsyncExitStack() as stack:
        servers: dict[str, RunningServer] = {}
        stack.push_async_callback(lambda: asyncio.gather(*(s.stop() for s in servers.values())))
        for inst in (p, d):
            servers[inst.name] = await serve(Delayed(inst.app, delay_s))
        app = build_proxy_app([servers["prefill-0"].url], [servers["decode-0"].url], tracing=recorder.tracing,
                              **proxy_kwargs)
        proxy = await serve(app)
        stack.push_async_callback(proxy.stop)
        http = await stack.enter_async_context(httpx.AsyncClient(base_url=proxy.url, timeout=10, trust_env=False))
        yield PD([p], [d], servers, proxy.url, http)


def attrs(span: ReadableSpan) -> dict:
    return dict(span.attributes or {})


def names(spans: list[ReadableSpan]) -> list[str]:
    return [s.name for s in spans]


def uncovered_ns(recorder: Recorder, request: ReadableSpan) -> int:
    """The time inside `request` that none of its children covers."""
    covered, cursor = 0, request.start_time
    for child in recorder.children(request):
        start, end = max(child.start_time, cursor), min(child.end_time, request.end_time)
        if end > start:
            covered += end - start
            cursor = end
    return (request.end_time - request.start_time) - covered


def named_by(received, attempt: ReadableSpan) -> bool:
    """Whether the traceparent an upstream received names `attempt` (same trace, its span id)."""
    parent = parse_traceparent(received.headers.get("traceparent"))
    return (parent is not None and parent.trace_id == attempt.context.trace_id
            and parent.span_id == attempt.context.span_id and parent.trace_flags.sampled)


async def streamed(pd: PD, body: dict, headers: dict | None = None) -> tuple[int, bytes]:
    async with pd.http.stream("POST", "/v1/completions", json=body, headers=headers) as r:
        return r.status_code, await r.aread()


# ---- tracing off --------------------------------------------------------------------------------------
async def test_tracing_off_makes_no_span_and_sends_no_traceparent(monkeypatch):
    def refuse(*_args, **_kwargs):
        raise AssertionError("a span was made with tracing off")
    for owner, name in ((Tracing, "start_span"), (Tracing, "record"), (SdkTracer, "start_span"),
                        (tracing_spans.RequestSpans, "__init__"), (tracing_spans.Leg, "__init__"),
                        (tracing_spans.AttemptSpan, "__init__"), (tracing_spans.ProxyTracingMiddleware, "__init__")):
        monkeypatch.setattr(owner, name, refuse)
    async with pd_cluster(num_prefill=2) as pd:
        offer_token(pd.prefill[1])
        pd.prefill[0].error = (500, ERROR)  # the first P fails: a retry, then the first-token path
        status, raw = await streamed(pd, STREAMED, headers={"traceparent": CLIENT_TP})
        assert status == 200 and b"[DONE]" in raw
        r = await pd.http.post("/v1/completions", json=COMPLETION)
        assert r.status_code == 200
        sent = pd.prefill[0].received + pd.prefill[1].received + pd.decode[0].received
        assert len(sent) >= 4 and all("traceparent" not in s.headers for s in sent)


# ---- the spans of one request --------------------------------------------------------------------------
async def test_an_unstreamed_request_s_spans_join_the_client_s_trace_and_name_each_attempt_upstream():
    recorder = Recorder()
    async with pd_cluster(tracing=recorder.tracing) as pd:
        r = await pd.http.post("/v1/completions", json=COMPLETION,
                               headers={"traceparent": CLIENT_TP, "X-Request-Id": "req-tr-1"})
        assert r.status_code == 200
        [request] = await recorder.requests()
    client = parse_traceparent(CLIENT_TP)
    assert request.kind is SpanKind.SERVER and request.context.trace_id == client.trace_id
    assert request.parent.span_id == client.span_id
    want = {"kvbridge.request_id": "req-tr-1", "http.route": "/v1/completions", "http.request.method": "POST",
            "http.response.status_code": 200, "kvbridge.outcome": "ok"}
    assert {k: attrs(request).get(k) for k in want} == want
    children = recorder.children(request)
    assert names(children) == ["proxy.read_body", "proxy.route", "proxy.attempt", "proxy.route", "proxy.attempt",
                               "proxy.relay"]
    assert all(s.context.trace_id == client.trace_id for s in recorder.spans)
    p_route, p_attempt, d_route, d_attempt = children[1:5]
    assert attrs(p_route)["kvbridge.role"] == "prefill" and attrs(p_route)["kvbridge.policy"] == "round_robin"
    assert attrs(p_route)["url.full"] == pd.servers["prefill-0"].url + "/v1/completions"
    assert attrs(d_route)["server.port"] == int(pd.servers["decode-0"].url.rsplit(":", 1)[1])
    for attempt, role in ((p_attempt, "prefill"), (d_attempt, "decode")):
        assert attempt.kind is SpanKind.CLIENT and attempt.status.status_code is StatusCode.UNSET
        assert {k: attrs(attempt)[k] for k in ("kvbridge.role", "kvbridge.attempt", "kvbridge.outcome",
                                               "http.response.status_code")} == {
            "kvbridge.role": role, "kvbridge.attempt": 1, "kvbridge.outcome": "ok", "http.response.status_code": 200}
    assert named_by(pd.prefill[0].received[0], p_attempt) and named_by(pd.decode[0].received[0], d_attempt)
    assert pd.prefill[0].received[0].headers["x-request-id"] == "req-tr-1"
    relay = children[-1]
    assert relay.end_time == request.end_time and attrs(relay)["kvbridge.chunks"] == 1
    assert attrs(relay)["kvbridge.bytes"] == len(r.content) and relay.start_time == d_attempt.end_time


async def test_without_a_valid_traceparent_the_proxy_starts_the_trace():
    recorder = Recorder()
    async with pd_cluster(tracing=recorder.tracing) as pd:
        await pd.http.post("/v1/completions", json=COMPLETION, headers={"traceparent": "00-garbage-01"})
        await pd.http.post("/v1/completions", json=COMPLETION)
        first, second = await recorder.requests(2)
    assert first.parent is None and second.parent is None and first.context.trace_id != second.context.trace_id
    sent = pd.decode[0].received
    assert parse_traceparent(sent[0].headers["traceparent"]).trace_id == first.context.trace_id


async def test_an_unsampled_client_trace_records_nothing_but_passes_the_decision_upstream():
    recorder = Recorder()
    unsampled = CLIENT_TP[:-2] + "00"
    async with pd_cluster(tracing=recorder.tracing) as pd:
        r = await pd.http.post("/v1/completions", json=COMPLETION, headers={"traceparent": unsampled})
        assert r.status_code == 200
        tps = [parse_traceparent(x.received[0].headers["traceparent"]) for x in (pd.prefill[0], pd.decode[0])]
    assert recorder.spans == []
    assert all(tp.trace_id == parse_traceparent(unsampled).trace_id and not tp.trace_flags.sampled for tp in tps)


async def test_a_streamed_request_s_relay_counts_d_s_chunks_until_the_last_byte():
    recorder = Recorder()
    async with pd_cluster(tracing=recorder.tracing, first_token_from_prefill=False) as pd:
        status, raw = await streamed(pd, STREAMED)
        assert status == 200
        [request] = await recorder.requests()
    children = recorder.children(request)
    assert names(children)[-2:] == ["proxy.attempt", "proxy.relay"] and "proxy.first_token" not in names(children)
    relay = children[-1]
    assert attrs(relay)["kvbridge.chunks"] == len(pd.decode[0].stream_chunks("/v1/completions", "x"))
    assert attrs(relay)["kvbridge.bytes"] == len(raw) and relay.end_time == request.end_time
    assert named_by(pd.decode[0].received[0], children[-2])


# ---- retries and fallbacks ----------------------------------------------------------------------------
async def test_a_retried_prefill_shows_both_attempts_with_their_outcomes_and_upstream_parents():
    recorder = Recorder()
    async with pd_cluster(num_prefill=2, tracing=recorder.tracing) as pd:
        pd.prefill[0].error = (500, ERROR)
        r = await pd.http.post("/v1/completions", json=COMPLETION)
        assert r.status_code == 200
        [request] = await recorder.requests()
    children = recorder.children(request)
    assert names(children) == ["proxy.read_body", "proxy.route", "proxy.attempt", "proxy.backoff", "proxy.route",
                               "proxy.attempt", "proxy.route", "proxy.attempt", "proxy.relay"]
    failed, ok = children[2], children[5]
    assert (attrs(failed)["kvbridge.attempt"], attrs(failed)["kvbridge.outcome"]) == (1, "status_500")
    assert attrs(failed)["http.response.status_code"] == 500 and failed.status.status_code is StatusCode.ERROR
    assert (attrs(ok)["kvbridge.attempt"], attrs(ok)["kvbridge.outcome"]) == (2, "ok")
    assert attrs(children[3]) == {"kvbridge.role": "prefill", "kvbridge.attempt": 2, "kvbridge.outcome": "retry"}
    assert attrs(children[4])["kvbridge.excluded"] == 1
    assert named_by(pd.prefill[0].received[0], failed) and named_by(pd.prefill[1].received[0], ok)


async def test_a_refused_connection_is_an_attempt_without_a_status():
    recorder = Recorder()
    async with pd_cluster(num_decode=2, tracing=recorder.tracing) as pd:
        await pd.servers["decode-0"].stop()  # still healthy to the proxy until its next probe
        r = await pd.http.post("/v1/completions", json=COMPLETION)
        assert r.status_code == 200
        [request] = await recorder.requests()
    d_attempts = [s for s in recorder.children(request, "proxy.attempt") if attrs(s)["kvbridge.role"] == "decode"]
    assert [attrs(s)["kvbridge.outcome"] for s in d_attempts] == ["connect", "ok"]
    assert "http.response.status_code" not in attrs(d_attempts[0])
    assert d_attempts[0].status.status_code is StatusCode.ERROR and named_by(pd.decode[1].received[0], d_attempts[1])


async def test_the_decode_only_fallback_is_traced_and_d_gets_its_attempt_s_traceparent():
    recorder = Recorder()
    async with pd_cluster(tracing=recorder.tracing, retry=RetryPolicy(retries=0)) as pd:
        pd.prefill[0].error = (503, ERROR)
        r = await pd.http.post("/v1/completions", json=COMPLETION)
        assert r.status_code == 200
        [request] = await recorder.requests()
    attempts = recorder.children(request, "proxy.attempt")
    assert [(attrs(s)["kvbridge.role"], attrs(s)["kvbridge.outcome"]) for s in attempts] == [
        ("prefill", "status_503"), ("decode_only", "ok")]
    assert named_by(pd.decode[0].received[0], attempts[1])


async def test_colocated_mode_traces_its_one_leg():
    recorder = Recorder()
    d = FakeInstance("decode-0", "decode")
    server = await serve(d.app)
    proxy = await serve(build_proxy_app([], [server.url], tracing=recorder.tracing, prefill_policy="prefix",
                                        decode_policy="prefix"))
    try:
        async with httpx.AsyncClient(base_url=proxy.url, timeout=10, trust_env=False) as http:
            for _ in range(2):
                assert (await http.post("/v1/completions", json={**COMPLETION, "prompt": "x" * 200})).status_code == 200
            await recorder.requests(2)
    finally:
        await proxy.stop()
        await server.stop()
    routes = [s for s in recorder.spans if s.name == "proxy.route"]
    assert [attrs(s)["kvbridge.role"] for s in routes] == ["colocated"] * 2
    assert [attrs(s)["kvbridge.policy"] for s in routes] == ["prefix"] * 2
    assert [attrs(s)["kvbridge.prefix_match_blocks"] for s in routes] == [0, 3]  # 200 chars: 3 blocks of 64


# ---- the first-token path -----------------------------------------------------------------------------
async def test_the_first_token_span_runs_from_p_s_answer_to_its_token_reaching_the_server():
    recorder = Recorder()
    async with pd_cluster(tracing=recorder.tracing) as pd:
        offer_token(pd.prefill[0])
        status, raw = await streamed(pd, STREAMED)
        assert status == 200
        [request] = await recorder.requests()
    children = recorder.children(request)
    [first] = recorder.children(request, "proxy.first_token")
    p_attempt, d_attempt = recorder.children(request, "proxy.attempt")
    relay = children[-1]
    assert attrs(first) == {"kvbridge.outcome": "continued"} and relay.name == "proxy.relay"
    assert p_attempt.end_time <= first.start_time <= d_attempt.start_time  # D's leg is part of the path
    assert d_attempt.end_time <= first.end_time <= relay.end_time
    assert attrs(relay)["kvbridge.chunks"] == 1 + len(pd.decode[0].stream_chunks("/v1/completions", "x"))
    assert relay.start_time == d_attempt.end_time  # D's stream in hand: P's token's events go first


async def test_a_request_p_s_token_ends_shows_the_first_token_the_release_and_no_decode_attempt():
    recorder = Recorder()
    async with pd_cluster(tracing=recorder.tracing) as pd:
        offer_token(pd.prefill[0])
        status, _ = await streamed(pd, {**STREAMED, "max_tokens": 1})
        assert status == 200
        [request] = await recorder.requests()
    assert names(recorder.children(request)) == ["proxy.read_body", "proxy.route", "proxy.attempt",
                                                 "proxy.first_token", "proxy.release", "proxy.relay"]
    [first] = recorder.children(request, "proxy.first_token")
    assert attrs(first)["kvbridge.outcome"] == "finished_at_prefill" and first.end_time <= request.end_time


async def test_when_p_offers_no_token_the_first_token_span_says_so_and_d_streams():
    recorder = Recorder()
    async with pd_cluster(tracing=recorder.tracing) as pd:
        status, _ = await streamed(pd, STREAMED)  # a stand-in P names no generated token
        assert status == 200
        [request] = await recorder.requests()
    [first] = recorder.children(request, "proxy.first_token")
    [_, d_attempt] = recorder.children(request, "proxy.attempt")
    assert attrs(first)["kvbridge.outcome"] == "no_token" and first.end_time <= d_attempt.start_time


# ---- requests the proxy answers itself, and clients that go away ----------------------------------------
async def test_a_refused_request_is_read_then_answered():
    recorder = Recorder()
    async with pd_cluster(tracing=recorder.tracing, api_key="sk-right") as pd:
        r = await pd.http.post("/v1/completions", json=COMPLETION)
        assert r.status_code == 401
        bad = await pd.http.post("/v1/completions", content=b"{not json", headers={"Authorization": "Bearer sk-right"})
        assert bad.status_code == 400
        requests = await recorder.requests(2)
    for request, status in zip(requests, (401, 400)):
        assert names(recorder.children(request)) == ["proxy.read_body", "proxy.relay"]
        assert attrs(request)["http.response.status_code"] == status
        assert request.status.status_code is StatusCode.UNSET
    assert pd.prefill[0].received == []


async def test_a_client_that_goes_away_ends_the_open_attempt_as_cancelled():
    recorder = Recorder()
    async with pd_cluster(tracing=recorder.tracing) as pd:
        pd.prefill[0].hold.clear()
        call = asyncio.create_task(pd.http.post("/v1/completions", json=COMPLETION))
        await received_by(pd.prefill[0])
        call.cancel()
        await asyncio.gather(call, return_exceptions=True)
        [request] = await recorder.requests()
        pd.prefill[0].hold.set()
    [attempt] = recorder.children(request, "proxy.attempt")
    assert attrs(attempt)["kvbridge.outcome"] == "cancelled" and attempt.status.status_code is StatusCode.ERROR
    assert attrs(request)["kvbridge.outcome"] == "client_gone"
    assert named_by(pd.prefill[0].received[0], attempt)


# ---- the children tile proxy.request --------------------------------------------------------------------
@pytest.mark.parametrize("path,stream", [("/v1/completions", False), ("/v1/completions", True),
                                         ("/v1/chat/completions", True)])
async def test_the_children_cover_all_but_a_hundredth_of_a_request_whose_upstreams_take_50_ms(path, stream):
    recorder = Recorder()
    body = ({**COMPLETION, "stream": stream} if path == "/v1/completions"
            else {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "stream": stream})
    async with delayed_cluster(recorder, 0.05) as pd:
        offer_token(pd.prefill[0])
        for _ in range(3):
            async with pd.http.stream("POST", path, json=body) as r:
                assert r.status_code == 200
                await r.aread()
        requests = await recorder.requests(3)
    for request in requests:
        duration = request.end_time - request.start_time
        gaps = uncovered_ns(recorder, request)
        assert duration > 100e6 and gaps < duration / 100, (gaps, duration, [
            (s.name, s.start_time - request.start_time, s.end_time - request.start_time)
            for s in recorder.children(request)])
        assert max(s.end_time for s in recorder.children(request)) == request.end_time

