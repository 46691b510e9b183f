"""What the side-channel tests share: the constants of a small lease and a raw frame exchange."""

from __future__ import annotations

import socket
import struct

from kvbridge.kv_transfer.lease import content_digest

HOST = "127.0.0.1"
PAYLOADS = {0: b"P's agent metadata and layout"}
BLOCKS = ([3, 4, 5],)
CONTENT = content_digest(list(range(1, 34)))
RANK0 = struct.pack("!I", 0)


def exchange(sock: socket.socket, frame: bytes) -> bytes:
    """Send one request frame on `sock` and return the one reply frame (bounded wait)."""
    sock.settimeout(5.0)
    sock.sendall(frame)
    data = b""
    while len(data) < 9 or len(data) < 9 + data[4] + int.from_bytes(data[5:9], "big"):
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data
