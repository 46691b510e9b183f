"""The parts of one prompt's answer: the validated job the engine serves (`Job`), its stream's
server-sent-event chunks (`ChunkMaker`), the usage, a failed output as its error, the lease an
answer names, and aborting on a client that left."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, cast

from fastapi import Request

from kvbridge import openai_wire as wire
from kvbridge.engine.outputs import DRAIN_TIMEOUT, RequestOutput, TokenLogprob
from kvbridge.engine.request import FinishReason
from kvbridge.engine.sampling_params import SamplingParams
from kvbridge.engine.tokenizer import Tokenizer
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
    index: int = 0  # its choice's index: prompt_index * samples + sample (best_of: reassigned by rank)
    prompt_index: int = 0  # the prompt's place in a completion's list
    sample: int = 0  # which of the prompt's n (or best_of) sequences
    cumulative_logprob: float = 0.0  # of its generated tokens so far (best_of ranks by it)

    @property
    def logprobs_asked(self) -> bool:
        """Whether the answer carries logprobs (the engine may compute them for best_of alone)."""
        if isinstance(self.request, protocol.CompletionRequest):
            return self.request.logprobs is not None
        return self.request.logprobs

    @property
    def echo(self) -> bool:
        """A completion whose answer starts with its prompt (text, and logprobs when asked)."""
        return isinstance(self.request, protocol.CompletionRequest) and self.request.echo

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: the engine samples one token (vLLM's way), the answer drops it."""
        return isinstance(self.request, protocol.CompletionRequest) and self.request.echo_only

    def prompt_text(self, tokenizer: Tokenizer) -> str:
        """The prompt as echoed: the text sent, or token ids' text (special tokens kept)."""
        prompt = self.request.prompts[self.prompt_index] if isinstance(self.request, protocol.CompletionRequest) else ""
        return prompt if isinstance(prompt, str) else tokenizer.decode(prompt, False)

    def answer_parts(self, output: RequestOutput, tokenizer: Tokenizer, echoed: bool,
                     ) -> tuple[str, list[TokenLogprob | int] | None, wire.PromptLogprobs | None]:
        """Of one output: the text, the completion logprobs entries (None when not asked) and vLLM's
        prompt_logprobs (None unless asked and this is the output carrying them). `echoed`: the prompt
        was already answered (a stream's later output)."""
        asked = self.logprobs_asked
        text = "" if self.echo_only else output.new_text
        entries: list[TokenLogprob | int] | None = (
            [] if self.echo_only else list(output.logprobs or ())) if asked else None
        if self.echo and not echoed:
            text = self.prompt_text(tokenizer) + text
            if entries is not None:
                entries[:0] = protocol.echoed(self.prompt_ids, output.prompt_logprobs or [])
        prompt_lps = None
        if self.request.prompt_logprobs is not None and output.prompt_logprobs is not None:
            prompt_lps = protocol.vllm_prompt_logprobs(output.prompt_logprobs, tokenizer.token_text)
        return text, entries, prompt_lps

    def finish_reason(self, output: RequestOutput) -> str | None:
        if self.echo_only:
            return "length"  # nothing generated: max_tokens 0 reached
        return output.finish_reason.value if output.finish_reason else None

    def completion_tokens(self, output: RequestOutput) -> int:
        return 0 if self.echo_only else output.num_output_tokens

class ChunkMaker:
    """Builds one request's stream chunks as JSON-able dicts. Like OpenAI, `usage` is on
    every chunk (null but on the last) only when the client asked for usage;
    `kv_transfer_params` only on the finishing chunk, when the engine returned some."""

    def __init__(self, job: Job, engine: AsyncEngine) -> None:
        self.job = job
        self.model = engine.model_name
        self.tokenizer = engine.tokenizer
        self.token_text = engine.tokenizer.token_text
        self.text_offset = 0
        self.answered = False  # an echoed prompt went out (it goes with the first content chunk)

    def _chunk(self, choices: list[Any], **extra: Any) -> str:
        cls = wire.ChatCompletionChunk if self.job.chat else wire.CompletionChunk
        chunk = cls(id=self.job.response_id, created=self.job.created, model=self.model,
                    choices=choices, **extra)
        exclude = set() if self.job.request.include_usage_chunk else {"usage"}
        if chunk.kv_transfer_params is None:
            exclude.add("kv_transfer_params")
        return wire.sse_event(chunk, exclude)

    def delta(self, delta: wire.DeltaMessage, reason: str | None = None, **extra: Any) -> str:
        return self._chunk([wire.ChatStreamChoice(index=self.job.index, delta=delta, logprobs=None,
                                                  finish_reason=reason)], **extra)

    def content(self, output: RequestOutput) -> str | None:
        """The chunk of an output's text and logprobs (the first also carries an echoed prompt and
        the prompt logprobs), or None when it has nothing to send."""
        text, entries, prompt_lps = self.job.answer_parts(output, self.tokenizer, self.answered)
        if not (text or entries or prompt_lps):
            return None
        self.answered = True
        if self.job.chat:
            chat_lp = protocol.chat_logprobs(cast(list[TokenLogprob], entries), self.token_text) if entries else None
            extra = {"prompt_logprobs": prompt_lps} if prompt_lps is not None else {}
            return self._chunk([wire.ChatStreamChoice(index=self.job.index, delta=wire.DeltaMessage(content=text),
                                                      logprobs=chat_lp, finish_reason=None)], **extra)
        lp = protocol.completion_logprobs(entries, self.token_text, self.text_offset) if entries else None
        self.text_offset += len(text)
        return self._chunk([wire.CompletionChoice(index=self.job.index, text=text, logprobs=lp, finish_reason=None,
                                                  prompt_logprobs=prompt_lps)])

    def finish(self, output: RequestOutput) -> str:
        reason = self.job.finish_reason(output)
        extra = {"kv_transfer_params": wire_or_none(output.kv_transfer_params)} if output.kv_transfer_params else {}
        if self.job.chat:
            return self.delta(wire.DeltaMessage(), reason, **extra)
        return self._chunk([wire.CompletionChoice(index=self.job.index, text="", logprobs=None,
                                                  finish_reason=reason)], **extra)

    def usage(self, output: RequestOutput) -> str:
        return self.usage_of(usage_of([output], [self.job]))

    def usage_of(self, usage: wire.UsageInfo) -> str:
        return self._chunk([], usage=usage)

def usage_of(outputs: list[RequestOutput], jobs: list[Job]) -> wire.UsageInfo:
    """The usage of finished outputs together, each with its job: each prompt's tokens once (its first
    sequence's), every sequence's completion tokens (as vLLM)."""
    firsts = [o for o, j in zip(outputs, jobs) if j.sample == 0]
    return wire.UsageInfo.of(sum(o.num_prompt_tokens for o in firsts),
                             sum(j.completion_tokens(o) for o, j in zip(outputs, jobs)),
                             sum(o.num_reused_tokens for o in firsts))

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
