"""`kvbridge trace FILE` (issue 30): the waterfall from an OTLP JSON file, and one clear line per error."""

from __future__ import annotations

import json

import pytest

from kvbridge.cli import main
from tests.unit.test_trace_waterfall import T1, T2, doc, otlp_span, pd_trace


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
