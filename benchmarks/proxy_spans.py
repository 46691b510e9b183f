"""What tracing costs the proxy per request, on and off, same run (issue 46).

The proxy's request path tells a request's spans what happened and never asks whether tracing
is on: with tracing off every request gets the null object `NO_SPANS` (proxy/tracing_spans.py).
Two measurements, each in interleaved repetitions (the order of the modes rotates), medians:

  calls    the span calls one P/D request makes (request id, body read, per leg a route and an
           attempt with its traceparent headers and verdict; when traced, the middleware's
           start, answer and finish), `--calls` requests a repetition, ns per request:
             null      NO_SPANS (tracing off, as built)
             branches  the same sequence as `if spans is not None` tests (tracing off before
                       issue 46: no object, one branch per call site)
             otel_off  the real RequestSpans over an SDK tracer that samples nothing
                       (OpenTelemetry's own "off": non-recording spans)
             on        the real RequestSpans, every span recorded, batch-exported to a sink that
                       drops them (the export thread's cost is outside the request)
  request  one whole unstreamed P/D request through the proxy app in process (ASGI in, the
           upstreams an httpx MockTransport answering P's and D's canned JSON), `--requests`
           requests a repetition, us per request, modes null, otel_off and on.

    python benchmarks/proxy_spans.py --reps 7 --json /tmp/proxy_spans.json
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import httpx
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, Sampler

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvbridge.proxy.app import build_proxy_app  # noqa: E402
from kvbridge.proxy.exchange import Exchange  # noqa: E402
from kvbridge.proxy.routing import UpstreamKind, UpstreamPool, make_policy  # noqa: E402
from kvbridge.proxy.tracing_spans import NO_SPANS, RequestSpans, Spans  # noqa: E402
from kvbridge.tracing import Tracing  # noqa: E402

ROUTE = "/v1/completions"
P_URL, D_URL = "http://p.invalid:8100", "http://d.invalid:8200"
HEADERS = {"X-Request-Id": "bench", "Accept-Encoding": "identity"}
PARAMS = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2]],
          "remote_engine_id": "P", "remote_request_id": "bench", "remote_host": "127.0.0.1",
          "remote_port": 5600, "tp_size": 1, "lease_generation": 1}


class _Drop(SpanExporter):
    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return SpanExportResult.SUCCESS


def tracing(sampler: Sampler) -> Tracing:
    provider = TracerProvider(sampler=sampler)
    # A queue long enough that no span is dropped (a dropped span costs less than an exported one).
    provider.add_span_processor(BatchSpanProcessor(_Drop(), max_queue_size=1 << 16))
    return Tracing(provider, "kvbridge-proxy-bench")


# ---- calls: the span calls of one P/D request -----------------------------------------------
def _pools() -> tuple[UpstreamPool, UpstreamPool]:
    return (UpstreamPool(UpstreamKind.PREFILL, [P_URL], make_policy("round_robin")),
            UpstreamPool(UpstreamKind.DECODE, [D_URL], make_policy("round_robin")))


def calls_with(spans: Spans, pools: tuple[UpstreamPool, UpstreamPool], sent: Exchange) -> None:
    """What PDProxy.handle and Legs.run tell the spans of one unstreamed P/D request."""
    spans.identified("bench")
    spans.body_read()
    for role, pool in zip(("prefill", "decode"), pools):
        leg = spans.leg(role)
        upstream = pool.upstreams[0]
        leg.routed(pool, ROUTE, [], upstream)
        attempt = leg.attempt(upstream, ROUTE, 1)
        attempt.headers(HEADERS)
        attempt.end(sent, None)


def calls_branches(spans: RequestSpans | None, pools: tuple[UpstreamPool, UpstreamPool], sent: Exchange) -> None:
    """The same request's call sites as `is None` tests (spans None: tracing off)."""
    if spans is not None:
        spans.identified("bench")
    if spans is not None:
        spans.body_read()
    for role, pool in zip(("prefill", "decode"), pools):
        leg = None if spans is None else spans.leg(role)
        upstream = pool.upstreams[0]
        if leg is not None:
            leg.routed(pool, ROUTE, [], upstream)
        attempt = None if leg is None else leg.attempt(upstream, ROUTE, 1)
        _ = HEADERS if attempt is None else attempt.headers(HEADERS)
        if attempt is not None:
            attempt.end(sent, None)


def traced_request(tracer: Tracing, pools: tuple[UpstreamPool, UpstreamPool], sent: Exchange) -> None:
    """The middleware's part (proxy.request, the answer going out) around the handler's calls."""
    spans = RequestSpans(tracer, ROUTE, None, time.time_ns())
    calls_with(spans, pools, sent)
    spans.response_started(200)
    end_ns = time.time_ns()
    spans.body_sent(b"{}", end_ns)
    spans.finish(end_ns)


def time_calls(mode: str, n: int, tracers: dict[str, Tracing]) -> float:
    """Median ns per request over `n` requests of `mode`."""
    pools = _pools()
    sent = Exchange(pools[1], pools[1].upstreams[0], httpx.Response(200))
    one: Callable[[], None]
    if mode == "null":
        def one() -> None: calls_with(NO_SPANS, pools, sent)
    elif mode == "branches":
        def one() -> None: calls_branches(None, pools, sent)
    else:
        tracer = tracers[mode]

        def one() -> None: traced_request(tracer, pools, sent)
    samples = []
    clock = time.perf_counter_ns
    for _ in range(n):
        start = clock()
        one()
        samples.append(clock() - start)
    return statistics.median(samples)


# ---- request: one whole P/D request through the proxy app ---------------------------------
def _upstreams(request: httpx.Request) -> httpx.Response:
    if request.url.path == "/health":
        return httpx.Response(200, json={"status": "ok"})
    body = json.loads(request.content)
    if request.url.host == "p.invalid":
        return httpx.Response(200, json={
            "id": "cmpl-p", "object": "text_completion", "created": 0, "model": "m",
            "choices": [{"index": 0, "text": " a", "finish_reason": "length"}],
            "usage": {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5},
            "kv_transfer_params": PARAMS})
    assert body["kv_transfer_params"] == PARAMS
    return httpx.Response(200, json={
        "id": "cmpl-d", "object": "text_completion", "created": 0, "model": "m",
        "choices": [{"index": 0, "text": " a b c d", "finish_reason": "length"}],
        "usage": {"prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8}})


async def time_requests(mode: str, n: int, tracers: dict[str, Tracing]) -> float:
    """Median us per request over `n` sequential requests of `mode`."""
    app = build_proxy_app([P_URL], [D_URL], health_interval_s=3600, tracing=tracers.get(mode),
                          first_token_from_prefill=False)
    proxy = app.state.proxy
    proxy.wrap_transport = lambda _transport: httpx.MockTransport(_upstreams)
    await proxy.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy") as client:
            body = {"model": "m", "prompt": "Hello there", "max_tokens": 4}
            for _ in range(20):  # warm-up
                (await client.post(ROUTE, json=body)).raise_for_status()
            samples = []
            for _ in range(n):
                start = time.perf_counter_ns()
                r = await client.post(ROUTE, json=body)
                samples.append(time.perf_counter_ns() - start)
                assert r.status_code == 200, r.text
    finally:
        await proxy.stop()
    return statistics.median(samples) / 1000


def _rotated(modes: list[str], rep: int) -> list[str]:
    k = rep % len(modes)
    return modes[k:] + modes[:k]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--calls", type=int, default=20000, help="requests a repetition of the calls measurement")
    parser.add_argument("--requests", type=int, default=300, help="requests a repetition of the request measurement")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    tracers = {"otel_off": tracing(ALWAYS_OFF), "on": tracing(ALWAYS_ON)}
    call_modes, request_modes = ["null", "branches", "otel_off", "on"], ["null", "otel_off", "on"]
    calls: dict[str, list[float]] = {m: [] for m in call_modes}
    requests: dict[str, list[float]] = {m: [] for m in request_modes}
    gc.collect()
    for rep in range(args.reps):
        for mode in _rotated(call_modes, rep):
            calls[mode].append(time_calls(mode, args.calls, tracers))
        for mode in _rotated(request_modes, rep):
            requests[mode].append(asyncio.run(time_requests(mode, args.requests, tracers)))
        print(f"rep {rep + 1}: calls ns " + ", ".join(f"{m} {calls[m][-1]:.0f}" for m in call_modes)
              + "; request us " + ", ".join(f"{m} {requests[m][-1]:.0f}" for m in request_modes), flush=True)
    for tracer in tracers.values():
        tracer.shutdown()
    result = {"reps": args.reps, "calls_per_rep": args.calls, "requests_per_rep": args.requests,
              "calls_ns": {m: statistics.median(v) for m, v in calls.items()},
              "request_us": {m: statistics.median(v) for m, v in requests.items()}}
    null_us = result["request_us"]["null"]
    print("\nspan calls of one P/D request, median ns (of per-repetition medians):")
    for mode, ns in result["calls_ns"].items():
        print(f"  {mode:9s} {ns:8.0f}")
    print("one P/D request through the proxy app, median us (of per-repetition medians):")
    for mode, us in result["request_us"].items():
        print(f"  {mode:9s} {us:8.0f}  ({us / null_us:.3f}x null)")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
