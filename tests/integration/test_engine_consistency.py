"""The engine on the real default model: a request's greedy output does not depend on
what else is in the batch, on preemption, or on prefix-cache hits."""

import pytest

from kvbridge.config import CacheConfig, EngineConfig, SchedulerConfig
from kvbridge.engine.engine import LLMEngine
from kvbridge.engine.loader import load_model
from kvbridge.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)
QUESTIONS = [
    "What is the capital of France?", "Name three primary colors.", "Write a haiku about the sea.",
    "What is 12 times 12?", "Who wrote Hamlet?", "Give me a synonym for happy.",
    "Explain gravity in one sentence.", "What language is spoken in Brazil?",
]


@pytest.fixture(scope="module")
def loaded():
    return load_model("SmolLM2-135M-Instruct")


@pytest.fixture(scope="module")
def prompts(loaded):
    tok = loaded.tokenizer
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in QUESTIONS]


def engine(loaded, num_blocks=256, block_size=16, budget=2048, prefix=True):
    return LLMEngine(EngineConfig(cache=CacheConfig(block_size=block_size, num_blocks=num_blocks,
                                                    enable_prefix_caching=prefix),
                                  scheduler=SchedulerConfig(max_num_batched_tokens=budget)), loaded)


@pytest.fixture(scope="module")
def alone(loaded, prompts):
    e = engine(loaded, prefix=False)
    return [e.generate([p], GREEDY)[0] for p in prompts]


def test_default_model_answers_sensibly(loaded, alone):
    assert "Paris" in loaded.tokenizer.decode(alone[0])


def test_batch_of_8_matches_each_request_alone(loaded, prompts, alone):
    assert engine(loaded, prefix=False).generate(prompts, GREEDY) == alone


def test_chunked_prefill_matches(loaded, prompts, alone):
    assert engine(loaded, budget=24, prefix=False).generate(prompts[:3], GREEDY) == alone[:3]


def test_preempted_requests_match(loaded, prompts, alone):
    # 8 prompts of ~40 tokens + 12 outputs need ~32 blocks of 16; 12 blocks force preemption.
    e = engine(loaded, num_blocks=12, prefix=False)
    assert e.generate(prompts, GREEDY) == alone
    assert e.metrics().num_preemptions > 0


def test_prefix_cache_hit_matches(loaded, prompts, alone):
    e = engine(loaded, block_size=4)
    first = e.generate([prompts[0]], GREEDY)[0]
    hits_before = e.metrics().prefix_cache_hits
    again = e.generate([prompts[0]], GREEDY)[0]
    assert e.metrics().prefix_cache_hits > hits_before
    assert first == again == alone[0]


def test_seeded_sampling_is_reproducible(loaded, prompts):
    sp = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, top_k=40, seed=1234)
    e = engine(loaded)
    a = e.generate([prompts[1]], sp)[0]
    b = e.generate([prompts[1], prompts[2]], [sp, SamplingParams(max_tokens=5, temperature=1.0)])[0]
    assert a == b


def test_stop_string_and_abort_free_blocks(loaded, prompts):
    e = engine(loaded)
    e.add_request("s", prompts[0], SamplingParams(max_tokens=30, temperature=0, stop=("Paris",)))
    e.add_request("a", prompts[1], SamplingParams(max_tokens=30, temperature=0))
    outs = {}
    e.abort_request("a")
    while e.has_unfinished_requests():
        for o in e.step().outputs:
            outs.setdefault(o.request_id, []).append(o)
    s_text = "".join(o.new_text for o in outs["s"])
    assert "Paris" not in s_text and outs["s"][-1].finish_reason.value == "stop"
    assert outs["a"][-1].finish_reason.value == "abort"
    assert e.metrics().num_free_blocks == e.metrics().num_total_blocks
