"""The server's error answers and what produces them: ApiError (OpenAI's body {"error": {...}}
with the right status), reading a request's JSON body, pydantic's validation errors as one 400, the
checks pydantic cannot make (token ids against the vocabulary, kv_transfer_params)."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from kvbridge import openai_wire as wire
from kvbridge.kv_transfer.params import KVTransferParams, KVTransferParamsError, parse_kv_transfer_params

logger = logging.getLogger("kvbridge.server.api_server")  # the name the server logged under before the split


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

def check_token_ids(ids: list[int], vocab: int, param: str) -> None:
    """400 naming `param` when an id is outside the vocabulary (vLLM's check and status)."""
    bad = sorted({t for t in ids if not 0 <= t < vocab})
    if bad:
        shown = ", ".join(map(str, bad[:8])) + (", ..." if len(bad) > 8 else "")
        raise ApiError(400, f"token_id(s) [{shown}] in {param} contain out-of-vocab token ids. "
                       f"Vocabulary size: {vocab}", param=param)


def parse_kv_params(body: dict[str, Any]) -> KVTransferParams | None:
    try:
        return parse_kv_transfer_params(body.get("kv_transfer_params"))
    except KVTransferParamsError as exc:
        raise ApiError(400, str(exc), param="kv_transfer_params") from None


def validation_error(exc: ValidationError) -> ApiError:
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
