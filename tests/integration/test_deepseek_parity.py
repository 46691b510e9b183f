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
from tests.paged_steps import ATOL, VOCAB, PagedSteps, prompt
from tests.tp_ranks import join_gloo, leave_gloo, load_folder, paged_scenario

_YARN = dict(type="yarn", factor=4.0, original_max_position_embeddings=16, beta_fast=32, beta_slow=1,
             mscale=0.707, mscale_all_dim=0.707)
_SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=8,
              qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
              max_position_embeddings=64, rope_scaling=_YARN, initializer_range=0.2, attn_implementation="eager")
VARIANTS = {
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


def make_folder(variant: str, folder: Path) -> Path:
    """The variant's seeded random model saved as a Hugging Face folder (idempotent)."""
    if (folder / "config.json").is_file():
        return folder
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(VARIANTS[variant]()).eval()
    with torch.no_grad():
        for name, buf in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):  # zero by default: make it matter
                buf.normal_(0.0, 0.1)
    hf.save_pretrained(folder)
    return folder


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
