"""The HTTP servers' listening socket (instances and proxy): every accepted connection has Nagle's
algorithm off. With it on, a non-streamed answer (headers, then the body, in two writes) waited for
the client's delayed ACK: 40 ms on every keep-alive request after the first, on P's answer to the
proxy, D's and the proxy's to the client (measured: 40-45 ms between headers and body; 0.2 ms with
TCP_NODELAY)."""

from __future__ import annotations

import socket

from kvbridge.openai_wire import bind_socket
from kvbridge.proxy import app as proxy_app
from kvbridge.server import api_server


def test_accepted_connections_have_nagle_off():
    listener = bind_socket("127.0.0.1", 0)
    listener.setblocking(True)
    with listener, socket.create_connection(listener.getsockname()[:2], timeout=5):
        accepted, _ = listener.accept()
        with accepted:
            assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0


def test_both_programs_listen_through_it():
    assert api_server.bind_socket is bind_socket
    assert proxy_app.bind_socket is bind_socket
