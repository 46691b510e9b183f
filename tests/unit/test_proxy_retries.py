"""The proxy never loses a request: retries of a failed prefill or decode leg on another
instance, the decode-only fallback, and each upstream's circuit breaker. Stand-in P and D
servers over real HTTP (tests/unit/proxy_upstreams.py)."""

from __future__ import annotations

import asyncio
import json
import random
import time

import pytest

from kvbridge.proxy.app import build_proxy_app
from kvbridge.proxy.proxy import RetryPolicy
from kvbridge.proxy.routing import BreakerState, CircuitBreaker
from tests.unit.proxy_cluster import COMPLETION, pd_cluster, received_by

pytestmark = pytest.mark.timeout(60)
ERROR = b'{"error": {"message": "engine failed", "type": "server_error", "code": 500}}'


def sent_params(instance) -> list[dict | None]:
    return [r.body.get("kv_transfer_params") for r in instance.received]


async def test_a_prefill_5xx_is_retried_on_another_prefill_and_the_client_never_sees_it():
    async with pd_cluster(num_prefill=2) as pd:
        pd.prefill[0].error = (500, ERROR)
        for _ in range(2):  # round robin after P 1 wraps to P 0: both requests start on the failing P
            r = await pd.http.post("/v1/completions", json=COMPLETION)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == "answer from decode-0"
        assert all(p["remote_engine_id"] == "prefill-1" for p in sent_params(pd.decode[0]))
        await pd.metrics_show('kvbridge_proxy_retries_total{kind="prefill",reason="status_500"} 2.0')


async def test_a_prefill_that_dies_mid_request_is_retried_on_another():
    async with pd_cluster(num_prefill=2) as pd:
        pd.prefill[0].hold.clear()  # P 0 takes the request and never answers...

        async def kill_p0_once_it_has_the_request():
            await received_by(pd.prefill[0])
            await pd.servers["prefill-0"].stop()  # ...then its server goes away mid-request
        stop = asyncio.create_task(kill_p0_once_it_has_the_request())
        r = await pd.http.post("/v1/completions", json=COMPLETION)
        await stop
        assert r.status_code == 200
        assert sent_params(pd.decode[0])[0]["remote_engine_id"] == "prefill-1"


async def test_a_prefill_4xx_is_the_request_s_fault_and_never_retried():
    async with pd_cluster(num_prefill=2) as pd:
        error = b'{"error": {"message": "prompt too long", "type": "BadRequestError", "code": 400}}'
        for p in pd.prefill:
            p.error = (400, error)
        r = await pd.http.post("/v1/completions", json=COMPLETION)
        assert (r.status_code, r.content) == (400, error)
        assert len(pd.prefill[0].received) + len(pd.prefill[1].received) == 1 and pd.decode[0].received == []


async def test_when_every_prefill_fails_decode_serves_alone_and_it_is_counted():
    async with pd_cluster(num_prefill=2) as pd:
        for p in pd.prefill:
            p.error = (503, ERROR)
        r = await pd.http.post("/v1/completions", json={**COMPLETION, "kv_transfer_params": {"x": 1}})
        assert r.status_code == 200
        assert sent_params(pd.decode[0]) == [None]  # an ordinary request: D prefills itself
        assert len(pd.prefill[0].received) == len(pd.prefill[1].received) == 1
        await pd.metrics_show("kvbridge_proxy_decode_only_fallback_total 1.0")


async def test_with_no_healthy_prefill_decode_serves_alone_unless_the_fallback_is_off():
    async with pd_cluster(health_interval_s=0.05) as pd:
        pd.prefill[0].healthy = False
        await pd.wait_health("prefill", 0, False)
        r = await pd.http.post("/v1/completions", json=COMPLETION)
        assert r.status_code == 200 and pd.prefill[0].received == [] and sent_params(pd.decode[0]) == [None]
    async with pd_cluster(health_interval_s=0.05, retry=RetryPolicy(decode_only_fallback=False)) as pd:
        pd.prefill[0].healthy = False
        await pd.wait_health("prefill", 0, False)
        r = await pd.http.post("/v1/completions", json=COMPLETION)
        assert r.status_code == 503 and pd.decode[0].received == []


async def test_a_decode_5xx_before_the_first_byte_is_retried_on_another_decode_with_the_same_params():
    async with pd_cluster(num_decode=2) as pd:
        pd.decode[0].error = (500, ERROR)
        r = await pd.http.post("/v1/completions", json={**COMPLETION, "stream": True})
        assert r.status_code == 200 and b"decode-1" in r.content and r.content.endswith(b"data: [DONE]\n\n")
        assert sent_params(pd.decode[0]) == sent_params(pd.decode[1])  # the same kv_transfer_params
        assert pd.prefill[0].releases == []  # P's blocks stay leased: D 1 reads them
        await pd.metrics_show('kvbridge_proxy_retries_total{kind="decode",reason="status_500"} 1.0')


async def test_a_decode_that_never_starts_its_stream_is_given_up_after_the_first_byte_timeout_and_retried():
    """A D that takes the request and never answers (as a SIGSTOPped one) held it for the whole
    --timeout; a streamed request's D sends its status line at admission, so a silent one is a
    failed attempt after --first-byte-timeout: retried on another D, held against its breaker."""
    async with pd_cluster(num_decode=2, timeout_s=120, first_byte_timeout_s=0.5, breaker_failures=1) as pd:
        pd.decode[0].hold.clear()
        started = time.monotonic()
        r = await pd.http.post("/v1/completions", json={**COMPLETION, "stream": True})
        assert r.status_code == 200 and b"decode-1" in r.content and r.content.endswith(b"data: [DONE]\n\n")
        assert time.monotonic() - started < 10  # pd.http's own timeout: far below --timeout
        assert sent_params(pd.decode[0]) == sent_params(pd.decode[1])  # the same kv_transfer_params
        await asyncio.wait_for(pd.decode[0].disconnected_while_held.wait(), 10)  # the proxy hung up on it
        assert pd.prefill[0].releases == []  # D 1 reads P's blocks
        assert (await pd.health())["decode"][0]["circuit"] == "open"
        await pd.metrics_show('kvbridge_proxy_retries_total{kind="decode",reason="first_byte_timeout"} 1.0')


async def test_the_first_byte_timeout_leaves_unstreamed_answers_alone():
    """D's answer to an unstreamed request starts when its generation ends: only --timeout bounds it."""
    async with pd_cluster(timeout_s=120, first_byte_timeout_s=0.3) as pd:
        pd.decode[0].hold.clear()
        unstreamed = asyncio.create_task(pd.http.post("/v1/completions", json=COMPLETION, timeout=60))
        await received_by(pd.decode[0])
        # Started after it, to the same D, a stream is given up after the first-byte timeout (no other D):
        streamed = await pd.http.post("/v1/completions", json={**COMPLETION, "stream": True})
        assert streamed.status_code == 504 and streamed.json()["error"]["code"] == "upstream_timeout"
        assert not unstreamed.done()  # waited longer than the first-byte timeout, still waiting
        pd.decode[0].hold.set()
        r = await unstreamed
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "answer from decode-0"


def test_first_byte_timeout_is_a_command_line_option_and_must_be_positive():
    from kvbridge.cli import build_parser
    parser = build_parser()
    assert parser.parse_args(["proxy", "--decode", "http://d"]).first_byte_timeout == 30.0
    assert parser.parse_args(["proxy", "--decode", "http://d", "--first-byte-timeout", "2.5"]).first_byte_timeout == 2.5
    with pytest.raises(ValueError):
        build_proxy_app([], ["http://d"], first_byte_timeout_s=0)


async def test_retries_are_bounded_by_count():
    async with pd_cluster(num_decode=3, retry=RetryPolicy(retries=1)) as pd:
        for d in pd.decode:
            d.error = (500, ERROR)
        r = await pd.http.post("/v1/completions", json=COMPLETION)
        assert r.status_code == 500 and r.content == ERROR
        assert sum(len(d.received) for d in pd.decode) == 2  # the first attempt and one retry


async def test_a_decode_failing_again_and_again_opens_its_circuit_then_a_probe_closes_it():
    async with pd_cluster(num_decode=2, decode_policy="round_robin", breaker_failures=2,
                          breaker_cooldown_s=0.3) as pd:
        now = [1000.0]  # the decode pool's time: the cool-down passes only when the test says so
        pd.proxy.decode.clock = lambda: now[0]
        pd.decode[0].error = (500, ERROR)
        for _ in range(4):
            assert (await pd.http.post("/v1/completions", json=COMPLETION)).status_code == 200
        assert len(pd.decode[0].received) == 2  # two failures opened it: skipped since
        health = await pd.health()
        assert health["decode"][0]["circuit"] == "open"
        await pd.metrics_show(f'kvbridge_proxy_circuit_state{{kind="decode",url="{pd.servers["decode-0"].url}"}} 2.0')
        pd.decode[0].error = None
        now[0] += 0.35  # the cool-down: the next requests probe decode-0 once
        for _ in range(2):
            assert (await pd.http.post("/v1/completions", json=COMPLETION)).status_code == 200
        assert len(pd.decode[0].received) == 3 and (await pd.health())["decode"][0]["circuit"] == "closed"


async def test_a_decode_that_could_not_load_the_kv_answers_the_client_and_stays_closed():
    """D's 500 with code kv_transfer_failed (load-failure policy "fail") is the request's failure:
    P released the KV, so no other D is tried, and D's breaker counts it as served."""
    kv_failed = (b'{"error": {"message": "KV transfer failed (transfer_state): the read failed. The request '
                 b'may be retried.", "type": "server_error", "param": null, "code": "kv_transfer_failed"}}')
    async with pd_cluster(num_decode=2, decode_policy="round_robin", breaker_failures=2) as pd:
        pd.decode[0].error = (500, kv_failed)
        answers = [await pd.http.post("/v1/completions", json=COMPLETION) for _ in range(6)]
        assert [(r.status_code, r.content) for r in answers[::2]] == [(500, kv_failed)] * 3
        assert all(r.status_code == 200 for r in answers[1::2])
        assert len(pd.decode[0].received) == 3 and len(pd.decode[1].received) == 3  # no retry, never skipped
        assert (await pd.health())["decode"][0]["circuit"] == "closed"


# ---- the breaker alone, on a clock of our own ---------------------------------------------

def test_breaker_opens_after_consecutive_failures_only():
    b = CircuitBreaker(failure_threshold=3, cooldown_s=10)
    b.record_failure(0)
    b.record_failure(1)
    b.record_success()  # not consecutive any more
    assert not b.record_failure(2) and not b.record_failure(3) and b.state is BreakerState.CLOSED
    assert b.record_failure(4) and b.state is BreakerState.OPEN and not b.allows(13.9)


def test_breaker_half_open_lets_one_probe_through_and_its_outcome_decides():
    b = CircuitBreaker(failure_threshold=1, cooldown_s=5)
    b.record_failure(0)
    assert b.allows(5) and b.state is BreakerState.HALF_OPEN
    b.on_send(5)
    assert not b.allows(6)  # one probe at a time
    assert b.record_failure(6) and b.state is BreakerState.OPEN and not b.allows(10)
    assert b.allows(11)
    b.on_send(11)
    b.record_success()
    assert b.state is BreakerState.CLOSED and b.allows(11)


def test_a_probe_that_never_reports_back_does_not_block_the_breaker_forever():
    b = CircuitBreaker(failure_threshold=1, cooldown_s=5)
    b.record_failure(0)
    assert b.allows(5)
    b.on_send(5)
    assert not b.allows(9) and b.allows(10)


def test_a_probe_that_could_not_be_sent_frees_the_half_open_slot_and_decides_nothing():
    b = CircuitBreaker(failure_threshold=1, cooldown_s=5)
    b.record_failure(0)
    assert b.allows(5)
    b.on_send(5)
    b.on_unsent()  # the request never left the proxy (it could not be sent): no verdict on the upstream
    assert b.state is BreakerState.HALF_OPEN and b.allows(6)


def test_backoff_is_full_jitter_doubling_up_to_the_cap():
    policy = RetryPolicy(backoff_s=0.1, backoff_max_s=0.5)
    rng = random.Random(0)
    for retry, cap in [(0, 0.1), (1, 0.2), (2, 0.4), (3, 0.5), (9, 0.5)]:
        delays = [policy.delay(retry, rng) for _ in range(200)]
        assert 0 <= min(delays) and max(delays) <= cap and max(delays) > cap / 2
    with pytest.raises(ValueError):
        RetryPolicy(retries=-1)


def test_the_proxy_command_line_takes_the_retry_and_breaker_options():
    from kvbridge.cli import build_parser
    a = build_parser().parse_args(["proxy", "--decode", "http://d", "--retries", "5", "--retry-budget", "9",
                                   "--no-decode-only-fallback", "--breaker-failures", "2", "--breaker-cooldown", "3"])
    assert (a.retries, a.retry_budget, a.no_decode_only_fallback, a.breaker_failures, a.breaker_cooldown) == (
        5, 9.0, True, 2, 3.0)
    assert json.dumps(vars(a), default=str)
