"""Handshake payload: what P serves about one TP rank, and how D checks it.

The wire payload P serves for one TP rank is a fixed header followed by a body:

    header  b"KVBH" | connector version (u16) | compatibility hash (32 bytes) | body length (u32)
    body    UTF-8 JSON: engine_id, backend, agent_metadata (base64), layout (RankLayout),
            and compat: P's CompatibilityInfo, the hash's inputs (left out when its
            canonical JSON exceeds MAX_COMPAT_BYTES; optional, so older peers interoperate)

The magic and version come first and stay put in every future version. D checks, in
order: magic, version, compatibility hash, and only then decodes the body, so a peer
running another model or release is refused with a precise reason rather than a
decode error. When the hashes differ, D reads P's `compat` description, if one is there
and it hashes to the header's hash (a description D cannot trust explains nothing), and
names the fields that differ: "the prefill engine serves an MLA model (latent KV cache)
and this engine a non-MLA one" rather than two hex digests. With equal hashes a
description that is malformed or does not hash to the header's hash is a decode error.
Then the engine id (when D knows which engine it expects) and the memory layout are
checked against D's own.

The payload travels over the side channel (server.py); D's deduplicating,
backing-off fetches live in handshake_manager.py.

Every failure is a HandshakeError subclass tagged with a HandshakeFailureKind, so the
connector's failure handler can classify it; HandshakeManager turns them into failed
futures and never raises into its callers.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import hmac
import json
import struct
from dataclasses import dataclass
from enum import Enum
from typing import Any, ClassVar

from kvbridge.kv_transfer.digest import DIGEST_ID
from kvbridge.kv_transfer.read_plan.block_mapping import check_block_ratios

KVBRIDGE_CONNECTOR_VERSION = 1
PAYLOAD_MAGIC = b"KVBH"

_PAYLOAD_PREFIX = struct.Struct("!4sH")  # magic, connector version
HASH_LEN = 32  # SHA-256 digest
_PAYLOAD_V1 = struct.Struct(f"!{HASH_LEN}sI")  # compatibility hash, body length
MAX_COMPAT_BYTES = 4096  # the most bytes of canonical JSON a compatibility description may have
_SHOWN_VALUE_CHARS = 80  # a differing field's value is cut to this in a refusal's message


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
    kv_digest: str = DIGEST_ID  # the transferred blocks' digest and its version, or "off" (digest.py)
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

    @classmethod
    def from_json(cls, obj: object) -> "CompatibilityInfo":
        """A peer's description (the object `canonical` encodes), checked field by field: exactly
        the fields, each of its exact JSON type, at most MAX_COMPAT_BYTES encoded. Raises
        ValueError (or TypeError) for anything else; never trusts the peer's input further."""
        if not isinstance(obj, dict):
            raise TypeError("expected a JSON object")
        if set(obj) != set(_COMPAT_FIELD_TYPES):
            raise ValueError(f"fields {sorted(map(str, obj))[:16]} are not {sorted(_COMPAT_FIELD_TYPES)}")
        values: dict[str, Any] = {}
        for name, want in _COMPAT_FIELD_TYPES.items():
            value = obj[name]
            if want is tuple:  # a tuple of strings, a JSON list
                if type(value) is not list or not all(type(g) is str for g in value):
                    raise TypeError(f"{name} must be a list of strings")
                value = tuple(value)
            elif type(value) is not want:  # exact: a JSON bool must not pass as an int
                raise TypeError(f"{name} must be {want.__name__}")
            values[name] = value
        info = cls(**values)
        if len(info.canonical()) > MAX_COMPAT_BYTES:
            raise ValueError(f"longer than {MAX_COMPAT_BYTES} bytes")
        return info

    def differences(self, local: "CompatibilityInfo") -> list[str]:
        """`field (peer X, local Y)` for each field that differs, values as JSON, cut short."""
        out = []
        for f in dataclasses.fields(self):
            mine, theirs = getattr(local, f.name), getattr(self, f.name)
            if mine != theirs:
                out.append(f"{f.name} (peer {_shown(theirs)}, local {_shown(mine)})")
        return out


# The JSON type of each CompatibilityInfo field (a field of another type must be added here).
_COMPAT_FIELD_TYPES: dict[str, type] = {
    f.name: {"str": str, "int": int, "bool": bool, "tuple[str, ...]": tuple}[str(f.type)]
    for f in dataclasses.fields(CompatibilityInfo)}


def _shown(value: object) -> str:
    text = json.dumps(list(value) if isinstance(value, tuple) else value)
    return text if len(text) <= _SHOWN_VALUE_CHARS else text[:_SHOWN_VALUE_CHARS - 3] + "..."


def mismatch_reason(peer: CompatibilityInfo, local: CompatibilityInfo) -> str:
    """Why the prefill engine described by `peer` and this (decode) engine cannot exchange KV."""
    parts = []
    if peer.use_mla != local.use_mla:
        parts.append("the prefill engine serves an MLA model (latent KV cache) and this engine a non-MLA one: "
                     "they cannot exchange KV" if peer.use_mla else
                     "the prefill engine serves a non-MLA model and this engine an MLA one (latent KV cache): "
                     "they cannot exchange KV")
    parts.append("the engines differ in " + ", ".join(peer.differences(local)))
    return "; ".join(parts)


@dataclass(frozen=True)
class RankLayout:
    """Where one TP rank's KV cache lives in memory. Raises ValueError when inconsistent."""

    tp_size: int
    tp_rank: int
    region_base_addrs: tuple[int, ...]  # one registered region per KV tensor (K and V apart)
    block_len_bytes: tuple[int, ...]  # bytes of one kernel block, per region
    num_blocks: int  # kernel blocks per region
    block_size: int  # tokens per kernel block
    kv_layout: str  # how a block is laid out (rank_agent.KV_LAYOUT)
    kv_head_start: int  # the first of the global KV heads this rank holds
    num_kv_heads: int  # how many consecutive KV heads it holds (each block_len_bytes / num_kv_heads)
    physical_blocks_per_logical: int = 1  # kernel blocks per scheduler (logical) block
    # Where the regions live: a reader names the peer's memory as the peer registered it (NIXL
    # looks a remote span up by memory type and device id: a GPU rank's KV is VRAM on its GPU).
    memory: str = "cpu"  # cpu | cuda
    device_id: int = 0  # the GPU's index in the registering process (0 for cpu)

    def __post_init__(self) -> None:
        for name in ("region_base_addrs", "block_len_bytes"):
            if not isinstance(getattr(self, name), (list, tuple)):
                raise ValueError(f"{name} must be a sequence of ints")
            object.__setattr__(self, name, tuple(getattr(self, name)))
        for name in ("tp_size", "tp_rank", "num_blocks", "block_size", "kv_head_start", "num_kv_heads",
                     "physical_blocks_per_logical", "device_id"):
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
        if self.kv_head_start < 0 or self.num_kv_heads < 1:
            raise ValueError("need kv_head_start >= 0 and num_kv_heads >= 1")
        if any(n % self.num_kv_heads for n in self.block_len_bytes):
            raise ValueError("block_len_bytes must split evenly over the rank's KV heads")
        if self.memory not in ("cpu", "cuda") or self.device_id < 0:
            raise ValueError(f"memory must be cpu or cuda and device_id >= 0, got {self.memory!r} {self.device_id}")


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


def encode_payload(metadata: HandshakeMetadata, compat: CompatibilityInfo | bytes) -> bytes:
    """P side: the bytes served for one rank (compute once, at registration). `compat`: this
    engine's CompatibilityInfo (its hash goes in the header, the description in the body,
    unless longer than MAX_COMPAT_BYTES), or a bare 32-byte hash (no description)."""
    if isinstance(compat, CompatibilityInfo):
        compat_hash, description = compat.hash(), compat.canonical()
    else:
        compat_hash, description = compat, None
    if len(compat_hash) != HASH_LEN:
        raise ValueError("compat_hash must be a 32-byte SHA-256 digest")
    body_obj = {
        "engine_id": metadata.engine_id,
        "backend": metadata.backend,
        "agent_metadata": base64.b64encode(metadata.agent_metadata).decode("ascii"),
        "layout": dataclasses.asdict(metadata.layout),
    }
    if description is not None and len(description) <= MAX_COMPAT_BYTES:
        body_obj["compat"] = json.loads(description)
    body = json.dumps(body_obj, sort_keys=True, separators=(",", ":")).encode()
    header = _PAYLOAD_PREFIX.pack(PAYLOAD_MAGIC, KVBRIDGE_CONNECTOR_VERSION)
    return header + _PAYLOAD_V1.pack(compat_hash, len(body)) + body


def decode_payload(data: bytes, expected: CompatibilityInfo | bytes, expected_engine_id: str | None = None,
                   local_layout: RankLayout | None = None, *,
                   prefix_caching: bool = False) -> HandshakeMetadata:
    """D side: check and decode P's payload. Raises only HandshakeError subclasses.

    `expected`: this engine's CompatibilityInfo, or just its hash (then a mismatch cannot
    name the fields that differ). Order: magic (DecodeError), version (VersionMismatch),
    compatibility hash (HashMismatch, decided before any body byte is looked at; its
    message names the differing fields when P's description can be read and trusted),
    body (DecodeError), engine id (EngineMismatch, skipped when expected_engine_id is
    None), layout against `local_layout` (LayoutMismatch, skipped when None).
    """
    local_compat: CompatibilityInfo | None
    if isinstance(expected, CompatibilityInfo):
        local_compat, expected_hash = expected, expected.hash()
    else:
        local_compat, expected_hash = None, expected
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
        peer = _peer_compat(data[header_len:], body_len, compat_hash) if local_compat is not None else None
        if peer is not None and local_compat is not None:  # a peer's description is read only with ours
            raise HandshakeHashMismatch(f"compatibility hash mismatch: {mismatch_reason(peer, local_compat)}")
        raise HandshakeHashMismatch(
            f"compatibility hash mismatch: peer {compat_hash.hex()[:16]}, local "
            f"{bytes(expected_hash).hex()[:16]} (model, dtype, KV heads, head size, layers, "
            "cache dtype, attention backend, MLA or KV cache groups differ)")
    if len(data) - header_len != body_len:
        raise HandshakeDecodeError(
            f"payload body is {len(data) - header_len} bytes, header says {body_len}")
    metadata = _decode_body(data[header_len:], compat_hash)
    if expected_engine_id is not None and metadata.engine_id != expected_engine_id:
        raise HandshakeEngineMismatch(
            f"expected engine {expected_engine_id!r}, the side channel serves "
            f"{metadata.engine_id!r} (stale kv_transfer_params or a misconfigured host?)")
    if local_layout is not None:
        validate_layout(metadata.layout, local_layout, prefix_caching=prefix_caching)
    return metadata


def validate_layout(remote: RankLayout, local: RankLayout, *, prefix_caching: bool) -> None:
    """Raise HandshakeLayoutMismatch when D (local) cannot read P's (remote) blocks.

    Which heads each rank holds, and whether D's ranks can be filled from P's, is checked
    once every rank's payload is in (tp_mapping.check_pairing, in the worker connector).
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
    refusal = check_block_ratios(local.physical_blocks_per_logical, remote.physical_blocks_per_logical,
                                 prefix_caching)
    if refusal is not None:  # D's prefix-cache hits cannot be paired with P's blocks
        raise HandshakeLayoutMismatch(refusal)


def _peer_compat(body: bytes, body_len: int, compat_hash: bytes) -> CompatibilityInfo | None:
    """P's description from a payload whose hash differs from D's: None unless the body is
    whole, parses, carries a well-formed description and that description hashes to the
    header's hash. Never raises (the peer's bytes may be anything)."""
    if len(body) != body_len:
        return None
    try:
        obj = json.loads(body.decode("utf-8"))
        if not isinstance(obj, dict) or "compat" not in obj:
            return None
        peer = CompatibilityInfo.from_json(obj["compat"])
    except (ValueError, TypeError, RecursionError):
        return None
    return peer if hmac.compare_digest(peer.hash(), compat_hash) else None


def _decode_body(body: bytes, compat_hash: bytes) -> HandshakeMetadata:
    try:
        obj = json.loads(body.decode("utf-8"))
        if isinstance(obj, dict) and "compat" in obj:
            try:
                described = CompatibilityInfo.from_json(obj["compat"]).hash()
            except (ValueError, TypeError) as exc:
                raise ValueError(f"bad compatibility description: {exc}") from None
            if not hmac.compare_digest(described, compat_hash):
                raise ValueError("the compatibility description does not match the payload's hash")
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
                kv_head_start=_typed(layout, "kv_head_start", int),
                num_kv_heads=_typed(layout, "num_kv_heads", int),
                physical_blocks_per_logical=_typed(layout, "physical_blocks_per_logical", int),
                # optional: a peer from before these fields registered host memory
                memory=_typed(layout, "memory", str) if "memory" in layout else "cpu",
                device_id=_typed(layout, "device_id", int) if "device_id" in layout else 0,
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
