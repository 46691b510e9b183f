"""The OpenAI error body every bad request must get: {"error": {message, type, param, code}} with
the right status (invalid_request_error below 500, server_error from 500)."""

from __future__ import annotations

from typing import Any

import httpx


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None,
                        code: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    assert error["type"] == ("server_error" if status >= 500 else "invalid_request_error")
    if param is not None:
        assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    return error
