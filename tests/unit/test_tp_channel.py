"""StepChannel: the TP step's one broadcast and one gather, with real gloo process groups.

Three spawned processes (group rank 0 plays the engine process) run the same script of
exchanges; every process checks what it received, so a wrong byte anywhere fails the spawn.
A small frame makes messages on both sides of the frame boundary cheap to produce: every
pickle length from well under one frame to well over it, in the broadcast and in the gather,
with ranks whose replies overflow beside ranks whose replies fit."""

from __future__ import annotations

import datetime
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kvbridge.engine.tp.channel import StepChannel

WORLD = 3
FRAME = 64


def _message(n: int, rank: int) -> bytes:
    return bytes((rank * 31 + i) % 251 for i in range(n))


def _script(rank: int, store: str) -> None:
    torch.set_num_threads(1)
    # A framing bug desynchronises the processes: a collective then times out instead of hanging.
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=30))
    small = StepChannel(rank, WORLD, frame_bytes=FRAME)
    # Pickle lengths from 20 to 120 bytes: below, at and above the frame's capacity (56).
    for n in range(5, 105):
        sent = {"n": n, "data": _message(n, 0)} if rank == 0 else None
        got = small.broadcast(sent)
        assert got == {"n": n, "data": _message(n, 0)}, (rank, n)
        # Rank 1's reply grows with n, rank 2's shrinks: every mix of fitting and overflowing.
        size = n if rank == 1 else 110 - n
        replies = small.gather((rank, _message(size, rank)) if rank else None)
        if rank == 0:
            assert replies == [None, (1, _message(n, 1)), (2, _message(110 - n, 2))], n
        else:
            assert replies is None
    # Much larger than a frame, both ways, and a collective of another group in between (a
    # TP step's all_reduces run between the step's broadcast and gather).
    ranks_group = dist.new_group(ranks=[1, 2])
    for step in range(3):
        big = StepChannel.__name__.encode() * (40_000 + step)
        assert small.broadcast(big if rank == 0 else None) == big
        if rank:
            t = torch.full((4,), float(rank))
            dist.all_reduce(t, group=ranks_group)
            assert t.tolist() == [3.0] * 4
        reply = big * rank if rank != 2 or step != 1 else None
        replies = small.gather(reply)
        if rank == 0:
            assert replies == [None, big, None if step == 1 else big * 2]
    # The default frame: a message that fits and one that does not.
    default = StepChannel(rank, WORLD)
    for payload in ({"x": list(range(100))}, list(range(default.capacity))):
        assert default.broadcast(payload if rank == 0 else None) == payload
        replies = default.gather(payload if rank else None)
        assert replies == ([None, payload, payload] if rank == 0 else None)
    dist.barrier()
    dist.destroy_process_group()


def test_messages_of_every_size_cross_intact(tmp_path):
    mp.spawn(_script, args=(str(tmp_path / "store"),), nprocs=WORLD, join=True)


def test_frame_must_hold_more_than_its_header():
    with pytest.raises(ValueError, match="header"):
        StepChannel(0, 2, frame_bytes=8)


def test_capacity_is_the_frame_less_its_header():
    channel = StepChannel(1, 2, frame_bytes=100)
    assert channel.capacity == 92
