"""The tracing core (issue 30): traceparent parsing, off by default, parent-based sampling."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

from kvbridge.cli import parse_args, tracing_config_from_args
from kvbridge.tracing import (RequestTrace, Tracing, TracingConfig, TracingConfigError, build_tracing,
                              format_traceparent, parse_traceparent)

TP = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def memory_tracing(ratio: float = 1.0) -> tuple[Tracing, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=ParentBased(root=TraceIdRatioBased(ratio)))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return Tracing(provider, "test"), exporter


def test_traceparent_round_trip():
    ctx = parse_traceparent(TP)
    assert ctx is not None and ctx.is_remote and ctx.trace_flags.sampled
    assert ctx.trace_id == 0x4bf92f3577b34da6a3ce929d0e0e4736 and ctx.span_id == 0x00f067aa0ba902b7
    assert format_traceparent(ctx) == TP


@pytest.mark.parametrize("bad", [None, "", "garbage", "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                                 "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
                                 "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
                                 "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
                                 "00-zzf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"])
def test_bad_traceparent_is_ignored(bad):
    assert parse_traceparent(bad) is None


def test_off_without_endpoint():
    assert build_tracing(None) is None
    assert build_tracing(TracingConfig(None, "kvbridge-proxy")) is None


@pytest.mark.parametrize("endpoint,ratio,name", [("localhost:4318", 1.0, "x"), ("http://h:4318/v1/traces", 1.5, "x"),
                                                  ("http://h:4318/v1/traces", -0.1, "x"),
                                                  ("http://h:4318/v1/traces", 1.0, "")])
def test_bad_config_refused(endpoint, ratio, name):
    with pytest.raises(TracingConfigError):
        TracingConfig(endpoint, name, ratio)


def test_record_joins_the_remote_parent_and_marks_errors():
    tracing, exporter = memory_tracing()
    parent = parse_traceparent(TP)
    child = tracing.record("kv.read", parent, 1_000, 3_000, attributes={"bytes": 10}, error="timeout",
                           events=[("retry", 2_000, {"attempt": 1})])
    [span] = exporter.get_finished_spans()
    assert span.context.trace_id == parent.trace_id and span.parent.span_id == parent.span_id
    assert (span.start_time, span.end_time) == (1_000, 3_000)
    assert span.status.status_code.name == "ERROR" and span.status.description == "timeout"
    assert span.events[0].name == "retry" and span.events[0].timestamp == 2_000
    assert child.span_id == span.context.span_id
    trace = RequestTrace(tracing, child)
    trace.record("inner", 1_500, 1_000)  # an end before the start is clamped, never negative
    inner = exporter.get_finished_spans()[-1]
    assert inner.parent.span_id == child.span_id and inner.end_time == inner.start_time
    assert trace.traceparent == format_traceparent(child)


def test_sampling_follows_the_incoming_flag_then_the_ratio():
    tracing, exporter = memory_tracing(ratio=0.0)
    unsampled = parse_traceparent(TP[:-2] + "00")
    tracing.record("a", unsampled, 1, 2)
    tracing.record("b", None, 1, 2)  # a new trace at ratio 0: not sampled
    assert exporter.get_finished_spans() == ()
    tracing.record("c", parse_traceparent(TP), 1, 2)  # a sampled parent wins over the ratio
    assert [s.name for s in exporter.get_finished_spans()] == ["c"]


def test_cli_options():
    a = parse_args(["serve", "--kv-role", "producer", "--port", "8100",
                    "--otlp-traces-endpoint", "http://127.0.0.1:4318/v1/traces"])
    from kvbridge.cli import serve_service_name
    config = tracing_config_from_args(a, serve_service_name(a))
    assert config == TracingConfig("http://127.0.0.1:4318/v1/traces", "kvbridge-prefill-8100", 1.0)
    assert tracing_config_from_args(parse_args(["serve"]), "x") is None
    p = parse_args(["proxy", "--decode", "http://d", "--otlp-traces-endpoint", "http://c/v1/traces",
                    "--otlp-traces-sample-ratio", "0.25"])
    assert tracing_config_from_args(p, "kvbridge-proxy") == TracingConfig("http://c/v1/traces", "kvbridge-proxy", 0.25)


def test_the_exporter_thread_exists_only_with_an_endpoint():
    import threading
    before = set(threading.enumerate())
    assert build_tracing(TracingConfig(None, "kvbridge-proxy")) is None
    assert set(threading.enumerate()) == before  # tracing off: no exporter thread
    tracing = build_tracing(TracingConfig("http://127.0.0.1:9/v1/traces", "kvbridge-proxy"))
    try:
        started = set(threading.enumerate()) - before
        assert len(started) == 1  # the batch processor's one exporter thread
    finally:
        tracing.shutdown()  # nothing queued: returns without reaching the (closed) port
    assert not any(t.is_alive() for t in started)
