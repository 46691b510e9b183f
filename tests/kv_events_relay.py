"""A fault-injecting hop for KV event streams: subscribes to a publisher's live stream (ZMQ PUB,
three frames: topic, 8-byte seq, msgpack EventBatch) and republishes it on a PUB of its own, doing
to each message what `fault(seq)` says. The replay endpoint is not relayed: a subscriber asks the
publisher itself for what it missed (as a router behind a lossy network would)."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable

import msgspec
import zmq

LOOPBACK = "tcp://127.0.0.1:*"

# What can happen to one message on its way (None: it passes unchanged).
DROP = "drop"  # lost
GARBLE = "garble"  # its payload cut short: not an EventBatch
FRAMES = "frames"  # the payload frame lost: two frames
SEQ_FRAME = "seq_frame"  # a sequence frame of 7 bytes
DUPLICATE = "duplicate"  # delivered twice
UNKNOWN = "unknown"  # an event of a type nobody knows appended to its batch (a newer publisher's)
FAULTS = (DROP, GARBLE, FRAMES, SEQ_FRAME, DUPLICATE, UNKNOWN)


def with_unknown_event(payload: bytes) -> bytes:
    """The batch with one more event, of a type no decoder knows (map form, as vLLM encodes events)."""
    ts, events, *rest = msgspec.msgpack.decode(payload)
    return msgspec.msgpack.encode([ts, [*events, {"type": "BlockMoved", "block_hashes": [7], "medium": "NVME"}],
                                   *rest])


def cycling_faults(every: int) -> Callable[[int], str | None]:
    """Every `every`-th message gets the next of FAULTS in turn (all of them within 6 * every
    messages, however many there are), the others pass."""
    count = itertools.count()

    def fault(seq: int) -> str | None:
        i = next(count)
        return FAULTS[(i // every) % len(FAULTS)] if i % every == every - 1 else None
    return fault


class Relay:
    def __init__(self, upstream: str, fault: Callable[[int], str | None] = lambda seq: None) -> None:
        ctx = zmq.Context.instance()
        self._in, self._out = ctx.socket(zmq.SUB), ctx.socket(zmq.PUB)
        self._in.setsockopt(zmq.SUBSCRIBE, b"")
        self._in.connect(upstream)
        self._out.bind(LOOPBACK)
        self.endpoint = self._out.getsockopt(zmq.LAST_ENDPOINT).decode()  # type: ignore[union-attr]
        self.fault = fault  # replaced to turn faults on or off; read on the relay's thread
        self.done: dict[str, int] = {}  # faults injected so far, by kind
        self.forwarded = 0  # messages passed on unchanged
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if self._in.poll(20):
                    self._forward(self._in.recv_multipart())
        finally:
            self._in.close(linger=0)
            self._out.close(linger=0)

    def _forward(self, frames: list[bytes]) -> None:
        topic, seq, payload = frames
        kind = self.fault(int.from_bytes(seq, "big"))
        if kind is None:
            self.forwarded += 1
            self._out.send_multipart(frames)
            return
        self.done[kind] = self.done.get(kind, 0) + 1
        if kind == DUPLICATE:
            self._out.send_multipart(frames)
            self._out.send_multipart(frames)
        elif kind == GARBLE:
            self._out.send_multipart([topic, seq, payload[:5]])
        elif kind == FRAMES:
            self._out.send_multipart([topic, seq])
        elif kind == SEQ_FRAME:
            self._out.send_multipart([topic, seq[1:], payload])
        elif kind == UNKNOWN:
            self._out.send_multipart([topic, seq, with_unknown_event(payload)])
        # DROP: nothing

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)
        assert not self._thread.is_alive()
