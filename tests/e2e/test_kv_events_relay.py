"""KV events through a fault-injecting relay, between real processes: a `kvbridge serve` (the default
model, fp32, publishing events with a replay endpoint) and a `kvbridge proxy` (kv_aware, following
its events) whose view of the instance's event stream goes through a relay in this process that
drops, garbles, truncates, duplicates and extends messages with an unknown event type.
The proxy reaches the instance through an HTTP front in this process that answers its question
"where are your events?" with the relay's address; every other request passes through unchanged.

While the faults run, every request through the proxy is answered right (the colocated engine's
text) and nothing crashes; each kind of fault is counted in the proxy's fleet view; once they stop,
the index resyncs (replay from the instance itself) and every prediction of cached tokens equals
what the instance reports; every block is free at the end."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from kvbridge.chaos import ThreadServer
from kvbridge.engine.sampling_params import SamplingParams
from kvbridge.launcher.cluster import DEFAULT_CLI, free_ports, http_url
from tests.e2e.processes import assert_all_blocks_free, metric
from tests.fleet import SMOLLM2, FleetSpec, Member, Reference
from tests.kv_events_relay import FAULTS, Relay, cycling_faults

EVENTS = '{"enable_kv_cache_events": true, "replay_endpoint": "tcp://127.0.0.1:*", "topic": "kv"}'
MAX_TOKENS = 8
WORDS = ["rivers", "mountains", "the sea", "bees", "trains", "libraries", "rain", "bridges", "chess", "autumn"]


def front_app(upstream: str, events_endpoint: str) -> Starlette:
    """Forwards every request to `upstream` as it is, streaming the answer back; GET /kvbridge/kv_events
    answers the upstream's contract with its live endpoint replaced by `events_endpoint`."""
    client = httpx.AsyncClient(base_url=upstream, timeout=120, trust_env=False)

    async def forward(request: Request) -> Response:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
        sent = client.build_request(request.method, request.url.path, params=request.url.query or None,
                                    headers=headers, content=await request.body())
        answer = await client.send(sent, stream=True)
        if request.url.path == "/kvbridge/kv_events":
            body = json.loads(await answer.aread())
            await answer.aclose()
            if body.get("enabled"):
                body["endpoint"] = events_endpoint
            return Response(json.dumps(body), status_code=answer.status_code, media_type="application/json")
        passed = {k: v for k, v in answer.headers.items() if k.lower() not in ("content-length", "transfer-encoding",
                                                                              "content-encoding", "connection")}

        async def chunks():
            try:
                async for chunk in answer.aiter_raw():
                    yield chunk
            finally:
                await answer.aclose()
        return StreamingResponse(chunks(), status_code=answer.status_code, headers=passed)

    methods = ["GET", "POST", "DELETE", "PUT"]
    return Starlette(routes=[Route("/{path:path}", forward, methods=methods)])


def fleet_entry(proxy: str, url: str) -> dict:
    return httpx.get(proxy + "/kvbridge/fleet", timeout=10).json()["instances"].get(url, {})


def wait_for(what: str, done, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def prediction_errors(proxy: str) -> tuple[float, float]:
    """(observations, those exactly 0) of the proxy's predicted-minus-reported histogram."""
    name = "kvbridge_proxy_cached_tokens_prediction_error"
    total = metric(proxy, f"{name}_count")
    exact = metric(proxy, f"{name}_bucket", le="0.0") - metric(proxy, f"{name}_bucket", le="-1.0")
    return total, exact


def complete_ids(proxy: str, ids: list[int]) -> tuple[str, int]:
    """(text, cached prompt tokens) of a greedy completion of token ids through the proxy."""
    r = httpx.post(proxy + "/v1/completions", timeout=120, json={
        "model": SMOLLM2, "prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"], r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def predicted(proxy: str, ids: list[int], url: str) -> int | None:
    r = httpx.post(proxy + "/kvbridge/fleet/predict", json={"model": SMOLLM2, "prompt": ids}, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()["cached"].get(url)


@pytest.fixture(scope="module")
def reference():
    return Reference(SMOLLM2)


def test_a_router_behind_a_lossy_garbling_relay_keeps_serving_and_resyncs(fleets, reference):
    fleet = fleets.own(FleetSpec.of(SMOLLM2, "nixl", {"c": Member(None, args=("--kv-events-config", EVENTS))}))
    instance = fleet.urls["c"]
    contract = httpx.get(instance + "/kvbridge/kv_events", timeout=10).json()
    assert contract["enabled"] and contract["replay_endpoint"]
    relay = Relay(contract["endpoint"])
    front = ThreadServer(front_app(instance, relay.endpoint))
    try:
        port = free_ports(1)[0]
        proxy = http_url("127.0.0.1", port)
        fleet.spawn("proxy", [*DEFAULT_CLI, "proxy", "--decode", front.url, "--decode-policy", "kv_aware",
                              "--health-interval", "0.3", "--host", "127.0.0.1", "--port", str(port)], proxy)
        wait_for("the proxy follows the instance's events through the relay",
                 lambda: fleet_entry(proxy, front.url).get("status") == "live")

        relay.fault = cycling_faults(every=2)  # every other message, each kind of fault in turn
        conversations = {w: f"Tell me about {w}, in the words of a poet who has seen them all her life." for w in WORDS[:4]}
        for turn in range(40):  # until every kind of fault was done (each turn stores blocks: a message or more)
            word = WORDS[turn % 4]
            history = conversations[word]
            r = httpx.post(proxy + "/v1/completions", timeout=120, json={
                "model": SMOLLM2, "prompt": history, "max_tokens": MAX_TOKENS, "temperature": 0})
            assert r.status_code == 200, r.text
            text = r.json()["choices"][0]["text"]
            assert text == reference(history), (turn, word)
            conversations[word] = history + text + f" And {WORDS[4 + turn % 6]}?"
            if len(relay.done) == len(FAULTS) and turn >= 3:
                break
        assert set(relay.done) == set(FAULTS), relay.done
        problems = fleet_entry(proxy, front.url)["problems"]
        for kind in ("gap", "undecodable", "frames", "sequence_frame", "duplicate", "unknown_event_type"):
            assert problems.get(kind, 0) >= 1, problems

        relay.fault = lambda seq: None  # the network heals: the index catches up through replay
        # Token-id prompts from here (no retokenised answers): each conversation's next turn, then the
        # turn after, once the index predicts for it exactly the full blocks of the last prompt and
        # answer; the instance must report that many cached tokens (the index holds what it holds).
        tok, bs = reference.loaded.tokenizer, contract["block_size"]
        more = tok.encode(" Once more.")
        sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
        before = prediction_errors(proxy)
        for history in conversations.values():
            ids = tok.encode(history)
            answer = reference.engine.generate([ids], sp)[0]
            assert complete_ids(proxy, ids)[0] == tok.decode(answer)
            following = ids + answer + more
            expect = (len(ids) + len(answer) - 1) // bs * bs
            wait_for("the index holds the last turn's blocks", lambda: predicted(proxy, following, front.url) == expect)
            text, cached = complete_ids(proxy, following)
            assert cached == expect and text == tok.decode(reference.engine.generate([following], sp)[0])
        total, exact = prediction_errors(proxy)
        assert total - before[0] == 2 * len(conversations) and exact - before[1] >= len(conversations)
        assert fleet.first_dead() is None  # nothing crashed
        assert_all_blocks_free([instance])
    finally:
        front.stop()
        relay.close()
