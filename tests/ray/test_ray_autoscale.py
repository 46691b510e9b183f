"""Autoscaling (policy.py through Serve's autoscaler): on the session's Ray cluster of three nodes
on this machine (conftest.py), each pool autoscaled between 1 and 2 replicas with low targets. A burst of long
prompts (one output token: the request ends at prefill) grows the prefill pool to its max while
the decode pool stays at one; a burst of long outputs grows the decode pool; both shrink back to
one when idle. Then both pools resized to 0:1 go to zero when idle and come back for the
requests that arrive, which wait (bounded) instead of failing. Waits are bounded polls of
Serve's status. Needs the instances' load (`GET /kvbridge/load`) and drain. About 6-9 minutes."""

from __future__ import annotations

import time

import pytest

from kvbridge.ray import app
from tests.e2e.processes import metric
from tests.ray.cluster import Load, app_config, application, assert_blocks_free

pytestmark = pytest.mark.timeout(1500)
NAME = "kvbridge-autoscale"
NOTES = " ".join(f"Note {i}: the shipment of crate {i} left the harbour at dawn and reached the warehouse by noon."
                 for i in range(24))
# Long prompts that share no prefix block (each starts differently): no prefix-cache hit shortens them.
LONG_PROMPTS = [f"Request {i} of the audit. Summarise these notes in one line. {NOTES}" for i in range(64)]
SHORT_PROMPTS = ["Tell me a long story about a dragon.", "Write a poem about the sea.", "Explain how rain forms."]
SCALE_FROM_ZERO_TIMEOUT_S = 300.0  # a replica's start on two loaded cores, with room
AUTOSCALING = app.Autoscaling(prefill_target_queued_tokens=256, prefill_target_wait_s=0.5, decode_target_running=4,
                              decode_target_kv_usage=0.9, metrics_interval_s=0.5, look_back_period_s=2.0,
                              upscale_delay_s=1.0, downscale_delay_s=15.0)


def running(role: str) -> int:
    """The pool's RUNNING replicas, as Serve reports them."""
    from ray import serve
    states = serve.status().applications[NAME].deployments[role].replica_states
    return sum(n for state, n in states.items() if str(state).endswith("RUNNING"))


def wait_sizes(want: dict[str, int], timeout_s: float, what: str, steady: dict[str, int] | None = None) -> None:
    """Poll Serve until the pools have `want` running replicas; `steady`: sizes that must hold
    the whole time."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = {role: running(role) for role in ("prefill", "decode")}
        for role, n in (steady or {}).items():
            assert now[role] == n, f"{role} left {n} replicas while waiting for {what}: {now}"
        if all(now[r] == n for r, n in want.items()):
            return
        assert time.monotonic() < deadline, f"not within {timeout_s:.0f} s: {what}; pools now {now}"
        time.sleep(0.5)


@pytest.fixture(scope="module")
def deployed(shared_ray):
    config = app_config(NAME, app.PoolSize(1, 2, True), app.PoolSize(1, 2, True), autoscaling=AUTOSCALING,
                        router={"scale_from_zero_timeout_s": SCALE_FROM_ZERO_TIMEOUT_S})
    with application(shared_ray, config) as deployed:
        yield deployed.url, deployed.pools


def test_prefill_grows_on_long_prompts_decode_on_long_outputs_both_shrink_when_idle(deployed):
    url, pools = deployed
    wait_sizes({"prefill": 1, "decode": 1}, 60, "the initial sizes")
    started = time.monotonic()
    with Load(url, LONG_PROMPTS, max_tokens=1, clients=16) as load:
        wait_sizes({"prefill": 2}, 300, "prefill grows on long prompts", steady={"decode": 1})
        prefill_up_s = time.monotonic() - started
    assert [r for r in load.results if r[3] is not None] == []
    started = time.monotonic()
    with Load(url, SHORT_PROMPTS, max_tokens=200, clients=16) as load:
        wait_sizes({"decode": 2}, 300, "decode grows on long outputs")
        decode_up_s = time.monotonic() - started
    assert [r for r in load.results if r[3] is not None] == []
    started = time.monotonic()
    wait_sizes({"prefill": 1, "decode": 1}, 300, "both shrink when idle")
    print(f"from the burst's start: prefill grew in {prefill_up_s:.0f} s, decode in {decode_up_s:.0f} s; both "
          f"shrank to one"
          f" {time.monotonic() - started:.0f} s after the last answer")
    pools.wait(lambda e: (len(e["prefill"]), len(e["decode"])) == (1, 1), 60, "the router's pools shrank")
    assert_blocks_free([e.url for r in pools.endpoints.values() for e in r])


def test_both_pools_come_back_from_zero_for_the_requests_that_wait(deployed):
    """Issue 44.2: pools with MIN 0 went to zero when idle and never came back (no replica, no
    load signal; every request got 503). Resized to 0:1 (no replica restarts), both go to zero
    when idle; then 2 clients stream: the first requests wait in the router, which wakes both
    pools through Serve; both come back, every request is answered (none refused), and the
    prefill pool serves again."""
    url, pools = deployed
    app.scale(NAME, app.PoolSize(0, 1, True), app.PoolSize(0, 1, True), timeout_s=600)
    wait_sizes({"prefill": 0, "decode": 0}, 180, "both pools at zero when idle")
    pools.wait(lambda e: (len(e["prefill"]), len(e["decode"])) == (0, 0), 60, "the router's pools are empty")
    started = time.monotonic()
    with Load(url, SHORT_PROMPTS, max_tokens=8, clients=2) as load:
        load.wait_done(1, SCALE_FROM_ZERO_TIMEOUT_S + 60)
        first_s = time.monotonic() - started
        up = pools.wait(lambda e: (len(e["prefill"]), len(e["decode"])) == (1, 1), 300, "both pools came back")
        back_s = time.monotonic() - started
        served = metric(up["prefill"][0].url, "kvbridge_prompt_tokens_total")
        load.wait_done(len(load.results) + 8, 300)
        assert metric(up["prefill"][0].url, "kvbridge_prompt_tokens_total") > served, "the prefill pool serves no request"
    print(f"from zero: first answer after {first_s:.0f} s, both pools back after {back_s:.0f} s; "
          f"{len(load.results)} answers")
    assert [r for r in load.results if r[3] is not None] == []
    # greedy: the answers while P was away (decode-only) equal those through P and D
    texts = {p: {t for q, t, _, _ in load.results if q == p} for p in SHORT_PROMPTS}
    assert [len(t) for t in texts.values()] == [1] * len(SHORT_PROMPTS), texts
