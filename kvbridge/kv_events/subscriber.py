"""One instance's KV event stream into the fleet index: a SUB socket for the live messages and a
DEALER socket that asks the instance's replay ROUTER for what a gap lost.

Replay protocol (vLLM's): the request is `[b"", start_seq(8 bytes)]`; the answers are
`[b"", topic, seq, payload]` (vLLM 0.33; before it `[b"", seq, payload]`, also read) for every
kept batch from start_seq, then the end marker, a sequence frame of -1 (8 bytes 0xff) with an
empty payload. A replay that does not end within `replay_timeout_s` fails (the index then drops
the instance's history and rebuilds it); its DEALER is replaced, so late answers to it can never
be read as answers to the next request.

Who calls: one thread per instance runs `run_once` in a loop (each call waits at most its
timeout), then `close`. The subscriber owns both sockets.
"""

from __future__ import annotations

import logging
import threading
import time

import zmq

from kvbridge.kv_events.index import FleetIndex, Outcome
from kvbridge.kv_events.publisher import END_SEQ, SEQ_BYTES

logger = logging.getLogger(__name__)


class EventSubscriber:
    def __init__(self, instance: str, index: FleetIndex, endpoint: str, replay_endpoint: str | None = None,
                 topic: str = "", context: zmq.Context[zmq.Socket[bytes]] | None = None,
                 replay_timeout_s: float = 1.0, max_per_call: int = 1000, rcvhwm: int = 100_000) -> None:
        self.instance = instance
        self._index = index
        self._ctx = context or zmq.Context.instance()
        self._replay_endpoint = replay_endpoint
        self._replay_timeout_s = replay_timeout_s
        self._max_per_call = max_per_call
        self.replays = 0  # replay requests sent
        self.replays_failed = 0
        self.socket_errors = 0
        self._sub = self._ctx.socket(zmq.SUB)
        self._dealer: zmq.Socket[bytes] | None = None
        try:
            self._sub.setsockopt(zmq.RCVHWM, rcvhwm)
            self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode("utf-8"))
            self._sub.connect(endpoint)
            self._dealer = self._new_dealer()
        except BaseException:
            self.close()
            raise

    def run_once(self, timeout_s: float) -> int:
        """Wait up to `timeout_s` for a message, ingest those waiting (at most max_per_call),
        running a replay when the index asks for one. Returns the messages ingested. A socket
        error is logged (once) and counted in `socket_errors`, never raised: the caller's loop goes on."""
        n = 0
        try:
            if not self._sub.poll(int(timeout_s * 1000)):
                return 0
            while n < self._max_per_call and self._sub.poll(0):
                result = self._index.ingest(self.instance, self._sub.recv_multipart(flags=zmq.NOBLOCK))
                n += 1
                if result.outcome is Outcome.NEEDS_REPLAY and result.replay_from is not None:
                    self._replay(result.replay_from)
        except zmq.ZMQError as e:
            self.socket_errors += 1
            if self.socket_errors == 1:
                logger.warning("kv events from %s: socket error %s (logged once)", self.instance, e)
        return n

    def catch_up(self) -> None:
        """Replay what the publisher kept when the index has applied nothing of this instance yet
        (FleetIndex.begin_catch_up); a no-op otherwise. Bounded by the replay timeout."""
        start = self._index.begin_catch_up(self.instance)
        if start is not None:
            self._replay(start)

    def run_until(self, stop: threading.Event, poll_s: float = 0.1) -> None:
        """The subscriber thread's loop: `run_once` until `stop` is set (noticed within poll_s plus
        one replay's timeout). Does not close: the owner does, after joining the thread."""
        while not stop.is_set():
            self.run_once(poll_s)

    def close(self) -> None:
        self._sub.close(linger=0)
        if self._dealer is not None:
            self._dealer.close(linger=0)
            self._dealer = None

    def _new_dealer(self) -> zmq.Socket[bytes] | None:
        if self._replay_endpoint is None:
            return None
        dealer = self._ctx.socket(zmq.DEALER)
        try:
            dealer.connect(self._replay_endpoint)
        except BaseException:
            dealer.close(linger=0)
            raise
        return dealer

    def _replay(self, start: int) -> None:
        self.replays += 1
        ok = self._dealer is not None and self._run_replay(self._dealer, start)
        if not ok:
            self.replays_failed += 1
            if self._dealer is not None:  # answers may still come: a fresh socket never sees them
                self._dealer.close(linger=0)
                self._dealer = None
                self._dealer = self._new_dealer()
        self._index.end_replay(self.instance, ok=ok)

    def _run_replay(self, dealer: zmq.Socket[bytes], start: int) -> bool:
        """Request from `start` and feed the answers to the index; True when the end marker came."""
        try:
            dealer.send_multipart((b"", start.to_bytes(SEQ_BYTES, "big")), flags=zmq.NOBLOCK)
        except zmq.Again:
            return False
        deadline = time.monotonic() + self._replay_timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if not dealer.poll(max(1, int(left * 1000))):
                return False
            frames = dealer.recv_multipart(flags=zmq.NOBLOCK)
            answer = _replay_answer(frames)
            if answer is None:
                continue  # not an answer of the protocol: skip it
            seq_bytes, payload = answer
            if seq_bytes == END_SEQ and not payload:
                return True
            self._index.ingest_replay(self.instance, int.from_bytes(seq_bytes, "big"), payload)
        return False


def _replay_answer(frames: list[bytes]) -> tuple[bytes, bytes] | None:
    """(seq frame, payload) of a DEALER-side answer, either vLLM layout; None if neither."""
    if not frames or frames[0] != b"":
        return None
    rest = frames[1:]
    if len(rest) == 3:  # vLLM 0.33: topic, seq, payload
        rest = rest[1:]
    if len(rest) != 2 or len(rest[0]) != SEQ_BYTES:
        return None
    return rest[0], rest[1]
