"""A KV read that stays in progress past --kv-transfer-timeout (a cut link, a hung prefill
instance) settles as TRANSFER_TIMEOUT, after its peer's agent was removed (so nothing can land
in the blocks later); the next read adds the peer afresh and completes. The fake fabric's
delayed reads stand for the stalled link; the clock is the test's. The real cut link is
tests/e2e/test_pd_multihost.py's fault test."""

from __future__ import annotations

import numpy as np

from kvbridge.kv_transfer.backends import MemoryRegion
from kvbridge.kv_transfer.backends.fake import FakeBackend, FakeFabric, FaultConfig
from kvbridge.kv_transfer.connector.rank_agent import RankAgent, RankCommands, ReadOp
from kvbridge.kv_transfer.failure import FailureKind


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_read_in_progress_past_the_timeout_fails_and_drops_its_peer_first() -> None:
    fabric, clock = FakeFabric(), Clock()
    src, dst = np.arange(4096, dtype=np.uint8) % 251, np.zeros(4096, dtype=np.uint8)
    p = fabric.create_agent("p")
    p.register_memory([MemoryRegion.of(src)])
    d_backend = fabric.create_agent("d", FaultConfig(delay_polls=3))
    d_backend.register_memory([MemoryRegion.of(dst)])
    d = RankAgent(d_backend, serves_reads=False, read_timeout_s=5.0, clock=clock)

    def read(xfer_id: str) -> None:
        d.apply(RankCommands(reads=[ReadOp(xfer_id, "p-tp0", p.agent_metadata(), ((dst.ctypes.data, 4096),),
                                           ((src.ctypes.data, 4096),))]))

    read("x1")
    assert d.poll().settled == []  # in progress, within the limit
    clock.now += 5.5
    [result] = d.poll().settled
    assert (result.xfer_id, result.kind) == ("x1", FailureKind.TRANSFER_TIMEOUT)
    assert "limit 5.0s" in result.cause
    assert "p" not in d_backend._remotes  # removed before the handle could be released
    d.apply(RankCommands(release=["x1"]))
    assert d.num_live_reads == 0

    read("x2")  # the peer is added again; this one completes within the limit
    settled = []
    for _ in range(10):
        settled += d.poll().settled
        if settled:
            break
    assert [(r.xfer_id, r.kind) for r in settled] == [("x2", None)]
    assert np.array_equal(dst, src)
    d.apply(RankCommands(release=["x2"]))
    d.shutdown()
    p.shutdown()


def test_without_a_timeout_a_slow_read_is_left_to_finish() -> None:
    fabric, clock = FakeFabric(), Clock()
    src, dst = np.ones(64, dtype=np.uint8), np.zeros(64, dtype=np.uint8)
    p = fabric.create_agent("p")
    p.register_memory([MemoryRegion.of(src)])
    d_backend = fabric.create_agent("d", FaultConfig(delay_polls=2))
    d_backend.register_memory([MemoryRegion.of(dst)])
    d = RankAgent(d_backend, serves_reads=False, read_timeout_s=None, clock=clock)
    d.apply(RankCommands(reads=[ReadOp("x", "p-tp0", p.agent_metadata(), ((dst.ctypes.data, 64),),
                                       ((src.ctypes.data, 64),))]))
    clock.now += 3600
    results = [r for _ in range(5) for r in d.poll().settled]
    assert [(r.xfer_id, r.kind) for r in results] == [("x", None)]
    d.apply(RankCommands(release=["x"]))
    d.shutdown()
    p.shutdown()



class RecordingBackend(FakeBackend):
    """The fake, noting the memory each prep_descs call names."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.named: list[tuple[str, int]] = []

    def prep_descs(self, descs, device="cpu", device_id=0):
        self.named.append((device, device_id))
        return super().prep_descs(descs, "cpu", 0)  # the fake copies host memory


def test_a_read_names_the_peer_memory_as_the_peer_registered_it() -> None:
    """D's spans are named as D's memory, P's as P's rank registered them (the handshake's
    RankLayout): NIXL looks a remote span up by memory type and device id, and a P rank on GPU 1
    read by a D on the CPU (or on GPU 0) found nothing before (NIXL_ERR_NOT_FOUND on every read,
    seen on an H100: each request recomputed)."""
    fabric = FakeFabric()
    src, dst = np.arange(4096, dtype=np.uint8) % 251, np.zeros(4096, dtype=np.uint8)
    p = fabric.create_agent("p")
    p.register_memory([MemoryRegion.of(src)])
    d_backend = RecordingBackend("d", fabric=fabric)
    d_backend.register_memory([MemoryRegion.of(dst)])
    d = RankAgent(d_backend, serves_reads=False)
    d.apply(RankCommands(reads=[ReadOp("x1", "p-tp0", p.agent_metadata(), ((dst.ctypes.data, 4096),),
                                       ((src.ctypes.data, 4096),), ("cuda", 1))]))
    assert d_backend.named == [("cpu", 0), ("cuda", 1)]
    settled = []
    for _ in range(10):
        settled += d.poll().settled
        if settled:
            break
    assert [(r.xfer_id, r.kind) for r in settled] == [("x1", None)] and np.array_equal(dst, src)
    d.apply(RankCommands(release=["x1"]))
    d.shutdown()
    p.shutdown()
