"""Tensor-parallel model parity: the Llama family split over 2 and 4 real gloo ranks computes
the logits of the unsplit model and of Hugging Face `transformers` (fp32 tolerance).

Each rank is a process (torch.multiprocessing, spawn) holding its shard (column-parallel
Q/K/V and gate/up, row-parallel o_proj and down_proj summed with torch.distributed's
all_reduce; at TP 4 the 2 KV heads are replicated on 2 ranks each) and its own paged KV
cache. The scenario mixes a whole prefill, a chunked prefill and batched decodes over
shuffled blocks; rank 0 writes the logits it computed for the test to compare.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from kvbridge.engine.models import build_model
from kvbridge.engine.tp import rank_shard
from tests.tp_ranks import join_gloo, leave_gloo
from tests.unit.test_model_parity import ATOL, HF_CONFIGS, PagedSteps, arch_from_hf, make_hf, prompt


def scenario(steps: PagedSteps) -> dict[str, torch.Tensor]:
    """Per sequence, the logits of every token it computed, across mixed steps."""
    rows: dict[str, list[torch.Tensor]] = {"a": [], "b": []}

    def run(new: dict[str, list[int]]) -> None:
        for seq, logits in steps.step(new).items():
            rows[seq].append(logits)
    run({"a": prompt(13, seed=1)})  # whole prefill
    run({"a": [int(rows["a"][-1][-1].argmax())], "b": prompt(6, seed=2)})  # decode + first chunk
    run({"b": prompt(5, seed=3)})  # the rest of b's prompt (a chunk after context)
    for _ in range(3):  # batched decode at different context lengths
        run({seq: [int(rows[seq][-1][-1].argmax())] for seq in ("a", "b")})
    return {seq: torch.cat(r) for seq, r in rows.items()} | {
        f"{seq}_tokens": torch.tensor(steps.tokens[seq]) for seq in ("a", "b")}


def _rank(rank: int, world: int, store: str, out: str) -> None:
    all_reduce = join_gloo(rank, world, store)
    results = {}
    for family in HF_CONFIGS:
        hf = make_hf(family)  # seeded: the same weights on every rank and in the test
        arch = arch_from_hf(family, hf.config)
        shard = rank_shard(arch.num_heads, arch.num_kv_heads, world, rank)
        model = build_model(arch, torch.float32, "cpu", shard, all_reduce)
        model.load_weights(dict(hf.state_dict()))
        results[family.value] = scenario(PagedSteps(model, arch, num_kv_heads=shard.num_kv_heads))
    if rank == 0:
        torch.save(results, out)
    leave_gloo()


@pytest.fixture(scope="module")
def unsplit() -> dict[str, tuple[dict[str, torch.Tensor], object]]:
    out = {}
    for family in HF_CONFIGS:
        hf = make_hf(family)
        arch = arch_from_hf(family, hf.config)
        model = build_model(arch, torch.float32, "cpu")
        model.load_weights(dict(hf.state_dict()))
        out[family.value] = (scenario(PagedSteps(model, arch)), hf)
    return out


@pytest.mark.parametrize("tp", [2, 4])
def test_split_models_compute_the_logits_of_the_whole_model_and_of_transformers(tp, unsplit, tmp_path: Path):
    out = tmp_path / "logits.pt"
    mp.spawn(_rank, args=(tp, str(tmp_path / "store"), str(out)), nprocs=tp, join=True)
    got = torch.load(out)
    for family, (whole, hf) in unsplit.items():
        for seq in ("a", "b"):
            assert torch.equal(got[family][f"{seq}_tokens"], whole[f"{seq}_tokens"])  # same greedy path
            torch.testing.assert_close(got[family][seq], whole[seq], atol=ATOL, rtol=0)
            with torch.no_grad():
                reference = hf(input_ids=whole[f"{seq}_tokens"][None]).logits[0].float()
            torch.testing.assert_close(got[family][seq], reference, atol=ATOL, rtol=0)
