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
from tests.paged_steps import ATOL, PagedSteps
from tests.tp_ranks import paged_scenario, scenario_rank
from tests.tiny_models import HF_CONFIGS, arch_from_hf, make_hf


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, dict[str, tuple[dict[str, torch.Tensor], object]]]:
    """Every family's architecture and weights saved for the ranks (which then need not import
    transformers), and per family the unsplit model's scenario logits and the HF model."""
    saved, out = {}, {}
    for family in HF_CONFIGS:
        hf = make_hf(family)  # seeded: the same weights as the ranks load
        arch = arch_from_hf(family, hf.config)
        weights = {k: v.clone() for k, v in hf.state_dict().items()}
        saved[family.value] = (arch, weights)
        model = build_model(arch, torch.float32, "cpu")
        model.load_weights(dict(weights))
        out[family.value] = (paged_scenario(PagedSteps(model, arch)), hf)
    path = tmp_path_factory.mktemp("tp-parity") / "models.pt"
    torch.save(saved, path)
    return path, out


@pytest.mark.parametrize("tp", [2, 4])
def test_split_models_compute_the_logits_of_the_whole_model_and_of_transformers(tp, models, tmp_path: Path):
    saved, unsplit = models
    out = tmp_path / "logits.pt"
    mp.spawn(scenario_rank, args=(tp, str(tmp_path / "store"), str(saved), str(out)), nprocs=tp, join=True)
    got = torch.load(out)
    for family, (whole, hf) in unsplit.items():
        for seq in ("a", "b"):
            assert torch.equal(got[family][f"{seq}_tokens"], whole[f"{seq}_tokens"])  # same greedy path
            torch.testing.assert_close(got[family][seq], whole[seq], atol=ATOL, rtol=0)
            with torch.no_grad():
                reference = hf(input_ids=whole[f"{seq}_tokens"][None]).logits[0].float()
            torch.testing.assert_close(got[family][seq], reference, atol=ATOL, rtol=0)
