"""The `kv_transfer_params` wire schema: the only place that parses it.

`kv_transfer_params` is a JSON object carried in the body of /v1/completions and
/v1/chat/completions requests (proxy -> P, proxy -> D) and in a prefill instance's
response body (P -> proxy). Field names and meanings follow vLLM's P/D protocol so a
router that speaks it can front kvbridge:

    do_remote_decode   bool  P side: keep this request's KV after it finishes, for a
                             remote decode instance to read (the proxy sets it on P).
    do_remote_prefill  bool  D side: this request's KV was computed remotely; read it
                             before decoding (P returns it, the proxy forwards it to D).
    remote_block_ids   list[int] | list[list[int]]  P's logical block ids, one list per
                             KV cache group; a flat list means one group.
    remote_engine_id   str   P's engine id (checked against the handshake).
    remote_request_id  str   P's own request id: notifications to P must carry it.
    remote_host, remote_port     P's handshake side channel.
    tp_size            int   P's tensor-parallel size (vLLM treats a missing one as 1).
    remote_num_tokens  int   optional: how many prompt tokens P computed.

kvbridge adds fields of its own:

    remote_block_size  int   tokens per P logical block. Hybrid Mamba models choose the
                             logical block size per TP size (shape/kv_cache_layout.py), so
                             D counts P's block ids with P's size. Absent: D's own size.

    generated_token_ids  list[int]  the tokens P sampled after the prompt (its one token
                             of a do_remote_decode request; absent for models whose P
                             computes only N-1 prompt tokens). Informational: D never
                             reads it. The kvbridge proxy sends them to D in the request's
                             own `continue_from_token_ids` (first token straight from
                             prefill), outside these params, so params swapped between
                             requests never carry another request's token.

    remote_cached_tokens  int  the prompt tokens P took from its own prefix cache for this request
                             (it computed the rest): D answers min(this, the tokens it did not
                             compute itself) as the request's `cached_tokens`, the prompt tokens
                             computed for it nowhere in the fleet. Absent (a vLLM P): 0.

    lease_generation   int   identifies the lease P granted on these blocks. P bumps it
                             whenever a lease is created; a read or heartbeat naming a
                             generation P no longer holds (the lease expired and the
                             blocks were freed, maybe reused) is refused instead of
                             returning someone else's KV. Peers that do not know it
                             simply omit it.

`null` for a field means "absent" (vLLM's proxy sends nulls). Unknown keys are kept in
`unknown_fields` and written back by `to_wire`, so a proxy forwarding P's answer to D
does not drop fields added by newer peers.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

logger = logging.getLogger(__name__)

# The error code (RequestOutput.error_code, the OpenAI error body's `code`) of a request that failed
# because its KV could not be loaded from the prefill instance (load-failure policy "fail"): the
# request's own failure, not the engine's. P has released that KV, so the proxy retries no other D.
KV_LOAD_FAILED = "kv_transfer_failed"

MAX_BLOCK_ID = 2**31 - 1  # block pools are far smaller; anything above is garbage
MAX_BLOCK_IDS = 1 << 20  # total over all groups: 16M tokens at block size 16
MAX_KV_GROUPS = 64
MAX_PORT = 65535
MAX_TP_SIZE = 1 << 16
MAX_NUM_TOKENS = 2**31 - 1
MAX_LEASE_GENERATION = 2**63 - 1  # fits a signed 64-bit field on any peer
MAX_GENERATED_TOKENS = 16  # P samples one token; a few more leave room, none need thousands
MAX_ID_CHARS = 1024  # engine and request ids
MAX_HOST_CHARS = 255
_MAX_UNKNOWN_DEPTH = 32  # nesting kept in unknown_fields

# Block ids, one sequence per KV cache group (group order: the model's layer groups): P's in its
# params (tuples), an engine's own as its KV cache manager hands them out (lists). The one shape
# for every module that passes them on; none of them changes a sequence it was given.
BlockIds = tuple[Sequence[int], ...]

_BOOL_FIELDS = ("do_remote_decode", "do_remote_prefill")
_STR_FIELDS = ("remote_engine_id", "remote_request_id", "remote_host")
_INT_FIELDS = {  # name -> (minimum, maximum)
    "remote_port": (1, MAX_PORT),
    "tp_size": (1, MAX_TP_SIZE),
    "remote_num_tokens": (0, MAX_NUM_TOKENS),
    "remote_block_size": (1, MAX_NUM_TOKENS),
    "lease_generation": (0, MAX_LEASE_GENERATION),
    "remote_cached_tokens": (0, MAX_NUM_TOKENS),
    "remote_prefix_tokens": (1, MAX_NUM_TOKENS),
}
_REQUIRED_FOR_REMOTE_PREFILL = (
    "remote_block_ids", "remote_engine_id", "remote_request_id", "remote_host", "remote_port",
)
KNOWN_FIELDS = frozenset((*_BOOL_FIELDS, *_STR_FIELDS, *_INT_FIELDS, "remote_block_ids", "generated_token_ids"))


class KVTransferParamsError(ValueError):
    """Invalid `kv_transfer_params`; str(error) is safe to return in an HTTP 400 body."""


@dataclass(frozen=True)
class KVTransferParams:
    """Validated `kv_transfer_params` of one request. See the module docstring for fields.

    Construction validates (raises KVTransferParamsError), so an instance is always
    consistent: when `do_remote_prefill` is true every field D needs to read is present.
    `remote_block_ids` is one tuple per KV cache group (at least one group when given).
    """

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_block_ids: BlockIds | None = None
    remote_engine_id: str | None = None
    remote_request_id: str | None = None
    remote_host: str | None = None
    remote_port: int | None = None
    tp_size: int | None = None
    remote_num_tokens: int | None = None
    remote_block_size: int | None = None
    lease_generation: int | None = None
    remote_cached_tokens: int | None = None
    remote_prefix_tokens: int | None = None
    generated_token_ids: tuple[int, ...] | None = None
    # Opaque pass-through of keys this version does not know; excluded from hashing
    # because the values may be lists or objects.
    unknown_fields: Mapping[str, Any] = field(
        default_factory=lambda: MappingProxyType({}), hash=False)

    def __post_init__(self) -> None:
        for name in _BOOL_FIELDS:
            if not isinstance(getattr(self, name), bool):
                raise KVTransferParamsError(f"kv_transfer_params.{name} must be a boolean")
        for name in _STR_FIELDS:
            _check_str(name, getattr(self, name))
        for name, (low, high) in _INT_FIELDS.items():
            _check_int(name, getattr(self, name), low, high)
        if self.remote_block_ids is not None:
            _check_block_ids(self.remote_block_ids)
        if self.generated_token_ids is not None:
            _check_generated(self.generated_token_ids)
        if self.do_remote_decode and self.do_remote_prefill and self.remote_prefix_tokens is None:
            raise KVTransferParamsError(
                "kv_transfer_params: do_remote_decode and do_remote_prefill cannot both be true "
                "(except to read a held prefix: remote_prefix_tokens)")
        if self.remote_prefix_tokens is not None and not self.do_remote_prefill:
            raise KVTransferParamsError("kv_transfer_params.remote_prefix_tokens needs do_remote_prefill")
        if self.remote_prefix_tokens is not None and self.generated_token_ids is not None:
            raise KVTransferParamsError(
                "kv_transfer_params: a held prefix (remote_prefix_tokens) has no generated_token_ids")
        if self.do_remote_prefill:
            missing = [n for n in _REQUIRED_FOR_REMOTE_PREFILL if getattr(self, n) is None]
            if missing:
                raise KVTransferParamsError(
                    "kv_transfer_params: do_remote_prefill requires " + ", ".join(missing))
        # Always a private read-only copy: the instance is frozen, the caller's dict is not.
        object.__setattr__(self, "unknown_fields", _freeze_unknown(self.unknown_fields))

    @property
    def wants_remote_prefill(self) -> bool:
        """D side: the prompt's KV lives on a remote P and must be read before decoding."""
        return self.do_remote_prefill

    @property
    def wants_remote_decode(self) -> bool:
        """P side: keep the KV after the request finishes, under a lease, for a remote reader."""
        return self.do_remote_decode

    @property
    def is_prefix_load(self) -> bool:
        """The source holds only a prefix of the prompt (remote_prefix_tokens): the rest is computed here."""
        return self.do_remote_prefill and self.remote_prefix_tokens is not None

    @property
    def num_kv_groups(self) -> int:
        return 0 if self.remote_block_ids is None else len(self.remote_block_ids)

    @property
    def remote_tp_size(self) -> int:
        """P's TP size, defaulting to 1 like vLLM when the field was absent."""
        return 1 if self.tp_size is None else self.tp_size


def parse_kv_transfer_params(raw: object) -> KVTransferParams | None:
    """Parse the `kv_transfer_params` value of a request or response body.

    Returns None for None or an empty object (no KV transfer). Raises
    KVTransferParamsError, and nothing else, for any other invalid input: a non-object,
    a wrong type (a bool is not an int, a float is not an int), out-of-range block ids,
    ports or sizes, or do_remote_prefill without the fields D needs to read.
    """
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise KVTransferParamsError(
            f"kv_transfer_params must be a JSON object, got {_json_type(raw)}")
    if not raw:
        return None
    known: dict[str, Any] = {}
    unknown: dict[str, Any] = {}
    for key, value in raw.items():
        if not isinstance(key, str):
            raise KVTransferParamsError("kv_transfer_params keys must be strings")
        if key in KNOWN_FIELDS:
            if value is not None:  # null means absent
                known[key] = value
        elif _is_json_like(value, _MAX_UNKNOWN_DEPTH):
            unknown[key] = value
        else:
            logger.debug("dropping kv_transfer_params.%s: not a JSON value", key)
    for name in _BOOL_FIELDS:
        known.setdefault(name, False)
    if "remote_block_ids" in known:
        known["remote_block_ids"] = _normalise_block_ids(known["remote_block_ids"])
    if "generated_token_ids" in known:
        ids = known["generated_token_ids"]
        if not isinstance(ids, (list, tuple)):
            raise KVTransferParamsError(
                f"kv_transfer_params.generated_token_ids must be a list, got {_json_type(ids)}")
        known["generated_token_ids"] = tuple(ids)
    return KVTransferParams(**known, unknown_fields=unknown)


def to_wire(params: KVTransferParams) -> dict[str, Any]:
    """JSON-able dict with vLLM's field names; `parse_kv_transfer_params` inverts it.

    The two flags are always written; other fields only when set. Block ids are a flat
    list for one KV cache group (what vLLM sends for non-hybrid models) and a list of
    lists for several.
    """
    wire: dict[str, Any] = copy.deepcopy(dict(params.unknown_fields))
    wire["do_remote_decode"] = params.do_remote_decode
    wire["do_remote_prefill"] = params.do_remote_prefill
    if params.remote_block_ids is not None:
        groups = [list(group) for group in params.remote_block_ids]
        wire["remote_block_ids"] = groups[0] if len(groups) == 1 else groups
    for name in (*_STR_FIELDS, *_INT_FIELDS):
        value = getattr(params, name)
        if value is not None:
            wire[name] = value
    if params.generated_token_ids is not None:
        wire["generated_token_ids"] = list(params.generated_token_ids)
    return wire


def wire_or_none(params: KVTransferParams | None) -> dict[str, Any] | None:
    """`to_wire` of params that may be absent: what a response body carries (the HTTP edge)."""
    return to_wire(params) if params is not None else None


def _normalise_block_ids(value: object) -> BlockIds:
    if not isinstance(value, (list, tuple)):
        raise KVTransferParamsError(
            f"kv_transfer_params.remote_block_ids must be a list, got {_json_type(value)}")
    if not value:
        return ((),)  # one group with no blocks (e.g. nothing left to read)
    if all(isinstance(item, (list, tuple)) for item in value):
        return tuple(tuple(group) for group in value)
    if any(isinstance(item, (list, tuple)) for item in value):
        raise KVTransferParamsError(
            "kv_transfer_params.remote_block_ids must be a list of ints or a list of lists "
            "of ints, not a mix")
    return (tuple(value),)


def _check_block_ids(groups: object) -> None:
    if not isinstance(groups, tuple) or not groups:
        raise KVTransferParamsError(
            "kv_transfer_params.remote_block_ids must hold at least one KV cache group")
    if len(groups) > MAX_KV_GROUPS:
        raise KVTransferParamsError(
            f"kv_transfer_params.remote_block_ids has {len(groups)} groups "
            f"(at most {MAX_KV_GROUPS})")
    total = 0
    for group in groups:
        if not isinstance(group, tuple):
            raise KVTransferParamsError("kv_transfer_params.remote_block_ids groups must be lists")
        total += len(group)
        if total > MAX_BLOCK_IDS:
            raise KVTransferParamsError(
                f"kv_transfer_params.remote_block_ids holds more than {MAX_BLOCK_IDS} ids")
        for block_id in group:
            if type(block_id) is not int:  # excludes bool, float and int subclasses
                raise KVTransferParamsError(
                    "kv_transfer_params.remote_block_ids must contain integers, got "
                    + _json_type(block_id))
            if not 0 <= block_id <= MAX_BLOCK_ID:
                raise KVTransferParamsError(
                    f"kv_transfer_params.remote_block_ids: block id {block_id} out of range "
                    f"[0, {MAX_BLOCK_ID}]")


def _check_generated(ids: object) -> None:
    if not isinstance(ids, tuple) or not 1 <= len(ids) <= MAX_GENERATED_TOKENS:
        raise KVTransferParamsError(
            f"kv_transfer_params.generated_token_ids must list 1 to {MAX_GENERATED_TOKENS} token ids")
    for token in ids:
        if type(token) is not int or not 0 <= token <= MAX_BLOCK_ID:
            raise KVTransferParamsError(
                f"kv_transfer_params.generated_token_ids must hold integers in [0, {MAX_BLOCK_ID}]")


def _check_str(name: str, value: object) -> None:
    if value is None:
        return
    if not isinstance(value, str):
        raise KVTransferParamsError(
            f"kv_transfer_params.{name} must be a string, got {_json_type(value)}")
    limit = MAX_HOST_CHARS if name == "remote_host" else MAX_ID_CHARS
    if not value or len(value) > limit:
        raise KVTransferParamsError(
            f"kv_transfer_params.{name} must be 1 to {limit} characters long")
    if not value.isprintable() or (name == "remote_host" and any(c.isspace() for c in value)):
        raise KVTransferParamsError(
            f"kv_transfer_params.{name} contains characters that are not allowed")


def _check_int(name: str, value: object, low: int, high: int) -> None:
    if value is None:
        return
    if type(value) is not int:
        raise KVTransferParamsError(
            f"kv_transfer_params.{name} must be an integer, got {_json_type(value)}")
    if not low <= value <= high:
        raise KVTransferParamsError(
            f"kv_transfer_params.{name}={value} out of range [{low}, {high}]")


def _is_json_like(value: object, depth: int) -> bool:
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if depth <= 0:
        return False
    if isinstance(value, (list, tuple)):
        return all(_is_json_like(item, depth - 1) for item in value)
    if isinstance(value, Mapping):
        return all(isinstance(k, str) and _is_json_like(v, depth - 1) for k, v in value.items())
    return False


def _freeze_unknown(value: Mapping[str, Any]) -> Mapping[str, Any]:
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise KVTransferParamsError("unknown_fields must be a mapping with string keys")
    if any(k in KNOWN_FIELDS for k in value):
        raise KVTransferParamsError("unknown_fields must not repeat a known field")
    return MappingProxyType(copy.deepcopy(dict(value)))


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, (list, tuple)):
        return "array"
    if isinstance(value, Mapping):
        return "object"
    return type(value).__name__
