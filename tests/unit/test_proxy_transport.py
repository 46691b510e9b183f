"""The proxy's upstream transport (kvbridge/proxy/transport.py): a socket that uvloop closed
under a new connection (its upstream killed at that moment) is a ConnectError the proxy retries
elsewhere, never the client's 500; an AttributeError of ours still surfaces."""

from __future__ import annotations

import asyncio

import anyio
import httpx
import pytest
import uvloop
from anyio.abc import SocketAttribute
from anyio.streams.tls import TLSAttribute

from kvbridge.proxy.transport import UpstreamTransport, raised_in_connection_layer


async def _open_then_lose_the_socket(_request: object) -> None:
    """What httpcore meets when the upstream dies while the connection opens: a real anyio stream
    whose transport closed before httpcore asks it for its TLS object."""
    async with await anyio.create_tcp_listener(local_host="127.0.0.1") as listener:
        stream = await anyio.connect_tcp("127.0.0.1", listener.extra(SocketAttribute.local_port))
        stream._transport.close()  # type: ignore[attr-defined]  # what the peer's reset does
        await asyncio.sleep(0)  # the transport forgets its socket
        stream.extra(TLSAttribute.ssl_object, None)  # httpcore's first look at a new connection


class _Pool:
    def __init__(self, handle: object) -> None:
        self.handle_async_request = handle


async def _send(handle: object) -> None:
    transport = UpstreamTransport()
    transport._pool = _Pool(handle)  # type: ignore[assignment]
    await transport.handle_async_request(httpx.Request("POST", "http://127.0.0.1:9/v1/completions", json={}))


def test_a_socket_closed_under_a_new_connection_is_a_connect_error() -> None:
    with pytest.raises(httpx.ConnectError, match="closed while it opened") as caught:
        uvloop.run(_send(_open_then_lose_the_socket))
    assert isinstance(caught.value.__cause__, AttributeError)
    assert raised_in_connection_layer(caught.value.__cause__)


def test_the_plain_transport_lets_it_out_as_an_attribute_error() -> None:
    """The failure mode, seen without the wrapper: uvloop's transport has no socket any more."""
    with pytest.raises(AttributeError, match="getpeername"):
        uvloop.run(_open_then_lose_the_socket(None))


def test_an_attribute_error_of_ours_is_not_hidden() -> None:
    async def ours(_request: object) -> None:
        raise AttributeError("a bug in the proxy")

    with pytest.raises(AttributeError, match="a bug in the proxy"):
        uvloop.run(_send(ours))
