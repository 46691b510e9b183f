"""P's side channel against idle connections (slowloris): a flood of them must not lock
D out. Real servers and clients on loopback."""

from __future__ import annotations

import socket
import threading

import pytest

from kvbridge.kv_transfer.side_channel.control import ControlClient, ControlServer
from kvbridge.kv_transfer.side_channel.handshake import HandshakeRefused
from kvbridge.kv_transfer.lease import LeaseTable
from kvbridge.kv_transfer.side_channel.server import SideChannelServer
from kvbridge.kv_transfer.side_channel.client import HandshakeClient
from kvbridge.kv_transfer.side_channel.frames import MSG_GET_METADATA, REPLY_OK, encode_frame
from tests.unit.side_channel_helpers import BLOCKS, CONTENT, HOST, PAYLOADS, RANK0, exchange



def test_idle_connections_do_not_lock_peers_out() -> None:
    """200 idle connections (more than max_connections) must not keep D from handshaking or
    releasing, nor cut an established peer's connection. The long read timeout leaves
    eviction as the only way in."""
    leases = LeaseTable(30.0)
    with SideChannelServer(PAYLOADS, HOST, read_timeout_s=30.0, max_connections=32) as server:
        ControlServer(server, leases)
        established = socket.create_connection((HOST, server.port), timeout=5.0)
        idle: list[socket.socket] = []
        try:
            assert exchange(established, encode_frame(MSG_GET_METADATA, RANK0)) == encode_frame(
                REPLY_OK, PAYLOADS[0])
            for _ in range(200):
                idle.append(socket.create_connection((HOST, server.port), timeout=5.0))
            assert HandshakeClient().fetch(HOST, server.port, 0, timeout=5.0) == PAYLOADS[0]
            leases.grant("r1", BLOCKS, 7, CONTENT)
            ControlClient(timeout_s=5.0).release(HOST, server.port, "r1", 7)
            assert "r1" not in leases and leases.drain_released() == ["r1"]
            # The peer that had already been served keeps its connection through the flood.
            assert exchange(established, encode_frame(MSG_GET_METADATA, RANK0)) == encode_frame(
                REPLY_OK, PAYLOADS[0])
            assert server.num_evicted >= 200 - 32 + 2  # the flood, the fetch and the release
            assert server.num_open <= 32
        finally:
            established.close()
            for sock in idle:
                sock.close()


def test_an_idle_connection_is_closed_within_about_a_second() -> None:
    with SideChannelServer(PAYLOADS, HOST) as server:  # default budgets
        with socket.create_connection((HOST, server.port), timeout=5.0) as sock:
            sock.settimeout(4.0)  # well above the ~1 s budget, well below the old 5 s
            assert sock.recv(1) == b""  # P closed it; a TimeoutError here means it did not
        assert server.num_refused == 0


def test_when_every_slot_runs_a_handler_a_new_connection_is_refused() -> None:
    entered, release = threading.Event(), threading.Event()

    def slow(body: bytes) -> bytes:
        entered.set()
        assert release.wait(10.0)
        return body

    with SideChannelServer(PAYLOADS, HOST, max_connections=1) as server:
        server.register_handler("slow", slow)
        replies: list[bytes] = []
        caller = threading.Thread(
            target=lambda: replies.append(HandshakeClient().request(HOST, server.port, "slow", b"x", 10.0)))
        caller.start()
        try:
            assert entered.wait(10.0)
            with pytest.raises(HandshakeRefused, match="closed the connection"):
                HandshakeClient().fetch(HOST, server.port, 0, timeout=5.0)
            assert server.num_refused == 1 and server.num_evicted == 0
        finally:
            release.set()
            caller.join(10.0)
        assert replies == [b"x"]
