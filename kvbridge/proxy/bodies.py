"""What the proxy reads from and writes into bodies and headers: the client's body (capped), the
body P gets, the prompt text prefix routing hashes, P's `kv_transfer_params` and an upstream
error's code in answers, and which client header values can be forwarded."""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from kvbridge.openai_wire import REQUEST_ID_HEADER, parse_json_object, read_capped, usable_request_id


async def read_body(request: Request, limit: int) -> bytes | None:
    """The request's body, or None when it is longer than `limit` bytes: refused on its
    Content-Length before any of it is read, else once the bytes read pass the limit."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        return None
    return await read_capped(request.stream(), limit)


def error_code(answer: Response) -> str | None:
    """The `error.code` of an upstream's OpenAI-style error body, or None."""
    try:
        error = parse_json_object(bytes(answer.body)).get("error")
    except ValueError:
        return None
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, str) else None


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The body sent to P: one token, no streaming, one sample, asking P to keep the KV. P samples
    the first token, so it applies what shapes it: logit_bias as sent, and min_tokens as 1 when the
    client's is a positive int (P's token is then no stop token; a min_tokens P cannot judge, not an
    int, goes as sent, for P to refuse as D would)."""
    out = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens", "best_of")}
    min_tokens = body.get("min_tokens")
    if type(min_tokens) is int and min_tokens > 0:
        out["min_tokens"] = 1
    elif min_tokens is not None and not (type(min_tokens) is int and min_tokens == 0):
        out["min_tokens"] = min_tokens
    out.update(max_tokens=1, stream=False, n=1, kv_transfer_params={"do_remote_decode": True})
    if "max_completion_tokens" in body:
        out["max_completion_tokens"] = 1
    return out


def wants_prompt_logprobs(body: dict[str, Any]) -> bool:
    """Whether the answer needs the prompt's logprobs (vLLM's `prompt_logprobs`, or a completion's
    `echo`): only an instance that computes the prompt has them, so P serves such a request alone."""
    return body.get("prompt_logprobs") is not None or body.get("echo") is True


def refused_by_decode(body: dict[str, Any]) -> tuple[str, str] | None:
    """(field, why) when D would refuse a field P never sees as sent (prefill_body rewrites
    max_tokens, stream and min_tokens): the proxy refuses it before P spends a prefill on it. The
    other fields P checks as D would."""
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if value is not None and (type(value) is not int or value < 1):
            return name, f"{name} must be a positive integer (0 only with echo), got {json.dumps(value)}"
    stream = body.get("stream")
    if stream is not None and type(stream) is not bool:
        return "stream", f"stream must be a boolean, got {json.dumps(stream)}"
    if body.get("stream_options") is not None and stream is not True:
        return "stream_options", "stream_options is only allowed when stream is true"
    min_tokens, max_tokens = body.get("min_tokens"), body.get("max_completion_tokens") or body.get("max_tokens")
    if type(min_tokens) is int and type(max_tokens) is int and min_tokens > max_tokens:
        return "min_tokens", f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}"
    return None


def prompt_text(body: dict[str, Any]) -> str:
    """The request's prompt as text, for prefix-affinity routing: a completion's prompt (token
    ids as their decimal list; the first of a batch), or a chat's messages as `role: content`
    lines (text parts of multi-part contents). Empty when there is none."""
    prompt = body.get("prompt")
    if prompt is None and isinstance(body.get("messages"), list):
        lines = []
        for m in body["messages"]:
            if not isinstance(m, dict):
                continue
            content = m.get("content")
            if isinstance(content, list):
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict)
                                  and isinstance(p.get("text", ""), str))
            lines.append(f"{m.get('role', '')}: {content if isinstance(content, str) else ''}\n")
        return "".join(lines)
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch: route by its first prompt
    if isinstance(prompt, list):
        return ",".join(str(t) for t in prompt)
    return prompt if isinstance(prompt, str) else ""


def kv_transfer_params(body: bytes) -> dict[str, object] | None:
    """The `kv_transfer_params` object of an upstream's JSON answer, or None."""
    try:
        params = json.loads(body).get("kv_transfer_params")
    except (ValueError, AttributeError):
        return None
    return params if isinstance(params, dict) else None


# A header value the proxy's HTTP client sends: visible ASCII, single runs of spaces or tabs
# inside (h11 refuses control characters and whitespace at either end, httpx anything outside ASCII).
_SENDABLE_HEADER_VALUE = re.compile(r"[\x21-\x7e]+(?:[ \t]+[\x21-\x7e]+)*")


def forwardable(value: str | None) -> str | None:
    """A client's header value as the proxy forwards it: without the spaces and tabs around it
    (they are not part of a field's value, RFC 9110 5.5; some servers' parsers keep trailing
    ones: lm-eval sends `Bearer ` when it has no key); None, not forwarded, when nothing is left
    or it holds what the proxy's HTTP client may not send (a control character, a byte outside ASCII)."""
    if value is None:
        return None
    value = value.strip(" \t")
    return value if _SENDABLE_HEADER_VALUE.fullmatch(value) else None


def request_id_of(request: Request) -> str:
    """The client's X-Request-Id when it is usable, else a new one."""
    given = request.headers.get(REQUEST_ID_HEADER)
    return given if given is not None and usable_request_id(given) else f"kvb-{uuid.uuid4().hex}"
