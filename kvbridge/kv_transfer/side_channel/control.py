"""Control messages between D and P over P's side channel (no read involved).

  kv_check_read  {"rid", "gen", "blocks", "content", "connect"}  before reading: is the
                 lease live, are these P's blocks granted to that request (the granted
                 sequence or a suffix of it), and do they hold the KV of D's prompt
                 ("content": the content_digest of D's prompt tokens)? Renews the lease. A
                 content mismatch ends the lease and frees the blocks at once. "connect"
                 (optional, default true): D has not completed a read from this P lately
                 (since it connected, or for a while), so the read may need P's agents to
                 progress (UCX wire-up): P then steps promptly until the read is done
                 (lease.py). "read_timeout_s" (optional): how long D lets a read run
                 before abandoning it; P keeps a granted read's blocks for twice that
                 (lease.py, READ_HOLD_TIMEOUTS), even past the lease's expiry.
                 "traceparent" (optional): the W3C traceparent of D's span for this
                 check (kv.lease_check) when D traces the request: P records its
                 handling as kv.check_read under it. An old peer omits it; a malformed
                 one is ignored (never a refusal); D sends none when it does not trace.
                 "digest" (optional): {P rank: [[addr, len], ...]}, the spans D will read
                 from each P rank; P answers their digests with the grant (digest.py).
                 Without it P answers its incarnation alone; with it, JSON
                 {"incarnation", "digests": {P rank: [int, ...] | null}} (null: that rank's
                 KV is not in host memory P can hash; []: a span lies outside the granted blocks).
  kv_read_done   {"rid", "gen"}            D's read of the request's blocks completed
  kv_release     {"rid", "gen"}            D will not read (abort, rejection, full hit);
                 "reason": "kv_content_mismatch" (optional): what D read did not match the
                 digests, so the lease ends as a content mismatch (LeaseOutcome)
  kv_heartbeat   {"items": [[rid, gen], ...]}  D still waits; renew these leases

The read-done notification goes here, not with the READ through NIXL: a NIXL READ
that carries a notification is not DONE on D until P's agent has progressed (it
completed only at P's next poll; without the notification it completes when the copy ends:
benchmarks/README.md, pd_transfer). P's
side-channel thread answers at once, whatever P's engine loop is doing.

P registers the handlers (ControlServer), which parse each body into a typed message
(CheckRead, LeaseKey, Heartbeat) and hand it to the lease table (lease.py), the one owner of
P's held blocks; D calls them through ControlClient, from a worker thread, each bounded by a
timeout. Every body is validated: the channel is reachable by anyone who can connect.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from opentelemetry.trace import SpanContext

from kvbridge.kv_transfer.digest import MAX_DIGEST_SPANS, Span, digest_spans, within
from kvbridge.kv_transfer.lease import MAX_READ_TIMEOUT_S, LeaseTable
from kvbridge.kv_transfer.params import BlockIds
from kvbridge.kv_transfer.side_channel.server import HandlerRefusal, SideChannelServer
from kvbridge.kv_transfer.side_channel.client import HandshakeClient
from kvbridge.kv_transfer.side_channel.handshake import (CompatibilityInfo, HandshakeDecodeError, HandshakeMetadata,
                                                         RankLayout, encode_payload)
from kvbridge.tracing import parse_traceparent

MSG_CHECK_READ = "kv_check_read"
MSG_READ_DONE = "kv_read_done"
MSG_RELEASE = "kv_release"
MSG_HEARTBEAT = "kv_heartbeat"
MAX_HEARTBEAT_ITEMS = 4096
KV_CONTENT_MISMATCH = "kv_content_mismatch"  # kv_release's reason: D's read failed its digests


@dataclass(frozen=True)
class LeaseKey:
    """A lease as D names it: P's request id and the lease's generation."""

    request_id: str
    generation: int


@dataclass(frozen=True)
class CheckRead:
    """kv_check_read: may D read these of P's blocks now?"""

    key: LeaseKey
    blocks: tuple[list[int], ...]
    content: str  # content_digest of D's prompt
    connect: bool  # D has not completed a read from this P lately: P must step promptly
    read_timeout_s: float | None  # D's read timeout (None: not sent)
    parent: SpanContext | None = None  # D's span for this check ("traceparent"; None: absent or malformed)
    digest: dict[int, list[Span]] | None = None  # P rank -> the spans D will read ("digest"; None: absent)


@dataclass(frozen=True)
class Heartbeat:
    """kv_heartbeat: D still waits for these leases."""

    keys: tuple[LeaseKey, ...]


def _load(body: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise HandlerRefusal("body is not JSON") from None
    if not isinstance(obj, dict):
        raise HandlerRefusal("body must be a JSON object")
    return obj


def _lease_key(obj: Any) -> LeaseKey:
    if not isinstance(obj, (list, tuple)) or len(obj) != 2:
        raise HandlerRefusal("expected [request_id, generation]")
    rid, gen = obj
    if not isinstance(rid, str) or not rid or type(gen) is not int:
        raise HandlerRefusal("request_id must be a string and generation an int")
    return LeaseKey(rid, gen)


def parse_lease_key(body: bytes) -> LeaseKey:
    """kv_read_done and kv_release: {"rid", "gen"}. Raises HandlerRefusal."""
    obj = _load(body)
    return _lease_key([obj.get("rid"), obj.get("gen")])


def parse_check_read(body: bytes) -> CheckRead:
    """kv_check_read (module doc). Raises HandlerRefusal naming the first bad field."""
    obj = _load(body)
    key = _lease_key([obj.get("rid"), obj.get("gen")])
    blocks = obj.get("blocks")
    if (not isinstance(blocks, list) or not all(isinstance(g, list) for g in blocks)
            or not all(type(b) is int for g in blocks for b in g)):
        raise HandlerRefusal("blocks must be a list of lists of ints")
    content = obj.get("content")
    if not isinstance(content, str) or not 0 < len(content) <= 128:
        raise HandlerRefusal("content must be the digest of the reader's prompt")
    connect = obj.get("connect", True)
    if not isinstance(connect, bool):
        raise HandlerRefusal("connect must be a boolean")
    read_timeout = obj.get("read_timeout_s")
    if read_timeout is not None and (type(read_timeout) not in (int, float)
                                     or not 0 < read_timeout <= MAX_READ_TIMEOUT_S):
        raise HandlerRefusal(f"read_timeout_s must be a number of seconds in (0, {MAX_READ_TIMEOUT_S:g}]")
    digest = obj.get("digest")
    spans: dict[int, list[Span]] | None = None
    if digest is not None:
        if not isinstance(digest, dict):
            raise HandlerRefusal("digest must be an object of P rank -> spans")
        spans = {}
        for rank, items in digest.items():
            if not rank.isdigit() or not isinstance(items, list) or not all(
                    isinstance(i, list) and len(i) == 2 and all(type(v) is int and v >= 0 for v in i) for i in items):
                raise HandlerRefusal("digest must map P ranks to lists of [address, length]")
            spans[int(rank)] = [(a, n) for a, n in items]
        if sum(len(v) for v in spans.values()) > MAX_DIGEST_SPANS:
            raise HandlerRefusal(f"digest names more than {MAX_DIGEST_SPANS} spans")
    return CheckRead(key, tuple(blocks), content, connect, read_timeout, parse_traceparent(obj.get("traceparent")),
                     spans)


@dataclass(frozen=True)
class RankDigester:
    """Hashes a P rank's KV in place: its registered region (host memory only) and geometry."""

    base_addr: int
    block_len: int  # bytes of one kernel block
    blocks_per_logical: int
    num_blocks: int  # kernel blocks

    @classmethod
    def of(cls, layout: RankLayout) -> "RankDigester":
        """The hasher of a rank registered in this process (its KV in host memory)."""
        return cls(layout.region_base_addrs[0], layout.block_len_bytes[0], layout.physical_blocks_per_logical,
                   layout.num_blocks)

    def granted_spans(self, block_ids: Sequence[Sequence[int]]) -> list[Span]:
        """The spans of the logical blocks a lease grants (every group: each indexes the region)."""
        page = self.block_len * self.blocks_per_logical
        return [(self.base_addr + b * page, page) for group in block_ids for b in group
                if 0 <= b and (b + 1) * self.blocks_per_logical <= self.num_blocks]

    def digest(self, spans: Sequence[Span], block_ids: Sequence[Sequence[int]]) -> list[int]:
        """Digests of `spans`; none ([]) when one leaves the granted blocks: P hashes nothing else
        (the reader mapped its read wrong, or planned it against a P that since restarted)."""
        if not within(spans, self.granted_spans(block_ids)):
            return []
        return digest_spans(spans)


def parse_heartbeat(body: bytes) -> Heartbeat:
    """kv_heartbeat: {"items": [[rid, gen], ...]}, at most MAX_HEARTBEAT_ITEMS. Raises HandlerRefusal."""
    items = _load(body).get("items")
    if not isinstance(items, list) or len(items) > MAX_HEARTBEAT_ITEMS:
        raise HandlerRefusal("items must be a list of [request_id, generation]")
    return Heartbeat(tuple(_lease_key(item) for item in items))


def _rid_gen_body(rid: str, gen: int) -> bytes:
    return json.dumps({"rid": rid, "gen": gen}).encode()


def incarnation_of(agent_metadata: bytes) -> str:
    return hashlib.sha256(agent_metadata).hexdigest()[:32]


class ControlServer:
    """P's end of the side channel: publishes each rank's handshake payload (`publish_ranks`),
    parses D's control messages and hands them to the lease table, which owns every change to a
    lease (lease.py). A message that does not parse, or a read the table refuses, is answered
    with the reason (HandlerRefusal)."""

    def __init__(self, server: SideChannelServer, leases: LeaseTable) -> None:
        self.server = server
        self.leases = leases
        # Identifies this process's transfer agent; D compares it with the agent it
        # handshook with, to notice a P restarted under the same address.
        self.incarnation = ""
        # P rank -> its hasher, for the ranks whose KV this process holds in host memory
        self.digesters: dict[int, RankDigester] = {}
        server.register_handler(MSG_CHECK_READ, self._check_read)
        server.register_handler(MSG_READ_DONE, self._read_done)
        server.register_handler(MSG_RELEASE, self._release)
        server.register_handler(MSG_HEARTBEAT, self._heartbeat)

    def publish_ranks(self, engine_id: str, backend_name: str, compat: CompatibilityInfo,
                      ranks: Sequence[tuple[bytes, RankLayout]]) -> None:
        """Serve each rank's (agent blob, KV layout), rank 0 first, as its handshake payload; rank
        0's agent names this incarnation."""
        self.incarnation = incarnation_of(ranks[0][0])
        for agent_metadata, layout in ranks:
            meta = HandshakeMetadata(engine_id, backend_name, agent_metadata, layout)
            self.server.set_payload(layout.tp_rank, encode_payload(meta, compat))

    def _check_read(self, body: bytes) -> bytes:
        msg = parse_check_read(body)
        refusal = self.leases.check_read(msg.key.request_id, msg.key.generation, msg.blocks, msg.content,
                                         watch=msg.connect, read_timeout_s=msg.read_timeout_s, parent=msg.parent)
        if refusal is not None:
            raise HandlerRefusal(refusal.reason)
        if msg.digest is None:
            return self.incarnation.encode()
        digests: dict[str, list[int] | None] = {}
        for rank, spans in msg.digest.items():
            digester = self.digesters.get(rank)
            digests[str(rank)] = digester.digest(spans, msg.blocks) if digester is not None else None
        return json.dumps({"incarnation": self.incarnation, "digests": digests}).encode()

    def _read_done(self, body: bytes) -> bytes:
        key = parse_lease_key(body)
        self.leases.read_done(key.request_id, key.generation)
        return b"ok"

    def _release(self, body: bytes) -> bytes:
        key = parse_lease_key(body)
        if _load(body).get("reason") == KV_CONTENT_MISMATCH:
            self.leases.kv_content_mismatch(key.request_id, key.generation)
        else:
            self.leases.release(key.request_id, key.generation)
        return b"ok"

    def _heartbeat(self, body: bytes) -> bytes:
        renewed = sum(self.leases.renew(k.request_id, k.generation) for k in parse_heartbeat(body).keys)
        return str(renewed).encode()


class ControlClient:
    """D side; every call blocks for at most `timeout_s` and raises HandshakeError subclasses."""

    def __init__(self, timeout_s: float, client: HandshakeClient | None = None,
                 read_timeout_s: float | None = None) -> None:
        """`read_timeout_s`: this reader's read timeout, sent with every check_read."""
        self.timeout_s = timeout_s
        self.read_timeout_s = read_timeout_s
        self._client = client or HandshakeClient()

    def check_read(self, host: str, port: int, rid: str, gen: int, blocks: BlockIds,
                   content: str, connect: bool = True, traceparent: str | None = None) -> str:
        """Returns P's incarnation (see ControlServer.incarnation). `content`: the
        content_digest of the reader's own prompt tokens; `connect`: this reader has not
        completed a read from P lately (P then steps promptly for the read); `traceparent`:
        the reader's span for this check, when it traces the request (sent only then)."""
        msg: dict[str, Any] = {"rid": rid, "gen": gen, "blocks": [list(g) for g in blocks], "content": content,
                               "connect": connect}
        if traceparent is not None:
            msg["traceparent"] = traceparent
        return self._request_check(host, port, msg).decode("ascii", "replace")

    def check_read_digests(self, host: str, port: int, rid: str, gen: int, blocks: BlockIds, content: str,
                           connect: bool = True, traceparent: str | None = None,
                           digest: dict[int, list[Span]] | None = None
                           ) -> tuple[str, dict[int, list[int] | None] | None]:
        """check_read, and with `digest` (P rank -> the spans D will read) P's digests of them per
        rank too (None for a rank P cannot hash); raises HandshakeDecodeError on an answer that
        does not parse. Without `digest`: (incarnation, None)."""
        if digest is None:
            return self.check_read(host, port, rid, gen, blocks, content, connect, traceparent), None
        msg: dict[str, Any] = {"rid": rid, "gen": gen, "blocks": [list(g) for g in blocks], "content": content,
                               "connect": connect,
                               "digest": {str(r): [list(s) for s in spans] for r, spans in digest.items()}}
        if traceparent is not None:
            msg["traceparent"] = traceparent
        return parse_digest_answer(self._request_check(host, port, msg), set(digest))

    def _request_check(self, host: str, port: int, msg: dict[str, Any]) -> bytes:
        if self.read_timeout_s is not None:
            msg["read_timeout_s"] = self.read_timeout_s
        return self._client.request(host, port, MSG_CHECK_READ, json.dumps(msg).encode(), self.timeout_s)

    def read_done(self, host: str, port: int, rid: str, gen: int) -> None:
        self._client.request(host, port, MSG_READ_DONE, _rid_gen_body(rid, gen), self.timeout_s)

    def release(self, host: str, port: int, rid: str, gen: int) -> None:
        self._client.request(host, port, MSG_RELEASE, _rid_gen_body(rid, gen), self.timeout_s)

    def release_mismatch(self, host: str, port: int, rid: str, gen: int) -> None:
        """A release after D's read failed its digests: P's lease ends as a content mismatch."""
        body = json.dumps({"rid": rid, "gen": gen, "reason": KV_CONTENT_MISMATCH}).encode()
        self._client.request(host, port, MSG_RELEASE, body, self.timeout_s)

    def heartbeat(self, host: str, port: int, items: list[tuple[str, int]]) -> None:
        body = json.dumps({"items": [list(i) for i in items]}).encode()
        self._client.request(host, port, MSG_HEARTBEAT, body, self.timeout_s)


def parse_digest_answer(answer: bytes, ranks: set[int]) -> tuple[str, dict[int, list[int] | None]]:
    """P's check_read answer to a request with "digest": (incarnation, P rank -> digests or None),
    exactly the ranks asked. Raises HandshakeDecodeError for anything else."""
    try:
        obj = json.loads(answer)
        incarnation, raw = obj["incarnation"], obj["digests"]
        if not isinstance(incarnation, str) or not isinstance(raw, dict) or {int(r) for r in raw} != ranks:
            raise ValueError("wrong fields")
        digests: dict[int, list[int] | None] = {}
        for rank, values in raw.items():
            if values is not None and not (isinstance(values, list) and all(type(v) is int for v in values)):
                raise ValueError("digests must be lists of ints")
            digests[int(rank)] = values
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise HandshakeDecodeError(f"undecodable check_read answer: {exc}") from None
    return incarnation, digests
