"""Raw READ throughput of the transfer backends, next to memcpy, in GB/s (1e9 B/s).

The target agent (P) runs in a child process that registers a buffer and keeps
calling get_new_notifs, as a prefill engine does; this process (D) reads the whole
buffer as ``num_descs`` descriptors and times read() -> DONE. Each figure is the
median of ``reps`` timed reads after one untimed warm-up read (connection set-up).
With several descriptors, the remote ones are taken in reverse order so that no
backend can merge neighbours into one.

    python benchmarks/raw_transfer.py --mib 256 --reps 5 --descs 1,16384

The KV transfer benchmark keeps a ``RawPair`` per backend for its physical-limit baseline.
"""

from __future__ import annotations

import os

os.environ.setdefault("UCX_NET_DEVICES", "lo")  # NIXL must stay on loopback here
os.environ.setdefault("UCX_MODULES", "^ib")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import json
import logging
import multiprocessing as mp
import select
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection

import numpy as np

from kvbridge.kv_transfer.backends import MemoryRegion, TransferState, create_backend

READ_TIMEOUT_S = 120.0
CHILD_TIMEOUT_S = 60.0
POLL_TARGET_S = 0.001  # how often P calls get_new_notifs
POLL_READER_S = 20e-6  # pause between D's check_state calls (lets tcp's read thread run)
PATTERN = 251  # the target's bytes are i % 251: no power-of-two period for a misplaced read to hide in


class LineConn:
    """multiprocessing.Connection's send/recv/poll over two pipe fds, one JSON value a line
    (bytes as {"hex": ...}): how a target started with `ip netns exec` (another network
    namespace, so not a multiprocessing child) talks to its reader."""

    def __init__(self, read_fd: int, write_fd: int) -> None:
        self._r, self._w = os.fdopen(read_fd, "r"), os.fdopen(write_fd, "w")

    def send(self, obj: object) -> None:
        wire = [{"hex": x.hex()} if isinstance(x, bytes) else x for x in obj] if isinstance(obj, tuple) else obj
        self._w.write(json.dumps(wire) + "\n")
        self._w.flush()

    def recv(self) -> object:
        line = self._r.readline()
        if not line:
            raise EOFError("the peer closed its pipe")
        value = json.loads(line)
        if isinstance(value, list):
            return tuple(bytes.fromhex(x["hex"]) if isinstance(x, dict) else x for x in value)
        return value

    def poll(self, timeout: float) -> bool:
        return bool(select.select([self._r], [], [], timeout)[0])

    def close(self) -> None:
        self._r.close()
        self._w.close()


_HUGE_PAGE = 2 << 20


def _target_main(kind: str, nbytes: int, conn: Connection | LineConn, host: str | None = None) -> None:
    """The child process: P's agent serving ``nbytes`` of a known pattern (tcp: listening on `host`)."""
    logging.getLogger("nixl").setLevel(logging.WARNING)
    src = huge_page_array(nbytes)
    src[:] = np.tile(np.arange(PATTERN, dtype=np.uint8), nbytes // PATTERN + 1)[:nbytes]
    agent = create_backend(kind, "bench-P", **({"host": host} if host and kind == "tcp" else {}))
    agent.register_memory([MemoryRegion.of(src)])
    conn.send((agent.agent_metadata(), src.ctypes.data))
    try:
        while conn.recv() == "poll":  # idle between measurements ("stop" ends it)
            # While the reader measures: progress at an engine step's cadence (a READ completes
            # only after the target's agent progresses). A busy loop would steal the reader's core.
            while not conn.poll(POLL_TARGET_S):
                agent.get_new_notifs()
            conn.recv()  # "idle"
    finally:
        agent.shutdown()


def huge_page_array(nbytes: int) -> np.ndarray:
    """An untouched uint8 buffer under which Linux is asked for transparent huge pages, as the
    engine asks for them under its KV cache (model_runner.advise_huge_pages): a baseline on 4 KiB
    pages reads at a fraction of the speed (UCX pins the pages it copies). `np.zeros` of the
    same size came back mostly on 4 KiB pages here (14 of 800 MiB in huge pages), so the raw
    reads ran at 8-9 GB/s in some runs and 12-13 in others."""
    import torch

    from kvbridge.engine.model_runner import advise_huge_pages

    t = torch.empty(nbytes + _HUGE_PAGE, dtype=torch.uint8)
    offset = -t.data_ptr() % _HUGE_PAGE  # start on a huge-page boundary
    aligned = t[offset:offset + nbytes]
    advise_huge_pages(aligned)
    return aligned.numpy()


def _spans(base: int, nbytes: int, num_descs: int, reverse: bool) -> list[tuple[int, int]]:
    size = nbytes // num_descs
    order = range(num_descs - 1, -1, -1) if reverse else range(num_descs)
    return [(base + i * size, size) for i in order]


def _memcpy_gbps(nbytes: int, reps: int) -> float:
    src, dst = huge_page_array(nbytes), huge_page_array(nbytes)
    src[:] = 1
    dst[:] = 0
    np.copyto(dst, src)  # warm-up: page faults out of the timing
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times) / 1e9


class RawPair:
    """A target process (P) serving ``capacity`` bytes and a reader agent (D) in this process,
    connected once and kept: each measurement reads the first ``nbytes`` of the buffer.

    Between measurements the target sleeps on its pipe; while one runs it polls its
    agent every POLL_TARGET_S, as a prefill engine does while a read of its blocks is in
    flight. A target polling all the time preempted the reader of an interleaved P/D
    measurement on this 2-core machine (20-50 involuntary context switches during an
    8k-token read, 28 ms instead of 22 ms). Use as a context manager; close() stops the
    child by its pid.
    """

    def __init__(self, backend: str, capacity: int, target_prefix: Sequence[str] = (),
                 target_host: str | None = None) -> None:
        """`target_prefix` (e.g. ["ip", "netns", "exec", NS]): start the target through it, as a
        plain process talking over pipes, instead of as a multiprocessing child (--netns: P's
        network namespace); `target_host`: the tcp target's listening address."""
        self.backend, self.capacity = backend, capacity
        self._agent = None
        if target_prefix:
            self._proc = _PrefixedTarget(target_prefix, backend, capacity, target_host)
            self._conn = self._proc.conn
        else:
            ctx = mp.get_context("spawn")  # no forked UCX or threads
            self._conn, child = ctx.Pipe()
            self._proc = ctx.Process(target=_target_main, args=(backend, capacity, child, target_host), daemon=True)
            self._proc.start()
        try:
            if not self._conn.poll(CHILD_TIMEOUT_S):
                raise RuntimeError(f"{backend} target process did not start")
            metadata, self._remote_base = self._conn.recv()
            self._dst = huge_page_array(capacity)
            self._dst[:] = 1  # fault the pages in before timing
            self._agent = create_backend(backend, "bench-D")
            self._agent.register_memory([MemoryRegion.of(self._dst)])
            self._peer = self._agent.add_remote_agent(metadata)
        except BaseException:
            self.close()
            raise

    def read_gbps(self, nbytes: int, reps: int = 5, num_descs: int = 1) -> float:
        """Median GB/s of ``reps`` timed READs of ``nbytes`` as ``num_descs`` equal descriptors
        (remote ones reversed so that none merge), after one untimed read. Raises
        RuntimeError if a read fails or copies wrong bytes."""
        if nbytes > self.capacity or nbytes % num_descs:
            raise ValueError("nbytes must fit the buffer and be a multiple of num_descs")
        assert self._agent is not None
        self._dst[: nbytes // num_descs] = 0  # so that _verify sees this read's bytes
        local = self._agent.prep_descs(_spans(self._dst.ctypes.data, nbytes, num_descs, False))
        remote = self._agent.prep_descs(_spans(self._remote_base, nbytes, num_descs, num_descs > 1))
        self._conn.send("poll")
        try:
            times = [_timed_read(self._agent, self._peer, local, remote) for _ in range(reps + 1)][1:]
        finally:
            self._conn.send("idle")
        _verify(self._dst, nbytes, num_descs)
        return nbytes / statistics.median(times) / 1e9

    def close(self) -> None:
        if self._agent is not None:
            self._agent.shutdown()
            self._agent = None
        if self._proc.is_alive():
            try:
                self._conn.send("stop")
            except OSError:  # the child is gone already
                pass
            self._proc.join(timeout=CHILD_TIMEOUT_S)
            if self._proc.is_alive():
                self._proc.terminate()

    def __enter__(self) -> RawPair:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class _PrefixedTarget:
    """The target as `prefix + python raw_transfer.py --serve-target ...`, with the Process methods
    RawPair uses (is_alive, join, terminate); its conn is a LineConn over two inherited pipes."""

    def __init__(self, prefix: Sequence[str], backend: str, capacity: int, host: str | None) -> None:
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        argv = [*prefix, sys.executable, os.path.abspath(__file__), "--serve-target", backend, str(capacity),
                str(to_child_r), str(from_child_w), host or ""]
        self.popen = subprocess.Popen(argv, pass_fds=(to_child_r, from_child_w), stdin=subprocess.DEVNULL)
        os.close(to_child_r)
        os.close(from_child_w)
        self.conn = LineConn(from_child_r, to_child_w)

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def join(self, timeout: float | None = None) -> None:
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def terminate(self) -> None:
        self.popen.terminate()
        self.popen.wait()


def raw_read_gbps(backend: str, nbytes: int, reps: int = 5, num_descs: int = 1) -> float:
    """Median GB/s of a raw READ of ``nbytes`` from a fresh peer process (``backend``:
    "nixl" or "tcp"), or of a numpy memcpy (``backend="memcpy"``). See RawPair."""
    if backend == "memcpy":
        return _memcpy_gbps(nbytes, reps)
    with RawPair(backend, nbytes) as pair:
        return pair.read_gbps(nbytes, reps, num_descs)


def _timed_read(agent, peer: str, local, remote) -> float:
    start = time.perf_counter()
    handle = agent.read(peer, local, remote, b"bench")
    try:
        while (state := agent.check_state(handle)) is TransferState.IN_PROGRESS:
            if time.perf_counter() - start > READ_TIMEOUT_S:
                raise RuntimeError("read timed out")
            time.sleep(POLL_READER_S)
        if state is not TransferState.DONE:
            raise RuntimeError(f"read ended {state.name}")
        return time.perf_counter() - start
    finally:
        agent.release(handle)


def _verify(dst: np.ndarray, nbytes: int, num_descs: int) -> None:
    """The first descriptor holds the bytes of the remote one it was paired with."""
    size = nbytes // num_descs
    offset = (num_descs - 1) * size if num_descs > 1 else 0
    expected = (np.arange(offset, offset + size) % PATTERN).astype(np.uint8)
    if not np.array_equal(dst[:size], expected):
        raise RuntimeError("the read copied wrong bytes")


def main() -> None:
    if sys.argv[1:2] == ["--serve-target"]:  # a target started by _PrefixedTarget
        backend, capacity, read_fd, write_fd, host = sys.argv[2:7]
        _target_main(backend, int(capacity), LineConn(int(read_fd), int(write_fd)), host or None)
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="bytes per read, in MiB")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--backends", default="nixl,tcp", help="comma-separated: nixl,tcp")
    ap.add_argument("--descs", default="1", help="comma-separated descriptor counts")
    args = ap.parse_args()
    nbytes = args.mib << 20
    base = _memcpy_gbps(nbytes, args.reps)
    print(f"{'path':<8} {'MiB':>6} {'descs':>7} {'desc KiB':>9} {'GB/s':>7} {'vs memcpy':>10}")
    print(f"{'memcpy':<8} {args.mib:>6} {1:>7} {nbytes >> 10:>9} {base:>7.2f} {1.0:>10.2f}")
    for kind in args.backends.split(","):
        for n in (int(x) for x in args.descs.split(",")):
            gbps = raw_read_gbps(kind, nbytes, args.reps, n)
            print(f"{kind:<8} {args.mib:>6} {n:>7} {(nbytes // n) >> 10:>9} {gbps:>7.2f} "
                  f"{gbps / base:>10.2f}")


if __name__ == "__main__":
    main()
