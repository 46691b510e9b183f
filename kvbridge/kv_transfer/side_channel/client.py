"""Side channel, D's end: blocking requests to a P's side-channel server (server.py).

The client raises only HandshakeError subclasses (timeout, refused, decode error,
peer error), so its callers classify side-channel failures like handshake ones.
"""

from __future__ import annotations

import socket
import time

from kvbridge.kv_transfer.side_channel.handshake import (HandshakeDecodeError, HandshakePeerError,
                                                         HandshakeRefused, HandshakeTimeout)
from kvbridge.kv_transfer.side_channel.frames import (MSG_GET_METADATA, RANK, REPLY_ERROR, REPLY_OK, FrameError,
                                                      PeerClosed, derive_key, encode_authenticated_frame,
                                                      encode_frame, read_frame)

DEFAULT_MAX_REPLY_BYTES = 64 << 20  # agent metadata of a big NIXL agent is a few MB


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
        return self.request(host, port, MSG_GET_METADATA, RANK.pack(tp_rank), timeout)

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
                reply = read_frame(sock, self._max_reply_bytes, remaining)
        except TimeoutError:
            raise HandshakeTimeout(f"{where} did not answer within {timeout}s") from None
        except (PeerClosed, ConnectionResetError, BrokenPipeError):
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
