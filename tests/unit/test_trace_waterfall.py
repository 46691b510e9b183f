"""`kvbridge trace`'s pure half (issue 30): OTLP JSON in, one request's waterfall out.

Documents are built here as the collector's file exporter writes them (hex ids, int64 as strings,
enums as integers) and as protobuf's JSON mapping may (enum names, base64 ids)."""

from __future__ import annotations

import base64
import json

import pytest

from kvbridge.tracing.waterfall import (REQUEST_ID_ATTRIBUTE, SpanRecord, TraceError, build_waterfall,
                                        jaeger_find_query, merge_intervals, parse_otlp_json, render_trace_list,
                                        render_waterfall, rfc3339_nano, select_trace, trace_summaries, uncovered)
from tests.unit.otlp_docs import BASE, MS, T1, T2, doc, jsonl, otlp_span, pd_trace

def spans_of(text: str) -> list[SpanRecord]:
    parsed = parse_otlp_json(text)
    assert not isinstance(parsed, TraceError), parsed
    return parsed


# ---- parsing ---------------------------------------------------------------------------------------------

def test_parse_reads_every_span_of_every_line_with_its_service():
    spans = spans_of(pd_trace())
    assert len(spans) == 6
    by_name = {s.name: s for s in spans}
    assert by_name["proxy.request"].service == "kvbridge-proxy"
    assert by_name["engine.prefill"].service == "kvbridge-prefill-8100"
    assert by_name["proxy.request"].kind == "SERVER" and by_name["proxy.attempt"].kind == "CLIENT"
    assert by_name["proxy.request"].parent_span_id is None
    assert by_name["engine.prefill"].parent_span_id == "b000000000000001"
    assert by_name["proxy.attempt"].attributes == {"kvbridge.role": "prefill", "kvbridge.attempt": 1,
                                                    "url.full": "http://p"}
    assert by_name["proxy.request"].start_ns == BASE and by_name["proxy.request"].end_ns == BASE + 100 * MS


def test_parse_accepts_one_document_pretty_printed_and_jaegers_result_wrapper():
    one = doc("svc", otlp_span("a", "0000000000000001", 0, 1))
    assert [s.name for s in spans_of(json.dumps(one, indent=2))] == ["a"]
    assert [s.name for s in spans_of(json.dumps({"result": one}))] == ["a"]


def test_parse_accepts_protobuf_json_mapping_names_and_base64_ids():
    span = otlp_span("a", "", 0, 1, kind="SPAN_KIND_SERVER")
    span["traceId"] = base64.b64encode(bytes.fromhex(T1)).decode()
    span["spanId"] = base64.b64encode(bytes.fromhex("00f067aa0ba902b7")).decode()
    span["parentSpanId"] = base64.b64encode(bytes.fromhex("00000000000000aa")).decode()
    span["status"] = {"code": "STATUS_CODE_ERROR", "message": "boom"}
    span["startTimeUnixNano"] = BASE  # an integer, not a string
    [s] = spans_of(json.dumps(doc("svc", span)))
    assert (s.trace_id, s.span_id, s.parent_span_id) == (T1, "00f067aa0ba902b7", "00000000000000aa")
    assert s.kind == "SERVER" and s.error == "boom" and s.start_ns == BASE


def test_parse_reads_values_of_every_type_and_events():
    span = otlp_span("a", "0000000000000001", 0, 1,
                     attributes={"s": "x", "i": 3, "f": 0.5, "b": True, "arr": [1, 2]},
                     events=[{"timeUnixNano": str(BASE + MS), "name": "retry",
                              "attributes": [{"key": "n", "value": {"intValue": "2"}}]}])
    [s] = spans_of(json.dumps(doc("svc", span)))
    assert s.attributes == {"s": "x", "i": 3, "f": 0.5, "b": True, "arr": [1, 2]}
    assert [(e.name, e.time_ns, e.attributes) for e in s.events] == [("retry", BASE + MS, {"n": 2})]


def test_parse_marks_error_status_and_only_error():
    ok = otlp_span("ok", "0000000000000001", 0, 1)
    ok["status"] = {"code": 1}
    bad = otlp_span("bad", "0000000000000002", 0, 1, error="timeout")
    spans = {s.name: s for s in spans_of(json.dumps(doc("svc", ok, bad)))}
    assert spans["ok"].error is None and spans["bad"].error == "timeout"
    unnamed = otlp_span("bad2", "0000000000000003", 0, 1)
    unnamed["status"] = {"code": 2}
    [s] = spans_of(json.dumps(doc("svc", unnamed)))
    assert s.error == ""  # ERROR without a message: still an error


def test_parse_drops_a_span_exported_twice():
    d = doc("svc", otlp_span("a", "0000000000000001", 0, 1))
    assert len(spans_of(jsonl(d, d))) == 1


@pytest.mark.parametrize("text,why", [
    ("", "no spans"),
    ("not json at all", "line 1"),
    ('{"resourceSpans": [{"scopeSpans": [{"spans": [{"name": "a"}]}]}]}', "traceId"),
    ('{"hello": 1}', "resourceSpans"),
    ('[1, 2]', "resourceSpans"),
    ('{"resourceSpans": []}\n{broken', "line 2"),
    (json.dumps(doc("svc", otlp_span("a", "zz", 0, 1))), "spanId"),
    (json.dumps(doc("svc", {**otlp_span("a", "0000000000000001", 0, 1), "startTimeUnixNano": "soon"})),
     "startTimeUnixNano"),
])
def test_parse_refuses_what_is_not_otlp_json_with_a_reason(text, why):
    parsed = parse_otlp_json(text)
    assert isinstance(parsed, TraceError) and why in parsed.message, parsed


def test_parse_reads_protobufs_string_forms_of_numbers():
    span = otlp_span("a", "0000000000000001", 0, 1, attributes={"i": 3})
    span["attributes"] += [{"key": "f", "value": {"doubleValue": "2.5"}},
                           {"key": "n", "value": {"doubleValue": "NaN"}},
                           {"key": "big", "value": {"doubleValue": "-Infinity"}}]
    span["startTimeUnixNano"] = float(BASE)  # an integral JSON number (1.7e+18)
    [s] = spans_of(json.dumps(doc("svc", span)))
    assert s.attributes["i"] == 3 and s.attributes["f"] == 2.5 and s.attributes["big"] == float("-inf")
    assert s.attributes["n"] != s.attributes["n"] and s.start_ns == BASE


@pytest.mark.parametrize("value,why", [
    ({"doubleValue": "abc"}, "doubleValue"),
    ({"doubleValue": True}, "doubleValue"),
    ({"arrayValue": [1, 2]}, "arrayValue"),
    ({"arrayValue": {"values": {}}}, "arrayValue"),
    ({"kvlistValue": ["a"]}, "kvlistValue"),
    ({"stringValue": 5}, "stringValue"),
    ({"boolValue": "true"}, "boolValue"),
    ({"intValue": 1.5}, "intValue"),
    ("plain", "attribute value"),
])
def test_parse_refuses_an_attribute_value_of_the_wrong_type(value, why):
    span = otlp_span("a", "0000000000000001", 0, 1)
    span["attributes"] = [{"key": "k", "value": value}]
    parsed = parse_otlp_json(json.dumps(doc("svc", span)))
    assert isinstance(parsed, TraceError) and why in parsed.message, parsed


@pytest.mark.parametrize("time", ["-1", str(2 ** 64), 1.5, "1e400", "NaN", [1]])
def test_parse_refuses_a_time_outside_uint64_nanoseconds(time):
    span = {**otlp_span("a", "0000000000000001", 0, 1), "startTimeUnixNano": time}
    parsed = parse_otlp_json(json.dumps(doc("svc", span)))
    assert isinstance(parsed, TraceError) and "startTimeUnixNano" in parsed.message, parsed


@pytest.mark.parametrize("text,why", [
    ("[" * 100_000 + "]" * 100_000, "deeper"),
    ("[" * 150 + "]" * 150, "deeper"),
    ('{"resourceSpans": [], "x": NaN}', "NaN"),
    ('{"resourceSpans": [], "x": 1e400}', "1e400"),
])
def test_parse_refuses_deep_nesting_and_numbers_json_does_not_have(text, why):
    parsed = parse_otlp_json(text)
    assert isinstance(parsed, TraceError) and why in parsed.message, parsed


def test_a_pretty_printed_document_that_is_not_json_names_the_documents_error():
    text = json.dumps(doc("svc", otlp_span("a", "0000000000000001", 0, 1)), indent=2)[:-3]
    parsed = parse_otlp_json(text)
    assert isinstance(parsed, TraceError) and not parsed.message.startswith("line 1:"), parsed


def test_a_huge_id_is_shown_shortened_in_the_error():
    parsed = parse_otlp_json(json.dumps(doc("svc", otlp_span("a", "z" * 100_000, 0, 1))))
    assert isinstance(parsed, TraceError) and "spanId" in parsed.message and len(parsed.message) < 200


# ---- finding the trace -----------------------------------------------------------------------------------

def test_select_by_request_id_on_any_span_of_any_service():
    spans = spans_of(pd_trace(T1, "cmpl-1") + pd_trace(T2, "cmpl-2", shift_ms=500))
    chosen = select_trace(spans, request_id="cmpl-2")
    assert not isinstance(chosen, TraceError)
    assert chosen.trace_id == T2 and len(chosen.spans) == 6 and {s.trace_id for s in chosen.spans} == {T2}
    assert select_trace(spans, request_id="cmpl-1-p").trace_id == T1  # the prefill instance's own id


def test_select_by_trace_id_and_the_most_recent_by_default():
    spans = spans_of(pd_trace(T1, "cmpl-1", shift_ms=500) + pd_trace(T2, "cmpl-2"))
    assert select_trace(spans, trace_id=T2.upper()).trace_id == T2
    latest = select_trace(spans)
    assert latest.trace_id == T1 and "2 traces" in latest.note


@pytest.mark.parametrize("kwargs,why", [({"request_id": "nope"}, "nope"), ({"trace_id": T2}, T2),
                                        ({"trace_id": "xyz"}, "32 hex")])
def test_select_says_what_is_missing(kwargs, why):
    chosen = select_trace(spans_of(pd_trace()), **kwargs)
    assert isinstance(chosen, TraceError) and why in chosen.message


def test_select_one_request_id_in_two_traces_takes_the_latest_and_says_so():
    spans = spans_of(pd_trace(T1, "cmpl-1") + pd_trace(T2, "cmpl-1", shift_ms=500))
    chosen = select_trace(spans, request_id="cmpl-1")
    assert chosen.trace_id == T2 and T1 in chosen.note


def test_trace_summaries_in_clock_order_with_root_and_request_ids():
    spans = spans_of(pd_trace(T1, "cmpl-1", shift_ms=500) + pd_trace(T2, "cmpl-2"))
    [first, second] = trace_summaries(spans)
    assert (first.trace_id, second.trace_id) == (T2, T1)
    assert first.root_name == "proxy.request" and first.num_spans == 6 and first.duration_ns == 100 * MS
    assert first.services == ("kvbridge-prefill-8100", "kvbridge-proxy")
    assert first.request_ids == ("cmpl-2", "cmpl-2-p")
    listing = render_trace_list([first, second])
    assert T1 in listing and T2 in listing and "cmpl-2" in listing
    assert listing.index(T2) < listing.index(T1)


# ---- intervals -------------------------------------------------------------------------------------------

def test_merge_intervals_joins_overlapping_and_touching_ones():
    assert merge_intervals([(5, 7), (0, 2), (1, 3), (3, 4), (10, 10)]) == [(0, 4), (5, 7)]
    assert merge_intervals([]) == []


def test_uncovered_is_the_parent_minus_its_children_clipped_to_it():
    assert uncovered(0, 10, []) == [(0, 10)]
    assert uncovered(0, 10, [(2, 4), (3, 6), (8, 12)]) == [(0, 2), (6, 8)]
    assert uncovered(0, 10, [(-5, 20)]) == []
    assert uncovered(0, 10, [(20, 30)]) == [(0, 10)]  # a child wholly outside its parent covers nothing


# ---- the waterfall ---------------------------------------------------------------------------------------

def test_children_nest_under_their_parents_across_services_in_clock_order():
    w = build_waterfall(spans_of(pd_trace()))
    names = [(r.depth, r.span.name) for r in w.span_rows]
    assert names == [(0, "proxy.request"), (1, "proxy.read_body"), (1, "proxy.attempt"), (2, "instance.request"),
                     (3, "engine.prefill"), (1, "proxy.relay")]
    assert w.root is not None and w.root.name == "proxy.request"
    assert w.start_ns == BASE and w.end_ns == BASE + 100 * MS
    assert [r.offset_ns for r in w.span_rows][:3] == [0, 0, 5 * MS]


def test_clock_order_ignores_the_order_spans_arrive_in():
    a = otlp_span("root", "0000000000000001", 0, 10)
    kids = [otlp_span(n, f"000000000000001{i}", t, t + 1, parent="0000000000000001")
            for i, (n, t) in enumerate([("c", 7), ("a", 1), ("b", 4)])]
    w = build_waterfall(spans_of(jsonl(doc("svc", kids[0]), doc("svc", *kids[1:]), doc("svc", a))))
    assert [r.span.name for r in w.span_rows] == ["root", "a", "b", "c"]


def test_unknown_parents_make_orphans_shown_at_top_level():
    root = otlp_span("root", "0000000000000001", 0, 10)
    orphan = otlp_span("lost", "0000000000000002", 3, 4, parent="00000000000000ff")
    child_of_orphan = otlp_span("lost.child", "0000000000000003", 3, 4, parent="0000000000000002")
    w = build_waterfall(spans_of(json.dumps(doc("svc", root, orphan, child_of_orphan))))
    rows = [(r.depth, r.span.name, r.orphan) for r in w.span_rows]
    assert rows == [(0, "root", False), (0, "lost", True), (1, "lost.child", False)]
    text = render_waterfall(w)
    assert "parent 00000000000000ff not in the trace" in text


def test_a_parent_cycle_still_shows_every_span_once():
    a = otlp_span("a", "0000000000000001", 0, 10, parent="0000000000000002")
    b = otlp_span("b", "0000000000000002", 1, 5, parent="0000000000000001")
    w = build_waterfall(spans_of(json.dumps(doc("svc", a, b))))
    assert sorted(r.span.name for r in w.span_rows) == ["a", "b"]


def test_a_5000_deep_parent_chain_nests_every_span_once():
    ids = [f"{i + 1:016x}" for i in range(5000)]
    spans = [otlp_span(f"s{i}", span_id, i * 0.001, 10_000 - i * 0.001, parent=ids[i - 1] if i else "")
             for i, span_id in enumerate(ids)]
    w = build_waterfall(spans_of(json.dumps(doc("svc", *spans))))
    assert [(r.depth, r.span.name) for r in w.span_rows] == [(i, f"s{i}") for i in range(5000)]
    text = render_waterfall(w)
    assert "[4999] s4999" in text and max(len(line) for line in text.splitlines()) < 400


def test_gaps_of_each_parent_between_and_around_its_children():
    w = build_waterfall(spans_of(pd_trace()))
    gaps = {(g.parent.name, g.after, g.before): (g.start_ns - BASE, g.end_ns - BASE) for g in w.gaps}
    assert gaps == {("proxy.request", "proxy.read_body", "proxy.attempt"): (2 * MS, 5 * MS),
                    ("proxy.attempt", None, "instance.request"): (5 * MS, 6 * MS),
                    ("proxy.attempt", "instance.request", None): (58 * MS, 60 * MS),
                    ("instance.request", None, "engine.prefill"): (6 * MS, 10 * MS),
                    ("instance.request", "engine.prefill", None): (50 * MS, 58 * MS)}


def test_overlapping_children_cover_their_union_once():
    root = otlp_span("root", "0000000000000001", 0, 20)
    kids = [otlp_span("x", "0000000000000002", 0, 8, parent="0000000000000001"),
            otlp_span("y", "0000000000000003", 4, 10, parent="0000000000000001"),  # overlaps x
            otlp_span("z", "0000000000000004", 5, 6, parent="0000000000000001"),  # inside x and y
            otlp_span("w", "0000000000000005", 15, 20, parent="0000000000000001")]
    w = build_waterfall(spans_of(json.dumps(doc("svc", root, *kids))))
    assert [(g.after, g.before, g.start_ns - BASE, g.end_ns - BASE) for g in w.gaps] == [("y", "w", 10 * MS, 15 * MS)]
    assert w.summary.covered_ns == 15 * MS and w.summary.total_ns == 20 * MS
    assert w.summary.largest_gap is not None and w.summary.largest_gap.duration_ns == 5 * MS


def test_summary_names_the_largest_gap_and_the_roots_coverage():
    w = build_waterfall(spans_of(pd_trace()))
    s = w.summary
    assert s.total_ns == 100 * MS and s.covered_ns == 97 * MS  # read_body 0-2, attempt 5-60, relay 60-100
    assert (s.largest_gap.parent.name, s.largest_gap.duration_ns) == ("instance.request", 8 * MS)
    text = render_waterfall(w)
    last = text.strip().splitlines()[-1]
    assert "total 100.000 ms" in last and "97.0%" in last and "largest gap 8.000 ms" in last
    assert "instance.request" in last


def test_leaves_have_no_gaps_and_a_lone_span_has_a_summary():
    w = build_waterfall(spans_of(json.dumps(doc("svc", otlp_span("only", "0000000000000001", 0, 3)))))
    assert w.gaps == () and w.summary.total_ns == 3 * MS and w.summary.covered_ns == 0
    assert w.summary.largest_gap is None
    assert "no gaps" in render_waterfall(w)


def test_without_a_root_the_longest_top_level_span_stands_for_it():
    a = otlp_span("a", "0000000000000001", 0, 3, parent="00000000000000f1")
    b = otlp_span("b", "0000000000000002", 1, 9, parent="00000000000000f2")
    w = build_waterfall(spans_of(json.dumps(doc("svc", a, b))))
    assert w.root.name == "b" and w.summary.total_ns == 8 * MS


# ---- rendering -------------------------------------------------------------------------------------------

def test_render_shows_offsets_durations_services_indent_bars_errors_and_key_attributes():
    text = render_waterfall(build_waterfall(spans_of(pd_trace())), width=20)
    lines = text.splitlines()
    rows = [line for line in lines if "~ gap" not in line]
    row = next(line for line in rows if "engine.prefill" in line)
    assert "10.000" in row and "40.000" in row and "kvbridge-prefill-8100" in row
    assert "kvbridge.num_tokens=12" in row
    root = next(line for line in rows if "proxy.request" in line)
    assert root.index("proxy.request") < row.index("engine.prefill")  # deeper = further right
    assert "#" * 20 in root  # the root fills the bar
    assert "http.route=/v1/completions" in root
    gap = next(line for line in lines if "gap" in line and "proxy.read_body" in line)
    assert "3.000" in gap and "proxy.attempt" in gap


def test_render_marks_errors_with_their_message():
    root = otlp_span("root", "0000000000000001", 0, 10)
    bad = otlp_span("kv.read", "0000000000000002", 1, 9, parent="0000000000000001", error="transfer timed out")
    text = render_waterfall(build_waterfall(spans_of(json.dumps(doc("svc", root, bad)))))
    rows = [line for line in text.splitlines() if "~ gap" not in line]
    row = next(line for line in rows if "kv.read" in line)
    assert "ERROR" in row and "transfer timed out" in row
    assert "ERROR" not in next(line for line in rows if " root" in line)


def test_render_hides_gaps_under_the_threshold_but_counts_them():
    w = build_waterfall(spans_of(pd_trace()))
    shown = render_waterfall(w, min_gap_ns=5 * MS)
    gap_lines = [line for line in shown.splitlines() if "gap " in line and "largest" not in line]
    assert len(gap_lines) == 1 and "8.000" in gap_lines[0]


def test_render_a_multi_service_header():
    text = render_waterfall(build_waterfall(spans_of(pd_trace())))
    header = text.splitlines()[0]
    assert T1 in header and "6 spans" in header and "2 services" in header


# ---- the trace store's query -----------------------------------------------------------------------------

def test_rfc3339_nano_keeps_nanoseconds_in_utc():
    assert rfc3339_nano(1_700_000_000_123_456_789) == "2023-11-14T22:13:20.123456789Z"
    assert rfc3339_nano(0) == "1970-01-01T00:00:00.000000000Z"


def test_jaeger_find_query_names_jaegers_parameters():
    q = jaeger_find_query("kvbridge-proxy", "cmpl-1", BASE, BASE + 3600 * 10**9, search_depth=20)
    assert q == {"query.service_name": "kvbridge-proxy",
                 "query.attributes": json.dumps({REQUEST_ID_ATTRIBUTE: "cmpl-1"}),
                 "query.start_time_min": rfc3339_nano(BASE),
                 "query.start_time_max": rfc3339_nano(BASE + 3600 * 10**9),
                 "query.search_depth": "20"}
