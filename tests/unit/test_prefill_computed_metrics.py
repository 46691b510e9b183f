"""vllm:request_prefill_kv_computed_tokens and vllm:prompt_tokens_cached from finished outputs: the
prompt less the local prefix hit and the KV read from another instance is what this instance computed."""

from __future__ import annotations

from kvbridge.engine.outputs import RequestOutput
from kvbridge.engine.request import FinishReason, RequestTimes
from kvbridge.server.metrics import ServerMetrics

LABELS = {"model_name": "m", "engine": "0"}


def _times(first_token: float) -> RequestTimes:
    return RequestTimes(arrival=1.0, scheduled=2.0, first_token=first_token, last_token=first_token)


def _finish(metrics: ServerMetrics, prompt: int, cached: int, loaded: int, times: RequestTimes | None) -> None:
    timer = metrics.request_timer(clock=lambda: 10.0)
    timer.on_output(RequestOutput("r", [7], "x", True, FinishReason.LENGTH, num_prompt_tokens=prompt,
                                  num_output_tokens=1, num_cached_tokens=cached, num_loaded_tokens=loaded,
                                  times=times))


def _value(metrics: ServerMetrics, name: str, **extra: str) -> float:
    got = metrics.registry.get_sample_value(name, {**LABELS, **extra})
    assert got is not None, name
    return got


def test_computed_is_the_prompt_less_local_hits_and_loaded_kv() -> None:
    m = ServerMetrics("m", 512)
    assert _value(m, "vllm:prompt_tokens_cached_total") == 0
    _finish(m, prompt=40, cached=0, loaded=0, times=_times(3.0))  # computed all of it (P, first time)
    _finish(m, prompt=40, cached=32, loaded=0, times=_times(3.0))  # local hit: the tail only
    _finish(m, prompt=40, cached=16, loaded=23, times=_times(3.0))  # D: hit + read, the last token computed
    assert _value(m, "vllm:prompt_tokens_cached_total") == 32 + 16 + 23
    assert _value(m, "vllm:request_prefill_kv_computed_tokens_count") == 3
    assert _value(m, "vllm:request_prefill_kv_computed_tokens_sum") == 40 + 8 + 1
    # vLLM's 1-2-5 buckets up to max_model_len
    assert _value(m, "vllm:request_prefill_kv_computed_tokens_bucket", le="1.0") == 1
    assert _value(m, "vllm:request_prefill_kv_computed_tokens_bucket", le="10.0") == 2
    assert _value(m, "vllm:request_prefill_kv_computed_tokens_bucket", le="50.0") == 3
    assert m.registry.get_sample_value("vllm:request_prefill_kv_computed_tokens_bucket",
                                       {**LABELS, "le": "1000.0"}) is None
    text = m.render().decode()
    assert "# TYPE vllm:request_prefill_kv_computed_tokens histogram" in text
    assert "# TYPE vllm:prompt_tokens_cached_total counter" in text


def test_cached_never_exceeds_the_prompt() -> None:
    m = ServerMetrics("m", 512)
    _finish(m, prompt=16, cached=0, loaded=16, times=_times(3.0))  # D continuing from P's sampled token
    assert _value(m, "vllm:prompt_tokens_cached_total") == 16
    assert _value(m, "vllm:request_prefill_kv_computed_tokens_sum") == 0


def test_requests_without_a_completed_prefill_are_not_counted() -> None:
    m = ServerMetrics("m", 512)
    _finish(m, prompt=40, cached=32, loaded=0, times=_times(0.0))  # aborted before its first token
    _finish(m, prompt=40, cached=32, loaded=0, times=None)  # failed outside the engine
    assert _value(m, "vllm:prompt_tokens_cached_total") == 0
    assert _value(m, "vllm:request_prefill_kv_computed_tokens_count") == 0
    assert _value(m, "vllm:request_prompt_tokens_count") == 2  # still counted as requests
