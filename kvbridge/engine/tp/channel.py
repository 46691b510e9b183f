"""The step exchange between a TP engine process and its rank processes: one broadcast, one gather.

`torch.distributed`'s object collectives cost more than the step's messages need:
`broadcast_object_list` is two broadcasts (the sizes, then the bytes) and `gather_object` is an
`all_gather` of the sizes (a ring through every process) and then a gather. Over gloo each of
those is a round of wake-ups of N + 1 processes. What this channel saves a step against the
object collectives is measured by benchmarks/tp_channel.py (benchmarks/README.md, "tp_channel").

A `StepChannel` instead keeps one fixed-size frame per process (`frame_bytes`, 64 KiB): an
8-byte little-endian length, then the message's pickle. The engine process's message is ONE
`dist.broadcast` of its frame; the ranks' replies are ONE `dist.gather` of their frames. A
message longer than a frame sends the rest right after, its size known from the header on both
sides: a second `dist.broadcast` (every rank reads the header, so all of them take part), or
for a reply a `dist.send` from that rank that the engine process `dist.recv`s (the engine
process reads every header; ranks whose reply fitted send nothing more). Every operation is
torch.distributed's own, on the default (gloo, CPU) group; only the framing is ours.

The messages are trusted: they come from this engine's own processes over a group nobody
else can join (its store listens on loopback, its port known only to them).
"""

from __future__ import annotations

import functools
import pickle
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

FRAME_BYTES = 1 << 16
_HEADER = 8
_REST_TAG = 0x6B76  # the point-to-point tag of a reply's overflow ("kv")


class StepChannel:
    """One process's end of the step exchange. Rank 0 of the default group is the engine process."""

    def __init__(self, rank: int, world_size: int, frame_bytes: int = FRAME_BYTES) -> None:
        if frame_bytes <= _HEADER:
            raise ValueError(f"frame_bytes must exceed the {_HEADER}-byte header")
        self.rank, self.world_size, self.frame_bytes = rank, world_size, frame_bytes
        self._frame = torch.zeros(frame_bytes, dtype=torch.uint8)
        self._frame_view = self._frame.numpy().data
        # The engine process receives every rank's frame (its own slot is sent and ignored).
        self._gathered = [torch.zeros(frame_bytes, dtype=torch.uint8) for _ in range(world_size)] \
            if rank == 0 else None

    @property
    def capacity(self) -> int:
        """The longest pickle that fits in one frame."""
        return self.frame_bytes - _HEADER

    def broadcast(self, obj: Any = None) -> Any:
        """Engine process: send `obj` to every rank and return it. Rank: return what it sent."""
        if self.rank == 0:
            data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            rest = self._pack(data)
            dist.broadcast(self._frame, src=0)
            if rest is not None:
                dist.broadcast(rest, src=0)
            return obj
        dist.broadcast(self._frame, src=0)
        return self._unpack(self._frame_view, lambda rest: dist.broadcast(rest, src=0))

    def gather(self, obj: Any = None) -> list[Any] | None:
        """Rank: send `obj` to the engine process; returns None. Engine process: returns every
        process's message in group-rank order (its own entry is None)."""
        if self.rank != 0:
            rest = self._pack(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
            dist.gather(self._frame, None, dst=0)
            if rest is not None:
                dist.send(rest, dst=0, tag=_REST_TAG)
            return None
        assert self._gathered is not None
        dist.gather(self._frame, self._gathered, dst=0)
        out: list[Any] = [None]
        for src in range(1, self.world_size):
            view = self._gathered[src].numpy().data
            out.append(self._unpack(view, functools.partial(_receive_rest, src=src)))
        return out

    # ---- framing ---------------------------------------------------------------------
    def _pack(self, data: bytes) -> torch.Tensor | None:
        """Write `data`'s length and head into this process's frame; return the rest, if any,
        as a tensor to send after the frame."""
        head = min(len(data), self.capacity)
        self._frame_view[:_HEADER] = len(data).to_bytes(_HEADER, "little")
        self._frame_view[_HEADER:_HEADER + head] = data[:head]
        if len(data) == head:
            return None
        return torch.frombuffer(bytearray(memoryview(data)[head:]), dtype=torch.uint8)

    def _unpack(self, frame: memoryview, receive_rest: Callable[[torch.Tensor], object]) -> Any:
        """The message in `frame`, receiving the rest of a long one with `receive_rest(tensor)`."""
        size = int.from_bytes(frame[:_HEADER], "little")
        if size <= self.capacity:
            return pickle.loads(frame[_HEADER:_HEADER + size])
        rest = torch.empty(size - self.capacity, dtype=torch.uint8)
        receive_rest(rest)
        return pickle.loads(bytes(frame[_HEADER:]) + rest.numpy().tobytes())


def _receive_rest(rest: torch.Tensor, src: int) -> None:
    """The rest of a long message from rank `src`, after its frame."""
    dist.recv(rest, src=src, tag=_REST_TAG)
