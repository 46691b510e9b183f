"""End-to-end KV digests (kv_transfer/digest.py): P digests exactly what D reads, D checks every
read before it is reported done, and a read that arrives wrong fails as kv_content_mismatch with
its blocks invalid and P's lease ended as a content mismatch. Against the receiver world (D's real
connector and ranks, P's real ControlServer and LeaseTable; tests/unit/receiver_world.py) with a
CorruptingBackend around D's agents."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from kvbridge.kv_transfer.backends.corrupting import KINDS
from kvbridge.kv_transfer.digest import DIGEST_OFF, digest_bytes, digest_span, within
from kvbridge.kv_transfer.failure import FailureKind
from kvbridge.kv_transfer.lease import LeaseOutcome, content_digest
from kvbridge.kv_transfer.side_channel.control import parse_check_read
from kvbridge.kv_transfer.side_channel.handshake import HandshakeFailureKind
from kvbridge.kv_transfer.side_channel.server import HandlerRefusal
from tests.unit.receiver_world import COMPAT, PROMPT, ReceiverWorld, rank_heads

LOCAL = [0, 1, 2]
REMOTE = [5, 6, 7]
TP_PAIRS = [(1, 1), (1, 2), (2, 1), (2, 2)]  # (D TP, P TP): hetero-TP reads head slices


def make(**kwargs) -> ReceiverWorld:
    return ReceiverWorld(**kwargs)


def d_matches_p(w: ReceiverWorld, local: list[int] = LOCAL, remote: list[int] = REMOTE) -> bool:
    return all(torch.equal(w.d_blocks(r, local), w.p_heads(remote, rank_heads(w.d_tp, r))) for r in range(w.d_tp))


def test_the_digest_hashes_memory_in_place():
    t = torch.arange(64, dtype=torch.float32)
    assert digest_span(t.data_ptr(), 256) == digest_bytes(t.numpy().tobytes())
    before = digest_span(t.data_ptr(), 256)
    t[63] += 1  # the same storage, changed: a new digest (nothing was copied at the first hash)
    assert digest_span(t.data_ptr(), 256) != before
    assert within([(100, 20), (120, 10)], [(100, 10), (110, 10), (120, 10)])
    assert not within([(100, 31)], [(100, 10), (110, 10), (120, 10)]) and not within([(99, 2)], [(100, 10)])
    assert not within([(100, 0)], [(100, 10)])


@pytest.mark.parametrize("d_tp,p_tp", TP_PAIRS)
def test_a_clean_load_is_verified_and_lands(d_tp, p_tp):
    w = make(d_tp=d_tp, p_tp=p_tp)
    try:
        w.recv("a")
        w.settle()
        assert w.out.finished["a"] == 1 and "a" not in w.out.failed
        assert d_matches_p(w) and w.stats.unverified_reads == 0
        checks = [d for d in w.net.delivered if d.kind == "check"]
        asked = parse_check_read(checks[0].body).digest
        assert asked is not None and set(asked) == set(range(p_tp))  # every P rank D reads from digested
        assert w.net.notices("p-a") == ["read_done"] and w.p.step() == {"p-a"}
        assert w.live_reads() == [0] * d_tp
    finally:
        w.shutdown()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("d_tp,p_tp", TP_PAIRS)
def test_every_corruption_is_caught_and_p_hears_a_content_mismatch(kind, d_tp, p_tp):
    w = make(d_tp=d_tp, p_tp=p_tp, corrupt=(1.0, (kind,)))
    try:
        # a first request read (wrongly too), so "foreign" has another request's blocks to read
        w.recv("first", local=[3, 4, 5], remote=[3, 4, 5], prompt=[7] * 9)
        w.settle()
        w.recv("a")
        w.settle()
        for rid, p_rid in (("first", "p-first"), ("a", "p-a")):
            assert w.out.failed[rid] is FailureKind.KV_CONTENT_MISMATCH, w.out.causes.get(rid)
            assert w.out.finished[rid] == 1
            assert w.net.notices(p_rid) == ["release"]
        assert set(LOCAL) <= w.out.invalid_block_ids and {3, 4, 5} <= w.out.invalid_block_ids
        assert "does not match the prefill engine's digest" in w.out.causes["a"]
        assert w.stats.failed_transfers["kv_content_mismatch"] == 2
        # P: both leases ended as content mismatches and their blocks are freed now
        assert w.p.step() == {"p-first", "p-a"} and len(w.p.leases) == 0
        assert w.p.stats.lease_outcomes() == {LeaseOutcome.KV_CONTENT_MISMATCH.value: 2}
        assert w.p.stats.kv_content_mismatches == 2
        assert w.live_reads() == [0] * d_tp
        counts = sum((a.backend.counts for a in w.agents), start=type(w.agents[0].backend.counts)())
        assert counts and set(counts) <= {kind, "shift", "corrupt"}  # foreign/truncate fall back when they cannot apply
    finally:
        w.shutdown()


@pytest.mark.parametrize("kind", ["corrupt", "shift", "truncate"])
def test_with_verification_off_the_same_corruption_lands_wrong_kv(kind):
    """The check matters: the same seeded corruption with kv_verify off settles as a good load
    whose KV differs from P's."""
    w = make(corrupt=(1.0, (kind,)), kv_verify=False)
    w.p.compat = dataclasses.replace(COMPAT, kv_digest=DIGEST_OFF)  # a P with verification off too
    w.p.restart()
    try:
        w.recv("a")
        w.settle()
        assert w.out.finished["a"] == 1 and "a" not in w.out.failed
        assert not d_matches_p(w)
        assert w.net.notices("p-a") == ["read_done"]
        assert all(parse_check_read(d.body).digest is None for d in w.net.delivered if d.kind == "check")
    finally:
        w.shutdown()


def test_a_corrupted_fraction_is_caught_exactly():
    """A seeded fraction of reads is corrupted: exactly those loads fail, the others land intact."""
    w = make(corrupt=(0.5, KINDS))
    try:
        n = 16
        for i in range(n):
            w.recv(f"r{i}", local=[i % 8], remote=[(i + 3) % 8], prompt=[i + 1] * 4)
            w.settle()
            if f"r{i}" not in w.out.failed:
                assert torch.equal(w.d_blocks(0, [i % 8]), w.p_heads([(i + 3) % 8], rank_heads(1, 0)))
        hit = sum(w.agents[0].backend.counts.values())
        assert 0 < hit < n and len(w.out.failed) == hit
        assert set(w.out.failed.values()) == {FailureKind.KV_CONTENT_MISMATCH}
        assert w.p.stats.kv_content_mismatches == hit and w.live_reads() == [0]
    finally:
        w.shutdown()


def test_a_digest_setting_mismatch_is_refused_at_the_handshake():
    w = make()
    w.p.compat = dataclasses.replace(COMPAT, kv_digest=DIGEST_OFF)
    w.p.restart()
    try:
        w.recv("a")
        w.settle()
        assert w.out.failed["a"] is FailureKind.HANDSHAKE
        assert HandshakeFailureKind.HASH_MISMATCH.value in w.out.causes["a"]
        assert w.net.count("check") == 0  # never read
        assert w.net.notices("p-a") == ["release"]
    finally:
        w.shutdown()


def test_a_p_that_cannot_digest_is_read_unverified_and_counted():
    w = make(p_digests=False)
    try:
        w.recv("a")
        w.settle()
        assert w.out.finished["a"] == 1 and "a" not in w.out.failed and d_matches_p(w)
        assert w.stats.unverified_reads == 1
    finally:
        w.shutdown()


def test_p_digests_nothing_outside_the_granted_blocks():
    """A reader naming spans outside its lease's blocks gets no digest: P hashes nothing else."""
    w = make()
    try:
        gen = w.p.grant("p-x", REMOTE)
        base, block = w.p.registrations[0].layout.region_base_addrs[0], w.p.registrations[0].layout.block_len_bytes[0]
        body = {"rid": "p-x", "gen": gen, "blocks": [REMOTE], "content": content_digest(PROMPT),
                "digest": {"0": [[base + 5 * block, 3 * block]]}}
        ok = json.loads(w.p.control._check_read(json.dumps(body).encode()))
        assert len(ok["digests"]["0"]) == 1
        body["digest"] = {"0": [[base + 4 * block, 2 * block]]}  # block 4 is not the lease's
        assert json.loads(w.p.control._check_read(json.dumps(body).encode()))["digests"] == {"0": []}
        body["digest"] = {"0": [["x", 1]]}
        with pytest.raises(HandlerRefusal):
            parse_check_read(json.dumps(body).encode())
    finally:
        w.shutdown()


def test_a_read_planned_outside_the_grant_fails_before_reading():
    """D's plan names spans P's lease does not grant (a mapping bug): P digests none of them and
    D fails the load without reading."""
    w = make()
    try:
        w.recv("a")
        orig = w.receiver._plan_reads

        def shifted(s, peer):
            plan, descs = orig(s, peer)
            return plan, {k: (l, [(a + 256, n) for a, n in r]) for k, (l, r) in descs.items()}
        w.receiver._plan_reads = shifted  # type: ignore[method-assign]
        w.settle()
        assert w.out.failed["a"] is FailureKind.TRANSFER_SETUP
        assert "outside the blocks its lease grants" in w.out.causes["a"]
        assert w.live_reads() == [0] and w.net.notices("p-a") == ["release"]
    finally:
        w.shutdown()

