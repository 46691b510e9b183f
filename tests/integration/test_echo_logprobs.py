"""Issue 48, echo and prompt logprobs, on one instance with the real default model and the official
`openai` client: what lm-eval's loglikelihood path sends (a token-id prompt, `echo`, `logprobs`,
`max_tokens` 0 or 1) answers the prompt's text and its tokens' logprobs in OpenAI's layout (null for
the first token), equal to a float64 reference; vLLM's `prompt_logprobs` in its layout (rank and
decoded token); streamed as whole; a list of prompts echoes each. Bad input is refused naming the
field and changes nothing; every KV block is back after each test."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch is imported

from typing import Any

import httpx
import pytest
import torch

from tests.integration.api_instance import MAX_MODEL_LEN, MODEL, REMOTE_PREFILL, InstrumentedEngine, Instance, inst, llm, loaded, post, stream_events, blocks_back
from tests.openai_errors import assert_openai_error

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("blocks_back")]

PROMPT = "Question: What is the capital of France?\nAnswer: Paris"
ATOL = 2e-3  # the float32 engine against float64



@pytest.fixture(scope="module")
def reference(hf_smollm2_from_gguf, loaded) -> tuple[list[int], torch.Tensor]:
    """PROMPT's token ids and, per position, the float64 log-softmax of the logits after it."""
    ids = loaded.tokenizer.encode(PROMPT, add_special_tokens=True)
    model = torch.nn.Module.double(hf_smollm2_from_gguf)
    try:
        with torch.inference_mode():
            return ids, torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0], dim=-1)
    finally:
        torch.nn.Module.float(hf_smollm2_from_gguf)


def test_lm_eval_loglikelihood_request_answers_the_prompts_logprobs(inst: Instance, reference) -> None:
    ids, ref = reference
    answer = inst.client().completions.create(model=MODEL, prompt=ids, echo=True, logprobs=1, max_tokens=1,
                                              temperature=0)
    choice = answer.choices[0]
    lp = choice.logprobs
    assert lp is not None and len(lp.tokens) == len(ids) + 1  # the prompt's tokens and the one generated
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for pos in range(1, len(ids)):
        assert lp.token_logprobs[pos] == pytest.approx(float(ref[pos - 1, ids[pos]]), abs=ATOL), pos
        (top_lp,) = lp.top_logprobs[pos].values()
        assert top_lp == pytest.approx(float(ref[pos - 1].max()), abs=ATOL)
    # lm-eval's is_greedy: the token's logprob equals its top-1 where the token is the argmax
    greedy_positions = [p for p in range(1, len(ids)) if int(ref[p - 1].argmax()) == ids[p]]
    assert greedy_positions and all(lp.token_logprobs[p] == max(lp.top_logprobs[p].values()) for p in greedy_positions)
    assert choice.text.startswith(PROMPT) and len(choice.text) > len(PROMPT)
    assert lp.text_offset[0] == 0 and all(b - a == len(t) for a, b, t in zip(lp.text_offset, lp.text_offset[1:], lp.tokens))
    assert answer.usage.prompt_tokens == len(ids) and answer.usage.completion_tokens == 1


def test_max_tokens_zero_with_echo_answers_the_prompt_alone(inst: Instance, reference) -> None:
    ids, ref = reference
    answer = inst.client().completions.create(model=MODEL, prompt=PROMPT, echo=True, logprobs=0, max_tokens=0)
    choice = answer.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert len(choice.logprobs.tokens) == len(ids) and choice.logprobs.top_logprobs[1] == {}
    assert choice.logprobs.token_logprobs[-1] == pytest.approx(float(ref[-2, ids[-1]]), abs=ATOL)
    assert answer.usage.completion_tokens == 0 and answer.usage.prompt_tokens == len(ids)
    plain = inst.client().completions.create(model=MODEL, prompt=PROMPT, echo=True, max_tokens=0)
    assert plain.choices[0].text == PROMPT and plain.choices[0].logprobs is None


def test_vllm_prompt_logprobs_layout(inst: Instance, reference) -> None:
    ids, ref = reference
    r = post(inst, "/v1/completions", {"model": MODEL, "prompt": ids, "max_tokens": 2, "temperature": 0,
                                       "prompt_logprobs": 2})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["logprobs"] is None and not choice["text"].startswith(PROMPT)  # no echo asked
    got = choice["prompt_logprobs"]
    assert len(got) == len(ids) and got[0] is None
    for pos in range(1, len(ids)):
        row = ref[pos - 1]
        entry = got[pos][str(ids[pos])]
        assert entry["logprob"] == pytest.approx(float(row[ids[pos]]), abs=ATOL)
        assert entry["decoded_token"] == inst_token_text(inst, ids[pos])
        assert float(torch.sort(row, descending=True).values[entry["rank"] - 1]) == pytest.approx(
            entry["logprob"], abs=ATOL)
        ranked = sorted((e for tid, e in got[pos].items() if e["rank"] <= 2), key=lambda e: e["rank"])
        assert [e["rank"] for e in ranked] == [1, 2]
        assert [e["logprob"] for e in ranked] == pytest.approx(torch.topk(row, 2).values.tolist(), abs=ATOL)
    chat = post(inst, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                                               "max_tokens": 1, "prompt_logprobs": 0})
    assert chat.status_code == 200, chat.text
    body = chat.json()
    assert body["prompt_logprobs"][0] is None and len(body["prompt_logprobs"]) == body["usage"]["prompt_tokens"]


def inst_token_text(inst: Instance, token_id: int) -> str:
    r = post(inst, "/detokenize", {"model": MODEL, "tokens": [token_id]})
    return str(r.json()["prompt"])


@pytest.mark.parametrize("max_tokens", [0, 4])
def test_streamed_echo_equals_the_whole_answer(inst: Instance, max_tokens: int) -> None:
    body = {"prompt": PROMPT, "echo": True, "logprobs": 2, "max_tokens": max_tokens, "temperature": 0}
    whole = post(inst, "/v1/completions", {"model": MODEL, **body}).json()["choices"][0]
    events = stream_events(inst, {"model": MODEL, **body, "stream": True})
    assert events[-1] == "[DONE]"
    choices = [c for e in events[:-1] for c in e["choices"]]
    assert "".join(c["text"] for c in choices) == whole["text"]
    assert choices[0]["text"].startswith(PROMPT)  # the prompt goes with the first chunk
    tokens = [t for c in choices if c["logprobs"] for t in c["logprobs"]["tokens"]]
    logprobs = [x for c in choices if c["logprobs"] for x in c["logprobs"]["token_logprobs"]]
    offsets = [x for c in choices if c["logprobs"] for x in c["logprobs"]["text_offset"]]
    assert tokens == whole["logprobs"]["tokens"] and offsets == whole["logprobs"]["text_offset"]
    assert logprobs[0] is None and logprobs[1:] == pytest.approx(whole["logprobs"]["token_logprobs"][1:], abs=1e-6)
    assert choices[-1]["finish_reason"] == whole["finish_reason"]


def test_a_list_of_prompts_echoes_each(inst: Instance) -> None:
    prompts = ["The capital of France is", "1, 2, 3,"]
    answer = inst.client().completions.create(model=MODEL, prompt=prompts, echo=True, max_tokens=0, logprobs=0)
    assert [c.text for c in sorted(answer.choices, key=lambda c: c.index)] == prompts
    assert answer.usage.completion_tokens == 0


def test_prompt_logprobs_with_kv_from_another_instance_is_refused_and_p_told(inst: Instance,
                                                                            llm: InstrumentedEngine) -> None:
    r = post(inst, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "echo": True, "logprobs": 1,
                                       "kv_transfer_params": REMOTE_PREFILL})
    assert "prompt_logprobs" in assert_openai_error(r, 400)["message"]
    assert [rid for rid, _ in llm.notified] == [r.headers["x-request-id"]]  # P frees the KV it held


@pytest.mark.parametrize("body, param", [({"max_tokens": 0}, "max_tokens"), ({"prompt_logprobs": 21}, "prompt_logprobs"),
                                         ({"echo": 1}, "echo")])
def test_bad_echo_requests_are_400_naming_the_field(inst: Instance, body: dict[str, Any], param: str) -> None:
    r = post(inst, "/v1/completions", {"model": MODEL, "prompt": PROMPT, **body})
    assert_openai_error(r, 400, param=param)


def test_tokenizer_info_names_what_a_remote_tokenizer_needs(inst: Instance, loaded) -> None:
    """vLLM's GET /tokenizer_info, which lm-eval's `remote` tokenizer reads (then /tokenize, /detokenize)."""
    r = httpx.get(inst.url + "/tokenizer_info", timeout=30)
    assert r.status_code == 200, r.text
    info = r.json()
    tokenizer = loaded.tokenizer
    assert info["eos_token"] == tokenizer.token_text(tokenizer.eos_token_id)
    assert info["chat_template"] == tokenizer.chat_template and info["model_max_length"] == MAX_MODEL_LEN
    # lm-eval finds the eos id by tokenising its text without special tokens
    ids = post(inst, "/tokenize", {"prompt": info["eos_token"], "add_special_tokens": False}).json()["tokens"]
    assert ids == [tokenizer.eos_token_id]
