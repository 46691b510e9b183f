"""Side channel: length-prefixed request/reply frames over plain TCP, P's server, D's client.

Every frame is

    b"KVBS" | type length (u8) | body length (u32) | type (ASCII) | body

one request frame answered by one reply frame of type "ok" or "error". Besides
"get_metadata" (body: tp_rank as u32; the reply is the handshake payload of
handshake.py) other modules may register handlers for their own message types on
the same server.

The client raises only HandshakeError subclasses (timeout, refused, decode error,
peer error), so its callers classify side-channel failures like handshake ones.
"""

from __future__ import annotations

import logging
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from kvbridge.kv_transfer.handshake import (HandshakeDecodeError, HandshakePeerError,
                                            HandshakeRefused, HandshakeTimeout)

logger = logging.getLogger(__name__)

FRAME_MAGIC = b"KVBS"
MSG_GET_METADATA = "get_metadata"
REPLY_OK = "ok"
REPLY_ERROR = "error"
DEFAULT_MAX_REQUEST_BYTES = 1 << 20  # requests are tiny; refuse anything large
DEFAULT_MAX_REPLY_BYTES = 64 << 20  # agent metadata of a big NIXL agent is a few MB
MAX_MSG_TYPE_CHARS = 64

_FRAME_HEADER = struct.Struct("!4sBI")  # magic, message-type length, body length
_RANK = struct.Struct("!I")
_MSG_TYPE_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789_.:-")


# ---- framing -------------------------------------------------------------------------


class FrameError(Exception):
    """A side-channel frame that is garbage, oversized or truncated."""


@dataclass(frozen=True)
class Frame:
    msg_type: str
    body: bytes


def encode_frame(msg_type: str, body: bytes) -> bytes:
    raw_type = msg_type.encode("ascii")
    _check_msg_type(raw_type)
    return _FRAME_HEADER.pack(FRAME_MAGIC, len(raw_type), len(body)) + raw_type + body


def decode_frame(data: bytes, max_body: int) -> Frame:
    """Decode exactly one whole frame from `data`; raises FrameError, nothing else."""
    if len(data) < _FRAME_HEADER.size:
        raise FrameError("truncated frame header")
    type_len, body_len = _parse_header(data[:_FRAME_HEADER.size], max_body)
    end = _FRAME_HEADER.size + type_len + body_len
    if len(data) != end:
        raise FrameError(f"frame is {len(data)} bytes, header says {end}")
    raw_type = data[_FRAME_HEADER.size:_FRAME_HEADER.size + type_len]
    return Frame(_check_msg_type(raw_type), bytes(data[_FRAME_HEADER.size + type_len:]))


def _parse_header(header: bytes, max_body: int) -> tuple[int, int]:
    magic, type_len, body_len = _FRAME_HEADER.unpack(header)
    if magic != FRAME_MAGIC:
        raise FrameError("bad frame magic")
    if not 0 < type_len <= MAX_MSG_TYPE_CHARS:
        raise FrameError(f"bad message type length {type_len}")
    if body_len > max_body:
        raise FrameError(f"frame body of {body_len} bytes exceeds the limit of {max_body}")
    return type_len, body_len


def _check_msg_type(raw: bytes) -> str:
    if not 0 < len(raw) <= MAX_MSG_TYPE_CHARS or not set(raw.decode("latin-1")) <= _MSG_TYPE_CHARS:
        raise FrameError("bad message type")
    return raw.decode("ascii")


class _PeerClosed(Exception):
    """EOF before the first byte of a frame."""


class _StalledMidFrame(TimeoutError):
    """The timeout hit after part of a frame had arrived."""


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("timed out")
        sock.settimeout(remaining)
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise FrameError(f"truncated frame: got {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def _read_frame(sock: socket.socket, max_body: int, timeout_s: float) -> Frame:
    """Read one frame within timeout_s. Raises _PeerClosed, FrameError, TimeoutError, OSError."""
    deadline = time.monotonic() + timeout_s
    sock.settimeout(timeout_s)
    first = sock.recv(_FRAME_HEADER.size)
    if not first:
        raise _PeerClosed()
    try:
        header = first + _recv_exact(sock, _FRAME_HEADER.size - len(first), deadline)
        type_len, body_len = _parse_header(header, max_body)
        rest = _recv_exact(sock, type_len + body_len, deadline)
    except TimeoutError as exc:
        raise _StalledMidFrame(str(exc)) from None
    return Frame(_check_msg_type(rest[:type_len]), rest[type_len:])


# ---- server (P side) ---------------------------------------------------------------

Handler = Callable[[bytes], bytes]


class SideChannelServer:
    """P's side-channel listener: one accept thread, one short-lived thread per connection.

    Serves pre-encoded handshake payloads by tp_rank ("get_metadata") and any message
    type registered with `register_handler`. A garbage, oversized or truncated frame
    closes that connection and is counted in `num_refused`; the listener keeps serving.
    Each frame must arrive within `read_timeout_s`. Beyond `max_connections` open
    connections, new ones are closed at once (counted too). `close()` stops and joins.
    """

    def __init__(self, payloads: Mapping[int, bytes], host: str = "127.0.0.1", port: int = 0, *,
                 read_timeout_s: float = 5.0, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
                 max_connections: int = 32) -> None:
        self._payloads = dict(payloads)
        self._handlers: dict[str, Handler] = {MSG_GET_METADATA: self._get_metadata}
        self._bind_addr = (host, port)
        self._read_timeout_s = read_timeout_s
        self._max_request_bytes = max_request_bytes
        self._max_connections = max_connections
        self._lock = threading.Lock()
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._stopping = threading.Event()
        self._listener: socket.socket | None = None
        self._wake_r, self._wake_w = socket.socketpair()  # wakes the selector on close
        self._thread: threading.Thread | None = None
        self._port: int | None = None
        self.num_served = 0  # requests answered, "ok" or "error"
        self.num_refused = 0  # connections closed for a bad frame, a stall or overload

    def start(self) -> SideChannelServer:
        host, port = self._bind_addr
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, port), family=family, backlog=128)
        self._listener.setblocking(False)  # accept() after select() must never block
        self._port = self._listener.getsockname()[1]
        self._thread = threading.Thread(target=self._accept_loop, daemon=True,
                                        name=f"kvbridge-side-channel-{self.port}")
        self._thread.start()
        logger.info("side channel listening on %s:%s", host, self.port)
        return self

    @property
    def host(self) -> str:
        return self._bind_addr[0]

    @property
    def port(self) -> int:
        """The bound port (the OS's choice when constructed with port 0)."""
        if self._port is None:
            raise RuntimeError("side channel server not started")
        return self._port

    def register_handler(self, msg_type: str, handler: Handler) -> None:
        """Serve `msg_type` with handler(body) -> reply body; called on connection threads.

        A handler that raises makes the client see an "error" reply; the server goes on.
        """
        try:
            _check_msg_type(msg_type.encode("ascii"))
        except (FrameError, UnicodeEncodeError):
            raise ValueError(f"bad message type {msg_type!r}: 1-{MAX_MSG_TYPE_CHARS} "
                             "characters of a-z 0-9 _ . : -") from None
        with self._lock:
            if msg_type in self._handlers:
                raise ValueError(f"a handler for {msg_type!r} is already registered")
            self._handlers[msg_type] = handler

    def set_payload(self, tp_rank: int, payload: bytes) -> None:
        with self._lock:
            self._payloads[tp_rank] = payload

    def close(self) -> None:
        """Stop accepting, cut open connections, join every thread. Idempotent."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        self._wake_w.send(b"x")
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            conns = list(self._conns.items())
        for conn, _ in conns:
            _shutdown_quietly(conn)
        for _, thread in conns:
            thread.join()
        if self._listener is not None:
            self._listener.close()
        self._wake_r.close()
        self._wake_w.close()

    def __enter__(self) -> SideChannelServer:
        return self.start() if self._listener is None else self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _accept_loop(self) -> None:
        assert self._listener is not None
        with selectors.DefaultSelector() as selector:  # not select(): fds may exceed 1024
            selector.register(self._listener, selectors.EVENT_READ)
            selector.register(self._wake_r, selectors.EVENT_READ)
            while not self._stopping.is_set():
                selector.select()
                if not self._stopping.is_set():
                    self._accept_one()

    def _accept_one(self) -> None:
        assert self._listener is not None
        try:
            conn, peer = self._listener.accept()
        except OSError:
            return  # the client gave up between select and accept
        with self._lock:
            overloaded = len(self._conns) >= self._max_connections
            if not overloaded:
                thread = threading.Thread(target=self._serve_conn, args=(conn, peer),
                                          daemon=True,
                                          name=f"kvbridge-side-channel-{self._port}-conn")
                self._conns[conn] = thread
        if overloaded:
            self._refuse(conn, peer, "too many connections")
            conn.close()
        else:
            thread.start()

    def _serve_conn(self, conn: socket.socket, peer: object) -> None:
        try:
            while not self._stopping.is_set():
                frame = _read_frame(conn, self._max_request_bytes, self._read_timeout_s)
                reply = self._dispatch(frame)
                with self._lock:  # counted before sending, so a client that has its reply sees it
                    self.num_served += 1
                conn.settimeout(self._read_timeout_s)  # a fresh budget for sending the reply
                conn.sendall(reply)
        except (FrameError, _StalledMidFrame) as exc:
            self._refuse(conn, peer, str(exc))
        except (_PeerClosed, TimeoutError, OSError):
            pass  # client done, idle past the timeout, or reset: nothing was half-read
        finally:
            with self._lock:
                self._conns.pop(conn, None)
            conn.close()

    def _dispatch(self, frame: Frame) -> bytes:
        with self._lock:
            handler = self._handlers.get(frame.msg_type)
        if handler is None:
            return encode_frame(REPLY_ERROR, f"unknown message type {frame.msg_type!r}".encode())
        try:
            reply = handler(frame.body)
            if not isinstance(reply, bytes):
                raise TypeError(f"handler returned {type(reply).__name__}, not bytes")
        except HandlerRefusal as exc:
            return encode_frame(REPLY_ERROR, str(exc).encode())
        except Exception:
            logger.exception("side channel handler for %s failed", frame.msg_type)
            return encode_frame(REPLY_ERROR, f"handler for {frame.msg_type!r} failed".encode())
        return encode_frame(REPLY_OK, reply)

    def _get_metadata(self, body: bytes) -> bytes:
        if len(body) != _RANK.size:
            raise HandlerRefusal("get_metadata wants a 4-byte tp_rank")
        (tp_rank,) = _RANK.unpack(body)
        with self._lock:
            payload = self._payloads.get(tp_rank)
        if payload is None:
            raise HandlerRefusal(f"no handshake metadata for tp_rank {tp_rank}")
        return payload

    def _refuse(self, conn: socket.socket, peer: object, reason: str) -> None:
        with self._lock:
            self.num_refused += 1
            count = self.num_refused
        if count & (count - 1) == 0:  # 1, 2, 4, 8...: a flood does not flood the log
            logger.warning("side channel refused a connection from %s: %s (%d refused so far)",
                           peer, reason, count)
        _shutdown_quietly(conn)


class HandlerRefusal(Exception):
    """Raise from a handler to answer "error" with this message (no traceback logged)."""


def _shutdown_quietly(conn: socket.socket) -> None:
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already closed by the peer


# ---- client (D side) ---------------------------------------------------------------


class HandshakeClient:
    """Blocking side-channel requests, each on its own connection, bounded by a timeout."""

    def __init__(self, *, max_reply_bytes: int = DEFAULT_MAX_REPLY_BYTES) -> None:
        self._max_reply_bytes = max_reply_bytes

    def fetch(self, host: str, port: int, tp_rank: int, timeout: float) -> bytes:
        """The raw handshake payload P serves for tp_rank (decode it with decode_payload)."""
        if type(tp_rank) is not int or not 0 <= tp_rank < 2**32:
            raise ValueError(f"tp_rank must be an unsigned 32-bit int, got {tp_rank!r}")
        return self.request(host, port, MSG_GET_METADATA, _RANK.pack(tp_rank), timeout)

    def request(self, host: str, port: int, msg_type: str, body: bytes, timeout: float) -> bytes:
        """Send one frame and return the "ok" reply's body within `timeout` seconds in all.

        Raises HandshakeTimeout, HandshakeRefused (cannot connect, or the peer closed
        without answering), HandshakeDecodeError (garbage reply), HandshakePeerError.
        """
        frame = encode_frame(msg_type, body)  # a bad msg_type is the caller's bug: raise here
        deadline = time.monotonic() + timeout
        where = f"side channel {host}:{port}"
        try:
            with socket.create_connection((host, port), timeout=timeout) as sock:
                sock.settimeout(max(deadline - time.monotonic(), 1e-3))
                sock.sendall(frame)
                remaining = max(deadline - time.monotonic(), 1e-3)
                reply = _read_frame(sock, self._max_reply_bytes, remaining)
        except TimeoutError:
            raise HandshakeTimeout(f"{where} did not answer within {timeout}s") from None
        except (_PeerClosed, ConnectionResetError, BrokenPipeError):
            raise HandshakeRefused(f"{where} closed the connection") from None
        except FrameError as exc:
            raise HandshakeDecodeError(f"bad reply from {where}: {exc}") from None
        except (OSError, OverflowError, ValueError) as exc:  # refused, unreachable, bad address
            raise HandshakeRefused(f"cannot connect to {where}: {exc}") from None
        if reply.msg_type == REPLY_OK:
            return reply.body
        if reply.msg_type == REPLY_ERROR:
            message = reply.body[:500].decode("utf-8", "replace")
            raise HandshakePeerError(f"{where} answered: {message}")
        raise HandshakeDecodeError(f"{where} sent reply type {reply.msg_type!r}")
