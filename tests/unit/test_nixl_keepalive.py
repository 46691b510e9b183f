"""UCX's endpoint keepalive must not make reads wait for the target's agent.

Without a progress thread a NIXL agent progresses only inside its own calls, and kvbridge's P
calls into its agents promptly only while a read is watched (lease.py). UCX's keepalive (every
20 s by default) breaks that: once an endpoint has been idle past the interval, reads between
agents already wired up stay in progress until the target's agent progresses (the first read
after the idle spell completes, the later ones do not). `NixlBackend` therefore turns it off
unless the environment sets it (`nixl.KEEPALIVE_ENV`). Here the target is another process (as
P is D's; two agents in one process do not show the stall) whose agent makes no call after the
warm-up read: with a 1 s keepalive, set explicitly, reads stall after a 2.5 s idle spell; with
the default they read on through the same spell.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import numpy as np
import pytest

from kvbridge.kv_transfer.backends import MemoryRegion, TransferState, create_backend

pytest.importorskip("nixl._api")
from kvbridge.kv_transfer.backends import nixl  # noqa: E402

NBYTES = 16 << 20
DESCS = 16
IDLE_S = 2.5  # the idle spell: longer than the explicit 1 s keepalive below
READS = 3
STALL_S = 3.0  # a read still in progress this long after its post waits for the target
START_S = 120.0


def _target(conn) -> None:
    """The read target: its agent polls until the warm-up read is done, then makes no call."""
    src = np.arange(NBYTES, dtype=np.uint8)
    agent = create_backend("nixl", "keepalive-P")
    agent.register_memory([MemoryRegion.of(src)])
    conn.send((agent.agent_metadata(), src.ctypes.data))
    while not conn.poll(0.001):  # until the reader's warm-up read is done
        agent.get_new_notifs()
    conn.recv()
    conn.recv()  # "stop": no agent call before it
    agent.shutdown()


def _reads_after_an_idle_spell() -> list[bool]:
    """Whether each read completed within STALL_S (stopping at the first that did not)."""
    conn, child = mp.get_context("spawn").Pipe()
    target = mp.get_context("spawn").Process(target=_target, args=(child,), daemon=True)
    target.start()
    reader = None
    try:
        assert conn.poll(START_S), "the target process did not start"
        metadata, base = conn.recv()
        dst = np.zeros(NBYTES, dtype=np.uint8)
        reader = create_backend("nixl", "keepalive-D")
        reader.register_memory([MemoryRegion.of(dst)])
        peer = reader.add_remote_agent(metadata)
        size = NBYTES // DESCS
        local = reader.prep_descs([(dst.ctypes.data + i * size, size) for i in range(DESCS)])
        remote = reader.prep_descs([(base + i * size, size) for i in range(DESCS)])

        def read() -> bool:
            handle = reader.read(peer, local, remote, b"")
            deadline = time.monotonic() + STALL_S
            while (state := reader.check_state(handle)) is TransferState.IN_PROGRESS:
                if time.monotonic() > deadline:
                    break
            reader.release(handle)
            return state is TransferState.DONE

        assert read(), "the warm-up read (UCX wire-up, the target polling) did not complete"
        assert np.array_equal(dst, np.arange(NBYTES, dtype=np.uint8))
        conn.send("quiet")
        time.sleep(IDLE_S)  # the fault itself: no traffic and no agent calls on either side
        done: list[bool] = []
        while len(done) < READS and (not done or done[-1]):
            done.append(read())
        return done
    finally:
        if reader is not None:
            reader.shutdown()
        conn.send("stop")
        target.join(10)
        if target.is_alive():
            target.kill()


def test_an_explicit_short_keepalive_makes_reads_wait_for_the_target(monkeypatch):
    monkeypatch.setenv(nixl.KEEPALIVE_ENV[0], "1s")
    assert not all(_reads_after_an_idle_spell())


def test_by_default_reads_complete_after_an_idle_spell_without_the_target(monkeypatch):
    monkeypatch.setenv(nixl.KEEPALIVE_ENV[0], "unset below")  # so that teardown unsets it again
    monkeypatch.delenv(nixl.KEEPALIVE_ENV[0])
    assert _reads_after_an_idle_spell() == [True] * READS
    assert os.environ[nixl.KEEPALIVE_ENV[0]] == "inf"
