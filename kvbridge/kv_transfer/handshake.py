"""Handshake side channel: P serves its transfer metadata, D fetches and validates it.

The wire payload P serves for one TP rank is a fixed header followed by a body:

    header  b"KVBH" | connector version (u16) | compatibility hash (32 bytes) | body length (u32)
    body    UTF-8 JSON: engine_id, backend, agent_metadata (base64), layout (RankLayout)

The magic and version come first and stay put in every future version. D checks, in
order: magic, version, compatibility hash, and only then decodes the body, so a peer
running another model or release is refused with a precise reason rather than a
decode error. Then the engine id (when D knows which engine it expects) and the
memory layout are checked against D's own.

The side channel is plain TCP carrying length-prefixed frames,

    b"KVBS" | type length (u8) | body length (u32) | type (ASCII) | body

one request frame answered by one reply frame of type "ok" or "error". Besides
"get_metadata" (body: tp_rank as u32) other modules may register handlers for their
own message types on the same server.

Every failure is a HandshakeError subclass tagged with a HandshakeFailureKind, so the
connector's failure handler can classify it; HandshakeManager turns them into failed
futures and never raises into its callers.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import hmac
import ipaddress
import json
import logging
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor, Future, InvalidStateError, ThreadPoolExecutor
from dataclasses import dataclass
from enum import Enum
from functools import lru_cache
from typing import Any, ClassVar

logger = logging.getLogger(__name__)

KVBRIDGE_CONNECTOR_VERSION = 1
PAYLOAD_MAGIC = b"KVBH"
FRAME_MAGIC = b"KVBS"
MSG_GET_METADATA = "get_metadata"
REPLY_OK = "ok"
REPLY_ERROR = "error"
DEFAULT_MAX_REQUEST_BYTES = 1 << 20  # requests are tiny; refuse anything large
DEFAULT_MAX_REPLY_BYTES = 64 << 20  # agent metadata of a big NIXL agent is a few MB
MAX_MSG_TYPE_CHARS = 64

_PAYLOAD_PREFIX = struct.Struct("!4sH")  # magic, connector version
HASH_LEN = 32  # SHA-256 digest
_PAYLOAD_V1 = struct.Struct(f"!{HASH_LEN}sI")  # compatibility hash, body length
_FRAME_HEADER = struct.Struct("!4sBI")  # magic, message-type length, body length
_RANK = struct.Struct("!I")
_MSG_TYPE_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789_.:-")


class HandshakeFailureKind(str, Enum):
    VERSION_MISMATCH = "version_mismatch"  # peer runs another kvbridge connector version
    HASH_MISMATCH = "hash_mismatch"  # another model, dtype, head geometry, backend...
    ENGINE_MISMATCH = "engine_mismatch"  # the address serves another engine than named
    LAYOUT_MISMATCH = "layout_mismatch"  # KV layout, block size or block ratio differ
    DECODE_ERROR = "decode_error"  # garbage or truncated payload or reply
    TIMEOUT = "timeout"  # no complete answer within the timeout
    REFUSED = "refused"  # could not connect, or the peer closed without answering
    PEER_ERROR = "peer_error"  # the peer answered with an error (e.g. unknown tp_rank)


class HandshakeError(Exception):
    """Base of all handshake failures; only its subclasses are raised."""

    kind: ClassVar[HandshakeFailureKind]


class HandshakeVersionMismatch(HandshakeError):
    kind = HandshakeFailureKind.VERSION_MISMATCH


class HandshakeHashMismatch(HandshakeError):
    kind = HandshakeFailureKind.HASH_MISMATCH


class HandshakeEngineMismatch(HandshakeError):
    kind = HandshakeFailureKind.ENGINE_MISMATCH


class HandshakeLayoutMismatch(HandshakeError):
    kind = HandshakeFailureKind.LAYOUT_MISMATCH


class HandshakeDecodeError(HandshakeError):
    kind = HandshakeFailureKind.DECODE_ERROR


class HandshakeTimeout(HandshakeError):
    kind = HandshakeFailureKind.TIMEOUT


class HandshakeRefused(HandshakeError):
    kind = HandshakeFailureKind.REFUSED


class HandshakePeerError(HandshakeError):
    kind = HandshakeFailureKind.PEER_ERROR


@dataclass(frozen=True)
class CompatibilityInfo:
    """What two engines must share for one to read the other's KV: the hash inputs.

    TP size, block size, KV layout and the logical/kernel block ratio are deliberately
    left out: they may legitimately differ or are checked by `validate_layout`, which can
    name the exact difference instead of "hash mismatch".
    """

    model: str  # model identity: name, plus a weights fingerprint where one exists
    dtype: str  # compute dtype
    num_kv_heads: int  # total over all TP ranks
    head_size: int
    num_layers: int
    cache_dtype: str
    attention_backend: str = "torch"
    use_mla: bool = False
    kv_cache_groups: tuple[str, ...] = ("full_attention",)  # spec kind of each group, in order
    connector_version: int = KVBRIDGE_CONNECTOR_VERSION

    def __post_init__(self) -> None:
        for name in ("num_kv_heads", "head_size", "num_layers", "connector_version"):
            if type(getattr(self, name)) is not int or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive int")
        object.__setattr__(self, "kv_cache_groups", tuple(self.kv_cache_groups))

    def canonical(self) -> bytes:
        return json.dumps(dataclasses.asdict(self), sort_keys=True, separators=(",", ":")).encode()

    def hash(self) -> bytes:
        """SHA-256 (32 bytes) of the canonical JSON encoding of every field."""
        return hashlib.sha256(self.canonical()).digest()


@dataclass(frozen=True)
class RankLayout:
    """Where one TP rank's KV cache lives in memory. Raises ValueError when inconsistent."""

    tp_size: int
    tp_rank: int
    region_base_addrs: tuple[int, ...]  # one registered region per KV tensor (K and V apart)
    block_len_bytes: tuple[int, ...]  # bytes of one kernel block, per region
    num_blocks: int  # kernel blocks per region
    block_size: int  # tokens per kernel block
    kv_layout: str  # e.g. "HND" or "NHD"
    physical_blocks_per_logical: int = 1  # kernel blocks per scheduler (logical) block

    def __post_init__(self) -> None:
        for name in ("region_base_addrs", "block_len_bytes"):
            if not isinstance(getattr(self, name), (list, tuple)):
                raise ValueError(f"{name} must be a sequence of ints")
            object.__setattr__(self, name, tuple(getattr(self, name)))
        for name in ("tp_size", "tp_rank", "num_blocks", "block_size",
                     "physical_blocks_per_logical"):
            if type(getattr(self, name)) is not int:
                raise ValueError(f"{name} must be an int")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} outside tp_size {self.tp_size}")
        if min(self.num_blocks, self.block_size, self.physical_blocks_per_logical) < 1:
            raise ValueError("num_blocks, block_size and physical_blocks_per_logical must be >= 1")
        if not self.region_base_addrs or len(self.region_base_addrs) != len(self.block_len_bytes):
            raise ValueError("need one block_len_bytes per region, and at least one region")
        if not all(type(a) is int and 0 <= a < 2**64 for a in self.region_base_addrs):
            raise ValueError("region base addresses must be unsigned 64-bit ints")
        if not all(type(n) is int and 0 < n < 2**48 for n in self.block_len_bytes):
            raise ValueError("block_len_bytes must be positive ints")
        if not isinstance(self.kv_layout, str) or not self.kv_layout:
            raise ValueError("kv_layout must be a non-empty string")


@dataclass(frozen=True)
class HandshakeMetadata:
    """What D learns from P's side channel for one of P's TP ranks."""

    engine_id: str
    backend: str  # transfer backend name: nixl | tcp | fake
    agent_metadata: bytes  # the backend's own agent blob (NIXL: get_agent_metadata())
    layout: RankLayout

    def __post_init__(self) -> None:
        if not isinstance(self.engine_id, str) or not self.engine_id:
            raise ValueError("engine_id must be a non-empty string")
        if not isinstance(self.backend, str) or not self.backend:
            raise ValueError("backend must be a non-empty string")
        if not isinstance(self.agent_metadata, bytes):
            raise ValueError("agent_metadata must be bytes")
        if not isinstance(self.layout, RankLayout):
            raise ValueError("layout must be a RankLayout")


def encode_payload(metadata: HandshakeMetadata, compat_hash: bytes) -> bytes:
    """P side: the bytes served for one rank (compute once, at registration)."""
    if len(compat_hash) != HASH_LEN:
        raise ValueError("compat_hash must be a 32-byte SHA-256 digest")
    body_obj = {
        "engine_id": metadata.engine_id,
        "backend": metadata.backend,
        "agent_metadata": base64.b64encode(metadata.agent_metadata).decode("ascii"),
        "layout": dataclasses.asdict(metadata.layout),
    }
    body = json.dumps(body_obj, sort_keys=True, separators=(",", ":")).encode()
    header = _PAYLOAD_PREFIX.pack(PAYLOAD_MAGIC, KVBRIDGE_CONNECTOR_VERSION)
    return header + _PAYLOAD_V1.pack(compat_hash, len(body)) + body


def decode_payload(data: bytes, expected_hash: bytes, expected_engine_id: str | None = None,
                   local_layout: RankLayout | None = None, *,
                   prefix_caching: bool = False) -> HandshakeMetadata:
    """D side: check and decode P's payload. Raises only HandshakeError subclasses.

    Order: magic (DecodeError), version (VersionMismatch), compatibility hash
    (HashMismatch, before any body byte is looked at), body (DecodeError), engine id
    (EngineMismatch, skipped when expected_engine_id is None), layout against
    `local_layout` (LayoutMismatch, skipped when None).
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise HandshakeDecodeError(f"payload must be bytes, got {type(data).__name__}")
    data = bytes(data)
    if len(data) < _PAYLOAD_PREFIX.size:
        raise HandshakeDecodeError(f"payload truncated: {len(data)} bytes, no header")
    magic, version = _PAYLOAD_PREFIX.unpack_from(data)
    if magic != PAYLOAD_MAGIC:
        raise HandshakeDecodeError("not a kvbridge handshake payload (bad magic)")
    if version != KVBRIDGE_CONNECTOR_VERSION:
        raise HandshakeVersionMismatch(
            f"peer speaks kvbridge connector version {version}, "
            f"this engine {KVBRIDGE_CONNECTOR_VERSION}")
    header_len = _PAYLOAD_PREFIX.size + _PAYLOAD_V1.size
    if len(data) < header_len:
        raise HandshakeDecodeError(f"payload truncated: {len(data)} bytes, header is {header_len}")
    compat_hash, body_len = _PAYLOAD_V1.unpack_from(data, _PAYLOAD_PREFIX.size)
    if not hmac.compare_digest(compat_hash, expected_hash):
        raise HandshakeHashMismatch(
            f"compatibility hash mismatch: peer {compat_hash.hex()[:16]}, local "
            f"{bytes(expected_hash).hex()[:16]} (model, dtype, KV heads, head size, layers, "
            "cache dtype, attention backend, MLA or KV cache groups differ)")
    if len(data) - header_len != body_len:
        raise HandshakeDecodeError(
            f"payload body is {len(data) - header_len} bytes, header says {body_len}")
    metadata = _decode_body(data[header_len:])
    if expected_engine_id is not None and metadata.engine_id != expected_engine_id:
        raise HandshakeEngineMismatch(
            f"expected engine {expected_engine_id!r}, the side channel serves "
            f"{metadata.engine_id!r} (stale kv_transfer_params or a misconfigured host?)")
    if local_layout is not None:
        validate_layout(metadata.layout, local_layout, prefix_caching=prefix_caching)
    return metadata


def validate_layout(remote: RankLayout, local: RankLayout, *, prefix_caching: bool) -> None:
    """Raise HandshakeLayoutMismatch when D (local) cannot read P's (remote) blocks.

    TP-ratio arithmetic (block lengths per head slice) belongs to the topology module,
    which can pass its own check to HandshakeManager as `validate`.
    """
    if remote.kv_layout != local.kv_layout:
        raise HandshakeLayoutMismatch(
            f"KV layout differs: peer {remote.kv_layout}, local {local.kv_layout}")
    if remote.block_size != local.block_size:
        raise HandshakeLayoutMismatch(
            f"block size differs: peer {remote.block_size} tokens, local {local.block_size}")
    if len(remote.region_base_addrs) != len(local.region_base_addrs):
        raise HandshakeLayoutMismatch(
            f"peer registers {len(remote.region_base_addrs)} KV regions, "
            f"local {len(local.region_base_addrs)}")
    if prefix_caching and remote.physical_blocks_per_logical != local.physical_blocks_per_logical:
        raise HandshakeLayoutMismatch(
            f"peer has {remote.physical_blocks_per_logical} kernel blocks per logical block, "
            f"local {local.physical_blocks_per_logical}: with prefix caching on they must "
            "match (disable prefix caching on the decode instance or align block sizes)")


def _decode_body(body: bytes) -> HandshakeMetadata:
    try:
        obj = json.loads(body.decode("utf-8"))
        layout = _typed(obj, "layout", dict)
        return HandshakeMetadata(
            engine_id=_typed(obj, "engine_id", str),
            backend=_typed(obj, "backend", str),
            agent_metadata=base64.b64decode(_typed(obj, "agent_metadata", str), validate=True),
            layout=RankLayout(
                tp_size=_typed(layout, "tp_size", int),
                tp_rank=_typed(layout, "tp_rank", int),
                region_base_addrs=_typed(layout, "region_base_addrs", list),
                block_len_bytes=_typed(layout, "block_len_bytes", list),
                num_blocks=_typed(layout, "num_blocks", int),
                block_size=_typed(layout, "block_size", int),
                kv_layout=_typed(layout, "kv_layout", str),
                physical_blocks_per_logical=_typed(layout, "physical_blocks_per_logical", int),
            ))
    except (ValueError, TypeError, KeyError, RecursionError) as exc:  # incl. binascii.Error
        raise HandshakeDecodeError(f"malformed handshake body: {exc}") from None


def _typed(obj: object, name: str, typ: type) -> Any:
    if not isinstance(obj, dict):
        raise TypeError("expected a JSON object")
    value = obj[name]
    if type(value) is not typ:  # exact: a JSON bool must not pass as an int
        raise TypeError(f"{name} must be {typ.__name__}")
    return value


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


# ---- deduplicating, backing-off handshakes (D side) ---------------------------------

HandshakeKey = tuple[str | None, str, int, int]  # (engine_id, host, port, tp_rank)


@dataclass(frozen=True)
class _Failure:
    error: HandshakeError
    retry_at: float  # clock() time before which ensure() answers from this record
    backoff_s: float


class HandshakeManager:
    """D's handshakes: at most one in flight per (engine_id, host, port, tp_rank).

    `ensure` never blocks and never raises: it returns a Future shared by every caller
    of the same key, resolved with HandshakeMetadata or a HandshakeError. Successes are
    cached until `forget`. A failure is remembered with exponential backoff
    (backoff_initial_s, doubling, capped at backoff_max_s): until it elapses `ensure`
    returns an already-failed future of the same kind without touching the network, so
    a dead peer costs one attempt per backoff window, not one per request.

    Each fetched payload is checked by decode_payload (version, hash, engine id when
    the caller names one, layout against `local_layout`) and then by `validate`, which
    may raise HandshakeLayoutMismatch for checks this module cannot know (TP ratios).
    Thread-safe. Handshakes run on `executor` (default: a private pool of `max_workers`).
    """

    def __init__(self, expected_hash: bytes, local_layout: RankLayout | None = None, *,
                 prefix_caching: bool = False, client: HandshakeClient | None = None,
                 timeout_s: float = 5.0, backoff_initial_s: float = 0.5,
                 backoff_max_s: float = 10.0,
                 validate: Callable[[HandshakeMetadata], None] | None = None,
                 executor: Executor | None = None, max_workers: int = 2,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if timeout_s <= 0 or backoff_initial_s <= 0 or backoff_max_s < backoff_initial_s:
            raise ValueError("need timeout_s > 0 and 0 < backoff_initial_s <= backoff_max_s")
        self._expected_hash = expected_hash
        self._local_layout = local_layout
        self._prefix_caching = prefix_caching
        self._client = client or HandshakeClient()
        self._timeout_s = timeout_s
        self._backoff_initial_s = backoff_initial_s
        self._backoff_max_s = backoff_max_s
        self._validate = validate
        self._own_executor = executor is None
        self._executor = executor or ThreadPoolExecutor(
            max_workers=max_workers, thread_name_prefix="kvbridge-handshake")
        self._clock = clock
        self._lock = threading.Lock()
        self._in_flight: dict[HandshakeKey, Future[HandshakeMetadata]] = {}
        self._done: dict[HandshakeKey, tuple[Future[HandshakeMetadata], HandshakeMetadata]] = {}
        self._failures: dict[HandshakeKey, _Failure] = {}
        self._closed = False

    def ensure(self, engine_id: str | None, host: str, port: int,
               tp_rank: int) -> Future[HandshakeMetadata]:
        """The handshake with P's `tp_rank` at host:port; engine_id None skips that check."""
        key: HandshakeKey = (engine_id, host, port, tp_rank)
        with self._lock:
            if self._closed:
                return _failed_future(HandshakeRefused("handshake manager is closed"))
            if key in self._done:
                return self._done[key][0]
            if key in self._in_flight:
                return self._in_flight[key]
            failure = self._failures.get(key)
            now = self._clock()
            if failure is not None and now < failure.retry_at:
                error = type(failure.error)(
                    f"{failure.error} (failed recently; next attempt in "
                    f"{failure.retry_at - now:.2f}s)")
                return _failed_future(error)
            future: Future[HandshakeMetadata] = Future()
            future.set_running_or_notify_cancel()  # shared: no caller may cancel it for others
            self._in_flight[key] = future
        try:
            self._executor.submit(self._attempt, key, future)
        except RuntimeError:  # the executor was shut down under us
            self._settle(key, future, None, HandshakeRefused("handshake executor is shut down"))
        return future

    def forget(self, engine_id: str) -> None:
        """Drop what is known about `engine_id` (e.g. it restarted): the next ensure re-fetches.

        A handshake in flight still resolves its waiting callers but is not cached.
        """
        with self._lock:
            for key in [k for k, (_, meta) in self._done.items()
                        if engine_id in (k[0], meta.engine_id)]:
                del self._done[key]
            for table in (self._failures, self._in_flight):
                for key in [k for k in table if k[0] == engine_id]:
                    del table[key]

    def close(self) -> None:
        """Fail handshakes still in flight and stop the private executor. Idempotent."""
        with self._lock:
            self._closed = True
            pending = list(self._in_flight.values())
            self._in_flight.clear()
        if self._own_executor:
            self._executor.shutdown(wait=False, cancel_futures=True)
        for future in pending:
            _resolve(future, None, HandshakeRefused("handshake manager closed"))

    def _attempt(self, key: HandshakeKey, future: Future[HandshakeMetadata]) -> None:
        engine_id, host, port, tp_rank = key
        metadata: HandshakeMetadata | None = None
        error: HandshakeError | None = None
        try:
            data = self._client.fetch(host, port, tp_rank, self._timeout_s)
            metadata = decode_payload(data, self._expected_hash, engine_id, self._local_layout,
                                      prefix_caching=self._prefix_caching)
            if metadata.layout.tp_rank != tp_rank:
                raise HandshakeLayoutMismatch(
                    f"asked for tp_rank {tp_rank}, got rank {metadata.layout.tp_rank}'s metadata")
            if self._validate is not None:
                self._validate(metadata)
        except HandshakeError as exc:
            error = exc
        except Exception as exc:  # a bug must not leave callers waiting forever
            logger.exception("handshake with %s:%s rank %s crashed", host, port, tp_rank)
            error = HandshakeDecodeError(f"unexpected error during handshake: {exc!r}")
        self._settle(key, future, metadata, error)

    def _settle(self, key: HandshakeKey, future: Future[HandshakeMetadata],
                metadata: HandshakeMetadata | None, error: HandshakeError | None) -> None:
        backoff_s = 0.0
        with self._lock:
            current = self._in_flight.get(key) is future
            if current:
                del self._in_flight[key]
                if error is None:
                    assert metadata is not None
                    self._done[key] = (future, metadata)
                    self._failures.pop(key, None)
                else:
                    previous = self._failures.get(key)
                    backoff_s = self._backoff_initial_s if previous is None else min(
                        previous.backoff_s * 2, self._backoff_max_s)
                    self._failures[key] = _Failure(error, self._clock() + backoff_s, backoff_s)
        if error is not None:
            logger.warning("handshake with engine %s at %s:%s rank %s failed (%s): %s; "
                           "not retried for %.1fs", key[0], key[1], key[2], key[3],
                           error.kind.value, error, backoff_s)
        else:
            logger.info("handshake with engine %s at %s:%s rank %s done",
                        metadata.engine_id if metadata else None, key[1], key[2], key[3])
        _resolve(future, metadata, error)  # outside the lock: callbacks may call ensure()


def _resolve(future: Future[HandshakeMetadata], metadata: HandshakeMetadata | None,
             error: HandshakeError | None) -> None:
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(metadata)  # type: ignore[arg-type]
    except InvalidStateError:
        pass  # already failed by close()


def _failed_future(error: HandshakeError) -> Future[HandshakeMetadata]:
    future: Future[HandshakeMetadata] = Future()
    future.set_exception(error)
    return future


# ---- trust ----------------------------------------------------------------------------

_LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})


def is_trusted_host(host: str, trusted: Sequence[str] = ()) -> bool:
    """Whether D may contact `host` (taken from client-supplied kv_transfer_params).

    `trusted` entries are host names, IP addresses or networks ("10.0.0.0/8"). An empty
    list means only this machine: loopback addresses, "localhost", and this host's own
    name and the addresses it resolves to. A client-chosen name is compared literally,
    never resolved: resolving it would let whoever controls its DNS pick D's target.
    """
    name = _normalise_host(host)
    if not name:
        return False
    if trusted:
        return any(_matches(name, _normalise_host(entry)) for entry in trusted)
    ip = _parse_ip(name)
    if ip is not None:
        return ip.is_loopback or ip in _own_addresses()
    return name in _LOOPBACK_NAMES or name == _own_hostname()


def _matches(name: str, entry: str) -> bool:
    ip = _parse_ip(name)
    if ip is not None and "/" in entry:
        try:
            return ip in ipaddress.ip_network(entry, strict=False)
        except ValueError:
            return False
    entry_ip = _parse_ip(entry)
    if ip is not None and entry_ip is not None:
        return ip == entry_ip
    return bool(entry) and name == entry


def _normalise_host(host: object) -> str:
    if not isinstance(host, str):
        return ""
    name = host.strip().lower()
    if name.startswith("[") and name.endswith("]"):
        name = name[1:-1]
    return name.rstrip(".")


def _parse_ip(name: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        ip = ipaddress.ip_address(name)
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped  # ::ffff:127.0.0.1 is 127.0.0.1
    return ip


@lru_cache(maxsize=1)
def _own_hostname() -> str:
    return _normalise_host(socket.gethostname())


@lru_cache(maxsize=1)
def _own_addresses() -> frozenset[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """Addresses this host's own name resolves to (from /etc/hosts, usually); cached once."""
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None)
    except (OSError, UnicodeError):
        return frozenset()
    found = (_parse_ip(str(info[4][0]).split("%")[0]) for info in infos)
    return frozenset(ip for ip in found if ip is not None)
