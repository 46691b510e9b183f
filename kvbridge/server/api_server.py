"""The OpenAI-compatible HTTP server of one kvbridge instance: the app, its routes, its lifecycle.

Endpoints: POST /v1/completions and /v1/chat/completions (streaming or not, served by
completions.py), POST /tokenize and /detokenize and GET /tokenizer_info (vLLM's), GET /v1/models, /health (200 healthy, 503 draining, shutting down or dead),
/metrics, /kvbridge/load (the engine's load and measured rates, for a router or an autoscaler) and
/kvbridge/kv_events (where its KV events are published), POST
/kvbridge/release_kv (P: free a request's held blocks), /kvbridge/kv_hold (hold a cached prefix for a
reader: KV reuse across turns and instances) and /kvbridge/drain. `build_app` makes
the FastAPI app of an engine; `run_server` loads the model, serves it with uvicorn until
SIGINT/SIGTERM (or until the engine fails, or a drain ends) and shuts down.

Drain (an instance leaving a pool): POST /kvbridge/drain or SIGTERM. New generation
requests get 503 code "draining" and /health 503 {"status": "draining"}, so routers send work
elsewhere; admitted requests run on for up to the drain timeout (--drain-timeout-s), then end
with an error (a stream's error event with code "drain_timeout", else a 503 body); a P keeps
serving its leases (D's reads, read-done, release_kv) until each ended. Once the engine is
drained the server shuts down and `run_server` returns 0. A second SIGTERM or a SIGINT while
draining shuts down at once (in-flight requests fail), as SIGINT always does.

Every error is OpenAI's body {"error": {...}}: 400 for anything wrong with the request
(never FastAPI's 422, never a 500), 401 for a bad API key, 404 for an unknown model,
503 when overloaded or shutting down, 500 when the engine fails a request (e.g. a KV
transfer failed under policy "fail"). A stream that fails midway ends with an error
event and [DONE].
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import signal
import socket
import time
from dataclasses import dataclass
from types import FrameType

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvbridge import openai_wire as wire
from kvbridge.openai_wire import bind_socket
from kvbridge.config import EngineConfig
from kvbridge.engine.engine import EngineRequestError
from kvbridge.engine.setup.generation_config import NO_DEFAULTS, SamplingDefaults, sampling_defaults, startup_lines
from kvbridge.http_protocol import AnnouncingServer, server_config
from kvbridge.kv_transfer.net import apply_ucx_net_devices
from kvbridge.kv_transfer.params import parse_kv_transfer_params, wire_or_none
from kvbridge.server.async_engine import AsyncEngine, EngineState
from kvbridge.server.completions import CompletionHandlers
from kvbridge.server.errors import ApiError, as_api_error, json_response, read_json
from kvbridge.server.metrics import CONTENT_TYPE, LoadCollector, ServerMetrics
from kvbridge.server.undelivered import usable_release_key
from kvbridge.tracing import Tracing, TracingConfig, program_tracing

logger = logging.getLogger(__name__)

_METRICS_TIMEOUT_S = 10.0  # a scrape waits at most this long for the current step
DEFAULT_DRAIN_TIMEOUT_S = 30.0


# The routes are module-level functions that find their instance's state in
# `request.app.state` (`_Instance`), never closures over it: FastAPI keeps the endpoint and
# dependency callables it has seen in a process-wide LRU cache, so a closure over an
# engine would keep every engine of every app built in the process alive.


@dataclass(frozen=True)
class _Instance:
    engine: AsyncEngine
    handlers: CompletionHandlers
    metrics: ServerMetrics
    api_key: str | None
    drain_timeout_s: float


def _instance(raw: Request) -> _Instance:
    instance: _Instance = raw.app.state.instance  # build_app put it there
    return instance


async def _check_api_key(raw: Request) -> None:
    api_key = _instance(raw).api_key
    if api_key is None:
        return
    given = raw.headers.get("Authorization", "")
    if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
        raise ApiError(401, "Incorrect or missing API key. Send 'Authorization: Bearer <key>'.",
                       code="invalid_api_key")


_v1 = APIRouter(prefix="/v1", dependencies=[Depends(_check_api_key)])


@_v1.post("/completions")
async def _completions(raw: Request) -> Response:
    return await _instance(raw).handlers.serve(raw, chat=False)


@_v1.post("/chat/completions")
async def _chat_completions(raw: Request) -> Response:
    return await _instance(raw).handlers.serve(raw, chat=True)


def _model_card(instance: _Instance) -> wire.ModelCard:
    engine = instance.engine
    return wire.ModelCard(id=engine.model_name, created=instance.handlers.created,
                       max_model_len=engine.max_model_len)


async def _tokenize(raw: Request) -> Response:
    return await _instance(raw).handlers.tokenize(raw)


async def _detokenize(raw: Request) -> Response:
    return await _instance(raw).handlers.detokenize(raw)


async def _tokenizer_info(raw: Request) -> Response:
    return _instance(raw).handlers.tokenizer_info()


@_v1.get("/models")
async def _models(raw: Request) -> Response:
    return json_response(wire.ModelList(data=[_model_card(_instance(raw))]))


@_v1.get("/models/{model_id:path}")
async def _model(raw: Request, model_id: str) -> Response:
    instance = _instance(raw)
    if model_id != instance.engine.model_name:
        raise ApiError(404, f"The model `{model_id}` does not exist.", param="model",
                       code="model_not_found")
    return json_response(_model_card(instance))


async def _release_kv(raw: Request) -> Response:
    """P: free the blocks held for a request no decode instance will read. The proxy names them
    by P's answer's `kv_transfer_params` (it could reach no D) or, when it never read that answer,
    by the `release_key` it sent with the attempt (undelivered.py). Idempotent: unknown ids and
    keys answer released=false."""
    body = await read_json(raw)
    instance = _instance(raw)
    if "release_key" in body:
        key = body["release_key"]
        if not isinstance(key, str) or not usable_release_key(key):
            raise ApiError(400, "release_key must be 16 to 64 lowercase hex digits", param="release_key")
        leased = instance.handlers.release_keys.take(key)
        if leased is None:
            return Response(json.dumps({"released": False}), media_type="application/json")
        released = await instance.engine.call(lambda e: e.release_kv(leased))
        if released:
            instance.metrics.record_undelivered_release()
        return Response(json.dumps({"released": bool(released)}), media_type="application/json")
    try:
        params = parse_kv_transfer_params(body.get("kv_transfer_params"))
    except ValueError as exc:
        raise ApiError(400, f"bad release request: {exc}") from None
    if params is None:
        raise ApiError(400, "kv_transfer_params or release_key is required", param="kv_transfer_params")
    released = await instance.engine.call(lambda e: e.release_kv(params))
    return Response(json.dumps({"released": bool(released)}), media_type="application/json")


MAX_HOLD_TOKEN_IDS = 1 << 22  # far above any model's context; the engine checks its own length


async def _kv_hold(raw: Request) -> Response:
    """Hold the longest cached prefix of `prompt_token_ids` for a remote reader (the proxy, before a
    conversation's next turn: the instance serving it reads the history from here instead of
    computing it again). Answers {"held_tokens": n, "kv_transfer_params": params or null}; the
    blocks stay leased until the reader is done, the lease is released (POST /kvbridge/release_kv
    with these params) or it expires. Holds nothing while draining or with nothing cached;
    `can_hold` false: this instance never holds (it serves no reads: --kv-role consumer)."""
    body = await read_json(raw)
    ids = body.get("prompt_token_ids")
    if (not isinstance(ids, list) or not ids or len(ids) > MAX_HOLD_TOKEN_IDS
            or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids)):
        raise ApiError(400, "prompt_token_ids must be a non-empty list of token ids", param="prompt_token_ids")
    instance = _instance(raw)
    if instance.engine.is_draining:
        return Response(json.dumps({"held_tokens": 0, "kv_transfer_params": None, "can_hold": True}),
                        media_type="application/json")
    try:
        held = await instance.engine.call(lambda e: e.hold_prefix(ids))
    except EngineRequestError as exc:
        raise ApiError(400, str(exc), param="prompt_token_ids") from None
    answer = {"held_tokens": held.num_tokens, "kv_transfer_params": wire_or_none(held.kv_transfer_params),
              "can_hold": held.can_hold}
    return Response(json.dumps(answer), media_type="application/json")


async def _load(raw: Request) -> Response:
    """The engine's load as its thread last published it (never waits for a step)."""
    engine = _instance(raw).engine
    load = engine.load()
    body = {"role": load.role, "running": load.running, "waiting": load.waiting,
            "queued_prompt_tokens": load.queued_prompt_tokens, "oldest_wait_s": load.oldest_wait_s(time.monotonic()),
            "kv_blocks_total": load.kv_blocks_total, "kv_blocks_used": load.kv_blocks_used,
            "leases_held": load.leases_held, "draining": engine.is_draining,
            "waiting_prefill_tokens": load.queued_prompt_tokens,
            "kv_blocks_free": load.kv_blocks_total - load.kv_blocks_used,
            "prefill_tokens_per_s": load.prefill_tokens_per_s, "decode_step_s": load.decode_step_s,
            "kv_pull_bytes_per_s": load.kv_pull_bytes_per_s, "kv_bytes_per_token": load.kv_bytes_per_token,
            "kv_blocks_retained": load.kv_blocks_retained}
    return Response(json.dumps(body), media_type="application/json")


async def _kv_events(raw: Request) -> Response:
    """Where this instance publishes its KV events, for a router's subscriber: the bound addresses
    (an any-address host replaced by the host the server listens on) and what computes its block
    hashes (kv_events/hashing.py). {"enabled": false} when it publishes none."""
    info = _instance(raw).engine.kv_events
    if info is None:
        return Response(json.dumps({"enabled": False}), media_type="application/json")
    host = raw.app.state.listen_host
    body = {"enabled": True, "endpoint": _advertised(info.endpoint, host),
            "replay_endpoint": _advertised(info.replay_endpoint, host) if info.replay_endpoint else None,
            "topic": info.topic, "block_size": info.block_size, "hash_root": info.hash_root,
            "data_parallel_rank": info.data_parallel_rank}
    return Response(json.dumps(body), media_type="application/json")


def _advertised(endpoint: str, listen_host: str) -> str:
    """`endpoint` with a wildcard or any-address host (tcp://*:P, tcp://0.0.0.0:P, tcp://[::]:P)
    replaced by the host the HTTP server listens on (itself loopback when that is an any-address)."""
    if not endpoint.startswith("tcp://"):
        return endpoint
    host, _, port = endpoint[len("tcp://"):].rpartition(":")
    if host.strip("[]") in ("*", "0.0.0.0", "::", ""):
        shown = listen_host if listen_host not in ("0.0.0.0", "::", "") else "127.0.0.1"
        host = f"[{shown}]" if ":" in shown else shown
    return f"tcp://{host}:{port}"


async def _drain(raw: Request) -> Response:
    """Start draining (idempotent): 202 {"draining": true, "drain_timeout_s": ...}; 503 when the
    engine is stopping or dead. The server exits once drained (run_server)."""
    instance = _instance(raw)
    engine = instance.engine
    if not engine.begin_drain(instance.drain_timeout_s) and not engine.is_draining:
        return ApiError(503, f"cannot drain: the engine is {engine.state.value}", code="unavailable").response()
    return Response(json.dumps({"draining": True, "drain_timeout_s": instance.drain_timeout_s}), status_code=202,
                    media_type="application/json")


async def _health(raw: Request) -> Response:
    engine = _instance(raw).engine
    if engine.is_draining:
        return Response('{"status": "draining"}', status_code=503, media_type="application/json")
    if engine.is_healthy:
        return Response('{"status":"ok"}', media_type="application/json")
    reason = engine.dead_reason or f"engine is {engine.state.value}"
    return ApiError(503, f"unhealthy: {reason}", code="unavailable").response()


async def _prometheus(raw: Request) -> Response:
    instance = _instance(raw)
    engine = instance.engine
    try:
        snapshot = await asyncio.wait_for(engine.get_metrics(), _METRICS_TIMEOUT_S)
    except Exception:  # dead, stopping or busy: serve what we have
        snapshot = None
    instance.metrics.update_engine(snapshot, engine.is_healthy)
    return Response(instance.metrics.render(), media_type=CONTENT_TYPE)


async def _on_api_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return exc.response()


async def _on_validation_error(_: Request, exc: Exception) -> Response:
    return ApiError(400, str(exc)).response()


async def _on_http_error(_: Request, exc: Exception) -> Response:
    """Routing's 404 and 405 in OpenAI's error body (a 405 keeps its Allow header), as the proxy answers them."""
    assert isinstance(exc, StarletteHTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return ApiError(exc.status_code, str(exc.detail), code=code, headers=dict(exc.headers or {})).response()


async def _on_unexpected(raw: Request, exc: Exception) -> Response:
    return as_api_error(exc, raw.headers.get(wire.REQUEST_ID_HEADER, "-")).response()


def build_app(engine: AsyncEngine, api_key: str | None = None,
              sampling_defaults: SamplingDefaults = NO_DEFAULTS, tracing: Tracing | None = None,
              drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S, listen_host: str = "127.0.0.1") -> FastAPI:
    """The FastAPI app of one instance. The caller owns `engine` (and shuts it down) and
    `tracing` (None: requests are not traced).
    `sampling_defaults`: what a request that omits a sampling field gets (--generation-config).
    `drain_timeout_s`: how long a drain lets admitted requests run (POST /kvbridge/drain).
    `listen_host`: the host the server listens on (GET /kvbridge/kv_events advertises it).
    `app.state.registry` is the Prometheus registry /metrics serves: other components
    may register their collectors on it."""
    app = FastAPI(title="kvbridge", docs_url=None, redoc_url=None, openapi_url=None)
    metrics = ServerMetrics(engine.model_name, engine.max_model_len)
    if drain_timeout_s < 0:
        raise ValueError("drain_timeout_s must be >= 0")
    app.state.instance = _Instance(engine, CompletionHandlers(engine, metrics, sampling_defaults, tracing), metrics,
                                   api_key, drain_timeout_s)
    app.state.engine = engine
    app.state.listen_host = listen_host
    app.state.metrics = metrics
    app.state.registry = metrics.registry
    for collector in engine.engine_collectors():
        metrics.registry.register(collector)
    metrics.registry.register(LoadCollector(engine.load, lambda: engine.is_draining))
    app.include_router(_v1)
    app.add_api_route("/kvbridge/release_kv", _release_kv, methods=["POST"],
                      dependencies=[Depends(_check_api_key)], include_in_schema=False)
    app.add_api_route("/kvbridge/kv_hold", _kv_hold, methods=["POST"],
                      dependencies=[Depends(_check_api_key)], include_in_schema=False)
    app.add_api_route("/kvbridge/drain", _drain, methods=["POST"],
                      dependencies=[Depends(_check_api_key)], include_in_schema=False)
    # vLLM's paths (no /v1); guarded by the API key when there is one (vLLM leaves them open)
    app.add_api_route("/tokenize", _tokenize, methods=["POST"], dependencies=[Depends(_check_api_key)])
    app.add_api_route("/detokenize", _detokenize, methods=["POST"], dependencies=[Depends(_check_api_key)])
    app.add_api_route("/tokenizer_info", _tokenizer_info, methods=["GET"], dependencies=[Depends(_check_api_key)])
    app.add_api_route("/kvbridge/load", _load, methods=["GET"], include_in_schema=False)
    app.add_api_route("/kvbridge/kv_events", _kv_events, methods=["GET"], include_in_schema=False)
    app.add_api_route("/health", _health, methods=["GET"])
    app.add_api_route("/metrics", _prometheus, methods=["GET"])
    app.add_exception_handler(ApiError, _on_api_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(Exception, _on_unexpected)
    return app


class _Server(AnnouncingServer):
    """SIGTERM drains (AsyncEngine.begin_drain) and the server stops once the engine is drained.
    SIGINT, or a second SIGTERM while draining, shuts down at once as part of uvicorn's graceful
    shutdown: in-flight requests fail, so connections close, then the engine thread stops.
    An engine that fails (a step raised, a TP rank process died) shuts the server down too,
    so `kvbridge serve` exits non-zero and a supervisor can restart it."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, drain_timeout_s: float,
                 ready_line: str = "") -> None:
        super().__init__(config, ready_line)  # printed once serving, signals handled
        self.engine = engine
        self.drain_timeout_s = drain_timeout_s
        self.engine_failed = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:  # uvicorn's signal handler (SIGINT, SIGTERM)
        if sig == signal.SIGTERM and not self.should_exit and self.engine.begin_drain(self.drain_timeout_s):
            return  # not captured: uvicorn re-raises captured signals on its way out, and a drain exits 0
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:  # uvicorn calls it every 0.1 s; True stops serving
        state = self.engine.state
        if state is EngineState.DEAD or (state in (EngineState.RUNNING, EngineState.DRAINING)
                                         and not self.engine.is_alive):
            if not self.engine_failed:
                self.engine_failed = True
                logger.error("the engine failed (%s); shutting the server down",
                             self.engine.dead_reason or "its thread or a rank process is gone")
            return True
        if self.engine.drained:
            return True
        return await super().on_tick(counter)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.engine.begin_shutdown()
        await super().shutdown(sockets)
        await asyncio.to_thread(self.engine.shutdown)


def run_server(config: EngineConfig, host: str, port: int, api_key: str | None,
               log_level: str = "info", tracing: TracingConfig | None = None,
               drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S) -> int:
    """Load the model, serve until SIGINT, a drain (SIGTERM, POST /kvbridge/drain) ends or the
    engine fails, shut down cleanly. Blocks. Returns the exit status: 0 after a requested
    shutdown or a drain, 1 when the engine failed."""
    if drain_timeout_s < 0:
        raise ValueError("drain_timeout_s must be >= 0")
    if not logging.getLogger().handlers:
        logging.basicConfig(level=log_level.upper(),
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    defaults = sampling_defaults(config.generation_config, config.model)  # a bad file fails before the model loads
    kv = config.kv_transfer
    if kv is not None and kv.backend == "nixl":  # before any NIXL agent (or TP rank) starts: UCX reads it once
        apply_ucx_net_devices(os.environ, kv.public_host)
    # The port first: a port already in use fails at once, not after the model loaded, and the
    # ephemeral ports the engine's rank processes and transfer agents open while it starts
    # (gloo, UCX) cannot take it. Connections are refused until the engine is ready (listen).
    sock = bind_socket(host, port, listen=False)
    try:
        engine = AsyncEngine.from_config(config)
    except BaseException:
        sock.close()
        raise
    # The tracer shuts down after the engine: its last spans (leases ended at shutdown) go too.
    with program_tracing(tracing) as tracer:
        sock.listen(2048)
        for i, line in enumerate(startup_lines(defaults)):  # as vLLM: a warning, then the defaults
            logger.log(logging.WARNING if i == 0 else logging.INFO, "%s", line)
        bound_port = sock.getsockname()[1]
        shown_host = f"[{host}]" if ":" in host else host
        server = _Server(server_config(build_app(engine, api_key, defaults, tracer, drain_timeout_s, host),
                                        log_level=log_level, timeout_graceful_shutdown=10), engine, drain_timeout_s,
                         ready_line=f"kvbridge: serving {engine.model_name} at http://{shown_host}:{bound_port}/v1")
        try:
            server.run(sockets=[sock])
        except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it handled gracefully
            pass
        finally:
            engine.shutdown()  # no-op when uvicorn's shutdown already did it
            sock.close()
    return 1 if server.engine_failed else 0
