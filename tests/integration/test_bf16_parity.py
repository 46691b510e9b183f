"""bf16 parity (issue 31): every model family in bfloat16 (weights, activations and KV cache)
computes transformers' bfloat16 logits within bf16 tolerance, unsplit and split over 2 real gloo
ranks, and SmolLM2 (the default model) in a bf16 engine gives transformers' bf16 greedy text.

Models: the tiny random-weight Llama, Qwen2 and Qwen3 of tests/unit/test_model_parity.py, the
DeepSeek-V2/V3 (MLA, MoE) variants of test_deepseek_parity.py and the Bamba of
test_bamba_parity.py, saved as Hugging Face folders and read through kvbridge's loader. The
scenario (tests/tp_ranks.paged_scenario) mixes a whole prefill, a chunked prefill and batched
decodes over shuffled blocks.

bf16 tolerance: transformers' own bf16 model moves the logits from fp32 by some amount (the
bf16 noise of this model and sequence); ours may be at most twice that far from transformers'
bf16, at every position (max) and on average. A wrong rotary, norm, scale or cache layout moves
logits by their whole scale (4-7 here), far beyond (noise is 0.05-0.4). Two things legitimately
go either way in bf16 and are left out of the per-position checks, each counted:
- a MoE routing choice within ROUTING_TIE of a tie in transformers' fp32 router (DeepSeek's
  group-limited routing had groups 0.006 apart): another expert there moves that token's
  logits by ~2, and the tokens after it a little (within tolerance). The DeepSeek folders here
  are test_deepseek_parity's, whose tiny routers tie often;
- an argmax whose fp32 top-2 logits are closer than bf16's noise, or on which transformers' bf16
  and fp32 models disagree (the greedy check).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
import transformers

from kvbridge.config import CacheConfig, EngineConfig
from kvbridge.engine.engine import LLMEngine
from kvbridge.engine.layers import linear
from kvbridge.engine.loader import load_model
from kvbridge.engine.loader.safetensors import arch_from_config
from kvbridge.engine.sampling_params import SamplingParams
from kvbridge.shape.model_config import MoEConfig
from tests.hybrid_models import BAMBA_CONFIG, DEEPSEEK_VARIANTS, HybridSteps, make_deepseek_folder
from tests.paged_steps import PagedSteps
from tests.smollm2 import NEW_TOKENS, PROMPTS
from tests.tp_ranks import join_gloo, leave_gloo, load_folder, paged_scenario
from tests.tiny_models import HF_CONFIGS, make_hf

pytestmark = pytest.mark.timeout(900)
BF16 = torch.bfloat16
# How near a tie a routing choice may go either way: bf16 moved router logits by up to ~0.035 here
# (V2 routes on softmax scores, the same order as the logits: compared in logits) and V3's sigmoid
# scores by up to ~0.008 (it routes on sigmoid + bias, sums of two per group: compared in scores).
ROUTING_TIE = {"softmax": 0.07, "sigmoid": 0.01}
MAX_SKIPPED = 0.4  # at most this share of a sequence's positions may be left out (tiny MoEs tie often)


def make_folders(root: Path) -> dict[str, Path]:
    """Every family's tiny model as a Hugging Face folder (idempotent)."""
    folders: dict[str, Path] = {}
    for family in HF_CONFIGS:
        folder = folders[family.value] = root / family.value
        if not (folder / "config.json").is_file():
            make_hf(family).save_pretrained(folder)
    for variant in DEEPSEEK_VARIANTS:
        folders[f"deepseek_{variant}"] = make_deepseek_folder(variant, root / f"deepseek_{variant}")
    folder = folders["bamba"] = root / "bamba"
    if not (folder / "config.json").is_file():
        torch.manual_seed(0)
        transformers.BambaForCausalLM(transformers.BambaConfig(**BAMBA_CONFIG)).eval().save_pretrained(folder)
    return folders


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    return make_folders(tmp_path_factory.mktemp("bf16-parity"))


def run_scenario(name: str, folder: Path, tp: int = 1, rank: int = 0, all_reduce=None) -> dict[str, torch.Tensor]:
    """paged_scenario on the folder's model in bf16 with a bf16 KV cache (rank `rank` of `tp`)."""
    arch, model, shard = load_folder(folder, tp, rank, all_reduce, dtype=BF16)
    if name == "bamba":
        steps = HybridSteps(model, arch, kv_heads=shard.num_kv_heads if shard else arch.num_kv_heads, tp=tp,
                            rank=rank, dtype=BF16)
    else:
        kv_heads = None if shard is None else (1 if arch.use_mla else shard.num_kv_heads)
        steps = PagedSteps(model, arch, num_kv_heads=kv_heads)
        steps.kv_cache = steps.kv_cache.to(BF16)
    got = paged_scenario(steps)
    assert steps.kv_cache.dtype == BF16 and any(p.dtype == BF16 for p in model.parameters())
    return got


def routing_margins(moe: MoEConfig, logits: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Per token, how far transformers' routing choice is from a tie (the smaller of the group
    choice's and the expert choice's gap): in router logits for softmax routing (the same order
    as its scores), in sigmoid + bias scores for sigmoid routing."""
    n, k = moe.num_experts, moe.num_experts_per_tok
    if moe.scoring == "softmax":
        choice = logits
    else:
        choice = logits.sigmoid() + bias if bias is not None else logits.sigmoid()
    gaps = []
    if moe.topk_method != "greedy":
        groups = moe.num_groups or 1
        per_group = choice.view(-1, groups, n // groups)
        group_scores = (per_group.max(-1).values if moe.scoring == "softmax"
                        else per_group.topk(min(2, n // groups), dim=-1)[0].sum(-1))
        ordered = group_scores.sort(-1, descending=True).values
        topk_group = moe.topk_group or groups
        if topk_group < groups:
            gaps.append(ordered[:, topk_group - 1] - ordered[:, topk_group])
        kept = group_scores >= ordered[:, topk_group - 1:topk_group]
        choice = choice.masked_fill(~kept.repeat_interleave(n // groups, dim=-1), float("-inf"))
    ordered = choice.sort(-1, descending=True).values
    gaps.append(ordered[:, k - 1] - ordered[:, k])
    return torch.stack(gaps).amin(0).nan_to_num(float("inf"))


def reference(folder: Path, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """transformers' bf16 and fp32 logits for `tokens`, and per token the smallest routing margin
    of the fp32 model's MoE layers (inf without MoE)."""
    hf_bf16 = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager",
                                                                dtype=BF16).eval()
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    margins = torch.full((len(tokens),), float("inf"))
    moe = arch_from_config(json.loads((folder / "config.json").read_text())).moe

    def router_input(module: torch.nn.Module, args: tuple) -> None:
        nonlocal margins
        logits = torch.nn.functional.linear(args[0].reshape(-1, args[0].shape[-1]).float(), module.weight.float())
        bias = getattr(module, "e_score_correction_bias", None)
        margins = torch.minimum(margins, routing_margins(moe, logits, bias))
    hooks = [layer.mlp.gate.register_forward_pre_hook(router_input)
             for layer in hf.model.layers if moe is not None and hasattr(layer.mlp, "gate")]
    with torch.no_grad():
        want = hf_bf16(input_ids=tokens[None]).logits[0].float()
        fp32 = hf(input_ids=tokens[None]).logits[0].float()
    for hook in hooks:
        hook.remove()
    return want, fp32, margins


def assert_bf16_parity(name: str, got: dict[str, torch.Tensor], folder: Path) -> None:
    for seq in ("a", "b"):
        ours = got[seq]
        want, fp32, margins = reference(folder, got[f"{seq}_tokens"])
        moe = arch_from_config(json.loads((folder / "config.json").read_text())).moe
        keep = margins >= (ROUTING_TIE[moe.scoring] if moe is not None else 0.0)
        assert (~keep).float().mean() <= MAX_SKIPPED, (name, seq, margins)
        noise = (want - fp32).abs()
        err = (ours - want).abs()
        tolerance = 2 * noise[keep].amax()
        assert err[keep].amax() <= tolerance, (name, seq, err.amax(-1), tolerance)
        assert err[keep].mean() <= 2 * noise[keep].mean(), (name, seq, err[keep].mean(), noise[keep].mean())
        # Greedy: where transformers' bf16 and fp32 agree on the argmax, and it is no near-tie in
        # fp32 (top 2 closer than bf16's own noise), ours is that argmax.
        top2 = fp32.topk(2, dim=-1).values
        clear = keep & (want.argmax(-1) == fp32.argmax(-1)) & (top2[:, 0] - top2[:, 1] > noise[keep].amax())
        assert clear.float().mean() >= 0.5, (name, seq, clear)  # not a check of nothing
        assert torch.equal(ours.argmax(-1)[clear], want.argmax(-1)[clear]), (name, seq)


FAMILIES = [f.value for f in HF_CONFIGS] + [f"deepseek_{v}" for v in DEEPSEEK_VARIANTS] + ["bamba"]


@pytest.mark.parametrize("matmuls", ["as_this_cpu_runs_them", "all_widened"])
@pytest.mark.parametrize("name", FAMILIES)
def test_bf16_logits_match_transformers_bf16(folders: dict[str, Path], name: str, matmuls: str, monkeypatch) -> None:
    """all_widened: every bf16 matmul in fp32 on widened values, as a long prefill's run on a CPU
    without AMX (linear.widens_bf16), whatever this CPU is."""
    if matmuls == "all_widened":
        monkeypatch.setattr(linear, "widens_bf16", lambda: True)
        monkeypatch.setattr(linear, "WIDEN_MIN_ROWS", 1)
    assert_bf16_parity(name, run_scenario(name, folders[name]), folders[name])


def _rank(rank: int, world: int, store: str, folders: dict[str, str], out: str) -> None:
    all_reduce = join_gloo(rank, world, store)
    results = {name: run_scenario(name, Path(folder), world, rank, all_reduce) for name, folder in folders.items()}
    if rank == 0:
        torch.save(results, out)
    leave_gloo()


def test_tp2_bf16_logits_match_transformers_bf16(folders: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "logits.pt"
    mp.spawn(_rank, args=(2, str(tmp_path / "store"), {n: str(f) for n, f in folders.items()}, str(out)),
             nprocs=2, join=True)
    got = torch.load(out)
    assert sorted(got) == sorted(FAMILIES)
    for name, folder in folders.items():
        assert_bf16_parity(name, got[name], folder)


def test_the_routing_margin_finds_a_group_near_tie() -> None:
    """The case seen on DeepSeek-V3: groups (0, 1) and (2, 3) 0.006 apart (sums of their top 2)."""
    moe = MoEConfig(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=4, num_shared_experts=0,
                    first_k_dense_replace=0, scoring="sigmoid", topk_method="noaux_tc", num_groups=4, topk_group=2)
    scores = torch.tensor([[0.671, 0.246, 0.798, 0.113, 0.291, 0.007, 0.488, 0.559]])
    margin = routing_margins(moe, torch.logit(scores), None)
    assert margin.item() == pytest.approx(0.006, abs=1e-4)
    clear = torch.tensor([[0.9, 0.1, 0.2, 0.1, 0.1, 0.0, 0.5, 0.6]])
    assert routing_margins(moe, torch.logit(clear), None).item() > ROUTING_TIE["sigmoid"]


def test_smollm2_bf16_engine_greedy_text_is_transformers_bf16(hf_smollm2_from_gguf) -> None:
    """The default model in a bf16 engine (batched decode of the standard prompts over the paged
    bf16 cache): at every one of 16 positions where transformers' bf16 and fp32 models agree on
    the argmax after the prompt and our tokens so far, our token is that argmax; up to the first
    position where they disagree, our text is transformers' bf16 greedy text."""
    loaded = load_model("SmolLM2-135M-Instruct")
    engine = LLMEngine(EngineConfig(dtype="bfloat16", cache=CacheConfig(num_blocks=64, enable_prefix_caching=False)),
                       loaded)
    assert engine.runner.kv_cache.dtype == BF16
    prompts = [loaded.tokenizer.encode(p) for p in PROMPTS]
    ours = engine.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))
    hf_bf16 = transformers.AutoModelForCausalLM.from_config(hf_smollm2_from_gguf.config, dtype=BF16).eval()
    hf_bf16.load_state_dict(hf_smollm2_from_gguf.state_dict())
    eos = hf_smollm2_from_gguf.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    compared = 0
    for prompt, got in zip(prompts, ours):
        assert len(got) == NEW_TOKENS
        argmax = {}
        for name, model in (("bf16", hf_bf16), ("fp32", hf_smollm2_from_gguf)):
            with torch.inference_mode():
                logits = model(input_ids=torch.tensor([prompt + got])).logits[0, len(prompt) - 1:-1].float()
                logits[:, eos] = float("-inf")  # as generate with min_new_tokens (ours ignores EOS)
                argmax[name] = logits.argmax(-1).tolist()
        agree = [b == f for b, f in zip(argmax["bf16"], argmax["fp32"])]
        first_disagreement = agree.index(False) if False in agree else NEW_TOKENS
        text = loaded.tokenizer.decode
        assert got[:first_disagreement] == argmax["bf16"][:first_disagreement], (text(got), text(argmax["bf16"]))
        assert all(g == b for g, b, same in zip(got, argmax["bf16"], agree) if same), (text(got), text(argmax["bf16"]))
        compared += sum(agree)
    assert compared >= 0.9 * NEW_TOKENS * len(PROMPTS)  # not a test of nothing
    engine.shutdown()
