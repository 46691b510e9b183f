"""D's engine spans (issue 30): engine.admission, engine.first_decode_step, and engine.recompute
after a failed load under policy recompute. In process: P and D engines on the real default
model, the fake transfer backend (its fault knobs fail D's reads) and the real side channel
(tests/integration/pd_harness.py). D's request carries a RequestTrace as the server hands it."""

from __future__ import annotations

import time

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from kvbridge.config import KVRole, LoadFailurePolicy
from kvbridge.engine.loader import load_model
from kvbridge.engine.sampling_params import SamplingParams
from kvbridge.kv_transfer.backends.fake import FakeFabric, FaultConfig
from kvbridge.kv_transfer.params import parse_kv_transfer_params
from kvbridge.tracing import RequestTrace, Tracing
from tests.integration.pd_harness import make_engine, prefill, settle, tokens

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
ENGINE_SPANS = {"engine.queue", "engine.admission", "engine.prefill", "engine.recompute", "engine.first_token",
                "engine.first_decode_step", "engine.decode"}

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def loaded():
    return load_model("SmolLM2-135M-Instruct")


@pytest.fixture
def pd(loaded):
    fabric = FakeFabric(seed=5)
    p = make_engine(loaded, KVRole.PRODUCER, fabric.create_agent("P"), engine_id="P")
    d = make_engine(loaded, KVRole.CONSUMER, fabric.create_agent("D"), engine_id="D",
                    policy=LoadFailurePolicy.RECOMPUTE)
    yield fabric, p, d
    settle(p, d)
    p.shutdown()
    d.shutdown()


def traced_decode(d, p, prompt, params) -> tuple[list, dict[str, list[ReadableSpan]], ReadableSpan]:
    """D's half of a request, traced under a stand-in for the server's instance.request span."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing = Tracing(provider, "kvbridge-decode-0")
    root = tracing.start_span("instance.request")
    d.add_request("d-1", prompt, GREEDY, parse_kv_transfer_params(params),
                  trace=RequestTrace(tracing, root.get_span_context()))
    outs = []
    deadline = time.monotonic() + 60
    while not (outs and outs[-1].finished):
        assert time.monotonic() < deadline, "D did not finish"
        outs += [o for o in d.step().outputs if o.request_id == "d-1"]
        p.step()
    root.end()
    spans: dict[str, list[ReadableSpan]] = {}
    [finished_root] = [s for s in exporter.get_finished_spans() if s.name == "instance.request"]
    for span in exporter.get_finished_spans():
        if span.name in ENGINE_SPANS:
            assert span.parent.span_id == finished_root.context.span_id, span.name
            spans.setdefault(span.name, []).append(span)
    provider.shutdown()
    return outs, spans, finished_root


def prompt_of(loaded, text: str) -> list[int]:
    tok = loaded.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))


def test_a_loaded_request_has_admission_and_first_decode_step(loaded, pd):
    _, p, d = pd
    prompt = prompt_of(loaded, "Name three rivers of Europe and say where they flow.")
    outs, spans, _ = traced_decode(d, p, prompt, prefill(p, prompt))
    assert set(spans) == {"engine.admission", "engine.first_decode_step", "engine.decode"}, set(spans)
    [admission], [first], [decode] = spans["engine.admission"], spans["engine.first_decode_step"], spans["engine.decode"]
    assert admission.attributes["kvbridge.num_tokens"] > 0 and admission.attributes["kvbridge.num_blocks"] > 0
    assert admission.end_time <= first.start_time == decode.start_time <= first.end_time <= decode.end_time
    assert decode.attributes["kvbridge.num_tokens"] == len(tokens(outs)) == GREEDY.max_tokens
    assert all(s.status.status_code is StatusCode.UNSET for group in spans.values() for s in group)


def test_a_failed_load_under_recompute_has_a_recompute_span(loaded, pd):
    fabric, p, d = pd
    prompt = prompt_of(loaded, "Tell me about the history of Rome, its emperors and its roads.")
    params = prefill(p, prompt)
    fabric.lookup("D").set_faults(FaultConfig(fail_read_setup=True))  # D's read fails: recompute locally
    outs, spans, _ = traced_decode(d, p, prompt, params)
    assert d.connectors.worker.stats.failed_transfers["transfer_setup"] == 1
    assert set(spans) == {"engine.admission", "engine.recompute", "engine.prefill", "engine.first_token",
                          "engine.decode"}, set(spans)
    [admission], [recompute], [first], [decode] = (spans[n] for n in ("engine.admission", "engine.recompute",
                                                                      "engine.first_token", "engine.decode"))
    chunks = spans["engine.prefill"]
    assert recompute.attributes["kvbridge.failure_kind"] == "transfer_setup"
    assert recompute.attributes["kvbridge.num_tokens"] == sum(c.attributes["kvbridge.num_tokens"] for c in chunks)
    assert recompute.attributes["kvbridge.num_tokens"] == len(prompt)  # no block loaded: all of it
    assert admission.end_time <= recompute.start_time <= chunks[0].start_time
    assert chunks[-1].end_time == recompute.end_time <= first.end_time <= decode.start_time
    assert decode.attributes["kvbridge.num_tokens"] == len(tokens(outs)) - 1 == GREEDY.max_tokens - 1
