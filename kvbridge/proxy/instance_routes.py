"""The proxy's routes that any one instance answers for all (every instance serves the same model):
vLLM's /tokenize, /detokenize and /tokenizer_info, and /v1/models."""

from __future__ import annotations

import logging
from typing import Any

import httpx
from fastapi import Request
from fastapi.responses import Response

from kvbridge.openai_wire import REQUEST_ID_HEADER
from kvbridge.proxy import tracing_spans
from kvbridge.proxy.bodies import request_id_of
from kvbridge.proxy.exchange import openai_error
from kvbridge.proxy.proxy import BAD_KEY_MESSAGE, PDProxy

logger = logging.getLogger("kvbridge.proxy.proxy")  # the name these lines logged under before the split


async def tokenization(proxy: PDProxy, request: Request, path: str) -> Response:
    """vLLM's /tokenize or /detokenize, forwarded to a healthy instance (`first_answer`)."""
    request_id = request_id_of(request)
    body = await proxy._read_request(request, request_id, tracing_spans.NO_SPANS)
    if isinstance(body, Response):
        return body
    return await first_answer(proxy, request, request_id, "POST", path, body)


async def tokenizer_info(proxy: PDProxy, request: Request) -> Response:
    """vLLM's GET /tokenizer_info, forwarded to a healthy instance (`first_answer`)."""
    request_id = request_id_of(request)
    if not proxy.authorized(request):
        return openai_error(401, BAD_KEY_MESSAGE, "invalid_api_key", request_id)
    return await first_answer(proxy, request, request_id, "GET", "/tokenizer_info", None)


async def first_answer(proxy: PDProxy, request: Request, request_id: str, method: str, path: str,
                       body: dict[str, Any] | None) -> Response:
    """The answer of the first healthy instance (decode first, then prefill; the next one when one
    cannot be reached) to `method path`, status and body as they are. Every instance serves the same
    model, so any one answers for all."""
    headers = {REQUEST_ID_HEADER: request_id, **proxy._auth_headers(request)}
    for upstream in [u for pool in reversed(proxy.pools) for u in pool.healthy()]:
        try:
            r = await proxy.client().request(method, upstream.url + path, json=body, headers=headers,
                                             timeout=proxy.short_timeout)
        except httpx.HTTPError as exc:
            logger.warning("request %s: %s on %s failed: %r", request_id, path, upstream.url, exc)
            continue
        return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"),
                        headers={REQUEST_ID_HEADER: request_id})
    return openai_error(503, f"no healthy instance answered {path}", "no_healthy_instance", request_id)


async def models(proxy: PDProxy, request: Request) -> Response:
    """/v1/models as the first healthy D that answers it reports."""
    for upstream in proxy.decode.healthy():
        try:
            r = await proxy.client().get(upstream.url + "/v1/models", headers=proxy._auth_headers(request),
                                         timeout=proxy.short_timeout)
        except httpx.HTTPError:
            continue
        return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))
    return openai_error(503, "no healthy decode instance answered /v1/models", "no_healthy_instance")
