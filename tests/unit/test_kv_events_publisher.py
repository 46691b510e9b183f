"""The publisher over real ZMQ on 127.0.0.1 (ports the OS picks): vLLM's three frames, the replay
ROUTER's answers and end marker, a subscriber that fills a relay's gaps by replay, a full queue
counted and seen as a gap, a replay that never answers, shutdown that releases the ports; and
`--kv-events-config` parsed with vLLM's field names and clear errors."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import msgspec
import pytest
import zmq

from kvbridge.kv_events.config import DEFAULT_ENDPOINT, KVEventsConfig, binds, parse_kv_events_config
from kvbridge.kv_events.events import BlockStored, DecodedBatch, KVEventBatch, decode_batch, encode_batch
from kvbridge.kv_events.hashing import model_root
from kvbridge.kv_events.index import FleetIndex, InstanceStatus, Problem
from kvbridge.kv_events.publisher import (
    END_SEQ, NullEventPublisher, PublishResult, ZmqEventPublisher, make_publisher)
from kvbridge.kv_events.subscriber import EventSubscriber
from tests.kv_events_relay import DROP, GARBLE, Relay

pytestmark = pytest.mark.timeout(60)
LOOPBACK = "tcp://127.0.0.1:*"
BS = 4


def config(**kwargs: object) -> KVEventsConfig:
    fields: dict[str, object] = {"enable_kv_cache_events": True, "endpoint": LOOPBACK,
                                 "replay_endpoint": LOOPBACK, "topic": "kv"}
    return KVEventsConfig.model_validate({**fields, **kwargs})


def batch(*hashes: int) -> KVEventBatch:
    event = BlockStored(block_hashes=list(hashes), parent_block_hash=None, token_ids=[0] * (BS * len(hashes)),
                        block_size=BS, lora_id=None, medium="GPU", lora_name=None)
    return KVEventBatch(ts=time.time(), events=[event] if hashes else [])


@pytest.fixture
def publisher() -> Iterator[ZmqEventPublisher]:
    pub = ZmqEventPublisher(config(), put_timeout_s=0.05)
    yield pub
    pub.shutdown(timeout_s=2.0)


@pytest.fixture
def sub_socket() -> Iterator[zmq.Socket[bytes]]:
    sock = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.SUBSCRIBE, b"kv")
    yield sock
    sock.close(linger=0)


def until(condition: Callable[[], bool], step: Callable[[], object], timeout_s: float = 5.0) -> None:
    """Run `step` (itself a bounded wait: a poll) until `condition` holds; fail after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        step()


def receive_first(pub: ZmqEventPublisher, sock: zmq.Socket[bytes]) -> list[bytes]:
    """Publish empty batches until the subscription is live (ZMQ's slow joiner); the first received."""
    got: list[list[bytes]] = []

    def step() -> None:
        pub.publish(batch())
        if sock.poll(50):
            got.append(sock.recv_multipart())
    until(lambda: bool(got), step)
    return got[0]


def test_messages_are_vllms_three_frames_topic_seq_payload(publisher, sub_socket):
    sub_socket.connect(publisher.endpoint)
    received = [receive_first(publisher, sub_socket)]
    publisher.publish(batch(1, 2))
    publisher.publish(KVEventBatch(ts=1.0, events=[], data_parallel_rank=3))

    def rank(message: list[bytes]) -> int | None:
        decoded = decode_batch(message[2])
        assert isinstance(decoded, DecodedBatch)
        return decoded.data_parallel_rank
    until(lambda: rank(received[-1]) == 3,
          lambda: sub_socket.poll(100) and received.append(sub_socket.recv_multipart()))
    stored, last = received[-2:]
    assert [len(m) for m in received] == [3] * len(received) and stored[0] == last[0] == b"kv"
    assert len(stored[1]) == 8 and int.from_bytes(last[1], "big") == int.from_bytes(stored[1], "big") + 1
    assert rank(stored) == 0  # the publisher's rank filled in where the batch had none, as vLLM does
    decoded = decode_batch(stored[2])
    assert isinstance(decoded, DecodedBatch) and decoded.events == tuple(batch(1, 2).events)


def replay(endpoint: str, start: int) -> list[list[bytes]]:
    """One replay request over a DEALER; every answer up to and with the end marker."""
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    try:
        dealer.connect(endpoint)
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        answers: list[list[bytes]] = []
        until(lambda: bool(answers) and answers[-1][2] == END_SEQ,
              lambda: dealer.poll(200) and answers.append(dealer.recv_multipart()))
        return answers
    finally:
        dealer.close(linger=0)


def test_replay_answers_every_kept_batch_from_the_seq_asked_then_the_end_marker(publisher):
    for i in range(5):
        assert publisher.publish(batch(i)) is PublishResult.QUEUED
    until(lambda: publisher.stats().published == 5, lambda: threading.Event().wait(0.01))
    answers = replay(publisher.replay_endpoint, 0)
    assert [int.from_bytes(a[2], "big") for a in answers[:-1]] == [0, 1, 2, 3, 4]  # seqs count from 0
    assert all(len(a) == 4 and a[0] == b"" and a[1] == b"kv" for a in answers[:-1])
    assert answers[2][3] == encode_batch(msgspec.structs.replace(batch(2), ts=decode_ts(answers[2][3]),
                                                                 data_parallel_rank=0))
    assert answers[-1] == [b"", b"", b"\xff" * 8, b""]  # vLLM's end marker: seq -1, empty payload
    assert [int.from_bytes(a[2], "big") for a in replay(publisher.replay_endpoint, 3)[:-1]] == [3, 4]
    assert replay(publisher.replay_endpoint, 9)[0][2] == END_SEQ  # nothing that late: the marker alone


def test_a_replay_request_of_the_wrong_shape_is_counted_and_ignored(publisher):
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    try:
        dealer.connect(publisher.replay_endpoint)
        dealer.send_multipart([b"", b"bad"])
        until(lambda: publisher.stats().replay_invalid == 1, lambda: dealer.poll(20))
    finally:
        dealer.close(linger=0)
    assert publisher.publish(batch(1)) is PublishResult.QUEUED


def decode_ts(payload: bytes) -> float:
    decoded = decode_batch(payload)
    assert isinstance(decoded, DecodedBatch)
    return decoded.ts


def test_a_subscriber_fills_the_gaps_of_a_lossy_relay_by_replay(publisher):
    index = FleetIndex(model_root("m"), BS)
    subscriber = None
    relay = Relay(publisher.endpoint, lambda seq: DROP if seq in (30, 31, 40) else GARBLE if seq == 35 else None)
    try:
        subscriber = EventSubscriber("d0", index, relay.endpoint, publisher.replay_endpoint, topic="kv",
                                     replay_timeout_s=2.0)
        sent = [0]  # batches published: the next one's seq

        def publish(b: KVEventBatch) -> None:
            assert publisher.publish(b) is PublishResult.QUEUED
            sent[0] += 1
        # warm up until both hops carry messages (empty batches), then stores of hash 100 + seq
        until(lambda: index.status("d0") is InstanceStatus.LIVE, lambda: (publish(batch()), subscriber.run_once(0.05)))
        start, warm_replays = sent[0], subscriber.replays
        assert start < 30
        # one fault per phase, so that each has its own replay: a gap, a garbled payload, a gap
        for end in (33, 37, 59):
            while sent[0] <= end:
                publish(batch(100 + sent[0]))
            until(lambda: index.view("d0").last_seq == end, lambda: subscriber.run_once(0.1))
        view = index.view("d0")
        assert view.complete and view.status is InstanceStatus.LIVE
        assert index.held_blocks("d0")[0] == frozenset(100 + s for s in range(start, 60))
        assert view.problems == {Problem.GAP: 2, Problem.UNDECODABLE: 1}
        assert subscriber.replays - warm_replays == 3 and subscriber.replays_failed == 0
    finally:
        relay.close()
        if subscriber is not None:
            subscriber.close()


def test_a_late_subscriber_replays_from_0_and_ends_complete(publisher):
    for i in range(10):
        publisher.publish(batch(i))
    until(lambda: publisher.stats().published == 10, lambda: threading.Event().wait(0.01))
    index = FleetIndex(model_root("m"), BS)
    subscriber = EventSubscriber("d0", index, publisher.endpoint, publisher.replay_endpoint, topic="kv")
    try:
        until(lambda: (index.view("d0").last_seq or 0) >= 10,
              lambda: (publisher.publish(batch()), subscriber.run_once(0.05)))
        assert subscriber.replays == 1 and index.view("d0").problems == {}
        assert index.view("d0").complete and index.held_blocks("d0")[0] == frozenset(range(10))
    finally:
        subscriber.close()


def test_a_full_queue_is_counted_and_its_dropped_batches_are_gaps(sub_socket):
    """max_queue_size 1 and no wait: a burst overflows the queue. Every publish call takes a seq,
    sent or not, so the subscriber sees a hole exactly where each dropped batch was."""
    pub = ZmqEventPublisher(config(max_queue_size=1), put_timeout_s=0.0)
    results: list[PublishResult] = []
    received: list[int] = []

    def receive(timeout_ms: int) -> None:
        if sub_socket.poll(timeout_ms):
            received.append(int.from_bytes(sub_socket.recv_multipart()[1], "big"))
    try:
        sub_socket.connect(pub.endpoint)
        until(lambda: bool(received), lambda: (results.append(pub.publish(batch())), receive(50)))
        results += [pub.publish(batch(1)) for _ in range(3000)]
        until(lambda: results[-1] is PublishResult.QUEUED,  # a last batch sent: trailing drops show
              lambda: (results.append(pub.publish(batch())), receive(10)))
        until(lambda: received[-1] == len(results) - 1, lambda: receive(100))
        dropped = results.count(PublishResult.DROPPED_QUEUE_FULL)
        stats = pub.stats()
        assert dropped > 0 and stats.dropped_queue_full == dropped and stats.queue_full >= dropped
        missing = set(range(received[0], len(results))) - set(received)
        assert missing == {i for i, r in enumerate(results) if i >= received[0] and r is PublishResult.DROPPED_QUEUE_FULL}
    finally:
        assert pub.shutdown(timeout_s=2.0).clean


def test_a_replay_that_never_answers_fails_in_time_and_drops_the_history(publisher):
    silent = zmq.Context.instance().socket(zmq.ROUTER)  # bound, never answers
    silent.bind(LOOPBACK)
    publisher.publish(batch(1))  # sent before anyone subscribed: the first seq heard is past 0
    until(lambda: publisher.stats().published == 1, lambda: threading.Event().wait(0.01))
    index = FleetIndex(model_root("m"), BS)
    subscriber = EventSubscriber("d0", index, publisher.endpoint, silent.getsockopt(zmq.LAST_ENDPOINT).decode(),  # type: ignore[union-attr]
                                 topic="kv", replay_timeout_s=0.2)
    try:
        until(lambda: subscriber.replays_failed >= 1 and index.status("d0") is InstanceStatus.LIVE,
              lambda: (publisher.publish(batch(2)), subscriber.run_once(0.05)))
        view = index.view("d0")
        assert not view.complete and view.problems[Problem.REPLAY_FAILED] >= 1
    finally:
        subscriber.close()
        silent.close(linger=0)


def test_shutdown_sends_what_is_queued_then_releases_both_ports():
    pub = ZmqEventPublisher(config())
    for i in range(100):
        pub.publish(batch(i))
    result = pub.shutdown(timeout_s=2.0)
    assert result.clean and result.unsent == 0 and pub.stats().published == 100
    assert pub.publish(batch(1)) is PublishResult.CLOSED
    # ZMQ closes sockets in its I/O thread, so the ports come free just after: bind them again
    rebound: list[ZmqEventPublisher] = []

    def try_bind() -> None:
        try:
            rebound.append(ZmqEventPublisher(config(endpoint=pub.endpoint, replay_endpoint=pub.replay_endpoint)))
        except zmq.ZMQError:
            threading.Event().wait(0.02)  # the I/O thread's close is under way
    until(lambda: bool(rebound), try_bind, timeout_s=2.0)
    assert rebound[0].shutdown(timeout_s=2.0).clean


def test_a_bad_endpoint_raises_in_the_constructor_and_leaves_nothing_open():
    taken = zmq.Context.instance().socket(zmq.PUB)
    taken.bind(LOOPBACK)
    try:
        endpoint = taken.getsockopt(zmq.LAST_ENDPOINT).decode()  # type: ignore[union-attr]
        with pytest.raises(zmq.ZMQError):
            ZmqEventPublisher(config(replay_endpoint=endpoint))
    finally:
        taken.close(linger=0)


def test_disabled_or_null_configs_give_the_null_publisher():
    for text in ('{}', '{"enable_kv_cache_events": false}', '{"enable_kv_cache_events": true, "publisher": "null"}'):
        pub = make_publisher(parse_kv_events_config(text))
        assert isinstance(pub, NullEventPublisher) and pub.publish(batch(1)) is PublishResult.DISABLED
    assert make_publisher(None).shutdown().clean


def test_vllms_json_parses_with_its_defaults_but_loopback():
    cfg = parse_kv_events_config('{"enable_kv_cache_events": true, "topic": "kv-events"}')
    assert cfg.publisher == "zmq" and cfg.publishes and cfg.topic == "kv-events"
    assert (cfg.endpoint, cfg.replay_endpoint, cfg.buffer_steps, cfg.hwm, cfg.max_queue_size) == \
        (DEFAULT_ENDPOINT, None, 10_000, 100_000, 100_000)
    assert DEFAULT_ENDPOINT == "tcp://127.0.0.1:*" and binds(DEFAULT_ENDPOINT)


@pytest.mark.parametrize("endpoint, bind", [("tcp://*:5557", True), ("tcp://127.0.0.1:*", True),
                                            ("tcp://[::]:5557", True), ("ipc:///tmp/kv", True),
                                            ("inproc://kv", True), ("tcp://10.0.0.1:5557", False),
                                            ("tcp://127.0.0.1:5557", False)])
def test_the_bind_rule_is_vllms(endpoint, bind):
    assert binds(endpoint) is bind


@pytest.mark.parametrize("text, message", [
    ('{"enable_kv_cache_events": true, "endpont": "tcp://*:1"}', "endpont: Extra inputs are not permitted"),
    ('{"enable_kv_cache_events": "yes"}', "enable_kv_cache_events: Input should be a valid boolean"),
    ('{"publisher": "kafka"}', "publisher: Input should be 'null' or 'zmq'"),
    ('{"endpoint": "http://x"}', "endpoint: Value error, 'http://x' is not a ZMQ endpoint"),
    ('{"buffer_steps": 0}', "buffer_steps: Input should be greater than or equal to 1"),
    ('{"hwm": -1}', "hwm: Input should be greater than or equal to 0"),
    ('{"max_queue_size": "10"}', "max_queue_size: Input should be a valid integer"),
    ('{"enable_kv_cache_events": tru', "--kv-events-config: (json): Invalid JSON"),
])
def test_bad_configs_name_the_field_and_the_problem(text, message):
    with pytest.raises(ValueError) as err:
        parse_kv_events_config(text)
    assert str(err.value).startswith("--kv-events-config: ") and message.split("--kv-events-config: ")[-1] in str(err.value)


def test_a_socket_error_in_the_subscriber_loop_is_counted_not_raised(publisher):
    subscriber = EventSubscriber("d0", FleetIndex(model_root("m"), BS), publisher.endpoint, publisher.replay_endpoint)
    subscriber.close()
    assert subscriber.run_once(0.01) == 0 and subscriber.socket_errors == 1


def test_heartbeats_keep_an_idle_instance_heard_and_its_seqs_moving():
    pub = ZmqEventPublisher(config(), heartbeat_s=0.05)
    index = FleetIndex(model_root("m"), BS)
    subscriber = EventSubscriber("d0", index, pub.endpoint, pub.replay_endpoint, topic="kv")
    try:
        until(lambda: (index.view("d0").last_seq or 0) >= 3, lambda: subscriber.run_once(0.1))
        assert index.status("d0") is InstanceStatus.LIVE and index.view("d0").blocks == {}
    finally:
        subscriber.close()
        assert pub.shutdown(timeout_s=2.0).clean


def test_a_subscriber_thread_runs_until_stopped(publisher):
    index = FleetIndex(model_root("m"), BS)
    subscriber = EventSubscriber("d0", index, publisher.endpoint, publisher.replay_endpoint, topic="kv")
    stop = threading.Event()
    thread = threading.Thread(target=subscriber.run_until, args=(stop, 0.02), daemon=True)
    thread.start()
    try:
        until(lambda: 7 in index.held_blocks("d0").get(0, frozenset()),
              lambda: (publisher.publish(batch(7)), stop.wait(0.02)))
    finally:
        stop.set()
        thread.join(timeout=2.0)
        subscriber.close()
    assert not thread.is_alive()
