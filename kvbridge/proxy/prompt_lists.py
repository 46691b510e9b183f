"""A completion's list of prompts through P/D: each prompt its own P/D path, the answers merged.

An instance serves a list itself (server/completions.py), but a P's answer names the KV of one
prompt, so in P/D mode the proxy splits a well-formed list (`split`: texts, or non-empty token-id
lists, at most MAX_PROMPTS) into one request per prompt, X-Request-Id `<id>-<index>` (vLLM's
naming), and runs each through P then D like any request (retries, fallback, first token from
prefill, releases). A malformed list goes to P as sent, to be refused there with the field named.

The answers are merged as one instance answers a list: each prompt's choices (one, or its n), `index`
prompt * n + choice, `usage` summed, one id; streamed, every prompt's chunks as they arrive (index rewritten), one usage
chunk at the end when asked, one [DONE].

One prompt failing fails the request, as it does on one vLLM server (its completions handler
answers the first error for the whole list) and as vLLM's own disaggregated proxy would have to,
having no way to answer part of a list: the client gets that prompt's error (status and body as its
leg ended), and every other prompt is stopped the way a client leaving stops a request (its own
`gone` is set): a P leg's KV is released, a D's connection is closed so D aborts and frees. A
stream answers only once every prompt's D accepted its request (each status line), so a refusal
still arrives as a status; after that, a prompt's error event ends the whole stream.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
from fastapi.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from kvbridge.openai_wire import REQUEST_ID_HEADER, UsageInfo

logger = logging.getLogger("kvbridge.proxy.proxy")

MAX_PROMPTS = 1024  # server/protocol.py's: a longer list goes to P as sent, to be refused there
DONE = b"data: [DONE]\n\n"


def split(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    """One body per prompt of a completion's well-formed list (a list of one: that prompt alone, so
    the first-token path may serve it), or None: one prompt, or a list an instance must refuse."""
    prompts = body.get("prompt")
    if not isinstance(prompts, list) or not prompts or len(prompts) > MAX_PROMPTS:
        return None
    if all(isinstance(p, str) and p for p in prompts):
        pass
    elif not all(isinstance(p, list) and p and all(type(t) is int for t in p) for p in prompts):
        return None
    return [{**body, "prompt": p} for p in prompts]


def failed(answer: Response) -> bool:
    return answer.status_code >= 400


def choices_per_prompt(body: dict[str, Any]) -> int:
    """The choices each prompt's answer holds (`n`; an instance refuses an n that is not a positive int)."""
    n = body.get("n")
    return n if type(n) is int and n > 0 else 1


def merge_whole(answers: list[Response], request_id: str, per_prompt: int = 1) -> Response:
    """The unstreamed answers of every prompt (each 200) as one: choices in index order (prompt i's
    j-th at i * per_prompt + j, as one instance numbers them), usage summed."""
    parsed = [json.loads(bytes(a.body)) for a in answers]
    choices = []
    for prompt_index, part in enumerate(parsed):
        for choice in part["choices"]:
            choices.append({**choice, "index": prompt_index * per_prompt + _index(choice)})
    merged = {**parsed[0], "id": f"cmpl-{request_id}", "choices": choices,
              "usage": _summed([p.get("usage") for p in parsed]).model_dump()}
    merged.pop("kv_transfer_params", None)
    return Response(json.dumps(merged), media_type="application/json", headers={REQUEST_ID_HEADER: request_id})


def _index(choice: Any) -> int:
    """A choice's index within its prompt's answer (0 if it names none)."""
    index = choice.get("index") if isinstance(choice, dict) else None
    return index if type(index) is int else 0


def _summed(usages: list[Any]) -> UsageInfo:
    parsed = [UsageInfo.model_validate(u) for u in usages if isinstance(u, dict)]
    cached = sum(u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else 0 for u in parsed)
    return UsageInfo.of(sum(u.prompt_tokens for u in parsed), sum(u.completion_tokens for u in parsed), cached)


async def close(answer: Response) -> None:
    """Stop an answer nobody will send: a D stream's connection is closed (D aborts and frees)."""
    closer: Callable[[], Awaitable[None]] | None = getattr(answer, "close", None)
    if closer is not None:
        await closer()


class MergedStream(StreamingResponse):
    """Every prompt's stream as one (see the module docstring); however it ends (done, an error
    event, the client gone), every part is closed."""

    def __init__(self, parts: list[Response], request_id: str, include_usage: bool, per_prompt: int = 1) -> None:
        self._parts = parts
        self._per_prompt = per_prompt
        self._request_id = request_id
        self._include_usage = include_usage
        # One reader per part, started here, in the handler's task: tasks started once the response
        # streams belong to its cancel scope, which cuts the closing of a part's D connection short
        # when the client leaves (D would then decode on, unread).
        self._queue: asyncio.Queue[tuple[int, bytes | None]] = asyncio.Queue()
        self._scopes: dict[int, anyio.CancelScope] = {}
        self._pumps = [asyncio.create_task(self._pump(i, part)) for i, part in enumerate(parts)]
        super().__init__(self._events(), media_type="text/event-stream", headers={REQUEST_ID_HEADER: request_id})

    async def _events(self) -> AsyncIterator[bytes]:
        queue = self._queue
        usages: list[Any] = []
        last: dict[str, Any] = {}
        try:
            running = len(self._pumps)
            while running:
                index, event = await queue.get()
                if event is None:
                    running -= 1
                    continue
                data = _data(event)
                if data is None or data == b"[DONE]":
                    continue
                try:
                    chunk = json.loads(data)
                except ValueError:
                    continue
                if not isinstance(chunk, dict):
                    continue
                if "error" in chunk:  # one prompt failed: the whole stream ends with its error
                    yield b"data: " + data + b"\n\n" + DONE
                    return
                if not chunk.get("choices"):
                    usages.append(chunk.get("usage"))
                    last = chunk
                    continue
                for choice in chunk["choices"]:
                    choice["index"] = index * self._per_prompt + _index(choice)
                chunk["id"] = f"cmpl-{self._request_id}"
                last = chunk
                yield f"data: {json.dumps(chunk)}\n\n".encode()
            if self._include_usage:
                final = {**last, "id": f"cmpl-{self._request_id}", "choices": [],
                         "usage": _summed(usages).model_dump()}
                yield f"data: {json.dumps(final)}\n\n".encode()
            yield DONE
        finally:  # the client gone, a cancelled scope: every await here may be cut short, so __call__ closes too
            await self.close()

    async def _pump(self, index: int, part: Response) -> None:
        """Puts each SSE event of `part` on the queue, then (index, None). It runs in an anyio cancel
        scope that `close` cancels: httpx shields closing a connection from anyio's cancellation,
        not from a bare Task.cancel (which would leave D's connection open, D decoding on)."""
        queue = self._queue
        try:
            with anyio.CancelScope() as self._scopes[index]:
                await self._read(index, part, queue)
        finally:
            queue.put_nowait((index, None))

    @staticmethod
    async def _read(index: int, part: Response, queue: asyncio.Queue[tuple[int, bytes | None]]) -> None:
        if isinstance(part, StreamingResponse):
            buffer = b""
            async for piece in part.body_iterator:
                buffer += piece if isinstance(piece, bytes) else str(piece).encode()
                *events, buffer = buffer.split(b"\n\n")
                for event in events:
                    queue.put_nowait((index, event))
        else:
            for event in bytes(part.body).split(b"\n\n"):
                queue.put_nowait((index, event))

    async def close(self) -> None:
        """Stop reading every part, then close each (a D stream's connection: D aborts). Idempotent."""
        await asyncio.gather(*(close(part) for part in self._parts), return_exceptions=True)
        for index, task in enumerate(self._pumps):
            scope = self._scopes.get(index)
            if scope is not None:
                scope.cancel()
            else:  # not started: it holds no connection yet
                task.cancel()
        await asyncio.gather(*self._pumps, return_exceptions=True)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.close()


def _data(event: bytes) -> bytes | None:
    """The data of one SSE event (its `data:` lines joined), or None."""
    lines = [line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
    return b"\n".join(lines) if lines else None
