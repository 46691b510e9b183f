"""Both connector halves end to end, in process: P and D engines on the real default
model, the fake transfer backend (real copies, fault knobs) and the real side channel."""

import time

import pytest

from kvbridge.config import KVRole
from kvbridge.engine.engine import EngineRequestError
from kvbridge.engine.loader import load_model
from kvbridge.engine.sampling_params import SamplingParams
from kvbridge.kv_transfer.backends.fake import FakeFabric, FaultConfig
from kvbridge.kv_transfer.connector import worker_side
from kvbridge.kv_transfer.lease import content_digest
from kvbridge.kv_transfer.params import parse_kv_transfer_params
from tests.integration.pd_harness import decode, make_engine, prefill, settle, tokens

GREEDY = SamplingParams(max_tokens=8, temperature=0)


@pytest.fixture(scope="module")
def loaded():
    return load_model("SmolLM2-135M-Instruct")


@pytest.fixture(scope="module")
def colocated(loaded):
    return make_engine(loaded, None)


@pytest.fixture
def pd(loaded):
    fabric = FakeFabric(seed=1)
    p = make_engine(loaded, KVRole.PRODUCER, fabric.create_agent("P"), engine_id="P")
    d = make_engine(loaded, KVRole.CONSUMER, fabric.create_agent("D"), engine_id="D")
    yield fabric, p, d
    settle(p, d)
    p.shutdown()
    d.shutdown()


def prompt_of(loaded, text):
    tok = loaded.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))


@pytest.mark.parametrize("text", ["Hi", "Tell me about the history of Rome, its emperors and its roads."])
def test_pd_output_equals_colocated(loaded, colocated, pd, text):
    _, p, d = pd
    prompt = prompt_of(loaded, text) if len(text) > 2 else loaded.tokenizer.encode("Hi there")
    assert len(prompt) < 16 or len(prompt) > 32  # shorter than a block, or several blocks
    want = colocated.generate([prompt], GREEDY)[0]
    params = prefill(p, prompt)
    assert params["do_remote_prefill"] and params["remote_engine_id"] == "P"
    assert p.metrics().num_held_for_remote == 1
    assert tokens(decode(d, p, prompt, params, GREEDY)) == want
    settle(p, d)
    assert p.metrics().num_held_for_remote == 0  # freed on the read-done notification
    assert d.connectors.worker.stats.transfers == 1


def test_partial_prefix_hit_on_d_reads_only_missing_blocks(loaded, colocated, pd):
    _, p, d = pd
    prompt = prompt_of(loaded, "Explain how a compiler turns source code into machine code, step by step.")
    want = colocated.generate([prompt], GREEDY)[0]
    assert len(prompt) > 33  # three blocks or more
    assert d.generate([prompt[:20]], SamplingParams(max_tokens=1, temperature=0))  # D caches 1 block
    params = prefill(p, prompt)
    assert tokens(decode(d, p, prompt, params, GREEDY)) == want
    stats = d.connectors.worker.stats
    n_blocks = -(-len(prompt) // 16)
    block_bytes = d.connectors.worker.ranks[0].layout.block_len_bytes[0]
    assert stats.bytes == (n_blocks - 1) * block_bytes


def test_eight_concurrent_requests(loaded, colocated, pd):
    _, p, d = pd
    prompts = [prompt_of(loaded, f"Count from {i} to {i + 5}.") for i in range(8)]
    want = colocated.generate(prompts, GREEDY)
    params = [prefill(p, pr) for pr in prompts]
    for i, (pr, pa) in enumerate(zip(prompts, params)):
        d.add_request(f"c{i}", pr, GREEDY, parse_kv_transfer_params(pa))
    got = {f"c{i}": [] for i in range(8)}
    deadline = time.monotonic() + 120
    while d.has_unfinished_requests():
        assert time.monotonic() < deadline, "D did not finish the eight requests"
        for o in d.step().outputs:
            got[o.request_id] += o.new_token_ids
        p.step()
    assert [got[f"c{i}"] for i in range(8)] == want


def test_abort_before_scheduling_releases_p_blocks_at_once(loaded, pd):
    _, p, d = pd
    prompt = prompt_of(loaded, "Name a fruit.")
    params = prefill(p, prompt)
    d.add_request("x", prompt, GREEDY, parse_kv_transfer_params(params))
    d.abort_request("x")
    settle(p, d)
    assert p.metrics().num_held_for_remote == 0
    assert p.connectors.worker.stats.early_releases == 1


def test_rejected_request_notifies_p(loaded, pd):
    _, p, d = pd
    prompt = prompt_of(loaded, "Name a color.")
    params = prefill(p, prompt)
    d.notify_kv_transfer_rejected("rejected", parse_kv_transfer_params(params))
    settle(p, d)
    assert p.metrics().num_held_for_remote == 0 and p.connectors.worker.stats.early_releases == 1


def test_lease_expiry_frees_blocks_and_a_late_read_is_refused(loaded, colocated):
    fabric = FakeFabric(seed=3)
    p = make_engine(loaded, KVRole.PRODUCER, fabric.create_agent("P"), engine_id="P", lease_s=0.2)
    d = make_engine(loaded, KVRole.CONSUMER, fabric.create_agent("D"), engine_id="D")
    try:
        prompt = prompt_of(loaded, "Name a planet.")
        params = prefill(p, prompt)
        settle(p)  # nobody reads: the lease expires (settle returns once it has)
        assert p.connectors.worker.stats.expired_leases == 1 and p.metrics().num_held_for_remote == 0
        outs = decode(d, p, prompt, params, GREEDY)  # a late reader: refused, recomputed
        assert tokens(outs) == colocated.generate([prompt], GREEDY)[0]
        assert d.connectors.worker.stats.failed_transfers["stale_lease"] == 1
        assert p.connectors.worker.stats.refused_reads == 1
    finally:
        settle(p, d)
        p.shutdown()
        d.shutdown()


def test_untrusted_prefill_host_is_a_client_error(loaded, pd):
    _, p, d = pd
    prompt = prompt_of(loaded, "Hi")
    params = parse_kv_transfer_params({
        "do_remote_prefill": True, "remote_block_ids": [0, 1], "remote_engine_id": "P",
        "remote_request_id": "r", "remote_host": "8.8.8.8", "remote_port": 1234})
    with pytest.raises(EngineRequestError, match="trusted"):
        d.add_request("u", prompt, GREEDY, params)


class LeaseClock:
    """P's lease time, moved only by the test: how long a real step takes cannot matter."""

    def __init__(self) -> None:
        self.now = time.monotonic()

    def __call__(self) -> float:
        return self.now


class Renewals:
    """Wraps P's LeaseTable.renew (called on P's side-channel thread for each heartbeat) and
    records the lease time of the latest renewal that took effect."""

    def __init__(self, renew, clock: LeaseClock) -> None:
        self._renew, self._clock = renew, clock
        self.last_at = float("-inf")

    def __call__(self, request_id: str, generation: int) -> bool:
        at = self._clock.now  # read before renew reads it: renew's own time is never earlier
        renewed = self._renew(request_id, generation)
        if renewed:
            self.last_at = max(self.last_at, at)
        return renewed


def test_heartbeats_keep_a_waiting_requests_lease_alive(loaded, colocated):
    """D has no room for the remote request while a long local one runs, far past P's lease;
    D's heartbeats renew the lease, so the read still succeeds.

    No wall-clock margin: P's leases run on a clock the test moves. The test moves it by a
    third of a lease at a time (a renewal grants two thirds), and only once a heartbeat has
    renewed the lease at the current time; without heartbeats it waits for one in vain and
    fails, and were a renewal not to extend the lease it would expire. D runs one request at a
    time; the local one (1000 tokens, far more than the wait takes) is aborted once 2.5 leases
    have passed on P's clock, and only then can the remote request read."""
    fabric = FakeFabric(seed=4)
    lease = 0.3  # D heartbeats every sixth of its own --kv-lease-seconds (real time): configure it like P's
    wait_leases = 2.5
    p = make_engine(loaded, KVRole.PRODUCER, fabric.create_agent("P"), engine_id="P", lease_s=lease)
    d = make_engine(loaded, KVRole.CONSUMER, fabric.create_agent("D"), engine_id="D", lease_s=lease,
                    max_num_seqs=1)
    clock = LeaseClock()
    leases = p.connectors.worker.leases  # shared by both of P's connector halves and its control server
    leases._clock = clock  # LeaseTable takes a clock; build_connectors passes none
    renewals = leases.renew = Renewals(leases.renew, clock)
    try:
        d.add_request("hog", loaded.tokenizer.encode("word " * 20),
                      SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True))
        d.step()
        prompt = prompt_of(loaded, "Name a bird.")
        want = colocated.generate([prompt], GREEDY)[0]
        params = prefill(p, prompt)
        granted = clock.now
        d.add_request("remote", prompt, GREEDY, parse_kv_transfer_params(params))
        got = []

        def step_both() -> None:
            for o in d.step().outputs:
                assert o.request_id != "hog" or not o.finished or aborted, "the local request ended first"
                if o.request_id == "remote":
                    got.extend(o.new_token_ids)
            p.step()

        aborted = False
        while clock.now - granted < wait_leases * lease:
            deadline = time.monotonic() + 30
            while renewals.last_at < clock.now:  # until a heartbeat renewed the lease at this time
                assert time.monotonic() < deadline, "no heartbeat from D renewed the lease"
                step_both()
            clock.now += lease / 3
            p.step()  # P checks its leases at the new time
            assert p.connectors.worker.stats.expired_leases == 0, "the lease expired although D renewed it"
        d.abort_request("hog")  # only now may the remote request start its read
        aborted = True
        deadline = time.monotonic() + 120
        while d.has_unfinished_requests():
            assert time.monotonic() < deadline, "D did not finish"
            step_both()
        assert got == want
        assert p.connectors.worker.stats.expired_leases == 0 and d.connectors.worker.stats.transfers == 1
    finally:
        settle(p, d)
        p.shutdown()
        d.shutdown()


def test_full_prefix_hit_on_d_sends_only_a_release(loaded, colocated, pd):
    _, p, d = pd
    prompt = prompt_of(loaded, "Describe the water cycle in two sentences for a child.")
    want = colocated.generate([prompt], GREEDY)[0]
    d.generate([prompt], SamplingParams(max_tokens=1, temperature=0))  # D caches every full block
    params = prefill(p, prompt)
    assert tokens(decode(d, p, prompt, params, GREEDY)) == want
    settle(p, d)
    assert d.connectors.worker.stats.transfers == 0 and d.connectors.worker.stats.bytes == 0
    assert p.connectors.worker.stats.early_releases == 1 and p.metrics().num_held_for_remote == 0


def test_p_polls_promptly_only_for_reads_between_agents_not_yet_wired_up(loaded, colocated):
    """A read may need P's agents to progress while D's agents are not wired up to P's (NIXL
    without a progress thread): D's check_read asks P to step promptly (``connect``) until a
    read from P completed, and again after D dropped P's agents (here: a read timed out)."""
    fabric = FakeFabric(seed=3)
    p = make_engine(loaded, KVRole.PRODUCER, fabric.create_agent("P"), engine_id="P")
    d_agent = fabric.create_agent("D")
    d = make_engine(loaded, KVRole.CONSUMER, d_agent, engine_id="D", transfer_timeout_s=0.5)
    leases = p.connectors.worker.leases
    asked: list[bool] = []
    in_flight_after_check: list[bool] = []
    check_read = leases.check_read

    def recording_check_read(*args, watch: bool = True, **kwargs):
        refusal = check_read(*args, watch=watch, **kwargs)
        asked.append(watch)
        in_flight_after_check.append(leases.reads_in_flight(watched=True))
        return refusal
    leases.check_read = recording_check_read
    prompts = [prompt_of(loaded, f"Name {n} rivers of Europe.") for n in (2, 3, 4, 5, 6)]
    try:
        for prompt in prompts[:2]:
            params = prefill(p, prompt)
            assert tokens(decode(d, p, prompt, params, GREEDY)) == colocated.generate([prompt], GREEDY)[0]
            settle(p, d)
        assert asked == [True, False]
        assert in_flight_after_check == [True, False]  # only a watched read keeps P stepping promptly

        d_agent.set_faults(FaultConfig(delay_polls=10**9))  # the next read never completes
        params = prefill(p, prompts[2])
        outs = decode(d, p, prompts[2], params, GREEDY)  # times out, then recomputes (the policy)
        assert tokens(outs) == colocated.generate([prompts[2]], GREEDY)[0]
        assert d.connectors.worker.stats.failed_transfers.get("transfer_timeout") == 1
        assert asked == [True, False, False]
        settle(p, d)

        d_agent.set_faults(FaultConfig())
        params = prefill(p, prompts[3])
        assert tokens(decode(d, p, prompts[3], params, GREEDY)) == colocated.generate([prompts[3]], GREEDY)[0]
        assert asked == [True, False, False, True]  # the timed-out read dropped P's agents: connect again
        settle(p, d)

        params = prefill(p, prompts[4])
        assert tokens(decode(d, p, prompts[4], params, GREEDY)) == colocated.generate([prompts[4]], GREEDY)[0]
        assert asked == [True, False, False, True, False]  # wired up again: no pause makes it watched
        settle(p, d)
        assert p.metrics().num_held_for_remote == 0 and p.connectors.worker.stats.expired_leases == 0
    finally:
        leases.check_read = check_read
        p.shutdown()
        d.shutdown()


def test_p_polls_its_ranks_for_an_unwatched_read_only_once_it_is_overdue(loaded, pd, monkeypatch):
    """A read D did not ask P to watch (it read from P a moment ago) needs no progress from P's
    agents; P's ranks poll for it only once it has been in flight UNWATCHED_POLL_AFTER_S (a
    safety net), so that no round through P's processes takes CPU from the reader's copy. A
    watched read makes them poll at once."""
    _, p, _ = pd
    prompt = prompt_of(loaded, "Describe Porto in two sentences.")
    params = prefill(p, prompt)
    p.step()
    worker = p.connectors.worker
    assert not worker.needs_rank_poll()
    rid, gen = params["remote_request_id"], params["lease_generation"]
    blocks = parse_kv_transfer_params(params).remote_block_ids
    try:
        assert worker.leases.check_read(rid, gen, blocks, content_digest(prompt), watch=False) is None
        monkeypatch.setattr(worker_side, "UNWATCHED_POLL_AFTER_S", 3600.0)
        assert not worker.needs_rank_poll() and not worker.status().transfers_in_flight
        monkeypatch.setattr(worker_side, "UNWATCHED_POLL_AFTER_S", 0.0)  # every read is overdue
        assert worker.needs_rank_poll() and not worker.status().transfers_in_flight
        monkeypatch.setattr(worker_side, "UNWATCHED_POLL_AFTER_S", 3600.0)
        assert worker.leases.check_read(rid, gen, blocks, content_digest(prompt), watch=True) is None
        assert worker.needs_rank_poll() and worker.status().transfers_in_flight
    finally:
        assert worker.release_local(rid, gen)
    settle(p)
    assert not worker.needs_rank_poll() and p.metrics().num_held_for_remote == 0


def _count_runner_calls(engine) -> list:
    calls: list = []
    execute = engine.runner.execute

    def counting(sched):
        calls.append(sched)
        return execute(sched)
    engine.runner.execute = counting
    return calls


def test_the_ranks_run_only_for_tokens_commands_or_reads_that_need_polling(loaded, colocated, pd):
    """At TP N every runner call is a round through N + 1 processes. A P holding a lease steps
    to advance it without its ranks; they run while a read of its blocks is granted (it may
    need their agents' progress), and a D's ranks run for its reads, not while it waits for
    P's answers."""
    _, p, d = pd
    p_calls, d_calls = _count_runner_calls(p), _count_runner_calls(d)
    prompt = prompt_of(loaded, "Describe Lisbon in two sentences.")

    params = prefill(p, prompt)
    p.step()  # the step after a prefill tells the runner to forget the finished request
    held = len(p_calls)
    for _ in range(5):
        p.step()
    assert len(p_calls) == held and p.metrics().num_held_for_remote == 1  # the lease alone: no rank work
    assert tokens(decode(d, p, prompt, params, GREEDY)) == colocated.generate([prompt], GREEDY)[0]
    assert len(p_calls) > held  # the granted read: P's ranks polled their agents
    settle(p, d)
    assert p.metrics().num_held_for_remote == 0
    # D's runner ran for its read and its tokens only, never for a step that waited on P's
    # handshake or check_read answer (the fake read completes at its first poll, in the step
    # that started it, so no step was needed to poll it either).
    assert d_calls and not [c for c in d_calls if not (c.scheduled or c.finished_req_ids or c.kv_rank_commands)]
    p.step(), d.step()  # the runners forget the finished requests
    done = len(p_calls), len(d_calls)
    for _ in range(5):
        p.step()
        d.step()
    assert (len(p_calls), len(d_calls)) == done  # nothing to do: neither engine's ranks run
