"""What one connection may make `kvbridge up`'s processes hold (issue 44): the proxy, P and D all
refuse an oversized header (431) and close a connection whose header never ends, with OpenAI's
error body, and serve on. The bounds are kvbridge/http_protocol.py's; this checks that every
program of a real cluster (SmolLM2, NIXL, loopback) runs on it."""

from __future__ import annotations

import json
import socket

import httpx
import pytest

from kvbridge.http_protocol import MAX_HEADER_BYTES

pytestmark = pytest.mark.timeout(300)


def urls(c) -> dict[str, str]:
    return {"proxy": c.urls.proxy, "prefill": c.urls.prefill[0], "decode": c.urls.decode[0]}


def send(url: str, data: bytes) -> tuple[int, dict]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        try:
            sock.sendall(data)
        except OSError:  # the server refused and closed before all of it was written
            pass
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, body = answer.split(b"\r\n\r\n", 1)
    return int(head.split()[1]), json.loads(body)


@pytest.mark.parametrize("program", ["proxy", "prefill", "decode"])
def test_an_oversized_header_is_a_431_on_every_program(smollm2_pd_cluster, program):
    url = urls(smollm2_pd_cluster)[program]
    big = b"a" * (MAX_HEADER_BYTES * 4)
    status, body = send(url, b"POST /v1/completions HTTP/1.1\r\nhost: t\r\nx-big: " + big + b"\r\n\r\n")
    assert status == 431 and body["error"]["code"] == "request_header_too_large", body
    r = httpx.get(url + "/health", timeout=10, trust_env=False)
    assert r.status_code == 200


@pytest.mark.parametrize("program", ["proxy", "prefill", "decode"])
def test_too_many_header_fields_is_a_431_on_every_program(smollm2_pd_cluster, program):
    url = urls(smollm2_pd_cluster)[program]
    fields = b"".join(b"x-f%d: 1\r\n" % i for i in range(1000))
    status, body = send(url, b"GET /health HTTP/1.1\r\nhost: t\r\n" + fields + b"\r\n")
    assert status == 431 and body["error"]["code"] == "too_many_header_fields", body


def test_a_half_closed_request_through_the_proxy_is_answered(smollm2_pd_cluster):
    """Issue 44: the client sends its request, shuts down its sending side, and reads: it gets the
    P/D answer (an interim 100 Continue first), as from vLLM."""
    url = smollm2_pd_cluster.urls.proxy
    host, port = url.removeprefix("http://").rsplit(":", 1)
    body = json.dumps({"prompt": "Name the capital of France.", "max_tokens": 8, "temperature": 0}).encode()
    with socket.create_connection((host, int(port)), timeout=120) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n" % len(body) + body)
        sock.shutdown(socket.SHUT_WR)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    final = answer[answer.rindex(b"HTTP/1.1 "):]  # past the interim answers
    head, payload = final.split(b"\r\n\r\n", 1)
    assert head.split()[1] == b"200", answer
    assert json.loads(payload)["usage"]["completion_tokens"] >= 1
