"""The engine serving a Qwen2 folder that mixes full-attention and sliding-window layers
(window 24 tokens; random weights, SmolLM2's tokenizer; two KV cache groups): a request's
greedy output does not depend on the batch, on chunked prefill, on preemption or on
prefix-cache hits, TP 2 gives TP 1's text, the sliding group holds only the blocks its window
sees while a request decodes, and every block is free afterwards."""

from __future__ import annotations

import pytest

from kvbridge.config import CacheConfig, EngineConfig, SchedulerConfig
from kvbridge.engine.engine import LLMEngine
from kvbridge.engine.kv_cache_manager import KVCacheKind
from kvbridge.engine.loader import load_model
from kvbridge.engine.loader.synthetic import TINY_QWEN2_SLIDING, write_synthetic_folder
from kvbridge.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=16, temperature=0.0)
QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "Write a haiku about the sea.",
             "What is 12 times 12?", "Who wrote Hamlet?", "Explain gravity in one sentence."]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    folder = tmp_path_factory.mktemp("models") / "tiny-qwen2-sliding"
    write_synthetic_folder(folder, load_model("SmolLM2-135M-Instruct").tokenizer, architecture="qwen2",
                           **TINY_QWEN2_SLIDING)
    return load_model(str(folder))


@pytest.fixture(scope="module")
def prompts(loaded):
    tok = loaded.tokenizer
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in QUESTIONS]


def engine(loaded, num_blocks=256, block_size=16, budget=2048, prefix=True, tp=1):
    return LLMEngine(EngineConfig(model=loaded.source, tensor_parallel_size=tp,
                                  cache=CacheConfig(block_size=block_size, num_blocks=num_blocks,
                                                    enable_prefix_caching=prefix),
                                  scheduler=SchedulerConfig(max_num_batched_tokens=budget)), loaded)


def all_free(e: LLMEngine) -> bool:
    m = e.metrics()
    return m.num_free_blocks == m.num_total_blocks


@pytest.fixture(scope="module")
def alone(loaded, prompts):
    e = engine(loaded, prefix=False)
    assert [g.kind for g in e.kv_cache_manager.groups] == [KVCacheKind.FULL_ATTENTION, KVCacheKind.SLIDING_WINDOW]
    return [e.generate([p], GREEDY)[0] for p in prompts]


def test_outputs_depend_on_the_prompt(alone):
    assert len({tuple(o) for o in alone}) == len(alone) and all(len(o) == GREEDY.max_tokens for o in alone)


def test_batch_matches_each_request_alone(loaded, prompts, alone):
    e = engine(loaded, prefix=False)
    assert e.generate(prompts, GREEDY) == alone
    assert all_free(e)


def test_chunked_prefill_matches(loaded, prompts, alone):
    e = engine(loaded, budget=20, prefix=False)
    assert e.generate(prompts[:3], GREEDY) == alone[:3]
    assert all_free(e)


def test_preempted_requests_match(loaded, prompts, alone):
    e = engine(loaded, num_blocks=36, block_size=4, prefix=False)  # two prompts fit, their decodes do not
    assert e.generate(prompts, GREEDY) == alone
    assert e.metrics().num_preemptions > 0
    assert all_free(e)


def test_prefix_cache_hit_matches(loaded, prompts, alone):
    e = engine(loaded, block_size=4)
    first = e.generate([prompts[0]], GREEDY)[0]
    hits_before = e.metrics().prefix_cache_hits
    again = e.generate([prompts[0]], GREEDY)[0]
    assert e.metrics().prefix_cache_hits > hits_before
    assert first == again == alone[0]


def test_tensor_parallel_2_gives_the_same_text(loaded, prompts, alone):
    e = engine(loaded, block_size=4, tp=2)
    try:
        assert e.generate(prompts, GREEDY) == alone
        assert all_free(e)
    finally:
        e.shutdown()


def test_the_sliding_group_holds_only_its_window_while_decoding(loaded, prompts, alone):
    e = engine(loaded, block_size=4, prefix=False)
    kvm = e.kv_cache_manager
    window = kvm.groups[1].sliding_window
    e.add_request("r", prompts[0], GREEDY)
    seen = []
    e.step()  # the prompt: every block written once
    while e.has_pending_work():
        e.step()  # a decode step allocates for its token first, dropping what the window left behind
        full, sliding = kvm.get_block_ids("r")
        if full:
            live = [b for b in sliding if b != kvm.pool.null_block.block_id]
            assert len(live) <= -(-window // 4) + 1  # the window's blocks (and the one being filled)
            seen.append(len(full) - len(live))
    assert min(seen) > 0  # blocks behind the window went back to the pool
    assert all_free(e)


def test_a_prefix_hit_past_the_window_gives_the_same_text(loaded, prompts, alone):
    e = engine(loaded, block_size=4)
    first = e.generate([prompts[1]], GREEDY)[0]
    hits = e.metrics().prefix_cache_hits
    assert e.generate([prompts[1]], GREEDY)[0] == first == alone[1]
    assert e.metrics().prefix_cache_hits - hits > loaded.arch.sliding_window  # resumed past the window
    assert all_free(e)
