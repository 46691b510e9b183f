"""Wire format of the TCP transfer backend (tcp.py): frames, payloads, agent metadata.

Protocol v1. Every frame is ``!4sBI`` (magic b"KVBT", op, payload length) followed by
the payload; byte strings inside payloads are u32-length-prefixed.

    READ       sender, notif, u32 n, n x (u64 addr, u64 length)
               -> OK(u64 total) and the raw bytes, or ERR(reason)
    READ_DONE  (empty) -> OK, after the server queued the READ's notif
    NOTIF      sender, message -> OK
    ERR        UTF-8 reason; the server closes the connection after sending it

An agent's metadata is JSON: kind "kvbridge-tcp", version, name, host, port.

Also here: the scatter/gather socket I/O that frames and bulk bytes go through.
Anything malformed raises ProtocolError; the caller drops the connection.
"""

from __future__ import annotations

import json
import socket
import struct
import threading
from dataclasses import dataclass
from enum import IntEnum
from typing import Sequence

from kvbridge.kv_transfer.backends.base import RemoteAgentError

_META_KIND = "kvbridge-tcp"
PROTOCOL_VERSION = 1
_HEADER = struct.Struct("!4sBI")
_MAGIC = b"KVBT"
_MAX_PAYLOAD = 16 << 20  # a READ of 1M descriptors; anything larger is garbage
_IOV_BATCH = 512  # buffers per sendmsg/recvmsg_into call (Linux IOV_MAX is 1024)


class Op(IntEnum):
    READ = 1
    READ_DONE = 2
    NOTIF = 3
    OK = 4
    ERR = 5


class ProtocolError(Exception):
    """A frame or request the other side must not send; the connection is dropped."""


class Cancelled(Exception):
    pass


@dataclass(frozen=True)
class Peer:
    """A remote agent as its metadata describes it."""

    name: str
    host: str
    port: int


def encode_agent_metadata(name: str, host: str, port: int) -> bytes:
    return json.dumps({"kind": _META_KIND, "version": PROTOCOL_VERSION,
                       "name": name, "host": host, "port": port}).encode()


def decode_agent_metadata(metadata: bytes) -> Peer:
    """The peer that `metadata` describes; RemoteAgentError if it is not tcp v1 metadata."""
    try:
        meta = json.loads(metadata)
        peer = Peer(meta["name"], meta["host"], meta["port"])
        kind, version = meta["kind"], meta["version"]
    except (ValueError, TypeError, KeyError) as exc:
        raise RemoteAgentError(f"malformed tcp agent metadata: {exc}") from exc
    if kind != _META_KIND or version != PROTOCOL_VERSION:
        raise RemoteAgentError(f"metadata is {kind!r} v{version}, "
                               f"not {_META_KIND} v{PROTOCOL_VERSION}")
    if not (isinstance(peer.name, str) and peer.name and isinstance(peer.host, str)
            and isinstance(peer.port, int) and 0 < peer.port < 65536):
        raise RemoteAgentError(f"bad tcp agent metadata fields: {peer}")
    return peer


def send_frame(sock: socket.socket, op: Op, payload: bytes = b"") -> None:
    sock.sendall(_HEADER.pack(_MAGIC, op, len(payload)) + payload)


def _advance(views: list[memoryview], first: int, n: int) -> int:
    """Consume ``n`` transferred bytes from ``views[first:]``; returns the new first."""
    while n:
        if n >= len(views[first]):
            n -= len(views[first])
            first += 1
        else:
            views[first] = views[first][n:]
            n = 0
    return first


def send_views(sock: socket.socket, views: list[memoryview]) -> None:
    """sendall for many buffers: one gathering syscall per batch, not per block."""
    first = 0
    while first < len(views):
        first = _advance(views, first, sock.sendmsg(views[first:first + _IOV_BATCH]))


def recv_views(sock: socket.socket, views: list[memoryview],
               cancel: threading.Event | None = None) -> None:
    """Fill every buffer from the stream in order (scattering syscalls); checks
    ``cancel`` between syscalls, so a cancelled read stops writing promptly."""
    first = 0
    while first < len(views):
        if cancel is not None and cancel.is_set():
            raise Cancelled()
        n = sock.recvmsg_into(views[first:first + _IOV_BATCH])[0]
        if n == 0:
            raise ConnectionError("connection closed by peer")
        first = _advance(views, first, n)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    if n:
        recv_views(sock, [memoryview(buf)])
    return bytes(buf)


def recv_frame(sock: socket.socket) -> tuple[Op, bytes]:
    magic, op, length = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    if magic != _MAGIC:
        raise ProtocolError("bad magic")
    if length > _MAX_PAYLOAD:
        raise ProtocolError(f"payload of {length} bytes is over the limit")
    try:
        return Op(op), _recv_exact(sock, length)
    except ValueError:
        raise ProtocolError(f"unknown op {op}") from None


def _blobs(*items: bytes) -> bytes:
    return b"".join(struct.pack("!I", len(x)) + x for x in items)


class _Cursor:
    """Reads a payload front to back; any overrun or leftover is a ProtocolError."""

    def __init__(self, data: bytes) -> None:
        self._data, self._pos = data, 0

    def take(self, n: int) -> bytes:
        if self._pos + n > len(self._data):
            raise ProtocolError("truncated payload")
        self._pos += n
        return self._data[self._pos - n:self._pos]

    def u32(self) -> int:
        value: int = struct.unpack("!I", self.take(4))[0]
        return value

    def blob(self) -> bytes:
        return self.take(self.u32())

    def text(self) -> str:
        try:
            return self.blob().decode()
        except UnicodeDecodeError:
            raise ProtocolError("name is not UTF-8") from None

    def end(self) -> None:
        if self._pos != len(self._data):
            raise ProtocolError("trailing bytes in payload")


def encode_read(sender: str, notif: bytes, spans: Sequence[tuple[int, int]]) -> bytes:
    flat = [v for span in spans for v in span]
    return (_blobs(sender.encode(), notif) + struct.pack("!I", len(spans))
            + struct.pack(f"!{len(flat)}Q", *flat))


def decode_read(payload: bytes) -> tuple[str, bytes, list[tuple[int, int]]]:
    cur = _Cursor(payload)
    sender, notif, n = cur.text(), cur.blob(), cur.u32()
    flat = struct.unpack(f"!{2 * n}Q", cur.take(16 * n))
    cur.end()
    return sender, notif, list(zip(flat[0::2], flat[1::2]))


def encode_notif(sender: str, msg: bytes) -> bytes:
    return _blobs(sender.encode(), msg)


def decode_notif(payload: bytes) -> tuple[str, bytes]:
    cur = _Cursor(payload)
    sender, msg = cur.text(), cur.blob()
    cur.end()
    return sender, msg
