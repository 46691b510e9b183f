"""Side channel: length-prefixed request/reply frames over plain TCP, P's server, D's client.

A plain frame is

    b"KVBS" | type length (u8) | body length (u32) | type (ASCII) | body

and an authenticated request frame (sent when P and D share a key: both started with
the same --api-key / KVBRIDGE_API_KEY) is

    b"KVBA" | type length (u8) | body length (u32) | type | body
            | nonce (16 random bytes) | timestamp (u64, ms since the epoch) | tag (32 bytes)

where tag = HMAC-SHA256(k, every byte of the frame before the tag) and
k = HMAC-SHA256(api_key as UTF-8, b"kvbridge side channel v1"). A server with a key
answers "error" to a plain frame, a bad tag, a timestamp more than AUTH_WINDOW_S away
from its own clock, or a nonce it has already accepted within that window (a replay),
runs no handler, counts it (`num_unauthenticated`) and closes the connection. A server
without a key refuses authenticated frames the same way, so a key set on only one side
fails loudly rather than silently running unauthenticated. Replies are plain frames.
The key authenticates requests; it does not encrypt anything.

One request frame is answered by one reply frame of type "ok" or "error". Besides
"get_metadata" (body: tp_rank as u32; the reply is the handshake payload of
handshake.py) other modules may register handlers for their own message types on
the same server.

The client raises only HandshakeError subclasses (timeout, refused, decode error,
peer error), so its callers classify side-channel failures like handshake ones.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import logging
import secrets
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
AUTH_FRAME_MAGIC = b"KVBA"
MSG_GET_METADATA = "get_metadata"
REPLY_OK = "ok"
REPLY_ERROR = "error"
DEFAULT_MAX_REQUEST_BYTES = 1 << 20  # requests are tiny; refuse anything large
DEFAULT_MAX_REPLY_BYTES = 64 << 20  # agent metadata of a big NIXL agent is a few MB
MAX_MSG_TYPE_CHARS = 64
AUTH_WINDOW_S = 30.0  # how far a frame's timestamp may be from P's clock (either way)
AUTH_KEY_INFO = b"kvbridge side channel v1"

_FRAME_HEADER = struct.Struct("!4sBI")  # magic, message-type length, body length
_NONCE_TIME = struct.Struct("!16sQ")  # nonce, timestamp (ms since the epoch)
_AUTH_TRAILER = struct.Struct("!16sQ32s")  # nonce, timestamp, tag
_RANK = struct.Struct("!I")
_MSG_TYPE_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789_.:-")


# ---- framing -------------------------------------------------------------------------


class FrameError(Exception):
    """A side-channel frame that is garbage, oversized or truncated."""


@dataclass(frozen=True)
class Frame:
    msg_type: str
    body: bytes
    auth: bytes = b""  # an authenticated frame's trailer (nonce | timestamp | tag); b"" if plain


def encode_frame(msg_type: str, body: bytes) -> bytes:
    raw_type = msg_type.encode("ascii")
    _check_msg_type(raw_type)
    return _FRAME_HEADER.pack(FRAME_MAGIC, len(raw_type), len(body)) + raw_type + body


def derive_key(api_key: str) -> bytes:
    """The side channel's HMAC key, derived from the API key P and D share."""
    return hmac.new(api_key.encode("utf-8"), AUTH_KEY_INFO, hashlib.sha256).digest()


def encode_authenticated_frame(msg_type: str, body: bytes, key: bytes, *, nonce: bytes | None = None,
                               timestamp_ms: int | None = None) -> bytes:
    """A request frame carrying a fresh nonce, the time and an HMAC of all of it (see above)."""
    raw_type = msg_type.encode("ascii")
    _check_msg_type(raw_type)
    nonce = secrets.token_bytes(16) if nonce is None else nonce
    timestamp_ms = int(time.time() * 1000) if timestamp_ms is None else timestamp_ms
    signed = _signed_part(raw_type, body, nonce, timestamp_ms)
    return signed + hmac.new(key, signed, hashlib.sha256).digest()


def _signed_part(raw_type: bytes, body: bytes, nonce: bytes, timestamp_ms: int) -> bytes:
    header = _FRAME_HEADER.pack(AUTH_FRAME_MAGIC, len(raw_type), len(body))
    return header + raw_type + body + _NONCE_TIME.pack(nonce, timestamp_ms)


def decode_frame(data: bytes, max_body: int) -> Frame:
    """Decode exactly one whole frame from `data`; raises FrameError, nothing else."""
    if len(data) < _FRAME_HEADER.size:
        raise FrameError("truncated frame header")
    authenticated, type_len, body_len = _parse_header(data[:_FRAME_HEADER.size], max_body)
    trailer = _AUTH_TRAILER.size if authenticated else 0
    end = _FRAME_HEADER.size + type_len + body_len + trailer
    if len(data) != end:
        raise FrameError(f"frame is {len(data)} bytes, header says {end}")
    return _frame_of(data[_FRAME_HEADER.size:], type_len, body_len)


def _frame_of(rest: bytes, type_len: int, body_len: int) -> Frame:
    """The frame whose type, body and (if any) trailer are `rest`."""
    end = type_len + body_len
    return Frame(_check_msg_type(rest[:type_len]), bytes(rest[type_len:end]), bytes(rest[end:]))


def _parse_header(header: bytes, max_body: int) -> tuple[bool, int, int]:
    """(authenticated, type length, body length) of a frame header."""
    magic, type_len, body_len = _FRAME_HEADER.unpack(header)
    if magic not in (FRAME_MAGIC, AUTH_FRAME_MAGIC):
        raise FrameError("bad frame magic")
    if not 0 < type_len <= MAX_MSG_TYPE_CHARS:
        raise FrameError(f"bad message type length {type_len}")
    if body_len > max_body:
        raise FrameError(f"frame body of {body_len} bytes exceeds the limit of {max_body}")
    return magic == AUTH_FRAME_MAGIC, type_len, body_len


def _check_msg_type(raw: bytes) -> str:
    if not 0 < len(raw) <= MAX_MSG_TYPE_CHARS or not set(raw.decode("latin-1")) <= _MSG_TYPE_CHARS:
        raise FrameError("bad message type")
    return raw.decode("ascii")


class FrameAuthenticator:
    """P's check of request frames when a key is configured: tag, freshness, no replay.

    A nonce is remembered (only once its frame's tag is valid, so only key holders can
    add any) for twice the window: as long as its timestamp could still be accepted.
    Thread-safe.
    """

    def __init__(self, key: bytes, window_s: float = AUTH_WINDOW_S,
                 clock: Callable[[], float] = time.time) -> None:
        if window_s <= 0:
            raise ValueError("window_s must be positive")
        self._key = key
        self._window_s = window_s
        self._clock = clock
        self._lock = threading.Lock()
        self._seen: set[bytes] = set()
        self._expiry: collections.deque[tuple[float, bytes]] = collections.deque()  # monotonic order

    def check(self, frame: Frame) -> str | None:
        """None if `frame` is authentic, fresh and new; else why it is refused."""
        if not frame.auth:
            return "authentication required (start P and D with the same --api-key)"
        nonce, timestamp_ms, tag = _AUTH_TRAILER.unpack(frame.auth)
        signed = _signed_part(frame.msg_type.encode("ascii"), frame.body, nonce, timestamp_ms)
        if not hmac.compare_digest(tag, hmac.new(self._key, signed, hashlib.sha256).digest()):
            return "authentication failed"
        if abs(timestamp_ms / 1000 - self._clock()) > self._window_s:
            return "authentication failed: stale timestamp (are P's and D's clocks in sync?)"
        now = time.monotonic()
        with self._lock:
            while self._expiry and self._expiry[0][0] <= now:
                self._seen.discard(self._expiry.popleft()[1])
            if nonce in self._seen:
                return "authentication failed: replayed frame"
            self._seen.add(nonce)
            self._expiry.append((now + 2 * self._window_s, nonce))
        return None


class _PeerClosed(Exception):
    """EOF before the first byte of a frame."""


class _StalledMidFrame(TimeoutError):
    """The timeout hit after part of a frame had arrived."""


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        remaining = deadline - time.monotonic()
        if remaining > 0:
            sock.settimeout(remaining)
        else:  # late (say, a busy machine): take only bytes that have already arrived
            sock.settimeout(0.0)
        try:
            chunk = sock.recv(min(n - len(buf), 1 << 20))
        except BlockingIOError:
            raise TimeoutError("timed out") from None
        if not chunk:
            raise FrameError(f"truncated frame: got {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def _read_frame(sock: socket.socket, max_body: int, timeout_s: float) -> Frame:
    """Read one whole frame within timeout_s. Raises _PeerClosed, FrameError, TimeoutError, OSError."""
    deadline = time.monotonic() + timeout_s
    sock.settimeout(timeout_s)
    first = sock.recv(_FRAME_HEADER.size)
    if not first:
        raise _PeerClosed()
    try:
        header = first + _recv_exact(sock, _FRAME_HEADER.size - len(first), deadline)
        authenticated, type_len, body_len = _parse_header(header, max_body)
        trailer = _AUTH_TRAILER.size if authenticated else 0
        rest = _recv_exact(sock, type_len + body_len + trailer, deadline)
    except TimeoutError as exc:
        raise _StalledMidFrame(str(exc)) from None
    return _frame_of(rest, type_len, body_len)


# ---- server (P side) ---------------------------------------------------------------

Handler = Callable[[bytes], bytes]


@dataclass
class _Conn:
    """What the accept thread knows of one open connection (guarded by the server's lock)."""

    thread: threading.Thread
    since: float  # monotonic: when its current wait (for a frame, or to send a reply) began
    handling: bool = False  # a handler is running for it: never evicted then
    known: bool = False  # it sent a frame that passed authentication (any frame, without a key)
    evicted: bool = False


class SideChannelServer:
    """P's side-channel listener: one accept thread, one short-lived thread per connection.

    Serves pre-encoded handshake payloads by tp_rank ("get_metadata") and any message
    type registered with `register_handler`. A garbage, oversized or truncated frame
    closes that connection and is counted in `num_refused`; the listener keeps serving.
    Each request frame must arrive whole within `read_timeout_s` of the connection
    opening or of the previous reply (an idle connection is closed after that), and
    each reply must be sent within `send_timeout_s`. With `key` (the API key) every
    request must be an authenticated frame (see the module docstring).

    At `max_connections` open connections a new one evicts the connection that has
    waited longest without a handler running for it, preferring connections that
    never sent an authentic frame (counted in `num_evicted`): idle connections cannot
    lock peers out. Only when every slot is running a handler is a new one closed at
    once (counted in `num_refused`). `close()` stops and joins.
    """

    def __init__(self, payloads: Mapping[int, bytes], host: str = "127.0.0.1", port: int = 0, *,
                 read_timeout_s: float = 1.0, send_timeout_s: float = 5.0,
                 max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, max_connections: int = 32,
                 key: str | None = None, auth_window_s: float = AUTH_WINDOW_S) -> None:
        if read_timeout_s <= 0 or send_timeout_s <= 0 or max_connections < 1:
            raise ValueError("need positive timeouts and max_connections >= 1")
        self._payloads = dict(payloads)
        self._handlers: dict[str, Handler] = {MSG_GET_METADATA: self._get_metadata}
        self._bind_addr = (host, port)
        self._read_timeout_s = read_timeout_s
        self._send_timeout_s = send_timeout_s
        self._max_request_bytes = max_request_bytes
        self._max_connections = max_connections
        self._auth = FrameAuthenticator(derive_key(key), auth_window_s) if key is not None else None
        self._lock = threading.Lock()
        self._conns: dict[socket.socket, _Conn] = {}
        self._stopping = threading.Event()
        self._listener: socket.socket | None = None
        self._wake_r, self._wake_w = socket.socketpair()  # wakes the selector on close
        self._thread: threading.Thread | None = None
        self._port: int | None = None
        self.num_served = 0  # requests answered by a handler ("ok" or "error")
        self.num_refused = 0  # connections closed for a bad frame, a stall or overload
        self.num_evicted = 0  # idle connections closed to make room for a new one
        self.num_unauthenticated = 0  # requests refused for a missing, bad, stale or replayed tag

    @property
    def authenticated(self) -> bool:
        """Whether requests must carry a valid tag (a key was configured)."""
        return self._auth is not None

    def start(self) -> SideChannelServer:
        host, port = self._bind_addr
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, port), family=family, backlog=128)
        self._listener.setblocking(False)  # accept() after select() must never block
        self._port = self._listener.getsockname()[1]
        self._thread = threading.Thread(target=self._accept_loop, daemon=True,
                                        name=f"kvbridge-side-channel-{self.port}")
        self._thread.start()
        logger.info("side channel listening on %s:%s%s", host, self.port,
                    " (authenticated)" if self._auth is not None else "")
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

    @property
    def num_open(self) -> int:
        """Connections being served now (evicted ones on their way out excluded)."""
        with self._lock:
            return sum(not c.evicted for c in self._conns.values())

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
        for _, state in conns:
            state.thread.join()
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
        thread = threading.Thread(target=self._serve_conn, args=(conn, peer), daemon=True,
                                  name=f"kvbridge-side-channel-{self._port}-conn")
        with self._lock:
            victim = self._evict_one() if self._count_open() >= self._max_connections else None
            admitted = self._count_open() < self._max_connections
            if admitted:
                self._conns[conn] = _Conn(thread, since=time.monotonic())
            evicted = self.num_evicted
        if victim is not None:
            if evicted & (evicted - 1) == 0:  # 1, 2, 4, 8...: a flood does not flood the log
                logger.warning("side channel at its limit of %d connections: closed the longest idle "
                               "one to admit %s (%d evicted so far)", self._max_connections, peer, evicted)
            _shutdown_quietly(victim)  # its thread sees EOF or an error, closes it and exits
        if admitted:
            thread.start()
        else:
            self._refuse(conn, peer, "too many connections, all busy")
            conn.close()

    def _count_open(self) -> int:
        return sum(not c.evicted for c in self._conns.values())

    def _evict_one(self) -> socket.socket | None:
        """Mark the connection to evict (under the lock): no handler running, never
        authenticated before authenticated, then the longest waiting."""
        candidates = [(c.known, c.since, i, conn) for i, (conn, c) in enumerate(self._conns.items())
                      if not c.evicted and not c.handling]
        if not candidates:
            return None
        victim = min(candidates)[3]
        self._conns[victim].evicted = True
        self.num_evicted += 1
        return victim

    def _enter_handler(self, conn: socket.socket, known: bool) -> bool:
        """Mark `conn` as running a handler; False if it was evicted meanwhile (drop the frame)."""
        with self._lock:
            state = self._conns[conn]
            if state.evicted:
                return False
            state.handling = True
            state.known = state.known or known
            return True

    def _wait_again(self, conn: socket.socket) -> None:
        """`conn` now waits (to send a reply, or for its next frame): evictable, budget restarts."""
        with self._lock:
            state = self._conns[conn]
            state.handling = False
            state.since = time.monotonic()

    def _serve_conn(self, conn: socket.socket, peer: object) -> None:
        try:
            while not self._stopping.is_set():
                frame = _read_frame(conn, self._max_request_bytes, self._read_timeout_s)
                refusal = self._authenticate(frame)
                if not self._enter_handler(conn, known=refusal is None):
                    return
                if refusal is not None:
                    with self._lock:
                        self.num_unauthenticated += 1
                        count = self.num_unauthenticated
                    if count & (count - 1) == 0:
                        logger.warning("side channel refused an unauthenticated %r from %s: %s "
                                       "(%d so far)", frame.msg_type, peer, refusal, count)
                    reply = encode_frame(REPLY_ERROR, refusal.encode())
                else:
                    reply = self._dispatch(frame)
                    with self._lock:  # counted before sending, so a client that has its reply sees it
                        self.num_served += 1
                self._wait_again(conn)
                conn.settimeout(self._send_timeout_s)
                conn.sendall(reply)
                if refusal is not None:
                    return  # no second try on this connection
                self._wait_again(conn)
        except (FrameError, _StalledMidFrame) as exc:
            self._refuse(conn, peer, str(exc))
        except (_PeerClosed, TimeoutError, OSError):
            pass  # client done, idle past the timeout, evicted, or reset: nothing was half-read
        finally:
            with self._lock:
                self._conns.pop(conn, None)
            conn.close()

    def _authenticate(self, frame: Frame) -> str | None:
        """None if the frame may be served; else why not."""
        if self._auth is not None:
            return self._auth.check(frame)
        if frame.auth:
            return "this side channel has no key: start P and D with the same --api-key"
        return None

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
    """Blocking side-channel requests, each on its own connection, bounded by a timeout.

    With `key` (the API key P was started with) every request is an authenticated frame.
    """

    def __init__(self, *, key: str | None = None, max_reply_bytes: int = DEFAULT_MAX_REPLY_BYTES) -> None:
        self._key = derive_key(key) if key is not None else None
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
        # A bad msg_type is the caller's bug: raise here.
        frame = (encode_frame(msg_type, body) if self._key is None
                 else encode_authenticated_frame(msg_type, body, self._key))
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
