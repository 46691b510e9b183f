"""The test OTLP receiver against the real OpenTelemetry SDK exporters kvbridge builds (issue 30):
OTLP/HTTP (plain and gzip) and OTLP/gRPC into `tests/otlp_receiver.py`, its OTLP JSON file read by
`kvbridge trace FILE`, and its Jaeger API v3 read by `kvbridge trace --endpoint`."""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest
from opentelemetry.trace import SpanKind

from kvbridge.cli import main
from kvbridge.tracing import Tracing, TracingConfig, build_tracing
from kvbridge.tracing.waterfall import jaeger_find_query, parse_otlp_json, rfc3339_nano
from tests.otlp_receiver import OtlpReceiver, ReceivedSpan

MS = 1_000_000
WAIT_S = 30


@pytest.fixture
def receiver():
    with OtlpReceiver(grpc=True) as r:
        yield r


def tracing_to(endpoint: str, service: str) -> Tracing:
    tracing = build_tracing(TracingConfig(endpoint, service))
    assert tracing is not None
    return tracing


def record_request(tracing: Tracing, request_id: str, t0: int) -> None:
    """A root with two children, one failed with an event: every field the receiver stores."""
    root = tracing.record("proxy.request", None, t0, t0 + 10 * MS, kind=SpanKind.SERVER,
                          attributes={"kvbridge.request_id": request_id, "http.route": "/v1/completions"})
    tracing.record("proxy.route", root, t0 + MS, t0 + 2 * MS, attributes={"kvbridge.role": "prefill"})
    tracing.record("proxy.attempt", root, t0 + 3 * MS, t0 + 9 * MS, kind=SpanKind.CLIENT,
                   attributes={"kvbridge.attempt": 1, "kvbridge.num_blocks": [1, 2]}, error="connect refused",
                   events=[("retry", t0 + 4 * MS, {"kvbridge.attempt": 2})])


def names(spans: list[ReceivedSpan]) -> set[str]:
    return {s.name for s in spans}


def check_request(spans: list[ReceivedSpan], request_id: str, service: str, t0: int) -> None:
    mine = [s for s in spans if s.start_ns >= t0 and s.service == service]
    by_name = {s.name: s for s in mine}
    root, route, attempt = by_name["proxy.request"], by_name["proxy.route"], by_name["proxy.attempt"]
    assert root.parent_span_id is None and root.kind == "SERVER" and re.fullmatch(r"[0-9a-f]{32}", root.trace_id)
    assert root.attributes == {"kvbridge.request_id": request_id, "http.route": "/v1/completions"}
    assert route.parent_span_id == root.span_id and attempt.parent_span_id == root.span_id
    assert {route.trace_id, attempt.trace_id} == {root.trace_id}
    assert (root.start_ns, root.end_ns) == (t0, t0 + 10 * MS)
    assert attempt.kind == "CLIENT" and attempt.status_code == "ERROR" and attempt.status_message == "connect refused"
    assert attempt.attributes == {"kvbridge.attempt": 1, "kvbridge.num_blocks": [1, 2]}
    assert attempt.events == (("retry", t0 + 4 * MS, {"kvbridge.attempt": 2}),)
    assert route.status_code == "UNSET"


def test_http_protobuf_export_arrives_whole(receiver):
    t0 = time.time_ns()
    tracing = tracing_to(receiver.endpoint, "svc-http")
    record_request(tracing, "r-http", t0)
    tracing.shutdown()  # flushes the batch
    spans = receiver.wait_for(lambda s: {"proxy.request", "proxy.route", "proxy.attempt"} <= names(s), WAIT_S)
    check_request(spans, "r-http", "svc-http", t0)
    assert receiver.content_encodings() == ["identity"] and receiver.refused() == []


def test_wait_for_waits_for_the_exporter_thread(receiver, monkeypatch):
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # the batch leaves on its own, no shutdown
    tracing = tracing_to(receiver.endpoint, "svc-late")
    try:
        tracing.record("late", None, time.time_ns(), time.time_ns())
        spans = receiver.wait_for(lambda s: "late" in names(s), WAIT_S)
        assert [s.service for s in spans if s.name == "late"] == ["svc-late"]
    finally:
        tracing.shutdown()


def test_gzip_bodies_are_decoded(receiver, monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_COMPRESSION", "gzip")
    t0 = time.time_ns()
    tracing = tracing_to(receiver.endpoint, "svc-gzip")
    record_request(tracing, "r-gzip", t0)
    tracing.shutdown()
    spans = receiver.wait_for(lambda s: len(s) >= 3, WAIT_S)
    check_request(spans, "r-gzip", "svc-gzip", t0)
    assert receiver.content_encodings() == ["gzip"]


def test_grpc_export_arrives_whole(receiver, monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
    t0 = time.time_ns()
    tracing = tracing_to(receiver.grpc_endpoint, "svc-grpc")
    record_request(tracing, "r-grpc", t0)
    tracing.shutdown()
    spans = receiver.wait_for(lambda s: len(s) >= 3, WAIT_S)
    check_request(spans, "r-grpc", "svc-grpc", t0)
    assert receiver.content_encodings() == []  # nothing came over HTTP


def test_wait_for_gives_up_at_its_timeout_saying_what_it_holds(receiver):
    with pytest.raises(TimeoutError, match="holds 0 spans"):
        receiver.wait_for(lambda s: bool(s), timeout=0.2)


def test_refuses_what_is_not_otlp_protobuf(receiver):
    json_body = httpx.post(receiver.endpoint, content=b"{}", headers={"Content-Type": "application/json"}, timeout=10)
    garbage = httpx.post(receiver.endpoint, content=b"\xff\xff\xff", timeout=10,
                         headers={"Content-Type": "application/x-protobuf"})
    bad_gzip = httpx.post(receiver.endpoint, content=b"not gzip", timeout=10,
                          headers={"Content-Type": "application/x-protobuf", "Content-Encoding": "gzip"})
    wrong_path = httpx.post(receiver.query_url + "/v1/logs", content=b"", timeout=10,
                            headers={"Content-Type": "application/x-protobuf"})
    assert [r.status_code for r in (json_body, garbage, bad_gzip, wrong_path)] == [415, 400, 400, 404]
    assert len(receiver.refused()) == 4 and receiver.spans() == []


def test_otlp_json_file_is_the_collectors_format_and_kvbridge_trace_reads_it(receiver, tmp_path, capsys):
    t0 = time.time_ns()
    proxy, instance = tracing_to(receiver.endpoint, "kvbridge-proxy"), tracing_to(receiver.endpoint, "kvbridge-decode-1")
    record_request(proxy, "r-1", t0)
    record_request(proxy, "r-2", t0 + 20 * MS)
    proxy.shutdown()
    spans = receiver.wait_for(lambda s: len(s) >= 6, WAIT_S)
    attempt = next(s for s in spans if s.name == "proxy.attempt" and s.start_ns > t0 + 20 * MS)
    from kvbridge.tracing import parse_traceparent
    parent = parse_traceparent(f"00-{attempt.trace_id}-{attempt.span_id}-01")
    instance.record("instance.request", parent, t0 + 24 * MS, t0 + 28 * MS, kind=SpanKind.SERVER)
    instance.shutdown()
    receiver.wait_for(lambda s: "instance.request" in names(s), WAIT_S)

    path = tmp_path / "traces.jsonl"
    assert receiver.write_otlp_json(path) >= 2
    lines = path.read_text().splitlines()
    for line in lines:
        document = json.loads(line)
        span = document["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
        assert re.fullmatch(r"[0-9a-f]{32}", span["traceId"]) and re.fullmatch(r"[0-9a-f]{16}", span["spanId"])
        assert isinstance(span["kind"], int) and isinstance(span["startTimeUnixNano"], str)
    parsed = parse_otlp_json(path.read_text())
    assert {(s.trace_id, s.span_id) for s in parsed} == {(s.trace_id, s.span_id) for s in receiver.spans()}

    assert main(["trace", str(path), "--request-id", "r-2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"trace {attempt.trace_id}: 4 spans, 2 services")
    rows = [line for line in out.splitlines() if "~ gap" not in line]
    row = next(line for line in rows if "instance.request" in line)
    assert "kvbridge-decode-1" in row and row.split("|")[0].split() == ["4.000", "4.000"]  # offset, duration
    attempt_row = next(line for line in rows if "proxy.attempt" in line)
    assert "ERROR(connect refused)" in attempt_row
    assert row.index("instance.request") > attempt_row.index("proxy.attempt")  # nested under the attempt


def test_jaeger_api_v3_finds_by_service_and_request_id(receiver):
    t0 = time.time_ns()
    proxy = tracing_to(receiver.endpoint, "kvbridge-proxy")
    record_request(proxy, "r-a", t0)
    record_request(proxy, "r-b", t0 + 20 * MS)
    proxy.shutdown()
    spans = receiver.wait_for(lambda s: len(s) >= 6, WAIT_S)
    wanted = next(s.trace_id for s in spans if s.attributes.get("kvbridge.request_id") == "r-b")
    find = receiver.query_url + "/api/v3/traces"
    window = (t0 - 10**9, t0 + 60 * 10**9)

    found = httpx.get(find, params=jaeger_find_query("kvbridge-proxy", "r-b", *window), timeout=10)
    assert found.status_code == 200
    found_spans = parse_otlp_json(found.text)
    assert {s.trace_id for s in found_spans} == {wanted} and len(found_spans) == 3
    # camelCase names (Jaeger v2.19+) mean the same
    camel = httpx.get(find, timeout=10, params={"query.serviceName": "kvbridge-proxy",
                                                "query.attributes": json.dumps({"kvbridge.request_id": "r-b"}),
                                                "query.startTimeMin": rfc3339_nano(window[0]),
                                                "query.startTimeMax": rfc3339_nano(window[1])})
    assert camel.json() == found.json()
    for params in (jaeger_find_query("kvbridge-proxy", "r-zzz", *window),
                   jaeger_find_query("other-service", "r-b", *window),
                   jaeger_find_query("kvbridge-proxy", "r-b", t0 + 60 * 10**9, t0 + 120 * 10**9)):
        missing = httpx.get(find, params=params, timeout=10)
        assert missing.status_code == 404 and missing.json() == {"error": {"httpCode": 404,
                                                                           "message": "No traces found"}}
    no_window = httpx.get(find, params={"query.service_name": "kvbridge-proxy"}, timeout=10)
    assert no_window.status_code == 400 and "required" in no_window.json()["error"]["message"]
    one = httpx.get(f"{receiver.query_url}/api/v3/traces/{wanted}", timeout=10)
    assert one.status_code == 200 and {s.trace_id for s in parse_otlp_json(one.text)} == {wanted}
    assert httpx.get(f"{receiver.query_url}/api/v3/traces/{'0' * 31}1", timeout=10).status_code == 404


def test_kvbridge_trace_endpoint_reads_jaeger_api_v3(receiver, capsys):
    t0 = time.time_ns()
    proxy = tracing_to(receiver.endpoint, "kvbridge-proxy")
    record_request(proxy, "r-x", t0)
    record_request(proxy, "r-y", t0 + 20 * MS)
    proxy.shutdown()
    spans = receiver.wait_for(lambda s: len(s) >= 6, WAIT_S)
    wanted = next(s.trace_id for s in spans if s.attributes.get("kvbridge.request_id") == "r-x")

    assert main(["trace", "--endpoint", receiver.query_url, "--request-id", "r-x"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"trace {wanted}: 3 spans") and "proxy.attempt" in out
    assert main(["trace", "--endpoint", receiver.query_url + "/", "--trace-id", wanted.upper()]) == 0
    assert capsys.readouterr().out == out

    assert main(["trace", "--endpoint", receiver.query_url, "--request-id", "r-none"]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "r-none" in err
    assert main(["trace", "--endpoint", receiver.query_url, "--request-id", "r-x", "--service", "other"]) == 1
    capsys.readouterr()
    assert main(["trace", "--endpoint", receiver.query_url]) == 2


def test_kvbridge_trace_endpoint_unreachable_is_one_line_and_exit_1(capsys):
    with OtlpReceiver() as gone:
        url = gone.query_url
    assert main(["trace", "--endpoint", url, "--request-id", "r", "--timeout", "5"]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "unreachable" in err and url in err
