"""Issue 48, structured output, without a model: the request fields that ask for it (OpenAI's
response_format, vLLM's structured_outputs and guided_*) as specs, or a refusal naming the field; the
bitmask the sampler applies equals xgrammar's own; the sampler never samples a forbidden id; a
matcher compiled against a byte-level vocabulary accepts exactly the grammar's texts."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
import xgrammar as xgr
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers

from kvbridge.engine.sampling import Sampler
from kvbridge.engine.sampling_params import SamplingParams
from kvbridge.engine.structured import Grammars, StructuredOutputError, StructuredSpec, accept, apply_bitmask
from kvbridge.engine.tokenizer import Tokenizer
from kvbridge.server.protocol import ChatCompletionRequest, CompletionRequest

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("fields, spec", [
    ({}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, StructuredSpec("json_object", "", "response_format")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
     StructuredSpec("json", json.dumps(SCHEMA), "response_format")),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, StructuredSpec("json", json.dumps(SCHEMA), "structured_outputs")),
    ({"structured_outputs": {"regex": "a+"}}, StructuredSpec("regex", "a+", "structured_outputs")),
    ({"structured_outputs": {"choice": ["x", "y"]}}, StructuredSpec("choice", '["x", "y"]', "structured_outputs")),
    ({"structured_outputs": {"grammar": 'root ::= "a"', "whitespace_pattern": None}},
     StructuredSpec("grammar", 'root ::= "a"', "structured_outputs")),
    ({"structured_outputs": {"json_object": True}}, StructuredSpec("json_object", "", "structured_outputs")),
    ({"guided_json": SCHEMA}, StructuredSpec("json", json.dumps(SCHEMA), "guided_json")),
    ({"guided_regex": "[0-9]+"}, StructuredSpec("regex", "[0-9]+", "guided_regex")),
    ({"guided_choice": ["yes", "no"]}, StructuredSpec("choice", '["yes", "no"]', "guided_choice")),
    ({"guided_grammar": 'root ::= "b"'}, StructuredSpec("grammar", 'root ::= "b"', "guided_grammar")),
])
def test_the_fields_that_ask_for_structure_become_one_spec(fields: dict[str, Any], spec: StructuredSpec | None) -> None:
    assert CompletionRequest.model_validate({"prompt": "x", **fields}).structured_spec() == spec
    chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], **fields})
    assert chat.structured_spec() == spec


@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": "not json"}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}}, "response_format"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs"),
    ({"structured_outputs": {"regex": ""}}, "structured_outputs"),
    ({"guided_regex": "a", "guided_grammar": "g"}, "guided_grammar"),
    ({"guided_choice": ["a", ""]}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
])
def test_malformed_or_conflicting_structure_is_refused_naming_the_field(fields: dict[str, Any], param: str) -> None:
    request = CompletionRequest.model_validate({"prompt": "x", **fields})
    with pytest.raises(StructuredOutputError) as caught:
        request.structured_spec()
    assert caught.value.param == param and param in str(caught.value)


def byte_level_tokenizer(words: list[str]) -> Tokenizer:
    """A tiny byte-level BPE vocabulary: every byte, these words, and an end token (id = len - 1)."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    for w in words:
        vocab.setdefault(w, len(vocab))
    vocab["<end>"] = len(vocab)
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["<end>"])
    return Tokenizer(backend, bos_token_id=None, eos_token_id=vocab["<end>"], chat_template=None)


@pytest.fixture(scope="module")
def tiny() -> tuple[Tokenizer, Grammars]:
    tokenizer = byte_level_tokenizer(["yes", "no", "ye"])
    return tokenizer, Grammars(tokenizer, tokenizer.vocab_size + 5)  # logits wider than the vocabulary


def test_the_bitmask_forbids_what_xgrammar_forbids(tiny) -> None:
    tokenizer, grammars = tiny
    mask = grammars.bitmask(grammars.matcher(StructuredSpec("choice", '["yes", "no"]')))
    ours = torch.zeros(1, tokenizer.vocab_size + 5)
    theirs = ours.clone()
    apply_bitmask(ours[0], mask)
    xgr.apply_token_bitmask_inplace(theirs, mask.unsqueeze(0))
    assert torch.equal(ours, theirs)
    allowed = {tokenizer.token_text(i) for i in torch.nonzero(ours[0] == 0).flatten().tolist()}
    assert allowed == {"y", "n", "yes", "no", "ye"}


def test_a_matcher_accepts_the_grammars_texts_and_ends_with_it(tiny) -> None:
    tokenizer, grammars = tiny
    matcher = grammars.matcher(StructuredSpec("choice", '["yes", "no"]'))
    ye, s = tokenizer.token_to_id("ye"), tokenizer.token_to_id("s")
    assert accept(matcher, ye) == (True, False)
    assert accept(matcher, tokenizer.token_to_id("x"))[0] is False  # refused: the matcher stays where it was
    assert accept(matcher, s) == (True, False)
    assert accept(matcher, tokenizer.eos_token_id) == (True, True)
    continued = grammars.matcher(StructuredSpec("regex", "(yes|no)"), continued=[tokenizer.token_to_id("no")])
    assert accept(continued, tokenizer.eos_token_id) == (True, True)
    with pytest.raises(StructuredOutputError, match="continue_from_token_ids"):
        grammars.matcher(StructuredSpec("regex", "(yes|no)"), continued=[ye, ye])


@pytest.mark.parametrize("spec", [StructuredSpec("regex", "(unclosed", "guided_regex"),
                                  StructuredSpec("grammar", "root ::= ", "structured_outputs"),
                                  StructuredSpec("json", '{"type": "nonsense-type"}', "response_format")])
def test_a_spec_that_cannot_compile_names_its_field(tiny, spec: StructuredSpec) -> None:
    with pytest.raises(StructuredOutputError) as caught:
        tiny[1].compile(spec)
    assert caught.value.param == spec.field


def test_the_sampler_never_samples_a_forbidden_id(tiny) -> None:
    tokenizer, grammars = tiny
    mask = grammars.bitmask(grammars.matcher(StructuredSpec("regex", "no")))
    n = tokenizer.token_to_id("n")
    no = tokenizer.token_to_id("no")
    sampler = Sampler(seed=0)
    logits = torch.zeros(3, tokenizer.vocab_size + 5)
    logits[:, 0] = 50.0  # the likeliest id by far is forbidden
    params = [SamplingParams(temperature=0, logprobs=0), SamplingParams(temperature=1.0, seed=1), SamplingParams()]
    for _ in range(20):
        out = sampler.sample(logits, ["a", "b", "c"], params, masks={0: mask, 1: mask})
        assert out.tokens["a"] in (n, no) and out.tokens["b"] in (n, no)
        assert out.logprobs["a"].top == () and out.logprobs["a"].logprob < -40  # the model's logprob, not the mask's
        assert out.tokens["c"] == 0  # an unconstrained row is untouched
