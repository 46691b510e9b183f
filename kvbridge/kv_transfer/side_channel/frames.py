"""Side-channel frames: the wire format, its HMAC authentication, and reading one from a socket.

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

One request frame is answered by one reply frame of type "ok" or "error". P's server
is server.py, D's client client.py.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

FRAME_MAGIC = b"KVBS"
AUTH_FRAME_MAGIC = b"KVBA"
MSG_GET_METADATA = "get_metadata"
REPLY_OK = "ok"
REPLY_ERROR = "error"
MAX_MSG_TYPE_CHARS = 64
AUTH_WINDOW_S = 30.0  # how far a frame's timestamp may be from P's clock (either way)
AUTH_KEY_INFO = b"kvbridge side channel v1"

_FRAME_HEADER = struct.Struct("!4sBI")  # magic, message-type length, body length
_NONCE_TIME = struct.Struct("!16sQ")  # nonce, timestamp (ms since the epoch)
_AUTH_TRAILER = struct.Struct("!16sQ32s")  # nonce, timestamp, tag
RANK = struct.Struct("!I")  # the body of a "get_metadata" request: tp_rank
_MSG_TYPE_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789_.:-")


class FrameError(Exception):
    """A side-channel frame that is garbage, oversized or truncated."""


@dataclass(frozen=True)
class Frame:
    msg_type: str
    body: bytes
    auth: bytes = b""  # an authenticated frame's trailer (nonce | timestamp | tag); b"" if plain


def encode_frame(msg_type: str, body: bytes) -> bytes:
    raw_type = msg_type.encode("ascii")
    check_msg_type(raw_type)
    return _FRAME_HEADER.pack(FRAME_MAGIC, len(raw_type), len(body)) + raw_type + body


def derive_key(api_key: str) -> bytes:
    """The side channel's HMAC key, derived from the API key P and D share."""
    return hmac.new(api_key.encode("utf-8"), AUTH_KEY_INFO, hashlib.sha256).digest()


def encode_authenticated_frame(msg_type: str, body: bytes, key: bytes, *, nonce: bytes | None = None,
                               timestamp_ms: int | None = None) -> bytes:
    """A request frame carrying a fresh nonce, the time and an HMAC of all of it (see above)."""
    raw_type = msg_type.encode("ascii")
    check_msg_type(raw_type)
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
    return Frame(check_msg_type(rest[:type_len]), bytes(rest[type_len:end]), bytes(rest[end:]))


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


def check_msg_type(raw: bytes) -> str:
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


class PeerClosed(Exception):
    """EOF before the first byte of a frame."""


class StalledMidFrame(TimeoutError):
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


def read_frame(sock: socket.socket, max_body: int, timeout_s: float) -> Frame:
    """Read one whole frame within timeout_s. Raises PeerClosed, FrameError, TimeoutError, OSError."""
    deadline = time.monotonic() + timeout_s
    sock.settimeout(timeout_s)
    first = sock.recv(_FRAME_HEADER.size)
    if not first:
        raise PeerClosed()
    try:
        header = first + _recv_exact(sock, _FRAME_HEADER.size - len(first), deadline)
        authenticated, type_len, body_len = _parse_header(header, max_body)
        trailer = _AUTH_TRAILER.size if authenticated else 0
        rest = _recv_exact(sock, type_len + body_len + trailer, deadline)
    except TimeoutError as exc:
        raise StalledMidFrame(str(exc)) from None
    return _frame_of(rest, type_len, body_len)
