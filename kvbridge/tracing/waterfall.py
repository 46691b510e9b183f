"""One request's waterfall from OTLP JSON: what `kvbridge trace` prints.

Pure functions, the stdlib only. The input is OTLP JSON as the OpenTelemetry Collector's file
exporter writes it (one `{"resourceSpans": [...]}` object per line), one such document, or a Jaeger
API v3 answer (`{"result": {"resourceSpans": [...]}}`). Ids are hex per the OTLP JSON spec; base64
ids (protobuf's plain JSON mapping) and enum names are read too. `parse_otlp_json` -> `select_trace`
-> `build_waterfall` -> `render_waterfall`; failures come back as a `TraceError`, never raised.

The waterfall nests each span under its parent (across services: a proxy attempt's child is the
instance's request span), in clock order; a span whose parent is not in the input is an orphan,
shown at the top level. Each parent's gaps are the stretches of it no child covers: the time a
tracing test expects near zero, and the first thing to read when a request was slow.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from kvbridge import strict_json

REQUEST_ID_ATTRIBUTE = "kvbridge.request_id"
SERVICE_NAME_ATTRIBUTE = "service.name"
# Shown on a span's row besides every `kvbridge.` attribute.
KEY_ATTRIBUTES = ("http.route", "http.response.status_code", "server.address", "url.full", "error.type")
_KINDS = ("UNSPECIFIED", "INTERNAL", "SERVER", "CLIENT", "PRODUCER", "CONSUMER")
_STATUS_ERROR = 2
_MAX_VALUE_CHARS = 48
# The deepest JSON nesting read is strict_json's 100: OTLP's own is 13 levels, and each array or
# kvlist value in an attribute adds 3 more. Deeper input is refused (a parser or a walk would recurse).
MAX_NANOS = 2 ** 64 - 1  # OTLP's times are fixed64 nanoseconds since the epoch
# A row deeper than this is indented this far and shows its depth: a parent chain thousands of
# spans deep (a valid trace) still prints rows of a readable width.
MAX_INDENT_DEPTH = 24


@dataclass(frozen=True)
class TraceError:
    """Why no waterfall: one line for the user."""
    message: str


@dataclass(frozen=True)
class SpanEvent:
    name: str
    time_ns: int
    attributes: dict[str, Any]


@dataclass(frozen=True)
class SpanRecord:
    trace_id: str  # 32 lowercase hex digits
    span_id: str  # 16 lowercase hex digits
    parent_span_id: str | None  # None: a root
    name: str
    service: str  # the resource's service.name
    kind: str  # SERVER, CLIENT, INTERNAL, PRODUCER, CONSUMER, UNSPECIFIED
    start_ns: int
    end_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)
    error: str | None = None  # None: not an error; else the ERROR status's message (maybe "")
    events: tuple[SpanEvent, ...] = ()

    @property
    def duration_ns(self) -> int:
        return max(0, self.end_ns - self.start_ns)


# ---- parsing ---------------------------------------------------------------------------------------------

class _Bad(Exception):
    """Internal: a malformed field, turned into a TraceError at the API edge."""


def parse_otlp_json(text: str) -> list[SpanRecord] | TraceError:
    """Every span in `text` (one JSON document, or one per line), each span once."""
    documents: list[tuple[int | None, Any]] = []
    try:
        documents.append((None, strict_json.loads(text)))
    except ValueError as whole:
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                documents.append((number, strict_json.loads(line)))
            except ValueError as exc:
                if not documents:  # not even its first line: one document, e.g. pretty-printed
                    return TraceError(f"not JSON ({whole})")
                return TraceError(f"line {number}: not JSON ({exc})")
    spans: list[SpanRecord] = []
    seen: set[tuple[str, str]] = set()
    for line_number, document in documents:
        where = f"line {line_number}: " if line_number is not None else ""
        try:
            found = spans_from_document(document)
        except _Bad as exc:
            return TraceError(f"{where}{exc}")
        for span in found:
            if (span.trace_id, span.span_id) not in seen:
                seen.add((span.trace_id, span.span_id))
                spans.append(span)
    if not spans:
        return TraceError("no spans in the input")
    return spans


def _show(value: Any) -> str:
    """`value` for an error message: its repr, shortened."""
    text = repr(value)
    return text if len(text) <= _MAX_VALUE_CHARS else text[:_MAX_VALUE_CHARS - 3] + "..."


def spans_from_document(document: Any) -> list[SpanRecord]:
    """The spans of one OTLP JSON document (or a Jaeger API v3 answer); _Bad when malformed."""
    if isinstance(document, dict) and isinstance(document.get("result"), dict):
        document = document["result"]
    if not isinstance(document, dict) or not isinstance(document.get("resourceSpans"), list):
        raise _Bad("not an OTLP JSON document (an object with resourceSpans)")
    spans = []
    for resource_spans in document["resourceSpans"]:
        resource = _dict(resource_spans, "resourceSpans").get("resource") or {}
        service = str(_attributes(_dict(resource, "resource").get("attributes")).get(SERVICE_NAME_ATTRIBUTE,
                                                                                      "unknown_service"))
        scopes = resource_spans.get("scopeSpans", resource_spans.get("instrumentationLibrarySpans", []))
        for scope_spans in _list(scopes, "scopeSpans"):
            for span in _list(_dict(scope_spans, "scopeSpans").get("spans", []), "spans"):
                spans.append(_span(_dict(span, "span"), service))
    return spans


def _span(raw: dict[str, Any], service: str) -> SpanRecord:
    name = raw.get("name", "")
    if not isinstance(name, str):
        raise _Bad(f"span name {_show(name)} is not a string")
    trace_id = _id(raw.get("traceId"), 16, "traceId", name)
    span_id = _id(raw.get("spanId"), 8, "spanId", name)
    parent = raw.get("parentSpanId")
    parent_id = _id(parent, 8, "parentSpanId", name) if parent else None
    if parent_id == "0" * 16:
        parent_id = None
    status = raw.get("status") or {}
    code = _dict(status, "status").get("code", 0)
    is_error = code == _STATUS_ERROR or code == "STATUS_CODE_ERROR"
    message = status.get("message") or ""
    if not isinstance(message, str):
        raise _Bad(f"span {_show(name)}: status message {_show(message)} is not a string")
    events = tuple(_event(_dict(e, "event"), name) for e in _list(_or_empty(raw.get("events")), "events"))
    return SpanRecord(trace_id=trace_id, span_id=span_id, parent_span_id=parent_id, name=name, service=service,
                      kind=_kind(raw.get("kind", 0)),
                      start_ns=_nanos(raw.get("startTimeUnixNano", 0), "startTimeUnixNano", name),
                      end_ns=_nanos(raw.get("endTimeUnixNano", 0), "endTimeUnixNano", name),
                      attributes=_attributes(raw.get("attributes")),
                      error=message if is_error else None, events=events)


def _event(raw: dict[str, Any], span: str) -> SpanEvent:
    name = raw.get("name") or ""
    if not isinstance(name, str):
        raise _Bad(f"span {_show(span)}: event name {_show(name)} is not a string")
    return SpanEvent(name, _nanos(raw.get("timeUnixNano", 0), "timeUnixNano", span),
                     _attributes(raw.get("attributes")))


def _id(value: Any, size: int, field_name: str, span: str) -> str:
    """A trace or span id as lowercase hex: OTLP JSON's hex, or protobuf JSON's base64."""
    if isinstance(value, str):
        if len(value) == 2 * size:
            try:
                return bytes.fromhex(value).hex()
            except ValueError:
                pass
        try:
            raw = base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            raw = b""
        if len(raw) == size:
            return raw.hex()
    raise _Bad(f"span {_show(span)}: {field_name} {_show(value)} is not {2 * size} hex digits")


def _nanos(value: Any, field_name: str, span: str) -> int:
    """A time: an integer from 0 to MAX_NANOS, as a JSON integer, an integral number or a string."""
    number = _integer(value)
    if number is None or not 0 <= number <= MAX_NANOS:
        raise _Bad(f"span {_show(span)}: {field_name} {_show(value)} is not a time in nanoseconds "
                   f"(0 to 2^64-1)")
    return number


def _integer(value: Any) -> int | None:
    """protobuf JSON's (u)int64: an integer, an integral number or a string of digits; else None."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:  # not digits, or past Python's limit on digits
            return None
    return None


def _kind(value: Any) -> str:
    if isinstance(value, int) and 0 <= value < len(_KINDS):
        return _KINDS[value]
    if isinstance(value, str) and value.removeprefix("SPAN_KIND_") in _KINDS:
        return value.removeprefix("SPAN_KIND_")
    return "UNSPECIFIED"


def _attributes(raw: Any) -> dict[str, Any]:
    attributes = {}
    for kv in _list(_or_empty(raw), "attributes"):
        key = _dict(kv, "attribute").get("key")
        if not isinstance(key, str):
            raise _Bad(f"attribute key {_show(key)} is not a string")
        attributes[key] = _value(kv.get("value") or {})
    return attributes


def _value(raw: Any) -> Any:
    """An AnyValue (its nesting is bounded: the document's depth was checked)."""
    if not isinstance(raw, dict):
        raise _Bad(f"attribute value {_show(raw)} is not an object")
    if raw.get("stringValue") is not None:
        return _typed(raw["stringValue"], str, "stringValue")
    if raw.get("boolValue") is not None:
        return _typed(raw["boolValue"], bool, "boolValue")
    if raw.get("intValue") is not None:
        number = _integer(raw["intValue"])
        if number is None:
            raise _Bad(f"intValue {_show(raw['intValue'])} is not an integer")
        return number
    if raw.get("doubleValue") is not None:
        return _double(raw["doubleValue"])
    if "arrayValue" in raw:
        values = _dict(raw["arrayValue"] or {}, "arrayValue").get("values")
        return [_value(v) for v in _list(_or_empty(values), "arrayValue's values")]
    if "kvlistValue" in raw:
        return _attributes(_dict(raw["kvlistValue"] or {}, "kvlistValue").get("values"))
    if raw.get("bytesValue") is not None:
        return _typed(raw["bytesValue"], str, "bytesValue")  # base64, shown as it is
    return None


def _typed(value: Any, kind: type, field_name: str) -> Any:
    if not isinstance(value, kind):
        raise _Bad(f"{field_name} {_show(value)} is not a {kind.__name__}")
    return value


def _double(value: Any) -> float:
    """protobuf JSON's double: a number, or a string of one ("NaN", "Infinity" included)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    raise _Bad(f"doubleValue {_show(value)} is not a number")


def _or_empty(value: Any) -> Any:
    """A repeated field: null (protobuf JSON's default) is an empty list."""
    return [] if value is None else value


def _dict(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _Bad(f"{what}: expected an object, got {type(value).__name__}")
    return value


def _list(value: Any, what: str) -> list[Any]:
    if not isinstance(value, list):
        raise _Bad(f"{what}: expected a list, got {type(value).__name__}")
    return value


# ---- finding the trace -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class TraceSummary:
    trace_id: str
    start_ns: int
    duration_ns: int  # first start to last end
    num_spans: int
    root_name: str
    services: tuple[str, ...]
    request_ids: tuple[str, ...]  # every kvbridge.request_id on its spans


@dataclass(frozen=True)
class Selection:
    trace_id: str
    spans: list[SpanRecord]
    note: str | None = None  # what the user should know about the choice (other candidates)


def group_traces(spans: Iterable[SpanRecord]) -> dict[str, list[SpanRecord]]:
    traces: dict[str, list[SpanRecord]] = {}
    for span in spans:
        traces.setdefault(span.trace_id, []).append(span)
    return traces


def trace_summaries(spans: Iterable[SpanRecord]) -> list[TraceSummary]:
    """One line's facts per trace, earliest first."""
    out = []
    for trace_id, members in group_traces(spans).items():
        start, end = min(s.start_ns for s in members), max(s.end_ns for s in members)
        out.append(TraceSummary(trace_id=trace_id, start_ns=start, duration_ns=end - start, num_spans=len(members),
                                root_name=_root(members, _top_level(members)).name,
                                services=tuple(sorted({s.service for s in members})),
                                request_ids=tuple(sorted({str(s.attributes[REQUEST_ID_ATTRIBUTE]) for s in members
                                                          if REQUEST_ID_ATTRIBUTE in s.attributes}))))
    return sorted(out, key=lambda t: (t.start_ns, t.trace_id))


def select_trace(spans: Sequence[SpanRecord], *, request_id: str | None = None,
                 trace_id: str | None = None) -> Selection | TraceError:
    """The trace holding `request_id` (the `kvbridge.request_id` attribute of any of its spans), the
    trace `trace_id`, or else the most recent trace (the one that started last)."""
    traces = group_traces(spans)
    if trace_id is not None:
        wanted = trace_id.strip().lower()
        if len(wanted) != 32 or any(c not in "0123456789abcdef" for c in wanted):
            return TraceError(f"trace id {trace_id!r} is not 32 hex digits")
        if wanted not in traces:
            return TraceError(f"no trace {wanted} among the {len(traces)} traces found")
        return Selection(wanted, traces[wanted])
    summaries = trace_summaries(spans)
    if request_id is not None:
        candidates = [t for t in summaries if request_id in t.request_ids]
        if not candidates:
            return TraceError(f"no span has {REQUEST_ID_ATTRIBUTE}={request_id!r} "
                              f"(among {len(spans)} spans of {len(traces)} traces)")
        chosen = candidates[-1]
        note = None
        if len(candidates) > 1:
            note = (f"request id {request_id} is in {len(candidates)} traces "
                    f"({', '.join(t.trace_id for t in candidates)}); showing the most recent")
        return Selection(chosen.trace_id, traces[chosen.trace_id], note)
    chosen = summaries[-1]
    note = None
    if len(summaries) > 1:
        note = (f"{len(summaries)} traces found; showing the most recent: choose one with --trace-id or "
                f"--request-id (--list lists them)")
    return Selection(chosen.trace_id, traces[chosen.trace_id], note)


# ---- intervals -------------------------------------------------------------------------------------------

Interval = tuple[int, int]


def merge_intervals(intervals: Iterable[Interval]) -> list[Interval]:
    """The union of `intervals` as sorted disjoint ones (touching ones joined, empty ones dropped)."""
    merged: list[Interval] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def uncovered(start: int, end: int, intervals: Iterable[Interval]) -> list[Interval]:
    """The parts of [start, end) that no interval covers."""
    gaps, cursor = [], start
    for s, e in merge_intervals((max(s, start), min(e, end)) for s, e in intervals):
        if s > cursor:
            gaps.append((cursor, s))
        cursor = max(cursor, e)
    if cursor < end:
        gaps.append((cursor, end))
    return gaps


def _covered(start: int, end: int, intervals: Iterable[Interval]) -> int:
    return sum(e - s for s, e in merge_intervals((max(s, start), min(e, end)) for s, e in intervals))


# ---- the waterfall ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SpanRow:
    span: SpanRecord
    depth: int
    offset_ns: int  # from the trace's first start
    orphan: bool = False  # has a parent id, but shown at the top level
    note: str | None = None  # why it is an orphan
    children_uncovered_ns: int | None = None  # parents only: time no child covers


@dataclass(frozen=True)
class Gap:
    parent: SpanRecord
    start_ns: int
    end_ns: int
    after: str | None  # the child it follows (None: the parent's start)
    before: str | None  # the child it precedes (None: the parent's end)
    depth: int = 0  # its children's depth (for display)

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns


@dataclass(frozen=True)
class Summary:
    total_ns: int  # the root span's duration
    covered_ns: int  # by the root's direct children (their union, inside the root)
    largest_gap: Gap | None


@dataclass(frozen=True)
class Waterfall:
    trace_id: str
    start_ns: int
    end_ns: int
    rows: tuple[SpanRow | Gap, ...]  # display order: each parent, then its children and gaps in clock order
    root: SpanRecord | None
    summary: Summary

    @property
    def span_rows(self) -> list[SpanRow]:
        return [r for r in self.rows if isinstance(r, SpanRow)]

    @property
    def gaps(self) -> tuple[Gap, ...]:
        return tuple(r for r in self.rows if isinstance(r, Gap))

    @property
    def services(self) -> list[str]:
        return sorted({r.span.service for r in self.span_rows})


def _order(span: SpanRecord) -> tuple[int, int, str, str]:
    return (span.start_ns, -span.end_ns, span.name, span.span_id)


def _top_level(spans: Sequence[SpanRecord]) -> list[SpanRecord]:
    ids = {s.span_id for s in spans}
    return [s for s in spans if s.parent_span_id is None or s.parent_span_id not in ids]


def _root(spans: Sequence[SpanRecord], top: Sequence[SpanRecord]) -> SpanRecord:
    """The trace's root: the longest span without a parent, else the longest top-level one."""
    roots = [s for s in top if s.parent_span_id is None] or list(top) or list(spans)
    return max(roots, key=lambda s: (s.duration_ns, -s.start_ns))


def _gaps(parent: SpanRecord, children: Sequence[SpanRecord], depth: int) -> list[Gap]:
    clipped = [(c, max(c.start_ns, parent.start_ns), min(c.end_ns, parent.end_ns)) for c in children]
    clipped = [(c, s, e) for c, s, e in clipped if e > s]
    gaps = []
    for start, end in uncovered(parent.start_ns, parent.end_ns, [(s, e) for _, s, e in clipped]):
        ending = [(e, c.name) for c, _, e in clipped if e == start]
        starting = [(s, c.name) for c, s, _ in clipped if s == end]
        gaps.append(Gap(parent, start, end, after=max(ending)[1] if ending else None,
                        before=min(starting)[1] if starting else None, depth=depth))
    return gaps


def build_waterfall(spans: Sequence[SpanRecord]) -> Waterfall:
    """`spans` (one trace's) nested under their parents, each parent's gaps among its children."""
    if not spans:
        return Waterfall("", 0, 0, (), None, Summary(0, 0, None))
    by_id = {s.span_id: s for s in spans}
    children: dict[str, list[SpanRecord]] = {}
    for s in spans:
        if s.parent_span_id is not None and s.parent_span_id in by_id and s.parent_span_id != s.span_id:
            children.setdefault(s.parent_span_id, []).append(s)
    for kids in children.values():
        kids.sort(key=_order)
    start = min(s.start_ns for s in spans)
    top = sorted(_top_level(spans), key=_order)
    rows: list[SpanRow | Gap] = []
    seen: set[str] = set()

    def visit(top_span: SpanRecord, note: str | None) -> None:
        """`top_span`'s row and, depth first, its descendants' and their gaps: a stack, not
        recursion (a valid parent chain may be thousands of spans deep)."""
        stack: list[tuple[SpanRecord | Gap, int]] = [(top_span, 0)]
        while stack:
            item, depth = stack.pop()
            if isinstance(item, Gap):
                rows.append(item)
                continue
            if item.span_id in seen:
                continue
            seen.add(item.span_id)
            kids = [k for k in children.get(item.span_id, []) if k.span_id not in seen]
            gaps = _gaps(item, kids, depth + 1) if kids else []
            row_note = note if item is top_span else None
            rows.append(SpanRow(item, depth, item.start_ns - start, orphan=row_note is not None, note=row_note,
                                children_uncovered_ns=sum(g.duration_ns for g in gaps) if kids else None))
            items: list[tuple[tuple[int | str, ...], SpanRecord | Gap]] = [(_order(k), k) for k in kids]
            items += [((g.start_ns, 1), g) for g in gaps]
            ordered = [child for _, child in sorted(items, key=lambda pair: pair[0][:2])]
            stack.extend((child, depth + 1) for child in reversed(ordered))

    for span in top:
        visit(span, None if span.parent_span_id is None else f"parent {span.parent_span_id} not in the trace")
    for span in sorted((s for s in spans if s.span_id not in seen), key=_order):  # parent cycles
        if span.span_id not in seen:
            visit(span, f"parent {span.parent_span_id} is in a cycle")
    root = _root(spans, top)
    gaps = [r for r in rows if isinstance(r, Gap)]
    summary = Summary(total_ns=root.duration_ns,
                      covered_ns=_covered(root.start_ns, root.end_ns,
                                          [(c.start_ns, c.end_ns) for c in children.get(root.span_id, [])]),
                      largest_gap=max(gaps, key=lambda g: (g.duration_ns, -g.start_ns)) if gaps else None)
    return Waterfall(spans[0].trace_id, start, max(s.end_ns for s in spans), tuple(rows), root, summary)


# ---- rendering -------------------------------------------------------------------------------------------

def _ms(ns: int) -> str:
    return f"{ns / 1e6:.3f}"


def _bar(start_ns: int, end_ns: int, w: Waterfall, width: int, fill: str) -> str:
    total = w.end_ns - w.start_ns
    if total <= 0:
        return fill * width
    first = min(width - 1, math.floor((start_ns - w.start_ns) * width / total))
    last = max(first + 1, min(width, math.ceil((end_ns - w.start_ns) * width / total)))
    return " " * first + fill * (last - first) + " " * (width - last)


def _format_value(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))
    return text if len(text) <= _MAX_VALUE_CHARS else text[:_MAX_VALUE_CHARS - 3] + "..."


def key_attributes(attributes: Mapping[str, Any]) -> str:
    """The attributes worth a row: every `kvbridge.` one and the HTTP/peer ones."""
    shown = [(k, v) for k, v in attributes.items() if k.startswith("kvbridge.") or k in KEY_ATTRIBUTES]
    return " ".join(f"{k}={_format_value(v)}" for k, v in shown)


def _gap_where(gap: Gap) -> str:
    if gap.after and gap.before:
        return f"between {gap.after} and {gap.before}"
    if gap.before:
        return f"before {gap.before}"
    if gap.after:
        return f"after {gap.after}"
    return "no child"


def render_waterfall(w: Waterfall, *, width: int = 40, min_gap_ns: int = 0) -> str:
    """The waterfall as text: offset and duration (ms), a bar, the service, the indented span name,
    ERROR marks, key attributes; a parent's gaps of at least `min_gap_ns` as rows of their own; a
    summary line last."""
    if not w.rows:
        return "no spans\n"
    service_width = max(len(s) for s in w.services)
    lines = [f"trace {w.trace_id}: {len(w.span_rows)} spans, {len(w.services)} services, "
             f"{_ms(w.end_ns - w.start_ns)} ms",
             f"{'start ms':>10} {'dur ms':>10} |{'':{width}}| {'service':<{service_width}} span"]
    hidden = 0
    for row in w.rows:
        if isinstance(row, Gap):
            if row.duration_ns < min_gap_ns:
                hidden += 1
                continue
            lines.append(f"{_ms(row.start_ns - w.start_ns):>10} {_ms(row.duration_ns):>10} "
                         f"|{_bar(row.start_ns, row.end_ns, w, width, '.')}| {'':<{service_width}} "
                         f"{_indent(row.depth)}~ gap {_gap_where(row)} in {row.parent.name}")
            continue
        span = row.span
        parts = [f"{_indent(row.depth)}{span.name}"]
        if span.error is not None:
            parts.append(f"ERROR({span.error})" if span.error else "ERROR")
        if row.note:
            parts.append(f"[orphan: {row.note}]")
        attrs = key_attributes(span.attributes)
        if attrs:
            parts.append(attrs)
        if span.events:
            parts.append("events: " + ", ".join(f"{e.name}@{_ms(e.time_ns - w.start_ns)}" for e in span.events))
        if row.children_uncovered_ns:
            parts.append(f"(children leave {_ms(row.children_uncovered_ns)} ms uncovered)")
        lines.append(f"{_ms(row.offset_ns):>10} {_ms(span.duration_ns):>10} "
                     f"|{_bar(span.start_ns, span.end_ns, w, width, '#')}| {span.service:<{service_width}} "
                     + " ".join(parts))
    if hidden:
        lines.append(f"({hidden} gaps under {_ms(min_gap_ns)} ms not shown)")
    lines.append(summary_line(w))
    return "".join(_printable(line) + "\n" for line in lines)


def _indent(depth: int) -> str:
    if depth <= MAX_INDENT_DEPTH:
        return "  " * depth
    return "  " * MAX_INDENT_DEPTH + f"[{depth}] "


def _printable(line: str) -> str:
    """`line` as one line a terminal shows as it is: what is not printable (a newline or escape in
    a span's name, a lone surrogate, which no encoder writes) escaped as Python writes it."""
    if line.isprintable():
        return line
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in line)


def summary_line(w: Waterfall) -> str:
    s, root = w.summary, w.root
    if root is None:
        return "no spans"
    share = 100.0 * s.covered_ns / s.total_ns if s.total_ns else 0.0
    text = (f"total {_ms(s.total_ns)} ms ({root.name}); its child spans cover {_ms(s.covered_ns)} ms "
            f"({share:.1f}%); ")
    if s.largest_gap is None:
        return text + "no gaps"
    g = s.largest_gap
    return text + f"largest gap {_ms(g.duration_ns)} ms in {g.parent.name} ({_gap_where(g)})"


def render_trace_list(summaries: Sequence[TraceSummary]) -> str:
    lines = [f"{len(summaries)} traces"]
    for t in summaries:
        ids = f" request ids {', '.join(t.request_ids)}" if t.request_ids else ""
        lines.append(f"{t.trace_id}  {rfc3339_nano(t.start_ns)}  {_ms(t.duration_ns):>10} ms  {t.num_spans:>4} spans  "
                     f"{t.root_name} ({', '.join(t.services)}){ids}")
    return "".join(_printable(line) + "\n" for line in lines)


# ---- a trace store's query (Jaeger API v3) ---------------------------------------------------------------

def rfc3339_nano(ns: int) -> str:
    """UTC time with nanoseconds, as Go's time.RFC3339Nano parses it."""
    seconds, rest = divmod(ns, 1_000_000_000)
    return datetime.fromtimestamp(seconds, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S") + f".{rest:09d}Z"


def jaeger_find_query(service: str, request_id: str, start_min_ns: int, start_max_ns: int, *,
                      search_depth: int = 20) -> dict[str, str]:
    """The query parameters of Jaeger API v3's `GET /api/v3/traces` (FindTraces) for the traces in
    which a span of `service` carries `kvbridge.request_id=request_id` and started in the window.
    The snake_case names are the ones every Jaeger v2 accepts (v2.19+ also takes camelCase);
    `query.attributes` (a JSON map of strings) is honoured from v2.19: callers filter again."""
    return {"query.service_name": service,
            "query.attributes": json.dumps({REQUEST_ID_ATTRIBUTE: request_id}),
            "query.start_time_min": rfc3339_nano(start_min_ns),
            "query.start_time_max": rfc3339_nano(start_max_ns),
            "query.search_depth": str(search_depth)}
