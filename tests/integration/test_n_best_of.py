"""Issue 48, n > 1 and best_of, on the default model: vLLM's semantics (each sequence its own request,
seed + index per sequence, choice index prompt * n + sample, each prompt's tokens counted once;
best_of: the n of highest cumulative logprob). The engine: a prompt's later sequences wait for the
first to compute its prompt, then take its full blocks from the prefix cache (computed once). The
server, with the official openai client: whole and streamed, completions and chat, lists, bad input
refused naming the field; every KV block back after each test."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch is imported

import json
from typing import Any

import httpx
import pytest

from kvbridge.config import CacheConfig, EngineConfig
from kvbridge.engine.engine import LLMEngine
from kvbridge.engine.sampling_params import SamplingParams
from tests.integration.api_instance import MODEL, Instance, inst, llm, loaded, post, blocks_back
from tests.engine_runs import run_to_end
from tests.openai_errors import assert_openai_error

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("blocks_back")]

PROMPT = ("Write one sentence about the sea, the wind and the boats that sail between the islands "
          "when the summer ends and the")  # about 25 tokens: one full block of 16 and a part
SAMPLED: dict[str, Any] = {"max_tokens": 6, "temperature": 1.0, "seed": 11}



def test_siblings_take_the_first_ones_prompt_blocks_and_sample_as_alone(loaded) -> None:
    ids = loaded.tokenizer.encode(PROMPT * 2)  # > 2 blocks
    params = [SamplingParams(max_tokens=5, temperature=1.0, seed=3 + j) for j in range(4)]
    engine = LLMEngine(EngineConfig(cache=CacheConfig(num_blocks=64)), loaded)
    try:
        shared = run_to_end(engine, {f"s-{j}": (ids, p, None if j == 0 else "s-0") for j, p in enumerate(params)})
        alone = {}
        for j, p in enumerate(params):
            engine.reset_prefix_cache()
            alone[j] = run_to_end(engine, {f"a-{j}": (ids, p)})[f"a-{j}"]
        metrics = engine.metrics()
    finally:
        engine.shutdown()
    full = (len(ids) - 1) // 16 * 16
    assert shared["s-0"][-1].num_cached_tokens == 0
    assert [shared[f"s-{j}"][-1].num_cached_tokens for j in (1, 2, 3)] == [full] * 3  # computed once
    for j in range(4):  # each sequence as its seed alone gives: sharing changes no token
        assert [t for o in shared[f"s-{j}"] for t in o.new_token_ids] == [t for o in alone[j] for t in o.new_token_ids]
    assert metrics.num_free_blocks == metrics.num_total_blocks


def test_n_samples_each_with_seed_plus_index_and_counts_the_prompt_once(inst: Instance) -> None:
    client = inst.client()
    answer = client.completions.create(model=MODEL, prompt=PROMPT, n=3, **SAMPLED)
    assert [c.index for c in answer.choices] == [0, 1, 2]
    singles = [client.completions.create(model=MODEL, prompt=PROMPT, **{**SAMPLED, "seed": 11 + j}) for j in range(3)]
    assert [c.text for c in answer.choices] == [s.choices[0].text for s in singles]
    assert len({c.text for c in answer.choices}) > 1  # sampled, not copied
    assert answer.usage.prompt_tokens == singles[0].usage.prompt_tokens
    assert answer.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)


def test_a_list_times_n_numbers_choices_prompt_by_prompt(inst: Instance) -> None:
    prompts = ["The capital of France is", "Once upon a time"]
    answer = inst.client().completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=4, temperature=0)
    by_index = {c.index: c.text for c in answer.choices}
    assert sorted(by_index) == [0, 1, 2, 3]
    alone = [inst.client().completions.create(model=MODEL, prompt=p, max_tokens=4, temperature=0).choices[0].text
             for p in prompts]
    assert [by_index[i] for i in range(4)] == [alone[0], alone[0], alone[1], alone[1]]  # greedy: equal samples


def test_best_of_answers_the_n_of_highest_cumulative_logprob(inst: Instance) -> None:
    client = inst.client()
    answer = client.completions.create(model=MODEL, prompt=PROMPT, n=2, best_of=4, **SAMPLED)
    singles = [client.completions.create(model=MODEL, prompt=PROMPT, logprobs=0, **{**SAMPLED, "seed": 11 + j})
               for j in range(4)]
    ranked = sorted(singles, key=lambda s: -sum(s.choices[0].logprobs.token_logprobs))
    assert [c.text for c in answer.choices] == [s.choices[0].text for s in ranked[:2]]
    assert [c.index for c in answer.choices] == [0, 1] and answer.choices[0].logprobs is None  # not asked
    assert answer.usage.completion_tokens == sum(s.usage.completion_tokens for s in ranked[:2])


def test_streamed_n_carries_each_choices_chunks_under_its_index(inst: Instance) -> None:
    whole = post(inst, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "n": 3, **SAMPLED}).json()
    events = []
    body = {"model": MODEL, "prompt": PROMPT, "n": 3, "stream": True, "stream_options": {"include_usage": True},
            **SAMPLED}
    with httpx.stream("POST", inst.url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
    texts: dict[int, str] = {}
    for e in events:
        for c in e["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    assert [texts[i] for i in range(3)] == [c["text"] for c in whole["choices"]]
    assert events[-1]["usage"] == whole["usage"]


def test_chat_n_whole_and_streamed(inst: Instance) -> None:
    messages = [{"role": "user", "content": "Name a colour."}]
    answer = inst.client().chat.completions.create(model=MODEL, messages=messages, n=2, **SAMPLED)
    assert [c.index for c in answer.choices] == [0, 1]
    roles: dict[int, str] = {}
    texts: dict[int, str] = {}
    for chunk in inst.client().chat.completions.create(model=MODEL, messages=messages, n=2, stream=True, **SAMPLED):
        for c in chunk.choices:
            if c.delta.role:
                roles[c.index] = c.delta.role
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    assert roles == {0: "assistant", 1: "assistant"}
    assert [texts[0], texts[1]] == [c.message.content for c in answer.choices]


@pytest.mark.parametrize("body, param", [({"n": 0}, "n"), ({"n": 1025}, "n"), ({"n": 3, "best_of": 2}, "best_of"),
                                         ({"best_of": 2, "stream": True}, "best_of"),
                                         ({"prompt": ["a"] * 300, "n": 4}, "n"),
                                         ({"n": 2, "kv_transfer_params": {"do_remote_decode": True}}, "n")])
def test_bad_n_and_best_of_are_400_naming_the_field(inst: Instance, body: dict[str, Any], param: str) -> None:
    assert_openai_error(post(inst, "/v1/completions", {"model": MODEL, "prompt": PROMPT, **body}), 400, param=param)


def test_echo_with_n_echoes_each_choices_own_prompt(inst: Instance) -> None:
    prompts = ["The capital of France is", "1, 2, 3,"]
    answer = inst.client().completions.create(model=MODEL, prompt=prompts, n=2, echo=True, max_tokens=2,
                                              temperature=0, logprobs=0)
    by_index = {c.index: c for c in answer.choices}
    assert sorted(by_index) == [0, 1, 2, 3]
    for index, choice in by_index.items():
        assert choice.text.startswith(prompts[index // 2]) and choice.logprobs.token_logprobs[0] is None
