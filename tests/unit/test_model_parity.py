"""The Llama-family model over a paged KV cache computes the same logits as Hugging Face.

Tiny random-weight Llama (tied embeddings), Qwen2 (Q/K/V bias) and Qwen3 (per-head Q/K
RMSNorm, head_dim != hidden / heads) models are built with `transformers` (eager attention,
fp32) and copied into kvbridge's model through `load_weights`. Every scenario the scheduler
produces (whole prefill, chunked prefill, mixed prefill + decode, batched decode at different
context lengths) must give, per sequence, the logits HF gives for that sequence alone.
Block ids are shuffled so no sequence's KV is contiguous.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from dataclasses import dataclass  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from kvbridge.engine.layers.attention import AttentionMetadata  # noqa: E402
from kvbridge.engine.models import CausalLM, build_model  # noqa: E402
from kvbridge.engine.models.llama import LlamaForCausalLM  # noqa: E402
from kvbridge.shape.model_config import ModelArchConfig  # noqa: E402
from tests.paged_steps import ATOL, BLOCK_SIZE, PagedSteps, prompt  # noqa: E402
from tests.tiny_models import HF_CONFIGS, arch_from_hf, make_hf  # noqa: E402


@dataclass
class Pair:
    """A Hugging Face reference model and the same weights in kvbridge's model."""

    hf: transformers.PreTrainedModel
    ours: CausalLM
    arch: ModelArchConfig

    def reference_logits(self, tokens: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return self.hf(input_ids=torch.tensor([tokens])).logits[0].float()


@pytest.fixture(scope="module", params=list(HF_CONFIGS), ids=lambda f: f.value)
def pair(request: pytest.FixtureRequest) -> Pair:
    family = request.param
    hf = make_hf(family)
    arch = arch_from_hf(family, hf.config)
    ours = build_model(arch, torch.float32, torch.device("cpu"))
    ours.load_weights(dict(hf.state_dict()))
    return Pair(hf, ours, arch)


def greedy(logits: torch.Tensor) -> list[int]:
    return [int(logits[-1].argmax())]


def test_prefill_across_shuffled_blocks_then_greedy_decode_matches_hf(pair: Pair) -> None:
    steps = PagedSteps(pair.ours, pair.arch)
    rows = [steps.step({"a": prompt(13, seed=1)})["a"]]
    for _ in range(5):
        rows.append(steps.step({"a": greedy(rows[-1])})["a"])
    assert steps.tables["a"] != sorted(steps.tables["a"]), "blocks should not be in order"
    torch.testing.assert_close(torch.cat(rows), pair.reference_logits(steps.tokens["a"]), atol=ATOL, rtol=0)


def test_two_prompts_of_different_lengths_in_one_step_match_each_alone(pair: Pair) -> None:
    steps = PagedSteps(pair.ours, pair.arch)
    out = steps.step({"a": prompt(7, seed=2), "b": prompt(11, seed=3)})
    for seq in ("a", "b"):
        torch.testing.assert_close(out[seq], pair.reference_logits(steps.tokens[seq]), atol=ATOL, rtol=0)


def test_step_mixing_decode_and_prefill_matches_each_alone(pair: Pair) -> None:
    steps = PagedSteps(pair.ours, pair.arch)
    first = steps.step({"a": prompt(9, seed=4)})["a"]
    out = steps.step({"b": prompt(6, seed=5), "a": greedy(first), "c": prompt(1, seed=6)})
    # "a" and the one-token prompt "c" are decode-shaped and attended together between b's rows.
    decode = steps.last_attn.decode
    assert decode is not None and decode.token_index.tolist() == [6, 7]
    torch.testing.assert_close(out["a"], pair.reference_logits(steps.tokens["a"])[-1:], atol=ATOL, rtol=0)
    for seq in ("b", "c"):
        torch.testing.assert_close(out[seq], pair.reference_logits(steps.tokens[seq]), atol=ATOL, rtol=0)


def test_chunked_prefill_matches_one_pass(pair: Pair) -> None:
    tokens = prompt(13, seed=7)
    steps = PagedSteps(pair.ours, pair.arch)
    # Chunks that end mid-block, including a one-token chunk.
    rows = [steps.step({"a": tokens[:5]})["a"], steps.step({"a": tokens[5:6]})["a"],
            steps.step({"a": tokens[6:]})["a"]]
    torch.testing.assert_close(torch.cat(rows), pair.reference_logits(tokens), atol=ATOL, rtol=0)


@pytest.mark.parametrize("fold_gqa_decode", [False, True], ids=["enable_gqa", "folded_gqa"])
def test_batched_decode_of_three_sequences_with_different_contexts(pair: Pair, fold_gqa_decode: bool) -> None:
    model = LlamaForCausalLM(pair.arch, torch.float32, "cpu", fold_gqa_decode=fold_gqa_decode)
    model.load_weights(dict(pair.hf.state_dict()))
    steps = PagedSteps(model, pair.arch)
    lens = {"a": 3, "b": 8, "c": 13}
    out = steps.step({seq: prompt(n, seed=10 + n) for seq, n in lens.items()})
    for _ in range(3):
        out = steps.step({seq: greedy(out[seq]) for seq in lens})
        assert steps.last_attn.is_pure_decode and steps.last_attn.decode.mask is not None
        for seq in lens:
            expected = pair.reference_logits(steps.tokens[seq])[-1:]
            torch.testing.assert_close(out[seq], expected, atol=ATOL, rtol=0)


def test_kv_cache_holds_hf_keys_and_values_at_each_tokens_slot(pair: Pair) -> None:
    tokens = prompt(10, seed=8)
    steps = PagedSteps(pair.ours, pair.arch)
    steps.step({"a": tokens})
    with torch.no_grad():
        hf_cache = pair.hf(input_ids=torch.tensor([tokens]), use_cache=True).past_key_values
    table = steps.tables["a"]
    for layer in range(pair.arch.num_layers):
        # The cache is [blocks, kv_heads, layers, 2, block_size, head_dim].
        ours = torch.stack([steps.kv_cache[table[p // BLOCK_SIZE], :, layer, :, p % BLOCK_SIZE].transpose(0, 1)
                            for p in range(len(tokens))], dim=1)  # [2, tokens, kv_heads, head_dim]
        hf_layer = hf_cache.layers[layer]
        expected = torch.stack([hf_layer.keys[0].transpose(0, 1), hf_layer.values[0].transpose(0, 1)])
        torch.testing.assert_close(ours, expected, atol=ATOL, rtol=0)


def test_bf16_model_tracks_fp32_reference(pair: Pair) -> None:
    model = build_model(pair.arch, torch.bfloat16, "cpu")
    model.load_weights(dict(pair.hf.state_dict()))
    steps = PagedSteps(model, pair.arch)
    steps.kv_cache = steps.kv_cache.bfloat16()
    rows = [steps.step({"a": prompt(9, seed=9)})["a"]]
    rows.append(steps.step({"a": greedy(rows[-1])})["a"])
    logits = torch.cat(rows)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, pair.reference_logits(steps.tokens["a"]), atol=0.15, rtol=0.05)


def test_load_weights_names_a_wrong_shape_and_copies_nothing(pair: Pair) -> None:
    model = build_model(pair.arch, torch.float32, "cpu")
    weights = dict(pair.hf.state_dict())
    model.load_weights(weights)
    bad = dict(weights)
    bad["model.norm.weight"] = weights["model.norm.weight"] + 1.0
    bad["model.layers.1.mlp.up_proj.weight"] = torch.zeros(3, pair.arch.hidden_size)
    with pytest.raises(ValueError, match=r"wrong shape: model\.layers\.1\.mlp\.up_proj\.weight: expected "
                                         r"\(112, 64\), got \(3, 64\)"):
        model.load_weights(bad)
    assert torch.equal(model.model.norm.weight, weights["model.norm.weight"])


def test_load_weights_names_missing_and_unexpected_weights(pair: Pair) -> None:
    model = build_model(pair.arch, torch.float32, "cpu")
    weights = dict(pair.hf.state_dict())
    del weights["model.layers.0.self_attn.k_proj.weight"]
    weights["model.layers.0.self_attn.rogue.weight"] = torch.zeros(1)
    with pytest.raises(ValueError, match=r"missing: model\.layers\.0\.self_attn\.k_proj\.weight; "
                                         r"unexpected: model\.layers\.0\.self_attn\.rogue\.weight"):
        model.load_weights(weights)


def test_untied_model_requires_lm_head(pair: Pair) -> None:
    weights = {k: v for k, v in pair.hf.state_dict().items() if k != "lm_head.weight"}
    model = build_model(pair.arch, torch.float32, "cpu")
    if pair.arch.tie_word_embeddings:
        model.load_weights(weights)  # the tied head is the embedding
    else:
        with pytest.raises(ValueError, match=r"missing: lm_head\.weight"):
            model.load_weights(weights)


@pytest.mark.parametrize(("query_lens", "context_lens", "tables", "message"), [
    ([3], [2], [[0]], "smaller than query_len"),
    ([2], [9], [[0, 1]], "cannot hold a context of 9"),
    ([0], [4], [[0]], "at least one new token"),
])
def test_metadata_rejects_inconsistent_batches(query_lens: list[int], context_lens: list[int],
                                               tables: list[list[int]], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AttentionMetadata.build(query_lens, context_lens, tables, BLOCK_SIZE, "cpu")


def test_metadata_slot_mapping_follows_block_tables() -> None:
    attn = AttentionMetadata.build([2, 1], [6, 3], [[7, 2], [5]], BLOCK_SIZE, "cpu")
    # seq 0 writes positions 4, 5 (block 2); seq 1 writes position 2 (block 5)
    assert attn.slot_mapping.tolist() == [2 * 4 + 0, 2 * 4 + 1, 5 * 4 + 2]
    assert attn.query_start_loc == [0, 2, 3]
    assert not attn.is_pure_decode
