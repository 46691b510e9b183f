"""Prompt logprobs (vLLM's `prompt_logprobs`, what `echo` with `logprobs` returns) from the engine on
the default model equal a float64 reference: transformers' model of the same GGUF in float64, one
forward over the prompt, log-softmax per position. Whatever splits the prompt (chunked prefill, a
batch with another request, a prefix already cached) changes nothing: every position is computed,
none is taken from the prefix cache, each token's logprob, rank and top alternatives are reported
once, on the request's first output."""

from __future__ import annotations

import pytest
import torch

from kvbridge.config import CacheConfig, EngineConfig, SchedulerConfig
from kvbridge.engine.engine import LLMEngine
from kvbridge.engine.loader import load_model
from kvbridge.engine.outputs import TokenLogprob
from kvbridge.engine.sampling_params import SamplingParams
from tests.engine_runs import run_to_end


PROMPT = ("The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single "
          "step, and every step of this sentence is scored by the model that reads it, token by token.")
FP32_ATOL = 2e-3  # float32 engine against float64: the model's rounding, a few 1e-4 at most here


@pytest.fixture(scope="module")
def loaded():
    return load_model("SmolLM2-135M-Instruct")


@pytest.fixture(scope="module")
def reference(hf_smollm2_from_gguf, loaded):
    """Per position of PROMPT's tokens: the float64 log-softmax of the logits after it."""
    ids = loaded.tokenizer.encode(PROMPT)
    model = torch.nn.Module.double(hf_smollm2_from_gguf)  # (transformers refuses .float() on a GGUF model)
    try:
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([ids])).logits[0]
        return ids, torch.log_softmax(logits, dim=-1)
    finally:
        torch.nn.Module.float(hf_smollm2_from_gguf)


def check_against(reference: tuple[list[int], torch.Tensor], got: list[TokenLogprob | None], k: int) -> None:
    ids, ref = reference
    assert len(got) == len(ids) and got[0] is None
    for pos in range(1, len(ids)):
        entry = got[pos]
        assert entry is not None and entry.token_id == ids[pos]
        row = ref[pos - 1]
        assert entry.logprob == pytest.approx(float(row[ids[pos]]), abs=FP32_ATOL), pos
        assert entry.rank is not None  # the rank-th likeliest token has the token's logprob (ties aside)
        assert float(torch.sort(row, descending=True).values[entry.rank - 1]) == pytest.approx(
            float(row[ids[pos]]), abs=FP32_ATOL)
        assert len(entry.top) == k
        want = torch.topk(row, k)
        for (tid, lp), ref_lp in zip(entry.top, want.values.tolist()):
            assert lp == pytest.approx(ref_lp, abs=FP32_ATOL)
            assert float(row[tid]) == pytest.approx(lp, abs=FP32_ATOL)


def test_chunked_batched_and_cached_prompts_give_the_float64_logprobs(loaded, reference) -> None:
    ids = reference[0]
    engine = LLMEngine(EngineConfig(cache=CacheConfig(num_blocks=64), scheduler=SchedulerConfig(
        max_num_batched_tokens=16)), loaded)  # the prompt is computed 16 tokens a step
    try:
        plain = SamplingParams(max_tokens=2, temperature=0)
        asked = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3)
        first = run_to_end(engine, {"warm": (ids, plain), "other": (loaded.tokenizer.encode("Hello there"), asked)})
        assert first["warm"][0].prompt_logprobs is None  # not asked: none computed
        # the prompt's blocks are cached now; a request that asks for prompt logprobs computes them all
        second = run_to_end(engine, {"scored": (ids, asked), "zero": (ids, SamplingParams(max_tokens=1, prompt_logprobs=0))})
    finally:
        engine.shutdown()
    scored = second["scored"]
    assert scored[0].prompt_logprobs is not None
    assert all(out.prompt_logprobs is None for out in scored[1:])  # once, on the first output
    assert scored[-1].num_cached_tokens == 0
    check_against(reference, scored[0].prompt_logprobs, 3)
    check_against(reference, second["zero"][0].prompt_logprobs or [], 0)
    short = first["other"][0].prompt_logprobs
    assert short is not None and len(short) == len(loaded.tokenizer.encode("Hello there"))


def test_a_one_token_prompt_has_one_empty_entry(loaded) -> None:
    engine = LLMEngine(EngineConfig(cache=CacheConfig(num_blocks=16)), loaded)
    try:
        out = run_to_end(engine, {"one": ([1], SamplingParams(max_tokens=1, prompt_logprobs=2))})["one"]
    finally:
        engine.shutdown()
    assert out[0].prompt_logprobs == [None]


def test_prompt_logprobs_out_of_range_are_refused() -> None:
    for bad in (-1, 21):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)


BF16_MEAN_ATOL, BF16_MAX_ATOL = 0.15, 0.8  # measured here: mean 0.074, max 0.39 (bf16 weights and activations)


def test_bf16_prompt_logprobs_are_within_bf16s_tolerance_of_float64(loaded, reference) -> None:
    """--dtype auto picks bfloat16 on a CPU with native bf16: its prompt logprobs are the bf16 model's,
    within bf16's rounding of the float64 reference (a few hundredths a token on average)."""
    ids, ref = reference
    engine = LLMEngine(EngineConfig(dtype="bfloat16", cache=CacheConfig(num_blocks=64)), loaded)
    try:
        got = run_to_end(engine, {"bf16": (ids, SamplingParams(max_tokens=1, prompt_logprobs=1))})["bf16"][0].prompt_logprobs
    finally:
        engine.shutdown()
    assert got is not None and got[0] is None and len(got) == len(ids)
    errors = torch.tensor([abs(got[p].logprob - float(ref[p - 1, ids[p]])) for p in range(1, len(ids))])
    assert float(errors.mean()) < BF16_MEAN_ATOL and float(errors.max()) < BF16_MAX_ATOL, errors
