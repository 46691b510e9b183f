"""The kvbridge application on the session's Ray cluster of three nodes on this machine (every
one bound to 127.0.0.1; conftest.py): the router on the head, a prefill replica on the prefill node, two decode replicas
on the decode node (Ray custom resources). Greedy answers through the Ray router equal a
colocated instance's; a replica whose process is SIGKILLed under load is dropped by the router
and replaced by Ray, and no request is lost before its first byte; afterwards every KV block is
free on every replica. One deployment for the module (about 2-3 minutes to start on two loaded
cores); the colocated reference is the session's."""

from __future__ import annotations

import os
import signal
import time

import pytest
from openai import OpenAI

from kvbridge.ray import app
from tests.e2e.processes import metric
from tests.ray.cluster import (D_RESOURCE, MODEL, P_RESOURCE, Load, Pools, app_config, application,
                               assert_blocks_free, node_of, wait_router)

pytestmark = pytest.mark.timeout(900)
NAME = "kvbridge-pd"
MAX_TOKENS = 12
PROMPTS = ["Hello there", "The capital of France is", "def fibonacci(n):",
           ("The history of the Roman Empire spans many centuries, from the founding of the city to the fall of "
            "Constantinople. Summarise its three most important turning points, with a date for each:")]
CHATS = ["Name the capital of France.", "Name three primary colours."]


@pytest.fixture(scope="module")
def deployed(shared_ray, shared_colocated):
    reference = shared_colocated.get()
    with application(shared_ray, app_config(NAME, app.PoolSize(1, 1), app.PoolSize(2, 2))) as deployed:
        pools = deployed.pools
        pools.wait(lambda e: sizes(e) == SIZES, 60, "1 P and 2 D published")
        wait_router(NAME, lambda m: healthy(m) == SIZES, 30, "the router has 1 healthy P and 2 healthy D")
        yield deployed.cluster, deployed.url, reference, pools


SIZES = {"prefill": 1, "decode": 2}


def sizes(endpoints: dict) -> dict[str, int]:
    return {role: len(endpoints[role]) for role in ("prefill", "decode")}


def healthy(members: dict) -> dict[str, int]:
    """How many instances of each pool the router holds healthy."""
    return {role: len([u for u in members[role] if u["healthy"]]) for role in ("prefill", "decode")}


def complete(base: str, prompt: str, stream: bool) -> str:
    client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=300)
    if stream:
        chunks = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                           stream=True)
        return "".join(c.choices[0].text for c in chunks if c.choices)
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0).choices[0].text


def chat(base: str, content: str, stream: bool) -> str:
    client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=300)
    messages = [{"role": "user", "content": content}]
    if stream:
        chunks = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS,
                                                temperature=0, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS,
                                          temperature=0).choices[0].message.content


def engine_urls(pools: Pools) -> list[str]:
    return [e.url for role in ("prefill", "decode") for e in pools.endpoints[role]]


def test_p_and_d_on_their_nodes_answers_equal_colocated(deployed):
    cluster, url, reference, pools = deployed
    p_node, d_node = node_of(cluster, P_RESOURCE), node_of(cluster, D_RESOURCE)
    assert {e.node_id for e in pools.endpoints["prefill"]} == {p_node}
    assert {e.node_id for e in pools.endpoints["decode"]} == {d_node}
    want = {p: complete(reference, p, False) for p in PROMPTS}
    want_chat = {c: chat(reference, c, False) for c in CHATS}
    for stream in (False, True):
        for prompt in PROMPTS:
            assert complete(url, prompt, stream) == want[prompt], (prompt, stream)
        for content in CHATS:
            assert chat(url, content, stream) == want_chat[content], (content, stream)
    # The answers crossed P -> D as KV, and every lease P granted ended by a read, not by expiry.
    assert sum(metric(e.url, "kvbridge_kv_transfer_bytes_total") for e in pools.endpoints["decode"]) > 0
    assert_blocks_free(engine_urls(pools))
    assert [metric(e.url, "kvbridge_kv_expired_leases_total") for e in pools.endpoints["prefill"]] == [0]


def test_sigkill_a_p_engine_and_a_d_replica_under_load(deployed):
    """SIGKILL the prefill replica's engine process and one decode replica's Serve replica
    process (its engine follows) while 16 clients stream: the router drops both within its
    health interval (meanwhile the surviving D serves alone: the decode-only fallback), Ray
    starts replacements that take traffic once healthy, no request fails before its first byte, every finished answer equals the colocated one, and no block stays
    allocated on any replica."""
    _cluster, url, reference, pools = deployed
    want = {p: complete(reference, p, False) for p in PROMPTS}
    p_victim, d_victim = pools.endpoints["prefill"][0], pools.endpoints["decode"][0]
    victims = {p_victim.url, d_victim.url}
    with Load(url, PROMPTS, MAX_TOKENS) as load:
        load.wait_done(16, 300)
        os.kill(p_victim.pid, signal.SIGKILL)
        os.kill(d_victim.replica_pid, signal.SIGKILL)
        killed = time.monotonic()
        wait_router(NAME, lambda m: not any(u["healthy"] and u["url"] in victims for k in m.values()
                                            if isinstance(k, list) for u in k), 10, "the router drops both")
        dropped_s = time.monotonic() - killed
        after = pools.wait(lambda e: sizes(e) == SIZES and not {x.url for r in e.values() for x in r} & victims,
                           400, "Ray replaced both")
        wait_router(NAME, lambda m: healthy(m) == SIZES, 60, "the replacements are healthy in the router")
        replaced_s = time.monotonic() - killed
        done = len(load.results)
        load.wait_done(done + 32, 300)
    print(f"router dropped the victims after {dropped_s:.1f} s; Ray's replacements serving after {replaced_s:.0f} s; "
          f"{len(load.results)} answers")
    lost = [r for r in load.results if r[3] is not None and not r[2]]
    assert lost == [], f"requests lost before their first byte: {lost[:5]}"
    finished = [r for r in load.results if r[3] is None]
    assert [(p, t) for p, t, _, _ in finished if t != want[p]] == []
    cut = [r for r in load.results if r[3] is not None]
    assert len(cut) <= 16, f"more streams cut than were in flight on the killed D: {cut[:3]}"
    new_urls = [e.url for r in ("prefill", "decode") for e in after[r]]
    assert_blocks_free(new_urls, timeout_s=60)  # a lease whose reader died ends by expiry (30 s)


def test_the_router_bounds_a_request_header(deployed):
    """Issue 44: the Ray router speaks kvbridge's bounded HTTP protocol, as `kvbridge proxy` does: an
    oversized header is a 431 with OpenAI's body, and the router serves on."""
    import json
    import socket

    from kvbridge.http_protocol import MAX_HEADER_BYTES

    _, url, _, _ = deployed
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        try:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: t\r\nx-big: " + b"a" * (4 * MAX_HEADER_BYTES)
                         + b"\r\n\r\n")
        except OSError:  # refused and closed before all of it was written
            pass
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, body = answer.split(b"\r\n\r\n", 1)
    assert head.split()[1] == b"431" and json.loads(body)["error"]["code"] == "request_header_too_large", answer
    assert complete(url, PROMPTS[0], False)
