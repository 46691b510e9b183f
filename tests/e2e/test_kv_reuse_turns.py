"""KV reuse across turns through `kvbridge up`'s cluster (LocalCluster with kv_reuse: every instance of
role both, the proxy's --kv-reuse on), 2 P + 2 D on the default model, fp32, loopback, and a second
proxy in front of one P and one D of it (1P1D). Every turn goes through P (--pd-mode always): from
turn 2 on, P reads the conversation's history from the D that answered the last turn and computes
only the new tokens (its vllm:request_prefill_kv_computed_tokens say so), D reads from P only the
blocks it lacks, and every answer is a colocated engine's. Then the holder is killed between turns:
the next turn is recomputed, with the right answer, and every block is free on the instances left;
restarted at the same address, it is followed again, its entries rebuilt from nothing."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

import httpx
import openai
import pytest

from kvbridge.config import CacheConfig, EngineConfig, KVRole
from kvbridge.engine.engine import LLMEngine
from kvbridge.engine.loader import load_model
from kvbridge.engine.sampling_params import SamplingParams
from kvbridge.engine.tokenizer import Tokenizer
from kvbridge.engine.setup.default_model import DEFAULT_MODEL
from kvbridge.launcher.cluster import (InstanceSpec, LocalCluster, child_env, free_ports, http_url, proxy_command,
                                      serve_command)
from tests.e2e.processes import assert_all_blocks_free, metric_total

pytestmark = [pytest.mark.cluster, pytest.mark.model]

BLOCK = 16
MAX_TOKENS = 20  # over a block: the D that answered holds at least a block more than the P that computed
# the last prompt
OPENING = ("The history of the Roman Empire spans many centuries, from the founding of the city to the fall of "
           "Constantinople. Summarise its three most important turning points:")
FOLLOW_UPS = [" Tell me more about the first.", " And the second one?", " Which emperor mattered most?",
              " Why did the west fall?", " Say it in one sentence."]
COMPUTED = "vllm:request_prefill_kv_computed_tokens_sum"
HELD = "x-kvbridge-kv-reused-tokens"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = LocalCluster(DEFAULT_MODEL, 2, 2, port=0, kv_backend="nixl", num_threads=1, kv_reuse=True,
                     extra_serve_args=["--dtype", "float32", "--num-blocks", "96", "--max-model-len", "1024"],
                     proxy_args=["--prefill-policy", "kv_aware", "--decode-policy", "kv_aware",
                                 "--health-interval", "0.5"],
                     log_dir=tmp_path_factory.mktemp("kv-reuse"))
    c.start()
    try:
        yield c
    finally:
        c.stop()


@dataclass
class Reference:
    """A colocated fp32 engine: each turn's answer as token ids, which the next turn's prompt carries
    (a client replaying text instead retokenises the answer, which may differ from the tokens D
    generated, and then nothing after the first difference is reusable anywhere: the same in vLLM)."""

    engine: LLMEngine
    tokenizer: Tokenizer

    def answer(self, prompt: list[int]) -> list[int]:
        return self.engine.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))[0]

    def ids(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)


@pytest.fixture(scope="module")
def reference():
    loaded = load_model(DEFAULT_MODEL)
    return Reference(LLMEngine(EngineConfig(cache=CacheConfig(num_blocks=96), num_threads=1, dtype="float32"), loaded),
                     loaded.tokenizer)


def complete(proxy: str, prompt: list[int]) -> httpx.Response:
    r = httpx.post(proxy + "/v1/completions", json={"model": DEFAULT_MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS,
                                                    "temperature": 0, "ignore_eos": True}, timeout=120)
    assert r.status_code == 200, r.text
    return r


def predicted(proxy: str, prompt: list[int]) -> dict[str, int]:
    r = httpx.post(proxy + "/kvbridge/fleet/predict", json={"model": DEFAULT_MODEL, "prompt": prompt}, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()["cached"]


def holder_of(proxy: str, prompt: list[int], tokens: int, among: tuple[str, ...],
              timeout_s: float = 30.0) -> tuple[str, int]:
    """The instance of `among` the proxy's fleet view predicts holds the most of `prompt`, and how much,
    once that is `tokens` or more (an instance's KV events reach the proxy a moment after its answer)."""
    deadline = time.monotonic() + timeout_s
    while True:
        cached = predicted(proxy, prompt)
        best = max(among, key=lambda u: cached.get(u, 0))
        if cached.get(best, 0) >= tokens:
            return best, cached[best]
        assert time.monotonic() < deadline, (cached, tokens)
        time.sleep(0.05)


def computed_on(urls: tuple[str, ...]) -> float:
    return sum(metric_total(u, COMPUTED) for u in urls)


def converse(proxy: str, prefill: tuple[str, ...], decode: tuple[str, ...], reference: Reference,
             turns: list[str]) -> list[int]:
    """A conversation through `proxy`: each turn's prompt (token ids) is the last one, its answer and the
    next text. Returns the last history."""
    history: list[int] = []
    for i, text in enumerate(turns):
        prompt = history + reference.ids(text)
        # the D that answered holds every full block of the history it computed (prompt and answer but
        # its last token, sampled and never fed back) before the turn is routed: its KV events reach the
        # proxy a moment after its answer
        whole = (len(history) - 1) // BLOCK * BLOCK if history else 0
        expect = holder_of(proxy, prompt, whole, decode)[1] if i else 0
        before = computed_on(prefill)
        r = complete(proxy, prompt)
        body = r.json()
        assert r.headers["x-kvbridge-pd-path"] == "prefill_decode"
        answer = reference.answer(prompt)
        assert body["choices"][0]["text"] == reference.tokenizer.decode(answer), (i, prompt)
        n = body["usage"]["prompt_tokens"]
        assert n == len(prompt)
        on_p = computed_on(prefill) - before
        if i == 0:
            assert HELD not in r.headers and on_p == n  # nothing held anywhere: P computes the prompt
        else:
            # every full block of the history, read from the D that answered it: P computed the rest alone
            held = int(r.headers[HELD])
            assert held == expect == whole, (i, held, expect, len(history))
            assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == held  # computed nowhere for it
            assert on_p == n - held, (i, on_p, n, held)
        history = prompt + answer
    return history


def test_six_turns_2p2d_then_1p1d_read_the_history_from_its_holder(cluster, reference):
    urls = cluster.urls
    converse(urls.proxy, urls.prefill, urls.decode, reference, [OPENING, *FOLLOW_UPS])
    assert_all_blocks_free([*urls.prefill, *urls.decode])

    # the same through a proxy in front of one P and one D of the cluster (1P1D), a new conversation
    port = free_ports(1)[0]
    cluster._spawn("proxy-1p1d", proxy_command(cluster.cli, urls.prefill[:1], urls.decode[:1], host="127.0.0.1",
                                               port=port, extra_args=["--kv-reuse", "on", "--health-interval", "0.5"]),
                   dict(os.environ, UCX_NET_DEVICES="lo"), http_url("127.0.0.1", port))
    cluster.wait_healthy(60)
    small = http_url("127.0.0.1", port)
    converse(small, urls.prefill[:1], urls.decode[:1], reference,
             ["A different story: the rivers of Europe, from the Danube to the Rhine, and the cities on them.",
              *FOLLOW_UPS[:2]])
    assert_all_blocks_free([*urls.prefill, *urls.decode])


def test_the_holder_killed_between_turns_is_recomputed_then_restarted_and_followed_again(cluster, reference):
    urls = cluster.urls
    history = converse(urls.proxy, urls.prefill, urls.decode, reference,
                       ["Tell me about the mountains of Asia, the highest ones first, and who climbed them:"])
    holder = holder_of(urls.proxy, history + reference.ids(FOLLOW_UPS[0]), (len(history) - 1) // BLOCK * BLOCK,
                       urls.decode)[0]
    killed = next(c for c in cluster.children if cluster._health_urls[c.name] == holder)
    os.kill(killed.pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while holder in httpx.get(urls.proxy + "/kvbridge/fleet", timeout=10).json()["instances"]:
        assert time.monotonic() < deadline, "the killed holder is still in the fleet view"
        time.sleep(0.1)
    prompt = history + reference.ids(FOLLOW_UPS[0])
    r = complete(urls.proxy, prompt)
    assert r.json()["choices"][0]["text"] == reference.tokenizer.decode(reference.answer(prompt))
    assert_all_blocks_free([u for u in (*urls.prefill, *urls.decode) if u != holder])

    # Restarted at the same address (a new engine: new id, empty cache), it is followed again from
    # nothing: its index entries are rebuilt from its own events, none carried over from before.
    killed.popen.wait()
    cluster.children.remove(killed)
    port = int(holder.rsplit(":", 1)[1])
    spec = InstanceSpec(killed.name, KVRole.BOTH, port, free_ports(1)[0], f"{killed.name}-again", pool="decode")
    argv = serve_command(cluster.cli, DEFAULT_MODEL, spec, host="127.0.0.1", kv_backend="nixl", num_threads=1,
                         extra_args=[*cluster.extra_serve_args, *cluster._kv_events_args()])
    cluster._spawn(killed.name, argv, child_env(os.environ, loopback_only=True, num_threads=1), holder)
    cluster.wait_healthy(120)
    fresh = reference.ids("A fresh story about lighthouses on rocky coasts, their keepers and the ships they saved.")
    deadline = time.monotonic() + 30
    while holder not in (view := httpx.get(urls.proxy + "/kvbridge/fleet", timeout=10).json())["instances"]:
        assert time.monotonic() < deadline, f"the restarted instance is not followed: {view}"
        time.sleep(0.1)
    assert predicted(urls.proxy, prompt)[holder] == 0  # none of what it held before the kill
    served = httpx.post(holder + "/v1/completions", json={"model": DEFAULT_MODEL, "prompt": fresh, "max_tokens": 2},
                        timeout=120)  # straight to it: its own cache, its own events
    assert served.status_code == 200, served.text
    assert len(fresh) > BLOCK
    holder_of(urls.proxy, fresh + [1], len(fresh) // BLOCK * BLOCK, (holder,))
    assert_all_blocks_free([*urls.prefill, *urls.decode])


def test_a_streamed_chat_turn_reports_the_reused_history_in_its_usage(cluster):
    """The chat API, streamed, through the official client: turn 2's usage (stream_options) counts the
    history's held tokens as cached, as the proxy's header names them."""
    client = openai.OpenAI(base_url=cluster.urls.proxy + "/v1", api_key="unused", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "Name the planets of the solar system in order, with one fact each."}]
    first = client.chat.completions.create(model=DEFAULT_MODEL, messages=messages, max_tokens=MAX_TOKENS,
                                           temperature=0, extra_body={"ignore_eos": True})
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "Which one is the largest?"}]
    deadline = time.monotonic() + 30  # until the answering D's events say it holds a block more than any P
    while (max((cached := predicted_chat(cluster.urls.proxy, messages))[u] for u in cluster.urls.decode)
           < max(cached[u] for u in cluster.urls.prefill) + BLOCK):
        assert time.monotonic() < deadline, f"turn 1's answer never reached the fleet view: {cached}"
        time.sleep(0.05)
    raw = client.chat.completions.with_raw_response.create(
        model=DEFAULT_MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    held = int(raw.headers[HELD])
    usage = [chunk.usage for chunk in raw.parse() if chunk.usage is not None]
    assert held >= BLOCK and len(usage) == 1
    assert usage[0].prompt_tokens_details is not None and usage[0].prompt_tokens_details.cached_tokens == held
    assert_all_blocks_free([*cluster.urls.prefill, *cluster.urls.decode])


def predicted_chat(proxy: str, messages: list[dict]) -> dict[str, int]:
    r = httpx.post(proxy + "/kvbridge/fleet/predict", json={"model": DEFAULT_MODEL, "messages": messages}, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()["cached"]
