"""Sliding-window attention over the paged cache computes the logits of Hugging Face
`transformers`, unsplit and split over 2 real gloo ranks.

Models (tiny random weights, saved as Hugging Face folders, read back through the loader):
a Qwen2 with one full-attention layer then three sliding ones (4 KV cache groups of 1 layer),
a Qwen3 alternating full and sliding layers (2 groups of 2) and a Mistral whose every layer
slides (1 group). Windows of 5 and 6 tokens against prompts of 13 tokens over blocks of 4:
every window cuts through blocks, and the scenario (whole prefill, chunked prefill, batched
decodes; tests/integration/test_tp_parity.py) runs past the window in every sequence. Each
group gets its own shuffled block table, as the KV cache manager hands them out.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
import transformers

from kvbridge.engine.layers.attention import AttentionMetadata
from kvbridge.engine.models import kv_cache_shape
from kvbridge.shape.kv_groups import layer_groups
from tests.paged_steps import ATOL, BLOCK_SIZE, VOCAB
from tests.tp_ranks import join_gloo, leave_gloo, load_folder, paged_scenario

_SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=112, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, attn_implementation="eager")
VARIANTS = {
    "qwen2_full_then_sliding": lambda: transformers.Qwen2Config(
        **_SHAPE, use_sliding_window=True, sliding_window=5, max_window_layers=1),
    "qwen3_alternating": lambda: transformers.Qwen3Config(
        **_SHAPE, head_dim=24, use_sliding_window=True, sliding_window=6,
        layer_types=["full_attention", "sliding_attention"] * 2),
    "mistral_all_sliding": lambda: transformers.MistralConfig(**_SHAPE, sliding_window=5),
}
GROUPS = {"qwen2_full_then_sliding": 4, "qwen3_alternating": 2, "mistral_all_sliding": 1}


class GroupedSteps:
    """PagedSteps (tests/paged_steps.py) with one shuffled block table per KV cache group."""

    def __init__(self, model, arch, num_kv_heads: int | None = None, num_blocks: int = 96, seed: int = 0) -> None:
        self.model, self.groups = model, layer_groups(arch)
        self.kv_cache = torch.zeros(kv_cache_shape(arch, num_blocks, BLOCK_SIZE, num_kv_heads))
        self.free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
        self.tables: dict[str, list[list[int]]] = {}
        self.tokens: dict[str, list[int]] = {}

    def step(self, new_tokens: dict[str, list[int]]) -> dict[str, torch.Tensor]:
        query_lens, context_lens, ids, positions = [], [], [], []
        for seq, toks in new_tokens.items():
            done = len(self.tokens.setdefault(seq, []))
            tables = self.tables.setdefault(seq, [[] for _ in self.groups])
            for table in tables:
                while len(table) * BLOCK_SIZE < done + len(toks):
                    table.append(self.free.pop())
            self.tokens[seq].extend(toks)
            query_lens.append(len(toks))
            context_lens.append(done + len(toks))
            ids.extend(toks)
            positions.extend(range(done, done + len(toks)))
        metas = [AttentionMetadata.build(query_lens, context_lens, [self.tables[s][gi] for s in new_tokens], BLOCK_SIZE,
                                         "cpu", g.sliding_window) for gi, g in enumerate(self.groups)]
        hidden = self.model(torch.tensor(ids), torch.tensor(positions), metas if len(metas) > 1 else metas[0],
                            self.kv_cache)
        logits = self.model.compute_logits(hidden)
        bounds = metas[0].query_start_loc
        return {seq: logits[bounds[i]:bounds[i + 1]] for i, seq in enumerate(new_tokens)}


def make_folder(variant: str, folder: Path) -> Path:
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(VARIANTS[variant]()).eval()
    with torch.no_grad():  # larger than HF's init so attention patterns are far from uniform
        for name, p in hf.named_parameters():
            p.uniform_(0.5, 1.5) if name.endswith("norm.weight") else p.normal_(0.0, 0.15)
    hf.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sliding")
    return {v: make_folder(v, root / v) for v in VARIANTS}


def reference(folder: Path, tokens: torch.Tensor, sliding: bool = True) -> torch.Tensor:
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    if not sliding:  # the same weights attending over the whole context
        hf = transformers.AutoModelForCausalLM.from_config(
            type(hf.config)(**{**hf.config.to_dict(), "sliding_window": None, "use_sliding_window": False,
                               "layer_types": None}), attn_implementation="eager").eval()
        hf.load_state_dict(transformers.AutoModelForCausalLM.from_pretrained(folder).state_dict())
    with torch.no_grad():
        return hf(input_ids=tokens[None]).logits[0].float()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_sliding_layers_match_transformers_past_the_window(folders, variant: str) -> None:
    arch, model, _ = load_folder(folders[variant])
    assert len(layer_groups(arch)) == GROUPS[variant] and "sliding_attention" in arch.layer_types
    got = paged_scenario(GroupedSteps(model, arch))
    for seq in ("a", "b"):
        tokens = got[f"{seq}_tokens"]
        assert len(tokens) > arch.sliding_window + BLOCK_SIZE
        torch.testing.assert_close(got[seq], reference(folders[variant], tokens), atol=ATOL, rtol=0)
        # The window matters: attending over everything gives other logits.
        assert (got[seq] - reference(folders[variant], tokens, sliding=False)).abs().max() > 1e-2


def _rank(rank: int, world: int, store: str, folders: dict[str, str], out: str) -> None:
    all_reduce = join_gloo(rank, world, store)
    results = {}
    for variant, folder in folders.items():
        arch, model, shard = load_folder(Path(folder), world, rank, all_reduce)
        results[variant] = paged_scenario(GroupedSteps(model, arch, num_kv_heads=shard.num_kv_heads))
    if rank == 0:
        torch.save(results, out)
    leave_gloo()


def test_tp2_sliding_models_compute_the_unsplit_logits(folders, tmp_path: Path) -> None:
    out = tmp_path / "logits.pt"
    mp.spawn(_rank, args=(2, str(tmp_path / "store"), {v: str(f) for v, f in folders.items()}, str(out)),
             nprocs=2, join=True)
    got = torch.load(out)
    for variant, folder in folders.items():
        arch, model, _ = load_folder(folder)
        whole = paged_scenario(GroupedSteps(model, arch))
        for seq in ("a", "b"):
            assert torch.equal(got[variant][f"{seq}_tokens"], whole[f"{seq}_tokens"])
            torch.testing.assert_close(got[variant][seq], whole[seq], atol=ATOL, rtol=0)
