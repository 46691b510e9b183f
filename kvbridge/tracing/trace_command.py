"""`kvbridge trace`: one request's waterfall from an OTLP JSON file or a Jaeger API v3 trace store
(tracing/waterfall.py renders it)."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported when the command runs: the CLI starts without them
    import httpx

    from kvbridge.tracing.waterfall import SpanRecord, TraceError


def add_trace_command(sub: argparse._SubParsersAction[argparse.ArgumentParser],
                      positive_int: Callable[[str], int]) -> None:
    """`kvbridge trace` on the CLI's subparsers; positive_int is the CLI's argument type."""
    trace = sub.add_parser(
        "trace", help="print one request's trace as a waterfall (OTLP JSON file or a Jaeger trace store)",
        description="Print one request's spans as a waterfall: each span under its parent, its start (ms from "
                    "the trace's start), duration, service, key attributes and ERROR status, and the gaps no "
                    "child span covers. Read an OTLP JSON file (the OpenTelemetry Collector's file exporter "
                    "output, or one JSON document) or query a trace store over Jaeger's API v3 (--endpoint).",
        epilog="Exit status: 0 printed; 1 no such request or trace, or the trace store unreachable; 2 the "
               "input cannot be used (no file, not OTLP JSON, bad options).")
    trace.add_argument("file", nargs="?", default=None, metavar="FILE",
                       help="OTLP JSON: one {\"resourceSpans\": [...]} object per line, or one document")
    trace.add_argument("--endpoint", default=None, metavar="URL",
                       help="a trace store's Jaeger API v3 base URL instead of FILE (Jaeger's query service, "
                            "e.g. http://127.0.0.1:16686); needs --request-id or --trace-id")
    which = trace.add_mutually_exclusive_group()
    which.add_argument("--request-id", default=None, metavar="ID",
                       help="the trace in which a span has the attribute kvbridge.request_id=ID")
    which.add_argument("--trace-id", default=None, metavar="HEX", help="the trace with this id (32 hex digits)")
    trace.add_argument("--list", action="store_true", help="list the traces found (FILE) instead of a waterfall")
    trace.add_argument("--service", default="kvbridge-proxy",
                       help="--endpoint --request-id: the service whose span carries the request id "
                            "(default: %(default)s)")
    trace.add_argument("--lookback", type=_non_negative, default=3600.0, metavar="SECONDS",
                       help="--endpoint --request-id: how far back the request started (default: %(default)s)")
    trace.add_argument("--timeout", type=_positive, default=10.0, metavar="SECONDS",
                       help="--endpoint: seconds for each HTTP request to the trace store (default: %(default)s)")
    trace.add_argument("--min-gap-ms", type=_non_negative, default=0.1, metavar="MS",
                       help="gaps shorter than this are counted, not printed (default: %(default)s)")
    trace.add_argument("--width", type=positive_int, default=40, help="bar width in characters "
                       "(default: %(default)s)")
    trace.set_defaults(func=cmd_trace)


def _non_negative(text: str) -> float:
    """argparse's type for a finite number >= 0."""
    value = float(text)
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def _positive(text: str) -> float:
    """argparse's type for a finite number > 0."""
    value = _non_negative(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def cmd_trace(a: argparse.Namespace) -> int:
    """One request's waterfall from an OTLP JSON file or a trace store (Jaeger API v3). Exit 2: the
    input cannot be used (no file, not OTLP JSON, bad options); 1: the trace is not there (no such
    request or trace id, the store unreachable or failing)."""
    from kvbridge.tracing import waterfall as wf
    if (a.file is None) == (a.endpoint is None):
        print("kvbridge trace: error: give an OTLP JSON FILE or --endpoint URL (one of them)", file=sys.stderr)
        return 2
    if a.file is not None:
        try:
            with open(a.file, encoding="utf-8") as f:
                text = f.read()
        except OSError as exc:
            print(f"kvbridge trace: error: cannot read {a.file}: {exc.strerror or exc}", file=sys.stderr)
            return 2
        except UnicodeDecodeError:
            print(f"kvbridge trace: error: {a.file} is not OTLP JSON (not UTF-8 text)", file=sys.stderr)
            return 2
        spans = wf.parse_otlp_json(text)
        if isinstance(spans, wf.TraceError):
            print(f"kvbridge trace: error: {a.file} is not OTLP JSON: {spans.message}", file=sys.stderr)
            return 2
    else:
        if a.request_id is None and a.trace_id is None:
            print("kvbridge trace: error: --endpoint needs --request-id or --trace-id", file=sys.stderr)
            return 2
        spans = _trace_store_spans(a)
        if isinstance(spans, wf.TraceError):
            print(f"kvbridge trace: {spans.message}", file=sys.stderr)
            return 1
    if a.list:
        print(wf.render_trace_list(wf.trace_summaries(spans)), end="")
        return 0
    chosen = wf.select_trace(spans, request_id=a.request_id, trace_id=a.trace_id)
    if isinstance(chosen, wf.TraceError):
        print(f"kvbridge trace: {chosen.message}", file=sys.stderr)
        return 1
    if chosen.note:
        print(f"kvbridge trace: {chosen.note}", file=sys.stderr)
    print(wf.render_waterfall(wf.build_waterfall(chosen.spans), width=a.width,
                              min_gap_ns=int(a.min_gap_ms * 1e6)), end="")
    return 0


def _trace_store_spans(a: argparse.Namespace) -> list[SpanRecord] | TraceError:
    """The spans of the wanted trace from a Jaeger API v3 trace store, or a TraceError. By request
    id: FindTraces (`GET /api/v3/traces`, the spans of --service carrying the id, started in the last
    --lookback seconds), then the whole trace by id (`GET /api/v3/traces/{id}`), which holds the other
    services' spans too."""
    import time

    import httpx

    from kvbridge.tracing import waterfall as wf
    base = a.endpoint.rstrip("/")
    try:
        with httpx.Client(timeout=a.timeout) as client:
            if a.trace_id is not None:
                return _store_answer(client.get(f"{base}/api/v3/traces/{a.trace_id.strip().lower()}"), base,
                                     f"no trace {a.trace_id}")
            now = time.time_ns()
            query = wf.jaeger_find_query(a.service, a.request_id, max(0, now - int(a.lookback * 1e9)),
                                         now + 60 * 10**9)
            found = _store_answer(client.get(f"{base}/api/v3/traces", params=query), base,
                                  f"no trace of service {a.service} with {wf.REQUEST_ID_ATTRIBUTE}={a.request_id} "
                                  f"in the last {a.lookback:g} s")
            if isinstance(found, wf.TraceError):
                return found
            chosen = wf.select_trace(found, request_id=a.request_id)  # a store that ignores attributes
            if isinstance(chosen, wf.TraceError):
                return wf.TraceError(f"{chosen.message} at {base}")
            whole = _store_answer(client.get(f"{base}/api/v3/traces/{chosen.trace_id}"), base, "")
            return chosen.spans if isinstance(whole, wf.TraceError) else whole
    except httpx.HTTPError as exc:
        return wf.TraceError(f"the trace store at {base} is unreachable: {type(exc).__name__}: {exc}")


def _store_answer(response: httpx.Response, base: str, not_found: str) -> list[SpanRecord] | TraceError:
    from kvbridge.tracing import waterfall as wf
    if response.status_code == 404:
        return wf.TraceError(f"{not_found} at {base}")
    if response.status_code != 200:
        return wf.TraceError(f"the trace store at {base} answered HTTP {response.status_code}: "
                             f"{response.text.strip()[:200]}")
    spans = wf.parse_otlp_json(response.text)
    if isinstance(spans, wf.TraceError):
        return wf.TraceError(f"the trace store at {base} answered no OTLP JSON: {spans.message}")
    return spans
