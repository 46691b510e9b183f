"""The HTTP/1.1 connection of every kvbridge server (instances, the proxy, the Ray router): uvicorn's
httptools protocol with bounds on what one client may make it hold.

uvicorn's httptools protocol puts no bound on a request's header: httptools collects a header of
any size before its first callback, and a 200 MB one stalled the proxy's event loop for 95 s
(health checks starved, every instance marked unhealthy) and kept 275 MB; the body limit
(`--max-body-bytes`) never saw it. Nor does it bound the time a connection takes to send its
headers: 2000 connections each trickling a partial header stayed open until the process ran out of
file descriptors. `BoundedHttpProtocol` adds, before any byte reaches the parser:

- **header bytes**: the request line and header fields of one request at most `MAX_HEADER_BYTES`
  (counted up to the blank line that ends them, so a body in the same read does not count):
  beyond, HTTP 431 and the connection is closed;
- **header fields**: at most `MAX_HEADER_FIELDS` (431 too);
- **header time**: a request's headers must be complete `HEADER_TIMEOUT_S` after the connection
  opened or, on a kept-alive connection, after the request's first byte: else HTTP 408 and close.

A request whose client shuts its sending side once it has sent it (a half-close) is answered:
uvicorn took the end of input for a disconnect and aborted it (`eof_received`).

Refusals are OpenAI's error body, like every other error of the servers, and close the connection
after a short linger (so that the client reads the answer rather than a reset). An idle kept-alive
connection is uvicorn's (closed after `timeout_keep_alive`).
"""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

MAX_HEADER_BYTES = 64 << 10
MAX_HEADER_FIELDS = 128
HEADER_TIMEOUT_S = 10.0
PEER_CHECK_S = 0.05  # a half-closed connection's socket error is checked this often
LINGER_S = 2.0  # after a refusal: how long the client's remaining input is read and dropped
_END = b"\r\n\r\n"
_REASONS = {408: "Request Timeout", 431: "Request Header Fields Too Large"}


CONNECTION_EXTENSION = "kvbridge.connection"  # the ASGI scope extension holding a ConnectionView


class _TooManyFields(Exception):
    pass


class ConnectionView:
    """What an app may ask of its request's connection (the scope's `kvbridge.connection`
    extension). `lost()`: the server knows the connection is gone and drops what the app sends;
    asked right after a send, before any other callback ran, True means that send was dropped."""

    def __init__(self, cycle: Any) -> None:
        self._cycle = cycle

    def lost(self) -> bool:
        return bool(self._cycle.disconnected)


def connection_view(scope: Any) -> ConnectionView | None:
    """The request's ConnectionView, None when it is not served by BoundedHttpProtocol."""
    view = scope.get("extensions", {}).get(CONNECTION_EXTENSION)
    return view if isinstance(view, ConnectionView) else None


def refusal(status: int, message: str, code: str) -> bytes:
    """A whole HTTP/1.1 answer that closes the connection, with OpenAI's error body."""
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()
    return (f"HTTP/1.1 {status} {_REASONS[status]}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode() + body


class BoundedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, bounded (see the module's doc). The limits are class
    attributes, so a test can make a subclass with smaller ones."""

    max_header_bytes = MAX_HEADER_BYTES
    max_header_fields = MAX_HEADER_FIELDS
    header_timeout_s = HEADER_TIMEOUT_S

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._awaiting_headers = True  # between requests, or inside a request's header
        self._header_bytes = 0
        self._tail = b""  # the last bytes counted, to find a blank line split across reads
        self._fields = 0
        self._header_timer: asyncio.TimerHandle | None = None
        self._refused = False
        self._half_closed = False  # the client shut its sending side with a request to answer
        self._peer_check: asyncio.TimerHandle | None = None

    # ---- connection ----------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        if self._peer_check is not None:
            self._peer_check.cancel()
            self._peer_check = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._awaiting_headers:
            if self._header_timer is None:  # a kept-alive connection's next request begins
                self._arm_header_timer()
            seen = self._tail + data
            end = seen.find(_END)
            self._header_bytes += len(data) if end < 0 else max(0, end + len(_END) - len(self._tail))
            self._tail = seen[-(len(_END) - 1):]
            if self._header_bytes > self.max_header_bytes:
                self._refuse(431, f"the request's header is larger than {self.max_header_bytes} bytes",
                             "request_header_too_large")
                return
        super().data_received(data)  # uvicorn answers the parser's errors (400), but for a refusal's

    # ---- parser callbacks ----------------------------------------------------
    def on_message_begin(self) -> None:
        self._fields = 0
        super().on_message_begin()

    def on_header(self, name: bytes, value: bytes) -> None:
        self._fields += 1
        if self._fields > self.max_header_fields:
            self._refuse(431, f"the request has more than {self.max_header_fields} header fields",
                         "too_many_header_fields")
            raise _TooManyFields  # stops the parser; the connection is closing with the 431
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._awaiting_headers = False
        self._header_bytes, self._tail = 0, b""
        self._disarm_header_timer()
        super().on_headers_complete()
        if self.cycle is not None and self.cycle.scope is self.scope:  # the request's own cycle was made
            self.scope.setdefault("extensions", {})[CONNECTION_EXTENSION] = ConnectionView(self.cycle)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._awaiting_headers = True  # the timer starts with the next request's first byte

    def eof_received(self) -> bool | None:
        """The client shut its sending side. With a whole request in hand whose answer is not
        complete this may be a half-close (`shutdown(SHUT_WR)` after sending: the client still
        reads), so the connection stays open to answer it (and closes after). A client that closed
        for good resets the connection on what is written next: an interim `100 Continue` (every
        HTTP/1.1 client reads past 1xx answers) when the answer has not started, and the socket's
        error is checked at 1 ms, 10 ms and every 50 ms until the answer is complete; a reset ends
        the request as a disconnect always did. Anything else closes, as uvicorn does."""
        if self._half_closed:
            return True
        cycle = self.cycle
        if (self._refused or cycle is None or cycle.response_complete or cycle.more_body or cycle.disconnected):
            return None
        self._half_closed = True
        cycle.keep_alive = False
        if not cycle.response_started:
            cycle.waiting_for_100_continue = False
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        self._peer_check = self.loop.call_later(0.001, self._check_peer, 0.01)
        return True

    def _check_peer(self, next_s: float) -> None:
        self._peer_check = None
        cycle = self.cycle
        if cycle is None or cycle.response_complete or self.transport.is_closing():
            return
        sock = self.transport.get_extra_info("socket")
        if sock is not None and sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
            self.transport.abort()  # gone for good: connection_lost marks the request disconnected
            return
        self._peer_check = self.loop.call_later(next_s, self._check_peer, min(next_s * 5, PEER_CHECK_S))

    def send_400_response(self, msg: str) -> None:
        if not self._refused:  # the parser error a refusal raised: answered already
            super().send_400_response(msg)

    # ---- bounds --------------------------------------------------------------
    def _arm_header_timer(self) -> None:
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_too_slow)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if self._awaiting_headers and not self._refused and (self.cycle is None or self.cycle.response_complete):
            self._refuse(408, f"the request's header did not arrive within {self.header_timeout_s} s",
                         "request_timeout")

    def _refuse(self, status: int, message: str, code: str) -> None:
        """Answer and close, lingering: a socket closed with unread input resets the connection,
        and the client would lose the answer. So the answer goes out, then our side is shut, and
        what the client still sends is read and dropped until it closes or `LINGER_S` passes."""
        self._refused = True
        self._disarm_header_timer()
        if self.transport.is_closing():
            return
        self.transport.write(refusal(status, message, code))
        if self.transport.can_write_eof():
            self.transport.write_eof()
            self._header_timer = self.loop.call_later(LINGER_S, self.transport.close)
        else:
            self.transport.close()


class AnnouncingServer(uvicorn.Server):
    """A uvicorn server that prints `ready_line` once it serves: with its SIGINT/SIGTERM handlers in
    place (installed when serve() begins), so a supervisor that signals as soon as it reads the
    line gets a clean stop (or a drain), never the default action's kill."""

    def __init__(self, config: uvicorn.Config, ready_line: str = "") -> None:
        super().__init__(config)
        self.ready_line = ready_line

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and self.ready_line:
            print(self.ready_line, flush=True)


def server_config(app: Any, **options: Any) -> uvicorn.Config:
    """uvicorn's config for one of kvbridge's servers: `options` as uvicorn takes them, on the
    bounded protocol."""
    return uvicorn.Config(app, http=BoundedHttpProtocol, **options)
