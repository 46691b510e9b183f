"""Paged attention over a block-structured KV cache, with torch's scaled_dot_product_attention.

One step's batch is flattened sequence-major into T tokens. `AttentionMetadata` describes it
and precomputes, once per step, every index and mask tensor the layers need, so each layer
does no Python work beyond a loop over prefill sequences:

- sequences with one new token (decode) are attended together in one call per layer: on CPU
  in fp32 or bf16 by kvbridge's kernel that reads K/V in place from the cache's blocks
  (cpu_kernels.paged_decode_attention: each byte of K/V read once, nothing copied); elsewhere
  (CUDA, fp16, or without the kernels) by ONE padded SDPA call over K/V gathered block by
  block from the cache, with a boolean padding mask;
- sequences with several new tokens (prefill, or a prefill chunk) are attended causally over
  the new K/V when they start at position 0: in bf16 on a CPU with AMX or AVX-512 BF16 all of a
  step's such prompts in one call per layer (cpu_kernels.prefill_attention_bf16_, written straight
  into the step's output rows), in fp32 on CPU one by one by kvbridge's tiled kernel
  (cpu_kernels.prefill_attention), elsewhere one SDPA call each; a chunk after tokens computed
  before attends one by one over its whole context read back from the cache with a causal mask
  shifted by those tokens.

KV cache layout (fixed by the transfer code, which copies whole blocks or head slices of
them): one tensor [num_blocks, num_kv_heads, num_layers, 2, block_size, head_dim],
block-major so that one block of every layer is one contiguous span and a run of blocks
moves as one descriptor, head-major within a block so that a run of heads is one span.
Layer i gets the strided view kv_cache[:, :, i].permute(0, 2, 3, 1, 4) = [num_blocks, 2,
block_size, kv_heads, head_dim], index 0 = K, 1 = V.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from kvbridge.engine.layers import cpu_kernels
from kvbridge.engine.layers.shape_buckets import prefill_sdpa


@dataclass(frozen=True)
class DecodeGroup:
    """The step's decode sequences (one new token each), attended by one padded SDPA call."""

    token_index: torch.Tensor | None  # [Bd] rows of the step's tokens; None = all T tokens, in order
    block_index: torch.Tensor  # [Bd, max_blocks] each sequence's blocks, padded with its first block
    max_blocks: int
    max_context: int  # keys per sequence after dropping the padded tail of the last block
    mask: torch.Tensor | None  # [Bd, 1, 1, max_context], True = attend; None when nothing is padding
    context_lens: torch.Tensor  # [Bd] int64: keys of each sequence (the in-place CPU kernel's bound)
    sliding_window: int | None
    _head_block_index: dict[int, torch.Tensor] = field(default_factory=dict, repr=False, compare=False)

    def head_block_index(self, kv_heads: int) -> torch.Tensor:
        """[Bd * kv_heads * max_blocks]: row `block * kv_heads + head` of a [blocks * kv_heads,
        block_size, head_dim] view of one layer's K (or V), sequence-major, then head, then block:
        gathered rows are SDPA's [Bd, kv_heads, keys, head_dim] with no second copy. Built once
        per step (every layer of a model has the same KV heads)."""
        index = self._head_block_index.get(kv_heads)
        if index is None:
            heads = torch.arange(kv_heads, device=self.block_index.device)
            index = (self.block_index[:, None, :] * kv_heads + heads[None, :, None]).flatten()
            self._head_block_index[kv_heads] = index
        return index


@dataclass(frozen=True)
class PrefillSeq:
    """One sequence with several new tokens (rows start:end of the step)."""

    start: int
    end: int
    context_len: int
    # None when the sequence starts at position 0: it attends over its new K/V only.
    block_index: torch.Tensor | None  # [ceil(context_len / block_size)]
    # [1, 1, query_len, context_len], True = attend; None: plain causal over the new K/V.
    mask: torch.Tensor | None
    # The mask grown to bucketed lengths (shape_buckets.prefill_sdpa), made by the first layer.
    padded_masks: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict, repr=False, compare=False)

    @property
    def own_kv_only(self) -> bool:
        """Plain causal attention over its own new K/V (a fresh prompt, no window mask)."""
        return self.block_index is None and self.mask is None


@dataclass
class AttentionMetadata:
    """One step's batch, flattened sequence-major: sequence i owns tokens query_start_loc[i]:query_start_loc[i+1].

    Built by the model runner once per step (`build` computes slot_mapping from the block
    tables); the derived fields are filled in `__post_init__` on slot_mapping's device.
    Raises ValueError when the fields are inconsistent.
    """

    query_start_loc: list[int]  # len B+1
    context_lens: list[int]  # per seq: tokens in its KV after this step (computed before + new)
    block_tables: list[list[int]]  # per seq: the block ids holding its KV, in order (cover context_lens)
    slot_mapping: torch.Tensor  # int64 [T]: block_id * block_size + offset of each new token
    block_size: int
    # Sliding-window layers: a query at position p sees keys (p - sliding_window, p] only; the
    # block-table entries wholly behind every query's window may be any block (the null block).
    sliding_window: int | None = None
    decode: DecodeGroup | None = field(init=False)
    prefills: list[PrefillSeq] = field(init=False)
    slot_blocks: torch.Tensor = field(init=False)  # [T] block of each new token's slot
    slot_offsets: torch.Tensor = field(init=False)  # [T] offset of each new token within its block

    @classmethod
    def build(cls, query_lens: list[int], context_lens: list[int], block_tables: list[list[int]],
              block_size: int, device: torch.device | str, sliding_window: int | None = None) -> AttentionMetadata:
        """Metadata for sequences computing query_lens[i] new tokens that end at context_lens[i]."""
        if not (len(query_lens) == len(context_lens) == len(block_tables)):
            raise ValueError("query_lens, context_lens and block_tables must have one entry per sequence")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        starts = [0]
        slots: list[int] = []
        for q_len, ctx, table in zip(query_lens, context_lens, block_tables):
            starts.append(starts[-1] + q_len)
            _check_sequence(q_len, ctx, table, block_size)
            slots.extend(table[p // block_size] * block_size + p % block_size for p in range(ctx - q_len, ctx))
        slot_mapping = torch.tensor(slots, dtype=torch.int64).to(device)
        return cls(starts, list(context_lens), [list(t) for t in block_tables], slot_mapping, block_size,
                   sliding_window)

    @functools.cached_property
    def fresh_prefills(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The prefills over their own new K/V only, as [n] int64 CPU starts and lengths: what the
        bf16 prefill kernel attends in one call per layer (made by the first layer that asks). None: none."""
        fresh = [p for p in self.prefills if p.own_kv_only]
        if not fresh:
            return None
        return (torch.tensor([p.start for p in fresh], dtype=torch.int64),
                torch.tensor([p.end - p.start for p in fresh], dtype=torch.int64))

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc[-1]

    @property
    def is_pure_decode(self) -> bool:
        return not self.prefills

    def __post_init__(self) -> None:
        self._validate()
        device = self.slot_mapping.device
        decode_seqs: list[int] = []
        prefills: list[PrefillSeq] = []
        for i, ctx in enumerate(self.context_lens):
            start, end = self.query_start_loc[i], self.query_start_loc[i + 1]
            if end - start == 1:
                decode_seqs.append(i)
            else:
                prefills.append(self._prefill_seq(start, end, ctx, self.block_tables[i], device))
        self.prefills = prefills
        self.decode = self._decode_group(decode_seqs, device) if decode_seqs else None
        self.slot_blocks = torch.div(self.slot_mapping, self.block_size, rounding_mode="floor")
        self.slot_offsets = self.slot_mapping - self.slot_blocks * self.block_size

    def _validate(self) -> None:
        num_seqs = len(self.context_lens)
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if len(self.query_start_loc) != num_seqs + 1 or len(self.block_tables) != num_seqs:
            raise ValueError(f"query_start_loc needs {num_seqs + 1} entries and block_tables {num_seqs}, "
                             f"got {len(self.query_start_loc)} and {len(self.block_tables)}")
        if num_seqs == 0 or self.query_start_loc[0] != 0:
            raise ValueError("a step needs at least one sequence and query_start_loc[0] == 0")
        for i in range(num_seqs):
            q_len = self.query_start_loc[i + 1] - self.query_start_loc[i]
            _check_sequence(q_len, self.context_lens[i], self.block_tables[i], self.block_size)
        if tuple(self.slot_mapping.shape) != (self.num_tokens,) or self.slot_mapping.dtype != torch.int64:
            raise ValueError(f"slot_mapping must be int64 of shape ({self.num_tokens},), "
                             f"got {self.slot_mapping.dtype} {tuple(self.slot_mapping.shape)}")

    def _prefill_seq(self, start: int, end: int, ctx: int, table: list[int],
                     device: torch.device) -> PrefillSeq:
        q_len = end - start
        window = self.sliding_window
        if ctx == q_len and (window is None or q_len <= window):
            return PrefillSeq(start, end, ctx, None, None)  # plain causal over the new K/V
        # Query i sits at absolute position (ctx - q_len + i) and sees every key up to it
        # (and, in a sliding window, none `window` or more positions behind it).
        query_pos = torch.arange(ctx - q_len, ctx)[:, None]
        keys = torch.arange(ctx)[None, :]
        mask = keys <= query_pos
        if window is not None:
            mask &= keys > query_pos - window
        mask = mask.view(1, 1, q_len, ctx).to(device)
        if ctx == q_len:
            return PrefillSeq(start, end, ctx, None, mask)  # over the new K/V, window-masked
        num_blocks = -(-ctx // self.block_size)
        block_index = torch.tensor(table[:num_blocks], dtype=torch.int64)
        return PrefillSeq(start, end, ctx, block_index.to(device), mask)

    def _decode_group(self, seqs: list[int], device: torch.device) -> DecodeGroup:
        ctxs = [self.context_lens[i] for i in seqs]
        max_context = max(ctxs)
        max_blocks = -(-max_context // self.block_size)
        blocks: list[int] = []
        for i, ctx in zip(seqs, ctxs):
            table = self.block_tables[i][:-(-ctx // self.block_size)]
            blocks.extend(table + [table[0]] * (max_blocks - len(table)))
        mask = None
        window = self.sliding_window
        if min(ctxs) != max_context or (window is not None and max_context > window):
            keys = torch.arange(max_context)[None, :]
            ends = torch.tensor(ctxs)[:, None]
            visible = keys < ends
            if window is not None:
                visible &= keys >= ends - window
            mask = visible.view(len(seqs), 1, 1, max_context).to(device)
        token_index = None
        if len(seqs) != len(self.context_lens):
            token_index = torch.tensor([self.query_start_loc[i] for i in seqs], dtype=torch.int64).to(device)
        block_index = torch.tensor(blocks, dtype=torch.int64).view(len(seqs), max_blocks).to(device)
        context_lens = torch.tensor(ctxs, dtype=torch.int64).to(device)
        return DecodeGroup(token_index, block_index, max_blocks, max_context, mask, context_lens, window)


def _check_sequence(q_len: int, ctx: int, table: list[int], block_size: int) -> None:
    if q_len < 1:
        raise ValueError(f"every sequence needs at least one new token, got query_len {q_len}")
    if ctx < q_len:
        raise ValueError(f"context_len {ctx} is smaller than query_len {q_len}")
    if len(table) * block_size < ctx:
        raise ValueError(f"{len(table)} blocks of {block_size} cannot hold a context of {ctx} tokens")


class PagedAttention(nn.Module):
    """Writes the step's K/V into one layer's cache, then attends each query over its context.

    `fold_gqa_decode` picks how decode handles grouped-query attention: False passes
    enable_gqa to SDPA (fastest on CPU); True folds each KV head's query heads into the
    query-length axis, which keeps CUDA on its fused kernels when a padding mask is present.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, fold_gqa_decode: bool) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.fold_gqa_decode = fold_gqa_decode
        self.in_place_decode = True  # the CPU kernel where it applies; False: always gather + SDPA

    def reads_in_place(self, q: torch.Tensor, kv_layer: torch.Tensor) -> bool:
        """Decode reads K/V in place (cpu_kernels) for fp32 or bf16 on CPU when the kernels are built."""
        return self.in_place_decode and cpu_kernels.decode_applies(q, kv_layer)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor,
                attn: AttentionMetadata) -> torch.Tensor:
        """q [T, heads, D], k/v [T, kv_heads, D], kv_layer [blocks, 2, block_size, kv_heads, D] (a strided
        view of the block-major cache) -> [T, heads*D]."""
        if cpu_kernels.elementwise_applies(kv_layer, k, v):
            cpu_kernels.ops().write_kv_(kv_layer, k, v, attn.slot_mapping)  # one pass, no index tensors
        else:
            where = (attn.slot_blocks, attn.slot_offsets)
            kv_layer[:, 0].index_put_(where, k.to(kv_layer.dtype))
            kv_layer[:, 1].index_put_(where, v.to(kv_layer.dtype))
        decode = attn.decode
        if decode is not None and decode.token_index is None:
            return self._decode(q, kv_layer, decode)
        fresh = attn.fresh_prefills if attn.prefills and cpu_kernels.bf16_prefill_applies(q) else None
        fused = fresh is not None
        if decode is None and len(attn.prefills) == 1 and not fused:
            return self._prefill(q, k, v, kv_layer, attn.prefills[0])
        out = q.new_empty(q.shape[0], self.num_heads * self.head_dim)
        if decode is not None:
            rows = decode.token_index
            assert rows is not None  # (every token a decode: returned above)
            out.index_copy_(0, rows, self._decode(q.index_select(0, rows), kv_layer, decode))
        if fresh is not None:  # every fresh prompt in one call, straight into its rows of out
            starts, lens = fresh
            cpu_kernels.prefill_attention_bf16_(out, q, k, v, starts, lens, self.head_dim ** -0.5)
        for seq in attn.prefills:
            if not (fused and seq.own_kv_only):
                out[seq.start:seq.end] = self._prefill(q, k, v, kv_layer, seq)
        return out

    def _decode(self, q: torch.Tensor, kv_layer: torch.Tensor, group: DecodeGroup) -> torch.Tensor:
        num_seqs = q.shape[0]
        if self.reads_in_place(q, kv_layer):
            return cpu_kernels.paged_decode_attention(q, kv_layer, group.block_index, group.context_lens,
                                                      group.sliding_window, self.head_dim ** -0.5
                                                      ).view(num_seqs, self.num_heads * self.head_dim)
        _, _, block_size, kv_heads, head_dim = kv_layer.shape
        # The cache's own order, [blocks, kv_heads, 2, block_size, D]: one (block, head) of K is one
        # contiguous [block_size, D] run, so gathering runs in (sequence, head, block) order gives
        # K and V directly as [Bd, kv_heads, keys, D] (view() raises if the layout is not the cache's).
        by_head = kv_layer.permute(0, 3, 1, 2, 4)
        index = group.head_block_index(kv_heads)
        k, v = (by_head[:, :, i].view(-1, block_size, head_dim).index_select(0, index)
                .view(num_seqs, kv_heads, -1, head_dim)[:, :, :group.max_context].to(q.dtype) for i in (0, 1))
        if self.fold_gqa_decode:
            group_size = self.num_heads // kv_heads
            out = F.scaled_dot_product_attention(q.view(num_seqs, kv_heads, group_size, head_dim), k, v,
                                                 attn_mask=group.mask)
        else:
            out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=group.mask,
                                                 enable_gqa=kv_heads != self.num_heads)
        return out.reshape(num_seqs, self.num_heads * head_dim)

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor,
                 seq: PrefillSeq) -> torch.Tensor:
        qs = q[seq.start:seq.end].transpose(0, 1).unsqueeze(0)  # [1, heads, L, D]
        gqa = self.num_kv_heads != self.num_heads
        if (seq.own_kv_only and self.head_dim in cpu_kernels.PREFILL_HEAD_DIMS
                and cpu_kernels.applies(q, k, v)):
            out = cpu_kernels.prefill_attention(q[seq.start:seq.end], k[seq.start:seq.end], v[seq.start:seq.end],
                                                self.head_dim ** -0.5)
            return out.view(seq.end - seq.start, self.num_heads * self.head_dim)
        if seq.block_index is None:
            ks = k[seq.start:seq.end].transpose(0, 1).unsqueeze(0)
            vs = v[seq.start:seq.end].transpose(0, 1).unsqueeze(0)
        else:
            ks, vs = (kv_layer[:, i].index_select(0, seq.block_index)
                      .view(-1, self.num_kv_heads, self.head_dim)[:seq.context_len].transpose(0, 1).unsqueeze(0)
                      .to(q.dtype) for i in (0, 1))
        out = prefill_sdpa(qs, ks, vs, seq.mask, enable_gqa=gqa, mask_cache=seq.padded_masks)
        return out[0].transpose(0, 1).reshape(seq.end - seq.start, self.num_heads * self.head_dim)
