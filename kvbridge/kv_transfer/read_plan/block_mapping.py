"""Logical to kernel block ids per KV cache group, and which of P's blocks fill which of D's.

Layout. The KV cache manager allocates *logical* blocks. An attention layer's kernel
works on *kernel* blocks of `block_size` tokens: the size both engines announce in the
handshake, which must be the same on both sides. One logical block is `ratio`
(`physical_blocks_per_logical`) consecutive kernel blocks, so logical block b of a
token-indexed group is kernel blocks [b*ratio, b*ratio + ratio), and position k of a
request's kernel list holds tokens [k*block_size, (k+1)*block_size) of its context,
counted from the list's first block.

Why P's ratio and D's ratio differ. A hybrid model chooses its logical block size so that
one logical block of attention KV takes as many bytes as one Mamba state (equal pages).
A rank's Mamba state size depends on the TP size, and not in proportion to its share of
attention KV, so engines of different TP sizes pick different logical sizes over the same
kernel block: in vLLM PR #42097's case P at TP 4 has 34 kernel blocks per logical
block and D at TP 1 has 66. Every id P sends is in P's logical blocks and every id D
holds is in D's.

Group kinds (`GroupKind`, the same strings as kvbridge.engine's KVCacheKind):
- full_attention, mla: token-indexed, every token kept; a request's list starts at its
  first token (or, on D, at the first block D lacks after a prefix-cache hit).
- sliding_window: token-indexed, but only the blocks still in the window are listed (the
  leading ones are freed), so a list ends at the request's last block and starts wherever
  the window does.
- mamba: one whole state (conv state + SSM state) per request. Its id is the state: never
  expanded by a ratio, never cut by tokens.

The rules:
1. `logical_to_kernel_block_ids`: P's ids are expanded with P's ratio, D's with D's.
   Seed 004's bug expanded P's ids with D's ratio: the reads hit the wrong kernel blocks
   and nothing failed. The ratio is keyword-only and must be named `local_ratio=` or
   `remote_ratio=`, so a call site says whose ratio it uses.
2. `apply_prefix_caching` pairs the kernel blocks D reads (`local`) with P's (`remote`):
   - equal ratios, token-indexed group: the tail. D lists only the blocks it lacks (its
     prefix-cache hit covers the first ones), both lists end at the request's last
     block, so D's n kernel blocks take P's last n. D listing more blocks than P is
     impossible and raises.
   - different ratios, full_attention/mla: D has no prefix hit (`check_block_ratios`
     refuses prefix caching at the handshake), so both whole lists start at the first
     token and differ only in how the last logical block rounds up. Both are cut to the
     smaller kernel count by dropping kernel blocks from the END, where the padding is.
     This is what vLLM's own test expects (`align_local6_remote10`: local 12, remote 10,
     and both keep their first 10). The `[-n:]` slices in the seed's report of the code
     keep the tail instead: P's kernel block j + d would fill D's block j.
   - different ratios, sliding_window: the two clipped lists start at tokens that depend
     on each side's logical size and on the request length, which this layer does not
     know. Raises.
   - mamba, whatever the ratios: states pair from the end (D's states take P's latest).
     D needing more states than P sent raises.
3. `check_block_ratios`: the handshake refusal when the ratios differ and D has prefix
   caching on, naming both ratios and the option (`--no-prefix-caching`) that turns
   prefix caching off.

For the decode side's worker connector, per request:
    kernel = apply_prefix_caching(d_logical_ids, p_logical_ids, group_kinds=kinds,
                                  local_ratio=d_layout.physical_blocks_per_logical,
                                  remote_ratio=p_layout.physical_blocks_per_logical)
    # kernel.local[g][i] is filled from kernel.remote[g][i], for every group g and index i
A request with nothing to read (every local group empty: a full prefix hit) needs no
call; with equal ratios a call returns empty lists. To mark a failed load's blocks
invalid, use D's logical ids for every group (a Mamba state that did not arrive is
invalid as a whole) or expand them with `logical_to_kernel_block_ids(...,
local_ratio=...)`.

Pure functions over plain ints and lists: no torch, no I/O.
"""

from __future__ import annotations

import enum
from typing import NamedTuple, Sequence

KernelIds = list[list[int]]  # one list of kernel block ids (Mamba: state ids) per group


class GroupKind(str, enum.Enum):
    """What a KV cache group's block ids index. The values are those of
    kvbridge.engine.kv_cache_manager.KVCacheKind."""

    FULL_ATTENTION = "full_attention"
    MLA = "mla"
    SLIDING_WINDOW = "sliding_window"
    MAMBA = "mamba"

    @property
    def token_indexed(self) -> bool:
        """Blocks hold runs of tokens: expanded by the ratio, cut by tokens."""
        return self is not GroupKind.MAMBA

    @property
    def keeps_every_token(self) -> bool:
        """A request's list starts at its first token (no window clips it)."""
        return self in (GroupKind.FULL_ATTENTION, GroupKind.MLA)


class BlockMappingError(ValueError):
    """The block ids, ratios or group kinds cannot describe one request's read; the
    message says why."""


class KernelReadIds(NamedTuple):
    """One request's read, per group: D's kernel block `local[g][i]` is filled from P's
    kernel block `remote[g][i]` (Mamba groups: state ids). Unpacks as (local, remote)."""

    local: KernelIds
    remote: KernelIds


def group_kind(kind: object) -> GroupKind:
    """`kind` as a GroupKind: a GroupKind, its string value, or any enum with such a value
    (kvbridge.engine's KVCacheKind passes as it is)."""
    value = getattr(kind, "value", kind)
    try:
        return GroupKind(value)
    except ValueError:
        known = ", ".join(k.value for k in GroupKind)
        raise BlockMappingError(f"unknown KV cache group kind {value!r} (known: {known})") from None


def logical_to_kernel_block_ids(block_ids: Sequence[Sequence[int]], *, group_kinds: Sequence[object],
                                local_ratio: int | None = None, remote_ratio: int | None = None) -> KernelIds:
    """Expand one engine's logical block ids, one list per group, into its kernel block ids.

    Give exactly one ratio, by name: `local_ratio=` (this engine's physical_blocks_per_logical)
    for this engine's ids, `remote_ratio=` (the peer's, from its handshake) for the peer's.
    Logical block b of a token-indexed group becomes [b*ratio, b*ratio + ratio); a Mamba
    group's ids are states and come back unchanged. Raises TypeError when no ratio or both
    are given, and BlockMappingError for non-int or negative ids, a ratio below 1, or a group
    count that differs from `group_kinds`."""
    if (local_ratio is None) == (remote_ratio is None):
        raise TypeError("give exactly one of local_ratio= (this engine's ids) or remote_ratio= "
                        "(the peer's ids, expanded with the peer's ratio)")
    ratio = local_ratio if local_ratio is not None else remote_ratio
    side = "local" if local_ratio is not None else "remote"
    _check_ratio(f"{side}_ratio", ratio)
    assert ratio is not None  # one of the two was given (checked above)
    kinds = _kinds(group_kinds)
    groups = _groups(side, block_ids, len(kinds))
    return [_expand(ids, ratio, kind) for ids, kind in zip(groups, kinds)]


def kernel_block_count(num_logical: int, ratio: int, kind: object) -> int:
    """How many kernel blocks (Mamba: states) `num_logical` logical blocks of a group are."""
    if type(num_logical) is not int or num_logical < 0:
        raise BlockMappingError(f"a block count must be an int >= 0, got {num_logical!r}")
    _check_ratio("ratio", ratio)
    return num_logical * ratio if group_kind(kind).token_indexed else num_logical


def apply_prefix_caching(local_block_ids: Sequence[Sequence[int]], remote_block_ids: Sequence[Sequence[int]], *,
                         local_ratio: int, remote_ratio: int, group_kinds: Sequence[object]) -> KernelReadIds:
    """The kernel blocks D reads for one request: D's (`local`) and P's (`remote`) LOGICAL
    block ids, one list per group, each expanded with its own engine's ratio and cut so that
    both sides have the same count per group (the module docstring gives the rules).

    Token-indexed groups with equal ratios keep the tail of P's list that D lacks (D's
    prefix-cache hit covers the first blocks). With different ratios, full_attention and
    mla groups keep the first min(local, remote) kernel blocks of both lists (the two
    differ only in the rounding of the last logical block; D has no prefix hit then, since
    check_block_ratios refuses prefix caching). Mamba groups pair states from the end and
    are never expanded. Raises BlockMappingError when D lists more blocks (kernel blocks or
    states) than P in any group whose tails are paired; when, with different ratios, P has a
    whole logical block or more that D lacks (a prefix hit, which cannot be paired); for a
    sliding-window group when the ratios differ; and for bad ids, ratios or group counts."""
    _check_ratio("local_ratio", local_ratio)
    _check_ratio("remote_ratio", remote_ratio)
    kinds = _kinds(group_kinds)
    local_groups = _groups("local", local_block_ids, len(kinds))
    remote_groups = _groups("remote", remote_block_ids, len(kinds))
    local_out: KernelIds = []
    remote_out: KernelIds = []
    for g, (local, remote, kind) in enumerate(zip(local_groups, remote_groups, kinds)):
        local_k = _expand(local, local_ratio, kind)
        remote_k = _expand(remote, remote_ratio, kind)
        if kind.token_indexed and local_ratio != remote_ratio:
            local_k, remote_k = _pair_heads(g, kind, local_k, remote_k, local_ratio, remote_ratio)
        else:
            local_k, remote_k = _pair_tails(g, kind, local_k, remote_k)
        local_out.append(local_k)
        remote_out.append(remote_k)
    return KernelReadIds(local_out, remote_out)


def check_block_ratios(local_ratio: int, remote_ratio: int, local_prefix_caching: bool) -> str | None:
    """Why D (local) must refuse P (remote) at the handshake, or None when it need not.

    With prefix caching on, D lists only the blocks it lacks, counted in its own logical
    blocks. Those cannot be matched to P's when one logical block is a different number of
    kernel blocks on each side, so different ratios require prefix caching off on D."""
    _check_ratio("local_ratio", local_ratio)
    _check_ratio("remote_ratio", remote_ratio)
    if local_ratio == remote_ratio or not local_prefix_caching:
        return None
    return (f"kernel blocks per logical block differ: the prefill engine has {remote_ratio}, this decode "
            f"engine has {local_ratio} (hybrid models at different TP sizes); with prefix caching on they "
            "must be equal: start the decode engine with --no-prefix-caching (enable_prefix_caching=False), "
            "or use TP sizes that give equal ratios")


# ---- helpers ----------------------------------------------------------------------------

def _check_ratio(name: str, ratio: object) -> None:
    if type(ratio) is not int or ratio < 1:
        raise BlockMappingError(f"{name} (kernel blocks per logical block) must be an int >= 1, got {ratio!r}")


def _kinds(group_kinds: Sequence[object]) -> tuple[GroupKind, ...]:
    if isinstance(group_kinds, (str, bytes)) or not isinstance(group_kinds, Sequence):
        raise BlockMappingError(f"group_kinds must be a sequence of group kinds, got {group_kinds!r}")
    kinds = tuple(group_kind(k) for k in group_kinds)
    if not kinds:
        raise BlockMappingError("at least one KV cache group is required")
    return kinds


def _groups(side: str, block_ids: Sequence[Sequence[int]], num_groups: int) -> list[list[int]]:
    if isinstance(block_ids, (str, bytes)) or not isinstance(block_ids, Sequence):
        raise BlockMappingError(f"{side} block ids must be one list per group, got {type(block_ids).__name__}")
    if len(block_ids) != num_groups:
        raise BlockMappingError(f"{side} block ids have {len(block_ids)} groups, the model has {num_groups}")
    groups: list[list[int]] = []
    for g, ids in enumerate(block_ids):
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
            raise BlockMappingError(f"{side} group {g}: block ids must be a list, got {type(ids).__name__}")
        for b in ids:
            if type(b) is not int or b < 0:
                raise BlockMappingError(f"{side} group {g}: block id {b!r} is not an int >= 0")
        groups.append(list(ids))
    return groups


def _expand(ids: list[int], ratio: int, kind: GroupKind) -> list[int]:
    if not kind.token_indexed or ratio == 1:
        return list(ids)
    return [k for b in ids for k in range(b * ratio, b * ratio + ratio)]


def _pair_tails(g: int, kind: GroupKind, local_k: list[int], remote_k: list[int]) -> tuple[list[int], list[int]]:
    """D's blocks (or states) take P's last ones; D listing more than P is an error."""
    unit = "kernel blocks" if kind.token_indexed else "states"
    if len(local_k) > len(remote_k):
        raise BlockMappingError(
            f"group {g} ({kind.value}): D lists {len(local_k)} {unit} but P sent {len(remote_k)}; "
            "D cannot lack more than P has")
    return local_k, remote_k[len(remote_k) - len(local_k):]


def _pair_heads(g: int, kind: GroupKind, local_k: list[int], remote_k: list[int], local_ratio: int,
                remote_ratio: int) -> tuple[list[int], list[int]]:
    """Whole lists from the first token on both sides: both cut to the shorter, at the end."""
    if not kind.keeps_every_token:
        raise BlockMappingError(
            f"group {g} ({kind.value}): kernel blocks per logical block differ (local {local_ratio}, remote "
            f"{remote_ratio}) and a window-clipped list cannot be aligned without the request's length")
    if len(remote_k) - len(local_k) >= remote_ratio:
        raise BlockMappingError(
            f"group {g} ({kind.value}): P sent {len(remote_k)} kernel blocks and D lists {len(local_k)}, "
            f"a whole remote logical block ({remote_ratio}) or more fewer; with different ratios D must list "
            "the whole request (prefix caching off on D)")
    n = min(len(local_k), len(remote_k))
    return local_k[:n], remote_k[:n]
