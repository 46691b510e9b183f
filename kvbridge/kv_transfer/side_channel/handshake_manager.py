"""D's handshakes: deduplicated, backed-off fetches of P's payload, and which hosts D may contact.

HandshakeManager fetches a payload over the side channel (client.py), checks it
with decode_payload (handshake.py) and caches the result; it never raises into its
callers, every failure comes back as a failed future carrying a HandshakeError.
is_trusted_host guards the addresses that reach D in client-supplied kv_transfer_params.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future, InvalidStateError, ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache

from kvbridge.kv_transfer.side_channel.handshake import (CompatibilityInfo, HandshakeDecodeError, HandshakeError,
                                                         HandshakeLayoutMismatch, HandshakeMetadata,
                                                         HandshakeRefused, RankLayout, decode_payload)
from kvbridge.kv_transfer.side_channel.client import HandshakeClient
from kvbridge.shape.hosts import IPAddress, parse_ip

logger = logging.getLogger(__name__)


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

    def __init__(self, expected: CompatibilityInfo | bytes, local_layout: RankLayout | None = None, *,
                 prefix_caching: bool = False, client: HandshakeClient | None = None,
                 timeout_s: float = 5.0, backoff_initial_s: float = 0.5,
                 backoff_max_s: float = 10.0,
                 validate: Callable[[HandshakeMetadata], None] | None = None,
                 executor: Executor | None = None, max_workers: int = 2,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if timeout_s <= 0 or backoff_initial_s <= 0 or backoff_max_s < backoff_initial_s:
            raise ValueError("need timeout_s > 0 and 0 < backoff_initial_s <= backoff_max_s")
        self._expected = expected  # this engine's CompatibilityInfo (a mismatch names what differs), or its hash
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
            metadata = decode_payload(data, self._expected, engine_id, self._local_layout,
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
    ip = parse_ip(name)
    if ip is not None:
        return ip.is_loopback or ip in _own_addresses()
    return name in _LOOPBACK_NAMES or name == _own_hostname()


def _matches(name: str, entry: str) -> bool:
    ip = parse_ip(name)
    if ip is not None and "/" in entry:
        try:
            return ip in ipaddress.ip_network(entry, strict=False)
        except ValueError:
            return False
    entry_ip = parse_ip(entry)
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


@lru_cache(maxsize=1)
def _own_hostname() -> str:
    return _normalise_host(socket.gethostname())


@lru_cache(maxsize=1)
def _own_addresses() -> frozenset[IPAddress]:
    """Addresses this host's own name resolves to (from /etc/hosts, usually); cached once."""
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None)
    except (OSError, UnicodeError):
        return frozenset()
    found = (parse_ip(str(info[4][0]).split("%")[0]) for info in infos)
    return frozenset(ip for ip in found if ip is not None)
