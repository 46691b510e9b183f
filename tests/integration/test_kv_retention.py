"""Retained answers (--kv-retention-seconds), on the real default model: a finished answer's cached
blocks (its conversation's history) stay referenced under a retention lease so that other traffic
does not evict them before the next turn; renewed while the conversation is used, ended when its
next answer is retained, under pressure, beyond the pool share, at a drain or reset, and by expiry
when the conversation goes quiet. Every block free in the end, no lease counted as expired."""

from __future__ import annotations

import time

import pytest

from kvbridge.config import KVRole
from kvbridge.engine.engine import LLMEngine
from kvbridge.engine.outputs import RequestOutput
from kvbridge.engine.sampling_params import SamplingParams
from kvbridge.engine.scheduler import MAX_HELD_FRACTION
from kvbridge.kv_transfer.backends.fake import FakeFabric
from kvbridge.kv_transfer.params import parse_kv_transfer_params
from tests.integration.api_instance import loaded  # noqa: F401
from tests.integration.pd_harness import make_engine, settle, tokens
from tests.unit.receiver_world import ManualClock

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
FIRST = list(range(500, 540))  # 2 full blocks + 8 tokens; with the answer 52 tokens: 3 full blocks
RETAIN_S = 100.0


def _run(engine: LLMEngine, rid: str, prompt: list[int], sp: SamplingParams = GREEDY,
         wire: dict | None = None) -> list[RequestOutput]:
    engine.add_request(rid, prompt, sp, parse_kv_transfer_params(wire) if wire else None)
    outs: list[RequestOutput] = []
    deadline = time.monotonic() + 60.0
    while time.monotonic() < deadline:
        outs += [o for o in engine.step().outputs if o.request_id == rid]
        if outs and outs[-1].finished:
            return outs
    raise TimeoutError(f"{rid} did not finish")


def _free(engine: LLMEngine) -> int:
    return engine.kv_cache_manager.num_free_blocks


def _all_free(engine: LLMEngine) -> None:
    settle(engine)
    assert _free(engine) == engine.kv_cache_manager.pool.num_usable_blocks
    assert len(engine.connectors.worker.leases) == 0


def _stats(engine: LLMEngine):
    return engine.connectors.worker.stats


@pytest.fixture
def fabric() -> FakeFabric:
    return FakeFabric(seed=11)


def _engine(loaded, fabric: FakeFabric, name: str, retention_s: float = RETAIN_S, num_blocks: int = 24,
            clock: ManualClock | None = None, role: KVRole = KVRole.BOTH) -> LLMEngine:
    return make_engine(loaded, role, fabric.create_agent(name), engine_id=name, num_blocks=num_blocks,
                       retention_s=retention_s, **({"clock": clock} if clock is not None else {}))


@pytest.fixture
def colocated(loaded):  # noqa: F811
    engine = make_engine(loaded, None)
    yield engine
    engine.shutdown()


def _flood(engine: LLMEngine, n: int, blocks: int = 8) -> None:
    """One-off prompts, one at a time, that cycle the whole pool through the LRU."""
    for i in range(n):
        start = 5000 + i * 300
        _run(engine, f"flood-{i}", list(range(start, start + blocks * 16 - 4)), SamplingParams(max_tokens=2))


@pytest.mark.parametrize("retention_s", [0.0, RETAIN_S])
def test_a_retained_history_survives_traffic_that_evicts_it_without_retention(loaded, fabric, colocated,
                                                                              retention_s):  # noqa: F811
    d = _engine(loaded, fabric, "D", retention_s)
    try:
        answer = tokens(_run(d, "turn-1", FIRST))
        pinned = (len(FIRST) + len(answer) - 1) // 16  # the full blocks whose KV was computed: 3
        assert _stats(d).retained_blocks() == (pinned if retention_s else 0)
        _flood(d, 6)  # 6 x 8 blocks through a 24-block pool: every unpinned cached block is evicted
        second = FIRST + answer + list(range(900, 930))
        outs = _run(d, "turn-2", second)
        assert outs[-1].num_cached_tokens == (pinned * 16 if retention_s else 0)
        assert tokens(outs) == colocated.generate([second], GREEDY)[0]
        if retention_s:
            # turn 2's answer is retained with every block of turn 1's: that one ends (superseded)
            assert d.lease_outcomes() == {"superseded": 1}
            assert _stats(d).retained_blocks() == (len(second) + GREEDY.max_tokens - 1) // 16
            assert _stats(d).retentions == 2 and _stats(d).retentions_renewed == 1  # turn 2's hit renewed it
        d.scheduler.end_retentions()
        _all_free(d)
        assert _stats(d).expired_leases == 0
    finally:
        d.shutdown()


def test_a_retention_renews_while_used_and_expires_when_the_conversation_goes_quiet(loaded, fabric):  # noqa: F811
    clock = ManualClock()
    d = _engine(loaded, fabric, "D", clock=clock)
    try:
        answer = tokens(_run(d, "turn-1", FIRST))
        history = FIRST + answer
        retained = _stats(d).retained_blocks()
        assert retained == 3 and not d.has_pending_work()  # a retention is no work for the loop
        clock.now += 0.6 * RETAIN_S
        held = d.hold_prefix(history + [7, 8])  # a reader wants the history: renewed
        assert held.num_tokens == 48 and d.release_kv(held.kv_transfer_params)
        settle(d)
        clock.now += 0.6 * RETAIN_S  # 1.2 periods after the answer, 0.6 after the hold
        d.step()  # (pops the first expiry's stale heap entry: the renewed retention lives on)
        assert _stats(d).retained_blocks() == 3 and not d.has_pending_work()
        # a request whose prefix-cache hit covers the history renews it too (a prompt-only check: max 1 token)
        assert _run(d, "peek", history + [9], SamplingParams(max_tokens=1))[-1].num_cached_tokens == 48
        clock.now += 0.6 * RETAIN_S
        d.step()
        assert _stats(d).retained_blocks() >= 3
        assert _stats(d).retentions_renewed == 2
        clock.now += RETAIN_S + 1  # quiet past the period: the next step frees everything
        assert d.has_pending_work()
        settle(d)
        assert _stats(d).retained_blocks() == 0
        outcomes = d.lease_outcomes()
        assert outcomes.get("retention_expired", 0) >= 1 and "expired" not in outcomes
        _all_free(d)
        assert _stats(d).expired_leases == 0
        assert d.hold_prefix(history + [7]).num_tokens == 48  # still cached, evictable as any block
    finally:
        settle(d)
        d.shutdown()


def test_a_retention_never_makes_a_request_wait_it_ends_under_pressure(loaded, fabric, colocated):  # noqa: F811
    d = _engine(loaded, fabric, "D", num_blocks=12)  # a quarter: 3 blocks, what turn 1 retains
    try:
        _run(d, "turn-1", FIRST)
        assert _stats(d).retained_blocks() == 3
        big = list(range(3000, 3000 + 10 * 16 - 8))  # 10 blocks: only 9 free while the retention pins 3
        outs = _run(d, "big", big, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        assert outs[-1].error is None
        assert tokens(outs) == colocated.generate([big], SamplingParams(max_tokens=8, temperature=0,
                                                                        ignore_eos=True))[0]
        assert d.lease_outcomes().get("pressure") == 1 and d.scheduler.num_preemptions == 0
        d.scheduler.end_retentions()
        _all_free(d)
    finally:
        d.shutdown()


def test_retentions_pin_at_most_their_share_of_the_pool_oldest_ending_first(loaded, fabric):  # noqa: F811
    d = _engine(loaded, fabric, "D", num_blocks=40)  # a quarter: 10 blocks, three conversations of 3
    try:
        share = int(MAX_HELD_FRACTION * d.kv_cache_manager.pool.num_usable_blocks)
        for i in range(5):
            _run(d, f"conv-{i}", list(range(1000 + 100 * i, 1040 + 100 * i)))
            assert _stats(d).retained_blocks() <= share
        assert _stats(d).retained_blocks() == 9 and d.lease_outcomes() == {"pressure": 2}
        # the two oldest ended: their histories are plain cached blocks now, the newest three retained
        ends = [1000 + 100 * i + 40 for i in range(5)]
        holds = [d.hold_prefix(list(range(e - 40, e)) + [1] * 13) for e in ends]
        assert [h.num_tokens for h in holds] == [32] * 5
        for h in holds:
            assert d.release_kv(h.kv_transfer_params)
        d.scheduler.end_retentions()
        _all_free(d)
    finally:
        d.shutdown()


def test_what_is_not_retained(loaded, fabric):  # noqa: F811
    consumer = _engine(loaded, fabric, "C", role=KVRole.CONSUMER)
    p = _engine(loaded, fabric, "P")
    off = _engine(loaded, fabric, "O", retention_s=0.0)
    try:
        _run(consumer, "c", FIRST)  # serves no reads: nothing to retain for
        _run(off, "o", FIRST)  # off
        out = _run(p, "p-leg", FIRST, SamplingParams(max_tokens=1, temperature=0), {"do_remote_decode": True})
        assert out[-1].kv_transfer_params is not None  # a P's prefill: leased for its reader, not retained
        assert p.release_kv(out[-1].kv_transfer_params)
        p.add_request("gone", FIRST + [1, 2], GREEDY)
        p.step()
        p.abort_request("gone")  # an aborted answer is no history a next turn sends
        for e in (consumer, p, off):
            assert e.connectors.worker.stats.retentions == 0
            _all_free(e)
    finally:
        for e in (consumer, p, off):
            e.shutdown()


def test_reset_and_drain_end_retentions(loaded, fabric):  # noqa: F811
    d = _engine(loaded, fabric, "D")
    try:
        _run(d, "turn-1", FIRST)
        assert _stats(d).retained_blocks() == 3
        d.reset_prefix_cache()  # its blocks could be found by no one: released
        assert _stats(d).retained_blocks() == 0 and d.lease_outcomes() == {"release": 1}
        _all_free(d)
    finally:
        d.shutdown()
