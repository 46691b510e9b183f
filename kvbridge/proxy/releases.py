"""Ending the leases P holds for requests no D will read: the proxy's half of the release contract.

Release contract (the API server implements it on P):
  `POST {P}/kvbridge/release_kv` with JSON `{"kv_transfer_params": <P's response params>}`
  and the request's `X-Request-Id`. P frees the blocks it holds for `remote_request_id` at once
  (idempotent; unknown ids answer 200 or 404, never 5xx).
The proxy calls it only when it knows no D received the request (no healthy D, every D refused
the connection, P's token finished the request, the client left before any D was asked): if D
may have received it, D may be reading those blocks, and only D (its notification) or P's lease
may free them.
Each P attempt also carries a fresh random `X-KVBridge-Release-Key` (`UnreadAnswers`); an attempt
whose answer the proxy never read whole (the client left, the connection broke mid-read) is
released by `{"release_key": K}` in the background, since nobody can have its params
(server/undelivered.py: P's side of it, and P's own release of answers it could not write).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Awaitable, Callable
from typing import Protocol

import httpx

from kvbridge.openai_wire import RELEASE_KEY_HEADER
from kvbridge.proxy.metrics import ProxyMetrics
from kvbridge.proxy.routing import Upstream
from kvbridge.proxy.tracing_spans import Spans

logger = logging.getLogger("kvbridge.proxy.proxy")  # the name these lines logged under before the split
RELEASE_PATH = "/kvbridge/release_kv"


class AttemptKeys(Protocol):
    """The release keys of one leg's attempts: P's leg keeps them (`UnreadAnswers`), D's keeps
    none (`NO_KEYS`)."""

    def sign(self, upstream: Upstream, headers: dict[str, str]) -> dict[str, str]:
        """The headers of a new attempt on `upstream`."""
        ...

    def read(self, upstream: Upstream) -> None:
        """The attempt's answer was read whole (or it never reached `upstream`): nothing to end."""
        ...


class _NoKeys(AttemptKeys):
    def sign(self, upstream: Upstream, headers: dict[str, str]) -> dict[str, str]:
        return headers

    def read(self, upstream: Upstream) -> None:
        pass


NO_KEYS: AttemptKeys = _NoKeys()


class UnreadAnswers(AttemptKeys):
    """One P leg's release keys (server/undelivered.py): each attempt sends a fresh random key; an
    attempt whose answer was not read whole (the leg was cancelled, the connection broke) may have
    left a lease on its P that nobody will learn of, and the key lets the proxy end it. A leg
    tries each P at most once."""

    def __init__(self) -> None:
        self._keys: dict[str, tuple[Upstream, str]] = {}

    def sign(self, upstream: Upstream, headers: dict[str, str]) -> dict[str, str]:
        key = secrets.token_hex(16)
        self._keys[upstream.url] = (upstream, key)
        return {**headers, RELEASE_KEY_HEADER: key}

    def read(self, upstream: Upstream) -> None:
        self._keys.pop(upstream.url, None)

    def unread(self) -> list[tuple[Upstream, str]]:
        return list(self._keys.values())


class Releases:
    """Sends the release calls (best effort, each bounded by `timeout`, over `client`: the proxy's,
    once it started) and owns those that outlive their request: `stop()` waits for them."""

    def __init__(self, client: Callable[[], httpx.AsyncClient], metrics: ProxyMetrics, timeout: httpx.Timeout) -> None:
        self._client, self._metrics, self._timeout = client, metrics, timeout
        self._background: set[asyncio.Future[bool]] = set()

    async def by_params(self, upstream: Upstream, params: dict[str, object], headers: dict[str, str],
                        request_id: str, spans: Spans) -> bool:
        """Ask P to free the KV it keeps for this request (as span `proxy.release`). True if P said 2xx.
        Shielded: a client hanging up now must not cancel the release half-sent."""
        return await asyncio.shield(self._by_params(upstream, params, headers, request_id, spans))

    async def _by_params(self, upstream: Upstream, params: dict[str, object], headers: dict[str, str],
                         request_id: str, spans: Spans) -> bool:
        with spans.timed("proxy.release", {"url.full": upstream.url + RELEASE_PATH}):
            ok, detail = await self._send(upstream, {"kv_transfer_params": params}, headers)
        if ok:
            logger.info("request %s: no decode instance took it; released its KV on %s", request_id, upstream.url)
        else:
            logger.warning("request %s: release on %s failed (%s); P frees the KV when its lease expires",
                           request_id, upstream.url, detail)
        return ok

    def unread_in_background(self, keys: UnreadAnswers, headers: dict[str, str], request_id: str) -> None:
        """End, beyond the request, the leases of P's attempts whose answers were never read."""
        for upstream, key in keys.unread():
            self._in_background(self.by_key(upstream, key, headers, request_id))

    async def by_key(self, upstream: Upstream, key: str, headers: dict[str, str], request_id: str) -> bool:
        """P may hold KV for an attempt whose answer the proxy never read (it gave up mid-attempt,
        or the connection broke): ask P to end that lease by the attempt's key. True if P said 2xx
        (whether or not a lease was held)."""
        ok, detail = await self._send(upstream, {"release_key": key}, headers)
        if not ok:
            logger.warning("request %s: release of an unread prefill answer on %s failed (%s); P frees its KV when "
                           "its lease expires", request_id, upstream.url, detail)
        return ok

    async def _send(self, upstream: Upstream, body: dict[str, object], headers: dict[str, str]) -> tuple[bool, str]:
        """One release call, counted by outcome: whether P said 2xx, and what it said."""
        try:
            r = await self._client().post(upstream.url + RELEASE_PATH, json=body, headers=headers,
                                        timeout=self._timeout)
            ok, detail = r.status_code < 300, f"status {r.status_code}"
        except httpx.HTTPError as exc:
            ok, detail = False, repr(exc)
        self._metrics.kv_releases.labels("ok" if ok else "failed").inc()
        return ok, detail

    def _in_background(self, work: Awaitable[bool]) -> None:
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def stop(self) -> None:
        """Wait for the releases still running (each bounded by the timeout)."""
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
