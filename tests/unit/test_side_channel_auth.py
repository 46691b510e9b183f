"""P's side channel with a key (--api-key): unauthenticated, forged, stale and replayed
request frames are refused and change nothing. Real servers and clients on loopback."""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Iterator

import pytest

from kvbridge.kv_transfer.side_channel.control import MSG_READ_DONE, MSG_RELEASE, ControlClient, ControlServer
from kvbridge.kv_transfer.side_channel.handshake import HandshakePeerError
from kvbridge.kv_transfer.lease import LeaseTable
from kvbridge.kv_transfer.side_channel.server import SideChannelServer
from kvbridge.kv_transfer.side_channel.client import HandshakeClient
from kvbridge.kv_transfer.side_channel.frames import (AUTH_FRAME_MAGIC, MSG_GET_METADATA, REPLY_ERROR, REPLY_OK,
                                                      decode_frame, derive_key, encode_authenticated_frame,
                                                      encode_frame)
from tests.unit.side_channel_helpers import BLOCKS, CONTENT, HOST, PAYLOADS, RANK0, exchange

KEY = "sk-test-key"


def _send_once(port: int, frame: bytes) -> bytes:
    with socket.create_connection((HOST, port), timeout=5.0) as sock:
        return exchange(sock, frame)


@pytest.fixture
def keyed() -> Iterator[tuple[SideChannelServer, ControlServer, LeaseTable]]:
    leases = LeaseTable(30.0)
    with SideChannelServer(PAYLOADS, HOST, key=KEY) as server:
        control = ControlServer(server, leases)
        leases.grant("r1", BLOCKS, 7, CONTENT)
        yield server, control, leases
        leases.release("r1", 7)


def test_an_unauthenticated_release_is_refused_and_changes_nothing(keyed) -> None:
    server, control, leases = keyed
    for client in (HandshakeClient(), HandshakeClient(key="another key")):
        with pytest.raises(HandshakePeerError, match="authentication"):
            ControlClient(timeout_s=5.0, client=client).release(HOST, server.port, "r1", 7)
        with pytest.raises(HandshakePeerError, match="authentication"):
            ControlClient(timeout_s=5.0, client=client).heartbeat(HOST, server.port, [("r1", 7)])
    assert "r1" in leases and leases.drain_released() == []
    assert server.num_unauthenticated == 4 and server.num_served == 0
    ControlClient(timeout_s=5.0, client=HandshakeClient(key=KEY)).release(HOST, server.port, "r1", 7)
    assert "r1" not in leases and leases.drain_released() == ["r1"]
    assert server.num_served == 1


def test_get_metadata_needs_the_key(keyed) -> None:
    server, _, _ = keyed
    with pytest.raises(HandshakePeerError, match="authentication required") as refused:
        HandshakeClient().fetch(HOST, server.port, 0, timeout=5.0)
    assert PAYLOADS[0].decode() not in str(refused.value)
    assert HandshakeClient(key=KEY).fetch(HOST, server.port, 0, timeout=5.0) == PAYLOADS[0]
    assert server.num_unauthenticated == 1


def test_forged_stale_and_replayed_frames_are_refused(keyed) -> None:
    server, control, leases = keyed
    key = derive_key(KEY)
    body = b'{"rid": "r1", "gen": 7}'
    now_ms = int(time.time() * 1000)
    good = encode_authenticated_frame(MSG_RELEASE, body, key, nonce=b"n" * 16, timestamp_ms=now_ms)
    tampered_body = good.replace(b'"gen": 7', b'"gen": 8')
    other = MSG_READ_DONE.encode()  # good's nonce, time and tag on another message type
    retyped = AUTH_FRAME_MAGIC + struct.pack("!BI", len(other), len(body)) + other + body + good[-56:]
    stale = encode_authenticated_frame(MSG_RELEASE, body, key, nonce=b"s" * 16, timestamp_ms=now_ms - 120_000)
    future = encode_authenticated_frame(MSG_RELEASE, body, key, nonce=b"f" * 16, timestamp_ms=now_ms + 120_000)
    wrong_key = encode_authenticated_frame(MSG_RELEASE, body, derive_key("guess"))
    for frame in (tampered_body, retyped, stale, future, wrong_key, encode_frame(MSG_RELEASE, body)):
        reply = decode_frame(_send_once(server.port, frame), 1 << 20)
        assert reply.msg_type == REPLY_ERROR and b"authentication" in reply.body
    assert "r1" in leases and server.num_served == 0
    assert decode_frame(_send_once(server.port, good), 1 << 20).msg_type == REPLY_OK
    assert "r1" not in leases and leases.drain_released() == ["r1"]
    leases.grant("r1", BLOCKS, 8, CONTENT)  # a new lease: a replay of the old frame must not touch it
    replay = decode_frame(_send_once(server.port, good), 1 << 20)
    assert replay.msg_type == REPLY_ERROR and b"replayed" in replay.body
    assert "r1" in leases and server.num_unauthenticated == 7
    leases.release("r1", 8)


def test_an_unauthenticated_frame_closes_its_connection(keyed) -> None:
    server, _, _ = keyed
    with socket.create_connection((HOST, server.port), timeout=5.0) as sock:
        reply = exchange(sock, encode_frame(MSG_GET_METADATA, RANK0))
        assert decode_frame(reply, 1 << 20).msg_type == REPLY_ERROR
        sock.settimeout(5.0)
        assert sock.recv(1) == b""


def test_a_key_on_one_side_only_fails_loudly() -> None:
    with SideChannelServer(PAYLOADS, HOST) as server:
        with pytest.raises(HandshakePeerError, match="no key"):
            HandshakeClient(key=KEY).fetch(HOST, server.port, 0, timeout=5.0)
        assert server.num_unauthenticated == 1 and server.num_served == 0
