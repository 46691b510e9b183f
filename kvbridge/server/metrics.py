"""Prometheus metrics of one API server, on a registry of its own.

Each server gets its own CollectorRegistry (never the process-global one) so several
servers can live in one process, as they do in tests. Other components (the KV
connector's stats) register their collectors on `ServerMetrics.registry`, which the
app also exposes as `app.state.registry`; everything is served by GET /metrics.

Per-request numbers are recorded by a RequestTimer fed with the request's outputs;
the per-phase histograms (queue, prefill, decode, inference) come from the engine's phase
times on the finished output (RequestTimes). Besides kvbridge's own `kvbridge_*` metrics the
request histograms are exported under vLLM v1's names, labels (`model_name`, `engine`) and
buckets (vllm/v1/metrics/loggers.py), so dashboards built for vLLM work unchanged:
vllm:time_to_first_token_seconds, vllm:inter_token_latency_seconds,
vllm:e2e_request_latency_seconds, vllm:request_queue_time_seconds,
vllm:request_prefill_time_seconds, vllm:request_decode_time_seconds,
vllm:request_inference_time_seconds, vllm:request_prompt_tokens,
vllm:request_generation_tokens, vllm:request_prefill_kv_computed_tokens (prompt tokens this instance
computed: the prompt less its local prefix hit and the KV read from another instance) and the counter
vllm:prompt_tokens_cached (those it did not compute), so a fleet's computed tokens per request sum
from outside. Engine-wide gauges (queue lengths, KV cache usage, prefix cache counters) come from
the latest EngineMetrics snapshot, which the server refreshes on every scrape. The load gauges (what GET
/kvbridge/load answers: queued prompt tokens, the oldest wait, leases held, draining, the role) come from
the load snapshot the engine thread publishes after each step (`LoadCollector`), read without waiting.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvbridge.engine.outputs import RequestOutput
from kvbridge.engine.request import FinishReason

if TYPE_CHECKING:
    from kvbridge.engine.engine import EngineLoad, EngineMetrics

PREFIX = "kvbridge_"
CONTENT_TYPE = CONTENT_TYPE_LATEST

# Seconds. CPU prefill of long prompts takes seconds, GPU decode steps milliseconds.
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                    5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
                0.75, 1.0, 2.5)

VLLM_PREFIX = "vllm:"
VLLM_LABELS = ("model_name", "engine")  # engine: the engine index, always 0 (one engine per server)
# vLLM v1's buckets (vllm/v1/metrics/loggers.py).
_VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                      10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_VLLM_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                     20.0, 40.0, 80.0)
_VLLM_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                         120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


def token_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value` (vLLM's build_1_2_5_buckets)."""
    buckets: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10


class Outcome(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"
    REJECTED = "rejected"  # refused before reaching the engine, or by its admission check

    @classmethod
    def of(cls, reason: FinishReason | None) -> Outcome:
        return cls(reason.value) if reason is not None else cls.ERROR


class ServerMetrics:
    def __init__(self, model_name: str, max_model_len: int, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            PREFIX + "requests", "Requests by outcome (stop, length, abort, error, rejected).",
            ["outcome"], registry=r)
        for outcome in Outcome:
            self.requests.labels(outcome.value)  # export zeros, so rates work from the start
        self.time_to_first_token = Histogram(
            PREFIX + "time_to_first_token_seconds", "From arrival to the first output token.",
            buckets=_LATENCY_BUCKETS, registry=r)
        self.inter_token_latency = Histogram(
            PREFIX + "inter_token_latency_seconds",
            "Between consecutive outputs that carry tokens, per request.",
            buckets=_ITL_BUCKETS, registry=r)
        self.e2e_latency = Histogram(
            PREFIX + "e2e_request_latency_seconds", "From arrival to the finished output.",
            buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter(
            PREFIX + "generation_tokens", "Tokens generated by finished requests.", registry=r)
        self.undelivered_releases = Counter(
            PREFIX + "undelivered_answer_releases",
            "Prefill answers that never reached their caller (it left, its connection broke, or it "
            "released the attempt's key): their leases ended at once.", registry=r)
        self.vllm = _VllmHistograms(r, model_name, max_model_len)
        self._engine = _EngineCollector()
        r.register(self._engine)

    def update_engine(self, snapshot: EngineMetrics | None, healthy: bool) -> None:
        """Called before each scrape with the engine's current numbers (None: unavailable)."""
        self._engine.snapshot = snapshot
        self._engine.healthy = healthy

    def record_rejected(self) -> None:
        self.requests.labels(Outcome.REJECTED.value).inc()

    def record_undelivered_release(self) -> None:
        self.undelivered_releases.inc()

    def request_timer(self, clock: Callable[[], float] = time.monotonic) -> RequestTimer:
        return RequestTimer(self, clock)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _VllmHistograms:
    """vLLM v1's per-request histograms, bound to this server's label values."""

    def __init__(self, r: CollectorRegistry, model_name: str, max_model_len: int) -> None:
        labels = (model_name, "0")

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(VLLM_PREFIX + name, doc, VLLM_LABELS, buckets=buckets, registry=r).labels(*labels)

        self.time_to_first_token = histogram("time_to_first_token_seconds",
                                             "Histogram of time to first token in seconds.", _VLLM_TTFT_BUCKETS)
        self.inter_token_latency = histogram("inter_token_latency_seconds",
                                             "Histogram of inter-token latency in seconds.", _VLLM_ITL_BUCKETS)
        self.e2e_latency = histogram("e2e_request_latency_seconds",
                                     "Histogram of e2e request latency in seconds.", _VLLM_REQUEST_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.", _VLLM_REQUEST_BUCKETS)
        self.prefill_time = histogram("request_prefill_time_seconds",
                                      "Histogram of time spent in PREFILL phase for request.", _VLLM_REQUEST_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds",
                                     "Histogram of time spent in DECODE phase for request.", _VLLM_REQUEST_BUCKETS)
        self.inference_time = histogram("request_inference_time_seconds",
                                        "Histogram of time spent in RUNNING phase for request.",
                                        _VLLM_REQUEST_BUCKETS)
        tokens = token_buckets(max_model_len)
        self.prompt_tokens = histogram("request_prompt_tokens", "Number of prefill tokens processed.", tokens)
        self.generation_tokens = histogram("request_generation_tokens", "Number of generation tokens processed.",
                                           tokens)
        self.prefill_kv_computed_tokens = histogram(
            "request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).", tokens)
        self.prompt_tokens_cached = Counter(
            VLLM_PREFIX + "prompt_tokens_cached", "Number of cached prompt tokens (local + external).",
            VLLM_LABELS, registry=r).labels(*labels)

    def finished(self, output: RequestOutput, e2e_s: float) -> None:
        self.e2e_latency.observe(e2e_s)
        self.prompt_tokens.observe(output.num_prompt_tokens)
        self.generation_tokens.observe(output.num_output_tokens)
        times = output.times
        if times is None:  # failed outside the engine's request path (the engine died)
            return
        if times.first_token:  # its prefill completed here
            cached = min(output.num_cached_tokens + output.num_loaded_tokens, output.num_prompt_tokens)
            self.prompt_tokens_cached.inc(cached)
            self.prefill_kv_computed_tokens.observe(output.num_prompt_tokens - cached)
        for histogram, seconds in ((self.queue_time, times.queue_s), (self.prefill_time, times.prefill_s),
                                   (self.decode_time, times.decode_s), (self.inference_time, times.inference_s)):
            if seconds is not None:  # phases the request reached
                histogram.observe(seconds)


class RequestTimer:
    """Feed it every output of one admitted request, in order."""

    def __init__(self, metrics: ServerMetrics, clock: Callable[[], float]) -> None:
        self._metrics = metrics
        self._clock = clock
        self._start = clock()
        self._last_token_at: float | None = None
        self._done = False

    def on_abandoned(self) -> None:
        """The consumer left before the finished output (client gone): count an abort."""
        if not self._done:
            self._done = True
            self._metrics.requests.labels(Outcome.ABORT.value).inc()
            e2e = self._clock() - self._start
            self._metrics.e2e_latency.observe(e2e)
            self._metrics.vllm.e2e_latency.observe(e2e)

    def on_output(self, output: RequestOutput) -> None:
        now = self._clock()
        if output.new_token_ids:
            if self._last_token_at is None:
                self._metrics.time_to_first_token.observe(now - self._start)
                self._metrics.vllm.time_to_first_token.observe(now - self._start)
            else:
                self._metrics.inter_token_latency.observe(now - self._last_token_at)
                self._metrics.vllm.inter_token_latency.observe(now - self._last_token_at)
            self._last_token_at = now
        if output.finished and not self._done:
            self._done = True
            m = self._metrics
            m.requests.labels(Outcome.of(output.finish_reason).value).inc()
            m.e2e_latency.observe(now - self._start)
            m.prompt_tokens.inc(output.num_prompt_tokens)
            m.generation_tokens.inc(output.num_output_tokens)
            m.vllm.finished(output, now - self._start)


class _EngineCollector(Collector):
    """Exports the latest EngineMetrics snapshot; exports nothing but health without one."""

    def __init__(self) -> None:
        self.snapshot: EngineMetrics | None = None
        self.healthy = True

    def describe(self) -> list[Metric]:
        return []  # values are only known at collect time

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(PREFIX + "engine_healthy",
                                "1 while the engine serves requests, 0 when dead or stopping.",
                                value=1.0 if self.healthy else 0.0)
        s = self.snapshot
        if s is None:
            return
        yield GaugeMetricFamily(PREFIX + "num_requests_running", "Requests being computed.",
                                value=s.num_running)
        yield GaugeMetricFamily(PREFIX + "num_requests_waiting", "Requests waiting to be scheduled.",
                                value=s.num_waiting)
        yield GaugeMetricFamily(PREFIX + "kv_cache_usage_ratio",
                                "Fraction of KV cache blocks in use (0 to 1).",
                                value=s.kv_cache_usage)
        yield GaugeMetricFamily(PREFIX + "kv_cache_free_blocks", "Free KV cache blocks.",
                                value=s.num_free_blocks)
        yield GaugeMetricFamily(PREFIX + "kv_cache_total_blocks", "KV cache blocks in all.",
                                value=s.num_total_blocks)
        yield CounterMetricFamily(PREFIX + "prefix_cache_queries",
                                  "Prompt tokens looked up in the prefix cache.",
                                  value=s.prefix_cache_queries)
        yield CounterMetricFamily(PREFIX + "prefix_cache_hits",
                                  "Prompt tokens found in the prefix cache.",
                                  value=s.prefix_cache_hits)
        rate = s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0
        yield GaugeMetricFamily(PREFIX + "prefix_cache_hit_rate",
                                "Prefix cache hits over queries since start (tokens).", value=rate)


class LoadCollector(Collector):
    """Exports the load gauges from `load()` (the engine thread's latest EngineLoad, read without
    waiting) and `draining()` at each scrape."""

    def __init__(self, load: Callable[[], EngineLoad], draining: Callable[[], bool],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._load, self._draining, self._clock = load, draining, clock

    def describe(self) -> list[Metric]:
        return []  # values are only known at collect time

    def collect(self) -> Iterator[Metric]:
        load = self._load()
        role = GaugeMetricFamily(PREFIX + "instance_role", "1, labelled with this instance's role (prefill, "
                                 "decode or both).", labels=["role"])
        role.add_metric([load.role], 1.0)
        yield role
        yield GaugeMetricFamily(PREFIX + "draining", "1 while the instance drains (takes no new requests).",
                                value=1.0 if self._draining() else 0.0)
        yield GaugeMetricFamily(PREFIX + "queued_prompt_tokens",
                                "Prompt tokens of waiting requests not computed yet.", value=load.queued_prompt_tokens)
        yield GaugeMetricFamily(PREFIX + "oldest_wait_seconds", "How long the oldest waiting request has waited "
                                "(0 when none waits).", value=load.oldest_wait_s(self._clock()))
        yield GaugeMetricFamily(PREFIX + "leases_held", "Leases on KV blocks granted to decode instances and "
                                "not ended yet (prefill instances).", value=load.leases_held)
