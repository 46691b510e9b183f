"""KV-transfer spans and histograms on P (issue 30): the kv.lease span of every way a lease ends,
the optional traceparent of kv_check_read (an old peer omits it, a malformed one is ignored) and
P's kv.check_read recorded under it, over a real side channel."""

from __future__ import annotations

import json

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from kvbridge.kv_transfer.side_channel.control import ControlClient, ControlServer, parse_check_read
from kvbridge.kv_transfer.side_channel.handshake import HandshakeError
from kvbridge.kv_transfer.lease import LeaseTable, content_digest
from kvbridge.kv_transfer.side_channel.server import SideChannelServer
from kvbridge.kv_transfer.stats import KVTransferStats
from kvbridge.tracing import RequestTrace, Tracing, format_traceparent, parse_traceparent

BLOCKS = ([3, 4, 5],)
PROMPT = content_digest(list(range(1, 34)))
OTHER_PROMPT = content_digest([*range(1, 33), 34])
D_SPAN = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def memory_tracing() -> tuple[Tracing, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return Tracing(provider, "kvbridge-prefill-test"), exporter


def traced_request(tracing: Tracing) -> RequestTrace:
    """A request's trace as the server hands it in: the parent is the request's span."""
    span = tracing.start_span("instance.request")
    span.end()
    return RequestTrace(tracing, span.get_span_context())


def spans(exporter: InMemorySpanExporter, name: str) -> list:
    return [s for s in exporter.get_finished_spans() if s.name == name]


def lease_held(stats: KVTransferStats) -> dict[str, float]:
    """kvbridge_kv_lease_held_seconds: count per outcome."""
    family = next(f for f in stats.collect() if f.name == "kvbridge_kv_lease_held_seconds")
    return {s.labels["outcome"]: s.value for s in family.samples if s.name.endswith("_count")}


@pytest.fixture
def traced_table():
    tracing, exporter = memory_tracing()
    clock = Clock()
    stats = KVTransferStats()
    table = LeaseTable(30.0, clock=clock, stats=stats, engine_id="prefill-0")
    trace = traced_request(tracing)
    table.grant("r1", BLOCKS, 7, PROMPT, trace=trace)
    return table, clock, exporter, trace, stats


# ---- kv.lease: failure paths first -------------------------------------------------------
def test_an_expired_lease_records_an_error_span_with_outcome_expired(traced_table) -> None:
    table, clock, exporter, trace, stats = traced_table
    clock.now += 31
    assert table.finished_sending() == {"r1"}
    [lease] = spans(exporter, "kv.lease")
    assert lease.attributes["kvbridge.outcome"] == "expired"
    assert lease.status.status_code is StatusCode.ERROR
    assert lease.parent.span_id == trace.parent.span_id and lease.context.trace_id == trace.parent.trace_id
    assert lease.attributes["kvbridge.lease_generation"] == 7 and lease.attributes["kvbridge.num_blocks"] == 3
    assert lease_held(stats) == {"expired": 1}


def test_a_content_mismatch_ends_the_lease_with_an_error_span(traced_table) -> None:
    table, _, exporter, _, stats = traced_table
    assert table.check_read("r1", 7, BLOCKS, OTHER_PROMPT) is not None
    [lease] = spans(exporter, "kv.lease")
    assert lease.attributes["kvbridge.outcome"] == "content_mismatch"
    assert lease.status.status_code is StatusCode.ERROR
    assert lease_held(stats) == {"content_mismatch": 1}


@pytest.mark.parametrize("end, outcome", [(lambda t: t.read_done("r1", 7), "read_done"),
                                          (lambda t: t.release("r1", 7), "release"),
                                          (lambda t: t.close(), "shutdown")])
def test_a_lease_ending_normally_records_its_outcome_once(traced_table, end, outcome) -> None:
    table, clock, exporter, _, stats = traced_table
    clock.now += 2.5
    end(table)
    assert not table.read_done("r1", 7) and not table.release("r1", 7)  # already ended: no second span
    table.close()
    [lease] = spans(exporter, "kv.lease")
    assert lease.attributes["kvbridge.outcome"] == outcome
    assert lease.status.status_code is StatusCode.UNSET
    assert lease.end_time >= lease.start_time
    assert lease_held(stats) == {outcome: 1}


def test_an_untraced_lease_records_no_span_but_is_counted() -> None:
    tracing, exporter = memory_tracing()
    stats = KVTransferStats()
    table = LeaseTable(30.0, stats=stats)
    table.grant("r1", BLOCKS, 7, PROMPT)
    assert table.check_read("r1", 7, BLOCKS, PROMPT, parent=parse_traceparent(D_SPAN)) is None
    table.read_done("r1", 7)
    assert exporter.get_finished_spans() == () and lease_held(stats) == {"read_done": 1}


# ---- kv_check_read's traceparent ----------------------------------------------------------
def _body(**extra) -> bytes:
    return json.dumps({"rid": "r1", "gen": 7, "blocks": [list(g) for g in BLOCKS], "content": PROMPT,
                       **extra}).encode()


@pytest.mark.parametrize("value", ["garbage", "", 17, None, ["00"], "01-4bf92f3577b34da6a3ce929d0e0e4736-"
                                                                  "00f067aa0ba902b7-01"])
def test_a_malformed_traceparent_is_ignored_not_refused(value) -> None:
    msg = parse_check_read(_body(traceparent=value))
    assert msg.parent is None and msg.key.request_id == "r1"


def test_an_old_peer_omits_the_traceparent_and_a_valid_one_is_parsed() -> None:
    assert parse_check_read(_body()).parent is None
    parent = parse_check_read(_body(traceparent=D_SPAN)).parent
    assert format_traceparent(parent) == D_SPAN


@pytest.fixture
def served(traced_table):
    table, clock, exporter, trace, stats = traced_table
    with SideChannelServer({0: b"{}"}, "127.0.0.1") as server:
        ControlServer(server, table)
        sent: list[dict] = []
        client = ControlClient(timeout_s=2.0)
        send = client._client.request

        def request(host, port, msg_type, body, timeout):
            sent.append(json.loads(body))
            return send(host, port, msg_type, body, timeout)
        client._client.request = request
        yield client, server.port, table, exporter, sent


def test_a_refused_check_read_is_recorded_under_ds_span_with_the_refusal(served) -> None:
    client, port, table, exporter, sent = served
    with pytest.raises(HandshakeError):
        client.check_read("127.0.0.1", port, "r1", 6, BLOCKS, PROMPT, traceparent=D_SPAN)  # stale generation
    [check] = spans(exporter, "kv.check_read")
    assert check.status.status_code is StatusCode.ERROR and check.attributes["kvbridge.outcome"] == "stale"
    d_span = parse_traceparent(D_SPAN)
    assert check.context.trace_id == d_span.trace_id and check.parent.span_id == d_span.span_id


def test_a_granted_check_read_is_recorded_under_ds_span_and_without_one_nothing_is_sent(served) -> None:
    client, port, table, exporter, sent = served
    client.check_read("127.0.0.1", port, "r1", 7, BLOCKS, PROMPT)  # D does not trace this request
    assert "traceparent" not in sent[-1] and spans(exporter, "kv.check_read") == []
    client.check_read("127.0.0.1", port, "r1", 7, BLOCKS, PROMPT, traceparent=D_SPAN)
    assert sent[-1]["traceparent"] == D_SPAN
    [check] = spans(exporter, "kv.check_read")
    assert check.attributes["kvbridge.outcome"] == "granted" and check.status.status_code is StatusCode.UNSET
    assert check.parent.span_id == parse_traceparent(D_SPAN).span_id
    client.read_done("127.0.0.1", port, "r1", 7)
    [lease] = spans(exporter, "kv.lease")
    assert lease.attributes["kvbridge.outcome"] == "read_done"


def test_the_kv_histograms_are_exported_with_their_buckets() -> None:
    stats = KVTransferStats()
    stats.record_load(0.004, "ok", 3 << 20)
    stats.record_load(0.5, "transfer_state")
    stats.record_handshake_wait(0.002, "ok")
    stats.record_lease(1.5, "read_done")
    families = {f.name: f for f in stats.collect()}
    for name in ("kvbridge_kv_load_seconds", "kvbridge_kv_read_bytes", "kvbridge_kv_handshake_seconds",
                 "kvbridge_kv_lease_held_seconds"):
        assert families[name].type == "histogram", name
    load = {(s.labels["outcome"], s.name): s.value for s in families["kvbridge_kv_load_seconds"].samples}
    assert load[("ok", "kvbridge_kv_load_seconds_count")] == 1
    assert load[("transfer_state", "kvbridge_kv_load_seconds_count")] == 1
    read_bytes = {s.name: s.value for s in families["kvbridge_kv_read_bytes"].samples if "le" not in s.labels}
    assert read_bytes == {"kvbridge_kv_read_bytes_count": 1, "kvbridge_kv_read_bytes_sum": 3 << 20}
