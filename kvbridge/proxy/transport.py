"""The proxy's upstream transport: httpx's, with one failure of the layers under it named for
what it is.

When an upstream dies while the proxy opens a connection to it (SIGKILL of an instance under load,
a Ray replica replaced), asyncio may close the new socket's transport between the TCP connect and
httpcore's first look at the stream (`get_extra_info("ssl_object")`). anyio's SocketStream then
reads `getpeername()` off the transport's socket, which is None by now, and raises AttributeError
out of httpx: not an httpx.HTTPError, so the proxy would answer the client 500 for what is a
failed connect, and never try another instance. Nothing was sent, so the request is as safe to
retry as after a refused connection: the transport raises httpx.ConnectError instead, for
AttributeErrors raised inside anyio or httpcore only (one of ours still surfaces as the bug it is).
"""

from __future__ import annotations

import os
import traceback

import anyio
import httpcore
import httpx

# The packages whose AttributeError on a closed socket is a lost connection, not a bug of ours.
_CONNECTION_LAYERS = tuple(os.path.dirname(m.__file__ or "") + os.sep for m in (anyio, httpcore))


def raised_in_connection_layer(exc: BaseException) -> bool:
    """Whether `exc` was raised by code of anyio or httpcore (its innermost frame is there)."""
    frames = traceback.extract_tb(exc.__traceback__)
    return bool(frames) and frames[-1].filename.startswith(_CONNECTION_LAYERS)


class UpstreamTransport(httpx.AsyncHTTPTransport):
    """httpx's pooled HTTP/1.1 transport; a socket closed under a new connection is a ConnectError."""

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        try:
            return await super().handle_async_request(request)
        except AttributeError as exc:
            if not raised_in_connection_layer(exc):
                raise
            raise httpx.ConnectError(f"the connection closed while it opened ({exc})", request=request) from exc
