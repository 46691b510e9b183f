"""Bamba (Mamba2 mixers + attention layers) over kvbridge's hybrid KV cache computes the logits
of Hugging Face `transformers`, unsplit and split over 2 real gloo ranks.

A tiny random-weight Bamba is saved as a Hugging Face folder and read back through kvbridge's
loader. Its 6 layers (attention at 1 and 4) form three KV cache groups of 2 layers: Mamba
[0, 2], attention [1, 4], Mamba [3, 5], so a Mamba page holds two layers' states. Kernel
blocks of 2 tokens; a logical block is 4 of them at TP 1 and 5 at TP 2 (shape/kv_cache_layout.py),
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

from kvbridge.shape.kv_cache_layout import plan_kv_cache_layout
from kvbridge.shape.kv_groups import KVCacheKind, layer_groups
from tests.hybrid_models import BAMBA_CONFIG as CONFIG
from tests.hybrid_models import KERNEL_BLOCK, HybridSteps
from tests.paged_steps import ATOL
from tests.tp_ranks import join_gloo, leave_gloo, load_folder, paged_scenario

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
