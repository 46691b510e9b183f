"""P's lease table and the control messages that act on it, over a real side channel."""

from __future__ import annotations

import json

import pytest

from kvbridge.kv_transfer.side_channel.control import ControlClient, ControlServer
from kvbridge.kv_transfer.side_channel.handshake import HandshakeError
from kvbridge.kv_transfer.lease import LeaseOutcome, LeaseTable, Refusal, content_digest
from kvbridge.kv_transfer.side_channel.server import SideChannelServer

BLOCKS = ([3, 4, 5],)
PROMPT = content_digest(list(range(1, 34)))  # 33 tokens: three blocks of 16
OTHER_PROMPT = content_digest([*range(1, 33), 34])  # differs in the last token only


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def table() -> tuple[LeaseTable, Clock]:
    clock = Clock()
    t = LeaseTable(30.0, clock=clock, read_watch_s=5.0)
    t.grant("r1", BLOCKS, 7, PROMPT)
    return t, clock


def test_a_held_lease_is_not_a_read_in_flight(table) -> None:
    t, _ = table
    assert "r1" in t and not t.reads_in_flight()


def test_a_granted_read_is_in_flight_until_the_lease_is_released(table) -> None:
    t, _ = table
    assert t.check_read("r1", 7, ([4, 5],), PROMPT) is None
    assert t.reads_in_flight()
    assert t.release("r1", 7)
    assert not t.reads_in_flight()


def test_an_unwatched_read_is_in_flight_but_not_watched(table) -> None:
    t, clock = table
    clock.now += 29.0
    assert t.check_read("r1", 7, BLOCKS, PROMPT, watch=False) is None
    assert t.reads_in_flight() and not t.reads_in_flight(watched=True)
    clock.now += 19.0
    assert t.pop_expired() == []  # renewed like a watched read
    assert t.release("r1", 7)
    assert not t.reads_in_flight()


def test_a_watched_read_is_in_flight_both_ways_until_it_ends(table) -> None:
    t, clock = table
    assert t.check_read("r1", 7, BLOCKS, PROMPT, watch=True) is None
    assert t.reads_in_flight() and t.reads_in_flight(watched=True)
    clock.now += 5.1  # past read_watch_s
    assert not t.reads_in_flight() and not t.reads_in_flight(watched=True)


@pytest.mark.parametrize("watch", [False, True])
def test_a_read_counts_with_a_minimum_age_once_it_is_that_old(table, watch) -> None:
    t, clock = table
    assert t.check_read("r1", 7, BLOCKS, PROMPT, watch=watch) is None
    assert t.reads_in_flight(min_age_s=0.0) and not t.reads_in_flight(min_age_s=0.02)
    assert t.reads_in_flight(watched=True, min_age_s=0.0) is watch
    clock.now += 0.019
    assert not t.reads_in_flight(min_age_s=0.02)
    clock.now += 0.002
    assert t.reads_in_flight(min_age_s=0.02) and t.reads_in_flight(watched=True, min_age_s=0.02) is watch
    clock.now += 5.0  # past read_watch_s: no longer in flight at any age
    assert not t.reads_in_flight(min_age_s=0.02) and not t.reads_in_flight()


def test_a_second_check_read_restarts_the_age(table) -> None:
    t, clock = table
    assert t.check_read("r1", 7, BLOCKS, PROMPT, watch=False) is None
    clock.now += 1.0
    assert t.reads_in_flight(min_age_s=0.5)
    assert t.check_read("r1", 7, BLOCKS, PROMPT, watch=False) is None
    assert not t.reads_in_flight(min_age_s=0.5) and t.reads_in_flight()


@pytest.mark.parametrize("rid, gen, blocks", [("r1", 8, BLOCKS), ("r2", 7, BLOCKS), ("r1", 7, ([9],)),
                                              ("r1", 7, ([3, 3, 3],)), ("r1", 7, ([5, 4, 3],))])
def test_a_refused_read_is_not_in_flight(table, rid, gen, blocks) -> None:
    t, _ = table
    assert t.check_read(rid, gen, blocks, PROMPT) is not None
    assert not t.reads_in_flight()


def test_a_read_that_never_reports_done_stops_counting_after_the_watch(table) -> None:
    t, clock = table
    t.check_read("r1", 7, BLOCKS, PROMPT)
    clock.now += 4.9
    assert t.reads_in_flight()
    clock.now += 0.2
    assert not t.reads_in_flight()
    assert "r1" in t  # the lease itself runs on until release or expiry


def test_an_expired_lease_ends_its_read(table) -> None:
    t, clock = table
    t2 = LeaseTable(1.0, clock=clock, read_watch_s=50.0)
    t2.grant("r", BLOCKS, 1, PROMPT)
    t2.check_read("r", 1, BLOCKS, PROMPT)
    clock.now += 2.0
    assert t2.pop_expired() == ["r"]
    assert not t2.reads_in_flight()


def test_check_read_renews_and_heartbeat_renewal_is_bounded(table) -> None:
    t, clock = table
    clock.now += 29.0
    assert t.check_read("r1", 7, BLOCKS, PROMPT) is None  # renewed to now + 20 s
    clock.now += 19.0
    assert t.pop_expired() == []
    clock.now += 2.0
    assert t.pop_expired() == ["r1"]


@pytest.fixture
def control():
    leases = LeaseTable(30.0)
    with SideChannelServer({0: b"{}"}, "127.0.0.1") as server:
        cs = ControlServer(server, leases)
        yield cs, leases, server.port


@pytest.mark.parametrize("connect", [True, False])
def test_a_granted_check_read_wakes_the_engine_once_if_the_reader_is_connecting(control, connect) -> None:
    """connect=False: the reader read from P a moment ago; P's ranks still poll while the read
    is in flight, but P's loop is neither woken nor kept stepping promptly."""
    cs, leases, port = control
    woken = []
    leases.on_read_granted = lambda: woken.append(1)
    cs.incarnation = "inc-1"
    leases.grant("r1", BLOCKS, 7, PROMPT)
    client = ControlClient(timeout_s=2.0)
    with pytest.raises(HandshakeError):  # stale generation: refused, no wake
        client.check_read("127.0.0.1", port, "r1", 6, BLOCKS, PROMPT, connect=connect)
    assert woken == [] and not leases.reads_in_flight()
    assert client.check_read("127.0.0.1", port, "r1", 7, BLOCKS, PROMPT, connect=connect) == "inc-1"
    assert woken == ([1] if connect else []) and leases.reads_in_flight()
    assert leases.reads_in_flight(watched=True) is connect
    client.release("127.0.0.1", port, "r1", 7)
    assert not leases.reads_in_flight() and leases.drain_released() == ["r1"]


@pytest.mark.parametrize("connect", ["yes", 1, None])
def test_a_check_read_whose_connect_is_not_a_boolean_is_refused(control, connect) -> None:
    cs, leases, port = control
    leases.grant("r1", BLOCKS, 7, PROMPT)
    body = json.dumps({"rid": "r1", "gen": 7, "blocks": [list(g) for g in BLOCKS], "content": PROMPT,
                       "connect": connect}).encode()
    with pytest.raises(HandshakeError, match="connect must be a boolean"):
        ControlClient(timeout_s=2.0)._client.request("127.0.0.1", port, "kv_check_read", body, 2.0)
    assert not leases.reads_in_flight()


def test_a_failing_wake_hook_does_not_refuse_the_read(control) -> None:
    cs, leases, port = control

    def broken() -> None:
        raise RuntimeError("boom")
    leases.on_read_granted = broken
    leases.grant("r1", BLOCKS, 7, PROMPT)
    assert ControlClient(timeout_s=2.0).check_read("127.0.0.1", port, "r1", 7, BLOCKS, PROMPT) == ""
    assert leases.reads_in_flight()


def test_content_digest_tells_prompts_apart() -> None:
    assert content_digest([1, 2, 3]) == content_digest([1, 2, 3])
    assert len({content_digest(t) for t in ([1, 2, 3], [1, 2], [3, 2, 1], [1, 2, 3, 0], [2**32 - 1], [])}) == 6


@pytest.mark.parametrize("blocks, granted", [
    (([3, 4, 5],), True), (([4, 5],), True), (([5],), True), (([],), True),  # the sequence or a suffix
    (([3, 3, 3],), False), (([5, 5, 5],), False), (([5, 4, 3],), False), (([3, 4],), False),  # repeats,
    (([4, 5, 5],), False), (([3, 4, 5, 5],), False), (([2, 3, 4, 5],), False),  # order, prefix, extra
    (([3, 4, 5], []), False),  # another group count
])
def test_a_read_must_name_exactly_the_granted_sequence_or_its_suffix(table, blocks, granted) -> None:
    t, _ = table
    refusal = t.check_read("r1", 7, blocks, PROMPT)
    assert (refusal is None) == granted
    if not granted:
        assert refusal.kind is Refusal.BLOCKS and "r1" in t  # refused, the lease holds on


def test_a_read_for_another_prompt_is_refused_and_ends_the_lease(table) -> None:
    t, _ = table
    refusal = t.check_read("r1", 7, BLOCKS, OTHER_PROMPT)
    assert refusal is not None and refusal.kind is Refusal.CONTENT
    assert "r1" not in t and not t.reads_in_flight() and t.held_blocks() == 0


def test_a_second_lease_on_a_held_request_id_is_refused(table) -> None:
    t, _ = table
    with pytest.raises(ValueError, match="already holds a lease"):
        t.grant("r1", ([8, 9],), 8, PROMPT)
    assert t.check_read("r1", 7, BLOCKS, PROMPT) is None  # the first lease still holds its blocks


def test_a_content_mismatch_over_the_side_channel_frees_the_blocks_and_is_counted(control) -> None:
    cs, leases, port = control
    leases.grant("r1", BLOCKS, 7, PROMPT)
    with pytest.raises(HandshakeError, match="content mismatch"):
        ControlClient(timeout_s=2.0).check_read("127.0.0.1", port, "r1", 7, BLOCKS, OTHER_PROMPT)
    assert leases.drain_released() == ["r1"] and "r1" not in leases
    assert leases.stats.content_mismatches == 1 and leases.stats.refused_reads == 1


def test_a_check_read_without_a_content_digest_is_refused(control) -> None:
    cs, leases, port = control
    leases.grant("r1", BLOCKS, 7, PROMPT)
    with pytest.raises(HandshakeError, match="content"):
        ControlClient(timeout_s=2.0)._client.request(
            "127.0.0.1", port, "kv_check_read", b'{"rid": "r1", "gen": 7, "blocks": [[3, 4, 5]]}', 2.0)
    assert "r1" in leases and not leases.reads_in_flight()


def test_a_lease_with_p_s_tokens_accepts_exactly_that_continuation_too() -> None:
    t = LeaseTable(30.0, clock=Clock(), read_watch_s=5.0)
    prompt = list(range(1, 34))
    t.grant("r1", BLOCKS, 7, content_digest(prompt), content_digest(prompt + [99]))
    assert t.check_read("r1", 7, BLOCKS, content_digest(prompt + [99])) is None
    assert t.check_read("r1", 7, BLOCKS, content_digest(prompt)) is None
    refusal = t.check_read("r1", 7, BLOCKS, content_digest(prompt + [98]))  # another token than P's
    assert refusal is not None and refusal.kind is Refusal.CONTENT
    assert "r1" not in t  # a content mismatch ends the lease


def test_a_check_read_without_connect_is_watched(control) -> None:
    """A reader that does not say (an older D) gets what every read got before: P steps promptly."""
    cs, leases, port = control
    leases.grant("r1", BLOCKS, 7, PROMPT)
    body = json.dumps({"rid": "r1", "gen": 7, "blocks": [list(g) for g in BLOCKS], "content": PROMPT}).encode()
    ControlClient(timeout_s=2.0)._client.request("127.0.0.1", port, "kv_check_read", body, 2.0)
    assert leases.reads_in_flight(watched=True)


def test_a_granted_read_keeps_its_blocks_past_the_reader_s_own_deadline(table) -> None:
    """A lease must not expire while the read it granted may still be copying: P would reuse the
    blocks and D would compute from another prompt's KV (issue 27's grid: lease expiry with a
    read posted). D names its read timeout T; the blocks stay held for 2 T after the grant
    (D starts no read more than T after it asked), then expire as any lease."""
    t, clock = table
    assert t.check_read("r1", 7, BLOCKS, PROMPT, read_timeout_s=40.0) is None
    clock.now += 79.0  # well past the lease (30 s) and its renewal (20 s)
    assert t.pop_expired() == [] and "r1" in t
    clock.now += 2.0
    assert t.pop_expired() == ["r1"]


def test_a_reader_without_a_deadline_gets_the_lease_s_renewal_only(table) -> None:
    t, clock = table
    clock.now += 29.0
    assert t.check_read("r1", 7, BLOCKS, PROMPT) is None  # an older D: renewed to now + 20 s
    clock.now += 21.0
    assert t.pop_expired() == ["r1"]


@pytest.mark.parametrize("bad", [0, -1, "30", True, float("inf"), 10**9])
def test_a_check_read_with_a_bad_read_timeout_is_refused(control, bad) -> None:
    cs, leases, port = control
    leases.grant("r1", BLOCKS, 7, PROMPT)
    body = json.dumps({"rid": "r1", "gen": 7, "blocks": [list(g) for g in BLOCKS], "content": PROMPT,
                       "read_timeout_s": bad}).encode()
    with pytest.raises(HandshakeError, match="read_timeout_s"):
        ControlClient(timeout_s=2.0)._client.request("127.0.0.1", port, "kv_check_read", body, 2.0)
    assert "r1" in leases and not leases.reads_in_flight()


def test_control_client_sends_its_read_timeout(control) -> None:
    cs, leases, port = control
    clock = leases._clock
    leases.grant("r1", BLOCKS, 7, PROMPT)
    ControlClient(timeout_s=2.0, read_timeout_s=45.0).check_read("127.0.0.1", port, "r1", 7, BLOCKS, PROMPT)
    assert leases._leases["r1"].expiry >= clock() + 89.0


def test_pressure_ends_a_lease_nobody_reads_yet_and_never_one_being_read(table) -> None:
    """A held prefix the pool needs back: ended unread (outcome pressure), its blocks queued to be freed;
    once a read was granted, even past the read watch, only the read's own end frees them."""
    t, clock = table
    t.grant("r2", BLOCKS, 8, PROMPT)
    assert t.check_read("r2", 8, BLOCKS, PROMPT) is None
    clock.now += 20.0  # past the read watch: no longer "in flight" for pacing, still granted
    assert not t.reads_in_flight()
    assert not t.end_unread("r2") and "r2" in t
    assert t.end_unread("r1") and "r1" not in t and not t.end_unread("r1")
    assert t.finished_sending() == {"r1"}
    assert t.check_read("r1", 7, BLOCKS, PROMPT) is not None  # a late reader is refused: nothing to read
    assert t.read_done("r2", 8)


def test_a_retention_renews_on_touch_and_expires_quietly_when_its_conversation_goes_quiet() -> None:
    clock = Clock()
    t = LeaseTable(30.0, clock=clock)
    t.grant("reader", BLOCKS, 7, PROMPT)
    t.retain("ret", ([8, 9],), PROMPT, retained_s=100.0)
    assert t.lent() == 1 and len(t) == 2
    assert t.held_blocks() == 3 and t.retained_blocks() == 2
    assert not t.retention_due()
    clock.now += 60.0
    assert t.touch("ret") and not t.touch("reader") and not t.touch("nobody")
    clock.now += 60.0  # 120 s after the grant, 60 s after the touch
    assert t.release("reader", 7)
    assert t.finished_sending() == {"reader"}
    assert "ret" in t
    clock.now += 41.0
    assert t.retention_due()
    assert t.finished_sending() == {"ret"}
    assert t.stats.expired_leases == 0  # a conversation going quiet is no failure
    assert t.stats.lease_outcomes() == {"release": 1, "retention_expired": 1}
    assert len(t) == 0 and t.lent() == 0 and not t.retention_due()


def test_a_retention_is_lent_to_no_reader_and_ends_by_outcome() -> None:
    clock = Clock()
    t = LeaseTable(30.0, clock=clock)
    t.retain("ret", BLOCKS, PROMPT, retained_s=100.0)
    gen = t._leases["ret"].generation
    refusal = t.check_read("ret", gen, BLOCKS, PROMPT)  # even with its generation: no params name it
    assert refusal is not None and refusal.kind is Refusal.NO_LEASE and "ret" in t
    assert t.end_retention("ret", LeaseOutcome.SUPERSEDED)
    assert not t.end_retention("ret", LeaseOutcome.SUPERSEDED)  # once
    assert t.drain_released() == ["ret"]
    t.grant("reader", BLOCKS, 9, PROMPT)
    assert not t.end_retention("reader", LeaseOutcome.RELEASE)  # only retentions end this way
    with pytest.raises(ValueError):
        t.retain("x", BLOCKS, PROMPT, retained_s=0.0)
    t.retain("y", BLOCKS, PROMPT, retained_s=5.0)
    assert t.end_unread("y")  # pressure ends it like an unread hold
    t.close()
    assert t.stats.lease_outcomes() == {"superseded": 1, "pressure": 1, "shutdown": 1}
    assert t.lent() == 0 and not t.retention_due()
