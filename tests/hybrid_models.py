"""Tiny random-weight hybrid and MLA models the parity tests build with `transformers`: a Bamba
(Mamba2 mixers + attention; `HybridSteps` runs it over kvbridge's hybrid KV cache) and DeepSeek
V2/V3 variants (MLA, MoE, YaRN) saved as Hugging Face folders."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from kvbridge.engine.layers.attention import AttentionMetadata
from kvbridge.engine.layers.mamba2 import Mamba2Metadata
from kvbridge.engine.models import CausalLM
from kvbridge.shape.kv_cache_layout import KVCacheLayout, plan_kv_cache_layout
from kvbridge.shape.kv_groups import KVCacheKind, layer_groups
from kvbridge.shape.model_config import ModelArchConfig
from tests.paged_steps import VOCAB

KERNEL_BLOCK = 2
BAMBA_CONFIG = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
              num_key_value_heads=2, attn_layer_indices=[1, 4], mamba_n_heads=4, mamba_d_head=8, mamba_n_groups=1,
              mamba_d_state=4, mamba_d_conv=4, mamba_expand=1, mamba_chunk_size=4, max_position_embeddings=64,
              initializer_range=0.2, attn_implementation="eager")


class HybridSteps:
    """A minimal model runner over a hybrid layout: shuffled logical blocks for the attention
    group (expanded to kernel blocks), one block per Mamba group per sequence, one forward per
    step of (seq -> new tokens); the same interface as tests/paged_steps.PagedSteps."""

    def __init__(self, model: CausalLM, arch: ModelArchConfig, kv_heads: int, tp: int = 1, rank: int = 0,
                 num_blocks: int = 24, dtype: torch.dtype = torch.float32) -> None:
        self.model = model
        self.layout: KVCacheLayout = plan_kv_cache_layout(arch, KERNEL_BLOCK, num_blocks, kv_heads, tp, rank)
        self.kv_cache = self.layout.allocate(dtype, "cpu").zero_()
        model.bind_kv_cache_layout(self.layout)
        self.mamba = [g.kind is KVCacheKind.MAMBA for g in layer_groups(arch)]
        self.free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0)).tolist()
        self.tables: dict[str, list[list[int]]] = {}
        self.tokens: dict[str, list[int]] = {}

    def step(self, new_tokens: dict[str, list[int]]) -> dict[str, torch.Tensor]:
        bs = self.layout.logical_block_size
        query_lens, context_lens, ids, positions = [], [], [], []
        per_group: list[list[list[int]]] = [[] for _ in self.mamba]
        for seq, toks in new_tokens.items():
            done = len(self.tokens.setdefault(seq, []))
            tables = self.tables.setdefault(seq, [[] for _ in self.mamba])
            for table, mamba in zip(tables, self.mamba):
                want = 1 if mamba else -(-(done + len(toks)) // bs)
                while len(table) < want:
                    table.append(self.free.pop())
            self.tokens[seq].extend(toks)
            query_lens.append(len(toks))
            context_lens.append(done + len(toks))
            ids.extend(toks)
            positions.extend(range(done, done + len(toks)))
            for g, table in enumerate(tables):
                per_group[g].append(table)
        metas = [Mamba2Metadata.from_context(query_lens, context_lens, [t[0] for t in tables])
                 if mamba else
                 AttentionMetadata.build(query_lens, context_lens, [self.layout.kernel_block_ids(t) for t in tables],
                                         KERNEL_BLOCK, "cpu")
                 for tables, mamba in zip(per_group, self.mamba)]
        logits = self.model.compute_logits(self.model(torch.tensor(ids), torch.tensor(positions), metas,
                                                      self.kv_cache))
        out, start = {}, 0
        for seq, n in zip(new_tokens, query_lens):
            out[seq] = logits[start:start + n]
            start += n
        return out


_YARN = dict(type="yarn", factor=4.0, original_max_position_embeddings=16, beta_fast=32, beta_slow=1,
             mscale=0.707, mscale_all_dim=0.707)
_SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=8,
              qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
              max_position_embeddings=64, rope_scaling=_YARN, initializer_range=0.2, attn_implementation="eager")
DEEPSEEK_VARIANTS = {
    "v2_moe_qlora": lambda: transformers.DeepseekV2Config(
        **_SHAPE, q_lora_rank=24, first_k_dense_replace=1, topk_method="group_limited_greedy", n_group=4,
        topk_group=2),
    "v2_dense": lambda: transformers.DeepseekV2Config(**_SHAPE, q_lora_rank=None, first_k_dense_replace=3),
    "v3_moe_qlora": lambda: transformers.DeepseekV3Config(
        **_SHAPE, q_lora_rank=24, first_k_dense_replace=1, n_group=4, topk_group=2, routed_scaling_factor=2.5),
    "v3_moe_plain_rope": lambda: transformers.DeepseekV3Config(
        **_SHAPE, q_lora_rank=None, first_k_dense_replace=2, n_group=2, topk_group=1, rope_interleave=False),
    "v3_dense_qlora": lambda: transformers.DeepseekV3Config(**_SHAPE, q_lora_rank=24, first_k_dense_replace=3),
}


def make_deepseek_folder(variant: str, folder: Path) -> Path:
    """The variant's seeded random model saved as a Hugging Face folder (idempotent)."""
    if (folder / "config.json").is_file():
        return folder
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(DEEPSEEK_VARIANTS[variant]()).eval()
    with torch.no_grad():
        for name, buf in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):  # zero by default: make it matter
                buf.normal_(0.0, 0.1)
    hf.save_pretrained(folder)
    return folder
