"""Specification of the handshake side channel (kvbridge.kv_transfer.side_channel.handshake).

Everything network-facing runs over real sockets on 127.0.0.1 with OS-chosen ports.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import socket
import struct
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbridge.config import EngineConfig
from kvbridge.engine.kv_connector_factory import compatibility_of
from kvbridge.kv_transfer.side_channel.handshake import (
    KVBRIDGE_CONNECTOR_VERSION,
    PAYLOAD_MAGIC,
    CompatibilityInfo,
    HandshakeDecodeError,
    HandshakeEngineMismatch,
    HandshakeError,
    HandshakeFailureKind,
    HandshakeHashMismatch,
    HandshakeLayoutMismatch,
    HandshakeMetadata,
    HandshakePeerError,
    HandshakeRefused,
    HandshakeTimeout,
    HandshakeVersionMismatch,
    RankLayout,
    decode_payload,
    encode_payload,
)
from kvbridge.kv_transfer.side_channel.handshake_manager import HandshakeManager, is_trusted_host
from kvbridge.kv_transfer.side_channel.server import HandlerRefusal, SideChannelServer
from kvbridge.kv_transfer.side_channel.client import HandshakeClient
from kvbridge.kv_transfer.side_channel.frames import FRAME_MAGIC, FrameError, decode_frame, encode_frame
from kvbridge.shape.model_config import MLAConfig, ModelArchConfig, ModelFamily

pytestmark = pytest.mark.timeout(120)

HOST = "127.0.0.1"
COMPAT = CompatibilityInfo(model="SmolLM2-135M-Instruct", dtype="float32", num_kv_heads=3,
                           head_size=64, num_layers=30, cache_dtype="float32")
HASH = COMPAT.hash()


def rank_layout(tp_rank: int = 0, **changes: object) -> RankLayout:
    fields: dict = dict(tp_size=2, tp_rank=tp_rank, region_base_addrs=(1 << 20, 2 << 20),
                        block_len_bytes=(4096, 4096), num_blocks=64, block_size=16,
                        kv_layout="HND", kv_head_start=2 * tp_rank, num_kv_heads=2,
                        physical_blocks_per_logical=1)
    fields.update(changes)
    return RankLayout(**fields)


def prefill_metadata(tp_rank: int = 0, engine_id: str = "prefill-0",
                     **layout: object) -> HandshakeMetadata:
    return HandshakeMetadata(engine_id=engine_id, backend="fake",
                             agent_metadata=bytes(range(256)) + bytes([tp_rank]),
                             layout=rank_layout(tp_rank, **layout))


PAYLOADS = {rank: encode_payload(prefill_metadata(rank), COMPAT) for rank in (0, 1)}
HEADER_LEN = 4 + 2 + 32 + 4


def reversion(payload: bytes, version: int) -> bytes:
    return payload[:4] + struct.pack("!H", version) + payload[6:]


def rehash(payload: bytes, new_hash: bytes) -> bytes:
    return payload[:6] + new_hash + payload[38:]


def with_body(body: bytes, compat_hash: bytes = HASH) -> bytes:
    header = struct.pack("!H32sI", KVBRIDGE_CONNECTOR_VERSION, compat_hash, len(body))
    return PAYLOAD_MAGIC + header + body


def dead_port() -> int:
    """A loopback port on which nothing listens (bound by the OS, then released)."""
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


@pytest.fixture
def prefill_side_channel() -> Iterator[SideChannelServer]:
    with SideChannelServer(PAYLOADS, HOST, 0, read_timeout_s=0.5) as server:
        yield server


def fetch_over_loopback(payload: bytes, **decode_kwargs: object) -> HandshakeMetadata:
    """Serve `payload` for rank 0 on a real side channel; D fetches and decodes it."""
    with SideChannelServer({0: payload}, HOST) as server:
        data = HandshakeClient().fetch(HOST, server.port, 0, timeout=2.0)
    assert data == payload
    return decode_payload(data, HASH, **decode_kwargs)  # type: ignore[arg-type]


# ---- payload: what D learns and what it refuses -------------------------------------


def test_decode_side_fetches_identical_metadata_for_each_rank(prefill_side_channel) -> None:
    client = HandshakeClient()
    for rank in (0, 1):
        data = client.fetch(HOST, prefill_side_channel.port, rank, timeout=2.0)
        got = decode_payload(data, HASH, "prefill-0", rank_layout(0))
        assert got == prefill_metadata(rank)
    assert prefill_side_channel.num_served == 2 and prefill_side_channel.num_refused == 0


def test_compatibility_hash_changes_with_every_input() -> None:
    variants = [dict(model="other"), dict(dtype="bfloat16"), dict(num_kv_heads=4),
                dict(head_size=128), dict(num_layers=31), dict(cache_dtype="float16"),
                dict(attention_backend="flash"), dict(use_mla=True),
                dict(kv_cache_groups=("full_attention", "sliding_window")),
                dict(connector_version=KVBRIDGE_CONNECTOR_VERSION + 1)]
    hashes = {CompatibilityInfo(**{**COMPAT.__dict__, **v}).hash() for v in variants}
    assert len(hashes) == len(variants) and HASH not in hashes
    assert len(HASH) == 32 and HASH == CompatibilityInfo(**COMPAT.__dict__).hash()
    assert not hasattr(COMPAT, "block_size") and not hasattr(COMPAT, "tp_size")


LLAMA_ARCH = ModelArchConfig(ModelFamily.LLAMA, vocab_size=64, hidden_size=576, intermediate_size=1536,
                             num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64)
MLA_ARCH = ModelArchConfig(ModelFamily.DEEPSEEK_V2, vocab_size=64, hidden_size=1024, intermediate_size=2048,
                           num_layers=4, num_heads=16, num_kv_heads=16, head_dim=192,
                           mla=MLAConfig(kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128,
                                         qk_rope_head_dim=64, v_head_dim=128))


def test_compatibility_describes_what_the_kv_cache_holds() -> None:
    config = EngineConfig()
    mla = compatibility_of(config, MLA_ARCH, "tiny-deepseek")
    # MLA: one latent "head" (kv_lora_rank + qk_rope_head_dim values), not 16 K/V heads of 192.
    assert (mla.use_mla, mla.num_kv_heads, mla.head_size, mla.kv_cache_groups) == (True, 1, 576, ("mla",))
    llama = compatibility_of(config, LLAMA_ARCH, "SmolLM2-135M-Instruct")
    assert (llama.use_mla, llama.num_kv_heads, llama.head_size, llama.kv_cache_groups) == \
        (False, 3, 64, ("full_attention",))
    assert llama == COMPAT and llama.hash() == HASH  # a non-MLA model's hash is what it was before MLA
    assert compatibility_of(config, MLA_ARCH, "SmolLM2-135M-Instruct").hash() != HASH


def test_version_mismatch_is_reported_before_the_hash_is_looked_at() -> None:
    payload = rehash(reversion(PAYLOADS[0], KVBRIDGE_CONNECTOR_VERSION + 1), b"\xff" * 32)
    with pytest.raises(HandshakeVersionMismatch) as info:
        fetch_over_loopback(payload)
    assert info.value.kind is HandshakeFailureKind.VERSION_MISMATCH


def test_hash_mismatch_is_reported_before_the_body_is_decoded() -> None:
    undecodable = with_body(b"\xff\xfe not json at all", compat_hash=b"\x00" * 32)
    with pytest.raises(HandshakeHashMismatch) as info:
        fetch_over_loopback(undecodable)
    assert info.value.kind is HandshakeFailureKind.HASH_MISMATCH
    with pytest.raises(HandshakeDecodeError):  # the same body with the right hash: undecodable
        fetch_over_loopback(with_body(b"\xff\xfe not json at all"))


def served_by(compat: CompatibilityInfo | bytes) -> bytes:
    """Rank 0's payload as a P whose compatibility is `compat` (a bare hash: no description) serves it."""
    return encode_payload(prefill_metadata(0), compat)


def hash_mismatch(payload: bytes, local: CompatibilityInfo | bytes = COMPAT) -> str:
    """D (compatibility `local`) fetches `payload` over a real side channel; the refusal's message."""
    with SideChannelServer({0: payload}, HOST) as server:
        data = HandshakeClient().fetch(HOST, server.port, 0, timeout=2.0)
    with pytest.raises(HandshakeHashMismatch) as info:
        decode_payload(data, local, "prefill-0", rank_layout(0))
    assert info.value.kind is HandshakeFailureKind.HASH_MISMATCH
    return str(info.value)


def test_a_hash_mismatch_names_the_fields_that_differ() -> None:
    peer = dataclasses.replace(COMPAT, dtype="bfloat16", num_layers=31)
    message = hash_mismatch(served_by(peer))
    assert 'dtype (peer "bfloat16", local "float32")' in message
    assert "num_layers (peer 31, local 30)" in message
    assert "model" not in message.split("differ in")[1] and "MLA model" not in message
    assert decode_payload(served_by(COMPAT), COMPAT) == prefill_metadata(0)  # the same engine: accepted


MLA_COMPAT = compatibility_of(EngineConfig(), MLA_ARCH, "tiny-deepseek")
LLAMA_COMPAT = compatibility_of(EngineConfig(), LLAMA_ARCH, "tiny-llama")


@pytest.mark.parametrize("prefill, decode, reason", [
    (MLA_COMPAT, LLAMA_COMPAT, "the prefill engine serves an MLA model (latent KV cache) and this engine a "
                               "non-MLA one: they cannot exchange KV"),
    (LLAMA_COMPAT, MLA_COMPAT, "the prefill engine serves a non-MLA model and this engine an MLA one "
                               "(latent KV cache): they cannot exchange KV"),
], ids=["mla-prefill", "mla-decode"])
def test_an_mla_and_a_non_mla_engine_are_refused_with_the_reason(prefill, decode, reason) -> None:
    message = hash_mismatch(served_by(prefill), decode)
    assert reason in message
    for name in ("use_mla", "num_kv_heads", "head_size", "kv_cache_groups"):
        assert f"{name} (peer " in message
    assert 'kv_cache_groups (peer ["mla"], local ["full_attention"])' in message \
        or 'kv_cache_groups (peer ["full_attention"], local ["mla"])' in message
    # Through D's handshake manager too: the failed future carries the reason.
    with SideChannelServer({0: served_by(prefill)}, HOST) as server:
        manager = HandshakeManager(decode, timeout_s=1.0)
        try:
            error = manager.ensure("prefill-0", HOST, server.port, 0).exception(timeout=5.0)
        finally:
            manager.close()
    assert isinstance(error, HandshakeHashMismatch) and reason in str(error)


def _with_compat(compat: object, compat_hash: bytes = HASH) -> bytes:
    return with_body(_body(compat=compat), compat_hash)


GARBAGE_COMPAT = [
    5,
    "compat",
    [1, 2],
    {},
    {**json.loads(COMPAT.canonical()), "use_mla": "yes"},  # not a bool
    {**json.loads(COMPAT.canonical()), "num_kv_heads": True},  # a bool is not an int
    {**json.loads(COMPAT.canonical()), "num_kv_heads": 0},
    {**json.loads(COMPAT.canonical()), "kv_cache_groups": "mla"},
    {**json.loads(COMPAT.canonical()), "kv_cache_groups": [1]},
    {**json.loads(COMPAT.canonical()), "extra": 1},
    {k: v for k, v in json.loads(COMPAT.canonical()).items() if k != "dtype"},
    {**json.loads(COMPAT.canonical()), "model": "m" * 100_000},  # far over the size bound
    json.loads(dataclasses.replace(COMPAT, dtype="bfloat16").canonical()),  # another engine's: not the header's hash
]


@pytest.mark.parametrize("compat", GARBAGE_COMPAT, ids=range(len(GARBAGE_COMPAT)))
def test_a_garbage_compatibility_description_is_a_decode_error_or_an_unexplained_mismatch(compat) -> None:
    with pytest.raises(HandshakeDecodeError, match="compatibility description"):  # the hash matches
        fetch_over_loopback(_with_compat(compat))
    # The hash differs: refused as a mismatch; a description D cannot trust explains nothing.
    message = hash_mismatch(_with_compat(compat, b"\x07" * 32))
    assert message.startswith("compatibility hash mismatch: peer 0707070707070707, local ")
    assert "the engines differ in" not in message and "MLA model" not in message and len(message) < 400


def test_a_peer_without_a_description_still_gets_the_plain_mismatch() -> None:
    message = hash_mismatch(served_by(MLA_COMPAT.hash()))  # a P that sends only its hash
    assert message.startswith("compatibility hash mismatch: peer ") and "the engines differ in" not in message
    assert decode_payload(served_by(HASH), COMPAT) == prefill_metadata(0)


def test_an_oversized_description_is_left_out_of_the_payload() -> None:
    huge = dataclasses.replace(COMPAT, model="m" * 10_000)
    body = json.loads(served_by(huge)[HEADER_LEN:])
    assert "compat" not in body and served_by(huge)[6:38] == huge.hash()
    assert decode_payload(served_by(huge), huge) == prefill_metadata(0)


def test_engine_id_mismatch_is_refused_when_d_knows_which_engine_it_wants() -> None:
    with pytest.raises(HandshakeEngineMismatch, match="prefill-7"):
        fetch_over_loopback(PAYLOADS[0], expected_engine_id="prefill-7")
    assert fetch_over_loopback(PAYLOADS[0], expected_engine_id=None).engine_id == "prefill-0"


@pytest.mark.parametrize("local, prefix_caching, match", [
    (rank_layout(kv_layout="NHD"), False, "KV layout"),
    (rank_layout(block_size=32), False, "block size"),
    (rank_layout(region_base_addrs=(1,), block_len_bytes=(4096,)), False, "regions"),
    (rank_layout(physical_blocks_per_logical=2), True, "prefix caching"),
])
def test_layout_mismatch_is_refused_with_the_difference_named(local, prefix_caching, match) -> None:
    with pytest.raises(HandshakeLayoutMismatch, match=match) as info:
        fetch_over_loopback(PAYLOADS[0], local_layout=local, prefix_caching=prefix_caching)
    assert info.value.kind is HandshakeFailureKind.LAYOUT_MISMATCH


def test_block_ratio_may_differ_when_prefix_caching_is_off() -> None:
    local = rank_layout(physical_blocks_per_logical=2, tp_size=4, tp_rank=3, num_blocks=7)
    assert fetch_over_loopback(PAYLOADS[0], local_layout=local, prefix_caching=False)


def _body(**changes: object) -> bytes:
    obj = json.loads(PAYLOADS[0][HEADER_LEN:])
    for key, value in changes.items():
        target, _, name = key.rpartition("__")
        (obj[target] if target else obj)[name] = value
    return json.dumps(obj).encode()


@pytest.mark.parametrize("payload", [
    b"",
    PAYLOADS[0][:5],  # shorter than magic + version
    PAYLOADS[0][:20],  # version fine, hash cut off
    b"XXXX" + PAYLOADS[0][4:],  # not a kvbridge payload
    PAYLOADS[0][:-1],  # body shorter than the header says
    PAYLOADS[0] + b"!",  # trailing bytes
    with_body(b"[1, 2]"),
    with_body(b'{"engine_id": "e"}'),
    with_body(_body(engine_id=5)),
    with_body(_body(agent_metadata="not base64!")),
    with_body(_body(layout__tp_size=True)),  # a bool is not an int
    with_body(_body(layout__tp_rank=2)),  # outside tp_size 2
    with_body(_body(layout__block_len_bytes=[4096])),  # one length for two regions
    with_body(_body(layout__region_base_addrs=[-1, 0])),
    with_body(b"[" * 100_000),  # nesting deep enough to hit the recursion limit
], ids=lambda p: repr(p[:12]))
def test_undecodable_payloads_are_decode_errors(payload: bytes) -> None:
    with pytest.raises(HandshakeDecodeError) as info:
        fetch_over_loopback(payload)
    assert info.value.kind is HandshakeFailureKind.DECODE_ERROR


# ---- client failures ----------------------------------------------------------------


def test_connecting_to_a_port_nobody_listens_on_is_refused() -> None:
    with pytest.raises(HandshakeRefused) as info:
        HandshakeClient().fetch(HOST, dead_port(), 0, timeout=2.0)
    assert info.value.kind is HandshakeFailureKind.REFUSED


def test_a_peer_that_accepts_and_never_answers_times_out_fast() -> None:
    with socket.create_server((HOST, 0)) as silent:  # the kernel accepts; nobody replies
        start = time.monotonic()
        with pytest.raises(HandshakeTimeout) as info:
            HandshakeClient().fetch(HOST, silent.getsockname()[1], 0, timeout=0.2)
    assert time.monotonic() - start < 5.0  # the 0.2 s timeout, not the kernel's minutes
    assert info.value.kind is HandshakeFailureKind.TIMEOUT


def test_a_rank_the_peer_does_not_serve_is_a_peer_error(prefill_side_channel) -> None:
    with pytest.raises(HandshakePeerError, match="tp_rank 5"):
        HandshakeClient().fetch(HOST, prefill_side_channel.port, 5, timeout=2.0)


def test_an_unknown_message_type_is_a_peer_error(prefill_side_channel) -> None:
    with pytest.raises(HandshakePeerError, match="unknown message type"):
        HandshakeClient().request(HOST, prefill_side_channel.port, "no_such_type", b"", 2.0)


def test_a_garbage_reply_is_a_decode_error() -> None:
    with socket.create_server((HOST, 0)) as liar:
        def answer() -> None:
            conn, _ = liar.accept()
            with conn:
                conn.recv(1024)
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
        threading.Thread(target=answer, daemon=True).start()
        with pytest.raises(HandshakeDecodeError):
            HandshakeClient().fetch(HOST, liar.getsockname()[1], 0, timeout=2.0)


# ---- server robustness ----------------------------------------------------------------


def _send_raw(port: int, data: bytes, *, half_close: bool = True) -> bytes:
    """Send bytes, optionally signal EOF, and return whatever comes back until close."""
    with socket.create_connection((HOST, port), timeout=3.0) as sock:
        received = b""
        try:
            sock.sendall(data)
            if half_close:
                sock.shutdown(socket.SHUT_WR)
            while chunk := sock.recv(65536):
                received += chunk
        except OSError:
            pass  # the server already closed, maybe with our bytes unread
        return received


@pytest.mark.parametrize("data, half_close", [
    (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", True),  # garbage
    (FRAME_MAGIC + struct.pack("!BI", 12, 1 << 30) + b"get_metadata", True),  # oversized
    (FRAME_MAGIC + struct.pack("!BI", 0, 0), True),  # empty message type
    (FRAME_MAGIC + struct.pack("!BI", 3, 0) + b"A\x00\xff", True),  # message type not ASCII
    (encode_frame("get_metadata", b"\x00\x00\x00\x00")[:-2], True),  # truncated, then EOF
    (encode_frame("get_metadata", b"\x00\x00\x00\x00")[:-2], False),  # truncated, then stall
], ids=["garbage", "oversized", "empty-type", "bad-type", "truncated-eof", "truncated-stall"])
def test_bad_frames_are_refused_and_the_server_keeps_serving(prefill_side_channel, data,
                                                            half_close) -> None:
    assert _send_raw(prefill_side_channel.port, data, half_close=half_close) == b""
    assert prefill_side_channel.num_refused == 1
    good = HandshakeClient().fetch(HOST, prefill_side_channel.port, 0, timeout=2.0)
    assert good == PAYLOADS[0]


def test_an_idle_client_is_disconnected_without_counting_a_refusal(prefill_side_channel) -> None:
    assert _send_raw(prefill_side_channel.port, b"", half_close=False) == b""  # waits ~0.5 s
    assert prefill_side_channel.num_refused == 0


def test_a_client_may_send_several_requests_on_one_connection(prefill_side_channel) -> None:
    request = encode_frame("get_metadata", struct.pack("!I", 1))
    reply = _send_raw(prefill_side_channel.port, request + request)
    one = encode_frame("ok", PAYLOADS[1])
    assert reply == one + one
    assert decode_frame(one, 1 << 20).body == PAYLOADS[1]


def test_registered_handlers_serve_their_own_message_type(prefill_side_channel) -> None:
    rejected: list[bytes] = []

    def on_reject(body: bytes) -> bytes:
        if body == b"unknown":
            raise HandlerRefusal("no such request")
        if body == b"bug":
            raise KeyError(body)
        rejected.append(body)
        return b"freed"

    prefill_side_channel.register_handler("reject_request", on_reject)
    client = HandshakeClient()
    port = prefill_side_channel.port
    assert client.request(HOST, port, "reject_request", b"req-1", 2.0) == b"freed"
    with pytest.raises(HandshakePeerError, match="no such request"):
        client.request(HOST, prefill_side_channel.port, "reject_request", b"unknown", 2.0)
    with pytest.raises(HandshakePeerError, match="failed"):
        client.request(HOST, prefill_side_channel.port, "reject_request", b"bug", 2.0)
    assert rejected == [b"req-1"]
    assert client.fetch(HOST, prefill_side_channel.port, 0, 2.0) == PAYLOADS[0]
    with pytest.raises(ValueError, match="already registered"):
        prefill_side_channel.register_handler("reject_request", on_reject)
    with pytest.raises(ValueError, match="bad message type"):
        prefill_side_channel.register_handler("Reject Request", on_reject)


def test_close_stops_the_listener_promptly_even_with_an_idle_client() -> None:
    # Threads alive before: another test's server on a port since reused may still be winding down.
    before = set(threading.enumerate())
    server = SideChannelServer(PAYLOADS, HOST, read_timeout_s=30.0).start()
    port = server.port
    assert port > 0
    idle = socket.create_connection((HOST, port))
    deadline = time.monotonic() + 30
    while server.num_open != 1:  # the server has accepted it and a thread waits on it
        assert time.monotonic() < deadline, "the server never accepted the idle client"
        time.sleep(0.01)
    start = time.monotonic()
    server.close()
    server.close()  # idempotent
    assert time.monotonic() - start < 10.0  # promptly: not the 30 s read timeout
    assert server.port == port and not any(
        t.name.startswith(f"kvbridge-side-channel-{port}") for t in set(threading.enumerate()) - before)
    idle.close()
    with pytest.raises(HandshakeRefused):
        HandshakeClient().fetch(HOST, port, 0, timeout=1.0)


# ---- HandshakeManager: dedup, cache, backoff ---------------------------------------------


class CountingClient(HandshakeClient):
    """The real client, counting fetches and optionally slowed down to force overlap."""

    def __init__(self, delay_s: float = 0.0) -> None:
        super().__init__()
        self.delay_s = delay_s
        self.fetches = 0
        self._lock = threading.Lock()

    def fetch(self, host: str, port: int, tp_rank: int, timeout: float) -> bytes:
        with self._lock:
            self.fetches += 1
        time.sleep(self.delay_s)
        return super().fetch(host, port, tp_rank, timeout)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_manager(client: HandshakeClient, **kwargs: object) -> HandshakeManager:
    return HandshakeManager(HASH, rank_layout(0), client=client, timeout_s=1.0,
                            **kwargs)  # type: ignore[arg-type]


def failure_kind(future: Future) -> HandshakeFailureKind:
    error = future.exception(timeout=5.0)
    assert isinstance(error, HandshakeError), error
    return error.kind


def test_concurrent_ensure_calls_share_one_handshake(prefill_side_channel) -> None:
    client = CountingClient(delay_s=0.2)
    manager = make_manager(client)
    barrier = threading.Barrier(10)
    futures: list[Future] = []

    def call() -> None:
        barrier.wait()
        futures.append(manager.ensure("prefill-0", HOST, prefill_side_channel.port, 1))

    threads = [threading.Thread(target=call) for _ in range(10)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(f.result(timeout=5.0) == prefill_metadata(1) for f in futures)
    assert client.fetches == 1 and prefill_side_channel.num_served == 1
    assert len({id(f) for f in futures}) == 1
    assert not futures[0].cancel()  # shared: one caller cannot cancel it for the others
    manager.close()


def test_a_successful_handshake_is_cached_until_forgotten(prefill_side_channel) -> None:
    client = CountingClient()
    manager = make_manager(client)
    port = prefill_side_channel.port
    first = manager.ensure("prefill-0", HOST, port, 0).result(timeout=5.0)
    assert manager.ensure("prefill-0", HOST, port, 0).result(timeout=5.0) is first
    assert client.fetches == 1
    manager.forget("prefill-0")  # e.g. the peer restarted
    assert manager.ensure("prefill-0", HOST, port, 0).result(timeout=5.0) == first
    assert client.fetches == 2
    manager.close()


def test_a_dead_peer_is_retried_only_after_exponential_backoff() -> None:
    clock = FakeClock()
    client = CountingClient()
    manager = make_manager(client, backoff_initial_s=0.5, backoff_max_s=10.0, clock=clock)
    port = dead_port()
    assert failure_kind(manager.ensure("prefill-0", HOST, port, 0)) is HandshakeFailureKind.REFUSED
    assert client.fetches == 1

    clock.now += 0.25  # inside the 0.5 s window: answered from memory, no network
    cached = manager.ensure("prefill-0", HOST, port, 0)
    assert cached.done() and failure_kind(cached) is HandshakeFailureKind.REFUSED
    assert client.fetches == 1

    clock.now += 0.25  # window over: one new attempt, which fails and doubles the window
    assert failure_kind(manager.ensure("prefill-0", HOST, port, 0)) is HandshakeFailureKind.REFUSED
    assert client.fetches == 2
    clock.now += 0.75
    assert manager.ensure("prefill-0", HOST, port, 0).done() and client.fetches == 2

    with SideChannelServer(PAYLOADS, HOST, port):  # the peer comes up on the same address
        clock.now += 0.25
        assert manager.ensure("prefill-0", HOST, port, 0).result(timeout=5.0) == prefill_metadata(0)
        assert client.fetches == 3
    manager.close()


class AlwaysRefused(HandshakeClient):
    def __init__(self) -> None:
        super().__init__()
        self.fetches = 0

    def fetch(self, host: str, port: int, tp_rank: int, timeout: float) -> bytes:
        self.fetches += 1
        raise HandshakeRefused("nobody home")


def test_backoff_doubles_up_to_its_cap() -> None:
    clock = FakeClock()
    client = AlwaysRefused()
    manager = make_manager(client, backoff_initial_s=0.5, backoff_max_s=3.0, clock=clock)
    windows = []
    for _ in range(5):
        manager.ensure(None, HOST, 1, 0).exception(timeout=5.0)
        attempts, waited = client.fetches, 0.0
        while client.fetches == attempts:
            clock.now += 0.25
            waited += 0.25
            manager.ensure(None, HOST, 1, 0).exception(timeout=5.0)
        windows.append(waited)
    assert windows == [0.5, 1.0, 2.0, 3.0, 3.0]
    manager.close()


def test_backoff_is_per_peer_and_forget_clears_it() -> None:
    clock = FakeClock()
    client = AlwaysRefused()
    manager = make_manager(client, clock=clock)
    manager.ensure("prefill-0", HOST, 1, 0).exception(timeout=5.0)
    manager.ensure("prefill-1", HOST, 2, 0).exception(timeout=5.0)  # another peer: own attempt
    assert client.fetches == 2
    manager.forget("prefill-0")
    manager.ensure("prefill-0", HOST, 1, 0).exception(timeout=5.0)
    assert client.fetches == 3
    manager.close()


@pytest.mark.parametrize("engine_id, local, validate, kind", [
    ("prefill-9", rank_layout(0), None, HandshakeFailureKind.ENGINE_MISMATCH),
    ("prefill-0", rank_layout(0, block_size=8), None, HandshakeFailureKind.LAYOUT_MISMATCH),
    (None, None, "raise", HandshakeFailureKind.LAYOUT_MISMATCH),
])
def test_validation_failures_become_failed_futures(prefill_side_channel, engine_id, local,
                                                   validate, kind) -> None:
    def tp_check(metadata: HandshakeMetadata) -> None:
        raise HandshakeLayoutMismatch(f"block_len {metadata.layout.block_len_bytes} wrong for TP")

    manager = HandshakeManager(HASH, local, timeout_s=1.0,
                               validate=tp_check if validate else None)
    future = manager.ensure(engine_id, HOST, prefill_side_channel.port, 0)
    assert failure_kind(future) is kind
    manager.close()


def test_a_hash_mismatch_fails_the_handshake_not_the_caller(prefill_side_channel) -> None:
    manager = HandshakeManager(b"\x01" * 32, timeout_s=1.0)
    future = manager.ensure("prefill-0", HOST, prefill_side_channel.port, 0)
    assert failure_kind(future) is HandshakeFailureKind.HASH_MISMATCH
    manager.close()


def test_an_unexpected_exception_still_resolves_the_future() -> None:
    class Broken(HandshakeClient):
        def fetch(self, host: str, port: int, tp_rank: int, timeout: float) -> bytes:
            raise ZeroDivisionError("bug")

    manager = make_manager(Broken())
    assert failure_kind(manager.ensure(None, HOST, 1, 0)) is HandshakeFailureKind.DECODE_ERROR
    manager.close()


def test_close_fails_handshakes_in_flight_and_later_calls() -> None:
    gate = threading.Event()

    class Stuck(HandshakeClient):
        def fetch(self, host: str, port: int, tp_rank: int, timeout: float) -> bytes:
            gate.wait(5.0)
            raise HandshakeTimeout("late")

    manager = make_manager(Stuck())
    in_flight = manager.ensure(None, HOST, 1, 0)
    manager.close()
    assert failure_kind(in_flight) is HandshakeFailureKind.REFUSED
    assert failure_kind(manager.ensure(None, HOST, 1, 0)) is HandshakeFailureKind.REFUSED
    gate.set()


# ---- trust ---------------------------------------------------------------------------


@pytest.mark.parametrize("host", ["127.0.0.1", "127.8.9.10", "::1", "[::1]", "localhost",
                                  "LOCALHOST.", "::ffff:127.0.0.1", socket.gethostname()])
def test_without_a_trusted_list_only_this_machine_is_trusted(host: str) -> None:
    assert is_trusted_host(host, ())


@pytest.mark.parametrize("host", ["10.0.0.1", "8.8.8.8", "0.0.0.0", "example.com", "", "::",
                                  "169.254.169.254", "localhost.example.com"])
def test_without_a_trusted_list_other_hosts_are_not(host: str) -> None:
    assert not is_trusted_host(host, ())


def test_a_trusted_list_names_hosts_addresses_and_networks() -> None:
    trusted = ["prefill-a.internal", "10.1.2.3", "192.168.0.0/16", "fd00::/8"]
    assert is_trusted_host("PREFILL-A.internal", trusted)
    assert is_trusted_host("10.1.2.3", trusted) and not is_trusted_host("10.1.2.4", trusted)
    assert is_trusted_host("192.168.44.1", trusted) and is_trusted_host("fd00::5", trusted)
    assert not is_trusted_host("127.0.0.1", trusted)  # the list replaces the default
    assert not is_trusted_host("prefill-b.internal", trusted)


def test_names_are_compared_literally_never_resolved() -> None:
    assert not is_trusted_host("localhost", ["127.0.0.1"])
    assert not is_trusted_host("127.0.0.1", ["localhost"])


# ---- fuzzing -------------------------------------------------------------------------


def _mutations() -> st.SearchStrategy[bytes]:
    base = PAYLOADS[0]
    flip = st.tuples(st.integers(0, len(base) - 1), st.integers(0, 255)).map(
        lambda iv: base[:iv[0]] + bytes([iv[1]]) + base[iv[0] + 1:])
    cut = st.integers(0, len(base)).map(lambda n: base[:n])
    json_bodies = st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=6),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
            st.sampled_from(["engine_id", "backend", "agent_metadata", "layout", "compat", "use_mla", "tp_size",
                             "tp_rank", "region_base_addrs", "block_len_bytes", "num_blocks",
                             "block_size", "kv_layout", "physical_blocks_per_logical"]),
            inner, max_size=8),
        max_leaves=24,
    ).map(lambda obj: with_body(json.dumps(obj).encode()))
    return st.one_of(st.binary(max_size=300), flip, cut, json_bodies,
                     st.binary(max_size=200).map(with_body))


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_mutations(), st.booleans(), st.sampled_from([HASH, COMPAT, MLA_COMPAT]))
def test_decode_payload_raises_only_handshake_errors(data: bytes, check_layout: bool,
                                                      expected: CompatibilityInfo | bytes) -> None:
    try:
        decode_payload(data, expected, "prefill-0", rank_layout(0) if check_layout else None,
                       prefix_caching=True)
    except HandshakeError:
        pass


frame_inputs = st.one_of(
    st.binary(max_size=100),
    st.tuples(st.integers(0, 255), st.integers(0, 2**32 - 1), st.binary(max_size=80)).map(
        lambda t: FRAME_MAGIC + struct.pack("!BI", t[0], t[1]) + t[2]),
    st.tuples(st.text(max_size=8), st.binary(max_size=20)).map(
        lambda t: FRAME_MAGIC + struct.pack("!BI", len(t[0].encode()), len(t[1]))
        + t[0].encode() + t[1]),
)


@settings(max_examples=500, deadline=None)
@given(frame_inputs)
def test_frame_parser_accepts_a_frame_or_raises_frame_error(data: bytes) -> None:
    try:
        frame = decode_frame(data, max_body=64)
    except FrameError:
        return
    assert encode_frame(frame.msg_type, frame.body) == data


def test_live_server_survives_arbitrary_bytes_and_still_serves() -> None:
    with SideChannelServer(PAYLOADS, HOST, read_timeout_s=1.0) as server:
        @settings(max_examples=60, deadline=None)
        @given(frame_inputs)
        def send(data: bytes) -> None:
            _send_raw(server.port, data)

        send()
        assert HandshakeClient().fetch(HOST, server.port, 1, timeout=2.0) == PAYLOADS[1]
        assert server.num_refused > 0


def test_payload_round_trips_agent_metadata_bytes_exactly() -> None:
    metadata = HandshakeMetadata("e", "nixl", b"\x00\xff" * 1000, rank_layout(1))
    assert decode_payload(encode_payload(metadata, HASH), HASH) == metadata
    body = json.loads(encode_payload(metadata, HASH)[HEADER_LEN:])
    assert base64.b64decode(body["agent_metadata"]) == metadata.agent_metadata


def test_payload_carries_where_each_rank_registered_its_kv() -> None:
    """A GPU rank's KV is VRAM on its GPU: D must name P's spans as P registered them (a D on
    another device type or GPU index than P's rank found nothing: NIXL_ERR_NOT_FOUND, every read)."""
    metadata = HandshakeMetadata("e", "nixl", b"blob", rank_layout(1, memory="cuda", device_id=3))
    assert decode_payload(encode_payload(metadata, HASH), HASH).layout.memory == "cuda"
    assert decode_payload(encode_payload(metadata, HASH), HASH).layout.device_id == 3
    # A peer from before these fields: host memory.
    body = json.loads(encode_payload(prefill_metadata(0), HASH)[HEADER_LEN:])
    for key in ("memory", "device_id"):
        del body["layout"][key]
    old = decode_payload(with_body(json.dumps(body).encode()), HASH)
    assert (old.layout.memory, old.layout.device_id) == ("cpu", 0)
    for bad in ({"memory": "tpu"}, {"memory": 1}, {"device_id": -1}, {"device_id": True}, {"device_id": "0"}):
        body = json.loads(encode_payload(prefill_metadata(0), HASH)[HEADER_LEN:])
        body["layout"].update(bad)
        with pytest.raises(HandshakeDecodeError):
            decode_payload(with_body(json.dumps(body).encode()), HASH)
