"""End to end on loopback: `kvbridge up`'s cluster (proxy + P + D as real processes, the
real default model), driven by the official openai client, once per transfer backend.
P/D greedy outputs must equal the colocated engine's, and afterwards every KV block is
free on P and on D."""

from __future__ import annotations

import asyncio
import functools
import time

import pytest
from openai import AsyncOpenAI, OpenAI

from kvbridge.config import CacheConfig, EngineConfig
from kvbridge.engine.engine import LLMEngine
from kvbridge.engine.loader import load_model
from kvbridge.engine.sampling_params import SamplingParams
from kvbridge.launcher.cluster import LocalCluster
from tests.e2e.processes import metric
from tests.fleet import LONG, MAX_TOKENS, SHORT

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def reference():
    loaded = load_model(MODEL)
    engine = LLMEngine(EngineConfig(cache=CacheConfig(num_blocks=128)), loaded)

    @functools.cache  # greedy: a prompt's answer once per module (both backends' tests ask for it)
    def complete(prompt: str) -> str:
        ids = loaded.tokenizer.encode(prompt)
        out = engine.generate([ids], SamplingParams(max_tokens=MAX_TOKENS, temperature=0))[0]
        return loaded.tokenizer.decode(out)
    complete.tokenizer = loaded.tokenizer
    return complete


@pytest.fixture(scope="module", params=["tcp", "nixl"])
def backend(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def tcp_cluster(tmp_path_factory):
    c = LocalCluster(MODEL, port=0, kv_backend="tcp", log_dir=tmp_path_factory.mktemp("logs"),
                     extra_serve_args=["--num-blocks", "128", "--max-model-len", "1024", "--dtype", "float32"])
    with c:
        c.wait_healthy(300)
        yield c


@pytest.fixture
def cluster(request, backend, smollm2_pd):
    """tcp: the module's own cluster; NIXL: the session's shared one (tests/e2e/conftest.py).
    Either way every block is free on P and D after each test."""
    if backend == "nixl":
        yield request.getfixturevalue("smollm2_pd_cluster")  # checks the blocks itself
        return
    c = request.getfixturevalue("tcp_cluster")
    yield c
    assert_all_blocks_free(c)


def assert_all_blocks_free(c: LocalCluster, timeout_s: float = 15.0) -> None:
    urls = c.urls
    deadline = time.monotonic() + timeout_s
    while True:
        state = {u: (metric(u, "kvbridge_kv_cache_free_blocks"), metric(u, "kvbridge_kv_cache_total_blocks"))
                 for u in (*urls.prefill, *urls.decode)}
        if all(free == total for free, total in state.values()):
            return
        assert time.monotonic() < deadline, f"KV blocks still allocated: {state}"
        time.sleep(0.1)


def client(c: LocalCluster) -> OpenAI:
    return OpenAI(base_url=c.urls.proxy + "/v1", api_key="unused", max_retries=0, timeout=120)


def complete(c: LocalCluster, prompt: str, stream: bool = False) -> str:
    cl = client(c)
    if stream:
        chunks = cl.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                       stream=True)
        return "".join(ch.choices[0].text for ch in chunks if ch.choices)
    return cl.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0).choices[0].text


def transfer_bytes(c: LocalCluster) -> float:
    return metric(c.urls.decode[0], "kvbridge_kv_transfer_bytes_total")


@pytest.mark.parametrize("stream", [False, True])
def test_short_and_multi_block_prompts_match_colocated(cluster, reference, stream):
    assert len(reference.tokenizer.encode(SHORT)) < 16 < 32 < len(reference.tokenizer.encode(LONG))
    assert complete(cluster, SHORT, stream) == reference(SHORT)
    assert complete(cluster, LONG, stream) == reference(LONG)
    assert_all_blocks_free(cluster)


def test_prefix_cache_hits_on_d_read_only_what_is_missing(cluster, reference):
    tok = reference.tokenizer
    prompt = ("A fresh prompt no other test sends: list the planets of the solar system in order "
              f"from the sun, with one fact about each ({cluster.kv_backend}).")
    n_blocks = -(-len(tok.encode(prompt)) // 16)
    before = transfer_bytes(cluster)
    assert complete(cluster, prompt) == reference(prompt)
    block_bytes = (transfer_bytes(cluster) - before) / n_blocks  # a cold read moves every block
    # Full local hit: the same prompt again; D holds every full block, computes the tail
    # itself and only tells P to release (nothing is read).
    before, released = transfer_bytes(cluster), metric(cluster.urls.prefill[0], "kvbridge_kv_early_releases_total")
    assert complete(cluster, prompt) == reference(prompt)
    assert transfer_bytes(cluster) - before == 0
    deadline = time.monotonic() + 5
    while metric(cluster.urls.prefill[0], "kvbridge_kv_early_releases_total") == released:
        assert time.monotonic() < deadline, "P never got the release notification"
        time.sleep(0.05)
    # Partial hit: a shared prefix and a new tail; D reads only the blocks past its hit.
    longer = prompt + " Then say which planet is the largest and why it matters."
    before = transfer_bytes(cluster)
    assert complete(cluster, longer) == reference(longer)
    hit_blocks = len(tok.encode(prompt)) // 16
    assert transfer_bytes(cluster) - before == block_bytes * (-(-len(tok.encode(longer)) // 16) - hit_blocks)
    assert_all_blocks_free(cluster)


def test_eight_concurrent_requests_stream_and_not(cluster, reference):
    prompts = [f"Question {i}: what is {i} plus {i}? Answer:" for i in range(8)]
    want = [reference(p) for p in prompts]

    async def run():
        cl = AsyncOpenAI(base_url=cluster.urls.proxy + "/v1", api_key="unused", max_retries=0, timeout=120)

        async def one(i):
            if i % 2:
                s = await cl.completions.create(model=MODEL, prompt=prompts[i], max_tokens=MAX_TOKENS,
                                                temperature=0, stream=True)
                return "".join([ch.choices[0].text async for ch in s if ch.choices])
            r = await cl.completions.create(model=MODEL, prompt=prompts[i], max_tokens=MAX_TOKENS, temperature=0)
            return r.choices[0].text
        return await asyncio.gather(*(one(i) for i in range(8)))

    assert asyncio.run(run()) == want
    assert_all_blocks_free(cluster)


def test_chat_through_the_proxy(cluster):
    r = client(cluster).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name the capital of France."}],
        max_tokens=12, temperature=0)
    assert "Paris" in r.choices[0].message.content
    assert r.usage.completion_tokens > 0
