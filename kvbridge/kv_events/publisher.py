"""Publishing KV event batches the way vLLM's ZmqEventPublisher does (vLLM 0.33.0).

Wire: a ZMQ PUB socket sends each batch as three frames: the topic, the batch's sequence number
(8 bytes, big-endian, from 0, one per batch) and the msgpack EventBatch. The last `buffer_steps`
batches are kept; a ROUTER socket on `replay_endpoint` answers a request `[identity, b"",
start_seq(8 bytes)]` with every kept batch whose seq >= start_seq, each `[identity, b"", topic,
seq, payload]`, then the end marker `[identity, b"", b"", END_SEQ, b""]`, END_SEQ being -1 as 8
signed big-endian bytes (all 0xff). (vLLM before 0.33 sent no topic frame in replay answers;
kvbridge's subscriber reads both.)

Threads: `publish` is called by one producer (the engine's loop) and only enqueues; a thread of
the publisher's own owns both sockets: it sends, keeps the replay buffer, answers replay
requests, and closes the sockets when it ends.

Heartbeats (kvbridge's, off unless `heartbeat_s` is given): after `heartbeat_s` without a batch
the thread sends an empty one (a valid EventBatch, its own seq). A router then tells an idle
instance from a dead one, and sees a lost last batch as a gap at the next heartbeat instead of
at the next event, whenever that comes.

Back-pressure, as vLLM: the queue holds `max_queue_size` batches and `publish` waits for room.
vLLM waits forever; here the wait is bounded (`put_timeout_s`), each full queue met is counted,
and a batch still without room is dropped, counted, and its sequence number skipped, so every
subscriber sees the gap (and resyncs) instead of silently missing blocks. A PUB socket past its
high-water mark drops messages for slow subscribers (ZMQ's rule, no error): they too see a gap.
"""

from __future__ import annotations

import enum
import logging
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass

import msgspec
import zmq

from kvbridge.kv_events.config import KVEventsConfig, binds
from kvbridge.kv_events.events import EventBatch, encode_batch

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
SEQ_BYTES = 8


class PublishResult(str, enum.Enum):
    QUEUED = "queued"
    DROPPED_QUEUE_FULL = "dropped_queue_full"  # no room within put_timeout_s: seq skipped
    CLOSED = "closed"  # shutdown() has begun
    DISABLED = "disabled"  # the null publisher


@dataclass(frozen=True)
class PublisherStats:
    published: int = 0  # batches handed to the PUB socket
    queue_full: int = 0  # publish() calls that found the queue full and had to wait
    dropped_queue_full: int = 0  # of those, batches dropped (their seq skipped)
    send_failed: int = 0  # PUB sends that ZMQ refused (would block)
    replay_requests: int = 0
    replay_invalid: int = 0  # replay requests of the wrong shape (ignored)
    replayed: int = 0  # batches sent in replay answers


@dataclass(frozen=True)
class ShutdownResult:
    clean: bool  # the thread ended in time and every queued batch went out
    unsent: int  # batches still queued when it ended


class EventPublisher(ABC):
    """Who calls: the engine, once per step that produced events, from one thread."""

    @abstractmethod
    def publish(self, batch: EventBatch) -> PublishResult: ...

    @abstractmethod
    def shutdown(self, timeout_s: float = 1.0) -> ShutdownResult: ...

    def stats(self) -> PublisherStats:
        return PublisherStats()


class NullEventPublisher(EventPublisher):
    """Events off (vLLM's default): publishing is a no-op."""

    def publish(self, batch: EventBatch) -> PublishResult:
        return PublishResult.DISABLED

    def shutdown(self, timeout_s: float = 1.0) -> ShutdownResult:
        return ShutdownResult(clean=True, unsent=0)


class ZmqEventPublisher(EventPublisher):
    """The sockets are created and bound in the constructor (a bad endpoint raises zmq.ZMQError
    there, with nothing left open); `endpoint` and `replay_endpoint` then name the addresses
    actually bound (a `*` port resolved), for the router to connect to."""

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0,
                 context: zmq.Context[zmq.Socket[bytes]] | None = None,
                 put_timeout_s: float = 0.1, idle_poll_s: float = 0.02, heartbeat_s: float | None = None) -> None:
        self._rank = data_parallel_rank
        self._topic = config.topic.encode("utf-8")
        self._put_timeout_s = put_timeout_s
        self._idle_poll_s = idle_poll_s
        self._heartbeat_s = heartbeat_s
        # (seqs to skip before it, batch): a dropped batch's seq is skipped right where it was
        # dropped, after everything queued before it, so no subscriber applies a later batch on
        # top of a hole it cannot see.
        self._queue: queue.Queue[tuple[int, EventBatch]] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._lock = threading.Lock()  # the counters the producer writes and stats() reads
        self._pending_skip = 0  # batches dropped since the last one queued (their seqs to skip)
        self._counts: dict[str, int] = {}
        self._closing = threading.Event()
        self._drain_until = 0.0  # set by shutdown(): the thread sends what is queued until then
        ctx = context or zmq.Context.instance()
        self._pub, self._replay = _open_sockets(ctx, config)
        self.endpoint = _bound(self._pub, config.endpoint)
        self.replay_endpoint = (_bound(self._replay, config.replay_endpoint)
                                if self._replay is not None and config.replay_endpoint else None)
        self._thread = threading.Thread(target=self._run, name="kv-events-publisher", daemon=True)
        self._thread.start()

    # ---- the producer's side ------------------------------------------------
    def publish(self, batch: EventBatch) -> PublishResult:
        """Enqueue `batch` (its data_parallel_rank set to this publisher's if None)."""
        if self._closing.is_set():
            return PublishResult.CLOSED
        if batch.data_parallel_rank is None:
            batch = msgspec.structs.replace(batch, data_parallel_rank=self._rank)
        with self._lock:
            item, self._pending_skip = (self._pending_skip, batch), 0
        try:
            self._queue.put_nowait(item)
            return PublishResult.QUEUED
        except queue.Full:
            self._count("queue_full")
        try:
            self._queue.put(item, timeout=self._put_timeout_s)
            return PublishResult.QUEUED
        except queue.Full:
            with self._lock:
                self._pending_skip += item[0] + 1
            self._count("dropped_queue_full")
            if self.stats().dropped_queue_full == 1:  # once; the counter says how often
                logger.warning("kv events: queue full (%d batches), a batch dropped; subscribers see a "
                               "sequence gap (logged once)", self._queue.maxsize)
            return PublishResult.DROPPED_QUEUE_FULL

    def shutdown(self, timeout_s: float = 1.0) -> ShutdownResult:
        """Send what is queued (for up to `timeout_s`), stop the thread; it closes the sockets."""
        self._drain_until = time.monotonic() + 0.8 * timeout_s
        self._closing.set()
        self._thread.join(timeout=timeout_s)
        unsent = self._queue.qsize()
        clean = not self._thread.is_alive() and unsent == 0
        if not clean:
            logger.warning("kv events: publisher stopped with %d batches unsent (thread alive: %s)",
                           unsent, self._thread.is_alive())
        return ShutdownResult(clean=clean, unsent=unsent)

    def stats(self) -> PublisherStats:
        with self._lock:
            return PublisherStats(**self._counts)

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] = self._counts.get(name, 0) + n

    # ---- the thread: owns the sockets -----------------------------------------
    def _run(self) -> None:
        seq = 0
        last_send = time.monotonic()
        try:
            while True:
                self._serve_replays()
                if self._closing.is_set() and (self._queue.empty() or time.monotonic() > self._drain_until):
                    return
                try:
                    skip, batch = self._queue.get(timeout=self._idle_poll_s)
                except queue.Empty:
                    if self._heartbeat_s is None or time.monotonic() - last_send < self._heartbeat_s:
                        continue
                    with self._lock:  # the queue is empty: drops so far come after all it held
                        skip, self._pending_skip = self._pending_skip, 0
                    batch = EventBatch(ts=time.time(), events=[], data_parallel_rank=self._rank)
                seq += skip
                self._send(seq, encode_batch(batch))
                seq += 1
                last_send = time.monotonic()
        except Exception:  # a bug here must not take the engine down: log, stop publishing
            logger.exception("kv events: publisher thread failed; events stop")
        finally:
            self._pub.close(linger=100)  # ms: what was just sent may still leave
            if self._replay is not None:
                self._replay.close(linger=0)

    def _send(self, seq: int, payload: bytes) -> None:
        try:
            self._pub.send_multipart((self._topic, seq.to_bytes(SEQ_BYTES, "big"), payload), flags=zmq.NOBLOCK)
            self._count("published")
        except zmq.Again:
            self._count("send_failed")
        self._buffer.append((seq, payload))  # replayable even if this send failed

    def _serve_replays(self) -> None:
        try:
            while self._replay is not None and self._replay.poll(0):
                self._serve_replay(self._replay.recv_multipart(flags=zmq.NOBLOCK))
        except zmq.ZMQError as e:  # replay is best effort (vLLM's too): publishing goes on
            logger.warning("kv events: replay socket error: %s", e)

    def _serve_replay(self, frames: list[bytes]) -> None:
        self._count("replay_requests")
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != SEQ_BYTES:
            self._count("replay_invalid")
            logger.debug("kv events: invalid replay request of %d frames", len(frames))
            return
        self._answer_replay(frames[0], int.from_bytes(frames[2], "big"))

    def _answer_replay(self, client: bytes, start: int) -> None:
        assert self._replay is not None
        sent = 0
        try:
            for seq, payload in self._buffer:
                if seq >= start:
                    self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(SEQ_BYTES, "big"), payload),
                                                flags=zmq.NOBLOCK)
                    sent += 1
            self._replay.send_multipart((client, b"", b"", END_SEQ, b""), flags=zmq.NOBLOCK)
        except zmq.Again:  # the client's queue is full: it times out and resyncs
            logger.debug("kv events: replay answer cut short after %d batches", sent)
        self._count("replayed", sent)


def _open_sockets(ctx: zmq.Context[zmq.Socket[bytes]],
                  config: KVEventsConfig) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes] | None]:
    """PUB bound or connected by vLLM's rule, ROUTER bound; on any error nothing stays open."""
    pub = ctx.socket(zmq.PUB)
    replay: zmq.Socket[bytes] | None = None
    try:
        pub.set_hwm(config.hwm)
        pub.bind(config.endpoint) if binds(config.endpoint) else pub.connect(config.endpoint)
        if config.replay_endpoint is not None:
            replay = ctx.socket(zmq.ROUTER)
            # vLLM: room for a whole replay and its marker, twice over (ZMQ's lazy HWM accounting).
            replay.setsockopt(zmq.SNDHWM, 2 * (config.buffer_steps + 1))
            replay.bind(config.replay_endpoint)
        return pub, replay
    except BaseException:
        pub.close(linger=0)
        if replay is not None:
            replay.close(linger=0)
        raise


def _bound(sock: zmq.Socket[bytes], configured: str) -> str:
    """The address a bound socket really has (`*` ports resolved); a connected one's as given."""
    if not binds(configured):
        return configured
    last = sock.getsockopt(zmq.LAST_ENDPOINT)
    return last.decode() if isinstance(last, bytes) else configured


def make_publisher(config: KVEventsConfig | None, data_parallel_rank: int = 0) -> EventPublisher:
    """vLLM's EventPublisherFactory.create: events off, or publisher "null", give the null one."""
    if config is None or not config.publishes:
        return NullEventPublisher()
    return ZmqEventPublisher(config, data_parallel_rank)
