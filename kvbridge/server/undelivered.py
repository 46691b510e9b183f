"""P's answer that never reached its caller: the lease it names ends at once.

A prefill answer carries `kv_transfer_params` naming blocks P holds under a lease for a decode
instance. Only whoever reads that answer can pass the params on; if it never arrives, nobody
ever will, and the blocks used to stay pinned until the lease expired (30 s): any client could
pin P's KV at will by hanging up during the P leg. Two ways close it:

- **P sees it** (`HandOff`, `StreamHandOff`): the caller's connection went away before the
  message naming the lease was written (the proxy cancelled its call, crashed, the connection was
  reset). The request may already have finished on the engine when the abort landed (a short
  prefill), so the abort alone frees nothing: P releases the lease it just granted. uvicorn drops,
  silently, what is sent on a connection it knows is lost; kvbridge's HTTP protocol lets the
  answer see whether it was (`http_protocol.connection_view`).
- **The caller says so** (`ReleaseKeys`): the answer was written, but the proxy never read it
  (the client left while it was in flight; the connection broke mid-read). The proxy sends a
  fresh random key per P attempt in `X-KVBridge-Release-Key`; P remembers key -> lease while the
  lease may live, and `POST /kvbridge/release_kv {"release_key": K}` ends it. A key released
  before P bound it (the release overtook the answer) is remembered as released, and its lease
  ends as soon as it is granted. The map is bounded (oldest first out) and its entries age out
  once no lease they could name is alive.

What neither can see: a proxy killed after P wrote the answer and before it read it. Its lease
ends by expiry (`--kv-lease-seconds`).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, Protocol

from starlette.responses import Response, StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from kvbridge.http_protocol import connection_view
from kvbridge.kv_transfer.params import KVTransferParams

logger = logging.getLogger("kvbridge.server.api_server")

RELEASE_KEY_RE = re.compile(r"[0-9a-f]{16,64}")
MAX_KEYS = 65536  # about 10 MB of keys at most; a hostile caller's tombstones push out only the oldest

Release = Callable[[KVTransferParams], Awaitable[Any]]
SETTLE_TIMEOUT_S = 10.0  # an abort ends a request within a step or two: this only bounds a stuck engine


class Outputs(Protocol):
    """A request's outputs (server/async_engine.RequestStream): iterated to the finished one."""

    request_id: str

    def __aiter__(self) -> AsyncIterator[Any]: ...

    def abort(self) -> None: ...


def usable_release_key(given: str | None) -> bool:
    return given is not None and RELEASE_KEY_RE.fullmatch(given) is not None


class ReleaseKeys:
    """Release key -> the lease a prefill answer named (or a tombstone: released before bound).
    Lives on the server's event loop (no lock). `ttl_s`: how long an entry may name a live lease
    (the lease, renewed while D reads, plus the read hold: generous, since ending an ended lease
    is a no-op)."""

    def __init__(self, ttl_s: float, max_keys: int = MAX_KEYS, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.max_keys = max_keys
        self._clock = clock
        self._entries: OrderedDict[str, tuple[float, KVTransferParams | None]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def _put(self, key: str, params: KVTransferParams | None) -> None:
        now = self._clock()
        self._entries.pop(key, None)
        self._entries[key] = (now + self.ttl_s, params)
        while self._entries:
            oldest_key, (expires, _) = next(iter(self._entries.items()))
            if expires > now and len(self._entries) <= self.max_keys:
                break
            del self._entries[oldest_key]

    def bind(self, key: str, params: KVTransferParams) -> bool:
        """P answers `params` for the attempt `key`. False: the key was released already (the
        caller gave up first), so the lease must end now."""
        entry = self._entries.get(key)
        if entry is not None and entry[1] is None and entry[0] > self._clock():
            del self._entries[key]
            return False
        self._put(key, params)
        return True

    def take(self, key: str) -> KVTransferParams | None:
        """The caller gave up on attempt `key`: the params bound to it (their lease ends), or
        None, and the key is remembered as released in case its answer is still to come."""
        entry = self._entries.pop(key, None)
        if entry is not None and entry[1] is not None and entry[0] > self._clock():
            return entry[1]
        self._put(key, None)
        return None


class LeaseBox:
    """The params of the lease an answer names, once known (a stream's come with its last chunk).
    `outputs`: the request's outputs, for a stream cut before its last chunk was made (its body
    iterator may never have run): `settle` aborts the request and reads what is left of them."""

    def __init__(self, params: KVTransferParams | None = None, outputs: Outputs | None = None,
                 leased: Callable[[Any], KVTransferParams | None] | None = None) -> None:
        self.params = params
        self.outputs = outputs
        self.leased = leased

    async def settle(self, timeout_s: float = SETTLE_TIMEOUT_S) -> KVTransferParams | None:
        """The lease's params, reading the request's final output if they are not known yet: the
        request is aborted first, so a running one ends at once (a finished one's output is queued)."""
        if self.params is not None or self.outputs is None or self.leased is None:
            return self.params
        outputs, leased = self.outputs, self.leased
        outputs.abort()

        async def last() -> KVTransferParams | None:
            async for output in outputs:
                if output.finished:
                    return leased(output)
            return None
        try:
            self.params = await asyncio.wait_for(last(), timeout_s)
        except (TimeoutError, Exception):  # the engine is gone or stuck: the lease's expiry frees them
            logger.warning("request %s: its final output did not come; its lease will free its KV",
                           getattr(outputs, "request_id", "?"))
        return self.params


class _HandOff:
    """The answer's ASGI call, watching the message that names the lease (an unstreamed answer's
    body, a stream's finishing chunk): if it was not written on a live connection (dropped, or
    never sent: the stream was cut first), `release` ends the lease (shielded: a cancelled
    response must not cut the release short). On kvbridge's HTTP protocol the connection's view
    (`http_protocol.connection_view`) is read right after that message's send, before any other
    callback can run: lost then means the server dropped it. On another server the answer counts
    as written once its send returned (the lease then ends by D or by expiry: never wrongly early)."""

    lease: LeaseBox
    release_lease: Release
    request_id: str

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        connection = connection_view(scope)
        written: bool | None = None  # the message naming the lease: None while not sent

        async def watched_send(message: Message) -> None:
            nonlocal written
            naming = written is None and self.lease.params is not None and message["type"] == "http.response.body"
            await send(message)
            if naming:
                written = connection is None or not connection.lost()

        try:
            await super().__call__(scope, receive, watched_send)  # type: ignore[misc]
        finally:
            if not written:
                await asyncio.shield(self._release())

    async def _release(self) -> None:
        params = await self.lease.settle()
        if params is not None:
            logger.info("request %s: P's answer never reached its caller; releasing its KV", self.request_id)
            await self.release_lease(params)


class HandOff(_HandOff, Response):
    """P's whole answer naming leased blocks."""

    def __init__(self, content: str, headers: Mapping[str, str], lease: LeaseBox, release: Release,
                 request_id: str) -> None:
        super().__init__(content, 200, dict(headers), media_type="application/json")
        self.lease, self.release_lease, self.request_id = lease, release, request_id


class StreamHandOff(_HandOff, StreamingResponse):
    """A streamed answer on a prefill instance: its last chunk may name leased blocks (`lease`)."""

    def __init__(self, chunks: AsyncIterator[str], headers: Mapping[str, str], lease: LeaseBox, release: Release,
                 request_id: str) -> None:
        super().__init__(chunks, media_type="text/event-stream", headers=dict(headers))
        self.lease, self.release_lease, self.request_id = lease, release, request_id
