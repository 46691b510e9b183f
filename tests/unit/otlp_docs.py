"""OTLP JSON documents built as the collector's file exporter writes them (hex ids, int64 as
strings, enums as integers): the inputs of `kvbridge trace`'s tests."""

from __future__ import annotations

import json


T1 = "4bf92f3577b34da6a3ce929d0e0e4736"
T2 = "0af7651916cd43dd8448eb211c80319c"
MS = 1_000_000
BASE = 1_700_000_000_000_000_000


def otlp_span(name: str, span_id: str, start_ms: float, end_ms: float, *, trace_id: str = T1, parent: str = "",
              kind: int | str = 1, attributes: dict | None = None, error: str | None = None,
              events: list | None = None) -> dict:
    span = {"traceId": trace_id, "spanId": span_id, "name": name, "kind": kind,
            "startTimeUnixNano": str(BASE + int(start_ms * MS)), "endTimeUnixNano": str(BASE + int(end_ms * MS))}
    if parent:
        span["parentSpanId"] = parent
    if attributes:
        span["attributes"] = [{"key": k, "value": _value(v)} for k, v in attributes.items()]
    if error is not None:
        span["status"] = {"code": 2, "message": error}
    if events:
        span["events"] = events
    return span


def _value(v) -> dict:
    if isinstance(v, bool):
        return {"boolValue": v}
    if isinstance(v, int):
        return {"intValue": str(v)}
    if isinstance(v, float):
        return {"doubleValue": v}
    if isinstance(v, list):
        return {"arrayValue": {"values": [_value(x) for x in v]}}
    return {"stringValue": v}


def doc(service: str, *spans: dict) -> dict:
    return {"resourceSpans": [{
        "resource": {"attributes": [{"key": "service.name", "value": {"stringValue": service}}]},
        "scopeSpans": [{"scope": {"name": "kvbridge"}, "spans": list(spans)}]}]}


def jsonl(*docs: dict) -> str:
    return "\n".join(json.dumps(d) for d in docs) + "\n"


def pd_trace(trace_id: str = T1, request_id: str = "cmpl-1", shift_ms: float = 0.0) -> str:
    """A proxy -> prefill trace in two export lines, as two processes' exporters write it."""
    s = shift_ms
    proxy = doc("kvbridge-proxy",
                otlp_span("proxy.request", "a000000000000001", s + 0, s + 100, trace_id=trace_id, kind=2,
                          attributes={"kvbridge.request_id": request_id, "http.route": "/v1/completions"}),
                otlp_span("proxy.read_body", "a000000000000002", s + 0, s + 2, trace_id=trace_id,
                          parent="a000000000000001"),
                otlp_span("proxy.attempt", "a000000000000003", s + 5, s + 60, trace_id=trace_id,
                          parent="a000000000000001", kind=3,
                          attributes={"kvbridge.role": "prefill", "kvbridge.attempt": 1, "url.full": "http://p"}),
                otlp_span("proxy.relay", "a000000000000004", s + 60, s + 100, trace_id=trace_id,
                          parent="a000000000000001"))
    prefill = doc("kvbridge-prefill-8100",
                  otlp_span("instance.request", "b000000000000001", s + 6, s + 58, trace_id=trace_id, kind=2,
                            parent="a000000000000003", attributes={"kvbridge.request_id": request_id + "-p"}),
                  otlp_span("engine.prefill", "b000000000000002", s + 10, s + 50, trace_id=trace_id,
                            parent="b000000000000001", attributes={"kvbridge.num_tokens": 12}))
    return jsonl(proxy, prefill)
