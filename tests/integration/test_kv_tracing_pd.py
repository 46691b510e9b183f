"""KV-transfer spans of P/D requests (issue 30), in-process: a P and a D engine on a small
synthetic model (pd_world.py: the fake transfer backend with its fault knobs, the real side
channel, a manual lease clock), each with its own Tracing exporting to memory, and requests that
carry a RequestTrace as the server hands them in.

Failure paths first: a failed read, an expired lease; then the clean request's whole tree (P's
kv.check_read under D's kv.lease_check, in one trace), D at TP 2 (one kv.read per (D rank, P
rank)), and tracing off (no span, no traceparent on the wire). Every test ends with every block
back in its pool and no lease held (pd_explorer.check)."""

from __future__ import annotations

import dataclasses
import json

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from kvbridge.engine.loader import load_model
from kvbridge.engine.loader.synthetic import TINY_4_KV_HEADS, write_synthetic_folder
from kvbridge.engine.sampling_params import SamplingParams
from kvbridge.kv_transfer.backends.fake import FaultConfig
from kvbridge.kv_transfer.side_channel.control import MSG_CHECK_READ
from kvbridge.kv_transfer.params import parse_kv_transfer_params
from kvbridge.tracing import RequestTrace, Tracing
from tests.integration.pd_explorer import check
from tests.integration.pd_harness import make_engine
from tests.integration.pd_world import LEASE_S, SAMPLING, ModelCase, Track, World

VOCAB = 1024
PROMPT = ("Once upon a time in a small village by the sea there lived an old fisherman who told the children "
          "stories about the storms he had seen")
FILLER = "A different prompt about mountains and rivers."


@pytest.fixture(scope="module")
def dense(tmp_path_factory) -> ModelCase:
    tok = load_model("SmolLM2-135M-Instruct").tokenizer
    folder = tmp_path_factory.mktemp("models") / "tiny-llama"
    write_synthetic_folder(folder, tok, architecture="llama", **{**TINY_4_KV_HEADS, "vocab_size": VOCAB})
    model = load_model(str(folder))
    colocated = make_engine(model, None, block_size=16, num_blocks=64)
    memo: dict[tuple[int, ...], list[int]] = {}

    def want(prompt: list[int]) -> list[int]:
        if tuple(prompt) not in memo:
            memo[tuple(prompt)] = colocated.generate([prompt], SAMPLING)[0]
        return memo[tuple(prompt)]

    def ids(text: str) -> list[int]:
        return [3 + t % (VOCAB - 3) for t in tok.encode(text)]
    return ModelCase("dense", model, 16, want, ids(PROMPT), ids(FILLER))


def memory_tracing(service: str) -> tuple[Tracing, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return Tracing(provider, service), exporter


class TracedWorld(World):
    """The world, with each engine's Tracing and the requests carrying a RequestTrace whose
    parent is a stand-in for the instance's request span (`roots`); `traced=False` carries none.
    Records the body of every kv_check_read D sends."""

    def __init__(self, case: ModelCase, traced: bool = True) -> None:
        super().__init__(case)
        self.traced = traced
        self.p_tracing, self.p_spans = memory_tracing("kvbridge-prefill-0")
        self.d_tracing, self.d_spans = memory_tracing("kvbridge-decode-0")
        self.roots: dict[str, object] = {}  # request id -> its stand-in request span's context
        self.check_bodies: list[dict] = []
        send = self.gate.request

        def request(host, port, msg_type, body, timeout):
            if msg_type == MSG_CHECK_READ:
                self.check_bodies.append(json.loads(body))
            return send(host, port, msg_type, body, timeout)
        self.d.connectors.worker.receiving._side_client.request = request

    def _trace(self, tracing: Tracing, rid: str) -> RequestTrace | None:
        if not self.traced:
            return None
        span = tracing.start_span("instance.request")
        span.end()
        self.roots[rid] = span.get_span_context()
        return RequestTrace(tracing, span.get_span_context())

    def add_to_p(self, track: Track) -> None:
        track.on_p = True
        self.p.add_request(track.p_id, track.prompt, SamplingParams(max_tokens=1, temperature=0),
                           parse_kv_transfer_params({"do_remote_decode": True}),
                           trace=self._trace(self.p_tracing, track.p_id))

    def add_to_d(self, track: Track) -> None:
        track.on_d = True
        self.d.add_request(track.d_id, track.prompt, SAMPLING, parse_kv_transfer_params(dict(track.params)),
                           trace=self._trace(self.d_tracing, track.d_id))

    def prefill(self, prompt: list[int] | None = None) -> Track:
        track = self.new_track(prompt or self.case.prompt, False)
        self.add_to_p(track)
        self.until(lambda: track.p_done, "P finishes the prefill", self.step_p)
        return track

    def decode(self, track: Track, hold_handshake: bool = False) -> None:
        """`hold_handshake`: D's handshake with P waits at the gate until D has parked the request
        (over loopback it may otherwise finish before D looks, and D would not have waited)."""
        if hold_handshake:
            self.gate.hold("handshake")
        self.add_to_d(track)
        if hold_handshake:
            self.until(lambda: self.gate.is_waiting("handshake"), "D sends its handshake", self.step_d)
            self.step_d()  # the receive is started and finds the handshake pending
            self.gate.open("handshake")
        self.until(lambda: track.d_done, "D finishes")
        self.settle()

    def finish(self) -> list[str]:
        """The broken invariants (blocks, leases, outputs), then shut down."""
        try:
            self.settle()
            return check(self)
        finally:
            self.shutdown()


def named(exporter: InMemorySpanExporter, name: str) -> list:
    return [s for s in exporter.get_finished_spans() if s.name == name]


def one(exporter: InMemorySpanExporter, name: str):
    found = named(exporter, name)
    assert len(found) == 1, f"{name}: {[s.attributes for s in found]}"
    return found[0]


def child_of(span, parent_context) -> bool:
    return span.parent is not None and span.parent.span_id == parent_context.span_id and \
        span.context.trace_id == parent_context.trace_id


def counts(stats, family_name: str) -> dict[str, float]:
    family = next(f for f in stats.collect() if f.name == family_name)
    return {s.labels.get("outcome", ""): s.value for s in family.samples if s.name.endswith("_count")}


# ---- failure paths ----------------------------------------------------------------------
def test_a_failed_read_ends_kv_load_in_error_with_its_failure_kind(dense) -> None:
    w = TracedWorld(dense)
    for agent in w.d_agents():
        agent.set_faults(FaultConfig(error_state=True))
    track = w.prefill()
    w.faulted = True
    w.decode(track)  # D recomputes (the load-failure policy)
    assert [t for o in track.d_outputs for t in o.new_token_ids] == dense.want(dense.prompt)
    load = one(w.d_spans, "kv.load")
    assert load.status.status_code is StatusCode.ERROR
    assert load.attributes["kvbridge.failure_kind"] == load.attributes["kvbridge.outcome"] == "transfer_state"
    assert child_of(load, w.roots[track.d_id])
    read = one(w.d_spans, "kv.read")
    assert read.status.status_code is StatusCode.ERROR and child_of(read, load.context)
    release = one(w.d_spans, "kv.release")  # D tells P it may free
    assert child_of(release, w.roots[track.d_id]) and named(w.d_spans, "kv.read_done") == []
    lease = one(w.p_spans, "kv.lease")
    assert lease.attributes["kvbridge.outcome"] == "release" and child_of(lease, w.roots[track.p_id])
    assert counts(w.d.connectors.worker.stats, "kvbridge_kv_load_seconds") == {"transfer_state": 1}
    assert w.finish() == []


def test_an_expired_lease_is_an_error_span_on_p_and_ds_check_is_refused(dense) -> None:
    w = TracedWorld(dense)
    track = w.prefill()
    w.expiry_expected = w.faulted = True
    w.clock.advance(LEASE_S + 1)
    w.step_p()  # the step that sees the expiry frees the blocks
    lease = one(w.p_spans, "kv.lease")
    assert lease.attributes["kvbridge.outcome"] == "expired" and lease.status.status_code is StatusCode.ERROR
    assert counts(w.p.connectors.worker.stats, "kvbridge_kv_lease_held_seconds") == {"expired": 1}
    w.decode(track)
    load = one(w.d_spans, "kv.load")
    assert load.attributes["kvbridge.failure_kind"] == "stale_lease" and load.status.status_code is StatusCode.ERROR
    check_span = one(w.d_spans, "kv.lease_check")
    assert check_span.status.status_code is StatusCode.ERROR and child_of(check_span, load.context)
    refused = one(w.p_spans, "kv.check_read")  # P's refusal, in D's trace
    assert refused.attributes["kvbridge.outcome"] == "no_lease" and child_of(refused, check_span.context)
    assert w.finish() == []


# ---- the clean request --------------------------------------------------------------------
def test_a_clean_pd_request_records_the_whole_kv_tree(dense) -> None:
    w = TracedWorld(dense)
    track = w.prefill()
    w.decode(track, hold_handshake=True)
    assert [t for o in track.d_outputs for t in o.new_token_ids] == dense.want(dense.prompt)
    d_root, p_root = w.roots[track.d_id], w.roots[track.p_id]
    load = one(w.d_spans, "kv.load")
    assert child_of(load, d_root) and load.status.status_code is StatusCode.UNSET
    assert load.attributes["kvbridge.outcome"] == "ok" and load.attributes["kvbridge.bytes"] > 0
    handshake = one(w.d_spans, "kv.handshake")  # the first request to this P waited for it
    assert child_of(handshake, load.context) and handshake.attributes["kvbridge.outcome"] == "ok"
    assert handshake.attributes["kvbridge.remote_engine_id"] == w.p.connectors.worker.engine_id
    lease_check = one(w.d_spans, "kv.lease_check")
    assert child_of(lease_check, load.context) and lease_check.attributes["kvbridge.outcome"] == "granted"
    check_read = one(w.p_spans, "kv.check_read")  # P's handling, parented by D's span: one trace
    assert child_of(check_read, lease_check.context) and check_read.attributes["kvbridge.outcome"] == "granted"
    assert lease_check.start_time <= check_read.start_time <= check_read.end_time <= lease_check.end_time
    read = one(w.d_spans, "kv.read")
    assert child_of(read, load.context)
    assert read.attributes["kvbridge.bytes"] == load.attributes["kvbridge.bytes"]
    assert (read.attributes["kvbridge.tp_rank"], read.attributes["kvbridge.remote_rank"]) == (0, 0)
    assert read.attributes["kvbridge.backend"] == "fake" and read.attributes["kvbridge.descriptors"] > 0
    assert load.start_time <= handshake.start_time and read.end_time <= load.end_time
    assert child_of(one(w.d_spans, "kv.read_done"), d_root) and named(w.d_spans, "kv.release") == []
    lease = one(w.p_spans, "kv.lease")
    assert child_of(lease, p_root) and lease.attributes["kvbridge.outcome"] == "read_done"
    assert lease.start_time <= check_read.start_time and check_read.end_time <= lease.end_time
    d_stats, p_stats = w.d.connectors.worker.stats, w.p.connectors.worker.stats
    assert counts(d_stats, "kvbridge_kv_load_seconds") == {"ok": 1}
    assert counts(d_stats, "kvbridge_kv_read_bytes") == {"": 1}
    assert counts(d_stats, "kvbridge_kv_handshake_seconds") == {"ok": 1}
    assert counts(p_stats, "kvbridge_kv_lease_held_seconds") == {"read_done": 1}
    # A second request to the same P finds the handshake done: no kv.handshake for it (another
    # prompt: D would find this one's blocks in its prefix cache and read nothing).
    second = w.prefill(dense.filler)
    w.decode(second)
    assert [t for o in second.d_outputs for t in o.new_token_ids] == dense.want(dense.filler)
    assert len(named(w.d_spans, "kv.load")) == 2 and len(named(w.d_spans, "kv.handshake")) == 1
    assert w.finish() == []


def test_d_at_tp_2_records_one_kv_read_per_rank_pair(dense) -> None:
    w = TracedWorld(dataclasses.replace(dense, d_tp=2))
    track = w.prefill()
    w.decode(track)
    assert [t for o in track.d_outputs for t in o.new_token_ids] == dense.want(dense.prompt)
    load = one(w.d_spans, "kv.load")
    reads = named(w.d_spans, "kv.read")
    assert sorted((r.attributes["kvbridge.tp_rank"], r.attributes["kvbridge.remote_rank"]) for r in reads) == \
        [(0, 0), (1, 0)]
    assert all(child_of(r, load.context) and r.attributes["kvbridge.bytes"] > 0 for r in reads)
    assert sum(r.attributes["kvbridge.bytes"] for r in reads) == load.attributes["kvbridge.bytes"]
    assert one(w.p_spans, "kv.lease").attributes["kvbridge.outcome"] == "read_done"
    assert w.finish() == []


def test_tracing_off_makes_no_span_and_sends_no_traceparent(dense) -> None:
    w = TracedWorld(dense, traced=False)
    track = w.prefill()
    w.decode(track)
    assert w.check_bodies and all("traceparent" not in body for body in w.check_bodies)
    assert w.d_spans.get_finished_spans() == () and w.p_spans.get_finished_spans() == ()
    assert counts(w.d.connectors.worker.stats, "kvbridge_kv_load_seconds") == {"ok": 1}  # metrics stay on
    assert w.finish() == []
