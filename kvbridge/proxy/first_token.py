"""First token straight from prefill: the proxy streams P's sampled token to the client and
D continues from it, so a streamed P/D request's first token costs P's prefill, not P's
prefill plus D's KV read and first step.

The pure half of the path (PDProxy.handle runs it, proxy.py):
  1. `eligible`: a streamed request with one choice, one prompt and no logprobs (P's token's
     logprobs would need chunks of their own); anything else takes the ordinary path.
  2. P answers its one-token request as usual; `plan` reads its text, finish reason, usage
     and `kv_transfer_params.generated_token_ids` (absent: a P that offers no token, e.g. a
     Mamba model's N-1 prefill: the ordinary path).
  3. P's token ended the request (EOS, a stop token id or a stop string: finish "stop"; or
     finish "length" where the request's limit is one token: the client's max_tokens, or, for a
     chat request without one, the context, which P's prompt fills but for that token):
     `Plan.finished` holds the whole stream; no D leg, and P is told to release its KV.
  4. Else D gets the client's body with P's params and `continue_from_token_ids` (P's
     token, outside the params: params swapped between requests never carry another
     request's token): its engine starts with P's token as its first output token
     (LLMEngine.add_request's `continued`), computes its KV after reading the prompt's from
     P, and streams only what follows. `Plan.events`, those for P's token, go to the client
     once D accepted the request (its status line:
     D's admission, before any KV moves), so a request D refuses still gets D's status and
     error body and a D that fails before answering is retried as on the ordinary path.

What the client receives equals one engine's stream: the text sent for P's token is what a
stream emits after its first token (`streamed_text`: a trailing partial UTF-8 character and
any end that may start a stop string are held back, and D, which counts P's token's text for
stop strings, emits them), D's sampler skips the draw P's token took (seeded sampling gives
one engine's sequence), and D's usage counts the original prompt and P's token.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvbridge import openai_wire as wire
from kvbridge.kv_transfer.params import KVTransferParamsError, parse_kv_transfer_params
from kvbridge.stop_strings import stop_holdback

CHAT_ROUTE = "/v1/chat/completions"
CONTINUE_FIELD = "continue_from_token_ids"  # only the proxy sets it (PDProxy.handle drops a client's)
DEFAULT_COMPLETION_MAX_TOKENS = 16  # server/protocol.py's CompletionRequest default
DONE = b"data: [DONE]\n\n"


def eligible(body: dict[str, Any], route: str) -> bool:
    """Whether the first-token path may serve this request (a pure check on the client's body)."""
    if body.get("stream") is not True or body.get("n", 1) != 1 or body.get("best_of", 1) != 1:
        return False
    logprobs = body.get("logprobs")
    if (logprobs is not None and logprobs is not False) or body.get("top_logprobs") is not None:  # 0 asks too
        return False
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return False  # a batch of prompts
    limit = requested_max_tokens(body, route)
    return limit is None or (type(limit) is int and limit >= 1)


def limited_by_context(body: dict[str, Any], route: str) -> bool:
    """Whether the request's token limit is what the context leaves (a chat without max_tokens)."""
    return requested_max_tokens(body, route) is None


def requested_max_tokens(body: dict[str, Any], route: str) -> object:
    """The client's token limit as sent (None: a chat request limited by the context)."""
    if route == CHAT_ROUTE:
        return body.get("max_completion_tokens") or body.get("max_tokens")
    return body.get("max_tokens", DEFAULT_COMPLETION_MAX_TOKENS)


def stop_strings(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if isinstance(stop, str):
        return (stop,)
    return tuple(s for s in stop if isinstance(s, str)) if isinstance(stop, list) else ()


def streamed_text(text: str, stops: tuple[str, ...]) -> str:
    """What a stream has sent after its first token, whose whole text (P's finished answer) is
    `text`: nothing while it ends in a partial character (U+FFFD), else all but an end that
    may start a stop string (output_processor does the same with the same rule)."""
    if text.endswith("\ufffd"):
        return ""
    return text[:len(text) - stop_holdback(text, stops)]


def ends_at_prefill(body: dict[str, Any], route: str, reason: object, used_tokens: int,
                    context_len: int | None) -> bool | None:
    """Whether P's one token, with finish `reason`, ended the request; None when it depends on a
    context length not known (`used_tokens`: P's prompt and its token; `context_len`: P's
    max_model_len, 0 or None when unknown)."""
    if reason != "length":
        return reason == "stop"
    if not limited_by_context(body, route):
        return requested_max_tokens(body, route) == 1
    return used_tokens >= context_len if context_len else None


@dataclass(frozen=True)
class Plan:
    """The first-token path for one request, from P's answer. `finished`: P's token ended
    the request and `events` are the client's whole stream; else `events` go first and D
    continues from `continued` (P's tokens)."""

    finished: bool
    events: bytes
    continued: list[int]

    def decode_body(self, body: dict[str, Any]) -> dict[str, Any]:
        """The client's body for D, continuing from P's tokens (the proxy adds P's params)."""
        return {**body, CONTINUE_FIELD: self.continued}


def plan(body: dict[str, Any], route: str, answer: bytes, params: dict[str, object],
         context_len: int | None = None) -> Plan | None:
    """None when P's answer offers no token to continue from, or when P's token may have filled
    the context of a request it limits and `context_len` (P's max_model_len) is unknown: the
    ordinary path serves it."""
    try:
        kv = parse_kv_transfer_params(params)
    except KVTransferParamsError:
        return None
    if kv is None or not kv.do_remote_prefill or not kv.generated_token_ids:
        return None
    try:
        parsed = json.loads(answer)
        choice = parsed["choices"][0]
        text = choice["message"]["content"] if route == CHAT_ROUTE else choice["text"]
        chunk = _Chunks(route, parsed["id"], parsed["created"], parsed["model"],
                        bool((body.get("stream_options") or {}).get("include_usage")))
        usage = wire.UsageInfo.model_validate(parsed["usage"])
        reason = choice["finish_reason"]
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        return None
    if not isinstance(text, str):
        return None
    finished = ends_at_prefill(body, route, reason, usage.prompt_tokens + usage.completion_tokens, context_len)
    if finished is None:
        return None
    sent = text if finished else streamed_text(text, stop_strings(body))
    events = chunk.first(sent)
    if finished:
        events += chunk.finish(reason) + chunk.usage(usage) + DONE
    return Plan(finished, events, list(kv.generated_token_ids))


class _Chunks:
    """SSE events in the API server's shapes (server/completions.py's _ChunkMaker) for one request."""

    def __init__(self, route: str, response_id: str, created: int, model: str, include_usage: bool) -> None:
        self.chat = route == CHAT_ROUTE
        self.id, self.created, self.model = response_id, created, model
        self.include_usage = include_usage

    def _event(self, choices: list[Any], usage: wire.UsageInfo | None = None) -> bytes:
        cls = wire.ChatCompletionChunk if self.chat else wire.CompletionChunk
        chunk = cls(id=self.id, created=self.created, model=self.model, choices=choices, usage=usage)
        exclude = {"kv_transfer_params"} if self.include_usage else {"kv_transfer_params", "usage"}
        return wire.sse_event(chunk, exclude).encode()

    def first(self, text: str) -> bytes:
        """The events for P's token: the chat role chunk, then its text unless empty."""
        events = b""
        if self.chat:
            events += self._event([wire.ChatStreamChoice(delta=wire.DeltaMessage(role="assistant", content=""))])
            if text:
                events += self._event([wire.ChatStreamChoice(delta=wire.DeltaMessage(content=text))])
        elif text:
            events += self._event([wire.CompletionChoice(text=text)])
        return events

    def finish(self, reason: str) -> bytes:
        if self.chat:
            return self._event([wire.ChatStreamChoice(delta=wire.DeltaMessage(), finish_reason=reason)])
        return self._event([wire.CompletionChoice(text="", finish_reason=reason)])

    def usage(self, usage: wire.UsageInfo) -> bytes:
        return self._event([], usage) if self.include_usage else b""
