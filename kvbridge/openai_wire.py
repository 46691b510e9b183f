"""OpenAI's HTTP wire as both kvbridge programs speak it: the instance server (kvbridge/server/)
answers in these shapes and the P/D proxy (kvbridge/proxy/) reads and writes them.

Here: the request-id header and its rule, how a request body is read (capped, strict JSON),
OpenAI's error body, the response and stream-chunk models and SSE framing. Responses and
stream chunks mirror OpenAI's shapes; like vLLM they carry `kv_transfer_params` at the top
level when the engine returned some (P side). The request models, which turn into the
engine's SamplingParams, are the server's (server/protocol.py): this module imports nothing
of kvbridge, so the proxy runs without the engine.
"""

from __future__ import annotations

import json
import re
import socket
import time
from collections.abc import AsyncIterable
from typing import Any, Literal

from pydantic import BaseModel, Field

from kvbridge import strict_json

# Sent by the proxy to P and D (one id for both legs) and echoed on every answer.
REQUEST_ID_HEADER = "X-Request-Id"
# Sent by the proxy with each attempt of the P leg, a fresh random key: the proxy that gives up on
# an attempt whose answer it did not read releases the lease by it (server/undelivered.py).
RELEASE_KEY_HEADER = "X-KVBridge-Release-Key"
_REQUEST_ID_RE = re.compile(r"[\x21-\x7e]{1,256}")  # printable ASCII without spaces, at most 256
# No OpenAI request nests deeper than a handful of levels (strict_json.py bounds it at 100).
MAX_JSON_DEPTH = strict_json.MAX_JSON_DEPTH
# The longest request body an instance or the proxy reads (HTTP 413 beyond it): a full-context
# prompt as token ids is well under 1 MiB.
MAX_BODY_BYTES = 32 << 20


def usable_request_id(given: str | None) -> bool:
    """Whether a caller's X-Request-Id may be used as the request's id (else a fresh one is made)."""
    return bool(given) and _REQUEST_ID_RE.fullmatch(given) is not None


# ---------------------------------------------------------------- errors


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body: {"error": {"message", "type", "param", "code"}}."""

    error: ErrorInfo


def error_type(status: int) -> str:
    """OpenAI's error type for an HTTP status."""
    return "server_error" if status >= 500 else "invalid_request_error"


# ---------------------------------------------------------------- request bodies

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


async def read_capped(chunks: AsyncIterable[bytes], limit: int) -> bytes | None:
    """A request body read chunk by chunk, or None as soon as it holds more than `limit` bytes:
    the rest is never read, so a huge body costs at most the limit and one chunk of memory."""
    data = bytearray()
    async for chunk in chunks:
        data += chunk
        if len(data) > limit:
            return None
    return bytes(data)


def parse_json_object(data: bytes) -> dict[str, Any]:
    """A request body as strict JSON (RFC 8259): UTF-8, no NaN or Infinity, no number that
    overflows a float, no lone surrogate (escaped as \\ud800: not Unicode, and it breaks
    every encoder after us), no nesting deeper than MAX_JSON_DEPTH, an object at the top.
    Raises ValueError with a message for the client (HTTP 400)."""
    try:
        value = strict_json.loads(data.decode("utf-8"))
    except strict_json.TooDeep as exc:
        raise ValueError(f"the request body {exc}") from None
    except ValueError as exc:  # not UTF-8, malformed, a constant, an out-of-range number
        raise ValueError(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError("the request body must be a JSON object")
    # The check costs a walk of the body; a body without a surrogate escape cannot fail it.
    if _SURROGATE_ESCAPE.search(data):
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("the request body has a lone UTF-16 surrogate (e.g. \\ud800), "
                             "which is not a Unicode character") from None
    return value


# ---------------------------------------------------------------- responses


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, prompt: int, completion: int, cached: int) -> UsageInfo:
        return cls(prompt_tokens=prompt, completion_tokens=completion,
                   total_tokens=prompt + completion,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)  # None: an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """One token's entry in vLLM's `prompt_logprobs`."""

    logprob: float
    rank: int | None = None
    decoded_token: str


PromptLogprobs = list[dict[str, PromptLogprob] | None]


def _unset(value: object) -> bool:
    return value is None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    prompt_logprobs: PromptLogprobs | None = Field(default=None, exclude_if=_unset)  # vLLM's, when asked for


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    kv_transfer_params: dict[str, Any] | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] = Field(default_factory=list)


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    kv_transfer_params: dict[str, Any] | None = None
    prompt_logprobs: PromptLogprobs | None = Field(default=None, exclude_if=_unset)  # vLLM's, when asked for


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatStreamChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    """The server drops `usage` unless the client asked for usage, and
    `kv_transfer_params` unless the engine returned some."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    kv_transfer_params: dict[str, Any] | None = None
    prompt_logprobs: PromptLogprobs | None = Field(default=None, exclude_if=_unset)  # the first chunk's, when asked


class CompletionChunk(BaseModel):
    """Trimmed by the server like ChatCompletionChunk."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    kv_transfer_params: dict[str, Any] | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kvbridge"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def sse_event(model: BaseModel, exclude: set[str] | None = None) -> str:
    """One server-sent event carrying `model` as JSON (a stream chunk), `exclude`d fields left out."""
    return f"data: {model.model_dump_json(exclude=exclude)}\n\n"


def bind_socket(host: str, port: int, listen: bool = True) -> socket.socket:
    """The listening TCP socket of an HTTP server (an instance's or the proxy's), bound to (host,
    port), listening unless `listen` is False (call `sock.listen(...)` later); port 0 lets the OS
    choose (read it with getsockname()). Nagle's algorithm is off on every connection it accepts
    (Linux hands TCP_NODELAY down from the listener): uvicorn writes an answer's headers and body
    separately, and with Nagle on the body waited for the client's delayed ACK, 40 ms a request."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    if listen:
        sock.listen(2048)
    sock.setblocking(False)
    return sock
