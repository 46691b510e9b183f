"""OpenAI's request bodies of /v1/completions and /v1/chat/completions as the instance server
validates them: pydantic models at the HTTP edge that turn into the engine's SamplingParams, and
the engine's logprobs in OpenAI's response layouts. The shapes both programs share (body
reading, errors, responses, stream chunks) are in kvbridge/openai_wire.py.

Requests are validated strictly (a string is not an int, a bool is not a number) and
unknown fields are ignored, because OpenAI clients send extras. Every check a client
can fail is a pydantic validator, so the server turns all of them into one HTTP 400.
Features that would change what the client gets back and that kvbridge does not
implement (suffix, presence and frequency penalties, tools) are refused rather than ignored.
`n` and `best_of` are vLLM's: each sequence its own engine request, seeds `seed + index`. Structured
output (response_format, structured_outputs, guided_*) becomes one StructuredSpec (`structured_spec`). `echo` and vLLM's `prompt_logprobs` are served (a completion with echo and
`logprobs` returns the prompt's logprobs, as vLLM; `max_tokens: 0` with echo returns the prompt alone). A sampling field left out (None) takes the model's default (--generation-config).
A completion's `prompt` takes OpenAI's four forms (a text, a list of texts, a list of token ids, a
list of token-id lists): `CompletionRequest.prompts` lists them, one choice each. Token ids (the
prompt's, logit_bias', stop_token_ids') are checked against the vocabulary where it is known
(`check_token_ids`, errors.py). /tokenize and /detokenize take vLLM's bodies; /tokenizer_info answers as vLLM's.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Annotated, Any, Literal, cast

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from kvbridge.engine.setup.generation_config import SamplingDefaults
from kvbridge.engine.outputs import TokenLogprob
from kvbridge.engine.sampling_params import MAX_LOGIT_BIAS, SEED_MAX, SEED_MIN, SamplingParams
from kvbridge.engine.structured import StructuredOutputError, StructuredSpec
from kvbridge.openai_wire import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, PromptLogprob, TopLogprob

MAX_LOGPROBS = 20  # SamplingParams' limit
MAX_STOP_STRINGS = 16
COMPLETION_MAX_TOKENS = 16  # a completion's max_tokens when neither it nor the model gives one (OpenAI's)
# Prompts in one completions request at most: each is an engine request (and, through the proxy,
# a P/D path of its own); the body cap alone would let one request queue a million.
MAX_PROMPTS = 1024
# Sequences one request may sample (prompts x max(n, best_of)): each is an engine request.
MAX_SEQUENCES = 1024

TokenId = Annotated[int, Field(ge=0)]


# ---------------------------------------------------------------- requests


def _refused_when_set(cls: type[BaseModel], value: Any, info: ValidationInfo) -> Any:
    """The validator of a field kvbridge does not serve: a value that asks for it (true, a text)
    is refused naming the field, never ignored."""
    if value:
        raise ValueError(f"{info.field_name} is not supported")
    return value


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    include_usage: bool = False


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None  # None: the served model
    # Sampling: None (omitted) takes the model's default (--generation-config), else OpenAI's.
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)  # extension; 0 or -1 disable it
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)  # extension; 0 disables it
    repetition_penalty: float | None = Field(default=None, gt=0.0)  # extension; 1 disables it
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None  # extension
    include_stop_str_in_output: bool = False  # extension
    ignore_eos: bool = False  # extension
    min_tokens: int = Field(default=0, ge=0)  # extension: no stop token (nor stop string) before this many
    n: int = Field(default=1, ge=1, le=MAX_SEQUENCES)  # choices per prompt, each sampled on its own (vLLM's)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    kv_transfer_params: dict[str, Any] | None = None  # parsed by kvbridge.kv_transfer.params
    # extension: with kv_transfer_params from a prefill instance, the tokens it sampled, which
    # the proxy already streamed: the answer continues from them (engine.add_request `continued`)
    continue_from_token_ids: list[TokenId] | None = None

    # vLLM extension: each prompt token's logprob (after the first), rank and this many top alternatives
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # Structured output (engine/structured.py): OpenAI's response_format, vLLM's structured_outputs and
    # its older guided_* names; at most one of them (structured_spec).
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def structured_spec(self) -> StructuredSpec | None:
        """What the output must match, or None; StructuredOutputError (naming the field) when the
        fields ask for something malformed, unsupported or for two things at once."""
        specs = [spec for spec in (_response_format(self.response_format), _structured_outputs(self.structured_outputs),
                                   _guided(self)) if spec is not None]
        if len(specs) > 1:
            raise StructuredOutputError(f"{specs[1].field}: only one of response_format, structured_outputs and "
                                        f"guided_* may be given (also {specs[0].field})", specs[1].field)
        return specs[0] if specs else None

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalties(cls, value: float) -> float:
        if value != 0.0:
            raise ValueError("presence and frequency penalties are not supported")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key in value or {}:
            digits = key.removeprefix("-")  # a negative id is an integer: refused as out of vocabulary
            if not digits.isascii() or not digits.isdigit() or len(digits) > 10:
                raise ValueError(f"Found token_id `{key}` in logit_bias but token_id must be an integer "
                                 "or string representing an integer")
        return value

    @property
    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        """logit_bias as (token id, bias) pairs, each bias clamped to +-100 (OpenAI's range, vLLM's clamp)."""
        return tuple(sorted((int(k), min(MAX_LOGIT_BIAS, max(-MAX_LOGIT_BIAS, b)))
                            for k, b in (self.logit_bias or {}).items()))

    def token_id_fields(self) -> dict[str, list[int]]:
        """The token ids of each field that names some (checked against the vocabulary)."""
        return {"logit_bias": [t for t, _ in self.logit_bias_pairs], "stop_token_ids": list(self.stop_token_ids or ())}

    @field_validator("stop")
    @classmethod
    def _sane_stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are supported")
        return value

    @field_validator("stream_options")
    @classmethod
    def _options_need_stream(cls, value: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if value is not None and not info.data.get("stream", False):
            raise ValueError("stream_options is only allowed when stream is true")
        return value

    @property
    def samples(self) -> int:
        """Sequences sampled per prompt (best_of's ranking keeps n of them)."""
        return self.n

    @property
    def include_usage_chunk(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def wanted_prompt_logprobs(self) -> int | None:
        """The prompt logprobs the answer needs (vLLM's rule: prompt_logprobs, else with echo the
        completion's `logprobs`)."""
        return self.prompt_logprobs

    def _sampling_params(self, max_tokens: int, logprobs: int | None, defaults: SamplingDefaults) -> SamplingParams:
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return SamplingParams(
            max_tokens=max_tokens, temperature=_given(self.temperature, defaults.temperature, 1.0),
            top_p=_given(self.top_p, defaults.top_p, 1.0), top_k=max(_given(self.top_k, defaults.top_k, 0), 0),
            min_p=_given(self.min_p, defaults.min_p, 0.0),
            repetition_penalty=_given(self.repetition_penalty, defaults.repetition_penalty, 1.0),
            seed=self.seed, stop=tuple(stops),
            stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos,
            logprobs=logprobs, include_stop_str_in_output=self.include_stop_str_in_output,
            min_tokens=self.min_tokens, logit_bias=self.logit_bias_pairs,
            prompt_logprobs=self.wanted_prompt_logprobs, structured=self.structured_spec())


def _schema_text(schema: Any, field: str) -> str:
    """A JSON schema (an object, or its JSON text) as JSON text."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            raise StructuredOutputError(f"{field}: the schema is not valid JSON", field) from None
    if not isinstance(schema, dict):
        raise StructuredOutputError(f"{field}: the schema must be a JSON object", field)
    return json.dumps(schema)


def _response_format(value: dict[str, Any] | None) -> StructuredSpec | None:
    """OpenAI's response_format: text (nothing), json_object, json_schema {name, schema, strict}."""
    if value is None or value.get("type") == "text":
        return None
    kind = value.get("type")
    if kind == "json_object":
        return StructuredSpec("json_object", field="response_format")
    if kind == "json_schema":
        body = value.get("json_schema")
        schema = body.get("schema") if isinstance(body, dict) else None
        if schema is None:
            raise StructuredOutputError("response_format: json_schema needs {\"json_schema\": {\"schema\": ...}}",
                                        "response_format")
        return StructuredSpec("json", _schema_text(schema, "response_format"), "response_format")
    raise StructuredOutputError(f"response_format: type must be text, json_object or json_schema, got {kind!r}",
                                "response_format")


_STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


def _structured_outputs(value: dict[str, Any] | None) -> StructuredSpec | None:
    """vLLM's structured_outputs: exactly one of json, regex, choice, grammar, json_object."""
    if value is None:
        return None
    field = "structured_outputs"
    unknown = sorted(k for k, v in value.items() if k not in _STRUCTURED_KINDS and v not in (None, False))
    if unknown:
        raise StructuredOutputError(f"{field}: {', '.join(unknown)} not supported (json, regex, choice, grammar, "
                                    "json_object are)", field)
    given = [k for k in _STRUCTURED_KINDS if value.get(k) not in (None, False)]
    if len(given) != 1:
        raise StructuredOutputError(f"{field}: exactly one of {', '.join(_STRUCTURED_KINDS)} must be given", field)
    return _spec(given[0], value[given[0]], field)


def _guided(request: _Request) -> StructuredSpec | None:
    """vLLM's older guided_json / guided_regex / guided_choice / guided_grammar (one of them)."""
    given = [(k, getattr(request, f"guided_{k}")) for k in ("json", "regex", "choice", "grammar")
             if getattr(request, f"guided_{k}") is not None]
    if len(given) > 1:
        raise StructuredOutputError(f"guided_{given[1][0]}: only one guided_* field may be given", f"guided_{given[1][0]}")
    return _spec(given[0][0], given[0][1], f"guided_{given[0][0]}") if given else None


def _spec(kind: str, value: Any, field: str) -> StructuredSpec:
    if kind == "json":
        return StructuredSpec("json", _schema_text(value, field), field)
    if kind == "json_object":
        return StructuredSpec("json_object", field=field)
    if kind == "choice":
        if not (isinstance(value, list) and value and all(isinstance(c, str) and c for c in value)):
            raise StructuredOutputError(f"{field}: choice must be a non-empty list of non-empty strings", field)
        return StructuredSpec("choice", json.dumps(value), field)
    if not (isinstance(value, str) and value):
        raise StructuredOutputError(f"{field}: {kind} must be a non-empty string", field)
    return StructuredSpec("regex" if kind == "regex" else "grammar", value, field)


def _given(value: Any, default: Any, neutral: Any) -> Any:
    """The request's value, else the model's default, else OpenAI's (`neutral`)."""
    return value if value is not None else default if default is not None else neutral


class CompletionRequest(_Request):
    """POST /v1/completions. `prompt` in OpenAI's four forms; `prompts` lists them, one per choice."""

    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    echo: bool = False  # the answer's text (and logprobs) start with the prompt's (before max_tokens: its check reads it)
    # None: the model's default, else COMPLETION_MAX_TOKENS; 0 only with echo (the prompt alone, as vLLM)
    max_tokens: int | None = Field(default=None, ge=0)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _sane_prompts(cls, value: Any) -> Any:
        if not value:
            raise ValueError("prompt must not be empty")
        if is_prompt_list(value):
            if len(value) > MAX_PROMPTS:
                raise ValueError(f"at most {MAX_PROMPTS} prompts per request are supported, got {len(value)}")
            if not all(value):
                raise ValueError("prompt must not contain an empty prompt")
        return value

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts, in order: one for a text or a list of token ids, else one per list entry."""
        prompt = self.prompt
        return list(cast("list[str] | list[list[int]]", prompt)) if is_prompt_list(prompt) else [
            cast("str | list[int]", prompt)]

    @field_validator("best_of")
    @classmethod
    def _best_of_n(cls, value: int | None, info: ValidationInfo) -> int | None:
        """vLLM's best_of: that many sequences sampled, the n of highest cumulative logprob answered."""
        if value is None:
            return value
        n = info.data.get("n", 1)
        if value < n or value > MAX_SEQUENCES:
            raise ValueError(f"best_of must be between n={n} and {MAX_SEQUENCES}, got {value}")
        if value > n and info.data.get("stream"):
            raise ValueError("best_of greater than n cannot be streamed (the best are known only at the end)")
        return value

    @property
    def samples(self) -> int:
        return self.best_of or self.n

    _not_supported = field_validator("suffix")(classmethod(_refused_when_set))

    @field_validator("max_tokens")
    @classmethod
    def _zero_tokens_only_with_echo(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value == 0 and not info.data.get("echo", False):
            raise ValueError("max_tokens must be at least 1 (0 is only allowed with echo)")
        return value

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: the answer is the prompt (and its logprobs); nothing is generated."""
        return self.echo and self.max_tokens == 0

    @property
    def wanted_prompt_logprobs(self) -> int | None:
        return self.prompt_logprobs if self.prompt_logprobs is not None else self.logprobs if self.echo else None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def to_sampling_params(self, max_tokens: int, defaults: SamplingDefaults) -> SamplingParams:
        return self._sampling_params(max_tokens, self.logprobs, defaults)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    type: str
    text: str | None = None

    @field_validator("type")
    @classmethod
    def _text_only(cls, value: str) -> str:
        if value != "text":
            raise ValueError(f"content parts of type {value!r} are not supported (text only)")
        return value


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None

    def as_template_message(self) -> dict[str, str]:
        """The {"role", "content"} dict the chat template takes ("developer" is OpenAI's
        newer name for "system")."""
        parts = self.content if isinstance(self.content, list) else [self.content or ""]
        text = "".join(p if isinstance(p, str) else p.text or "" for p in parts)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatCompletionRequest(_Request):
    """POST /v1/chat/completions. Without max_tokens the answer may fill the context."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[Any] | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("logprobs", False):
            raise ValueError("top_logprobs requires logprobs to be true")
        return value

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, value: list[Any] | None) -> list[Any] | None:
        if value:
            raise ValueError("tools are not supported")
        return value

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def to_sampling_params(self, max_tokens: int, defaults: SamplingDefaults) -> SamplingParams:
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, logprobs, defaults)


def is_prompt_list(prompt: object) -> bool:
    """Whether a completion's `prompt` is a list of prompts (texts or token-id lists), not one."""
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], (str, list))


# ---------------------------------------------------------------- /tokenize and /detokenize


class TokenizeCompletionRequest(BaseModel):
    """POST /tokenize with a prompt (vLLM's TokenizeCompletionRequest)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(BaseModel):
    """POST /tokenize with messages (vLLM's TokenizeChatRequest), through the chat template."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool | None = False

    _not_supported = field_validator("continue_final_message")(classmethod(_refused_when_set))


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizerInfoResponse(BaseModel):
    """GET /tokenizer_info (vLLM's): the fields its clients read."""

    tokenizer_class: str
    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    chat_template: str | None = None
    model_max_length: int


# ---------------------------------------------------------------- logprob conversion


def completion_logprobs(entries: Sequence[TokenLogprob | int], token_text: Callable[[int], str],
                        text_offset: int) -> CompletionLogprobs:
    """The legacy completions layout; `text_offset` is where the first token's text starts. An int
    entry is a token without a logprob (an echoed prompt's first): null in token_logprobs and
    top_logprobs, as vLLM and OpenAI."""
    out = CompletionLogprobs()
    for entry in entries:
        text = token_text(entry if isinstance(entry, int) else entry.token_id)
        out.tokens.append(text)
        if isinstance(entry, int):
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
        else:
            out.token_logprobs.append(entry.logprob)
            out.top_logprobs.append({token_text(tid): lp for tid, lp in entry.top})
        out.text_offset.append(text_offset)
        text_offset += len(text)
    return out


def echoed(prompt_ids: Sequence[int], prompt_logprobs: Sequence[TokenLogprob | None]) -> list[TokenLogprob | int]:
    """An echoed prompt's completion_logprobs entries: its first token bare, the others' logprobs."""
    return [entry if entry is not None else tid for tid, entry in zip(prompt_ids, prompt_logprobs)]


def vllm_prompt_logprobs(entries: Sequence[TokenLogprob | None],
                         token_text: Callable[[int], str]) -> list[dict[str, PromptLogprob] | None]:
    """vLLM's `prompt_logprobs` layout: per prompt token, None for the first, else by token id the
    token's own logprob and rank and its top alternatives' (ranks 1, 2, ...), each with its text."""
    out: list[dict[str, PromptLogprob] | None] = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        ranked = {str(tid): PromptLogprob(logprob=lp, rank=i + 1, decoded_token=token_text(tid))
                  for i, (tid, lp) in enumerate(entry.top)}
        ranked.setdefault(str(entry.token_id), PromptLogprob(logprob=entry.logprob, rank=entry.rank,
                                                             decoded_token=token_text(entry.token_id)))
        out.append(ranked)
    return out


def chat_logprobs(entries: Sequence[TokenLogprob],
                  token_text: Callable[[int], str]) -> ChatLogprobs:
    def top(tid: int, lp: float) -> TopLogprob:
        text = token_text(tid)
        return TopLogprob(token=text, logprob=lp, bytes=list(text.encode("utf-8")))

    content = []
    for entry in entries:
        chosen = top(entry.token_id, entry.logprob)
        content.append(ChatTokenLogprob(**chosen.model_dump(),
                                        top_logprobs=[top(t, lp) for t, lp in entry.top]))
    return ChatLogprobs(content=content)
