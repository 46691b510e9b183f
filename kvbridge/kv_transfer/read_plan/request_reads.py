"""One request's read descriptors over every KV cache group: the join of the three mappings.

D's worker connector knows, for a request: D's logical block ids and P's, one list per group
(the scheduler half lists D's new blocks and all of P's), both engines' kernel blocks per
logical block (D's own, P's from the handshake), and the request's ReadPlan (which P rank
each of D's ranks reads its attention heads from). This module turns that into
{(D rank, P rank): (D descriptors, P descriptors)}:

1. block_mapping.apply_prefix_caching pairs D's kernel blocks with P's, per group, each side's
   ids expanded with its OWN ratio, trimmed for D's prefix-cache hit (the tail) or,
   when the ratios differ, cut to the common kernel count;
2. an attention group's kernel blocks are read as the plan's head spans (tp_mapping.py);
3. a Mamba group's state (one page per request) as the head and group spans of
   mamba_mapping.py, whose P ranks need not be the attention plan's (Mamba heads split over P's
   ranks even where the KV heads are replicated).

Pure functions; every error is a BlockMappingError or TPMappingError naming the cause.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from kvbridge.kv_transfer.read_plan.block_mapping import GroupKind, apply_prefix_caching, group_kind
from kvbridge.kv_transfer.read_plan.mamba_mapping import MambaRankPages, mamba_read_descs
from kvbridge.kv_transfer.read_plan.tp_mapping import Desc, RankBlocks, ReadPlan, TPMappingError
from kvbridge.shape.model_config import Mamba2Config

Descs = dict[tuple[int, int], tuple[list[Desc], list[Desc]]]


@dataclass(frozen=True)
class KVGroups:
    """What D must know of the model's KV cache groups to pair its blocks with P's."""

    kinds: tuple[str, ...]  # KVCacheKind values, one per group, in order
    mamba: Mamba2Config | None = None  # the Mamba layers' mixer, when a group holds Mamba states
    slots: int = 1  # layers per group (states per Mamba page)
    elem_bytes: int = 4  # bytes per cached element

    def __post_init__(self) -> None:
        kinds = tuple(group_kind(k) for k in self.kinds)
        if (GroupKind.MAMBA in kinds) != (self.mamba is not None):
            raise ValueError("a Mamba group needs the Mamba2 config, and only a Mamba group")


def mamba_pages(ranks: Sequence[RankBlocks], ratio: int) -> list[MambaRankPages]:
    """A rank's pages (logical blocks) from its kernel-block layout: `ratio` kernel blocks each."""
    return [MambaRankPages(tp_size=len(ranks), tp_rank=r.kv.tp_rank, base_addr=r.base_addr,
                           page_bytes=r.kv.block_bytes * ratio, num_blocks=r.num_blocks // ratio) for r in ranks]


def request_descs(groups: KVGroups, plan: ReadPlan, local: Sequence[RankBlocks], remote: Sequence[RankBlocks], *,
                  local_ratio: int, remote_ratio: int, local_ids: Sequence[Sequence[int]],
                  remote_ids: Sequence[Sequence[int]], salt: int) -> Descs:
    """Every read of one request, merged per (local rank, remote rank); see the module docstring."""
    kernel = apply_prefix_caching(local_ids, remote_ids, local_ratio=local_ratio, remote_ratio=remote_ratio,
                                  group_kinds=groups.kinds)
    out: Descs = {}

    def add(pair: tuple[int, int], descs: tuple[list[Desc], list[Desc]]) -> None:
        l_all, r_all = out.setdefault(pair, ([], []))
        l_all += descs[0]
        r_all += descs[1]

    for kind, l_ids, r_ids in zip(groups.kinds, kernel.local, kernel.remote):
        if not l_ids:
            continue
        if group_kind(kind) is GroupKind.MAMBA:
            assert groups.mamba is not None
            d_pages, p_pages = mamba_pages(local, local_ratio), mamba_pages(remote, remote_ratio)
            for d in d_pages:
                for p_rank, descs in mamba_read_descs(groups.mamba, groups.slots, groups.elem_bytes, d, p_pages,
                                                      l_ids, r_ids, salt).items():
                    add((d.tp_rank, p_rank), descs)
        else:
            for pair, descs in plan.block_descs(local, remote, l_ids, r_ids).items():
                add(pair, descs)
    if any(len(ld) != len(rd) for ld, rd in out.values()):
        raise TPMappingError("local and remote descriptor lists differ in length")
    return out
