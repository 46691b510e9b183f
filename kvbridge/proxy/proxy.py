"""The P/D proxy: one OpenAI-compatible front that routes each request to a prefill
instance (P), then to a decode instance (D), and streams D's answer back.

Life of a request (docs: ARCHITECTURE.md, "The life of a P/D request"):
  1. pick a healthy P and a healthy D (routing.py: pools and selection policies;
     503 if either kind has none);
  2. POST to P the client's body with max_tokens=1, stream=false, n=1 and
     kv_transfer_params={"do_remote_decode": true}; P's errors go back unchanged;
  3. POST to D the client's original body plus P's response `kv_transfer_params`;
     D's answer (JSON or SSE, success or error) goes back unchanged, streamed as it comes.
Both upstream calls carry the same `X-Request-Id` (the client's, else a new one). Each call is a
leg (legs.py: attempts, retries, breakers). P's leg ends in one of three outcomes (`Prefilled`,
P's own 4xx answer, `Exhausted`), and `handle` runs a method per outcome. With `stream: true`,
P's sampled token goes to the client as soon as D accepted the request, and D continues from it
(first_token.py: first token straight from prefill). P's KV that no D will read is released
(releases.py: the release contract). The FastAPI app and the server runner are in app.py.

Colocated mode (no prefill URLs): each request goes straight to a decode-list instance
(a plain `kvbridge serve`), its body unchanged but for any client `kv_transfer_params`,
which are dropped as in P/D mode (only the proxy sets them). Everything else — client,
selection, health, SSE passthrough, errors — is the same code path; it is the baseline
that P/D latency is compared with (benchmarks/pd_ttft.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, assert_never

import httpx
from fastapi import Request
from fastapi.responses import Response
from starlette.requests import ClientDisconnect

from kvbridge.kv_transfer.params import KV_LOAD_FAILED
from kvbridge.openai_wire import MAX_BODY_BYTES, REQUEST_ID_HEADER, parse_json_object
from kvbridge.proxy import first_token, gone, prompt_lists, tracing_spans
from kvbridge.proxy.bodies import (error_code, forwardable, kv_transfer_params, prefill_body, prompt_text, read_body,
                                   refused_by_decode, request_id_of, wants_prompt_logprobs)
from kvbridge.proxy.instance_info import ask_context_len
from kvbridge.proxy.fleet_view import FleetView
from kvbridge.proxy import kv_reuse, kv_routing
from kvbridge.proxy.kv_cost import PdMode
from kvbridge.proxy.kv_routing import FORCED_PD, RoutePlan
from kvbridge.proxy.exchange import (Exchange, Exhausted, Failed, PassthroughStream, RetryPolicy, UsageTap,
                                     openai_error)
from kvbridge.proxy.health import HealthChecks
from kvbridge.proxy.legs import Legs
from kvbridge.proxy.metrics import ProxyMetrics
from kvbridge.proxy.releases import Releases, UnreadAnswers
from kvbridge.proxy.routing import KvAwarePolicy, Upstream, UpstreamKind, UpstreamPool
from kvbridge.proxy.tracing_spans import Spans
from kvbridge.proxy.transport import UpstreamTransport

# RetryPolicy and openai_error are named here too: the CLI and the Ray ingress import them from here.
__all__ = ["BAD_KEY_MESSAGE", "FIRST_BYTE_TIMEOUT_S", "ClientRequest", "PDProxy", "Prefilled", "RetryPolicy",
           "openai_error"]

logger = logging.getLogger(__name__)

# How long a decode instance may take to start a streamed answer (its status line, sent once it
# admitted the request): a stopped or hung one fails the attempt rather than holding it for the
# whole timeout. Admission waits for the engine's current step and tokenises the prompt: seconds.
FIRST_BYTE_TIMEOUT_S = 30.0
COMPLETIONS_ROUTE = "/v1/completions"
UPSTREAM_KEEPALIVE_S = 2.0
PD_PATH_HEADER, PD_REASON_HEADER = "x-kvbridge-pd-path", "x-kvbridge-pd-reason"
HELD_HEADER = "x-kvbridge-kv-reused-tokens"  # a held prefix's tokens the serving instance was sent (kv_reuse.py)
BAD_KEY_MESSAGE = "Incorrect or missing API key. Send 'Authorization: Bearer <key>'."


@dataclass(frozen=True)
class Prefilled:
    """P's leg succeeded: the P that prefilled, the kv_transfer_params it answered (its lease),
    and its whole answer (the first-token path reads P's token from it)."""

    upstream: Upstream
    params: dict[str, object]
    answer: bytes


# The outcome of P's leg: P prefilled; P's own 4xx answer (the request's fault: the client gets
# it); or no P could prefill (the decode-only fallback may serve the request).
PrefillOutcome = Prefilled | Response | Exhausted


@dataclass(frozen=True)
class ClientRequest:
    """One client request being served: what each step of it needs."""

    route: str
    body: dict[str, Any]  # the client's JSON body
    headers: dict[str, str]  # sent upstream: the request id, identity encoding, authorization
    request_id: str
    spans: Spans  # tracing_spans.NO_SPANS when tracing is off
    gone: asyncio.Event  # set when the client disconnects
    plan: RoutePlan = FORCED_PD  # the fleet view's costs and P/D decision (kv_routing.py)
    held: kv_reuse.Held | None = None  # a prefix another instance holds for this request (kv_reuse.py)


class PDProxy:
    """Routes requests over two pools (or only the decode pool: colocated mode, `prefill`
    None); owns the pooled HTTP client, the health loop and the release calls outliving requests."""

    def __init__(self, prefill: UpstreamPool | None, decode: UpstreamPool, *, health_interval_s: float,
                 health_timeout_s: float, timeout_s: float, connect_timeout_s: float,
                 api_key: str | None, upstream_api_key: str | None, retry: RetryPolicy = RetryPolicy(),
                 seed: int | None = None, first_token_from_prefill: bool = True,
                 max_body_bytes: int = MAX_BODY_BYTES, first_byte_timeout_s: float = FIRST_BYTE_TIMEOUT_S,
                 wrap_transport: Callable[[httpx.AsyncBaseTransport], httpx.AsyncBaseTransport] | None = None,
                 pd_mode: PdMode = "always", kv_reuse: bool = False) -> None:
        """`wrap_transport`: wraps the upstream connections' transport (tests inject faults there).
        `pd_mode`: kv_routing.py's; a fleet view (KV events, loads) runs when it, `kv_reuse` (a
        request reads the prefix another instance holds: kv_reuse.py) or a kv_aware policy needs one.
        Tracing is the app's (app.py): a request's spans come in its ASGI scope (`request_spans`)."""
        if max_body_bytes < 1 or first_byte_timeout_s <= 0:
            raise ValueError("max_body_bytes and first_byte_timeout_s must be positive")
        self.prefill, self.decode = prefill, decode
        self.max_body_bytes = max_body_bytes
        self.first_byte_timeout_s = first_byte_timeout_s
        self.first_token_from_prefill = first_token_from_prefill
        self.retry = retry
        self._rng = random.Random(seed)  # backoff jitter
        self.metrics = ProxyMetrics()
        self.health_interval_s, self.health_timeout_s = health_interval_s, health_timeout_s
        self.timeout = httpx.Timeout(timeout_s, connect=connect_timeout_s)
        # Release calls and /v1/models do no model work: they get a short bound.
        self.short_timeout = httpx.Timeout(min(timeout_s, 10.0), connect=connect_timeout_s)
        self.api_key, self.upstream_api_key = api_key, upstream_api_key
        self.wrap_transport = wrap_transport
        self._client: httpx.AsyncClient | None = None  # opened by start()
        self.legs = Legs(self.client, self.metrics, retry, self._rng)
        self.releases = Releases(self.client, self.metrics, self.short_timeout)
        self.pd_mode = pd_mode
        self.kv_reuse = kv_reuse
        self._cannot_hold: set[str] = set()  # instances that answered they never hold a prefix
        wanted = kv_reuse or pd_mode != "always" or any(isinstance(p.policy, KvAwarePolicy) for p in self.pools)
        self.fleet: FleetView | None = FleetView() if wanted else None
        self.health = HealthChecks(self.pools, self.client, self._auth_headers(None), health_interval_s,
                                   health_timeout_s, self.fleet)

    def client(self) -> httpx.AsyncClient:
        """The pooled client of every upstream call; RuntimeError before start()."""
        if self._client is None:
            raise RuntimeError("the proxy has not started")
        return self._client

    @property
    def pools(self) -> tuple[UpstreamPool, ...]:
        """The configured pools, prefill first (decode only in colocated mode)."""
        return (self.decode,) if self.prefill is None else (self.prefill, self.decode)

    # ---- lifecycle -------------------------------------------------------------------
    async def start(self) -> None:
        """Open the client and run one health round before serving (then one every interval)."""
        # trust_env=False: an HTTP(S)_PROXY variable must never reroute upstream calls.
        transport: httpx.AsyncBaseTransport = UpstreamTransport(
            trust_env=False, limits=httpx.Limits(max_connections=None, max_keepalive_connections=64,
                                                 # below uvicorn's 5 s keep-alive: never reuse a
                                                 # connection the upstream is closing
                                                 keepalive_expiry=UPSTREAM_KEEPALIVE_S))
        if self.wrap_transport is not None:
            transport = self.wrap_transport(transport)
        self._client = httpx.AsyncClient(timeout=self.timeout, trust_env=False, transport=transport)
        await self.health.start()

    async def stop(self) -> None:
        await self.health.stop()
        if self.fleet is not None:
            await self.fleet.close()
        await self.releases.stop()
        if self._client is not None:
            await self._client.aclose()

    async def set_members(self, kind: UpstreamKind, urls: list[str]) -> None:
        """A dynamic pool's instances are now `urls` (routing.UpstreamPool.set_members): the
        new ones are probed at once, so one that is healthy takes traffic without waiting for the
        next health round; one that left is picked no more."""
        pool = self.decode if kind is UpstreamKind.DECODE else self.prefill
        if pool is None:
            raise ValueError("colocated mode has no prefill pool")
        added, removed = pool.set_members(urls)
        for u in removed:
            if self.fleet is not None:
                await self.fleet.forget(u.url)
        if added and self._client is not None:  # else start() probes them
            await asyncio.gather(*(self.health.probe(pool, u) for u in added))

    # ---- health (health.py probes; the pools hold the verdicts) ----------------------
    def refresh_gauges(self) -> None:
        for pool in self.pools:
            self.metrics.healthy.labels(pool.kind.value).set(len(pool.healthy()))
            self.metrics.outstanding.labels(pool.kind.value).set(sum(u.outstanding for u in pool.upstreams))
            for u in pool.upstreams:
                self.metrics.circuit.labels(pool.kind.value, u.url).set(u.breaker.state.gauge)

    def health_report(self) -> tuple[bool, dict[str, object]]:
        report: dict[str, list[dict[str, object]]] = {kind.value: [] for kind in UpstreamKind}
        for pool in self.pools:
            report[pool.kind.value] = [{"url": u.url, "healthy": u.healthy, "outstanding": u.outstanding,
                                        "circuit": u.breaker.state.value} for u in pool.upstreams]
        ok = all(pool.healthy() for pool in self.pools)
        mode = "colocated" if self.prefill is None else "pd"
        return ok, {"status": "ok" if ok else "unavailable", "mode": mode, **report}

    # ---- requests --------------------------------------------------------------------
    def _auth_headers(self, client_request: Request | None) -> dict[str, str]:
        """The upstream key, else the client's Authorization as `forwardable` makes it (without
        --api-key an instance takes any value; one that cannot be sent goes on as none)."""
        if self.upstream_api_key:
            return {"Authorization": f"Bearer {self.upstream_api_key}"}
        given = None if client_request is None else forwardable(client_request.headers.get("authorization"))
        return {"Authorization": given} if given else {}

    def upstream_headers(self, client_request: Request | None) -> dict[str, str]:
        """The authorization an upstream call made for `client_request` carries."""
        return self._auth_headers(client_request)

    def authorized(self, request: Request) -> bool:
        """Whether the client's Authorization (without the whitespace around it) names the proxy's key."""
        if not self.api_key:
            return True
        given = request.headers.get("authorization", "").strip(" \t")
        return hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode())


    async def handle(self, request: Request, route: str) -> Response:
        """Serve one completions or chat-completions request through P then D (colocated
        mode: straight to a decode-list instance)."""
        request_id = request_id_of(request)
        spans = tracing_spans.request_spans(request, request_id)
        body = await self._read_request(request, request_id, spans)
        if isinstance(body, Response):
            return body
        body.pop(first_token.CONTINUE_FIELD, None)  # like kv_transfer_params: only the proxy sets it
        unavailable = self._unavailable(request_id)
        if unavailable is not None:
            return unavailable
        headers = {REQUEST_ID_HEADER: request_id, "Accept-Encoding": "identity", **self._auth_headers(request)}
        call = ClientRequest(route, body, headers, request_id, spans, asyncio.Event())
        watcher = asyncio.create_task(gone.watch_disconnect(request, call.gone))
        try:  # the watcher must stop before a StreamingResponse listens to the client itself
            if self.prefill is None:  # planned too: a kv_aware pool routes on the instances' cached prefixes
                call = await self._planned(call)
                return self._path(call, await self._decode_alone(call), "decode_only", "colocated")
            on_p_alone = wants_prompt_logprobs(body)
            if not on_p_alone and (refused := refused_by_decode(body)) is not None:  # before P prefills for D
                return openai_error(400, f"{refused[0]}: {refused[1]}", None, request_id, param=refused[0])
            if route == COMPLETIONS_ROUTE and (bodies := prompt_lists.split(body)) is not None:
                return await self._prompt_list(call, self.prefill, bodies)
            return await self._one_prompt(call, self.prefill)
        finally:
            watcher.cancel()

    async def _read_request(self, request: Request, request_id: str, spans: Spans) -> dict[str, Any] | Response:
        """The client's body, or the answer that refuses it (401, 413, 400; 499 when the client
        left mid-body: nothing was sent anywhere, nobody reads an answer)."""
        try:
            if not self.authorized(request):
                return openai_error(401, BAD_KEY_MESSAGE, "invalid_api_key", request_id)
            try:
                raw = await read_body(request, self.max_body_bytes)
            except ClientDisconnect:
                return Response(status_code=499)
            if raw is None:
                return openai_error(413, f"the request body is larger than {self.max_body_bytes} bytes",
                                    "request_too_large", request_id)
            try:  # strict: what parses here can be forwarded (no NaN, no lone surrogate, no deep nesting)
                return parse_json_object(raw)
            except ValueError as exc:
                return openai_error(400, str(exc), "invalid_json", request_id)
        finally:
            spans.body_read()

    def _unavailable(self, request_id: str) -> Response | None:
        """503 when a pool the request needs has no healthy instance; checked before P works, so
        no KV is held for nothing (no healthy P: the decode-only fallback serves, when on)."""
        for pool in self.pools:
            if pool is self.prefill and self.retry.decode_only_fallback:
                continue
            if not pool.healthy():
                return openai_error(503, f"no healthy {pool.kind.value} instance", "no_healthy_instance",
                                    request_id)
        return None

    # ---- one method per outcome of P's leg ----------------------------------------------
    async def _prefill_then_decode(self, call: ClientRequest, prefill: UpstreamPool) -> Response:
        """P/D mode: P's leg, then the method for its outcome (or 499 when the client left first)."""
        outcome = await gone.unless(call.gone, self._prefill(call, prefill))
        reason = call.plan.decision.reason
        if outcome is None or call.gone.is_set():
            return self._path(call, await self._gone_before_decode(outcome, call), "prefill_decode", reason)
        match outcome:
            case Prefilled():
                return self._path(call, await self._decode_prefilled(outcome, call), "prefill_decode", reason)
            case Exhausted():
                return await self._without_prefill(outcome, call, prefill)
            case Response():  # P's 4xx: the request's own fault, never retried
                return self._path(call, outcome, "prefill_decode", reason)
            case _:
                assert_never(outcome)

    def _path(self, call: ClientRequest, answer: Response, path: str, reason: str) -> Response:
        """Says which path served the request and why: a counter, a span attribute, two headers."""
        self.metrics.pd_path.labels(path, reason).inc()
        call.spans.pd_path(path, reason)
        answer.headers[PD_PATH_HEADER], answer.headers[PD_REASON_HEADER] = path, reason
        if call.held is not None:
            answer.headers[HELD_HEADER] = str(call.held.tokens)
        return answer

    async def _one_prompt(self, call: ClientRequest, prefill: UpstreamPool) -> Response:
        """One prompt (the request's, or one of its list's): on P alone when its answer needs the
        prompt's logprobs; else by its routing plan, D alone (decode_only) or P then D."""
        if wants_prompt_logprobs(call.body):
            return await self._prefill_alone(call, prefill)
        call = await self._with_held_prefix(await self._planned(call))
        if call.plan.decision.path == "decode_only":
            return self._path(call, await self._decode_alone(call), "decode_only", call.plan.decision.reason)
        return await self._prefill_then_decode(call, prefill)

    async def _prefill_alone(self, call: ClientRequest, prefill: UpstreamPool) -> Response:
        """P serves the whole request (path prefill_only, reason prompt_logprobs): the prompt's
        logprobs come from the instance that computes the prompt, and a D reading P's KV never
        computes them. P gets the client's body unchanged (no KV is kept for a D); its answer is
        passed through, streamed or whole. When no P can serve it, the decode-only fallback does
        (D computes the prompt itself)."""
        stream = bool(call.body.get("stream"))
        result = await gone.unless(call.gone, self.legs.run(
            prefill, call.route, call.body, call.headers, call.request_id, prompt_text(call.body),
            lambda exchange: self._whole_answer(exchange, call, stream, UpstreamKind.PREFILL),
            first_byte_s=self.first_byte_timeout_s if stream else None, spans=call.spans.leg("prefill_only")))
        if result is None:
            return Response(status_code=499)
        if isinstance(result, Exhausted):
            return await self._without_prefill(result, call, prefill)
        return self._path(call, result, "prefill_only", "prompt_logprobs")

    async def _whole_answer(self, exchange: Exchange, call: ClientRequest, stream: bool,
                            kind: UpstreamKind) -> Response | Failed:
        """An instance's answer to a request it serves alone: a stream passed through, or the whole
        answer; or why this attempt failed (reading it failed, a 5xx)."""
        if exchange.response.status_code < 400 and stream:
            return PassthroughStream(exchange, call.request_id)
        answer = await self.legs.read_all(exchange, call.request_id)
        return self.legs.server_error(kind, answer) or answer

    async def _prompt_list(self, call: ClientRequest, prefill: UpstreamPool, bodies: list[dict[str, Any]]) -> Response:
        """A completion's list of prompts: each its own P/D path (`<id>-<index>`), the answers merged;
        one prompt's failure is the answer, and stops the others as a client leaving would
        (prompt_lists.py)."""
        if len(bodies) == 1:
            return await self._one_prompt(ClientRequest(
                call.route, bodies[0], call.headers, call.request_id, call.spans, call.gone), prefill)
        parts = [ClientRequest(call.route, b, {**call.headers, REQUEST_ID_HEADER: f"{call.request_id}-{i}"},
                               f"{call.request_id}-{i}", call.spans, asyncio.Event()) for i, b in enumerate(bodies)]
        events = [part.gone for part in parts]
        relay = asyncio.create_task(gone.relay(call.gone, events))
        tasks = [asyncio.create_task(self._one_prompt(part, prefill)) for part in parts]
        try:
            answers, failure = await gone.first_failure_stops_the_rest(tasks, events)
        finally:
            relay.cancel()
        if failure is not None or call.gone.is_set():
            await asyncio.gather(*(prompt_lists.close(a) for a in answers), return_exceptions=True)
            if failure is None:
                return Response(status_code=499)
            logger.info("request %s: a prompt of its list failed (%d): the list fails", call.request_id,
                        failure.status_code)
            return failure
        if call.body.get("stream") is True:
            options = call.body.get("stream_options")
            include_usage = isinstance(options, dict) and options.get("include_usage") is True
            return prompt_lists.MergedStream(answers, call.request_id, include_usage,
                                             prompt_lists.choices_per_prompt(call.body))
        return prompt_lists.merge_whole(answers, call.request_id, prompt_lists.choices_per_prompt(call.body))

    async def _gone_before_decode(self, outcome: PrefillOutcome | None, call: ClientRequest) -> Response:
        """The client left before any D was asked: P's KV, if P granted some, is released at once
        (nobody else knows its params yet)."""
        if isinstance(outcome, Prefilled):
            await self._release(outcome, call)
        logger.info("request %s: client went away before decode started", call.request_id)
        return Response(status_code=499)

    async def _without_prefill(self, exhausted: Exhausted, call: ClientRequest, prefill: UpstreamPool) -> Response:
        """No P could prefill: D serves the request alone (the decode-only fallback), unless the
        fallback is off or the request itself could not be sent."""
        if not self.retry.decode_only_fallback or exhausted.request_at_fault:
            await self._release_held(call)
            return self._path(call, exhausted.response, "prefill_decode", call.plan.decision.reason)
        self.metrics.decode_only_fallback.inc()
        logger.warning("request %s: no prefill instance could serve it; decode-only fallback", call.request_id)
        reason = "prefill_failed" if prefill.healthy() else "no_prefill_healthy"
        return self._path(call, await self._decode_alone(call), "decode_only", reason)

    async def _decode_prefilled(self, prefilled: Prefilled, call: ClientRequest) -> Response:
        """P prefilled: D decodes from P's KV, and from P's token where the first-token path serves."""
        plan = await self._first_token_plan(prefilled, call)
        if call.gone.is_set():  # left while the first-token plan was made
            return await self._gone_before_decode(prefilled, call)
        if plan is None:
            return await self._decode_until_gone(call, call.body, prefilled)
        if plan.finished:
            self.metrics.first_token.labels("finished_at_prefill").inc()
            call.spans.first_token_outcome("finished_at_prefill")
            await self._release(prefilled, call)
            return Response(plan.events, media_type="text/event-stream", headers={REQUEST_ID_HEADER: call.request_id})
        answer = await self._decode_until_gone(call, plan.decode_body(call.body), prefilled, plan.events)
        continued = isinstance(answer, PassthroughStream)
        if continued:
            self.metrics.first_token.labels("continued").inc()
        call.spans.first_token_outcome("continued" if continued else "decode_failed")
        return answer

    async def _release(self, prefilled: Prefilled, call: ClientRequest) -> None:
        """No D will read `prefilled`'s KV: ask its P to free it now (releases.py)."""
        await self.releases.by_params(prefilled.upstream, prefilled.params, call.headers, call.request_id, call.spans)

    async def _decode_alone(self, call: ClientRequest) -> Response:
        """D serves the request without P (colocated mode, the decode-only fallback)."""
        return await self._decode_until_gone(call, call.body, None)

    async def _decode_until_gone(self, call: ClientRequest, body: dict[str, Any], prefilled: Prefilled | None,
                                 first: bytes = b"") -> Response:
        """D's answer, or 499 when the client left first: the D call is cancelled, which closes its
        connection, so D aborts and frees through its own path."""
        answer = await gone.unless(call.gone, self._decode(call, body, prefilled, first))
        return answer if answer is not None else Response(status_code=499)

    # ---- P's leg ------------------------------------------------------------------------
    async def _prefill(self, call: ClientRequest, pool: UpstreamPool) -> PrefillOutcome:
        """Step 1: P's leg. Exhausted when every attempt failed (connection, timeout, a broken
        answer, 5xx, no kv_transfer_params) or no P could be tried."""
        started = time.monotonic()
        keys = UnreadAnswers()
        try:
            body = prefill_body(call.body)
            body["kv_transfer_params"] = kv_reuse.with_held(body["kv_transfer_params"], call.held)
            outcome: PrefillOutcome = await self.legs.run(
                pool, call.route, body, call.headers, call.request_id, prompt_text(call.body),
                lambda exchange: self._prefill_answer(exchange, call, keys),
                spans=call.spans.leg("prefill"), keys=keys, costs=call.plan.prefill_costs)
        finally:  # cancelled (the client left), or attempts that broke mid-answer: P may hold their KV
            self.releases.unread_in_background(keys, call.headers, call.request_id)
        if isinstance(outcome, Prefilled):
            self.metrics.prefill_seconds.observe(time.monotonic() - started)
        return outcome

    async def _prefill_answer(self, exchange: Exchange, call: ClientRequest,
                              keys: UnreadAnswers) -> Prefilled | Response | Failed:
        """P's whole answer as the leg's outcome (a 4xx, the request's own fault, is never retried),
        or why this attempt failed (an answer without kv_transfer_params: not P's breaker's failure)."""
        request_id = call.request_id
        answer = await self.legs.read_all(exchange, request_id)
        if isinstance(answer, Failed):
            return answer
        kv_routing.observe_cached(self.metrics.cached_prediction_error, call.plan, exchange.upstream.url, answer)
        keys.read(exchange.upstream)  # read whole: its params (if any) are ours to pass on or release
        failed = self.legs.server_error(UpstreamKind.PREFILL, answer)
        if failed is not None:
            return failed
        if answer.status_code >= 400:
            return answer
        body = bytes(answer.body)
        params = kv_transfer_params(body)
        if params is None:
            url = exchange.upstream.url
            logger.warning("request %s: prefill instance %s returned no kv_transfer_params", request_id, url)
            return Failed("no_kv_transfer_params", True, openai_error(
                502, f"prefill instance {url} returned no kv_transfer_params (is it running with --kv-role "
                     "producer?)", "no_kv_transfer_params", request_id), instance_at_fault=False)
        return Prefilled(exchange.upstream, params, body)

    async def _first_token_plan(self, prefilled: Prefilled, call: ClientRequest) -> first_token.Plan | None:
        """The first-token path for this request, or None for the ordinary path. A request the
        context limits (a chat without max_tokens) needs P's context length: asked once per P."""
        body, route, upstream = call.body, call.route, prefilled.upstream
        if not (self.first_token_from_prefill and first_token.eligible(body, route)):
            return None
        call.spans.first_token_started()
        context_len = None
        if first_token.limited_by_context(body, route):
            if upstream.context_len is None:
                upstream.context_len = await ask_context_len(self.client(), upstream, call.headers,
                                                             self.short_timeout)
            context_len = upstream.context_len
        plan = first_token.plan(body, route, prefilled.answer, prefilled.params, context_len)
        call.spans.first_token_planned(plan is not None)
        return plan

    # ---- D's leg ------------------------------------------------------------------------
    async def _decode(self, call: ClientRequest, body: dict[str, Any], prefilled: Prefilled | None,
                      first: bytes = b"") -> Response:
        """Step 2 (or the whole request in colocated mode and in the decode-only fallback:
        `prefilled` None, the client's body without kv_transfer_params): D's answer, streamed or
        whole. A D that fails before anything reached the client (connection, timeout, a broken
        answer, 5xx) is retried on another D with the same kv_transfer_params; a 4xx and a
        stream that started are never retried. P's KV is released when no D received the request.
        `first`: bytes a successful stream sends before D's (the first-token path's events)."""
        if prefilled is None:
            forwarded = {k: v for k, v in body.items() if k != "kv_transfer_params"}
            if call.held is not None:  # D alone reads the prefix another instance holds
                forwarded["kv_transfer_params"] = kv_reuse.with_held({}, call.held)
        else:
            forwarded = {**body, "kv_transfer_params": prefilled.params}
        stream = bool(body.get("stream"))
        # D sends a stream's status line once it admitted the request (before any KV moves), an
        # unstreamed answer's only when it is complete: only a stream's start can be bounded.
        first_byte_s = self.first_byte_timeout_s if stream else None
        role = "decode" if prefilled is not None else "colocated" if self.prefill is None else "decode_only"
        result = await self.legs.run(
            self.decode, call.route, forwarded, call.headers, call.request_id, prompt_text(body),
            lambda exchange: self._decode_answer(exchange, call, stream, first, prefilled is None),
            first_byte_s=first_byte_s, spans=call.spans.leg(role), costs=call.plan.decode_costs)
        if not isinstance(result, Exhausted):
            return result
        if prefilled is not None and not result.received:
            await self._release(prefilled, call)
        if prefilled is None and not result.received:
            await self._release_held(call)
        return result.response

    async def _decode_answer(self, exchange: Exchange, call: ClientRequest, stream: bool,
                             first: bytes, alone: bool) -> Response | Failed:
        """D's answer as the leg's result: a stream passed through (its first byte goes to the
        client: no retry after it), or the whole answer; or why this attempt failed."""
        status = exchange.response.status_code
        if status < 400 and stream:
            observe = (kv_routing.cached_observer(self.metrics.cached_prediction_error, call.plan,
                                                  exchange.upstream.url) if alone else None)
            return PassthroughStream(exchange, call.request_id, first, UsageTap(observe) if observe else None)
        answer = await self.legs.read_all(exchange, call.request_id)
        if alone and not isinstance(answer, Failed):  # D computed the prompt from its own cache
            kv_routing.observe_cached(self.metrics.cached_prediction_error, call.plan, exchange.upstream.url, answer)
        if not isinstance(answer, Failed) and status >= 500 and error_code(answer) == KV_LOAD_FAILED:
            # D is fine; the request's KV could not be loaded and P has released it, so
            # another D could not load it either: the client gets D's answer, D's breaker a success.
            return answer
        return self.legs.server_error(UpstreamKind.DECODE, answer) or answer

    async def _with_held_prefix(self, call: ClientRequest) -> ClientRequest:
        """`call` with the prefix held for it by the instance that has the most of its prompt cached,
        when that is a block more than wherever it may go (kv_reuse.py); unchanged otherwise."""
        prediction = call.plan.prediction
        if not self.kv_reuse or self.fleet is None or prediction is None:
            return call
        pool = self.decode if call.plan.decision.path == "decode_only" or self.prefill is None else self.prefill
        targets = [u.url for u in pool.healthy()]
        block = max((self.fleet.block_size(u) or kv_routing.DEFAULT_BLOCK_SIZE for u in targets),
                    default=kv_routing.DEFAULT_BLOCK_SIZE)
        url = kv_reuse.better_holder(prediction, targets, block, self._cannot_hold)
        if url is None:
            return call
        held = await kv_reuse.hold(self.client(), url, prediction.token_ids, call.headers,
                                   httpx.Timeout(kv_reuse.HOLD_TIMEOUT_S))
        if held is False:
            self._cannot_hold.add(url)
            self.metrics.kv_holds.labels("cannot_hold").inc()
            return call
        self.metrics.kv_holds.labels("held" if held is not None else "none").inc()
        return dataclasses.replace(call, held=held) if held is not None else call

    async def _release_held(self, call: ClientRequest) -> None:
        """No instance received the request: its held prefix is released at once (else its lease expires)."""
        if call.held is None:
            return
        upstream = next((u for pool in self.pools for u in pool.upstreams if u.url == call.held.url), None)
        if upstream is not None:
            await self.releases.by_params(upstream, call.held.params, call.headers, call.request_id, call.spans)

    async def _planned(self, call: ClientRequest) -> ClientRequest:
        """`call` with its routing plan (kv_routing.py), when a fleet view runs."""
        if self.fleet is None:
            return call
        plan = await kv_routing.plan_for(self.fleet, self.client(), self.prefill, self.decode, call.route, call.body,
                                         call.headers, self.short_timeout, self.pd_mode, self.kv_reuse)
        return dataclasses.replace(call, plan=plan)
