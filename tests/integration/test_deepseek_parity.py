"""DeepSeek-V2/V3 (MLA, MoE, YaRN) over the paged latent cache computes the logits of
Hugging Face `transformers`, unsplit and split over 2 real gloo ranks.

Tiny random-weight models are built with `transformers`, saved as Hugging Face folders in
the test's temporary directory and read back through kvbridge's loader (config.json ->
ModelArchConfig, safetensors -> weights), so the loader's DeepSeek path is under test too.
Variants: V2 with MoE (group-limited routing) and q LoRA; V2 dense without q LoRA; V3 with
MoE (sigmoid routing with a non-zero correction bias) with and without q LoRA, one of them
without interleaved rotary dims; V3 dense with q LoRA. The scenario (tests/integration/test_tp_parity.py) mixes a
whole prefill, a chunked prefill and batched decodes over shuffled blocks of 4 tokens, so
every prompt spans several blocks.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
import transformers

from kvbridge.engine.models.deepseek import deinterleave_rows
from tests.hybrid_models import DEEPSEEK_VARIANTS as VARIANTS
from tests.hybrid_models import make_deepseek_folder as make_folder
from tests.paged_steps import ATOL, PagedSteps, prompt
from tests.tp_ranks import join_gloo, leave_gloo, load_folder, paged_scenario

@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("deepseek")
    return {v: make_folder(v, root / v) for v in VARIANTS}


def reference(folder: Path, tokens: torch.Tensor) -> torch.Tensor:
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    with torch.no_grad():
        return hf(input_ids=tokens[None]).logits[0].float()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_then_decode_over_blocks_matches_transformers(folders, variant: str) -> None:
    arch, model, _ = load_folder(folders[variant])
    assert arch.use_mla and (arch.moe is not None) == ("moe" in variant)
    assert (arch.mla.q_lora_rank is not None) == ("qlora" in variant)
    got = paged_scenario(PagedSteps(model, arch))
    for seq in ("a", "b"):
        torch.testing.assert_close(got[seq], reference(folders[variant], got[f"{seq}_tokens"]), atol=ATOL, rtol=0)


def test_cache_holds_one_latent_per_token_the_size_the_config_says(folders) -> None:
    arch, model, _ = load_folder(folders["v2_moe_qlora"])
    steps = PagedSteps(model, arch)
    steps.step({"a": prompt(9, seed=4)})
    # [blocks, 1 latent head, layers, 1 entry, block_size, kv_lora_rank + qk_rope_head_dim]
    assert steps.kv_cache.shape[1:4] == (1, arch.num_layers, 1) and steps.kv_cache.shape[5] == 16 + 4
    assert arch.kv_bytes_per_token == arch.num_layers * (16 + 4) * 4
    used = {steps.tables["a"][p // 4] for p in range(9)}
    written = {b for b in range(steps.kv_cache.shape[0]) if steps.kv_cache[b].abs().sum() > 0}
    assert written == used


def _rank(rank: int, world: int, store: str, folders: dict[str, str], out: str) -> None:
    all_reduce = join_gloo(rank, world, store)
    results = {}
    for variant, folder in folders.items():
        arch, model, _ = load_folder(Path(folder), world, rank, all_reduce)
        # Every rank caches the whole latent: one replicated "KV head".
        results[variant] = paged_scenario(PagedSteps(model, arch, num_kv_heads=1))
    if rank == 0:
        torch.save(results, out)
    leave_gloo()


def test_tp2_split_heads_and_experts_compute_the_unsplit_logits(folders, tmp_path: Path) -> None:
    out = tmp_path / "logits.pt"
    mp.spawn(_rank, args=(2, str(tmp_path / "store"), {v: str(f) for v, f in folders.items()}, str(out)),
             nprocs=2, join=True)
    got = torch.load(out)
    for variant, folder in folders.items():
        arch, model, _ = load_folder(folder)
        whole = paged_scenario(PagedSteps(model, arch))
        for seq in ("a", "b"):
            assert torch.equal(got[variant][f"{seq}_tokens"], whole[f"{seq}_tokens"])  # same greedy path
            torch.testing.assert_close(got[variant][seq], whole[seq], atol=ATOL, rtol=0)
            torch.testing.assert_close(got[variant][seq], reference(folder, whole[f"{seq}_tokens"]), atol=ATOL, rtol=0)


@pytest.mark.parametrize("rows,rope,group,offset", [(8, 4, 8, 4), (24, 4, 12, 8), (6, 2, 6, 0), (20, 4, 20, 16)])
def test_deinterleave_rows_turns_pairs_into_halves_in_every_group(rows, rope, group, offset) -> None:
    order = deinterleave_rows(rows, rope, group, offset).tolist()
    assert sorted(order) == list(range(rows))
    for g in range(0, rows, group):
        assert order[g:g + offset] == list(range(g, g + offset))  # rows before the rotary part stay
        assert order[g + offset:g + offset + rope] == ([g + offset + i for i in range(0, rope, 2)]
                                                       + [g + offset + i for i in range(1, rope, 2)])
        assert order[g + offset + rope:g + group] == list(range(g + offset + rope, g + group))
    with pytest.raises(ValueError):
        deinterleave_rows(rows + 1, rope, group, offset)
