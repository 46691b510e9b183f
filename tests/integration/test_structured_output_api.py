"""Issue 48, structured output, on one instance with the real default model and the official `openai`
client: OpenAI's response_format (json_schema, json_object) and vLLM's structured_outputs and guided_*
(regex, choice, grammar) constrain every sampled token, whole and streamed, greedy and sampled, in
completions and chat; what cannot compile is a 400 naming the field; every block back after each test."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch is imported

import json
import re
from typing import Any

import httpx
import pytest

from tests.integration.api_instance import MODEL, Instance, inst, llm, loaded, post, blocks_back
from tests.openai_errors import assert_openai_error

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("blocks_back")]

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Describe a cat named Tom who is 3 years old, as JSON."}]



def check_person(text: str) -> None:
    value = json.loads(text)
    assert set(value) == {"name", "age"} and isinstance(value["name"], str) and len(value["name"]) <= 12
    assert type(value["age"]) is int and 0 <= value["age"] <= 120


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_json_schema_holds_for_chat_whole_and_streamed(inst: Instance, temperature: float) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    client = inst.client()
    answer = client.chat.completions.create(model=MODEL, messages=ASK, response_format=fmt, max_tokens=60,
                                            temperature=temperature, seed=4)
    assert answer.choices[0].finish_reason == "stop"
    check_person(answer.choices[0].message.content)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=ASK, response_format=fmt, max_tokens=60, temperature=temperature, seed=4, stream=True)
        if c.choices)
    assert streamed == answer.choices[0].message.content


def test_json_object_gives_json(inst: Instance) -> None:
    answer = inst.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": 'Reply with {"ok": true} and nothing else.'}],
        response_format={"type": "json_object"}, max_tokens=40, temperature=0)
    assert answer.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(answer.choices[0].message.content), dict)


@pytest.mark.parametrize("fields, check", [
    ({"structured_outputs": {"regex": r"[0-9]{3}-[0-9]{4}"}}, lambda t: re.fullmatch(r"[0-9]{3}-[0-9]{4}", t)),
    ({"guided_regex": r"(red|green|blue) (car|boat)"}, lambda t: re.fullmatch(r"(red|green|blue) (car|boat)", t)),
    ({"structured_outputs": {"choice": ["Paris", "London", "Rome"]}}, lambda t: t in ("Paris", "London", "Rome")),
    ({"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
    ({"structured_outputs": {"grammar": 'root ::= "The answer is " [0-9] [0-9]? "."'}},
     lambda t: re.fullmatch(r"The answer is [0-9]{1,2}\.", t)),
    ({"guided_json": PERSON}, lambda t: check_person(t) is None),
])
def test_vllm_structured_outputs_constrain_completions(inst: Instance, fields: dict[str, Any], check) -> None:
    for temperature in (0.0, 1.2):
        r = post(inst, "/v1/completions", {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 40,
                                           "temperature": temperature, "seed": 9, **fields})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "stop" and check(choice["text"]), choice


def test_n_samples_each_follow_the_grammar(inst: Instance) -> None:
    answer = inst.client().completions.create(model=MODEL, prompt="Pick one:", n=4, max_tokens=5, temperature=1.5,
                                              seed=2, extra_body={"guided_choice": ["alpha", "beta", "gamma"]})
    assert all(c.text in ("alpha", "beta", "gamma") for c in answer.choices)


@pytest.mark.parametrize("fields, param", [
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"structured_outputs": {"grammar": "root ::= "}}, "structured_outputs"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 7}}}}, "response_format"),
    ({"response_format": {"type": "grammar"}}, "response_format"),
    ({"guided_json": PERSON, "guided_regex": "a"}, "guided_regex"),
])
def test_what_cannot_compile_is_400_naming_the_field(inst: Instance, fields: dict[str, Any], param: str) -> None:
    r = post(inst, "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 4, **fields})
    assert_openai_error(r, 400, param=param)


def test_structured_streams_end_with_the_grammar(inst: Instance) -> None:
    body = {"model": MODEL, "prompt": "Phone:", "max_tokens": 30, "temperature": 0, "stream": True,
            "structured_outputs": {"regex": r"[0-9]{3}-[0-9]{4}"}}
    text, reasons = "", []
    with httpx.stream("POST", inst.url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    text += c["text"]
                    reasons.append(c["finish_reason"])
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", text) and reasons[-1] == "stop"
