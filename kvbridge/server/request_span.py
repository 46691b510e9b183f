"""A request's span as the completions handler sees it: `RequestSpan`, the live `instance.request`
span of a traced request (with `instance.prepare` and `instance.stream` under it), or `NO_SPAN`,
whose methods do nothing, for every request while tracing is off. The handler tells the span what
happened and never asks whether tracing is on."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import Protocol

from fastapi import Request
from opentelemetry.trace import SpanKind, Status, StatusCode

from kvbridge.kv_transfer.params import KVTransferParams
from kvbridge.server.answer import Job
from kvbridge.server.errors import ApiError
from kvbridge.tracing import TRACEPARENT_HEADER, RequestTrace, Tracing, parse_traceparent, without_none


class Span(Protocol):
    """What the handler tells one request's span (`RequestSpan`, or `NO_SPAN` when tracing is off)."""

    def prepared(self, kv_params: KVTransferParams | None, job: Job) -> None:
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


class NoSpan(Span):
    """The span of every request while tracing is off: does nothing."""

    def prepared(self, kv_params: KVTransferParams | None, job: Job) -> None:
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


NO_SPAN: Span = NoSpan()


def no_span(raw: Request, chat: bool) -> Span:
    return NO_SPAN


class RequestSpan(Span):
    """The live `instance.request` span of one traced request (`Span`)."""

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

    def prepared(self, kv_params: KVTransferParams | None, job: Job) -> None:
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
