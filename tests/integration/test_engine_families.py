"""The engine serving model families beyond the default Llama (random weights, SmolLM2's
tokenizer): a DeepSeek-V2 folder (MLA + MoE: one latent per token, KV cache group "mla") and a
Qwen2 folder mixing full-attention and sliding-window layers (window 24 tokens: two KV cache
groups), and a Bamba folder (Mamba2 + attention: Mamba-state groups, logical blocks of several
kernel blocks). For each, a request's greedy output does not depend on the batch, on chunked
prefill, on preemption or on prefix-cache hits, TP 2 gives TP 1's text, and every block is
free afterwards. For the sliding model also: the sliding group holds only the blocks its
window sees while a request decodes, and a prefix hit resumes past the window."""

from __future__ import annotations

import pytest

from kvbridge.config import CacheConfig, EngineConfig, SchedulerConfig
from kvbridge.engine.engine import LLMEngine
from kvbridge.engine.loader import load_model
from kvbridge.engine.loader.synthetic import (TINY_BAMBA, TINY_DEEPSEEK_V2_MOE, TINY_QWEN2_SLIDING,
                                              write_synthetic_folder)
from kvbridge.engine.sampling_params import SamplingParams
from kvbridge.shape.kv_groups import KVCacheKind

GREEDY = SamplingParams(max_tokens=16, temperature=0.0)
QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "Write a haiku about the sea.",
             "What is 12 times 12?", "Who wrote Hamlet?", "Explain gravity in one sentence."]
FAMILIES = {  # name: (architecture, geometry, KV cache group kinds, blocks of 4 that force preemption)
    "deepseek_v2_moe": ("deepseek_v2", TINY_DEEPSEEK_V2_MOE, [KVCacheKind.MLA], 24),
    "qwen2_sliding": ("qwen2", TINY_QWEN2_SLIDING, [KVCacheKind.FULL_ATTENTION, KVCacheKind.SLIDING_WINDOW], 36),
    # 3 Mamba layers + 1 attention layer: 4 groups of 1; logical blocks of 6 kernel blocks of 4.
    "bamba": ("bamba", TINY_BAMBA, [KVCacheKind.MAMBA, KVCacheKind.FULL_ATTENTION, KVCacheKind.MAMBA,
                                    KVCacheKind.MAMBA], 10),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    architecture, geometry, kinds, preempt_blocks = FAMILIES[request.param]
    folder = tmp_path_factory.mktemp("models") / request.param
    write_synthetic_folder(folder, load_model("SmolLM2-135M-Instruct").tokenizer, architecture=architecture,
                           **geometry)
    loaded = load_model(str(folder))
    tok = loaded.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in QUESTIONS]
    e = engine(loaded, prefix=False)
    assert [g.kind for g in e.kv_cache_manager.groups] == kinds
    alone = [e.generate([p], GREEDY)[0] for p in prompts]
    return request.param, loaded, prompts, alone, preempt_blocks


def engine(loaded, num_blocks=256, block_size=16, budget=2048, prefix=True, tp=1):
    return LLMEngine(EngineConfig(model=loaded.source, tensor_parallel_size=tp,
                                  cache=CacheConfig(block_size=block_size, num_blocks=num_blocks,
                                                    enable_prefix_caching=prefix),
                                  scheduler=SchedulerConfig(max_num_batched_tokens=budget)), loaded)


def all_free(e: LLMEngine) -> bool:
    m = e.metrics()
    return m.num_free_blocks == m.num_total_blocks


def test_outputs_depend_on_the_prompt(family):
    _, _, _, alone, _ = family
    assert len({tuple(o) for o in alone}) == len(alone) and all(len(o) == GREEDY.max_tokens for o in alone)


def test_batch_matches_each_request_alone(family):
    _, loaded, prompts, alone, _ = family
    e = engine(loaded, prefix=False)
    assert e.generate(prompts, GREEDY) == alone
    assert all_free(e)


def test_chunked_prefill_matches(family):
    _, loaded, prompts, alone, _ = family
    e = engine(loaded, budget=20, prefix=False)
    assert e.generate(prompts[:3], GREEDY) == alone[:3]
    assert all_free(e)


def test_preempted_requests_match(family):
    _, loaded, prompts, alone, preempt_blocks = family
    e = engine(loaded, num_blocks=preempt_blocks, block_size=4, prefix=False)
    assert e.generate(prompts, GREEDY) == alone
    assert e.metrics().num_preemptions > 0
    assert all_free(e)


def test_prefix_cache_hit_matches(family):
    _, loaded, prompts, alone, _ = family
    e = engine(loaded, block_size=4)
    first = e.generate([prompts[1]], GREEDY)[0]
    hits = e.metrics().prefix_cache_hits
    assert e.generate([prompts[1]], GREEDY)[0] == first == alone[1]
    hit_tokens = e.metrics().prefix_cache_hits - hits
    if loaded.arch.mamba is not None:  # a Mamba state is no run of tokens: no prefix hits, same text
        assert hit_tokens == 0
        assert all_free(e)
        return
    assert hit_tokens > 0
    if loaded.arch.sliding_window is not None:
        assert hit_tokens > loaded.arch.sliding_window  # resumed past the window
    assert all_free(e)


def test_tensor_parallel_2_gives_the_same_text(family):
    _, loaded, prompts, alone, _ = family
    e = engine(loaded, block_size=4, tp=2)
    try:
        assert e.generate(prompts, GREEDY) == alone
        assert all_free(e)
    finally:
        e.shutdown()


def test_a_sliding_group_holds_only_its_window_while_decoding_other_groups_every_block(family):
    _, loaded, prompts, _, _ = family
    e = engine(loaded, block_size=4, prefix=False)
    kvm = e.kv_cache_manager
    null = kvm.pool.null_block.block_id if kvm.pool.null_block is not None else None
    e.add_request("r", prompts[0], GREEDY)
    dropped = []
    e.step()  # the prompt: every block written once
    while e.has_pending_work():
        e.step()  # a decode step allocates for its token first, dropping what a window left behind
        tables = kvm.get_block_ids("r")  # empty once the request finished
        for group, table in zip(kvm.groups, tables if tables[0] else ()):
            live = [b for b in table if b != null]
            if group.sliding_window is None:
                assert len(live) == len(table)  # full attention and MLA keep every block
            else:  # the window's blocks (and the one being filled)
                assert len(live) <= -(-group.sliding_window // 4) + 1
                dropped.append(len(table) - len(live))
    assert (min(dropped) > 0) if loaded.arch.sliding_window else not dropped
    assert all_free(e)
