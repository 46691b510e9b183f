"""The bounded HTTP/1.1 connection of every kvbridge server (kvbridge/http_protocol.py, issue 44):
header bytes, header fields and header time, on a real uvicorn server on loopback driven by raw
sockets. A header of 200 MB used to stall the proxy's event loop for 95 s; 2000 connections
trickling partial headers stayed open for good."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from kvbridge.http_protocol import HEADER_TIMEOUT_S, MAX_HEADER_BYTES, MAX_HEADER_FIELDS, BoundedHttpProtocol
from kvbridge.openai_wire import bind_socket

pytestmark = pytest.mark.timeout(120)
FAST_TIMEOUT_S = 0.5  # the test server's header time bound (the product's is HEADER_TIMEOUT_S)


class FastTimeout(BoundedHttpProtocol):
    header_timeout_s = FAST_TIMEOUT_S


def echo_app() -> FastAPI:
    app = FastAPI()
    app.state.disconnects = []  # what /slow saw: True when its client was gone before its answer

    @app.post("/slow")
    async def slow(request: Request) -> JSONResponse:
        """Answers after `wait` seconds unless the client leaves first (what an instance does)."""
        wait = float((await request.json())["wait"])
        try:
            message = await asyncio.wait_for(request.receive(), wait)
            app.state.disconnects.append(message["type"] == "http.disconnect")
        except TimeoutError:
            app.state.disconnects.append(False)
        return JSONResponse({"waited": wait})

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.post("/echo")
    async def echo(request: Request) -> JSONResponse:
        body = await request.body()
        return JSONResponse({"bytes": len(body), "fields": len(request.headers)})
    return app


@pytest.fixture(scope="module")
def server():
    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    app = echo_app()
    srv = uvicorn.Server(uvicorn.Config(app, http=FastTimeout, log_level="error"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the test server did not start"
        thread.join(0.01)
    yield Addr("127.0.0.1", port, app)
    srv.should_exit = True
    thread.join(10)


class Addr(tuple):
    """(host, port) of the test server, with its app."""

    def __new__(cls, host: str, port: int, app: FastAPI) -> Addr:
        made = super().__new__(cls, (host, port))
        made.app = app
        return made


def connect(addr) -> socket.socket:
    return socket.create_connection(tuple(addr), timeout=30)


def read_answer(sock: socket.socket) -> tuple[int, dict, bytes]:
    """One whole answer (status, headers, body), read until the body's length or the close."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed before an answer: {data!r}"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    lines = head.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    length = int(headers.get("content-length", 0))
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk
        body += chunk
    return int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}, body


def request(path: str = "/echo", fields: list[tuple[str, str]] = (), body: bytes = b"") -> bytes:
    head = f"POST {path} HTTP/1.1\r\nhost: t\r\ncontent-length: {len(body)}\r\n"
    return (head + "".join(f"{k}: {v}\r\n" for k, v in fields) + "\r\n").encode() + body


def assert_refused(answer: tuple[int, dict, bytes], status: int, code: str) -> None:
    got, headers, body = answer
    assert got == status and headers["connection"] == "close", answer
    error = json.loads(body)["error"]
    assert error["code"] == code and error["type"] == "invalid_request_error" and error["message"]


def assert_serves(addr) -> None:
    with connect(addr) as sock:
        sock.sendall(request(body=b"{}"))
        status, _, body = read_answer(sock)
    assert status == 200 and json.loads(body)["bytes"] == 2


def padding_for(total: int) -> str:
    """A header value that makes `request()`'s head exactly `total` bytes with one field `x-pad`."""
    base = len(request(fields=[("x-pad", "")]))
    return "a" * (total - base)


def test_a_header_of_exactly_the_bound_is_served_and_one_byte_more_is_a_431(server):
    for total, ok in ((MAX_HEADER_BYTES, True), (MAX_HEADER_BYTES + 1, False)):
        with connect(server) as sock:
            sock.sendall(request(fields=[("x-pad", padding_for(total))]))
            answer = read_answer(sock)
        if ok:
            assert answer[0] == 200, answer
        else:
            assert_refused(answer, 431, "request_header_too_large")
    assert_serves(server)


def test_the_blank_line_split_across_reads_is_still_the_end_of_the_header(server):
    data = request(fields=[("x-pad", padding_for(MAX_HEADER_BYTES))])
    with connect(server) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for part in (data[:-3], data[-3:-1], data[-1:]):
            sock.sendall(part)
            time.sleep(0.05)  # separate reads on the server: a pacing, not a synchronisation
        assert read_answer(sock)[0] == 200


def test_a_body_in_the_same_write_as_the_header_does_not_count(server):
    body = b"x" * (4 * MAX_HEADER_BYTES)
    with connect(server) as sock:
        sock.sendall(request(body=body))
        status, _, answer = read_answer(sock)
    assert status == 200 and json.loads(answer)["bytes"] == len(body)


def test_too_many_header_fields_is_a_431(server):
    with connect(server) as sock:
        sock.sendall(request(fields=[(f"x-f{i}", "1") for i in range(MAX_HEADER_FIELDS)]))
        assert_refused(read_answer(sock), 431, "too_many_header_fields")
    with connect(server) as sock:  # the request's own two fields + the rest: exactly the bound
        sock.sendall(request(fields=[(f"x-f{i}", "1") for i in range(MAX_HEADER_FIELDS - 2)]))
        assert read_answer(sock)[0] == 200
    assert_serves(server)


def test_a_200_mb_header_sent_in_1_mib_writes_is_refused_after_the_bound(server):
    """The issue's probe: the 431 comes while the header is still being written (a sender thread
    writes it; the refusal is read meanwhile), the connection then closes, the server serves on."""
    chunk = b"a" * (1 << 20)
    sent = [0]
    with connect(server) as sock:
        sock.sendall(b"POST /echo HTTP/1.1\r\nhost: t\r\nx-big: ")

        def write() -> None:
            try:
                while sent[0] < 200 << 20:
                    sock.sendall(chunk)
                    sent[0] += len(chunk)
            except OSError:  # the server closed the connection
                pass
        writer = threading.Thread(target=write, daemon=True)
        writer.start()
        answer = read_answer(sock)
        at_answer = sent[0]
        sock.shutdown(socket.SHUT_RDWR)
        writer.join(30)
    assert_refused(answer, 431, "request_header_too_large")
    assert at_answer < 100 << 20, f"the refusal came only after {at_answer} bytes"
    assert_serves(server)


def test_a_header_that_never_ends_is_a_408_after_the_bound(server):
    with connect(server) as sock:
        started = time.monotonic()
        sock.sendall(b"POST /echo HTTP/1.1\r\nhost: t\r\nx-slow: a")
        answer = read_answer(sock)  # the server's 408, sent when its timer fires (the test waits on it)
        assert time.monotonic() - started >= FAST_TIMEOUT_S * 0.9
    assert_refused(answer, 408, "request_timeout")


def test_a_connection_that_sends_nothing_is_closed_after_the_bound(server):
    with connect(server) as sock:
        assert_refused(read_answer(sock), 408, "request_timeout")


def test_many_trickling_connections_are_all_closed_and_others_are_served_meanwhile(server):
    """The issue's slowloris (2000 connections there; 200 here): each trickles a byte of header
    now and then; every one is closed at the bound, and a normal request is served meanwhile."""
    socks = [connect(server) for _ in range(200)]
    try:
        for sock in socks:
            sock.sendall(b"POST /echo HTTP/1.1\r\nhost: t\r\n")
        for sock in socks[::10]:
            sock.sendall(b"x")  # still inside the header: the bound counts from the request's start
        assert_serves(server)
        for sock in socks:
            assert_refused(read_answer(sock), 408, "request_timeout")
    finally:
        for sock in socks:
            sock.close()


def test_a_kept_alive_connection_times_each_request_from_its_first_byte(server):
    """An idle spell between two requests (shorter than uvicorn's keep-alive) is not header time."""
    with connect(server) as sock:
        sock.sendall(request(body=b"{}"))
        assert read_answer(sock)[0] == 200
        time.sleep(FAST_TIMEOUT_S * 2)  # idle, kept alive: a pacing, not a synchronisation
        sock.sendall(request(body=b"{}"))
        assert read_answer(sock)[0] == 200


def test_the_product_bounds() -> None:
    """What the README promises."""
    assert (MAX_HEADER_BYTES, MAX_HEADER_FIELDS, HEADER_TIMEOUT_S) == (64 << 10, 128, 10.0)


def read_final_answer(sock: socket.socket) -> tuple[int, dict, bytes]:
    """The final answer, past any 1xx interim ones (as every HTTP/1.1 client reads)."""
    while True:
        answer = read_answer(sock)
        if answer[0] >= 200:
            return answer


def test_a_half_closed_request_is_answered(server):
    """Issue 44: the client sends its request, then shuts down its sending side and reads."""
    with connect(server) as sock:
        sock.sendall(request("/slow", body=b'{"wait": 0.3}'))
        sock.shutdown(socket.SHUT_WR)
        status, headers, body = read_final_answer(sock)
        assert sock.recv(1) == b""  # closed after the answer: no other request can come
    assert status == 200 and json.loads(body) == {"waited": 0.3}
    assert server.app.state.disconnects[-1] is False  # served to the end, not taken for gone


def test_a_client_gone_for_good_is_still_a_disconnect_at_once(server):
    """A full close (not a half-close) before the answer: the app hears the disconnect well before
    its answer was due (the interim answer's reset tells, within milliseconds)."""
    before = len(server.app.state.disconnects)
    with connect(server) as sock:
        sock.sendall(request("/slow", body=b'{"wait": 20}'))
    deadline = time.monotonic() + 10
    while len(server.app.state.disconnects) == before and time.monotonic() < deadline:
        time.sleep(0.01)  # polled: the app records it on its own loop
    assert server.app.state.disconnects[before:] == [True]
