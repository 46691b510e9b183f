"""Stand-ins for prefill (P) and decode (D) instances that speak the real HTTP protocol,
for the proxy and cluster tests.

A FakeInstance records what it receives and answers like a kvbridge/vLLM instance:
P returns `kv_transfer_params`, D streams SSE. Tests steer it through plain attributes
(`healthy`, `error`, `hold`, `stall_after`). `serve(app)` runs any ASGI app on
127.0.0.1 with an OS-chosen port inside the test's event loop.

Run as a script, this file is a stand-in `kvbridge` CLI for LocalCluster tests:
`serve MODEL --port P --kv-role R ...` serves a FakeInstance (model "crash-on-<role>"
makes that role exit at once with a message on stderr); `proxy ...` runs the real proxy.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse


@dataclass(frozen=True)
class Received:
    path: str
    body: dict
    headers: dict[str, str]  # lower-case names


class FakeInstance:
    """One P (role "prefill") or D (role "decode") instance."""

    def __init__(self, name: str, role: str) -> None:
        self.name, self.role = name, role
        self.received: list[Received] = []
        self.releases: list[Received] = []
        self.healthy = True
        self.error: tuple[int, bytes] | None = None  # answer every completion with this status and body
        self.hold = asyncio.Event()  # completions wait until it is set
        self.hold.set()
        self.stall_after: int | None = None  # a stream sends this many chunks, then waits forever
        self.stream_closed_early = asyncio.Event()
        self.disconnected_while_held = asyncio.Event()  # the caller hung up during `hold`
        self.max_model_len: int | None = None  # named on /v1/models when set
        self.models_asked = 0
        # The fleet contract a router reads (absent, 404, unless set): GET /kvbridge/kv_events and
        # /kvbridge/load answer these bodies, POST /tokenize these token ids.
        self.kv_events: dict | None = None
        self.load: dict | None = None
        self.tokens: list[int] | None = None
        self.app = self._build_app()

    def kv_transfer_params(self, request_id: str) -> dict:
        return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.name,
                "remote_request_id": f"{self.name}:{request_id}", "remote_block_ids": [[3, 4, 5]],
                "remote_host": "127.0.0.1", "remote_port": 5601, "tp_size": 1}

    def completion(self, path: str, request_id: str) -> dict:
        text = f"answer from {self.name}"
        if path.endswith("chat/completions"):
            body = {"id": f"chatcmpl-{request_id}", "object": "chat.completion", "created": 0, "model": "fake",
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                 "finish_reason": "stop", "logprobs": None}]}
        else:
            body = {"id": f"cmpl-{request_id}", "object": "text_completion", "created": 0, "model": "fake",
                    "choices": [{"index": 0, "text": text, "finish_reason": "stop", "logprobs": None}]}
        body["usage"] = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
        if self.role == "prefill":
            body["kv_transfer_params"] = self.kv_transfer_params(request_id)
        return body

    def stream_chunks(self, path: str, request_id: str) -> list[bytes]:
        """The exact SSE bytes a streamed answer consists of, chunk by chunk."""
        chat = path.endswith("chat/completions")
        chunks = []
        for i, piece in enumerate(["answer", " from", f" {self.name}"]):
            choice = ({"index": 0, "delta": {"content": piece}, "finish_reason": None} if chat
                      else {"index": 0, "text": piece, "finish_reason": None})
            event = {"id": f"cmpl-{request_id}", "object": "chat.completion.chunk" if chat else "text_completion",
                     "created": 0, "model": "fake", "choices": [choice]}
            chunks.append(f"data: {json.dumps(event)}\n\n".encode())
        return chunks + [b"data: [DONE]\n\n"]

    async def _stream(self, chunks: list[bytes]) -> AsyncIterator[bytes]:
        completed = False
        try:
            for i, chunk in enumerate(chunks):
                if self.stall_after is not None and i >= self.stall_after:
                    await asyncio.Event().wait()
                yield chunk
                await asyncio.sleep(0.01)  # separate network writes, like real token pacing
            completed = True
        finally:
            if not completed:
                self.stream_closed_early.set()

    def _build_app(self) -> FastAPI:
        app = FastAPI()

        async def complete(request: Request) -> Response:
            body = await request.json()
            self.received.append(Received(request.url.path, body, dict(request.headers)))
            while not self.hold.is_set():
                if await request.is_disconnected():
                    self.disconnected_while_held.set()
                    return Response(status_code=499)
                await asyncio.sleep(0.01)
            if self.error is not None:
                return Response(self.error[1], status_code=self.error[0], media_type="application/json")
            request_id = request.headers.get("x-request-id", "none")
            if body.get("stream"):
                return StreamingResponse(self._stream(self.stream_chunks(request.url.path, request_id)),
                                         media_type="text/event-stream")
            return JSONResponse(self.completion(request.url.path, request_id))

        app.add_api_route("/v1/completions", complete, methods=["POST"])
        app.add_api_route("/v1/chat/completions", complete, methods=["POST"])

        @app.get("/health")
        async def health() -> Response:
            return Response(status_code=200 if self.healthy else 503)

        @app.get("/v1/models")
        async def models() -> dict:
            self.models_asked += 1
            card = {"id": f"model-of-{self.name}", "object": "model", "created": 0, "owned_by": "kvbridge"}
            if self.max_model_len is not None:
                card["max_model_len"] = self.max_model_len
            return {"object": "list", "data": [card]}

        @app.post("/kvbridge/release_kv")
        async def release(request: Request) -> dict:
            self.releases.append(Received(request.url.path, await request.json(), dict(request.headers)))
            return {"released": True}

        @app.get("/kvbridge/kv_events")
        async def kv_events() -> Response:
            return JSONResponse(self.kv_events) if self.kv_events is not None else Response(status_code=404)

        @app.get("/kvbridge/load")
        async def load() -> Response:
            return JSONResponse(self.load) if self.load is not None else Response(status_code=404)

        @app.post("/tokenize")
        async def tokenize() -> Response:
            if self.tokens is None:
                return Response(status_code=404)
            return JSONResponse({"count": len(self.tokens), "max_model_len": 512, "tokens": self.tokens})

        @app.get("/debug/env")
        async def env() -> dict:
            keys = ("UCX_NET_DEVICES", "OMP_WAIT_POLICY", "OMP_NUM_THREADS")
            return {k: os.environ.get(k) for k in keys}

        return app


class RunningServer:
    """A uvicorn server running in the current event loop, on 127.0.0.1 and a port the OS chose."""

    def __init__(self, app) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1))
        self._task = asyncio.create_task(self._server.serve(sockets=[self._sock]))

    async def wait_started(self, timeout_s: float = 60.0) -> None:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not self._server.started:  # uvicorn sets `started` with no event to wait on
            if self._task.done():
                self._task.result()  # raises the start-up error
                raise RuntimeError("server exited during start-up")
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"the server for {self.url} did not start in {timeout_s} s")
            await asyncio.sleep(0.005)

    async def stop(self) -> None:
        """Stop serving; afterwards the port refuses connections. Safe to call twice."""
        self._server.should_exit = True
        await self._task
        self._sock.close()


async def serve(app) -> RunningServer:
    """Start `app` and return once it accepts connections; the caller must stop() it."""
    server = RunningServer(app)
    try:
        await server.wait_started()
    except BaseException:
        await server.stop()
        raise
    return server


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fake-kvbridge")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve")
    serve.add_argument("model")
    for option in ("--host", "--port", "--kv-role", "--kv-backend", "--kv-engine-id",
                   "--kv-side-channel-port", "--num-threads"):
        serve.add_argument(option, required=True)
    proxy = commands.add_parser("proxy")
    proxy.add_argument("--prefill", nargs="+", required=True)
    proxy.add_argument("--decode", nargs="+", required=True)
    proxy.add_argument("--host", required=True)
    proxy.add_argument("--port", type=int, required=True)
    proxy.add_argument("--max-body-bytes", type=int, default=32 << 20)
    args, _extra = parser.parse_known_args(argv)
    if args.command == "proxy":
        from kvbridge.proxy.app import run_proxy

        return run_proxy(args.prefill, args.decode, host=args.host, port=args.port,
                         health_interval_s=0.2, log_level="warning", max_body_bytes=args.max_body_bytes)
    if args.model == f"crash-on-{args.kv_role}":
        print(f"fake serve {args.kv_engine_id}: cannot load model {args.model}", file=sys.stderr, flush=True)
        return 3
    role = "prefill" if args.kv_role == "producer" else "decode"
    uvicorn.run(FakeInstance(args.kv_engine_id, role).app, host=args.host, port=int(args.port),
                log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
