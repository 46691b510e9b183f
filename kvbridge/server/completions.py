"""Serving one OpenAI completions or chat completions request (api_server.py routes them here).

CompletionHandlers.serve reads and validates the body, tokenises the prompt, admits the
request to the engine and answers it whole or as a server-sent-event stream. ApiError is
every error answer of the server, in OpenAI's body {"error": {...}}.

Pre-admission rejection (seed 002): a request carrying kv_transfer_params with
do_remote_prefill names blocks a prefill instance holds for it. Every path that
refuses such a request before the engine owns it runs through the one guard in
`CompletionHandlers.serve`, which tells the prefill instance to free them before the
error is answered. Once admitted, the engine's own abort/finish path does it. A 401 does
not notify: unauthenticated input must cause no side effects; the lease frees those blocks.

A client that disconnects aborts its request, streaming or not, so its blocks are freed.

Tracing (issue 30): `instance.request` (SERVER, child of the incoming `traceparent`) from handler
entry until the answer's last byte is produced, `instance.prepare` (body read, validation,
tokenisation) and `instance.stream` (first chunk -> last chunk) under it; the engine's spans join
it through the RequestTrace handed to the engine (tracing/request_trace.py). The handler tells a
request's span what happened and never asks whether tracing is on: without a Tracing every request
gets `_NO_SPAN`, whose methods do nothing (no span object is made, and the engine gets no
RequestTrace).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, cast

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from starlette.requests import ClientDisconnect
from opentelemetry.trace import SpanKind, Status, StatusCode
from pydantic import BaseModel, ValidationError

from kvbridge import openai_wire as wire
from kvbridge.engine.engine import DuplicateRequestIdError, EngineOverloadedError, EngineRequestError
from kvbridge.engine.generation_config import SamplingDefaults
from kvbridge.engine.outputs import DRAIN_TIMEOUT, RequestOutput, TokenLogprob
from kvbridge.engine.request import FinishReason
from kvbridge.engine.sampling_params import SamplingParams
from kvbridge.kv_transfer.params import KVTransferParams, KVTransferParamsError, parse_kv_transfer_params, wire_or_none
from kvbridge.server import protocol as p
from kvbridge.server.async_engine import AsyncEngine, EngineDrainingError, EngineUnavailableError, RequestStream
from kvbridge.server.metrics import RequestTimer, ServerMetrics
from kvbridge.server.undelivered import HandOff, LeaseBox, ReleaseKeys, StreamHandOff, usable_release_key
from kvbridge.tracing import TRACEPARENT_HEADER, RequestTrace, Tracing, parse_traceparent, without_none

logger = logging.getLogger("kvbridge.server.api_server")  # the name the server logged under before the split
# How long a release key may name a lease (or a release that overtook its answer): far longer
# than a proxy takes to give up on an attempt; ending an ended lease is a no-op.
RELEASE_KEY_TTL_S = 600.0
T = TypeVar("T")



class ApiError(Exception):
    """An error answer; `type` defaults from the status like OpenAI's."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.info = wire.ErrorInfo(message=message, param=param, code=code, type=type or wire.error_type(status))
        self.headers = headers or {}

    def response(self, headers: dict[str, str] | None = None) -> Response:
        return json_response(wire.ErrorResponse(error=self.info), self.status, {**self.headers, **(headers or {})})


def json_response(model: BaseModel, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    # pydantic writes non-finite floats (a -inf logprob) as null: always valid JSON
    return Response(model.model_dump_json(), status, headers, media_type="application/json")


@dataclass
class _Job:
    """One validated request, ready for the engine."""

    chat: bool
    request: p.CompletionRequest | p.ChatCompletionRequest
    prompt_ids: list[int]
    params: SamplingParams
    response_id: str
    created: int
    # Tokens a prefill instance sampled, which the proxy streamed with the role chunk: the
    # answer continues from them (LLMEngine.add_request's `continued`).
    continued: tuple[int, ...] = ()
    index: int = 0  # the prompt's place in a completion's list: its choice's index


class CompletionHandlers:
    """Serves the completions and chat completions requests of one instance's engine."""

    def __init__(self, engine: AsyncEngine, metrics: ServerMetrics, defaults: SamplingDefaults,
                 tracing: Tracing | None = None) -> None:
        self.engine = engine
        self.tracing = tracing  # None: requests are not traced
        # The one place that asks whether tracing is on: a traced span per request, or the null one.
        self._span: Callable[[Request, bool], _Span] = _no_span if tracing is None else functools.partial(
            _RequestSpan, tracing)
        self.metrics = metrics
        self.defaults = defaults  # the model's sampling defaults (--generation-config)
        self.created = int(time.time())
        # A prompt text longer than this has more tokens than the context holds, whatever
        # its content: it is refused without being tokenised (a 10 MB prompt took 9 s).
        self.max_prompt_bytes = engine.max_model_len * engine.tokenizer.max_bytes_per_token
        # P: the leases of answers the proxy gave up on, by the key it sent (undelivered.py)
        self.release_keys = ReleaseKeys(RELEASE_KEY_TTL_S)

    async def serve(self, raw: Request, chat: bool) -> Response:
        timer = self.metrics.request_timer()  # latencies count from arrival
        span = self._span(raw, chat)
        request_id = _request_id(raw)
        headers = {wire.REQUEST_ID_HEADER: request_id}
        kv_params: KVTransferParams | None = None
        job: _Job | None = None
        try:
            body = await read_json(raw)
            kv_params = _parse_kv_params(body)
            # Tokenising holds a thread for up to a second or two (a prompt near the byte
            # bound): never the event loop, which must keep answering /health and streams.
            jobs = await asyncio.to_thread(self._prepare, body, chat, request_id)
            if len(jobs) > 1 and kv_params is not None:
                raise ApiError(400, "a list of prompts cannot take kv_transfer_params: send one prompt per "
                               "prefill/decode request (the proxy splits lists)", param="prompt")
            job = jobs[0]
            span.prepared(kv_params, job)
            if len(jobs) > 1:
                streams = await self._admit_all(request_id, jobs, span)
            else:
                stream = await self._admit(request_id, job, kv_params, span)
        except Exception as exc:  # the one guard around every pre-admission rejection
            error = as_api_error(exc, request_id)
            self.metrics.record_rejected()
            if kv_params is not None and kv_params.do_remote_prefill and self.engine.has_kv_connector:
                await self.engine.notify_kv_transfer_rejected(request_id, kv_params)
            span.refused(kv_params, error)
            return error.response(headers)
        if len(jobs) > 1:
            return await self._serve_list(raw, jobs, streams, timer, span, headers)
        watcher = asyncio.create_task(_abort_on_disconnect(raw, [stream]))
        release_key = raw.headers.get(wire.RELEASE_KEY_HEADER)
        release_key = release_key if usable_release_key(release_key) else None
        if job.request.stream:
            lease = LeaseBox(outputs=stream, leased=_leased)  # P: the stream's last chunk names leased blocks
            body_chunks = self._stream(job, stream, timer, watcher, span, lease, release_key)
            chunks = span.traced_stream(body_chunks)
            if kv_params is not None and kv_params.do_remote_decode:
                return StreamHandOff(chunks, headers, lease, self.release_lease, request_id)
            return StreamingResponse(chunks, media_type="text/event-stream", headers=headers)
        leased: KVTransferParams | None = None  # P's answer names blocks under a lease
        try:
            answer, leased = await self._collect(job, stream, timer)
            if leased is not None:
                leased = await self._bound(release_key, leased)
            response = (json_response(answer, headers=headers) if leased is None else
                        HandOff(answer.model_dump_json(), headers, LeaseBox(leased), self.release_lease, request_id))
        except ApiError as error:
            span.failed(error)
            return error.response(headers)
        except BaseException as exc:  # answered 500 by the app's handler (or cancelled)
            span.end(500, f"{type(exc).__name__}: {exc}", "internal_error")
            if leased is not None:  # the answer will never be written
                await asyncio.shield(self.release_lease(leased))
            raise
        finally:
            watcher.cancel()
            stream.abort()
            timer.on_abandoned()
        usage = answer.usage
        span.answered(usage.completion_tokens if usage else None, answer.choices[0].finish_reason)
        span.end(200)
        return response

    # ---------------------------------------------------------------- admission

    def _prepare(self, body: dict[str, Any], chat: bool, request_id: str) -> list[_Job]:
        """Validates and tokenises: one job per prompt (a chat, or a completion's one prompt: one
        job; a completion's list: one per entry, in order). Nothing is admitted unless every prompt
        passed. Runs on a worker thread."""
        model_cls = p.ChatCompletionRequest if chat else p.CompletionRequest
        try:
            request = model_cls.model_validate(body)
        except ValidationError as exc:
            raise _validation_error(exc) from None
        if request.model is not None and request.model != self.engine.model_name:
            raise ApiError(404, f"The model `{request.model}` does not exist.",
                           param="model", code="model_not_found")
        vocab = self.engine.tokenizer.vocab_size
        for field, ids in request.token_id_fields().items():
            check_token_ids(ids, vocab, field)
        prompts = self._prompt_ids(request)
        prefix = "chatcmpl-" if chat else "cmpl-"
        created = int(time.time())
        return [_Job(chat, request, ids, self._params(request, len(ids)), prefix + request_id, created,
                     tuple(request.continue_from_token_ids or ()), index) for index, ids in enumerate(prompts)]

    def _prompt_ids(self, request: p.CompletionRequest | p.ChatCompletionRequest) -> list[list[int]]:
        """Each prompt's token ids (a chat's through its template), checked against the vocabulary."""
        tokenizer = self.engine.tokenizer
        if isinstance(request, p.ChatCompletionRequest):
            try:
                text = tokenizer.apply_chat_template(
                    [m.as_template_message() for m in request.messages], add_generation_prompt=True)
            except ValueError as exc:
                raise ApiError(400, f"invalid messages: {exc}", param="messages") from None
            self._check_prompt_bytes(text, "messages")
            return [tokenizer.encode(text, add_special_tokens=False)]
        out = []
        for prompt in request.prompts:
            if isinstance(prompt, str):
                self._check_prompt_bytes(prompt, "prompt")
                out.append(tokenizer.encode(prompt, add_special_tokens=True))
            else:
                check_token_ids(prompt, tokenizer.vocab_size, "prompt")
                out.append(list(prompt))
        return out

    def _params(self, request: p.CompletionRequest | p.ChatCompletionRequest, num_prompt: int) -> SamplingParams:
        """The sampling params of one prompt of `request` (its length decides max_tokens' default)."""
        max_tokens = self._check_length(request, num_prompt)
        if request.min_tokens > max_tokens:
            raise ApiError(400, f"min_tokens must be less than or equal to max_tokens={max_tokens}, "
                           f"got {request.min_tokens}", param="min_tokens")
        try:
            params = request.to_sampling_params(max_tokens, self.defaults)
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None
        if not params.ignore_eos:  # end-of-turn tokens besides eos (e.g. <|endoftext|>)
            stops = set(params.stop_token_ids) | set(self.engine.tokenizer.stop_token_ids)
            params = dataclasses.replace(params, stop_token_ids=tuple(sorted(stops)))
        return params

    def _check_prompt_bytes(self, text: str, param: str) -> None:
        size = len(text.encode("utf-8"))
        if size > self.max_prompt_bytes:
            limit = self.engine.max_model_len
            raise ApiError(400, f"This model's maximum context length is {limit} tokens, but the "
                           f"prompt has {size} bytes, more than {limit} tokens can hold. "
                           "Please shorten the prompt.", param=param, code="context_length_exceeded")

    def _check_length(self, request: p.CompletionRequest | p.ChatCompletionRequest,
                      num_prompt: int) -> int:
        """The request's max_tokens; without one, the model's default (at most what the context
        leaves, as vLLM), else what the context leaves (chat) or COMPLETION_MAX_TOKENS; or 400."""
        limit = self.engine.max_model_len
        param = "messages" if isinstance(request, p.ChatCompletionRequest) else "prompt"
        if num_prompt >= limit:
            raise ApiError(400, f"This model's maximum context length is {limit} tokens, but "
                           f"the prompt has {num_prompt} tokens and at least one token must be "
                           "generated. Please shorten the prompt.",
                           param=param, code="context_length_exceeded")
        requested = request.requested_max_tokens
        if requested is not None:
            max_tokens = requested
        elif self.defaults.max_tokens is not None:
            max_tokens = min(self.defaults.max_tokens, limit - num_prompt)
        elif isinstance(request, p.ChatCompletionRequest):
            max_tokens = limit - num_prompt
        else:
            max_tokens = p.COMPLETION_MAX_TOKENS
        if num_prompt + max_tokens > limit:
            raise ApiError(400, f"This model's maximum context length is {limit} tokens. "
                           f"However, you requested {num_prompt + max_tokens} tokens "
                           f"({num_prompt} in the prompt, {max_tokens} for the completion). "
                           "Please reduce the prompt or max_tokens.",
                           param="max_tokens", code="context_length_exceeded")
        return max_tokens

    async def _admit(self, request_id: str, job: _Job, kv_params: KVTransferParams | None,
                     span: _Span) -> RequestStream:
        trace = span.request_trace()
        try:
            try:
                stream = await self.engine.add_request(request_id, job.prompt_ids, job.params, kv_params,
                                                       job.continued, trace)
            except DuplicateRequestIdError:
                # A client (or a proxy passing client ids through) reused an X-Request-Id while
                # the engine still holds state for it, e.g. blocks leased to a remote reader.
                # Like vLLM, serve it under a unique internal id; the answer keeps the header.
                unique = f"{request_id}-{uuid.uuid4().hex[:12]}"
                logger.info("request id %s is in use; serving this request as %s", request_id, unique)
                stream = await self.engine.add_request(unique, job.prompt_ids, job.params, kv_params,
                                                       job.continued, trace)
        except EngineRequestError as exc:
            raise ApiError(400, str(exc)) from None
        except EngineOverloadedError as exc:
            raise ApiError(503, str(exc) or "the server is overloaded; retry later",
                           code="overloaded", headers={"Retry-After": "1"}) from None
        except EngineDrainingError as exc:  # a router retries it on another instance
            raise ApiError(503, str(exc), code="draining") from None
        except EngineUnavailableError as exc:
            raise ApiError(503, str(exc), code="unavailable") from None
        span.admitted(stream.request_id)
        return stream

    # ---------------------------------------------------------------- answers

    async def release_lease(self, params: KVTransferParams) -> None:
        """P: end the lease `params` name at once (their answer never reached its caller).
        Never raises: a failure leaves the blocks to the lease's expiry."""
        try:
            released = await self.engine.call(lambda e: e.release_kv(params))
        except Exception:
            logger.exception("request %s: releasing its KV failed; its lease will free the blocks",
                             params.remote_request_id)
            return
        if released:
            self.metrics.record_undelivered_release()

    async def _bound(self, release_key: str | None, params: KVTransferParams) -> KVTransferParams | None:
        """Bind P's answer to its caller's release key. None: the caller released the key before
        the answer was ready (it gave up on this attempt), so the lease is ended now."""
        if release_key is None or self.release_keys.bind(release_key, params):
            return params
        logger.info("request %s: its caller gave up before P answered; releasing its KV", params.remote_request_id)
        await self.release_lease(params)
        return None

    async def _collect(self, job: _Job, stream: RequestStream, timer: RequestTimer,
                       ) -> tuple[wire.CompletionResponse | wire.ChatCompletionResponse, KVTransferParams | None]:
        """The whole answer, and the params of the lease it names (P with kv_transfer_params)."""
        text: list[str] = []
        logprobs: list[TokenLogprob] = []
        last: RequestOutput | None = None
        async for last in stream:
            timer.on_output(last)
            text.append(last.new_text)
            logprobs.extend(last.logprobs or ())
        assert last is not None and last.finished  # a stream always ends with its finished output
        _raise_if_failed(last)
        usage = wire.UsageInfo.of(last.num_prompt_tokens, last.num_output_tokens, last.num_cached_tokens)
        reason = last.finish_reason.value if last.finish_reason else None
        token_text = self.engine.tokenizer.token_text
        if job.chat:
            chat_lp = p.chat_logprobs(logprobs, token_text) if job.params.logprobs is not None else None
            chat_choice = wire.ChatChoice(message=wire.ChatMessageOut(content="".join(text)), logprobs=chat_lp,
                                          finish_reason=reason)
            return wire.ChatCompletionResponse(id=job.response_id, created=job.created,
                                               model=self.engine.model_name, choices=[chat_choice],
                                               usage=usage, kv_transfer_params=wire_or_none(last.kv_transfer_params)
                                               ), _leased(last)
        lp = p.completion_logprobs(logprobs, token_text, 0) if job.params.logprobs is not None else None
        choice = wire.CompletionChoice(index=job.index, text="".join(text), logprobs=lp, finish_reason=reason)
        return wire.CompletionResponse(id=job.response_id, created=job.created,
                                       model=self.engine.model_name, choices=[choice], usage=usage,
                                       kv_transfer_params=wire_or_none(last.kv_transfer_params)), _leased(last)

    # ---------------------------------------------------------------- /tokenize and /detokenize

    async def tokenize(self, raw: Request) -> Response:
        """vLLM's POST /tokenize: a prompt (with the model's special tokens unless told otherwise) or
        chat messages (through the chat template) as token ids, their count and max_model_len."""
        try:
            body = await read_json(raw)
            answer = await asyncio.to_thread(self._tokenize, body)
        except Exception as exc:
            return as_api_error(exc, _request_id(raw)).response()
        return json_response(answer)

    def _tokenize(self, body: dict[str, Any]) -> p.TokenizeResponse:
        model_cls: type[p.TokenizeChatRequest | p.TokenizeCompletionRequest] = (
            p.TokenizeChatRequest if "messages" in body else p.TokenizeCompletionRequest)
        try:
            request = model_cls.model_validate(body)
        except ValidationError as exc:
            raise _validation_error(exc) from None
        self._check_model(request.model)
        tokenizer = self.engine.tokenizer
        if isinstance(request, p.TokenizeChatRequest):
            try:
                text = tokenizer.apply_chat_template([m.as_template_message() for m in request.messages],
                                                     add_generation_prompt=request.add_generation_prompt)
            except ValueError as exc:
                raise ApiError(400, f"invalid messages: {exc}", param="messages") from None
            param = "messages"
        else:
            text, param = request.prompt, "prompt"
        self._check_prompt_bytes(text, param)
        ids = tokenizer.encode(text, add_special_tokens=request.add_special_tokens)
        strs = [tokenizer.token_text(t) for t in ids] if request.return_token_strs else None
        return p.TokenizeResponse(count=len(ids), max_model_len=self.engine.max_model_len, tokens=ids, token_strs=strs)

    async def detokenize(self, raw: Request) -> Response:
        """vLLM's POST /detokenize: token ids as text (special tokens kept)."""
        try:
            body = await read_json(raw)
            try:
                request = p.DetokenizeRequest.model_validate(body)
            except ValidationError as exc:
                raise _validation_error(exc) from None
            self._check_model(request.model)
            check_token_ids(request.tokens, self.engine.tokenizer.vocab_size, "tokens")
            text = await asyncio.to_thread(self.engine.tokenizer.decode, request.tokens, False)
        except Exception as exc:
            return as_api_error(exc, _request_id(raw)).response()
        return json_response(p.DetokenizeResponse(prompt=text))

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.engine.model_name:
            raise ApiError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")

    # ---------------------------------------------------------------- a completion's list of prompts

    async def _admit_all(self, request_id: str, jobs: list[_Job], span: _Span) -> list[RequestStream]:
        """Admits each prompt of a list as its own engine request, `<request id>-<index>` (vLLM's
        naming); if one is refused, those admitted are aborted and the refusal raised."""
        streams: list[RequestStream] = []
        try:
            for job in jobs:
                streams.append(await self._admit(f"{request_id}-{job.index}", job, None, span))
        except BaseException:
            for stream in streams:
                stream.abort()
            raise
        return streams

    async def _serve_list(self, raw: Request, jobs: list[_Job], streams: list[RequestStream],
                          first_timer: RequestTimer, span: _Span, headers: dict[str, str]) -> Response:
        """The answer to a completion's list of prompts: one choice per prompt with its index and
        the usage summed, whole or as one stream of every prompt's chunks as they come (vLLM's
        semantics). One prompt's failure fails the request: the others are aborted."""
        timers = [first_timer] + [self.metrics.request_timer() for _ in jobs[1:]]
        watcher = asyncio.create_task(_abort_on_disconnect(raw, streams))
        if jobs[0].request.stream:
            chunks = self._stream_list(jobs, streams, timers, watcher, span)
            return StreamingResponse(span.traced_stream(chunks), media_type="text/event-stream", headers=headers)
        try:
            answers = await _all_or_none([self._collect(job, stream, timer)
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
        parts = [cast(wire.CompletionResponse, answer) for answer, _ in answers]
        usage = _summed([a.usage for a in parts if a.usage is not None])
        merged = parts[0].model_copy(update={"choices": [a.choices[0] for a in parts], "usage": usage,
                                             "kv_transfer_params": None})
        span.answered(usage.completion_tokens, parts[0].choices[0].finish_reason)
        span.end(200)
        return json_response(merged, headers=headers)

    async def _stream_list(self, jobs: list[_Job], streams: list[RequestStream], timers: list[RequestTimer],
                           watcher: asyncio.Task[None], span: _Span) -> AsyncGenerator[str, None]:
        """Every prompt's chunks as its engine request yields them, each choice with its index; the
        usage chunk (when asked) sums them all; one [DONE]. An error ends the whole stream."""
        makers = [_ChunkMaker(job, self.engine) for job in jobs]
        finished: list[RequestOutput] = []
        try:
            async with aclosing(_merged(streams)) as outputs:
                async for index, output in outputs:
                    timers[index].on_output(output)
                    if output.finished:
                        _raise_if_failed(output)
                    if output.new_text or output.logprobs:
                        yield makers[index].content(output)
                    if output.finished:
                        finished.append(output)
                        yield makers[index].finish(output)
            usage = usage_of(finished)
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

    async def _stream(self, job: _Job, stream: RequestStream, timer: RequestTimer,
                      watcher: asyncio.Task[None], span: _Span, lease: LeaseBox,
                      release_key: str | None = None) -> AsyncGenerator[str, None]:
        """`lease`: where the finishing chunk's leased params go (P: StreamHandOff ends that lease if
        the stream does not reach its caller whole)."""
        chunks = _ChunkMaker(job, self.engine)
        try:
            if job.chat and not job.continued:
                yield chunks.delta(wire.DeltaMessage(role="assistant", content=""))
            async for output in stream:
                timer.on_output(output)
                if output.finished:
                    _raise_if_failed(output)
                if output.new_text or output.logprobs:
                    yield chunks.content(output)
                if output.finished:
                    span.answered(output.num_output_tokens,
                                  output.finish_reason.value if output.finish_reason else None)
                    if (leased := _leased(output)) is not None:
                        lease.params = await self._bound(release_key, leased)
                    yield chunks.finish(output)
                    if job.request.include_usage_chunk:
                        yield chunks.usage(output)
            yield "data: [DONE]\n\n"
        except Exception as exc:
            error = exc if isinstance(exc, ApiError) else as_api_error(exc, job.response_id)
            span.stream_failed(error)
            yield wire.sse_event(wire.ErrorResponse(error=error.info))
            yield "data: [DONE]\n\n"
        finally:
            watcher.cancel()
            stream.abort()
            timer.on_abandoned()


class _Span(Protocol):
    """What the handler tells one request's span (`_RequestSpan`, or `_NO_SPAN` when tracing is off)."""

    def prepared(self, kv_params: KVTransferParams | None, job: _Job) -> None:
        """The body was read, validated and tokenised."""
        ...

    def refused(self, kv_params: KVTransferParams | None, error: ApiError) -> None:
        """The request was refused before the engine took it (`kv_params`: as far as they were read)."""
        ...

    def request_trace(self) -> RequestTrace | None:
        """What the engine records its spans under (None: the engine traces nothing)."""
        ...

    def admitted(self, request_id: str) -> None:
        """The engine took the request, under `request_id`."""
        ...

    def answered(self, output_tokens: int | None, finish_reason: str | None) -> None: ...

    def stream_failed(self, error: ApiError) -> None:
        """The stream ends with `error`'s event."""
        ...

    def failed(self, error: ApiError) -> None:
        """The request ends with `error`'s answer."""
        ...

    def end(self, status: int, error: str | None = None, error_type: str | None = None,
            end_ns: int | None = None) -> None:
        """The answer's last byte is produced (`error`: the request failed)."""
        ...

    def traced_stream(self, chunks: AsyncGenerator[str, None]) -> AsyncIterator[str]:
        """The answer's stream, as the span sees it go out (it ends the span)."""
        ...


class _NoSpan(_Span):
    """The span of every request while tracing is off: does nothing."""

    def prepared(self, kv_params: KVTransferParams | None, job: _Job) -> None:
        pass

    def refused(self, kv_params: KVTransferParams | None, error: ApiError) -> None:
        pass

    def request_trace(self) -> RequestTrace | None:
        return None

    def admitted(self, request_id: str) -> None:
        pass

    def answered(self, output_tokens: int | None, finish_reason: str | None) -> None:
        pass

    def stream_failed(self, error: ApiError) -> None:
        pass

    def failed(self, error: ApiError) -> None:
        pass

    def end(self, status: int, error: str | None = None, error_type: str | None = None,
            end_ns: int | None = None) -> None:
        pass

    def traced_stream(self, chunks: AsyncGenerator[str, None]) -> AsyncIterator[str]:
        return chunks


_NO_SPAN: _Span = _NoSpan()


def _no_span(raw: Request, chat: bool) -> _Span:
    return _NO_SPAN


class _RequestSpan(_Span):
    """The live `instance.request` span of one traced request (`_Span`)."""

    def __init__(self, tracing: Tracing, raw: Request, chat: bool) -> None:
        self.tracing = tracing
        self.start_ns = time.time_ns()
        route = "/v1/chat/completions" if chat else "/v1/completions"
        self.span = tracing.start_span("instance.request", parse_traceparent(raw.headers.get(TRACEPARENT_HEADER)),
                                       kind=SpanKind.SERVER, start_ns=self.start_ns,
                                       attributes={"http.request.method": "POST", "http.route": route})
        self.context = self.span.get_span_context()
        self.stream_error: ApiError | None = None  # the error event a stream ended with
        self._prepare_ended = False

    def prepared(self, kv_params: KVTransferParams | None, job: _Job) -> None:
        self._end_prepare(kv_params, len(job.prompt_ids), None)

    def refused(self, kv_params: KVTransferParams | None, error: ApiError) -> None:
        if not self._prepare_ended:
            self._end_prepare(kv_params, None, error)
        self.failed(error)

    def _end_prepare(self, kv_params: KVTransferParams | None, prompt_tokens: int | None,
                     error: ApiError | None) -> None:
        """`instance.prepare` ends: the body read, validated and tokenised (or refused)."""
        self._prepare_ended = True
        role = ("decode" if kv_params.do_remote_prefill else "prefill" if kv_params.do_remote_decode
                else "colocated") if kv_params is not None else "colocated"
        self.span.set_attribute("kvbridge.role", role)
        if prompt_tokens is not None:
            self.span.set_attribute("gen_ai.usage.input_tokens", prompt_tokens)
        self.tracing.record("instance.prepare", self.context, self.start_ns, time.time_ns(),
                            attributes=without_none({"kvbridge.num_tokens": prompt_tokens}),
                            error=error.info.message if error is not None else None)

    def request_trace(self) -> RequestTrace | None:
        return RequestTrace(self.tracing, self.context)

    def admitted(self, request_id: str) -> None:
        self.span.set_attribute("kvbridge.request_id", request_id)

    def answered(self, output_tokens: int | None, finish_reason: str | None) -> None:
        self.span.set_attributes(without_none({"gen_ai.usage.output_tokens": output_tokens,
                                               "gen_ai.response.finish_reasons": [finish_reason]
                                               if finish_reason else None}))

    def stream_failed(self, error: ApiError) -> None:
        self.stream_error = error

    def failed(self, error: ApiError) -> None:
        self.end(error.status, error.info.message, error.info.code)

    def end(self, status: int, error: str | None = None, error_type: str | None = None,
            end_ns: int | None = None) -> None:
        """The answer's last byte is produced: ends `instance.request` (ERROR with `error`)."""
        self.span.set_attribute("http.response.status_code", status)
        if error is not None:
            self.span.set_attribute("error.type", error_type or str(status))
            self.span.set_status(Status(StatusCode.ERROR, error))
        self.span.end(end_time=end_ns)

    async def traced_stream(self, chunks: AsyncGenerator[str, None]) -> AsyncIterator[str]:
        """The answer's stream, timed: `instance.stream` from the first chunk produced to the last
        one written; the request's span ends with it (ERROR if the stream ended with an error
        event, or the client left before the end)."""
        first_ns = 0
        count = 0
        complete = False
        try:
            async with aclosing(chunks):
                async for chunk in chunks:
                    first_ns = first_ns or time.time_ns()
                    count += 1
                    yield chunk
                complete = True
        finally:
            end_ns = time.time_ns()
            error = self.stream_error
            message = (error.info.message if error is not None
                       else None if complete else "the client went away before the end of the stream")
            if first_ns:
                self.tracing.record("instance.stream", self.context, first_ns, end_ns, error=message,
                                    attributes={"kvbridge.num_chunks": count})
            self.end(200, message, (error.info.code or str(error.status)) if error is not None
                     else None if complete else "client_disconnected", end_ns)


class _ChunkMaker:
    """Builds one request's stream chunks as JSON-able dicts. Like OpenAI, `usage` is on
    every chunk (null but on the last) only when the client asked for usage;
    `kv_transfer_params` only on the finishing chunk, when the engine returned some."""

    def __init__(self, job: _Job, engine: AsyncEngine) -> None:
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
            chat_lp = p.chat_logprobs(logprobs, self.token_text) if logprobs else None
            return self._chunk([wire.ChatStreamChoice(delta=wire.DeltaMessage(content=output.new_text),
                                                      logprobs=chat_lp, finish_reason=None)])
        lp = p.completion_logprobs(logprobs, self.token_text, self.text_offset) if logprobs else None
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


# -------------------------------------------------------------------- helpers


def _request_id(raw: Request) -> str:
    """The caller's X-Request-Id when it is sane (the P/D proxy sends one id to P and D),
    else a fresh one."""
    given = raw.headers.get(wire.REQUEST_ID_HEADER)
    if given is not None and wire.usable_request_id(given):
        return given
    return uuid.uuid4().hex


async def read_json(raw: Request) -> dict[str, Any]:
    try:
        data = await wire.read_capped(raw.stream(), wire.MAX_BODY_BYTES)
    except ClientDisconnect:  # the caller left mid-body (a proxy that gave up): nobody reads an answer
        raise ApiError(499, "the client closed the connection before its request was read",
                       code="client_disconnected") from None
    if data is None:
        raise ApiError(413, f"the request body is larger than {wire.MAX_BODY_BYTES} bytes", code="request_too_large")
    try:
        return wire.parse_json_object(data)
    except ValueError as exc:
        raise ApiError(400, str(exc), code="invalid_json") from None


def usage_of(outputs: list[RequestOutput]) -> wire.UsageInfo:
    """The usage of finished outputs together (a list's prompts: summed, as vLLM)."""
    return wire.UsageInfo.of(sum(o.num_prompt_tokens for o in outputs), sum(o.num_output_tokens for o in outputs),
                             sum(o.num_cached_tokens for o in outputs))


def _summed(usages: list[wire.UsageInfo]) -> wire.UsageInfo:
    return wire.UsageInfo.of(sum(u.prompt_tokens for u in usages), sum(u.completion_tokens for u in usages),
                             sum(u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else 0
                                 for u in usages))


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


def check_token_ids(ids: list[int], vocab: int, param: str) -> None:
    """400 naming `param` when an id is outside the vocabulary (vLLM's check and status)."""
    bad = sorted({t for t in ids if not 0 <= t < vocab})
    if bad:
        shown = ", ".join(map(str, bad[:8])) + (", ..." if len(bad) > 8 else "")
        raise ApiError(400, f"token_id(s) [{shown}] in {param} contain out-of-vocab token ids. "
                       f"Vocabulary size: {vocab}", param=param)


def _parse_kv_params(body: dict[str, Any]) -> KVTransferParams | None:
    try:
        return parse_kv_transfer_params(body.get("kv_transfer_params"))
    except KVTransferParamsError as exc:
        raise ApiError(400, str(exc), param="kv_transfer_params") from None


def _validation_error(exc: ValidationError) -> ApiError:
    """One 400 from pydantic's errors; the deepest one is the most specific (in a union,
    the member that got furthest)."""
    errors = exc.errors(include_url=False)
    worst = max(errors, key=lambda e: len(e["loc"]))
    # Union members show up in the location as type names ("str", "list[int]"): drop them.
    path = [str(x) for x in worst["loc"]
            if not (isinstance(x, str) and (x in ("str", "int", "float", "bool") or "[" in x))]
    message = worst["msg"].removeprefix("Value error, ")
    where = ".".join(path)
    return ApiError(400, f"{where}: {message}" if where else message,
                    param=path[0] if path else None)


def as_api_error(exc: BaseException, request_id: str) -> ApiError:
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, RequestValidationError):
        return ApiError(400, str(exc))
    logger.error("request %s: unexpected error", request_id, exc_info=exc)
    return ApiError(500, f"internal error: {type(exc).__name__}", code="internal_error")


def _leased(output: RequestOutput) -> KVTransferParams | None:
    """The params of the lease a finished output names: P's answer (do_remote_prefill for D)."""
    params = output.kv_transfer_params
    return params if params is not None and params.do_remote_prefill and params.remote_request_id else None


def _raise_if_failed(output: RequestOutput) -> None:
    if output.finish_reason is FinishReason.ERROR and output.error_code == DRAIN_TIMEOUT:
        raise ApiError(503, output.error or "the server drained before this request completed", code=DRAIN_TIMEOUT)
    if output.finish_reason is FinishReason.ERROR:
        raise ApiError(500, output.error or "the engine failed to serve this request",
                       code=output.error_code or "engine_error")
    if output.finish_reason is FinishReason.ABORT:
        raise ApiError(503, "the request was aborted before it completed", code="aborted")


async def _abort_on_disconnect(raw: Request, streams: list[RequestStream]) -> None:
    """Abort the request (each of a list's) when the client goes away. The body has been read, so
    the next ASGI message is the disconnect."""
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            for stream in streams:
                logger.info("request %s: client disconnected, aborting", stream.request_id)
                stream.abort()
            return
