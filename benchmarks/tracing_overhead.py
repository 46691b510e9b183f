"""Tracing on (100% sampling) vs off: output tok/s of two `kvbridge up` clusters, same run (issue 30).

Two identical local P/D clusters (1 prefill, 1 decode, NIXL on loopback) run side by side; one
has `--otlp-traces-endpoint` (every process exports every span, sample ratio 1) pointing at an
OTLP/HTTP sink in this script, the other has tracing off. A `vllm bench serve`-style load runs
against one cluster at a time, alternating (A B, B A, ...): `--concurrency` clients (16) stream
`/v1/completions` with random-token prompts of `--input-len` tokens (128) and `--output-len`
output tokens (128, ignore_eos), `--num-prompts` requests a repetition (64), fresh prompts each
repetition (no prefix cache hits). Reported per repetition and as medians: output tok/s, median
TTFT and median TPOT, and the median of the per-repetition ratios on / off (tok/s >= 0.98 is
the issue's target). The sink counts the spans it received (protobuf-decoded), so the figure
shows the traced cluster really exported every request's spans.

    python benchmarks/tracing_overhead.py --reps 3 --json /tmp/tracing_overhead.json

The sink is in this process and so shares the machine's cores with the clusters, like a
collector on the same host would; run it under `nice -n 19` on a shared machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (ExportTraceServiceRequest,
                                                                      ExportTraceServiceResponse)

from kvbridge.engine.setup.default_model import DEFAULT_MODEL
from kvbridge.launcher.cluster import LocalCluster

READY_TIMEOUT_S = 600.0
REQUEST_TIMEOUT_S = 600.0
ON, OFF = "tracing on", "tracing off"


class SpanSink:
    """An OTLP/HTTP traces endpoint that decodes each export and counts its spans."""

    def __init__(self) -> None:
        self.spans = 0
        self.lock = threading.Lock()
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if self.headers.get("Content-Encoding") == "gzip":
                    import gzip
                    body = gzip.decompress(body)
                request = ExportTraceServiceRequest.FromString(body)
                count = sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
                with sink.lock:
                    sink.spans += count
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def count(self) -> int:
        with self.lock:
            return self.spans

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@dataclass(frozen=True)
class Run:
    setup: str
    rep: int
    output_tok_s: float
    median_ttft_ms: float
    median_tpot_ms: float
    spans_exported: int  # spans the sink received during this repetition (and the previous one's tail)


async def one_request(http: httpx.AsyncClient, url: str, model: str, prompt: list[int],
                      output_len: int) -> tuple[float, float, int]:
    """(TTFT s, TPOT s, output tokens) of one streamed completion, measured by the client."""
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    first = last = None
    tokens = 0
    async with http.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[len("data: "):])
            if "error" in event:
                raise RuntimeError(f"the stream failed: {event['error']}")
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            if event["choices"] and event["choices"][0].get("text"):
                last = time.perf_counter()
                if first is None:
                    first = last
    if first is None or last is None:
        raise RuntimeError("the stream had no text")
    tpot = (last - first) / (tokens - 1) if tokens > 1 else 0.0
    return first - started, tpot, tokens


async def load(url: str, model: str, prompts: list[list[int]], concurrency: int,
               output_len: int) -> tuple[float, float, float]:
    """(output tok/s, median TTFT ms, median TPOT ms) of `prompts` sent by `concurrency` clients."""
    queue: asyncio.Queue[list[int]] = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    results: list[tuple[float, float, int]] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits, trust_env=False) as http:
        async def client() -> None:
            while not queue.empty():
                results.append(await one_request(http, url, model, queue.get_nowait(), output_len))

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    return (sum(r[2] for r in results) / elapsed, statistics.median(r[0] for r in results) * 1e3,
            statistics.median(r[1] for r in results) * 1e3)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--reps", type=int, default=3, help="repetitions of each set-up (default: %(default)s)")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the runs and the summary here")
    ap.add_argument("serve_args", nargs="*", help="after --: extra `kvbridge serve` options for every instance "
                                                  "(default: --kv-cache-memory-gb 0.25)")
    a = ap.parse_args()
    serve_args = a.serve_args or ["--kv-cache-memory-gb", "0.25"]
    sink = SpanSink()
    log_dir = Path(tempfile.mkdtemp(prefix="kvbridge-tracing-bench-"))
    tracing = ["--otlp-traces-endpoint", sink.url, "--otlp-traces-sample-ratio", "1.0"]
    clusters = {ON: LocalCluster(a.model, 1, 1, port=0, extra_serve_args=[*serve_args, *tracing],
                                 proxy_args=tracing, ready_timeout_s=READY_TIMEOUT_S, log_dir=log_dir / "on"),
                OFF: LocalCluster(a.model, 1, 1, port=0, extra_serve_args=serve_args,
                                  ready_timeout_s=READY_TIMEOUT_S, log_dir=log_dir / "off")}
    rng = random.Random(a.seed)
    runs: list[Run] = []
    try:
        for cluster in clusters.values():
            cluster.start()
        warm = [[rng.randrange(100, 40000) for _ in range(a.input_len)] for _ in range(a.concurrency)]
        for name, cluster in clusters.items():  # warm-up: kernels, oneDNN primitives, UCX endpoints
            asyncio.run(load(cluster.urls.proxy, a.model, warm, a.concurrency, 8))
        for rep in range(a.reps):
            order = (ON, OFF) if rep % 2 == 0 else (OFF, ON)
            for name in order:
                prompts = [[rng.randrange(100, 40000) for _ in range(a.input_len)] for _ in range(a.num_prompts)]
                before = sink.count()
                tok_s, ttft, tpot = asyncio.run(load(clusters[name].urls.proxy, a.model, prompts, a.concurrency,
                                                     a.output_len))
                runs.append(Run(name, rep, tok_s, ttft, tpot, sink.count() - before))
                print(f"rep {rep} {name:12s} {tok_s:8.1f} tok/s  TTFT {ttft:7.1f} ms  TPOT {tpot:6.1f} ms  "
                      f"spans {runs[-1].spans_exported}", flush=True)
    finally:
        for cluster in clusters.values():
            cluster.stop()
        sink.stop()
    by = {name: [r for r in runs if r.setup == name] for name in clusters}
    ratios = [on.output_tok_s / off.output_tok_s for on, off in zip(by[ON], by[OFF])]
    summary = {name: {"output_tok_s": statistics.median(r.output_tok_s for r in rs),
                      "median_ttft_ms": statistics.median(r.median_ttft_ms for r in rs),
                      "median_tpot_ms": statistics.median(r.median_tpot_ms for r in rs)} for name, rs in by.items()}
    summary["ratio_on_off_tok_s"] = statistics.median(ratios)
    summary["ratios"] = ratios
    summary["spans_total"] = sink.count()
    print(f"\nmedians over {a.reps} repetitions, concurrency {a.concurrency}, {a.input_len} in / {a.output_len} out:")
    for name in clusters:
        s = summary[name]
        print(f"  {name:12s} {s['output_tok_s']:8.1f} tok/s  TTFT {s['median_ttft_ms']:7.1f} ms  "
              f"TPOT {s['median_tpot_ms']:6.1f} ms")
    print(f"  on / off output tok/s: median {summary['ratio_on_off_tok_s']:.3f} (per repetition: "
          f"{', '.join(f'{r:.3f}' for r in ratios)}); spans exported: {summary['spans_total']}")
    if a.json:
        Path(a.json).write_text(json.dumps({"runs": [asdict(r) for r in runs], "summary": summary}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
