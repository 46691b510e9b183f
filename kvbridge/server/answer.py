"""The parts of one prompt's answer: the validated job the engine serves (`Job`), its stream's
server-sent-event chunks (`ChunkMaker`), the usage, a failed output as its error, the lease an
answer names, and aborting on a client that left."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from kvbridge import openai_wire as wire
from kvbridge.engine.outputs import DRAIN_TIMEOUT, RequestOutput
from kvbridge.engine.request import FinishReason
from kvbridge.engine.sampling_params import SamplingParams
from kvbridge.kv_transfer.params import KVTransferParams, wire_or_none
from kvbridge.server import protocol
from kvbridge.server.async_engine import AsyncEngine, RequestStream
from kvbridge.server.errors import ApiError

logger = logging.getLogger("kvbridge.server.api_server")  # the name the server logged under before the split


@dataclass
class Job:
    """One validated request, ready for the engine."""

    chat: bool
    request: protocol.CompletionRequest | protocol.ChatCompletionRequest
    prompt_ids: list[int]
    params: SamplingParams
    response_id: str
    created: int
    # Tokens a prefill instance sampled, which the proxy streamed with the role chunk: the
    # answer continues from them (LLMEngine.add_request's `continued`).
    continued: tuple[int, ...] = ()
    index: int = 0  # the prompt's place in a completion's list: its choice's index

class ChunkMaker:
    """Builds one request's stream chunks as JSON-able dicts. Like OpenAI, `usage` is on
    every chunk (null but on the last) only when the client asked for usage;
    `kv_transfer_params` only on the finishing chunk, when the engine returned some."""

    def __init__(self, job: Job, engine: AsyncEngine) -> None:
        self.job = job
        self.model = engine.model_name
        self.token_text = engine.tokenizer.token_text
        self.text_offset = 0

    def _chunk(self, choices: list[Any], **extra: Any) -> str:
        cls = wire.ChatCompletionChunk if self.job.chat else wire.CompletionChunk
        chunk = cls(id=self.job.response_id, created=self.job.created, model=self.model,
                    choices=choices, **extra)
        exclude = set() if self.job.request.include_usage_chunk else {"usage"}
        if chunk.kv_transfer_params is None:
            exclude.add("kv_transfer_params")
        return wire.sse_event(chunk, exclude)

    def delta(self, delta: wire.DeltaMessage, reason: str | None = None, **extra: Any) -> str:
        return self._chunk([wire.ChatStreamChoice(delta=delta, logprobs=None, finish_reason=reason)],
                           **extra)

    def content(self, output: RequestOutput) -> str:
        logprobs = output.logprobs if self.job.params.logprobs is not None else None
        if self.job.chat:
            chat_lp = protocol.chat_logprobs(logprobs, self.token_text) if logprobs else None
            return self._chunk([wire.ChatStreamChoice(delta=wire.DeltaMessage(content=output.new_text),
                                                      logprobs=chat_lp, finish_reason=None)])
        lp = protocol.completion_logprobs(logprobs, self.token_text, self.text_offset) if logprobs else None
        self.text_offset += len(output.new_text)
        return self._chunk([wire.CompletionChoice(index=self.job.index, text=output.new_text, logprobs=lp,
                                                  finish_reason=None)])

    def finish(self, output: RequestOutput) -> str:
        reason = output.finish_reason.value if output.finish_reason else None
        extra = {"kv_transfer_params": wire_or_none(output.kv_transfer_params)} if output.kv_transfer_params else {}
        if self.job.chat:
            return self.delta(wire.DeltaMessage(), reason, **extra)
        return self._chunk([wire.CompletionChoice(index=self.job.index, text="", logprobs=None,
                                                  finish_reason=reason)], **extra)

    def usage(self, output: RequestOutput) -> str:
        return self.usage_of(usage_of([output]))

    def usage_of(self, usage: wire.UsageInfo) -> str:
        return self._chunk([], usage=usage)

def usage_of(outputs: list[RequestOutput]) -> wire.UsageInfo:
    """The usage of finished outputs together (a list's prompts: summed, as vLLM)."""
    return wire.UsageInfo.of(sum(o.num_prompt_tokens for o in outputs), sum(o.num_output_tokens for o in outputs),
                             sum(o.num_cached_tokens for o in outputs))

def leased_params(output: RequestOutput) -> KVTransferParams | None:
    """The params of the lease a finished output names: P's answer (do_remote_prefill for D)."""
    params = output.kv_transfer_params
    return params if params is not None and params.do_remote_prefill and params.remote_request_id else None


def raise_if_failed(output: RequestOutput) -> None:
    if output.finish_reason is FinishReason.ERROR and output.error_code == DRAIN_TIMEOUT:
        raise ApiError(503, output.error or "the server drained before this request completed", code=DRAIN_TIMEOUT)
    if output.finish_reason is FinishReason.ERROR:
        raise ApiError(500, output.error or "the engine failed to serve this request",
                       code=output.error_code or "engine_error")
    if output.finish_reason is FinishReason.ABORT:
        raise ApiError(503, "the request was aborted before it completed", code="aborted")


async def abort_on_disconnect(raw: Request, streams: list[RequestStream]) -> None:
    """Abort the request (each of a list's) when the client goes away. The body has been read, so
    the next ASGI message is the disconnect."""
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            for stream in streams:
                logger.info("request %s: client disconnected, aborting", stream.request_id)
                stream.abort()
            return
