"""P's lease table and the control messages that act on it, over a real side channel."""

from __future__ import annotations

import pytest

from kvbridge.kv_transfer.control import ControlClient, ControlServer
from kvbridge.kv_transfer.handshake import HandshakeError
from kvbridge.kv_transfer.lease import LeaseTable
from kvbridge.kv_transfer.side_channel import SideChannelServer
from kvbridge.kv_transfer.stats import KVTransferStats

BLOCKS = ([3, 4, 5],)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def table() -> tuple[LeaseTable, Clock]:
    clock = Clock()
    t = LeaseTable(30.0, clock=clock, read_watch_s=5.0)
    t.grant("r1", BLOCKS, generation=7)
    return t, clock


def test_a_held_lease_is_not_a_read_in_flight(table) -> None:
    t, _ = table
    assert "r1" in t and not t.reads_in_flight()


def test_a_granted_read_is_in_flight_until_the_lease_is_released(table) -> None:
    t, _ = table
    assert t.check_read("r1", 7, ([4, 5],)) is None
    assert t.reads_in_flight()
    assert t.release("r1", 7)
    assert not t.reads_in_flight()


@pytest.mark.parametrize("rid, gen, blocks", [("r1", 8, BLOCKS), ("r2", 7, BLOCKS), ("r1", 7, ([9],))])
def test_a_refused_read_is_not_in_flight(table, rid, gen, blocks) -> None:
    t, _ = table
    assert t.check_read(rid, gen, blocks) is not None
    assert not t.reads_in_flight()


def test_a_read_that_never_reports_done_stops_counting_after_the_watch(table) -> None:
    t, clock = table
    t.check_read("r1", 7, BLOCKS)
    clock.now += 4.9
    assert t.reads_in_flight()
    clock.now += 0.2
    assert not t.reads_in_flight()
    assert "r1" in t  # the lease itself runs on until release or expiry


def test_an_expired_lease_ends_its_read(table) -> None:
    t, clock = table
    t2 = LeaseTable(1.0, clock=clock, read_watch_s=50.0)
    t2.grant("r", BLOCKS, 1)
    t2.check_read("r", 1, BLOCKS)
    clock.now += 2.0
    assert t2.pop_expired() == ["r"]
    assert not t2.reads_in_flight()


def test_check_read_renews_and_heartbeat_renewal_is_bounded(table) -> None:
    t, clock = table
    clock.now += 29.0
    assert t.check_read("r1", 7, BLOCKS) is None  # renewed to now + 20 s
    clock.now += 19.0
    assert t.pop_expired() == []
    clock.now += 2.0
    assert t.pop_expired() == ["r1"]


@pytest.fixture
def control():
    leases = LeaseTable(30.0)
    with SideChannelServer({0: b"{}"}, "127.0.0.1") as server:
        cs = ControlServer(server, leases, KVTransferStats())
        yield cs, leases, server.port


def test_a_granted_check_read_wakes_the_engine_once(control) -> None:
    cs, leases, port = control
    woken = []
    cs.on_read_granted = lambda: woken.append(1)
    cs.incarnation = "inc-1"
    leases.grant("r1", BLOCKS, 7)
    client = ControlClient(timeout_s=2.0)
    with pytest.raises(HandshakeError):
        client.check_read("127.0.0.1", port, "r1", 6, BLOCKS)  # stale generation: refused, no wake
    assert woken == [] and not leases.reads_in_flight()
    assert client.check_read("127.0.0.1", port, "r1", 7, BLOCKS) == "inc-1"
    assert woken == [1] and leases.reads_in_flight()
    client.release("127.0.0.1", port, "r1", 7)
    assert not leases.reads_in_flight() and cs.drain_released() == ["r1"]


def test_a_failing_wake_hook_does_not_refuse_the_read(control) -> None:
    cs, leases, port = control

    def broken() -> None:
        raise RuntimeError("boom")
    cs.on_read_granted = broken
    leases.grant("r1", BLOCKS, 7)
    assert ControlClient(timeout_s=2.0).check_read("127.0.0.1", port, "r1", 7, BLOCKS) == ""
    assert leases.reads_in_flight()
