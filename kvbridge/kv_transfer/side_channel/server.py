"""Side channel, P's end: the server D's handshakes and control messages reach over TCP.

Requests and replies are the length-prefixed frames of frames.py (which
also describes their authentication with the shared API key); D's client is
client.py. One request frame is answered by one reply frame of type "ok"
or "error". Besides "get_metadata" (body: tp_rank as u32; the reply is the handshake
payload of handshake.py) other modules may register handlers for their own message
types on the same server.
"""

from __future__ import annotations

import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from kvbridge.kv_transfer.side_channel.frames import (AUTH_WINDOW_S, MAX_MSG_TYPE_CHARS, MSG_GET_METADATA,
                                                      RANK, REPLY_ERROR, REPLY_OK, Frame, FrameAuthenticator,
                                                      FrameError, PeerClosed, StalledMidFrame, check_msg_type,
                                                      derive_key, encode_frame, read_frame)

logger = logging.getLogger(__name__)

DEFAULT_MAX_REQUEST_BYTES = 1 << 20  # requests are tiny; refuse anything large


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
    request must be an authenticated frame (see frames.py).

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
            check_msg_type(msg_type.encode("ascii"))
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
                frame = read_frame(conn, self._max_request_bytes, self._read_timeout_s)
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
        except (FrameError, StalledMidFrame) as exc:
            self._refuse(conn, peer, str(exc))
        except (PeerClosed, TimeoutError, OSError):
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
        if len(body) != RANK.size:
            raise HandlerRefusal("get_metadata wants a 4-byte tp_rank")
        (tp_rank,) = RANK.unpack(body)
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
