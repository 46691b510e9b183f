"""Traces end to end (issue 30): `kvbridge up --otlp-traces-endpoint` (a real proxy, P and D, the
default model, NIXL on loopback) exporting to a real OTLP/HTTP receiver in the test (the official
protobuf), plus a second proxy in front of a misconfigured prefill (bf16 KV against D's fp32: D's
handshake refuses it, so its load fails and D recomputes), as a user would trace them:

- a streamed P/D request: every named span of the proxy, P and D arrives, all in the client's trace
  (its `traceparent` honoured), each parented inside the trace, P's `kv.check_read` under D's;
- a failed read: D's `kv.load` has ERROR and the failure kind, `engine.recompute` follows, the answer
  is right; P's lease ends by D's release;
- a retry: a prefill that died (SIGKILL) shows a failed `proxy.attempt` and the decode-only one;
- coverage: for every request of a mixed run (plain P/D, streamed through the first-token path, chat,
  a repeated prompt D serves from its own prefix cache, the failed read) the named spans (all but
  the proxy's root) cover at least 99% of the client-measured TTFT and end-to-end time;
- `kvbridge trace FILE --request-id ID` prints that request's waterfall from the receiver's OTLP JSON.
Afterwards every block is free on P and D."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from kvbridge.config import KVRole
from kvbridge.launcher.cluster import ChildProcess, child_env, free_ports
from tests.e2e.processes import assert_all_blocks_free, metric, wait_until_ready
from tests.fleet import FleetSpec, Member
from tests.otlp_receiver import OtlpReceiver, ReceivedSpan

pytestmark = pytest.mark.timeout(600)
MODEL = "SmolLM2-135M-Instruct"
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
STORY = ("Here is a short story about a lighthouse keeper who lived alone on a rocky island far from the "
         "coast, and who every night climbed the long spiral stairs to light the great lamp. ")
# ~450 tokens: P's prefill (the first-token path's TTFT) lasts long enough that the client's own
# share of it (sending the request, reading the answer) stays well under 1% on a busy machine.
PROMPT = STORY * 3 + "One evening"
INSTANCE_ARGS = ["--num-blocks", "128", "--max-model-len", "1024", "--num-threads", "1"]
COVERAGE = 0.99
TRIES = 3
INSIDE_GAP = 0.001  # the proxy's children may leave at most 0.1% of its root span uncovered


@dataclass
class Traced:
    proxy: str  # `kvbridge up`'s proxy
    prefill: str
    decode: str
    faulty_proxy: str  # a proxy in front of the bf16 prefill and up's decode
    faulty_prefill: ChildProcess
    receiver: OtlpReceiver


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, fleets):
    """`kvbridge up` (its proxy, P and D) as a user runs it, plus, from the tests' fleet builder, a
    bf16 prefill (KV D cannot use: a retry) and a proxy between it and up's decode instance."""
    logs = tmp_path_factory.mktemp("logs-tracing")
    receiver = OtlpReceiver().start()
    tracing = ("--otlp-traces-endpoint", receiver.endpoint)
    env = child_env({**os.environ, "OTEL_BSP_SCHEDULE_DELAY": "50"}, loopback_only=True, num_threads=1)
    port = free_ports(1)[0]
    up_argv = [sys.executable, "-m", "kvbridge.cli", "up", "--port", str(port), "--num-threads", "1", "--dtype", "float32",
               *tracing, "--", *INSTANCE_ARGS[:4]]
    stdout, stderr = logs / "up.out", logs / "up.err"
    with open(stdout, "wb") as out, open(stderr, "wb") as err:
        up = subprocess.Popen(up_argv, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env)
    extra = None
    try:
        extra = fleets.own(FleetSpec.of(MODEL, "nixl", {}, base_args=tuple(INSTANCE_ARGS),
                                        env=(("OTEL_BSP_SCHEDULE_DELAY", "50"),)))
        extra.add("prefill-bf16", Member(KVRole.PRODUCER, 1, ("--dtype", "bfloat16", *tracing)), wait=False)
        text = wait_until_ready(up, stdout, stderr)
        prefill = re.search(r"prefill: (\S+)", text).group(1)
        decode = re.search(r"decode: +(\S+)", text).group(1)
        extra.wait_healthy(["prefill-bf16"])
        proxy2_port = free_ports(1)[0]
        extra.spawn("proxy-faulty", [sys.executable, "-m", "kvbridge.cli", "proxy", "--prefill",
                                     extra.urls["prefill-bf16"], "--decode", decode, "--port", str(proxy2_port),
                                     "--health-interval", "600", "--otlp-service-name", "kvbridge-proxy-faulty",
                                     *tracing], f"http://127.0.0.1:{proxy2_port}")
        yield Traced(f"http://127.0.0.1:{port}", prefill, decode, extra.urls["proxy-faulty"],
                     extra.child("prefill-bf16"), receiver)
    finally:
        if extra is not None:
            extra.stop()
        if up.poll() is None:
            up.send_signal(signal.SIGTERM)
            try:
                up.wait(timeout=60)
            except subprocess.TimeoutExpired:
                up.kill()
                up.wait()
        receiver.stop()


@dataclass
class Timed:
    request_id: str
    text: str
    start_ns: int  # the client sent the request (httpx's request hook)
    first_ns: int  # the first chunk with text arrived (or the whole answer, not streamed)
    end_ns: int  # the answer's last byte arrived


def traced_request(url: str, request_id: str, *, stream: bool, chat: bool = False, prompt: str = PROMPT,
                   max_tokens: int = 24, traceparent: str | None = None) -> Timed:
    sent: list[int] = []
    http = httpx.Client(event_hooks={"request": [lambda _r: sent.append(time.time_ns())]}, trust_env=False,
                        timeout=120)
    http.get(url + "/health").raise_for_status()  # a warm keep-alive connection, as a client in use has
    sent.clear()
    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, http_client=http)
    headers = {"X-Request-Id": request_id}
    if traceparent is not None:
        headers["traceparent"] = traceparent
    options = dict(model=MODEL, max_tokens=max_tokens, temperature=0, extra_headers=headers)
    first = end = None
    pieces: list[str] = []
    if chat:
        kwargs = dict(messages=[{"role": "user", "content": prompt}], **options)
        if stream:
            for chunk in client.chat.completions.create(stream=True, **kwargs):
                if chunk.choices and chunk.choices[0].delta.content:
                    first = first or time.time_ns()
                    pieces.append(chunk.choices[0].delta.content)
        else:
            raw = client.chat.completions.with_raw_response.create(**kwargs)  # the body is in: stop the clock
            end = time.time_ns()
            pieces.append(raw.parse().choices[0].message.content)
    elif stream:
        for chunk in client.completions.create(prompt=prompt, stream=True, **options):
            if chunk.choices and chunk.choices[0].text:
                first = first or time.time_ns()
                pieces.append(chunk.choices[0].text)
    else:
        raw = client.completions.with_raw_response.create(prompt=prompt, **options)
        end = time.time_ns()
        pieces.append(raw.parse().choices[0].text)
    if stream:
        end = time.time_ns()
    http.close()
    return Timed(request_id, "".join(pieces), sent[0], first or end, end)


def trace_of(receiver: OtlpReceiver, request_id: str, needed: set[str] = frozenset(), *,
             attempts: int = 0, timeout: float = 30) -> list[ReceivedSpan]:
    """Every span of the trace whose proxy.request carries `request_id`, once it holds the `needed`
    names (and at least `attempts` proxy.attempt spans). The proxy exports its spans in the order
    they end and its root ends last, so once the root is here every proxy span is."""
    def spans_of(spans: list[ReceivedSpan]) -> list[ReceivedSpan]:
        roots = [s for s in spans if s.name == "proxy.request" and s.attributes.get("kvbridge.request_id") == request_id]
        return [s for s in spans if roots and s.trace_id == roots[0].trace_id]

    def done(spans: list[ReceivedSpan]) -> bool:
        mine = spans_of(spans)
        return bool(mine) and needed <= {s.name for s in mine} and len(by_name(mine, "proxy.attempt")) >= attempts

    return spans_of(receiver.wait_for(done, timeout))


def uncovered_ns(spans: list[ReceivedSpan], start_ns: int, end_ns: int) -> tuple[int, list[tuple[int, int]]]:
    """Time in [start, end] that no span covers, and those gaps."""
    gaps: list[tuple[int, int]] = []
    at = start_ns
    for s in sorted(spans, key=lambda s: s.start_ns):
        if s.start_ns > at:
            gaps.append((at, min(s.start_ns, end_ns)))
        at = max(at, s.end_ns)
        if at >= end_ns:
            break
    if at < end_ns:
        gaps.append((at, end_ns))
    gaps = [(a, b) for a, b in gaps if b > a]
    return sum(b - a for a, b in gaps), gaps


def client_coverage(timed: Timed, spans: list[ReceivedSpan]) -> dict[str, tuple[float, str]]:
    """For the client's TTFT and end-to-end time: the share the named spans (all but the proxy's root)
    cover, and the gaps (offset from the client's send + length, ms)."""
    named = [s for s in spans if s.name != "proxy.request"]
    result = {}
    for what, end in (("TTFT", timed.first_ns), ("end-to-end", timed.end_ns)):
        missing, gaps = uncovered_ns(named, timed.start_ns, end)
        shown = ", ".join(f"{(a - timed.start_ns) / 1e6:.2f}+{(b - a) / 1e6:.2f} ms" for a, b in gaps)
        result[what] = (1 - missing / (end - timed.start_ns), shown or "none")
    return result


def by_name(spans: list[ReceivedSpan], name: str) -> list[ReceivedSpan]:
    return [s for s in spans if s.name == name]


def one(spans: list[ReceivedSpan], name: str) -> ReceivedSpan:
    found = by_name(spans, name)
    assert len(found) == 1, (name, [(s.name, s.service) for s in spans])
    return found[0]


PD_STREAM_SPANS = {
    "proxy.request", "proxy.route", "proxy.attempt", "proxy.first_token", "proxy.relay",
    "instance.request", "instance.prepare", "engine.queue", "engine.prefill", "engine.first_token", "kv.lease",
    "kv.check_read", "engine.admission", "kv.load", "kv.lease_check", "kv.read", "kv.read_done",
    "engine.first_decode_step", "engine.decode", "instance.stream"}


def settled(fleet: Traced, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    assert_all_blocks_free([fleet.prefill, fleet.decode], max(0.0, deadline - time.monotonic()))
    for url in (fleet.prefill, fleet.decode):
        assert metric(url, "kvbridge_kv_expired_leases_total") == 0, url


def test_a_streamed_pd_request_is_one_trace_under_the_clients(fleet: Traced) -> None:
    timed = traced_request(fleet.proxy, "trace-e2e-stream", stream=True,
                           traceparent=f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01")
    assert timed.text
    spans = trace_of(fleet.receiver, "trace-e2e-stream", PD_STREAM_SPANS)
    assert PD_STREAM_SPANS <= {s.name for s in spans}, sorted(PD_STREAM_SPANS - {s.name for s in spans})
    assert {s.trace_id for s in spans} == {CLIENT_TRACE}
    root = one(spans, "proxy.request")
    assert root.parent_span_id == CLIENT_SPAN and root.service == "kvbridge-proxy"
    # the openai client closes the stream after [DONE], before the server's empty last message: complete
    assert root.attributes.get("kvbridge.outcome") == "ok" and root.status_code != "ERROR", root.attributes
    ids = {s.span_id: s for s in spans}
    for s in spans:
        if s is not root:
            assert s.parent_span_id in ids, f"{s.name} ({s.service}) has a parent outside the trace"
    services = {s.service for s in spans}
    assert {"kvbridge-proxy", "kvbridge-prefill-0", "kvbridge-decode-0"} <= services, services
    attempts = by_name(spans, "proxy.attempt")
    assert sorted(a.attributes.get("kvbridge.role") for a in attempts) == ["decode", "prefill"]
    for instance in by_name(spans, "instance.request"):  # each instance's span is under the proxy's attempt
        assert ids[instance.parent_span_id].name == "proxy.attempt"
    check = one(spans, "kv.check_read")
    assert check.service == "kvbridge-prefill-0"
    ancestors = []
    at = check
    while at.parent_span_id in ids:
        at = ids[at.parent_span_id]
        ancestors.append((at.name, at.service))
    assert any(service == "kvbridge-decode-0" for _, service in ancestors), ancestors  # P's check sits under D's read
    lease = one(spans, "kv.lease")
    assert lease.attributes.get("kvbridge.outcome") == "read_done" and lease.status_code != "ERROR"
    load = one(spans, "kv.load")
    assert load.status_code != "ERROR" and load.attributes.get("kvbridge.bytes", 0) > 0
    reads = by_name(spans, "kv.read")
    assert reads and sum(r.attributes.get("kvbridge.bytes", 0) for r in reads) == load.attributes["kvbridge.bytes"]
    settled(fleet)


def test_a_failed_read_shows_its_kind_and_the_recompute(fleet: Traced) -> None:
    prompt = "A second story, " + PROMPT  # a prompt D has not seen: it must read all of it
    failed = traced_request(fleet.faulty_proxy, "trace-e2e-failed", stream=False, prompt=prompt)
    clean = traced_request(fleet.proxy, "trace-e2e-clean", stream=False, prompt=prompt)
    assert failed.text == clean.text  # D recomputed the prompt: the same greedy answer
    spans = trace_of(fleet.receiver, "trace-e2e-failed", {"kv.load", "engine.recompute", "kv.lease"})
    load = one(spans, "kv.load")
    assert load.status_code == "ERROR" and load.attributes.get("kvbridge.failure_kind"), load
    recompute = one(spans, "engine.recompute")
    assert recompute.attributes.get("kvbridge.failure_kind") == load.attributes["kvbridge.failure_kind"]
    assert recompute.start_ns >= load.start_ns
    lease = one(spans, "kv.lease")
    assert lease.service == "kvbridge-prefill-bf16" and lease.attributes.get("kvbridge.outcome") == "release"
    settled(fleet)


def test_every_request_of_a_mixed_run_is_covered_by_its_spans(fleet: Traced) -> None:
    """Two measures per request. Inside the proxy's root span its children leave no gap (the proxy
    times every step; asserted on each request). Against the client's own clock, the spans cover at
    least 99% of its TTFT and end-to-end time: the rest is the client's sending and reading, and on a
    loaded machine the client's thread waiting for a core, which no server span can explain; so a
    request whose client was held up is tried again (up to TRIES times, each printed), and the best
    try must reach 99%. A missing span would leave its gap in every try."""
    def prompt(n: int) -> str:  # a prompt of its own for each (D's prefix cache would serve a repeat)
        return f"Story number {n}. " + PROMPT

    runs = [("pd", dict(url=fleet.proxy, stream=False)),
            ("pd-first-token", dict(url=fleet.proxy, stream=True)),
            ("pd-chat-stream", dict(url=fleet.proxy, stream=True, chat=True)),
            ("d-prefix-hit", dict(url=fleet.proxy, stream=False)),  # the last pd prompt again: D holds it
            ("failed-read", dict(url=fleet.faulty_proxy, stream=False))]
    best: dict[str, float] = {}
    last_pd_prompt = ""
    for k, (label, options) in enumerate(runs):
        url = options.pop("url")
        for attempt in range(TRIES):
            text = prompt(10 * k + attempt) if label != "d-prefix-hit" else last_pd_prompt
            if label == "pd":
                last_pd_prompt = text
            timed = traced_request(url, f"trace-e2e-mix-{label}-{attempt}", prompt=text, **options)
            spans = trace_of(fleet.receiver, timed.request_id)
            root = one(spans, "proxy.request")
            inside, gaps = uncovered_ns([s for s in spans if s is not root], root.start_ns, root.end_ns)
            assert inside <= INSIDE_GAP * root.duration_ns, (label, gaps)
            coverage = client_coverage(timed, spans)
            for what, (share, shown) in coverage.items():
                end = timed.first_ns if what == "TTFT" else timed.end_ns
                print(f"{label} try {attempt}: {what} {(end - timed.start_ns) / 1e6:.1f} ms, covered {share:.2%}, "
                      f"gaps (ms from the send + length): {shown}")
            best[label] = max(best.get(label, 0.0), min(share for share, _ in coverage.values()))
            if best[label] >= COVERAGE:
                break
    print("best coverage of TTFT and end-to-end, per request kind:", {k: f"{v:.2%}" for k, v in best.items()})
    assert all(v >= COVERAGE for v in best.values()), best
    settled(fleet)


def test_kvbridge_trace_prints_the_waterfall(fleet: Traced, tmp_path: Path) -> None:
    traced_request(fleet.proxy, "trace-e2e-cli", stream=True, prompt="A third story. " + PROMPT)
    trace_of(fleet.receiver, "trace-e2e-cli", {"proxy.relay", "kv.read", "engine.decode"})
    path = tmp_path / "traces.jsonl"
    fleet.receiver.write_otlp_json(path)
    shown = subprocess.run([sys.executable, "-m", "kvbridge.cli", "trace", str(path), "--request-id", "trace-e2e-cli"],
                           capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    print(shown.stdout)
    for name in ("proxy.request", "proxy.attempt", "instance.request", "engine.prefill", "kv.read", "engine.decode"):
        assert name in shown.stdout, (name, shown.stdout)
    assert "kvbridge-decode-0" in shown.stdout and "kvbridge-prefill-0" in shown.stdout


def test_a_retry_shows_both_attempts(fleet: Traced) -> None:
    """Last: it kills the bf16 prefill. The faulty proxy has not noticed (health every 600 s)."""
    fleet.faulty_prefill.popen.send_signal(signal.SIGKILL)
    fleet.faulty_prefill.popen.wait(timeout=30)
    timed = traced_request(fleet.faulty_proxy, "trace-e2e-retry", stream=False)
    assert timed.text
    spans = trace_of(fleet.receiver, "trace-e2e-retry", {"proxy.relay"}, attempts=2)
    attempts = sorted(by_name(spans, "proxy.attempt"), key=lambda s: s.start_ns)
    assert len(attempts) >= 2, attempts
    assert attempts[0].status_code == "ERROR" and attempts[0].attributes.get("kvbridge.role") == "prefill"
    assert attempts[-1].status_code != "ERROR" and attempts[-1].attributes.get("kvbridge.role") == "decode_only"
    settled(fleet)
