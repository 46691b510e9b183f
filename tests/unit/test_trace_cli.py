"""`kvbridge trace FILE` (issue 30): the waterfall from an OTLP JSON file, and one clear line per error."""

from __future__ import annotations

import json
import re

import pytest

from kvbridge.cli import main
from tests.unit.otlp_docs import T1, T2, doc, otlp_span, pd_trace


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["trace", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def two_traces(tmp_path):
    path = tmp_path / "traces.jsonl"
    path.write_text(pd_trace(T1, "cmpl-1") + pd_trace(T2, "cmpl-2", shift_ms=500))
    return path


def test_missing_file_is_one_line_and_exit_2(tmp_path, capsys):
    code, out, err = run(capsys, str(tmp_path / "nope.jsonl"))
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and "cannot read" in err


@pytest.mark.parametrize("content", ["hello\n", '{"resourceSpans": 3}\n', "", '{"a": 1}\n'])
def test_not_otlp_json_is_one_line_and_exit_2(tmp_path, capsys, content):
    path = tmp_path / "bad.json"
    path.write_text(content)
    code, out, err = run(capsys, str(path))
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and "is not OTLP JSON" in err


def test_binary_file_is_not_otlp_json(tmp_path, capsys):
    path = tmp_path / "bad.bin"
    path.write_bytes(b"\xff\xfe\x00garbage")
    code, _, err = run(capsys, str(path))
    assert code == 2 and "not OTLP JSON" in err


def test_unknown_request_id_is_one_line_and_exit_1(two_traces, capsys):
    code, out, err = run(capsys, str(two_traces), "--request-id", "cmpl-9")
    assert code == 1 and out == "" and len(err.strip().splitlines()) == 1 and "cmpl-9" in err


def test_unknown_trace_id_is_exit_1(two_traces, capsys):
    code, _, err = run(capsys, str(two_traces), "--trace-id", "f" * 32)
    assert code == 1 and "f" * 32 in err


def test_file_and_endpoint_together_or_neither_is_exit_2(two_traces, capsys):
    assert run(capsys, str(two_traces), "--endpoint", "http://127.0.0.1:1")[0] == 2
    assert run(capsys)[0] == 2


def test_request_id_and_trace_id_together_are_refused(two_traces, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["trace", str(two_traces), "--request-id", "a", "--trace-id", T1])
    assert exc.value.code == 2


def test_request_id_prints_that_requests_waterfall(two_traces, capsys):
    code, out, err = run(capsys, str(two_traces), "--request-id", "cmpl-2")
    assert code == 0 and err == ""
    assert out.splitlines()[0].startswith(f"trace {T2}")
    assert "engine.prefill" in out and "largest gap 8.000 ms" in out.splitlines()[-1]


def test_without_a_choice_the_latest_trace_with_a_note(two_traces, capsys):
    code, out, err = run(capsys, str(two_traces))
    assert code == 0 and out.startswith(f"trace {T2}") and "2 traces" in err


def test_list_lists_every_trace(two_traces, capsys):
    code, out, _ = run(capsys, str(two_traces), "--list")
    assert code == 0 and T1 in out and T2 in out and "cmpl-1" in out and "cmpl-2" in out


def test_min_gap_hides_small_gaps(two_traces, capsys):
    _, out, _ = run(capsys, str(two_traces), "--request-id", "cmpl-1", "--min-gap-ms", "5")
    gap_rows = [line for line in out.splitlines() if "~ gap" in line]
    assert len(gap_rows) == 1 and "4 gaps under 5.000 ms not shown" in out


def test_one_pretty_printed_document_reads_too(tmp_path, capsys):
    path = tmp_path / "one.json"
    path.write_text(json.dumps(doc("svc", otlp_span("a", "0000000000000001", 0, 1)), indent=2))
    code, out, _ = run(capsys, str(path))
    assert code == 0 and " a" in out


# ---- hostile input (issue 44, item 7): every malformed file is one line and exit 2, never a traceback ----

def _one_span(**fields) -> str:
    return json.dumps(doc("svc", {**otlp_span("a", "0000000000000001", 0, 1), **fields}))


def _attribute(value) -> str:
    return _one_span(attributes=[{"key": "kvbridge.x", "value": value}])


def _nested_attribute(levels: int) -> str:
    """An attribute value that is an array of an array of ... (written as text: json.dumps recurses)."""
    value = '{"arrayValue": {"values": [' * levels + '{"stringValue": "x"}' + "]}}" * levels
    return _attribute({"stringValue": "here"}).replace('{"stringValue": "here"}', value)


MALFORMED = {
    "doubleValue not a number": _attribute({"doubleValue": "abc"}),
    "doubleValue an object": _attribute({"doubleValue": {"a": 1}}),
    "intValue a list": _attribute({"intValue": [1]}),
    "stringValue a number": _attribute({"stringValue": 5}),
    "boolValue a string": _attribute({"boolValue": "yes"}),
    "arrayValue a list": _attribute({"arrayValue": [1, 2]}),
    "arrayValue values a string": _attribute({"arrayValue": {"values": "x"}}),
    "kvlistValue a list": _attribute({"kvlistValue": [1, 2]}),
    "time 1e400": _one_span(startTimeUnixNano=0).replace('"startTimeUnixNano": 0', '"startTimeUnixNano": 1e400'),
    "time NaN": _one_span(startTimeUnixNano=0).replace('"startTimeUnixNano": 0', '"startTimeUnixNano": NaN'),
    "doubleValue Infinity literal": _attribute({"doubleValue": 0}).replace('"doubleValue": 0',
                                                                           '"doubleValue": Infinity'),
    "time past uint64": _one_span(endTimeUnixNano=str(2 ** 64)),
    "time negative": _one_span(startTimeUnixNano="-5"),
    "time a fraction": _one_span(startTimeUnixNano=1.5),
    "time a boolean": _one_span(startTimeUnixNano=True),
    "span id not hex": _one_span(spanId="zzzzzzzzzzzzzzzz"),
    "trace id a huge string": _one_span(traceId="z" * 100_000),
    "parent id a number": _one_span(parentSpanId=7),
    "ids missing": json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [{"name": "a"}]}]}]}),
    "span name a number": _one_span(name=3),
    "status a list": _one_span(status=[2]),
    "events a list of numbers": _one_span(events=[1]),
    "event attributes an object": _one_span(events=[{"name": "e", "attributes": {"a": 1}}]),
    "attributes an object": _one_span(attributes={"a": 1}),
    "resourceSpans an object": '{"resourceSpans": {}}',
    "resourceSpans of strings": '{"resourceSpans": ["x"]}',
    "scopeSpans an object": '{"resourceSpans": [{"scopeSpans": {}}]}',
    "spans a string": '{"resourceSpans": [{"scopeSpans": [{"spans": "x"}]}]}',
    "resource a list": '{"resourceSpans": [{"resource": [1], "scopeSpans": []}]}',
    "100000 nested lists": "[" * 100_000 + "]" * 100_000,
    "100000 nested objects": '{"a":' * 100_000 + "1" + "}" * 100_000,
    "attribute values nested 400 deep": _nested_attribute(400),
    "truncated": _one_span()[:60],
    "truncated second line": _one_span() + "\n" + _one_span()[:60],
    "empty": "",
    "only blank lines": "\n\n  \n",
    "binary garbage": b"\x00\xff\xfe\x13garbage\x89PNG\r\n\x1a\n",
}


@pytest.mark.parametrize("content", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_otlp_json_is_one_line_and_exit_2(tmp_path, capsys, content):
    path = tmp_path / "bad.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    code, out, err = run(capsys, str(path))
    assert code == 2 and out == "", (code, out[:200])
    assert len(err.strip().splitlines()) == 1 and err.startswith("kvbridge trace: error: "), err[:500]
    assert "Traceback" not in err and len(err) < 400, err[:500]


@pytest.mark.parametrize("option", [["--min-gap-ms", "inf"], ["--min-gap-ms", "nan"], ["--min-gap-ms", "-1"],
                                    ["--lookback", "inf"], ["--timeout", "0"], ["--timeout", "nan"]])
def test_a_non_finite_or_negative_number_option_is_refused_by_argparse(two_traces, capsys, option):
    with pytest.raises(SystemExit) as exc:
        main(["trace", str(two_traces), *option])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option[0]}" in err and "Traceback" not in err


def test_a_5000_span_parent_chain_prints_its_waterfall(tmp_path, capsys):
    """The reporter's chain: each span the child of the one before. Every span gets its row."""
    ids = [f"{i + 1:016x}" for i in range(5000)]
    spans = [otlp_span(f"s{i}", span_id, i * 0.001, 10_000 - i * 0.001, parent=ids[i - 1] if i else "")
             for i, span_id in enumerate(ids)]
    path = tmp_path / "chain.json"
    path.write_text(json.dumps(doc("svc", *spans)))
    code, out, err = run(capsys, str(path))
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].startswith(f"trace {T1}: 5000 spans")
    assert sum(1 for line in lines if re.search(r"\| svc +(\[\d+\] )?s\d+", line)) == 5000
    assert lines[-1].startswith("total 10000.000 ms (s0)")
    assert max(len(line) for line in lines) < 400  # deep rows do not indent without bound


def test_names_with_control_characters_print_escaped_on_their_own_row(tmp_path, capsys):
    path = tmp_path / "names.json"
    path.write_text(_one_span(name="a\nb\x1b[2Jc\ud800"))
    code, out, err = run(capsys, str(path))
    assert code == 0 and err == ""
    assert "\x1b" not in out and "a\\nb\\x1b[2Jc\\ud800" in out
    assert len(out.splitlines()) == 4  # header, column titles, the row, the summary
