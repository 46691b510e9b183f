"""Serving one OpenAI completions or chat completions request (api_server.py routes them here).

CompletionHandlers.serve reads and validates the body, tokenises the prompt, admits the
request to the engine and answers it whole or as a server-sent-event stream; a completion's list
of prompts is answered by prompt_lists.py. The parts of an answer (the job, its chunks, usage) are
in answer.py, every error answer (ApiError, OpenAI's body {"error": {...}}) in errors.py.

Pre-admission rejection: a request carrying kv_transfer_params with do_remote_prefill names
blocks a prefill instance holds for it. Every path that refuses such a request before the engine
owns it runs through the one guard in `CompletionHandlers.serve`, which tells the prefill instance
to free them before the error is answered. Once admitted, the engine's own abort/finish path does
it. A 401 does not notify: unauthenticated input must cause no side effects; the lease frees
those blocks.

A client that disconnects aborts its request, streaming or not, so its blocks are freed.

Tracing: each request gets a span (request_span.py), traced or the null one, told what happened;
the engine's spans join it through the RequestTrace handed to the engine
(tracing/request_trace.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from typing import Any, cast

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import ValidationError

from kvbridge import openai_wire as wire
from kvbridge.engine.engine import DuplicateRequestIdError, EngineOverloadedError, EngineRequestError
from kvbridge.engine.setup.generation_config import SamplingDefaults
from kvbridge.engine.outputs import RequestOutput, TokenLogprob
from kvbridge.engine.sampling_params import SEED_MAX, SamplingParams
from kvbridge.kv_transfer.params import KVTransferParams, wire_or_none
from kvbridge.server import protocol
from kvbridge.server.answer import ChunkMaker, Job, abort_on_disconnect, leased_params, raise_if_failed
from kvbridge.server.async_engine import AsyncEngine, EngineDrainingError, EngineUnavailableError, RequestStream
from kvbridge.server.errors import (ApiError, as_api_error, check_token_ids, json_response, parse_kv_params,
                                    read_json, validation_error)
from kvbridge.server.metrics import RequestTimer, ServerMetrics
from kvbridge.server.prompt_lists import admit_all, serve_list
from kvbridge.server.request_span import RequestSpan, Span, no_span
from kvbridge.server.undelivered import HandOff, LeaseBox, ReleaseKeys, StreamHandOff, usable_release_key
from kvbridge.tracing import Tracing


logger = logging.getLogger("kvbridge.server.api_server")  # the name the server logged under before the split
# How long a release key may name a lease (or a release that overtook its answer): far longer
# than a proxy takes to give up on an attempt; ending an ended lease is a no-op.
RELEASE_KEY_TTL_S = 600.0


class CompletionHandlers:
    """Serves the completions and chat completions requests of one instance's engine."""

    def __init__(self, engine: AsyncEngine, metrics: ServerMetrics, defaults: SamplingDefaults,
                 tracing: Tracing | None = None) -> None:
        self.engine = engine
        self.tracing = tracing  # None: requests are not traced
        # The one place that asks whether tracing is on: a traced span per request, or the null one.
        self._span: Callable[[Request, bool], Span] = no_span if tracing is None else functools.partial(
            RequestSpan, tracing)
        self.metrics = metrics
        self.defaults = defaults  # the model's sampling defaults (--generation-config)
        self.created = int(time.time())
        # A prompt text longer than this has more tokens than the context holds, whatever
        # its content: it is refused without being tokenised (a huge prompt would hold a thread for seconds).
        self.max_prompt_bytes = engine.max_model_len * engine.tokenizer.max_bytes_per_token
        # P: the leases of answers the proxy gave up on, by the key it sent (undelivered.py)
        self.release_keys = ReleaseKeys(RELEASE_KEY_TTL_S)

    async def serve(self, raw: Request, chat: bool) -> Response:
        timer = self.metrics.request_timer()  # latencies count from arrival
        span = self._span(raw, chat)
        request_id = _request_id(raw)
        headers = {wire.REQUEST_ID_HEADER: request_id}
        kv_params: KVTransferParams | None = None
        job: Job | None = None
        try:
            body = await read_json(raw)
            kv_params = parse_kv_params(body)
            # Tokenising holds a thread for up to a second or two (a prompt near the byte
            # bound): never the event loop, which must keep answering /health and streams.
            jobs = await asyncio.to_thread(self._prepare, body, chat, request_id)
            if jobs[-1].prompt_index > 0 and kv_params is not None:
                raise ApiError(400, "a list of prompts cannot take kv_transfer_params: send one prompt per "
                               "prefill/decode request (the proxy splits lists)", param="prompt")
            if len(jobs) > 1 and kv_params is not None and kv_params.do_remote_decode:
                raise ApiError(400, "n > 1 (or best_of) cannot be prefilled for a remote decode: the prefill "
                               "computes one sequence (the proxy sends n=1) and D samples the n", param="n")
            job = jobs[0]
            span.prepared(kv_params, job)
            if len(jobs) > 1:  # a list of prompts, or n > 1: the first sequence of a prompt takes its KV
                streams = await admit_all(self._admit, request_id, jobs, span, kv_params)
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
            timers = [timer] + [self.metrics.request_timer() for _ in jobs[1:]]
            return await serve_list(raw, self.engine, self._collect, jobs, streams, timers, span, headers)
        watcher = asyncio.create_task(abort_on_disconnect(raw, [stream]))
        release_key = raw.headers.get(wire.RELEASE_KEY_HEADER)
        release_key = release_key if usable_release_key(release_key) else None
        if job.request.stream:
            lease = LeaseBox(outputs=stream, leased=leased_params)  # P: the stream's last chunk names leased blocks
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

    def _prepare(self, body: dict[str, Any], chat: bool, request_id: str) -> list[Job]:
        """Validates and tokenises: one job per prompt (a chat, or a completion's one prompt: one
        job; a completion's list: one per entry, in order). Nothing is admitted unless every prompt
        passed. Runs on a worker thread."""
        model_cls = protocol.ChatCompletionRequest if chat else protocol.CompletionRequest
        try:
            request = model_cls.model_validate(body)
        except ValidationError as exc:
            raise validation_error(exc) from None
        if request.model is not None and request.model != self.engine.model_name:
            raise ApiError(404, f"The model `{request.model}` does not exist.",
                           param="model", code="model_not_found")
        vocab = self.engine.tokenizer.vocab_size
        for field, ids in request.token_id_fields().items():
            check_token_ids(ids, vocab, field)
        prompts = self._prompt_ids(request)
        samples = request.samples
        if len(prompts) * samples > protocol.MAX_SEQUENCES:
            param = "best_of" if samples != request.n else "n"
            raise ApiError(400, f"{len(prompts)} prompts x {param}={samples} sequences: at most "
                           f"{protocol.MAX_SEQUENCES} per request", param=param)
        prefix = "chatcmpl-" if chat else "cmpl-"
        created = int(time.time())
        continued = tuple(request.continue_from_token_ids or ())
        jobs = []
        for p_index, ids in enumerate(prompts):
            params = self._params(request, len(ids))
            if samples > request.n and params.logprobs is None:  # best_of ranks by the sequences' logprobs
                params = dataclasses.replace(params, logprobs=0)
            for j in range(samples):
                jobs.append(Job(chat, request, ids, _sample_params(params, j), prefix + request_id, created,
                                continued, p_index * samples + j, p_index, j))
        return jobs

    def _prompt_ids(self, request: protocol.CompletionRequest | protocol.ChatCompletionRequest) -> list[list[int]]:
        """Each prompt's token ids (a chat's through its template), checked against the vocabulary."""
        tokenizer = self.engine.tokenizer
        if isinstance(request, protocol.ChatCompletionRequest):
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

    def _params(self, request: protocol.CompletionRequest | protocol.ChatCompletionRequest, num_prompt: int) -> SamplingParams:
        """The sampling params of one prompt of `request` (its length decides max_tokens' default)."""
        max_tokens = self._check_length(request, num_prompt)
        if request.min_tokens > max_tokens:
            raise ApiError(400, f"min_tokens must be less than or equal to max_tokens={max_tokens}, "
                           f"got {request.min_tokens}", param="min_tokens")
        if max_tokens == 0:  # echo alone: the engine samples one token, which the answer drops (as vLLM)
            max_tokens = 1
        try:
            params = request.to_sampling_params(max_tokens, self.defaults)
        except ValueError as exc:
            raise ApiError(400, str(exc), param=getattr(exc, "param", None)) from None
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

    def _check_length(self, request: protocol.CompletionRequest | protocol.ChatCompletionRequest,
                      num_prompt: int) -> int:
        """The request's max_tokens; without one, the model's default (at most what the context
        leaves, as vLLM), else what the context leaves (chat) or COMPLETION_MAX_TOKENS; or 400."""
        limit = self.engine.max_model_len
        param = "messages" if isinstance(request, protocol.ChatCompletionRequest) else "prompt"
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
        elif isinstance(request, protocol.ChatCompletionRequest):
            max_tokens = limit - num_prompt
        else:
            max_tokens = protocol.COMPLETION_MAX_TOKENS
        if num_prompt + max_tokens > limit:
            raise ApiError(400, f"This model's maximum context length is {limit} tokens. "
                           f"However, you requested {num_prompt + max_tokens} tokens "
                           f"({num_prompt} in the prompt, {max_tokens} for the completion). "
                           "Please reduce the prompt or max_tokens.",
                           param="max_tokens", code="context_length_exceeded")
        return max_tokens

    async def _admit(self, request_id: str, job: Job, kv_params: KVTransferParams | None,
                     span: Span, share_prompt_with: str | None = None) -> RequestStream:
        trace = span.request_trace()
        try:
            try:
                stream = await self.engine.add_request(request_id, job.prompt_ids, job.params, kv_params,
                                                       job.continued, trace, share_prompt_with)
            except DuplicateRequestIdError:
                # A client (or a proxy passing client ids through) reused an X-Request-Id while
                # the engine still holds state for it, e.g. blocks leased to a remote reader.
                # Like vLLM, serve it under a unique internal id; the answer keeps the header.
                unique = f"{request_id}-{uuid.uuid4().hex[:12]}"
                logger.info("request id %s is in use; serving this request as %s", request_id, unique)
                stream = await self.engine.add_request(unique, job.prompt_ids, job.params, kv_params,
                                                       job.continued, trace, share_prompt_with)
        except EngineRequestError as exc:
            raise ApiError(400, str(exc), param=exc.param) from None
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

    async def _collect(self, job: Job, stream: RequestStream, timer: RequestTimer,
                       ) -> tuple[wire.CompletionResponse | wire.ChatCompletionResponse, KVTransferParams | None]:
        """The whole answer, and the params of the lease it names (P with kv_transfer_params)."""
        text: list[str] = []
        logprobs: list[TokenLogprob | int] = []
        prompt_lps: wire.PromptLogprobs | None = None
        last: RequestOutput | None = None
        tokenizer = self.engine.tokenizer
        async for last in stream:
            timer.on_output(last)
            if last.finished:
                raise_if_failed(last)
            job.cumulative_logprob += sum(e.logprob for e in last.logprobs or ())
            part, entries, first_prompt_lps = job.answer_parts(last, tokenizer, echoed=bool(text))
            text.append(part)
            logprobs.extend(entries or ())
            prompt_lps = prompt_lps or first_prompt_lps
        assert last is not None and last.finished  # a stream always ends with its finished output
        usage = wire.UsageInfo.of(last.num_prompt_tokens, job.completion_tokens(last), last.num_reused_tokens)
        reason = job.finish_reason(last)
        token_text = tokenizer.token_text
        if job.chat:
            chat_lp = (protocol.chat_logprobs(cast(list[TokenLogprob], logprobs), token_text)
                       if job.logprobs_asked else None)
            chat_choice = wire.ChatChoice(index=job.index, message=wire.ChatMessageOut(content="".join(text)),
                                          logprobs=chat_lp, finish_reason=reason)
            return wire.ChatCompletionResponse(id=job.response_id, created=job.created,
                                               model=self.engine.model_name, choices=[chat_choice],
                                               usage=usage, kv_transfer_params=wire_or_none(last.kv_transfer_params),
                                               prompt_logprobs=prompt_lps), leased_params(last)
        lp = protocol.completion_logprobs(logprobs, token_text, 0) if job.logprobs_asked else None
        choice = wire.CompletionChoice(index=job.index, text="".join(text), logprobs=lp, finish_reason=reason,
                                       prompt_logprobs=prompt_lps)
        return wire.CompletionResponse(id=job.response_id, created=job.created,
                                       model=self.engine.model_name, choices=[choice], usage=usage,
                                       kv_transfer_params=wire_or_none(last.kv_transfer_params)), leased_params(last)

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

    def _tokenize(self, body: dict[str, Any]) -> protocol.TokenizeResponse:
        model_cls: type[protocol.TokenizeChatRequest | protocol.TokenizeCompletionRequest] = (
            protocol.TokenizeChatRequest if "messages" in body else protocol.TokenizeCompletionRequest)
        try:
            request = model_cls.model_validate(body)
        except ValidationError as exc:
            raise validation_error(exc) from None
        self._check_model(request.model)
        tokenizer = self.engine.tokenizer
        if isinstance(request, protocol.TokenizeChatRequest):
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
        return protocol.TokenizeResponse(count=len(ids), max_model_len=self.engine.max_model_len, tokens=ids, token_strs=strs)

    async def detokenize(self, raw: Request) -> Response:
        """vLLM's POST /detokenize: token ids as text (special tokens kept)."""
        try:
            body = await read_json(raw)
            try:
                request = protocol.DetokenizeRequest.model_validate(body)
            except ValidationError as exc:
                raise validation_error(exc) from None
            self._check_model(request.model)
            check_token_ids(request.tokens, self.engine.tokenizer.vocab_size, "tokens")
            text = await asyncio.to_thread(self.engine.tokenizer.decode, request.tokens, False)
        except Exception as exc:
            return as_api_error(exc, _request_id(raw)).response()
        return json_response(protocol.DetokenizeResponse(prompt=text))

    def tokenizer_info(self) -> Response:
        """vLLM's GET /tokenizer_info: the special tokens' texts, the chat template and the context
        length, what a client needs to tokenise through /tokenize (lm-eval's `remote` backend)."""
        tokenizer = self.engine.tokenizer
        texts = {name: None if tid is None else tokenizer.token_text(tid)
                 for name, tid in (("bos_token", tokenizer.bos_token_id), ("eos_token", tokenizer.eos_token_id))}
        return json_response(protocol.TokenizerInfoResponse(
            tokenizer_class="kvbridge.Tokenizer", chat_template=tokenizer.chat_template,
            model_max_length=self.engine.max_model_len, **texts))

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.engine.model_name:
            raise ApiError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")


    async def _stream(self, job: Job, stream: RequestStream, timer: RequestTimer,
                      watcher: asyncio.Task[None], span: Span, lease: LeaseBox,
                      release_key: str | None = None) -> AsyncGenerator[str, None]:
        """`lease`: where the finishing chunk's leased params go (P: StreamHandOff ends that lease if
        the stream does not reach its caller whole)."""
        chunks = ChunkMaker(job, self.engine)
        try:
            if job.chat and not job.continued:
                yield chunks.delta(wire.DeltaMessage(role="assistant", content=""))
            async for output in stream:
                timer.on_output(output)
                if output.finished:
                    raise_if_failed(output)
                if (chunk := chunks.content(output)) is not None:
                    yield chunk
                if output.finished:
                    span.answered(output.num_output_tokens,
                                  output.finish_reason.value if output.finish_reason else None)
                    if (leased := leased_params(output)) is not None:
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


def _sample_params(params: SamplingParams, sample: int) -> SamplingParams:
    """The params of a prompt's `sample`-th sequence: a seeded request's seed + sample (vLLM's), wrapped
    into the 64-bit range."""
    if sample == 0 or params.seed is None:
        return params
    seed = params.seed + sample
    return dataclasses.replace(params, seed=seed - 2 ** 64 if seed > SEED_MAX else seed)


def _request_id(raw: Request) -> str:
    """The caller's X-Request-Id when it is sane (the P/D proxy sends one id to P and D),
    else a fresh one."""
    given = raw.headers.get(wire.REQUEST_ID_HEADER)
    if given is not None and wire.usable_request_id(given):
        return given
    return uuid.uuid4().hex
