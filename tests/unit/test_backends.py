"""Transfer backends: the shared contract on every backend, then each one's own rules.

Topology: two connected agents in this process, D (the reader, a decode instance)
and P (the target, a prefill instance). NIXL agents in one process work, provided
both keep calling into NIXL (without a progress thread an agent progresses only
inside its own calls), which is what ``Pair.pump`` does while a test waits.
"""

from __future__ import annotations

import os

os.environ.setdefault("UCX_NET_DEVICES", "lo")  # before NIXL is imported: stay on loopback
os.environ.setdefault("UCX_MODULES", "^ib")

import contextlib
import socket
import struct
import sys
import time
import uuid
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from kvbridge.kv_transfer.backends import (
    BackendUnavailableError, BlockRun, MemoryRegion, NotificationError, RemoteAgentError,
    TransferBackend, TransferError, TransferSetupError, TransferState, TransferStateError,
    coalesce_block_runs, create_backend, run_descs,
)
from kvbridge.kv_transfer.backends.fake import FakeFabric, FaultConfig

BLOCK = 4096
NUM_BLOCKS = 64
RUNS = coalesce_block_runs([0, 1, 2, 7, 8, 20], [5, 6, 7, 30, 31, 2])  # -> 3 descriptors


@dataclass
class Pair:
    d: TransferBackend
    p: TransferBackend
    p_name: str  # P's agent name as D knows it
    src: np.ndarray  # P's registered memory: random bytes
    dst: np.ndarray  # D's registered memory: zeros
    inbox: dict[str, list[bytes]] = field(default_factory=dict)  # P's notifs so far
    d_inbox: dict[str, list[bytes]] = field(default_factory=dict)  # D's (progress side effect)

    def pump(self) -> None:
        for agent, box in ((self.p, self.inbox), (self.d, self.d_inbox)):
            for sender, msgs in agent.get_new_notifs().items():
                box.setdefault(sender, []).extend(msgs)

    def read_runs(self, runs, notif: bytes = b"req-1"):
        local, remote = run_descs(runs, local_base=self.dst.ctypes.data,
                                  remote_base=self.src.ctypes.data, block_bytes=BLOCK)
        return self.d.read(self.p_name, self.d.prep_descs(local), self.d.prep_descs(remote), notif)

    def wait(self, handle, timeout_s: float = 10.0) -> TransferState:
        deadline = time.monotonic() + timeout_s
        while (state := self.d.check_state(handle)) is TransferState.IN_PROGRESS:
            assert time.monotonic() < deadline, "read did not finish in time"
            self.pump()
            time.sleep(0.0005)
        return state

    def notifs_from_d(self, settle_s: float = 0.05, timeout_s: float = 5.0,
                      expect: int = 1) -> list[bytes]:
        """P's notifs from D, once ``expect`` arrived (or the timeout), plus a settle time
        in which duplicates would show up."""
        deadline = time.monotonic() + timeout_s
        while len(self.inbox.get(self.d.agent_name, [])) < expect and time.monotonic() < deadline:
            self.pump()
            time.sleep(0.001)
        end = time.monotonic() + settle_s
        while time.monotonic() < end:
            self.pump()
            time.sleep(0.001)
        return self.inbox.get(self.d.agent_name, [])

    def blocks_match(self, runs) -> bool:
        def blocks(buf, start, n):
            return buf[start * BLOCK:(start + n) * BLOCK]
        return all(np.array_equal(blocks(self.dst, r.local_start, r.num_blocks),
                                  blocks(self.src, r.remote_start, r.num_blocks)) for r in runs)


def _new_agent(kind: str, name: str, fabric: FakeFabric | None) -> TransferBackend:
    if kind == "nixl":
        pytest.importorskip("nixl._api")
    return create_backend(kind, name, **({"fabric": fabric} if kind == "fake" else {}))


def make_pair(kind: str, fabric: FakeFabric | None = None, tag: str = "") -> Pair:
    tag = tag or uuid.uuid4().hex[:8]  # NIXL agents in one process need distinct names
    fabric = fabric or FakeFabric(seed=1)
    d, p = _new_agent(kind, f"D-{tag}", fabric), _new_agent(kind, f"P-{tag}", fabric)
    src = np.random.default_rng(0).integers(0, 256, NUM_BLOCKS * BLOCK, dtype=np.uint8)
    dst = np.zeros(NUM_BLOCKS * BLOCK, dtype=np.uint8)
    p.register_memory([MemoryRegion.of(src)])
    d.register_memory([MemoryRegion.of(dst)])
    return Pair(d, p, d.add_remote_agent(p.agent_metadata()), src, dst)


@pytest.fixture(params=["fake", "tcp", "nixl"])
def pair(request):
    two = make_pair(request.param)
    yield two
    two.d.shutdown()
    two.p.shutdown()


# -- the shared contract, on every backend ------------------------------------------------


def test_add_remote_agent_returns_the_peer_name_as_str(pair):
    assert pair.p_name == pair.p.agent_name and isinstance(pair.p_name, str)


def test_read_of_coalesced_runs_copies_exact_bytes_and_nothing_else(pair):
    handle = pair.read_runs(RUNS)
    assert handle.num_descs == 3 and handle.nbytes == 6 * BLOCK
    assert pair.wait(handle) is TransferState.DONE
    assert pair.blocks_match(RUNS)
    copied = np.zeros(NUM_BLOCKS, dtype=bool)
    copied[[0, 1, 2, 7, 8, 20]] = True
    untouched = pair.dst.reshape(NUM_BLOCKS, BLOCK)[~copied]
    assert not untouched.any()
    pair.d.release(handle)


def test_many_scattered_descriptors_in_one_read(pair):
    local_ids, remote_ids = list(range(0, NUM_BLOCKS, 2)), list(range(NUM_BLOCKS - 1, 0, -2))
    runs = coalesce_block_runs(local_ids, remote_ids)
    assert len(runs) == NUM_BLOCKS // 2
    handle = pair.read_runs(runs)
    assert pair.wait(handle) is TransferState.DONE
    assert pair.blocks_match(runs)
    pair.d.release(handle)


def test_torch_tensors_register_and_read(pair):
    src = torch.arange(4096, dtype=torch.float32)
    dst = torch.zeros(4096, dtype=torch.float32)
    pair.p.register_memory([MemoryRegion.of(src)])
    pair.d.register_memory([MemoryRegion.of(dst)])
    pair.d.add_remote_agent(pair.p.agent_metadata())  # peers see new regions via fresh metadata
    local = pair.d.prep_descs([(dst.data_ptr(), 1024 * 4)])
    remote = pair.d.prep_descs([(src.data_ptr() + 1024 * 4, 1024 * 4)])
    handle = pair.d.read(pair.p_name, local, remote, b"t")
    assert pair.wait(handle) is TransferState.DONE
    assert torch.equal(dst[:1024], src[1024:2048]) and not dst[1024:].any()
    pair.d.release(handle)


def test_notif_reaches_target_exactly_once_and_only_after_done(pair):
    handle = pair.read_runs(RUNS, notif=b"req-42:1")
    assert pair.wait(handle) is TransferState.DONE
    for _ in range(3):  # polling a finished read again neither changes it nor re-notifies
        assert pair.d.check_state(handle) is TransferState.DONE
    assert pair.notifs_from_d() == [b"req-42:1"]
    pair.d.release(handle)
    assert pair.notifs_from_d() == [b"req-42:1"]


def test_send_notif_arrives_in_order_and_get_new_notifs_drains(pair):
    for msg in (b"HB:a", b"HB:b", b"done:c"):
        pair.d.send_notif(pair.p_name, msg)
    assert pair.notifs_from_d(expect=3) == [b"HB:a", b"HB:b", b"done:c"]
    assert pair.p.get_new_notifs() == {}


def test_send_notif_to_unknown_agent_raises_notification_error(pair):
    with pytest.raises(NotificationError):
        pair.d.send_notif("nobody", b"x")


def test_read_from_unknown_agent_raises_setup_error(pair):
    descs = pair.d.prep_descs([(pair.dst.ctypes.data, BLOCK)])
    with pytest.raises(TransferSetupError):
        pair.d.read("nobody", descs, descs, b"x")
    assert pair.d.stats().reads_started == 0


def test_read_into_unregistered_local_memory_raises_setup_error(pair):
    stray = np.zeros(BLOCK, dtype=np.uint8)
    local = pair.d.prep_descs([(stray.ctypes.data, BLOCK)])
    remote = pair.d.prep_descs([(pair.src.ctypes.data, BLOCK)])
    with pytest.raises(TransferSetupError):
        pair.d.read(pair.p_name, local, remote, b"x")


def test_mismatched_descriptor_lengths_are_a_caller_error(pair):
    local = pair.d.prep_descs([(pair.dst.ctypes.data, BLOCK)])
    with pytest.raises(ValueError):
        pair.d.read(pair.p_name, local, pair.d.prep_descs([(pair.src.ctypes.data, 2 * BLOCK)]), b"")
    with pytest.raises(ValueError):
        pair.d.read(pair.p_name, local, pair.d.prep_descs([(pair.src.ctypes.data, BLOCK)] * 2), b"")


@pytest.mark.parametrize("bad", [[], [(0, BLOCK)], [(4096, 0)], [(4096, -1)]])
def test_prep_descs_rejects_empty_lists_and_bad_spans(pair, bad):
    with pytest.raises(ValueError):
        pair.d.prep_descs(bad)


def test_add_remote_agent_rejects_garbage_metadata(pair):
    with pytest.raises(RemoteAgentError):
        pair.d.add_remote_agent(b"\x00garbage\xff")


def test_release_is_idempotent_and_a_released_handle_cannot_be_polled(pair):
    handle = pair.read_runs(RUNS)
    pair.wait(handle)
    pair.d.release(handle)
    pair.d.release(handle)
    assert handle.released
    with pytest.raises(ValueError):
        pair.d.check_state(handle)


def test_remove_remote_agent_forgets_the_peer_and_unknown_names_are_a_noop(pair):
    pair.d.remove_remote_agent("nobody")
    pair.d.remove_remote_agent(pair.p_name)
    with pytest.raises(TransferSetupError):
        pair.read_runs(RUNS)
    assert pair.d.add_remote_agent(pair.p.agent_metadata()) == pair.p_name
    handle = pair.read_runs(RUNS)
    assert pair.wait(handle) is TransferState.DONE
    pair.d.release(handle)


def test_stats_count_reads_bytes_descriptors_and_notifs(pair):
    handle = pair.read_runs(RUNS)
    pair.wait(handle)
    pair.d.send_notif(pair.p_name, b"hb")
    pair.notifs_from_d(expect=2)
    s = pair.d.stats()
    assert (s.reads_started, s.reads_done, s.reads_failed) == (1, 1, 0)
    assert (s.bytes_read, s.descs_read, s.notifs_sent) == (6 * BLOCK, 3, 1)
    assert pair.p.stats().notifs_received == 2
    pair.d.release(handle)


def test_shutdown_releases_open_handles_and_is_idempotent(pair):
    handle = pair.read_runs(RUNS)
    pair.wait(handle)
    pair.d.shutdown()
    assert handle.released
    pair.d.shutdown()
    pair.d.release(handle)  # still safe
    with pytest.raises(TransferError):
        pair.d.get_new_notifs()
    with pytest.raises(TransferError):
        pair.d.add_remote_agent(pair.p.agent_metadata())


def test_create_backend_refuses_unknown_names_and_a_fake_without_fabric():
    with pytest.raises(ValueError, match="unknown transfer backend"):
        create_backend("rdma", "x")
    with pytest.raises(ValueError, match="fabric"):
        create_backend("fake", "x")


def test_memory_region_validates_and_reads_buffers():
    arr = np.zeros(10, dtype=np.float32)
    assert MemoryRegion.of(arr) == MemoryRegion(arr.ctypes.data, 40, "cpu", 0)
    t = torch.zeros(3, 5, dtype=torch.float16)
    assert MemoryRegion.of(t).length == 30
    with pytest.raises(ValueError):
        MemoryRegion.of(torch.zeros(4, 4).t())
    for bad in [dict(addr=0, length=1), dict(addr=1, length=0),
                dict(addr=1, length=1, device="tpu"), dict(addr=1, length=1, device_id=-1)]:
        with pytest.raises(ValueError):
            MemoryRegion(**bad)


# -- coalescing ------------------------------------------------------------------------------


@pytest.mark.parametrize("local,remote,runs", [
    ([], [], []),
    ([4], [9], [(4, 9, 1)]),
    ([0, 1, 2, 3], [10, 11, 12, 13], [(0, 10, 4)]),
    ([0, 1, 5, 6], [0, 1, 2, 3], [(0, 0, 2), (5, 2, 2)]),  # gap on the local side
    ([0, 1, 2, 3], [0, 1, 7, 8], [(0, 0, 2), (2, 7, 2)]),  # gap on the remote side
    ([0, 1, 4, 9], [3, 4, 8, 5], [(0, 3, 2), (4, 8, 1), (9, 5, 1)]),  # gaps on both sides
    ([3, 2, 1], [3, 2, 1], [(3, 3, 1), (2, 2, 1), (1, 1, 1)]),  # descending never merges
    ([5, 5], [1, 2], [(5, 1, 1), (5, 2, 1)]),
])
def test_coalesce_block_runs(local, remote, runs):
    assert coalesce_block_runs(local, remote) == [BlockRun(*r) for r in runs]


def test_coalesce_block_runs_rejects_lists_of_different_length():
    with pytest.raises(ValueError):
        coalesce_block_runs([1, 2], [1])


@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 50)), max_size=40))
def test_coalesced_runs_expand_back_to_the_pairs_and_are_maximal(pairs):
    runs = coalesce_block_runs([p[0] for p in pairs], [p[1] for p in pairs])
    expanded = [(r.local_start + i, r.remote_start + i) for r in runs for i in range(r.num_blocks)]
    assert expanded == pairs
    for a, b in zip(runs, runs[1:]):
        assert not (b.local_start == a.local_start + a.num_blocks
                    and b.remote_start == a.remote_start + a.num_blocks)


def test_run_descs_gives_one_span_per_run_on_each_side():
    local, remote = run_descs([BlockRun(2, 5, 3)], local_base=1000, remote_base=9000,
                              block_bytes=16)
    assert local == [(1032, 48)] and remote == [(9080, 48)]


# -- tcp: the server's trust boundary and timeouts ---------------------------------------------


@pytest.fixture
def tcp_pair():
    two = make_pair("tcp")
    yield two
    two.d.shutdown()
    two.p.shutdown()


def _raw_exchange(pair: Pair, data: bytes) -> bytes:
    """Send raw bytes to P's server; return whatever it answers before closing."""
    with socket.create_connection(pair.p.address, timeout=5) as sock:
        chunks = []
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        except OSError:
            pass  # the server closed with our garbage unread: a reset, not a clean close
    return b"".join(chunks)


def _frame(op: int, payload: bytes, magic: bytes = b"KVBT", length: int | None = None) -> bytes:
    return struct.pack("!4sBI", magic, op, len(payload) if length is None else length) + payload


def _read_payload(spans, sender=b"D", notif=b"n") -> bytes:
    flat = [v for span in spans for v in span]
    return (struct.pack("!I", len(sender)) + sender + struct.pack("!I", len(notif)) + notif
            + struct.pack("!I", len(spans)) + struct.pack(f"!{len(flat)}Q", *flat))


def test_tcp_read_outside_registered_memory_ends_error_without_bytes_or_notif(tcp_pair):
    outside = tcp_pair.src.ctypes.data + tcp_pair.src.nbytes - BLOCK // 2  # straddles the end
    local = tcp_pair.d.prep_descs([(tcp_pair.dst.ctypes.data, BLOCK)])
    remote = tcp_pair.d.prep_descs([(outside, BLOCK)])
    handle = tcp_pair.d.read(tcp_pair.p_name, local, remote, b"x")
    assert tcp_pair.wait(handle) is TransferState.ERROR
    assert not tcp_pair.dst.any() and tcp_pair.notifs_from_d(timeout_s=0.1) == []
    tcp_pair.d.release(handle)
    good = tcp_pair.read_runs(RUNS)  # the server kept serving
    assert tcp_pair.wait(good) is TransferState.DONE and tcp_pair.blocks_match(RUNS)
    tcp_pair.d.release(good)


GARBAGE = {
    "random bytes": b"\x13\x37" * 40,
    "bad magic": _frame(1, b"", magic=b"HTTP"),
    "unknown op": _frame(99, b""),
    "oversized length": _frame(1, b"", length=1 << 30),
    "truncated read payload": _frame(1, b"\x00\x00\x00\x05ab"),
    "trailing bytes": _frame(1, _read_payload([]) + b"zz"),
    "span count larger than payload": _frame(1, _read_payload([])[:-4] + struct.pack("!I", 1000)),
    "READ_DONE without READ": _frame(2, b""),
    "server-only op": _frame(4, b""),
    "non-utf8 sender": _frame(3, struct.pack("!I", 2) + b"\xff\xfe" + struct.pack("!I", 0)),
    "zero-length span": _frame(1, _read_payload([(1 << 20, 0)])),
    "span at address zero": _frame(1, _read_payload([(0, 64)])),
}


@pytest.mark.parametrize("name", list(GARBAGE))
def test_tcp_server_refuses_garbage_and_keeps_serving(tcp_pair, name):
    answer = _raw_exchange(tcp_pair, GARBAGE[name])
    assert answer == b"" or answer[4:5] == bytes([5]), answer[:16]  # ERR, or just closed
    assert tcp_pair.p.get_new_notifs() == {}
    handle = tcp_pair.read_runs(RUNS)
    assert tcp_pair.wait(handle) is TransferState.DONE and tcp_pair.blocks_match(RUNS)
    tcp_pair.d.release(handle)


@settings(max_examples=40, deadline=None)
@given(data=st.binary(max_size=200))
def test_tcp_server_survives_arbitrary_bytes(data):
    two = make_pair("tcp")
    try:
        _raw_exchange(two, data)
        two.d.send_notif(two.p_name, b"still-alive")
        assert two.notifs_from_d(settle_s=0) == [b"still-alive"]
    finally:
        two.d.shutdown()
        two.p.shutdown()


def test_tcp_metadata_is_versioned(tcp_pair):
    import json
    meta = json.loads(tcp_pair.p.agent_metadata())
    assert set(meta) == {"kind", "version", "name", "host", "port"}
    for broken in [dict(meta, version=meta["version"] + 1), dict(meta, kind="nixl"),
                   dict(meta, port=0), dict(meta, name=7)]:
        with pytest.raises(RemoteAgentError):
            tcp_pair.d.add_remote_agent(json.dumps(broken).encode())


@pytest.fixture
def silent_server():
    """A TCP peer that accepts and then never answers: a hung prefill instance."""
    listener = socket.create_server(("127.0.0.1", 0))
    yield listener
    listener.close()


def _agent_at(listener, name="hung") -> bytes:
    import json
    host, port = listener.getsockname()[:2]
    return json.dumps({"kind": "kvbridge-tcp", "version": 1, "name": name,
                       "host": host, "port": port}).encode()


@contextlib.contextmanager
def _reading_from(listener: socket.socket, name: str, io_timeout_s: float):
    """A tcp agent with one BLOCK-sized read in flight from the silent server: (agent, peer, handle)."""
    d = create_backend("tcp", name, io_timeout_s=io_timeout_s)
    try:
        dst = np.zeros(BLOCK, dtype=np.uint8)
        d.register_memory([MemoryRegion.of(dst)])
        peer = d.add_remote_agent(_agent_at(listener))
        descs = d.prep_descs([(dst.ctypes.data, BLOCK)])
        yield d, peer, d.read(peer, descs, descs, b"x")
    finally:
        d.shutdown()


def test_tcp_read_from_a_hung_peer_times_out_to_error(silent_server):
    with _reading_from(silent_server, "D-timeout", io_timeout_s=0.3) as (d, name, handle):
        start = time.monotonic()
        while d.check_state(handle) is TransferState.IN_PROGRESS:
            assert time.monotonic() - start < 5
            time.sleep(0.01)
        assert d.check_state(handle) is TransferState.ERROR
        with pytest.raises(NotificationError):
            d.send_notif(name, b"hb")
        d.release(handle)


def test_tcp_release_cancels_an_in_flight_read_promptly(silent_server):
    with _reading_from(silent_server, "D-cancel", io_timeout_s=30) as (d, _, handle):
        # Wait until the read's thread has connected and sent its READ (it then blocks for the
        # answer the silent peer never gives): only then is there a blocked read to cancel.
        silent_server.settimeout(10)
        conn, _ = silent_server.accept()
        with conn:
            conn.settimeout(10)
            assert conn.recv(1), "the read never sent its request"
            assert d.check_state(handle) is TransferState.IN_PROGRESS
            start = time.monotonic()
            d.release(handle)
            # Well under the 30 s I/O timeout a blocked read would otherwise wait out.
            assert time.monotonic() - start < 10 and not handle.native.thread.is_alive()


def test_tcp_read_and_notif_to_a_dead_peer_fail(tcp_pair):
    tcp_pair.p.shutdown()
    handle = tcp_pair.read_runs(RUNS)
    assert tcp_pair.d.check_state(handle) in (TransferState.IN_PROGRESS, TransferState.ERROR)
    deadline = time.monotonic() + 10
    while (state := tcp_pair.d.check_state(handle)) is TransferState.IN_PROGRESS:
        assert time.monotonic() < deadline, "a read from a dead peer never ended"
        time.sleep(0.001)
    assert state is TransferState.ERROR and not tcp_pair.dst.any()
    with pytest.raises(NotificationError):
        tcp_pair.d.send_notif(tcp_pair.p_name, b"hb")
    tcp_pair.d.release(handle)


def test_tcp_refuses_device_memory():
    d = create_backend("tcp", "D-cuda")
    try:
        with pytest.raises(TransferError):
            d.register_memory([MemoryRegion(4096, 4096, "cuda")])
    finally:
        d.shutdown()


# -- fake: every fault knob ---------------------------------------------------------------------


@pytest.fixture
def fake_pair():
    two = make_pair("fake")
    yield two
    two.d.shutdown()
    two.p.shutdown()


def test_fault_fail_add_remote_agent(fake_pair):
    fake_pair.d.set_faults(FaultConfig(fail_add_remote_agent=True))
    with pytest.raises(RemoteAgentError):
        fake_pair.d.add_remote_agent(fake_pair.p.agent_metadata())


def test_fault_fail_read_setup_raises_and_leaves_no_handle(fake_pair):
    fake_pair.d.set_faults(FaultConfig(fail_read_setup=True))
    with pytest.raises(TransferSetupError):
        fake_pair.read_runs(RUNS)
    assert fake_pair.d.stats().reads_started == 0 and not fake_pair.d._live


def test_fault_error_state_ends_error_without_bytes_or_notif(fake_pair):
    fake_pair.d.set_faults(FaultConfig(error_state=True))
    handle = fake_pair.read_runs(RUNS)
    assert fake_pair.wait(handle) is TransferState.ERROR
    assert not fake_pair.dst.any() and fake_pair.notifs_from_d(timeout_s=0) == []
    assert fake_pair.d.stats().reads_failed == 1
    fake_pair.d.release(handle)


def test_fault_raise_on_check_state_raises_while_set(fake_pair):
    handle = fake_pair.read_runs(RUNS)
    fake_pair.d.set_faults(FaultConfig(raise_on_check_state=True))
    with pytest.raises(TransferStateError):
        fake_pair.d.check_state(handle)
    fake_pair.d.set_faults(FaultConfig())
    assert fake_pair.wait(handle) is TransferState.DONE
    fake_pair.d.release(handle)


def test_fault_fail_send_notif(fake_pair):
    fake_pair.d.set_faults(FaultConfig(fail_send_notif=True))
    with pytest.raises(NotificationError):
        fake_pair.d.send_notif(fake_pair.p_name, b"hb")
    assert fake_pair.p.get_new_notifs() == {}


def test_fault_drop_completion_notif_copies_bytes_but_never_notifies(fake_pair):
    fake_pair.d.set_faults(FaultConfig(drop_completion_notif=True))
    handle = fake_pair.read_runs(RUNS)
    assert fake_pair.wait(handle) is TransferState.DONE and fake_pair.blocks_match(RUNS)
    assert fake_pair.notifs_from_d(timeout_s=0) == []
    fake_pair.d.release(handle)


def test_fault_delay_polls_holds_bytes_and_notif_until_done(fake_pair):
    fake_pair.d.set_faults(FaultConfig(delay_polls=3))
    handle = fake_pair.read_runs(RUNS)
    for _ in range(3):
        assert fake_pair.d.check_state(handle) is TransferState.IN_PROGRESS
        assert not fake_pair.dst.any() and fake_pair.p.get_new_notifs() == {}
    assert fake_pair.d.check_state(handle) is TransferState.DONE
    assert fake_pair.blocks_match(RUNS)
    assert fake_pair.p.get_new_notifs() == {fake_pair.d.agent_name: [b"req-1"]}
    fake_pair.d.release(handle)


def test_killed_peer_fails_in_flight_and_later_reads_and_notifs(fake_pair):
    fake_pair.d.set_faults(FaultConfig(delay_polls=1))
    in_flight = fake_pair.read_runs(RUNS)
    assert fake_pair.d.check_state(in_flight) is TransferState.IN_PROGRESS
    fake_pair.d.fabric.kill(fake_pair.p_name)
    assert not fake_pair.d.fabric.is_alive(fake_pair.p_name)
    assert fake_pair.d.check_state(in_flight) is TransferState.ERROR
    later = fake_pair.read_runs(RUNS)
    assert fake_pair.d.check_state(later) is TransferState.ERROR
    with pytest.raises(NotificationError):
        fake_pair.d.send_notif(fake_pair.p_name, b"hb")
    with pytest.raises(TransferError):
        fake_pair.p.get_new_notifs()  # the dead agent's own calls fail too
    assert not fake_pair.dst.any()
    fake_pair.d.release(in_flight)
    fake_pair.d.release(later)


def test_strict_progress_completes_reads_only_after_the_target_polls():
    two = make_pair("fake", FakeFabric(strict_progress=True))
    handle = two.read_runs(RUNS)
    for _ in range(5):
        assert two.d.check_state(handle) is TransferState.IN_PROGRESS
    assert two.p.get_new_notifs() == {}  # the target makes progress
    assert two.d.check_state(handle) is TransferState.DONE
    two.d.release(handle)


def test_metadata_from_another_fabric_is_refused(fake_pair):
    stranger = FakeFabric().create_agent("elsewhere")
    with pytest.raises(RemoteAgentError):
        fake_pair.d.add_remote_agent(stranger.agent_metadata())
    with pytest.raises(ValueError):
        fake_pair.d.fabric.create_agent(fake_pair.p_name)  # names are unique per fabric


def _chaos_outcomes(seed: int, n: int = 60) -> list[str]:
    two = make_pair("fake", FakeFabric(seed=seed), tag="chaos")  # fault draws seed on names
    two.d.set_faults(FaultConfig.chaos(0.25, max_random_delay_polls=2))
    outcomes = []
    for i in range(n):
        two.dst[:] = 0
        try:
            handle = two.read_runs(RUNS, notif=f"r{i}".encode())
        except TransferSetupError:
            outcomes.append("setup")
            continue
        while True:
            try:
                state = two.d.check_state(handle)
            except TransferStateError:
                outcomes.append("poll-raised")
                break
            if state is TransferState.DONE:
                assert two.blocks_match(RUNS)
                outcomes.append("done")
                break
            if state is TransferState.ERROR:
                assert not two.dst.any()
                outcomes.append("error")
                break
        two.d.release(handle)
    done_notifs = two.p.get_new_notifs().get(two.d.agent_name, [])
    two.d.shutdown()
    two.p.shutdown()
    # every DONE read notified exactly once; reads that failed setup, ended ERROR or were
    # abandoned after a raising poll never notify
    assert len(done_notifs) == outcomes.count("done") == len(set(done_notifs))
    return outcomes


def test_chaos_mode_is_seeded_and_keeps_the_protocol():
    first = _chaos_outcomes(seed=7)
    assert _chaos_outcomes(seed=7) == first
    assert _chaos_outcomes(seed=8) != first
    assert {"setup", "poll-raised", "done", "error"} <= set(first)


# -- nixl ---------------------------------------------------------------------------------------


def test_nixl_missing_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "nixl", None)
    with pytest.raises(BackendUnavailableError, match="pip install nixl-cu12==1.5.1"):
        create_backend("nixl", "no-nixl")


def test_nixl_read_from_an_idle_target_waits_for_the_target_to_poll():
    two = make_pair("nixl")
    try:
        handle = two.read_runs(RUNS)
        deadline = time.monotonic() + 0.3
        while time.monotonic() < deadline:  # P never calls into NIXL meanwhile
            assert two.d.check_state(handle) is TransferState.IN_PROGRESS
        assert two.wait(handle) is TransferState.DONE  # wait() polls P
        two.d.release(handle)
    finally:
        two.d.shutdown()
        two.p.shutdown()


def test_nixl_read_without_notif_completes_while_the_target_is_idle():
    """What the connector relies on: once wired up, a READ with no notification is DONE
    without the target calling into NIXL. (Between processes, a 45 MiB READ that carried
    one stayed IN_PROGRESS until the target polled: benchmarks/README.md, pd_transfer.)"""
    two = make_pair("nixl")
    try:
        first = two.read_runs(RUNS, notif=b"")
        assert two.wait(first) is TransferState.DONE  # the first read wires up: wait() polls P
        two.d.release(first)
        two.dst[:] = 0
        handle = two.read_runs(RUNS, notif=b"")
        deadline = time.monotonic() + 10.0
        while (state := two.d.check_state(handle)) is TransferState.IN_PROGRESS:  # P never polls
            assert time.monotonic() < deadline, "a read without notification waited for the idle target"
            time.sleep(0.0005)
        assert state is TransferState.DONE and two.blocks_match(RUNS)
        two.d.release(handle)
        assert two.notifs_from_d(expect=0) == []  # an empty notif sends nothing
    finally:
        two.d.shutdown()
        two.p.shutdown()


@pytest.mark.parametrize("kind", ["fake", "tcp"])
def test_an_empty_notif_sends_nothing(kind):
    two = make_pair(kind)
    try:
        handle = two.read_runs(RUNS, notif=b"")
        assert two.wait(handle) is TransferState.DONE and two.blocks_match(RUNS)
        two.d.release(handle)
        assert two.notifs_from_d(expect=0) == []
    finally:
        two.d.shutdown()
        two.p.shutdown()
