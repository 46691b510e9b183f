"""KV-aware routing through real processes: a proxy with `--decode-policy kv_aware --pd-mode
auto` in front of 2 P and 2 D `kvbridge serve` (the default model, fp32, small KV caches,
loopback), each publishing KV events. The next turn of a conversation goes to the D that holds
the previous one and, its new text short, is served by that D alone (reason `cost`) with the
answer one engine gives; the first request, before any rate is measured, goes through P; every
prediction of cached tokens equals what the instance reports. Killed, the holder leaves the
router's index, and the turn after is answered right without it."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest

from kvbridge.config import CacheConfig, EngineConfig
from kvbridge.engine.engine import LLMEngine
from kvbridge.engine.loader import load_model
from kvbridge.engine.sampling_params import SamplingParams
from kvbridge.engine.setup.default_model import DEFAULT_MODEL
from kvbridge.launcher.cluster import LocalCluster
from tests.e2e.processes import assert_all_blocks_free

BLOCK = 16
TURN_1 = ("The history of the Roman Empire spans many centuries, from the founding of the city to the fall of "
          "Constantinople. Summarise its three most important turning points, with a date for each, and say "
          "which of them mattered most for the people who lived through it:")
TURN_2 = " Now in one sentence."
LONG = " ".join(f"Item {i}: a long new document about rivers, mountains and the weather of every season."
                for i in range(12))
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    cluster = LocalCluster(DEFAULT_MODEL, 2, 2, port=0, kv_backend="nixl", num_threads=1,
                           extra_serve_args=["--dtype", "float32", "--num-blocks", "64", "--max-model-len", "512"],
                           proxy_args=["--prefill-policy", "kv_aware", "--decode-policy", "kv_aware",
                                       "--pd-mode", "auto", "--health-interval", "0.5"],
                           log_dir=tmp_path_factory.mktemp("kv-routing"))
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def reference():
    loaded = load_model(DEFAULT_MODEL)
    engine = LLMEngine(EngineConfig(cache=CacheConfig(num_blocks=64), num_threads=1, dtype="float32"), loaded)

    def answer(prompt: str) -> str:
        out = engine.generate([loaded.tokenizer.encode(prompt)], SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                                                               ignore_eos=True))[0]
        return loaded.tokenizer.decode(out)
    return answer


def complete(proxy: str, prompt: str) -> httpx.Response:
    r = httpx.post(proxy + "/v1/completions", json={"model": DEFAULT_MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS,
                                                    "temperature": 0, "ignore_eos": True}, timeout=120)
    assert r.status_code == 200, r.text
    return r


def wait_fleet(proxy: str, done, what: str, timeout_s: float = 30.0) -> dict:
    """Until the proxy's fleet view satisfies `done` (its feeds ingest on their own threads)."""
    deadline = time.monotonic() + timeout_s
    while not done(view := httpx.get(proxy + "/kvbridge/fleet", timeout=10).json()):
        assert time.monotonic() < deadline, f"{what}: {view}"
        time.sleep(0.1)
    return view


def held(view: dict, url: str) -> int:
    return view["instances"].get(url, {}).get("blocks", {}).get("0", 0)


def prediction_errors(proxy: str) -> tuple[float, float]:
    """(observations, those exactly 0) of the proxy's predicted-minus-reported histogram."""
    text = httpx.get(proxy + "/metrics", timeout=10).text
    value = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
             if line.startswith("kvbridge_proxy_cached_tokens_prediction_error")}
    bucket = "kvbridge_proxy_cached_tokens_prediction_error_bucket"
    return (value["kvbridge_proxy_cached_tokens_prediction_error_count"],
            value[f'{bucket}{{le="0.0"}}'] - value[f'{bucket}{{le="-1.0"}}'])


def stream_completion(proxy: str, prompt: str) -> tuple[str, str, dict]:
    """(the pd path header, the text, the usage event) of a streamed completion with usage asked for."""
    text, usage = "", None
    with httpx.stream("POST", proxy + "/v1/completions", timeout=120, json={
            "model": DEFAULT_MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            text += "".join(c.get("text") or "" for c in event.get("choices", ()))
            usage = event.get("usage") or usage
        return r.headers["x-kvbridge-pd-path"], text, usage


def test_the_next_turn_goes_to_the_d_holding_the_last_served_alone_by_cost(fleet, reference):
    proxy, decode = fleet.urls.proxy, list(fleet.urls.decode)
    wait_fleet(proxy, lambda v: all(u in v["instances"] and v["instances"][u]["load"] for u in decode),
               "every D followed")
    first = complete(proxy, TURN_1)
    assert first.headers["x-kvbridge-pd-path"] == "prefill_decode"  # nothing cached, no rate measured yet
    assert first.json()["choices"][0]["text"] == reference(TURN_1)
    history = TURN_1 + first.json()["choices"][0]["text"]
    blocks = (first.json()["usage"]["prompt_tokens"] - 1) // BLOCK
    assert blocks >= 2
    # The D that served turn 1 cached its prompt's blocks (read from P) and publishes them.
    view = wait_fleet(proxy, lambda v: max(held(v, u) for u in decode) >= blocks, "turn 1's blocks on a D")
    holder = max(decode, key=lambda u: held(view, u))
    assert min(held(view, u) for u in decode) == 0  # the other D holds nothing

    second = complete(proxy, history + TURN_2)
    assert (second.headers["x-kvbridge-pd-path"], second.headers["x-kvbridge-pd-reason"]) == ("decode_only", "cost")
    assert second.json()["choices"][0]["text"] == reference(history + TURN_2)
    cached = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= blocks * BLOCK, second.json()["usage"]  # served by the holder, from its cache
    assert held(httpx.get(proxy + "/kvbridge/fleet", timeout=10).json(), holder) >= blocks

    # A long prompt no one holds, the fleet idle: D's own prefill (P's measured rate standing in
    # for D's) beats P's prefill plus the transfer, and no stream on D would wait for it. (With D
    # busy, P wins: the cost table in tests/unit/test_kv_routing_cost.py.)
    third = complete(proxy, LONG)
    assert (third.headers["x-kvbridge-pd-path"], third.headers["x-kvbridge-pd-reason"]) == ("decode_only", "cost")
    assert third.json()["choices"][0]["text"] == reference(LONG)
    observed, exact = prediction_errors(proxy)
    assert observed >= 3 and exact == observed  # P's legs and D's answer alone, each predicted exactly
    # Turn 2 again, streamed with its usage: D alone's usage event is checked against the prediction too
    path, text, usage = stream_completion(proxy, history + TURN_2)
    assert path == "decode_only" and text == second.json()["choices"][0]["text"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= blocks * BLOCK
    assert prediction_errors(proxy) == (observed + 1, exact + 1)
    assert_all_blocks_free([*fleet.urls.prefill, *fleet.urls.decode])

    # The holder dies between turns: the router drops what it held, and the next turn is recomputed
    # (through P, which still holds turn 1's prompt, or on the other D) with the right answer.
    urls = (*fleet.urls.prefill, *fleet.urls.decode, fleet.urls.proxy)
    os.kill(next(child.pid for child, url in zip(fleet.children, urls) if url == holder), signal.SIGKILL)
    wait_fleet(proxy, lambda v: holder not in v["instances"], "the killed holder dropped from the index")
    history = history + TURN_2 + second.json()["choices"][0]["text"]
    fourth = complete(proxy, history + TURN_2)
    assert fourth.json()["choices"][0]["text"] == reference(history + TURN_2)
    # the D left has never read KV from a P, so it may have no pull rate to weigh yet
    assert fourth.headers["x-kvbridge-pd-reason"] in ("cost", "no_measured_rate"), fourth.headers
    alive = [u for u in (*fleet.urls.prefill, *fleet.urls.decode) if u != holder]
    assert_all_blocks_free(alive)
