"""Block hashes that every instance of one model, and the router, compute alike.

A block's hash is SHA-256 over (its parent's digest, its token ids, its extra keys), so equal
hashes mean equal whole prefixes; the first block's parent is the model's *root*, a digest of the
model's identity, so two models never share a hash. Nothing is seeded per process or per start:
the same model and tokens give the same chain in any process, on any host, after any restart.

Why not vLLM's scheme: vLLM hashes a pickled tuple (or CBOR) under a NONE_HASH derived from
PYTHONHASHSEED, from a fixed default seed for sha256 and from os.urandom for xxhash; a pickle's
bytes depend on Python's pickler, and a router that is not vLLM cannot reproduce them. Here the
bytes hashed are spelled out below, so any language can compute them:

    digest(block) = sha256(b"kvbridge-block-v1" || parent_digest (32 bytes)
                           || u32be(len(token_ids)) || u32be(token_id) for each token
                           || msgpack(extra_keys))    # nil when the block has none

    root(model) = sha256(b"kvbridge-root-v1" || utf8(model_identity))

The digest chains; what events carry and the index keys on is vLLM's int form of it, the low
64 bits (`events.external_hash`). KV cache groups share the chain (vLLM does the same) and are
kept apart by `group_idx` in events and in the index.

Pure functions; `tests/unit/test_kv_events_hashing.py` checks them in two processes.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import Union

import msgspec

DIGEST_BYTES = 32
# An extra key: what, besides its tokens, makes a block's KV differ (a LoRA name, a cache salt,
# a multi-modal item's hash and offset). Only these types, so msgpack's bytes are canonical.
ExtraKeyItem = Union[str, int, bytes, None, tuple["ExtraKeyItem", ...]]
ExtraKeys = Union[tuple[ExtraKeyItem, ...], None]

_BLOCK_DOMAIN = b"kvbridge-block-v1"
_ROOT_DOMAIN = b"kvbridge-root-v1"
_MAX_TOKEN_ID = (1 << 32) - 1
_EXTRA = msgspec.msgpack.Encoder()
_NO_EXTRA = _EXTRA.encode(None)


def model_root(model_identity: str) -> bytes:
    """The digest every chain of this model starts from. `model_identity` must name the weights
    and tokenizer exactly (e.g. "<repo>@<revision>" or a weights file's sha256): instances that
    should share cache entries pass the same string, different models different ones."""
    if not model_identity:
        raise ValueError("model_identity must not be empty")
    return hashlib.sha256(_ROOT_DOMAIN + model_identity.encode("utf-8")).digest()


def block_digest(parent: bytes, token_ids: Sequence[int], extra_keys: ExtraKeys = None) -> bytes:
    """The digest of one block under `parent` (the previous block's digest, or the root).
    Raises ValueError for a parent that is not a digest or a token id outside [0, 2**32)."""
    if len(parent) != DIGEST_BYTES:
        raise ValueError(f"parent must be a {DIGEST_BYTES}-byte digest, got {len(parent)} bytes")
    try:
        tokens = struct.pack(f">{len(token_ids)}I", *token_ids)
    except struct.error as e:
        raise ValueError(f"token ids must be ints in [0, {_MAX_TOKEN_ID}]: {e}") from None
    extra = _NO_EXTRA if extra_keys is None else _EXTRA.encode(extra_keys)
    return hashlib.sha256(_BLOCK_DOMAIN + parent + struct.pack(">I", len(token_ids)) + tokens
                          + extra).digest()


def chain_digests(parent: bytes, token_ids: Sequence[int], block_size: int,
                  extra_keys: Sequence[ExtraKeys] | None = None) -> list[bytes]:
    """Digests of the FULL blocks of `token_ids` (a trailing partial block has none), chained
    from `parent`. `extra_keys`, if given, has one entry per full block."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    n = len(token_ids) // block_size
    if extra_keys is not None and len(extra_keys) != n:
        raise ValueError(f"extra_keys has {len(extra_keys)} entries for {n} full blocks")
    out: list[bytes] = []
    for i in range(n):
        parent = block_digest(parent, token_ids[i * block_size:(i + 1) * block_size],
                              extra_keys[i] if extra_keys is not None else None)
        out.append(parent)
    return out


def to_external(digest: bytes) -> int:
    """vLLM's int form of a digest (maybe_convert_block_hash): big-endian, low 64 bits."""
    return int.from_bytes(digest[-8:], "big")


def block_hashes(root: bytes, token_ids: Sequence[int], block_size: int,
                 extra_keys: Sequence[ExtraKeys] | None = None) -> list[int]:
    """The int hashes of a prompt's full blocks from the model's root: what events carry."""
    return [to_external(d) for d in chain_digests(root, token_ids, block_size, extra_keys)]
