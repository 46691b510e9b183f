"""Multi-head latent attention (MLA, DeepSeek-V2/V3) over the paged KV cache, absorbed form.

The cache keeps, per token and layer, ONE latent entry shared by every query head:
[normalised compressed KV (kv_lora_rank) | rotated rotary key (qk_rope_head_dim)]. Instead
of expanding it into per-head K and V for every context token each step, the up-projection
kv_b_proj is absorbed into the query and the output (DeepSeek-V2 paper, appendix C):

    score_h = q_nope_h . (W_UK_h c) + q_pe_h . k_pe = (W_UK_h^T q_nope_h) . c + q_pe_h . k_pe
    out_h   = W_UV_h (sum_t p_t c_t)

so attention is multi-query attention with one KV "head" of width latent_dim, whose value is
the entry's first kv_lora_rank values. The caller passes queries already absorbed
([T, heads, latent_dim]) and gets back latent outputs ([T, heads, kv_lora_rank]); each query
row attends over its sequence exactly as `PagedAttention` does (same `AttentionMetadata`).

Layout: the model's cache is [blocks, 1, layers, 1, block_size, latent_dim]; layer i is given
the view kv_cache[:, :, i].permute(0, 2, 3, 1, 4) = [blocks, 1, block_size, 1, latent_dim].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvbridge.engine.layers.attention import AttentionMetadata, DecodeGroup, PrefillSeq


class MLAPagedAttention(nn.Module):
    def __init__(self, num_heads: int, kv_lora_rank: int, rope_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.kv_lora_rank = kv_lora_rank
        self.latent_dim = kv_lora_rank + rope_dim
        self.scale = scale

    def forward(self, q: torch.Tensor, entry: torch.Tensor, kv_layer: torch.Tensor,
                attn: AttentionMetadata) -> torch.Tensor:
        """q [T, heads, latent_dim] (absorbed), entry [T, latent_dim] (the new tokens' cache entries),
        kv_layer [blocks, 1, block_size, 1, latent_dim] -> latent outputs [T, heads, kv_lora_rank]."""
        cache = kv_layer[:, 0]  # [blocks, block_size, 1, latent_dim]
        cache.index_put_((attn.slot_blocks, attn.slot_offsets), entry.unsqueeze(1).to(cache.dtype))
        decode = attn.decode
        if decode is not None and decode.token_index is None:
            return self._decode(q, cache, decode)
        out = q.new_empty(q.shape[0], self.num_heads, self.kv_lora_rank)
        if decode is not None:
            out.index_copy_(0, decode.token_index, self._decode(q.index_select(0, decode.token_index), cache, decode))
        for seq in attn.prefills:
            out[seq.start:seq.end] = self._prefill(q, entry, cache, seq)
        return out

    def _decode(self, q: torch.Tensor, cache: torch.Tensor, group: DecodeGroup) -> torch.Tensor:
        num_seqs = q.shape[0]
        block_size = cache.shape[1]
        k = (cache.index_select(0, group.block_index).view(num_seqs, 1, group.max_blocks * block_size,
                                                          self.latent_dim)[:, :, :group.max_context].to(q.dtype))
        # One KV head: the heads ride the query-length axis, so one plain SDPA call serves all.
        out = F.scaled_dot_product_attention(q.unsqueeze(1), k, k[..., :self.kv_lora_rank],
                                             attn_mask=group.mask, scale=self.scale)
        return out.view(num_seqs, self.num_heads, self.kv_lora_rank)

    def _prefill(self, q: torch.Tensor, entry: torch.Tensor, cache: torch.Tensor, seq: PrefillSeq) -> torch.Tensor:
        qs = q[seq.start:seq.end].transpose(0, 1).unsqueeze(0)  # [1, heads, L, latent]
        if seq.block_index is None:
            k = entry[seq.start:seq.end].view(1, 1, -1, self.latent_dim)
            out = F.scaled_dot_product_attention(qs, k, k[..., :self.kv_lora_rank], is_causal=True,
                                                 scale=self.scale, enable_gqa=True)
        else:
            k = (cache.index_select(0, seq.block_index).view(1, 1, -1, self.latent_dim)[:, :, :seq.context_len]
                 .to(q.dtype))
            out = F.scaled_dot_product_attention(qs, k, k[..., :self.kv_lora_rank], attn_mask=seq.mask,
                                                 scale=self.scale, enable_gqa=True)
        return out[0].transpose(0, 1)
