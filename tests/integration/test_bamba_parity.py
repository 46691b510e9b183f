"""Bamba (Mamba2 mixers + attention layers) over kvbridge's hybrid KV cache computes the logits
of Hugging Face `transformers`, unsplit and split over 2 real gloo ranks.

A tiny random-weight Bamba is saved as a Hugging Face folder and read back through kvbridge's
loader. Its 6 layers (attention at 1 and 4) form three KV cache groups of 2 layers: Mamba
[0, 2], attention [1, 4], Mamba [3, 5], so a Mamba page holds two layers' states. Kernel
blocks of 2 tokens; a logical block is 4 of them at TP 1 and 5 at TP 2 (spec/kv_cache_layout.py),
so the prompts span several logical and kernel blocks. The scenario (test_tp_parity.scenario)
mixes a whole prefill, a chunked prefill (its second chunk starting from the carried state)
and batched decodes, over shuffled logical blocks.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
import transformers

from kvbridge.engine.layers.attention import AttentionMetadata
from kvbridge.engine.layers.mamba2 import Mamba2Metadata
from kvbridge.engine.models import CausalLM
from kvbridge.spec.kv_cache_layout import KVCacheLayout, plan_kv_cache_layout
from kvbridge.spec.kv_groups import KVCacheKind, layer_groups
from kvbridge.spec.model_config import ModelArchConfig
from tests.paged_steps import ATOL, VOCAB
from tests.tp_ranks import join_gloo, leave_gloo, load_folder, paged_scenario

KERNEL_BLOCK = 2
CONFIG = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
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


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("bamba") / "tiny"
    torch.manual_seed(0)
    transformers.BambaForCausalLM(transformers.BambaConfig(**CONFIG)).eval().save_pretrained(folder)
    return folder


def reference(folder: Path, tokens: torch.Tensor) -> torch.Tensor:
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    with torch.no_grad():
        return hf(input_ids=tokens[None]).logits[0].float()


def test_the_groups_and_ratios_are_the_ones_the_docstring_names(folder: Path) -> None:
    arch, _, _ = load_folder(folder)
    assert [(g.kind, g.layer_ids) for g in layer_groups(arch)] == [
        (KVCacheKind.MAMBA, (0, 2)), (KVCacheKind.FULL_ATTENTION, (1, 4)), (KVCacheKind.MAMBA, (3, 5))]
    assert plan_kv_cache_layout(arch, KERNEL_BLOCK, 8, 2).blocks_per_logical == 4
    assert plan_kv_cache_layout(arch, KERNEL_BLOCK, 8, 1, tp_size=2).blocks_per_logical == 5


def test_prefill_chunks_and_decodes_over_hybrid_blocks_match_transformers(folder: Path) -> None:
    arch, model, _ = load_folder(folder)
    got = paged_scenario(HybridSteps(model, arch, kv_heads=2))
    for seq in ("a", "b"):
        torch.testing.assert_close(got[seq], reference(folder, got[f"{seq}_tokens"]), atol=ATOL, rtol=0)


def _rank(rank: int, world: int, store: str, folder: str, out: str) -> None:
    all_reduce = join_gloo(rank, world, store)
    arch, model, shard = load_folder(Path(folder), world, rank, all_reduce)
    result = paged_scenario(HybridSteps(model, arch, kv_heads=shard.num_kv_heads, tp=world, rank=rank))
    if rank == 0:
        torch.save(result, out)
    leave_gloo()


def test_tp2_split_mamba_heads_and_attention_compute_the_unsplit_logits(folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "logits.pt"
    mp.spawn(_rank, args=(2, str(tmp_path / "store"), str(folder), str(out)), nprocs=2, join=True)
    got = torch.load(out)
    for seq in ("a", "b"):
        torch.testing.assert_close(got[seq], reference(folder, got[f"{seq}_tokens"]), atol=ATOL, rtol=0)
