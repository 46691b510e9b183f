"""A request of several sequences, served as vLLM does: a completion's list of prompts, and n > 1 (or
best_of) samples of each prompt. Each sequence is its own engine request (`<request id>-<index>`;
a prompt's later samples share its first's prompt blocks); the answer is one choice per sequence
with its index (prompt_index * n + sample; best_of: the n of highest cumulative logprob), each
prompt's tokens counted once in the usage, whole or as one stream of every sequence's chunks as
they come; one sequence's failure fails the request and aborts the others. The handler
(completions.py) validates and tokenises and hands its jobs here with how it admits and collects one."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Callable, Coroutine
from contextlib import aclosing
from typing import Any, TypeVar, cast

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from kvbridge import openai_wire as wire
from kvbridge.engine.outputs import RequestOutput
from kvbridge.kv_transfer.params import KVTransferParams
from kvbridge.server.answer import ChunkMaker, Job, abort_on_disconnect, raise_if_failed, usage_of
from kvbridge.server.async_engine import AsyncEngine, RequestStream
from kvbridge.server.errors import ApiError, as_api_error, json_response
from kvbridge.server.metrics import RequestTimer
from kvbridge.server.request_span import Span

T = TypeVar("T")
Answer = wire.CompletionResponse | wire.ChatCompletionResponse
# How the handler admits one sequence (request id, job, params, span, the request whose prompt blocks it
# shares) and collects its whole answer.
Admit = Callable[[str, Job, KVTransferParams | None, Span, str | None], Awaitable[RequestStream]]
Collect = Callable[[Job, RequestStream, RequestTimer],
                   Coroutine[Any, Any, tuple[wire.CompletionResponse | wire.ChatCompletionResponse, KVTransferParams | None]]]


async def admit_all(admit: Admit, request_id: str, jobs: list[Job], span: Span,
                    kv_params: KVTransferParams | None = None) -> list[RequestStream]:
    """Admits each sequence (each prompt of a list, each of a prompt's n) as its own engine request,
    `<request id>-<index>` (vLLM's naming for lists); a prompt's first sequence takes `kv_params`
    (one prompt only: D reading P's KV), the others share its prompt blocks once computed or loaded.
    If one is refused, those admitted are aborted and the refusal raised."""
    streams: list[RequestStream] = []
    leaders: dict[int, str] = {}
    try:
        for job in jobs:
            leader = leaders.get(job.prompt_index)
            stream = await admit(f"{request_id}-{job.index}", job, kv_params if leader is None else None, span, leader)
            streams.append(stream)
            leaders.setdefault(job.prompt_index, stream.request_id)
    except BaseException:
        for stream in streams:
            stream.abort()
        raise
    return streams


async def serve_list(raw: Request, engine: AsyncEngine, collect: Collect, jobs: list[Job],
                     streams: list[RequestStream], timers: list[RequestTimer], span: Span,
                     headers: dict[str, str]) -> Response:
    """The answer to a completion's list of prompts (one timer per prompt): one choice per prompt
    with its index and the usage summed, whole or as one stream of every prompt's chunks as they
    come (vLLM's semantics). One prompt's failure fails the request: the others are aborted."""
    watcher = asyncio.create_task(abort_on_disconnect(raw, streams))
    if jobs[0].request.stream:
        chunks = _stream_list(engine, jobs, streams, timers, watcher, span)
        return StreamingResponse(span.traced_stream(chunks), media_type="text/event-stream", headers=headers)
    try:
        answers = await _all_or_none([collect(job, stream, timer)
                                      for job, stream, timer in zip(jobs, streams, timers)])
    except ApiError as error:
        span.failed(error)
        return error.response(headers)
    except BaseException as exc:  # answered 500 by the app's handler (or cancelled)
        span.end(500, f"{type(exc).__name__}: {exc}", "internal_error")
        raise
    finally:
        watcher.cancel()
        for stream, timer in zip(streams, timers):
            stream.abort()
            timer.on_abandoned()
    parts = [answer for answer, _ in answers]
    kept = _best(jobs, parts)
    choices = [cast(Any, part.choices[0]).model_copy(update={"index": index}) for index, (_, part) in enumerate(kept)]
    usage = _summed([part.usage for job, part in zip(jobs, parts) if part.usage is not None and job.sample == 0],
                    [part.usage for _, part in kept if part.usage is not None])
    merged = parts[0].model_copy(update={"choices": choices, "usage": usage, "kv_transfer_params": None})
    span.answered(usage.completion_tokens, choices[0].finish_reason)
    span.end(200)
    return json_response(merged, headers=headers)


async def _stream_list(engine: AsyncEngine, jobs: list[Job], streams: list[RequestStream],
                       timers: list[RequestTimer], watcher: asyncio.Task[None],
                       span: Span) -> AsyncGenerator[str, None]:
    """Every prompt's chunks as its engine request yields them, each choice with its index; the
    usage chunk (when asked) sums them all; one [DONE]. An error ends the whole stream."""
    makers = [ChunkMaker(job, engine) for job in jobs]
    finished: list[tuple[RequestOutput, Job]] = []
    try:
        for maker in makers:  # a chat's choices each open with the assistant's role, as one choice does
            if maker.job.chat:
                yield maker.delta(wire.DeltaMessage(role="assistant", content=""))
        async with aclosing(_merged(streams)) as outputs:
            async for index, output in outputs:
                timers[index].on_output(output)
                if output.finished:
                    raise_if_failed(output)
                if (chunk := makers[index].content(output)) is not None:
                    yield chunk
                if output.finished:
                    finished.append((output, jobs[index]))
                    yield makers[index].finish(output)
        usage = usage_of([o for o, _ in finished], [j for _, j in finished])
        span.answered(usage.completion_tokens, None)
        if jobs[0].request.include_usage_chunk:
            yield makers[0].usage_of(usage)
        yield "data: [DONE]\n\n"
    except Exception as exc:
        error = exc if isinstance(exc, ApiError) else as_api_error(exc, jobs[0].response_id)
        span.stream_failed(error)
        yield wire.sse_event(wire.ErrorResponse(error=error.info))
        yield "data: [DONE]\n\n"
    finally:
        watcher.cancel()
        for stream, timer in zip(streams, timers):
            stream.abort()
            timer.on_abandoned()


def _best(jobs: list[Job], parts: list[Answer]) -> list[tuple[Job, Answer]]:
    """The answers that become choices, in choice order: each prompt's sequences, or with best_of its n
    of highest cumulative logprob (vLLM's ranking), best first."""
    kept: list[tuple[Job, Answer]] = []
    for prompt_index in sorted({job.prompt_index for job in jobs}):
        group = [(job, part) for job, part in zip(jobs, parts) if job.prompt_index == prompt_index]
        n = group[0][0].request.n
        if len(group) > n:
            group = sorted(group, key=lambda jp: -jp[0].cumulative_logprob)[:n]
        kept.extend(group)
    return kept


def _summed(prompts: list[wire.UsageInfo], answered: list[wire.UsageInfo]) -> wire.UsageInfo:
    """The usage of a request: each prompt's tokens once (`prompts`: one usage per prompt), the
    completion tokens of every answered sequence (as vLLM)."""
    return wire.UsageInfo.of(sum(u.prompt_tokens for u in prompts), sum(u.completion_tokens for u in answered),
                             sum(u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else 0
                                 for u in prompts))


async def _all_or_none(work: list[Coroutine[Any, Any, T]]) -> list[T]:
    """Every result, in order; at the first exception the rest are cancelled and it is raised."""
    tasks = [asyncio.ensure_future(w) for w in work]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise cast(BaseException, task.exception())
        return [task.result() for task in tasks]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _merged(streams: list[RequestStream]) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """(index, output) of every stream, as they come; closing it stops reading them all."""
    queue: asyncio.Queue[tuple[int, RequestOutput] | int] = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                queue.put_nowait((index, output))
        finally:
            queue.put_nowait(index)  # this stream ended

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if isinstance(item, int):
                running -= 1
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

