"""D's receive state machine (connector/receiving.py) on its own, against an in-memory P.

The world (receiver_world.py) keeps the real protocol on both ends (handshake payloads, the
side channel's frames and handlers, P's lease table, the ranks' transfer agents) and fakes only
the transport, the pools the side-channel calls run on (they run when the test says) and the
clock (it moves when the test says). So every wait here is a step or a run of the pools, never a
sleep, and each test checks what P heard: exactly one read-done or release per request that P
should hear of, however many ranks either side has.
"""

from __future__ import annotations

import dataclasses
import struct

import pytest
import torch

from kvbridge.kv_transfer.backends.fake import FaultConfig
from kvbridge.kv_transfer.connector import receiving
from kvbridge.kv_transfer.connector.receiving import MAX_REMOTE_TP_SIZE
from kvbridge.kv_transfer.failure import FailureKind
from kvbridge.kv_transfer.side_channel.handshake import HandshakeFailureKind, HandshakeRefused, HandshakeTimeout

from tests.unit.receiver_world import (COMPAT, HOST, LEASE_S, P_PORT, PROMPT, TRANSFER_TIMEOUT_S, PrefillEnd,
                                       ReceiverWorld, rank_heads)

LOCAL = [0, 1, 2]
REMOTE = [5, 6, 7]


@pytest.fixture
def world():
    w = ReceiverWorld()
    yield w
    w.shutdown()


def make_world(request, **kwargs) -> ReceiverWorld:
    w = ReceiverWorld(**kwargs)
    request.addfinalizer(w.shutdown)
    return w


def assert_loaded(w: ReceiverWorld, rid: str, p: PrefillEnd | None = None) -> None:
    """`rid` settled once, not failed, its blocks hold P's KV, and P heard one read-done."""
    p = p or w.p
    assert w.out.finished[rid] == 1 and rid not in w.out.failed
    for rank in range(w.d_tp):
        assert torch.equal(w.d_blocks(rank, LOCAL), w.p_heads(REMOTE, rank_heads(w.d_tp, rank), p))
    assert w.net.notices(f"p-{rid}", p.port) == ["read_done"]
    assert f"p-{rid}" not in p.leases
    assert w.live_reads() == [0] * w.d_tp  # every handle released


def assert_failed(w: ReceiverWorld, rid: str, kind: FailureKind, notices: list[str]) -> None:
    """`rid` settled once, failed with `kind`, its blocks invalid; P heard `notices`."""
    assert w.out.finished[rid] == 1
    assert w.out.failed[rid] is kind, w.out.causes.get(rid)
    assert set(LOCAL) <= w.out.invalid_block_ids
    assert w.net.notices(f"p-{rid}") == notices
    assert w.live_reads() == [0] * w.d_tp


# ---- reads that land, and settle-all (seed 000) ---------------------------------------

@pytest.mark.parametrize("d_tp,p_tp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_a_load_reads_every_head_and_p_hears_one_read_done(request, d_tp, p_tp):
    """Whatever the TP sizes, D's ranks fill their heads from P's ranks and P hears ONE read-done,
    after one check_read and one handshake per P rank."""
    w = make_world(request, d_tp=d_tp, p_tp=p_tp)
    w.recv("d1")
    w.settle()
    assert_loaded(w, "d1")
    assert (w.net.count("handshake"), w.net.count("check")) == (p_tp, 1)


def test_many_requests_share_one_handshake_and_each_gets_one_read_done(request):
    w = make_world(request, d_tp=2, p_tp=2)
    for rid in ("d1", "d2", "d3"):
        w.recv(rid, prompt=PROMPT)
    w.settle()
    for rid in ("d1", "d2", "d3"):
        assert w.out.finished[rid] == 1 and rid not in w.out.failed
        assert w.net.notices(f"p-{rid}") == ["read_done"]
    assert w.net.count("handshake") == 2  # one per P rank, deduplicated over the requests


def test_a_notification_only_request_reads_nothing_and_p_hears_read_done(world):
    world.recv("d1", local=[], remote=[])
    world.settle()
    assert world.out.finished["d1"] == 1 and "d1" not in world.out.failed
    assert world.net.notices("p-d1") == ["read_done"]
    assert world.stats.transfers == 1 and world.stats.bytes == 0


def test_a_request_settles_only_when_every_rank_read_settled(request):
    """Seed 000: rank 0's read is DONE, rank 1's still in flight: the request is not reported,
    P hears nothing and rank 0 keeps its handle; once rank 1's settles, all of it happens once."""
    w = make_world(request, d_tp=2, p_tp=2, d_faults={1: FaultConfig(hold_reads=True)})
    w.recv("d1")
    for _ in range(5):
        w.step()
        w.run()
    assert w.out.finished["d1"] == 0 and w.net.notices("p-d1") == []
    assert w.receiver.has_unsettled_reads()
    assert w.live_reads() == [1, 1]  # rank 0's settled read is not released before rank 1's settles
    w.agents[1].backend.set_faults(FaultConfig())
    w.settle()
    assert_loaded(w, "d1")


def test_a_failed_read_fails_the_request_only_once_the_others_settled(request):
    """Rank 0's read fails while rank 1's is in flight: nothing is reported and no release goes
    until rank 1's settles; then the request fails with rank 0's failure and P hears ONE release."""
    w = make_world(request, d_tp=2, p_tp=2,
                   d_faults={0: FaultConfig(error_state=True), 1: FaultConfig(hold_reads=True)})
    w.recv("d1")
    for _ in range(5):
        w.step()
        w.run()
    assert w.out.finished["d1"] == 0 and w.net.notices("p-d1") == []
    w.agents[1].backend.set_faults(FaultConfig())
    w.settle()
    assert_failed(w, "d1", FailureKind.TRANSFER_STATE, ["release"])
    assert "D rank 0" in w.out.causes["d1"] and "1 of 2 reads failed" in w.out.causes["d1"]
    assert "p-d1" not in w.p.leases


# ---- read failures --------------------------------------------------------------------

@pytest.mark.parametrize("fault,kind", [
    (FaultConfig(fail_read_setup=True), FailureKind.TRANSFER_SETUP),
    (FaultConfig(error_state=True), FailureKind.TRANSFER_STATE),
    (FaultConfig(raise_on_check_state=True), FailureKind.TRANSFER_POLL),
    (FaultConfig(fail_add_remote_agent=True), FailureKind.HANDSHAKE),
], ids=["setup", "state", "poll", "add_agent"])
def test_a_failed_read_fails_the_request_and_p_hears_one_release(request, fault, kind):
    w = make_world(request, d_faults={0: fault})
    w.recv("d1")
    w.settle()
    assert_failed(w, "d1", kind, ["release"])
    assert "p-d1" not in w.p.leases and w.p.stats.early_releases == 1


def test_a_rank_that_cannot_add_p_agent_drops_the_peer(request):
    """A rank failing to add P's agent counts as a handshake failure and D forgets P: the next
    request shakes hands afresh (and succeeds once the agent can be added)."""
    w = make_world(request, d_faults={0: FaultConfig(fail_add_remote_agent=True)})
    w.recv("d1")
    w.settle()
    assert w.stats.handshake_failures["add_remote_agent"] == 1
    w.agents[0].backend.set_faults(FaultConfig())
    w.recv("d2")
    w.settle()
    assert w.net.count("handshake") == 2
    assert w.out.finished["d2"] == 1 and "d2" not in w.out.failed


def test_p_dying_mid_read_fails_the_request(request):
    w = make_world(request, d_faults={0: FaultConfig(hold_reads=True)})
    w.recv("d1")
    w.to_read()
    assert w.receiver.has_unsettled_reads()
    w.fabric.kill(w.p.agents[0].backend.agent_name)
    w.settle()
    assert_failed(w, "d1", FailureKind.TRANSFER_STATE, ["release"])


def test_a_read_times_out_by_the_clock_and_p_is_forgotten(request):
    """A read still in flight transfer_timeout_s after it started (the ranks' clock: no sleep)
    fails as TRANSFER_TIMEOUT, not a moment before; P hears one release and D shakes hands
    afresh for the next request (P may be gone)."""
    w = make_world(request, d_faults={0: FaultConfig(hold_reads=True)})
    w.recv("d1")
    w.to_read()  # the read starts now
    w.clock.advance(TRANSFER_TIMEOUT_S)
    w.step()
    w.run()
    assert w.out.finished["d1"] == 0
    w.clock.advance(0.001)
    w.settle()
    assert_failed(w, "d1", FailureKind.TRANSFER_TIMEOUT, ["release"])
    w.agents[0].backend.set_faults(FaultConfig())
    w.recv("d2")
    w.settle()
    assert w.net.count("handshake") == 2
    assert w.out.finished["d2"] == 1 and "d2" not in w.out.failed


# ---- handshake failures ---------------------------------------------------------------

def _version_mismatch(w: ReceiverWorld) -> dict:
    payload = w.p.payload(0)
    w.p.serve(0, struct.pack("!4sH", b"KVBH", 2) + payload[6:])
    return {}


def _hash_mismatch(w: ReceiverWorld) -> dict:
    w.p.serve(0, w.p.payload(0, compat=dataclasses.replace(COMPAT, model="another-model")))
    return {}


def _refused(w: ReceiverWorld) -> dict:
    del w.net.servers[(HOST, P_PORT)]
    return {}


def _peer_error(w: ReceiverWorld) -> dict:
    w.p.serve(0, w.p.payload(0, tp_size=2))  # names a rank 1 that P serves no payload for
    return {}


# kind -> (how the world is broken: returns RecvSpec overrides; P answered on its side channel:
# D lets P free at once with a release)
HANDSHAKE_FAILURES = {
    HandshakeFailureKind.VERSION_MISMATCH: (_version_mismatch, True),
    HandshakeFailureKind.HASH_MISMATCH: (_hash_mismatch, True),
    HandshakeFailureKind.ENGINE_MISMATCH: (lambda w: {"engine_id": "prefill-9"}, False),
    HandshakeFailureKind.LAYOUT_MISMATCH: (lambda w: w.p.serve(0, w.p.payload(0, block_size=8)) or {}, True),
    HandshakeFailureKind.DECODE_ERROR: (lambda w: w.p.serve(0, b"not a kvbridge payload") or {}, False),
    HandshakeFailureKind.TIMEOUT: (lambda w: w.net.fail("handshake", HandshakeTimeout) or {}, False),
    HandshakeFailureKind.REFUSED: (_refused, False),
    HandshakeFailureKind.PEER_ERROR: (_peer_error, False),
}


def test_every_handshake_failure_kind_is_tested():
    assert set(HANDSHAKE_FAILURES) == set(HandshakeFailureKind)


@pytest.mark.parametrize("kind", list(HANDSHAKE_FAILURES), ids=lambda k: k.value)
def test_a_failed_handshake_fails_the_request_before_any_check(world, kind):
    """Each handshake failure fails the request as HANDSHAKE naming its kind, before any
    check_read or read; P hears a release only when its own side channel answered the refused
    payload (it is up and it is the engine named), so it need not wait for the lease's expiry."""
    breaks, p_answered = HANDSHAKE_FAILURES[kind]
    world.recv("d1", **breaks(world))
    world.settle()
    assert_failed(world, "d1", FailureKind.HANDSHAKE, ["release"] if p_answered else [])
    assert world.out.causes["d1"].startswith(f"KV transfer failed (handshake): {kind.value}:")
    assert world.net.attempts["check"] == 0
    assert world.stats.handshake_failures[kind.value] == 1
    assert ("p-d1" in world.p.leases) is not p_answered


def test_an_mla_peer_is_refused_naming_why(world):
    world.p.serve(0, world.p.payload(0, compat=dataclasses.replace(COMPAT, use_mla=True)))
    world.recv("d1")
    world.settle()
    assert_failed(world, "d1", FailureKind.HANDSHAKE, ["release"])
    assert "the prefill engine serves an MLA model" in world.out.causes["d1"]


def test_a_peer_on_another_transfer_backend_is_refused(world):
    world.p.serve(0, world.p.payload(0, backend="tcp"))
    world.recv("d1")
    world.settle()
    assert_failed(world, "d1", FailureKind.HANDSHAKE, ["release"])
    assert "transfer backend 'tcp'" in world.out.causes["d1"]


def _same_heads_twice(p: PrefillEnd) -> dict:
    p.serve(1, p.payload(1, kv_head_start=0))
    return {}


def _other_head_size(p: PrefillEnd) -> dict:
    layout = p.registrations[1].layout
    p.serve(1, p.payload(1, block_len_bytes=(layout.block_len_bytes[0] * 2,)))
    return {}


def _other_tp_size(p: PrefillEnd) -> dict:
    p.serve(1, p.payload(1, tp_size=3))
    return {}


def _other_engine(p: PrefillEnd) -> dict:
    """Rank 1 answers as another engine; the params name none (else that is an engine mismatch)."""
    p.serve(1, p.payload(1, engine_id="prefill-restarted"))
    return {"engine_id": ""}


@pytest.mark.parametrize("breaks,why", [
    (_same_heads_twice, "the engines hold different KV heads"),
    (_other_head_size, "KV head sizes per block differ"),
    (_other_tp_size, "disagree on its engine id or TP size"),
    (_other_engine, "disagree on its engine id or TP size"),
], ids=["heads", "head_size", "tp_size", "engine_id"])
def test_p_ranks_that_cannot_fill_d_ranks_are_refused_before_any_check(request, breaks, why):
    """The pairing of D's ranks with P's is checked once every P rank's payload is in: a P whose
    ranks do not cover D's heads, or disagree, is refused as a layout mismatch (P answered: release)."""
    w = make_world(request, d_tp=2, p_tp=2)
    w.recv("d1", **breaks(w.p))
    w.settle()
    assert_failed(w, "d1", FailureKind.HANDSHAKE, ["release"])
    assert w.out.causes["d1"].startswith("KV transfer failed (handshake): layout_mismatch:")
    assert why in w.out.causes["d1"]
    assert w.net.attempts["check"] == 0


def test_a_p_announcing_a_huge_tp_size_is_refused_without_fetching_its_ranks(world):
    world.p.serve(0, world.p.payload(0, tp_size=MAX_REMOTE_TP_SIZE + 1))
    world.recv("d1")
    world.settle()
    assert_failed(world, "d1", FailureKind.HANDSHAKE, [])
    assert f"more than {MAX_REMOTE_TP_SIZE}" in world.out.causes["d1"]
    assert world.net.attempts["handshake"] == 1


def test_a_failed_handshake_is_retried_only_after_its_backoff_on_the_clock(world):
    """A refused handshake is remembered: a request within the backoff (0.5 s on D's clock) fails
    at once without touching the network; after it, the handshake is tried again."""
    server = world.net.servers.pop((HOST, P_PORT))
    world.recv("d1")
    world.settle()
    world.net.servers[(HOST, P_PORT)] = server
    world.recv("d2")
    world.settle()
    assert world.out.failed["d2"] is FailureKind.HANDSHAKE and "failed recently" in world.out.causes["d2"]
    assert world.net.attempts["handshake"] == 1
    world.clock.advance(0.5)
    world.recv("d3")
    world.settle()
    assert world.net.attempts["handshake"] == 2
    assert world.out.finished["d3"] == 1 and "d3" not in world.out.failed


# ---- the lease check ------------------------------------------------------------------

def _content(w: ReceiverWorld) -> dict:
    return {"generation": w.p.grant("p-d1", REMOTE, prompt=[7, 7, 7])}


def _stale(w: ReceiverWorld) -> dict:
    return {"generation": w.p.grant("p-d1", REMOTE) + 1}


def _foreign_blocks(w: ReceiverWorld) -> dict:
    return {"generation": w.p.grant("p-d1", [1, 2, 3])}


def _no_lease(w: ReceiverWorld) -> dict:
    return {"generation": 12345}


@pytest.mark.parametrize("breaks,kind,why", [
    (_content, FailureKind.CONTENT_MISMATCH, "content mismatch"),
    (_stale, FailureKind.STALE_LEASE, "stale lease generation"),
    (_foreign_blocks, FailureKind.STALE_LEASE, "blocks not granted"),
    (_no_lease, FailureKind.STALE_LEASE, "no lease for request p-d1"),
], ids=["content", "stale", "blocks", "no_lease"])
def test_a_refused_check_fails_the_request_without_reading(world, breaks, kind, why):
    """P refuses the read on its side channel: the request fails with P's reason, nothing is
    read, and D sends no release (P holds nothing for this reader, or ended the lease itself)."""
    world.recv("d1", **breaks(world))
    world.settle()
    assert_failed(world, "d1", kind, [])
    assert why in world.out.causes["d1"]
    assert world.stats.transfers == 0 and not world.caches[0].any()


def test_a_check_refused_for_content_ends_p_lease(world):
    world.recv("d1", **_content(world))
    world.settle()
    assert "p-d1" not in world.p.leases and world.p.stats.content_mismatches == 1


def _p_expires_it(w: ReceiverWorld, p_rid: str, generation: int) -> None:
    w.clock.advance(LEASE_S + 1)
    assert p_rid in w.p.step()


def _p_releases_it(w: ReceiverWorld, p_rid: str, generation: int) -> None:
    assert w.p.leases.release(p_rid, generation)


@pytest.mark.parametrize("p_ends", [_p_expires_it, _p_releases_it], ids=["expired", "released"])
@pytest.mark.parametrize("phase", ["handshake", "check"])
def test_a_check_after_p_ended_the_lease_is_refused(world, p_ends, phase):
    """P ended the lease (expiry on the clock, or its own release: the proxy gave up) while D
    was shaking hands or its check was on the wire: the check is refused, the request fails as
    STALE_LEASE and reads nothing, and D sends P nothing."""
    spec = world.recv("d1")
    if phase == "check":
        world.to_check()
        assert world.control.pending == 1
    else:
        world.step()
        assert world.handshakes.pending == 1
    p_ends(world, spec.remote_request_id, spec.lease_generation)
    world.settle()
    assert_failed(world, "d1", FailureKind.STALE_LEASE, [])
    assert "no lease for request p-d1" in world.out.causes["d1"]
    assert world.stats.transfers == 0


def test_p_releasing_mid_read_still_gets_one_read_done(request):
    """P's own release while D's read is in flight ends nothing on D: the read settles, D reports
    the load and sends its one read-done (which P no longer needs)."""
    w = make_world(request, d_faults={0: FaultConfig(hold_reads=True)})
    spec = w.recv("d1")
    w.to_read()
    assert w.receiver.has_unsettled_reads()
    w.p.leases.release(spec.remote_request_id, spec.lease_generation)
    w.agents[0].backend.set_faults(FaultConfig())
    w.settle()
    assert w.out.finished["d1"] == 1 and "d1" not in w.out.failed
    assert w.net.notices("p-d1") == ["read_done"]
    assert w.p.stats.lease_outcomes() == {"release": 1}


@pytest.mark.parametrize("error", [HandshakeTimeout, HandshakeRefused], ids=["timeout", "refused"])
def test_a_check_lost_on_the_wire_fails_as_peer_death_and_forgets_p(world, error):
    world.net.fail("check", error)
    world.recv("d1")
    world.settle()
    assert_failed(world, "d1", FailureKind.PEER_DEATH, [])
    world.net.heal("check")
    world.recv("d2")
    world.settle()
    assert world.net.count("handshake") == 2  # P was forgotten: D shook hands again
    assert world.out.finished["d2"] == 1 and "d2" not in world.out.failed


@pytest.mark.parametrize("late,fails", [(TRANSFER_TIMEOUT_S, False), (TRANSFER_TIMEOUT_S + 0.01, True)],
                         ids=["at_the_timeout", "past_it"])
def test_a_grant_seen_past_the_read_timeout_is_not_read(world, late, fails):
    """P holds a granted read's blocks for two read timeouts from the grant: D starts no read
    more than one timeout after it asked (D's clock), fails it and lets P free at once."""
    world.recv("d1")
    world.to_check()  # D asks P now
    world.clock.advance(late)
    world.settle()
    if fails:
        assert_failed(world, "d1", FailureKind.TRANSFER_TIMEOUT, ["release"])
        assert "P granted the read" in world.out.causes["d1"] and world.stats.transfers == 0
        assert "p-d1" not in world.p.leases
    else:
        assert_loaded(world, "d1")


def test_a_restarted_p_is_shaken_hands_with_again_once(world):
    """P restarted under the same address after D's handshake: its check answers as another
    incarnation, D forgets the old agents, shakes hands afresh and reads from the new P."""
    world.recv("d1")
    world.settle()
    world.p.restart()
    world.recv("d2")
    world.settle()
    assert world.net.count("handshake") == 2
    assert world.out.finished["d2"] == 1 and "d2" not in world.out.failed
    assert torch.equal(world.d_blocks(0, LOCAL), world.p_heads(REMOTE, rank_heads(1, 0)))
    assert world.net.notices("p-d2") == ["read_done"]


def test_a_p_that_keeps_answering_as_another_incarnation_fails_the_request(world):
    world.recv("d1")
    world.settle()
    world.p.control.incarnation = "not-the-agents-d-shook-hands-with"
    world.recv("d2")
    world.settle()
    assert world.out.failed["d2"] is FailureKind.HANDSHAKE
    assert "restarted during the handshake" in world.out.causes["d2"]
    assert world.net.count("check") == 3 and world.net.notices("p-d2") == []


# ---- releases, heartbeats and lost notices ---------------------------------------------

def test_a_release_reaches_p_once_and_reports_no_load(world):
    generation = world.p.grant("p-d1", REMOTE)
    world.release("d1", "p-d1", generation)
    world.step()
    world.run()
    world.step()
    assert world.net.notices("p-d1") == ["release"]
    assert "p-d1" not in world.p.leases
    assert not world.out.finished


def test_heartbeats_renew_p_lease(world):
    gen = world.p.grant("p-d1", REMOTE)
    world.clock.advance(LEASE_S - 1)
    world.heartbeat("p-d1", gen)
    world.step()
    world.run()
    world.clock.advance(2)
    assert "p-d1" not in world.p.step() and "p-d1" in world.p.leases


def test_a_lost_read_done_is_counted_and_the_load_still_lands(world):
    world.net.fail("read_done", HandshakeTimeout)
    world.recv("d1")
    world.settle()
    assert world.out.finished["d1"] == 1 and "d1" not in world.out.failed
    assert world.stats.failed_notifications == 1 and world.net.attempts["read_done"] == 1
    assert "p-d1" in world.p.leases  # P frees at expiry instead


# ---- a bug in the state machine never reaches the step --------------------------------

class _Bug(RuntimeError):
    pass


def _raise(*args, **kwargs):
    raise _Bug("a bug")


@pytest.mark.parametrize("where", ["check_pairing", "request_descs"], ids=["mid_handshake", "mid_check"])
def test_an_unexpected_error_fails_the_request_and_lets_p_free(world, monkeypatch, where):
    monkeypatch.setattr(receiving, where, _raise)
    world.recv("d1")
    world.settle()
    assert_failed(world, "d1", FailureKind.TRANSFER_POLL, ["release"])
    assert "unexpected _Bug: a bug" in world.out.causes["d1"]


def test_an_unexpected_error_mid_read_fails_the_request_once_its_reads_settled(request, monkeypatch):
    """The error strikes after the first of two reads was handed to a rank: the request must
    not be failed before that read settles (it writes into the request's blocks), and must not
    be reported loaded after it (the second read never happened)."""
    w = make_world(request, d_tp=2, d_faults={0: FaultConfig(hold_reads=True)})
    real, made = receiving.ReadOp, []

    def second_fails(*args, **kwargs):
        if made:
            raise _Bug("a bug")
        made.append(real(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(receiving, "ReadOp", second_fails)
    w.recv("d1")
    for _ in range(5):
        w.step()
        w.run()
    assert w.out.finished["d1"] == 0 and w.net.notices("p-d1") == []
    w.agents[0].backend.set_faults(FaultConfig())
    w.settle()
    assert_failed(w, "d1", FailureKind.TRANSFER_POLL, ["release"])


# ---- shutdown -------------------------------------------------------------------------

def test_shutdown_with_work_in_flight_sends_nothing_more(request):
    """Loads in every phase and a release on the wire: shutdown raises nothing, drops the loads and
    cancels what had not gone out (handshakes, the check, the release); P hears nothing after it,
    and the step after it raises nothing either: the cancelled release and one asked for
    afterwards are counted as failed notifications."""
    w = make_world(request, d_faults={0: FaultConfig(hold_reads=True)})
    p2 = PrefillEnd(w.net, w.fabric, w.clock, engine_id="prefill-1", port=P_PORT + 1)
    request.addfinalizer(p2.server.close)
    w.recv("reading")
    w.to_read()  # "reading": its read in flight
    w.recv("checking", local=[3, 4, 5])
    w.step()  # "checking": its check_read queued
    w.recv("shaking", p=p2)
    w.release("released", "p-gone", w.p.grant("p-gone", [1]))
    w.step()  # "shaking": its handshake queued; the release queued
    assert w.receiver.has_unsettled_reads() and w.handshakes.pending and w.control.pending == 2
    delivered = len(w.net.delivered)

    w.connector.shutdown()
    assert not w.receiver.has_loads()
    assert (w.handshakes.run_all(), w.control.run_all()) == (0, 0)  # cancelled, not run
    assert len(w.net.delivered) == delivered
    w.release("late", "p-gone", 1)
    w.step()  # reports nothing, raises nothing
    assert w.stats.failed_notifications == 2  # the release cancelled by shutdown, and the late one
    assert not w.out.finished and not w.receiver.has_work()
    assert w.net.notices("p-reading") == w.net.notices("p-checking") == []
    assert "p-gone" in w.p.leases
