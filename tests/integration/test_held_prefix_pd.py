"""KV reuse across turns and instances, on the real default model: a conversation's next turn reads the
history's KV from the instance that answered it (its prefix cache, held under a lease:
LLMEngine.hold_prefix) instead of computing it again.

P and D are engines of role "both" in this process: D serves reads of what it holds, P reads a held
prefix and prefills the new tokens for D. Turn 2's answer is the colocated engine's; P computes only
the new tokens; D reads only the blocks it lacks from P; every lease ends and every block is free.
Faults: the holder's read fails (P recomputes, right answer), the hold is released unread, expires,
or names a prefix the reader already has."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from kvbridge.config import KVRole, LoadFailurePolicy
from kvbridge.engine.engine import EngineRequestError, LLMEngine
from kvbridge.engine.outputs import RequestOutput
from kvbridge.engine.sampling_params import SamplingParams
from kvbridge.engine.scheduler import MAX_HELD_FRACTION
from kvbridge.kv_transfer.backends.fake import FakeFabric, FaultConfig
from kvbridge.kv_transfer.params import KVTransferParams, parse_kv_transfer_params, to_wire
from tests.integration.api_instance import loaded  # noqa: F401
from tests.integration.pd_harness import decode, make_engine, settle, tokens

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
FIRST = list(range(500, 540))  # 2 full blocks + 8 tokens


def _run(engine: LLMEngine, others: tuple[LLMEngine, ...], rid: str, timeout_s: float = 60.0) -> list[RequestOutput]:
    """Step `engine` (and `others`: the holder serves the reads) until `rid` finishes."""
    outs: list[RequestOutput] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        outs += [o for o in engine.step().outputs if o.request_id == rid]
        for other in others:
            other.step()
        if outs and outs[-1].finished:
            return outs
    raise TimeoutError(f"{rid} did not finish")


def _prefill(p: LLMEngine, prompt: list[int], rid: str, held: KVTransferParams | None = None,
             holder: tuple[LLMEngine, ...] = ()) -> RequestOutput:
    wire = {"do_remote_decode": True}
    if held is not None:
        wire = {**to_wire(held), "do_remote_decode": True}
    p.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0), parse_kv_transfer_params(wire))
    return _run(p, holder, rid)[-1]


def _all_free(*engines: LLMEngine) -> None:
    settle(*engines)
    for e in engines:
        assert e.kv_cache_manager.num_free_blocks == e.kv_cache_manager.pool.num_usable_blocks
        assert len(e.connectors.worker.leases) == 0


@pytest.fixture
def colocated(loaded):  # noqa: F811
    engine = make_engine(loaded, None)
    yield engine
    engine.shutdown()


def _turn_one(p: LLMEngine, d: LLMEngine) -> list[int]:
    """Turn 1 through P then D: D now holds the prompt's and the answer's full blocks. Returns turn 2's
    prompt: the history (prompt + answer) and new tokens."""
    p_out = _prefill(p, FIRST, "p-1")
    answer = tokens(decode(d, p, FIRST, to_wire(p_out.kv_transfer_params), GREEDY, request_id="d-1"))
    assert len(answer) == GREEDY.max_tokens
    settle(p, d)
    return FIRST + answer + list(range(900, 930))


@contextmanager
def _pair(loaded, backend: str = "fake", p_policy: LoadFailurePolicy = LoadFailurePolicy.RECOMPUTE,
          lease_s: float = 30.0) -> Iterator[tuple[FakeFabric | None, LLMEngine, LLMEngine]]:
    """P and D of role both, over NIXL or the fake backend (its fabric, for faults); settled and shut down after."""
    fabric = None
    if backend == "nixl":
        pytest.importorskip("nixl._api")
        p = make_engine(loaded, KVRole.BOTH, backend_name="nixl", engine_id="P", policy=p_policy, lease_s=lease_s)
        d = make_engine(loaded, KVRole.BOTH, backend_name="nixl", engine_id="D", lease_s=lease_s)
    else:
        fabric = FakeFabric(seed=3)
        p = make_engine(loaded, KVRole.BOTH, fabric.create_agent("P"), engine_id="P", policy=p_policy, lease_s=lease_s)
        d = make_engine(loaded, KVRole.BOTH, fabric.create_agent("D"), engine_id="D", lease_s=lease_s)
    try:
        yield fabric, p, d
    finally:
        settle(p, d)
        p.shutdown()
        d.shutdown()


@pytest.mark.parametrize("backend", ["nixl", "fake"])
def test_turn_two_reads_the_history_from_the_decode_instance_and_p_computes_only_new_tokens(
        loaded, colocated, backend):  # noqa: F811
    with _pair(loaded, backend) as (_, p, d):
        bs = d.block_size
        second = _turn_one(p, d)
        p.reset_prefix_cache()  # P holds nothing of the history: without D it would compute all of it
        held = d.hold_prefix(second)
        history = (len(FIRST) + GREEDY.max_tokens) // bs * bs  # D cached the history's full blocks
        assert held.num_tokens == history and held.kv_transfer_params is not None
        assert held.kv_transfer_params.remote_prefix_tokens == history
        assert len(d.connectors.worker.leases) == 1

        p_out = _prefill(p, second, "p-2", held.kv_transfer_params, (d,))
        assert p_out.error is None
        # P read the history and computed the new tokens only; it computed none of the history
        assert (p_out.num_cached_tokens, p_out.num_loaded_tokens) == (0, history)
        assert p_out.num_reused_tokens == history
        d_outs = decode(d, p, second, to_wire(p_out.kv_transfer_params), GREEDY, request_id="d-2")
        # D hit the history in its own cache and read only the new blocks from P
        assert (d_outs[-1].num_cached_tokens, d_outs[-1].num_loaded_tokens) == (history, len(second) - 1 - history)
        assert d_outs[-1].num_reused_tokens == history
        assert tokens(d_outs) == colocated.generate([second], GREEDY)[0]
        assert d.lease_outcomes().get("read_done") == 1  # the hold ended when P had read it
        _all_free(p, d)


def test_a_failed_read_of_the_held_prefix_is_recomputed_with_the_right_answer(loaded, colocated):  # noqa: F811
    # policy fail is for KV only another instance computed; a held prefix's failed read is recomputed
    with _pair(loaded, p_policy=LoadFailurePolicy.FAIL) as (fabric, p, d):
        assert fabric is not None
        second = _turn_one(p, d)
        p.reset_prefix_cache()
        held = d.hold_prefix(second)
        assert held.kv_transfer_params is not None
        fabric.lookup("P").set_faults(FaultConfig(error_state=True))  # P's read of D's blocks fails
        p_out = _prefill(p, second, "p-2", held.kv_transfer_params, (d,))
        assert p_out.error is None and p_out.num_loaded_tokens == 0  # recomputed, whatever the policy
        fabric.lookup("P").set_faults(FaultConfig())
        d_outs = decode(d, p, second, to_wire(p_out.kv_transfer_params), GREEDY, request_id="d-2")
        assert tokens(d_outs) == colocated.generate([second], GREEDY)[0]
        _all_free(p, d)


@pytest.mark.parametrize("when, ended", [("reading", "read_done"), ("queued", "release")])
def test_the_client_leaving_while_p_reads_the_held_prefix_ends_the_hold_and_frees_both(
        loaded, when, ended):  # noqa: F811
    """P's request aborted while its read of D's held blocks is in flight, or before it was scheduled:
    no lease is left to expire on D, every block is back on both, and both serve the next turn."""
    with _pair(loaded) as (fabric, p, d):
        assert fabric is not None
        second = _turn_one(p, d)
        p.reset_prefix_cache()
        held = d.hold_prefix(second)
        assert held.kv_transfer_params is not None
        fabric.lookup("P").set_faults(FaultConfig(hold_reads=True))
        p.add_request("p-2", second, SamplingParams(max_tokens=1, temperature=0),
                      parse_kv_transfer_params({**to_wire(held.kv_transfer_params), "do_remote_decode": True}))
        if when == "reading":
            deadline = time.monotonic() + 30
            while not p.worker_status().transfers_in_flight:  # P's read of D's blocks started, held in flight
                assert time.monotonic() < deadline, "P never started reading the held prefix"
                p.step()
                d.step()
        p.abort_request("p-2")
        fabric.lookup("P").set_faults(FaultConfig())
        settle(p, d)
        # never left to expire: a read in flight settles (its blocks are freed only then), a queued one releases
        assert d.lease_outcomes() == {ended: 1}
        _all_free(p, d)
        p_out = _prefill(p, second, "p-3", d.hold_prefix(second).kv_transfer_params, (d,))  # both serve on
        assert p_out.error is None and p_out.num_loaded_tokens > 0
        assert p.release_kv(p_out.kv_transfer_params)  # no D for it: P's own lease released
        _all_free(p, d)


def test_a_hold_ends_by_release_or_expiry_and_frees_nothing_the_cache_still_needs(loaded):  # noqa: F811
    with _pair(loaded, lease_s=2.0) as (_, p, d):
        second = _turn_one(p, d)
        held = d.hold_prefix(second)
        assert held.kv_transfer_params is not None
        assert d.release_kv(held.kv_transfer_params)  # the proxy found no reader: released at once
        assert not d.release_kv(held.kv_transfer_params)  # idempotent
        _all_free(d)
        again = d.hold_prefix(second)  # released blocks stay cached: held again
        assert again.num_tokens == held.num_tokens
        settle(d, timeout_s=10.0)  # nobody reads it: the lease expires
        assert d.lease_outcomes().get("expired") == 1
        _all_free(p, d)
        last = d.hold_prefix(second)  # still cached after the expiry
        assert last.num_tokens == held.num_tokens and d.release_kv(last.kv_transfer_params)
        assert d.release_kv(d.hold_prefix(list(range(2000, 2100))).kv_transfer_params) is False  # nothing cached
        _all_free(p, d)


def test_hold_refusals(loaded):  # noqa: F811
    fabric = FakeFabric(seed=6)
    consumer = make_engine(loaded, KVRole.CONSUMER, fabric.create_agent("C"), engine_id="C")
    both = make_engine(loaded, KVRole.BOTH, fabric.create_agent("B"), engine_id="B")
    try:
        consumer.generate([FIRST], SamplingParams(max_tokens=1))
        both.generate([FIRST], SamplingParams(max_tokens=1))
        # a consumer serves no reads: nothing held, nothing referenced
        assert consumer.hold_prefix(FIRST + [1]).kv_transfer_params is None
        held = both.hold_prefix(FIRST + [1])
        assert held.num_tokens == 32
        assert both.hold_prefix(FIRST[:16]).num_tokens == 0  # a one-block prompt: nothing before its last token
        for bad in ([], [-1], [10**9]):
            with pytest.raises(EngineRequestError):
                both.hold_prefix(bad)
        # a reader refuses a prefix that is not whole blocks below its prompt
        wire = to_wire(held.kv_transfer_params)
        for n in (31, 48):
            params = parse_kv_transfer_params({**wire, "remote_prefix_tokens": n})
            with pytest.raises(EngineRequestError, match="remote_prefix_tokens"):
                both.add_request(f"bad-{n}", FIRST, SamplingParams(max_tokens=1), params)
        assert both.release_kv(held.kv_transfer_params)
        settle(both)  # a released hold's blocks go back at the next step
        # holds pin at most a quarter of the pool together (counted per hold): a client asking for
        # more keeps nothing from being evicted
        holds = []
        while (more := both.hold_prefix(FIRST + [1])).kv_transfer_params is not None:
            holds.append(more.kv_transfer_params)
        usable = both.kv_cache_manager.pool.num_usable_blocks
        assert len(holds) == int(MAX_HELD_FRACTION * usable) // 2  # two blocks each
        assert both.release_kv(holds.pop())
        both.step()  # the released hold's blocks go back (the others stay held)
        again = both.hold_prefix(FIRST + [1])  # room for one again
        assert again.num_tokens == 32 and again.kv_transfer_params is not None
        for params in [*holds, again.kv_transfer_params]:
            assert both.release_kv(params)
        _all_free(consumer, both)
    finally:
        settle(consumer, both)
        consumer.shutdown()
        both.shutdown()


def test_a_hold_never_makes_the_holders_own_requests_wait_it_ends_under_pressure(loaded, colocated):  # noqa: F811
    """A holder whose pool is short of blocks ends the held prefix nobody reads yet (lease outcome
    pressure) instead of queueing or preempting its own request; the reader that comes later fails its
    read and recomputes the history: the right answer, every block free."""
    fabric = FakeFabric(seed=9)
    p = make_engine(loaded, KVRole.BOTH, fabric.create_agent("P"), engine_id="P")
    # a lease far longer than the test: only pressure can end the hold in time
    d = make_engine(loaded, KVRole.BOTH, fabric.create_agent("D"), engine_id="D", num_blocks=12, lease_s=600.0)
    try:
        second = _turn_one(p, d)  # D caches 3 full blocks of history (52 tokens): the hold pins 3 of 12
        p.reset_prefix_cache()
        held = d.hold_prefix(second)
        assert held.kv_transfer_params is not None and held.num_tokens == 48
        # 10 blocks: only 9 are free while the hold pins 3; without ending it this request would wait forever
        big = list(range(3000, 3000 + 10 * 16 - 8))
        d.add_request("big", big, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        outs = _run(d, (), "big", timeout_s=30.0)
        assert outs[-1].error is None and len(tokens(outs)) == 8
        assert d.lease_outcomes() == {"pressure": 1}
        assert d.connectors.worker.stats.holds_ended_under_pressure == 1
        p_out = _prefill(p, second, "p-2", held.kv_transfer_params, (d,))  # the hold is gone: P recomputes
        assert p_out.error is None and p_out.num_loaded_tokens == 0
        d_outs = decode(d, p, second, to_wire(p_out.kv_transfer_params), GREEDY, request_id="d-2")
        assert tokens(d_outs) == colocated.generate([second], GREEDY)[0]
        _all_free(p, d)
    finally:
        settle(p, d)
        p.shutdown()
        d.shutdown()
