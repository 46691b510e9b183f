"""An instance's spans (issue 30) and its vLLM-named per-phase histograms, on a real server.

One uvicorn server on loopback serves the real default model through the real engine, with a
small token budget (chunked prefill: a prompt takes several steps) and a small KV cache. Its
Tracing exports into memory (`SpanSink`: the SDK's InMemorySpanExporter behind a
SimpleSpanProcessor, which also wakes a waiting test when a span ends, as a stream's request span
ends after the client read its last byte). The official `openai` client sends the requests with
a W3C traceparent, as the proxy does. A second server on the same engine has tracing off.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch is imported

import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import uvicorn
from opentelemetry.sdk.trace import ReadableSpan, Tracer, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from prometheus_client.parser import text_string_to_metric_families

from kvbridge.config import CacheConfig, EngineConfig, SchedulerConfig
from kvbridge.engine.engine import LLMEngine
from kvbridge.engine.loader import LoadedModel, load_model
from kvbridge.server.api_server import bind_socket, build_app
from kvbridge.server.async_engine import AsyncEngine
from kvbridge.tracing import Tracing, parse_traceparent
from kvbridge.tracing import core as tracing_core

MODEL = "SmolLM2-135M-Instruct"
BUDGET = 16  # tokens per step: a prompt of more than 16 tokens is prefilled in several chunks
CONFIG = EngineConfig(model=MODEL, max_model_len=512, cache=CacheConfig(num_blocks=48, enable_prefix_caching=False),
                      scheduler=SchedulerConfig(max_num_seqs=4, max_waiting=8, max_num_batched_tokens=BUDGET))
TP = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
PARENT = parse_traceparent(TP)
LONG_PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle on the beach."
WAIT_S = 30.0

pytestmark = pytest.mark.timeout(180)


class SpanSink(InMemorySpanExporter):
    """Finished spans in memory; `wait_for` waits (on a condition, not a sleep) until some exist."""

    def __init__(self) -> None:
        super().__init__()
        self._cv = threading.Condition()

    def export(self, spans):
        result = super().export(spans)
        with self._cv:
            self._cv.notify_all()
        return result

    def wait_for(self, name: str, count: int = 1) -> list[ReadableSpan]:
        with self._cv:
            assert self._cv.wait_for(lambda: len(self.named(name)) >= count, WAIT_S), \
                f"{count} {name} span(s) did not end: {[s.name for s in self.get_finished_spans()]}"
        return self.named(name)

    def named(self, name: str) -> list[ReadableSpan]:
        return [s for s in self.get_finished_spans() if s.name == name]


class Instance:
    def __init__(self, engine: AsyncEngine, tracing: Tracing | None) -> None:
        sock = bind_socket("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(build_app(engine, tracing=tracing), log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.01)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=60,
                             default_headers={"traceparent": TP})

    def histograms(self) -> dict[str, dict[str, float]]:
        """vllm:* histogram name -> {"count", "sum"} of this server's one label set (model, engine 0)."""
        out: dict[str, dict[str, float]] = {}
        for family in text_string_to_metric_families(httpx.get(self.url + "/metrics", timeout=10).text):
            for sample in family.samples:
                if sample.name.startswith("vllm:") and sample.name.endswith(("_count", "_sum")):
                    assert sample.labels == {"model_name": MODEL, "engine": "0"}, sample
                    name, _, field = sample.name.rpartition("_")
                    out.setdefault(name, {})[field] = sample.value
        return out


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model(MODEL)


@pytest.fixture(scope="module")
def engine(loaded: LoadedModel) -> Iterator[AsyncEngine]:
    engine = AsyncEngine(LLMEngine(CONFIG, loaded))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def sink() -> SpanSink:
    return SpanSink()


@pytest.fixture(scope="module")
def traced(engine: AsyncEngine, sink: SpanSink) -> Iterator[Instance]:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(sink))
    instance = Instance(engine, Tracing(provider, "kvbridge-serve"))
    yield instance
    instance.close()
    provider.shutdown()


@pytest.fixture
def untraced(engine: AsyncEngine) -> Iterator[Instance]:
    instance = Instance(engine, None)  # a fresh server: its metrics start from zero
    yield instance
    instance.close()


@pytest.fixture(autouse=True)
def all_blocks_free_after_each_test(engine: AsyncEngine, sink: SpanSink) -> Iterator[None]:
    sink.clear()
    yield
    deadline = time.monotonic() + 10
    while True:
        m = engine.call_threadsafe(lambda e: e.metrics()).result(timeout=10)
        if m.num_free_blocks == m.num_total_blocks or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert m.num_free_blocks == m.num_total_blocks and m.num_running == 0 and m.num_waiting == 0, m


def request_trace(sink: SpanSink) -> tuple[ReadableSpan, dict[str, list[ReadableSpan]]]:
    """The one instance.request span, and its children by name (every span must be in its trace)."""
    [root] = sink.wait_for("instance.request")
    children: dict[str, list[ReadableSpan]] = {}
    for span in sink.get_finished_spans():
        assert span.context.trace_id == PARENT.trace_id, span.name
        if span is not root:
            assert span.parent.span_id == root.context.span_id, span.name
            children.setdefault(span.name, []).append(span)
    for spans in children.values():
        spans.sort(key=lambda s: s.start_time)
    return root, children


def assert_engine_spans(root: ReadableSpan, children: dict[str, list[ReadableSpan]], prompt_tokens: int,
                        output_tokens: int) -> None:
    def inside(span: ReadableSpan) -> None:
        assert root.start_time <= span.start_time <= span.end_time <= root.end_time, span.name

    [prepare], [queue], [first], [decode] = (children[n] for n in ("instance.prepare", "engine.queue",
                                                                   "engine.first_token", "engine.decode"))
    chunks = children["engine.prefill"]
    assert len(chunks) == -(-prompt_tokens // BUDGET) >= 2  # chunked prefill: one span per chunk
    assert [c.attributes["kvbridge.chunk"] for c in chunks] == list(range(len(chunks)))
    assert sum(c.attributes["kvbridge.num_tokens"] for c in chunks) == prompt_tokens
    assert prepare.attributes["kvbridge.num_tokens"] == prompt_tokens
    assert decode.attributes["kvbridge.num_tokens"] == output_tokens - 1  # all but the prefill's token
    for span in (prepare, queue, first, decode, *chunks):
        inside(span)
        assert span.status.status_code is StatusCode.UNSET, span.name
    # In order: prepared, queued, chunk after chunk, the first token (its step is the last chunk's), decode.
    assert prepare.end_time <= queue.end_time <= chunks[0].start_time
    assert all(a.end_time <= b.start_time for a, b in zip(chunks, chunks[1:]))
    assert first.start_time == chunks[-1].start_time and first.end_time >= chunks[-1].end_time
    assert first.end_time <= decode.start_time
    assert not {"engine.admission", "engine.recompute", "engine.first_decode_step"} & set(children)
    assert root.kind is SpanKind.SERVER and root.parent.span_id == PARENT.span_id and root.parent.is_remote
    assert root.status.status_code is StatusCode.UNSET
    a = root.attributes
    assert a["http.response.status_code"] == 200 and a["kvbridge.role"] == "colocated"
    assert a["gen_ai.usage.input_tokens"] == prompt_tokens and a["gen_ai.usage.output_tokens"] == output_tokens
    assert list(a["gen_ai.response.finish_reasons"]) == ["length"] and a["kvbridge.request_id"]


def test_a_completion_is_one_trace_under_the_callers_span(traced: Instance, sink: SpanSink) -> None:
    r = traced.client().completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=6, temperature=0,
                                           extra_body={"ignore_eos": True})
    root, children = request_trace(sink)
    assert root.attributes["http.route"] == "/v1/completions"
    assert_engine_spans(root, children, r.usage.prompt_tokens, r.usage.completion_tokens)
    assert "instance.stream" not in children


def test_a_streamed_chat_is_one_trace_with_its_stream_span(traced: Instance, sink: SpanSink) -> None:
    stream = traced.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": LONG_PROMPT}], max_tokens=5, temperature=0,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    usage = chunks[-1].usage
    root, children = request_trace(sink)  # ends after the last byte: waited for, not raced
    assert root.attributes["http.route"] == "/v1/chat/completions"
    assert_engine_spans(root, children, usage.prompt_tokens, usage.completion_tokens)
    [stream_span] = children["instance.stream"]
    assert stream_span.attributes["kvbridge.num_chunks"] == len(chunks) + 1  # and [DONE]
    assert children["instance.prepare"][0].end_time <= stream_span.start_time
    assert children["engine.decode"][0].end_time <= stream_span.end_time <= root.end_time
    assert stream_span.status.status_code is StatusCode.UNSET


def test_a_bad_request_ends_its_span_with_error(traced: Instance, sink: SpanSink) -> None:
    with pytest.raises(openai.BadRequestError):
        traced.client().completions.create(model=MODEL, prompt="Hi", max_tokens=-3)
    root, children = request_trace(sink)
    assert root.status.status_code is StatusCode.ERROR and "max_tokens" in root.status.description
    assert root.attributes["http.response.status_code"] == 400
    [prepare] = children["instance.prepare"]
    assert prepare.status.status_code is StatusCode.ERROR
    assert set(children) == {"instance.prepare"}  # it never reached the engine


def test_a_request_without_a_traceparent_starts_a_trace(traced: Instance, sink: SpanSink) -> None:
    httpx.post(traced.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60,
               headers={"traceparent": "garbage"}).raise_for_status()
    [root] = sink.wait_for("instance.request")
    assert root.parent is None
    assert {s.context.trace_id for s in sink.get_finished_spans()} == {root.context.trace_id}
    assert {s.name for s in sink.get_finished_spans()} >= {"engine.queue", "engine.prefill", "engine.first_token"}


def test_tracing_off_makes_no_spans_and_the_vllm_histograms_count_every_request(
        traced: Instance, untraced: Instance, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a span was made while tracing is off")

    for cls, name in ((Tracer, "start_span"), (Tracer, "start_as_current_span"),
                      (tracing_core.Tracing, "start_span"), (tracing_core.Tracing, "record")):
        monkeypatch.setattr(cls, name, refuse)
    # The trap works: the traced server, on the same engine, fails at its first span.
    assert httpx.post(traced.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2},
                      timeout=60).status_code == 500
    client = untraced.client()
    usages = [client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=4,
                                        extra_body={"ignore_eos": True}).usage,
              client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, extra_body={"ignore_eos": True}).usage]
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=5, stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    usages.append(chunks[-1].usage)
    # The stream's last output is counted before its [DONE] is written, but wait on the counter anyway.
    deadline = time.monotonic() + WAIT_S
    while (h := untraced.histograms())["vllm:e2e_request_latency_seconds"]["count"] < 3:
        assert time.monotonic() < deadline, h
        time.sleep(0.05)
    n = len(usages)
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds", "request_inference_time_seconds",
                 "request_prompt_tokens", "request_generation_tokens"):
        assert h["vllm:" + name]["count"] == n, name
    assert h["vllm:inter_token_latency_seconds"]["count"] == sum(u.completion_tokens - 1 for u in usages)
    assert h["vllm:request_prompt_tokens"]["sum"] == sum(u.prompt_tokens for u in usages)
    assert h["vllm:request_generation_tokens"]["sum"] == sum(u.completion_tokens for u in usages)
    seconds = {name: h["vllm:request_" + name + "_time_seconds"]["sum"]
               for name in ("queue", "prefill", "decode", "inference")}
    assert all(v > 0 for v in seconds.values()), seconds
    assert seconds["queue"] + seconds["prefill"] + seconds["decode"] <= h["vllm:e2e_request_latency_seconds"]["sum"]
    assert seconds["inference"] == pytest.approx(seconds["prefill"] + seconds["decode"], rel=1e-6)
    assert h["vllm:time_to_first_token_seconds"]["sum"] <= h["vllm:e2e_request_latency_seconds"]["sum"]
    # kvbridge's own histograms are still there.
    text = httpx.get(untraced.url + "/metrics", timeout=10).text
    assert "kvbridge_time_to_first_token_seconds_count 3.0" in text
