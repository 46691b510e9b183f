"""Multi-head latent attention (MLA, DeepSeek-V2/V3) over the paged KV cache.

The cache keeps, per token and layer, ONE latent entry shared by every query head:
[normalised compressed KV (kv_lora_rank) | rotated rotary key (qk_rope_head_dim)]. The
up-projection kv_b_proj turns a latent into per-head keys (W_UK) and values (W_UV). Two
ways to attend, each where it is cheaper (as vLLM does):

- **Decode: absorbed** (DeepSeek-V2 paper, appendix C). W_UK is folded into the query and
  W_UV into the output:

      score_h = q_nope_h . (W_UK_h c) + q_pe_h . k_pe = (W_UK_h^T q_nope_h) . c + q_pe_h . k_pe
      out_h   = W_UV_h (sum_t p_t c_t)

  so one query token attends over the cached latents themselves: multi-query attention
  with one KV "head" of width latent_dim whose value is the entry's first kv_lora_rank
  values, one SDPA call for every decode sequence of the step, and nothing per context
  token is expanded. Cost per token: context x heads x latent_dim.
- **Prefill: expanded.** A chunk of L queries over a context of C tokens expands the C
  latents once through kv_b_proj into per-head keys (qk_nope + rotary) and values, then
  attends with ordinary multi-head SDPA: C x heads x (nope + v) x kv_lora_rank to expand
  plus L x C x heads x (qk_head_dim + v_head_dim) to attend, against L x C x heads x
  (latent_dim + kv_lora_rank) absorbed: about 3x less for DeepSeek's shapes once L is large.

Layout: the model's cache is [blocks, 1, layers, 1, block_size, latent_dim]; layer i is given
the view kv_cache[:, :, i].permute(0, 2, 3, 1, 4) = [blocks, 1, block_size, 1, latent_dim].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvbridge.engine.layers.attention import AttentionMetadata, DecodeGroup, PrefillSeq
from kvbridge.engine.layers.shape_buckets import prefill_sdpa


class MLAPagedAttention(nn.Module):
    def __init__(self, num_heads: int, kv_lora_rank: int, qk_nope_head_dim: int, rope_dim: int, v_head_dim: int,
                 scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.kv_lora_rank = kv_lora_rank
        self.nope = qk_nope_head_dim
        self.v_head_dim = v_head_dim
        self.latent_dim = kv_lora_rank + rope_dim
        self.scale = scale

    def forward(self, q_nope: torch.Tensor, q_pe: torch.Tensor, entry: torch.Tensor, kv_layer: torch.Tensor,
                attn: AttentionMetadata, kv_b_proj: nn.Module, w_uk: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
        """q_nope [T, heads, nope], q_pe [T, heads, rope] (rotated), entry [T, latent_dim] (the new
        tokens' cache entries), kv_layer [blocks, 1, block_size, 1, latent_dim]; kv_b_proj the
        latent -> per-head [nope | v] projection, w_uk [heads, nope, lora] and w_uv [heads, v, lora]
        its parts -> [T, heads, v_head_dim]."""
        cache = kv_layer[:, 0]  # [blocks, block_size, 1, latent_dim]
        cache.index_put_((attn.slot_blocks, attn.slot_offsets), entry.unsqueeze(1).to(cache.dtype))
        decode = attn.decode
        if decode is not None and decode.token_index is None:
            return self._decode(q_nope, q_pe, cache, decode, w_uk, w_uv)
        out = q_nope.new_empty(q_nope.shape[0], self.num_heads, self.v_head_dim)
        if decode is not None:
            rows = decode.token_index
            assert rows is not None  # (every token a decode: returned above)
            out.index_copy_(0, rows, self._decode(q_nope.index_select(0, rows), q_pe.index_select(0, rows), cache,
                                                  decode, w_uk, w_uv))
        for seq in attn.prefills:
            out[seq.start:seq.end] = self._prefill(q_nope, q_pe, entry, cache, seq, kv_b_proj)
        return out

    def _decode(self, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, group: DecodeGroup,
                w_uk: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
        num_seqs = q_nope.shape[0]
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [Bd, heads, lora]
        q = torch.cat((q_latent, q_pe), dim=-1)  # [Bd, heads, latent]
        block_size = cache.shape[1]
        k = (cache.index_select(0, group.block_index.flatten())
             .view(num_seqs, 1, group.max_blocks * block_size, self.latent_dim)[:, :, :group.max_context].to(q.dtype))
        # One KV head: the heads ride the query-length axis, so one plain SDPA call serves all.
        out = F.scaled_dot_product_attention(q.unsqueeze(1), k, k[..., :self.kv_lora_rank],
                                             attn_mask=group.mask, scale=self.scale)
        out = out.view(num_seqs, self.num_heads, self.kv_lora_rank)
        return torch.bmm(out.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [Bd, heads, v]

    def _prefill(self, q_nope: torch.Tensor, q_pe: torch.Tensor, entry: torch.Tensor, cache: torch.Tensor,
                 seq: PrefillSeq, kv_b_proj: nn.Module) -> torch.Tensor:
        if seq.block_index is None:
            ctx = entry[seq.start:seq.end]
        else:
            ctx = (cache.index_select(0, seq.block_index).view(-1, self.latent_dim)[:seq.context_len]
                   .to(q_nope.dtype))
        kv = kv_b_proj(ctx[:, :self.kv_lora_rank]).view(-1, self.num_heads, self.nope + self.v_head_dim)
        k_pe = ctx[:, None, self.kv_lora_rank:].expand(-1, self.num_heads, -1)
        k = torch.cat((kv[..., :self.nope], k_pe), dim=-1).transpose(0, 1).unsqueeze(0)  # [1, heads, C, qk]
        v = kv[..., self.nope:].transpose(0, 1).unsqueeze(0)  # [1, heads, C, v]
        q = torch.cat((q_nope[seq.start:seq.end], q_pe[seq.start:seq.end]), dim=-1).transpose(0, 1).unsqueeze(0)
        out = prefill_sdpa(q, k, v, seq.mask, scale=self.scale, mask_cache=seq.padded_masks)
        return out[0].transpose(0, 1)  # [L, heads, v]
