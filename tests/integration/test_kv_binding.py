"""A decode instance never answers from KV that is not its prompt's (issue 14, findings 1, 3, 4).

Real P and D API servers on loopback (tcp backend, the default model) and a colocated
instance for the reference answers:
- swapped params: prompt B sent to D with the params P returned for prompt A (same block
  count, live lease, right generation): P refuses the read (content mismatch), frees A's
  blocks at once, and D answers B from its own computation (recompute) or with the
  policy's error (fail), never with A's text;
- a repeated block id ([a, a, a, a] for [a, b, c, d]) is refused; the lease holds its blocks;
- a reused X-Request-Id on P while the first request's blocks are leased does not free
  them: D later reads them with the first request's params and answers correctly.
"""

from __future__ import annotations

import functools
import time

import httpx
import pytest
from openai import InternalServerError, OpenAI

from kvbridge.chaos import ThreadServer
from kvbridge.config import CacheConfig, EngineConfig, KVRole, KVTransferConfig, LoadFailurePolicy
from kvbridge.engine.engine import DuplicateRequestIdError, LLMEngine
from kvbridge.engine.kv_connector_factory import build_connectors
from kvbridge.engine.loader import load_model
from kvbridge.engine.sampling_params import SamplingParams
from kvbridge.kv_transfer.params import parse_kv_transfer_params
from kvbridge.server.api_server import build_app
from kvbridge.server.async_engine import AsyncEngine

MODEL = "SmolLM2-135M-Instruct"
PROMPT_A = "Tell me everything about the history of the Roman empire and its emperors. " * 4
# 64 tokens, like A's 57 four blocks of 16: D's block-count check at admission passes.
PROMPT_B = ("Write a short poem about cats sleeping in the warm afternoon sun by the window. " * 4).strip()
# Each test reads a prompt of its own: one D has already cached would be a local hit (no read).
PROMPT_C = "Tell me everything about the history of the Greek city states and their wars. " * 4
PROMPT_D = "Tell me everything about the history of the Ottoman empire and its sultans. " * 4
WAIT_S = 10.0


@pytest.fixture(scope="module")
def cluster():
    loaded = load_model(MODEL)

    def engine(role: KVRole | None, eid: str, policy=LoadFailurePolicy.RECOMPUTE) -> AsyncEngine:
        kv = None if role is None else KVTransferConfig(role=role, backend="tcp", engine_id=eid, lease_seconds=60,
                                                         load_failure_policy=policy)
        config = EngineConfig(cache=CacheConfig(num_blocks=40), max_model_len=512, num_threads=1, kv_transfer=kv)
        conns = build_connectors(config, loaded.arch, loaded.name) if kv is not None else None
        return AsyncEngine(LLMEngine(config, loaded, conns))

    engines = {"p": engine(KVRole.PRODUCER, "P"), "d": engine(KVRole.CONSUMER, "D"),
               "d_fail": engine(KVRole.CONSUMER, "D-fail", LoadFailurePolicy.FAIL), "ref": engine(None, "ref")}
    servers = {name: ThreadServer(build_app(e)) for name, e in engines.items()}
    yield engines, {name: s.url for name, s in servers.items()}, loaded.tokenizer
    for s in servers.values():
        s.stop()
    for e in engines.values():
        e.shutdown()


def _client(url: str) -> OpenAI:
    return OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _prefill(url: str, prompt: str, request_id: str | None = None) -> dict:
    headers = {"X-Request-Id": request_id} if request_id else None
    r = httpx.post(url + "/v1/completions", timeout=60, headers=headers, json={
        "model": MODEL, "prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 200, r.text
    return r.json()["kv_transfer_params"]


def _complete(url: str, prompt: str, params: dict | None = None, max_tokens: int = 24) -> str:
    extra = {"kv_transfer_params": params} if params is not None else None
    r = _client(url).completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                        extra_body=extra)
    return r.choices[0].text


@functools.cache
def _reference(ref_url: str, prompt: str) -> str:
    """The colocated instance's greedy answer, asked once per prompt (both decoders' tests need A's and B's)."""
    return _complete(ref_url, prompt)


def _stats(engine: AsyncEngine):
    return engine.call_threadsafe(lambda e: e.connectors.worker.stats).result(timeout=WAIT_S)


def _wait_nothing_held(p: AsyncEngine) -> bool:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if p.call_threadsafe(lambda e: e.metrics().num_held_for_remote).result(timeout=WAIT_S) == 0:
            return True
        time.sleep(0.01)
    return False


def test_the_two_prompts_fill_the_same_number_of_blocks(cluster):
    _, _, tok = cluster  # otherwise D would refuse the swapped params at admission (400)
    a, b = (len(tok.encode(x, add_special_tokens=True)) for x in (PROMPT_A, PROMPT_B))
    assert a != b and -(-a // 16) == -(-b // 16)


@pytest.mark.parametrize("decoder", ["d", "d_fail"])
def test_swapped_params_never_answer_with_another_prompts_kv(cluster, decoder):
    engines, urls, _ = cluster
    want_b = _reference(urls["ref"], PROMPT_B)
    want_a = _reference(urls["ref"], PROMPT_A)
    assert "cat" in want_b.lower() and want_a != want_b
    before_p, before_d = _stats(engines["p"]).content_mismatches, _stats(engines[decoder]).failed_transfers[
        "content_mismatch"]
    params_a = _prefill(urls["p"], PROMPT_A)
    if decoder == "d":  # policy recompute: B is answered from D's own computation
        assert _complete(urls["d"], PROMPT_B, params_a) == want_b
    else:  # policy fail: the transfer error, never HTTP 200
        with pytest.raises(InternalServerError, match="KV transfer failed"):
            _complete(urls["d_fail"], PROMPT_B, params_a)
    assert _stats(engines["p"]).content_mismatches == before_p + 1
    assert _stats(engines[decoder]).failed_transfers["content_mismatch"] == before_d + 1
    assert _wait_nothing_held(engines["p"])  # A's blocks were freed at the refusal, not at lease expiry
    if decoder == "d":  # the refused lease is gone: even A itself cannot read those blocks now
        stale = _stats(engines["d"]).failed_transfers["stale_lease"]
        assert _complete(urls["d"], PROMPT_A, params_a) == want_a
        assert _stats(engines["d"]).failed_transfers["stale_lease"] == stale + 1


def test_a_repeated_block_id_is_refused_and_the_lease_keeps_its_blocks(cluster):
    engines, urls, _ = cluster
    want = _reference(urls["ref"], PROMPT_C)
    params = _prefill(urls["p"], PROMPT_C)
    ids = parse_kv_transfer_params(params).remote_block_ids[0]
    assert len(set(ids)) == len(ids) >= 3
    refused = _stats(engines["p"]).refused_reads
    forged = {**params, "remote_block_ids": [ids[0]] * len(ids)}
    with pytest.raises(InternalServerError, match="KV transfer failed"):  # policy fail: refused, not read
        _complete(urls["d_fail"], PROMPT_C, forged)
    assert _stats(engines["p"]).refused_reads == refused + 1
    # The lease still holds the blocks, untouched: a read with the true params gets their KV.
    transfers = _stats(engines["d"]).transfers
    assert _complete(urls["d"], PROMPT_C, params) == want
    assert _stats(engines["d"]).transfers == transfers + 1
    assert _wait_nothing_held(engines["p"])


def test_a_reused_request_id_on_p_does_not_free_leased_blocks(cluster):
    engines, urls, _ = cluster
    want = _reference(urls["ref"], PROMPT_D)
    params = _prefill(urls["p"], PROMPT_D, request_id="reused-id")
    assert params["remote_request_id"] == "reused-id"
    # The same id again, while A's blocks are leased: served, under an id of its own.
    r = httpx.post(urls["p"] + "/v1/completions", timeout=60, headers={"X-Request-Id": "reused-id"},
                   json={"model": MODEL, "prompt": PROMPT_B, "max_tokens": 2})
    assert r.status_code == 200 and r.headers["X-Request-Id"] == "reused-id"
    # Unrelated work that takes every free block P has, reusing anything wrongly freed.
    for i in range(3):  # 40 blocks, 4 leased: each of these takes 30 of the free ones
        assert _complete(urls["p"], f"Describe the number {i} in detail. " * 56, max_tokens=2)
    transfers = _stats(engines["d"]).transfers
    assert _complete(urls["d"], PROMPT_D, params) == want
    assert _stats(engines["d"]).transfers == transfers + 1  # read from P, not recomputed
    assert _wait_nothing_held(engines["p"])


def test_the_engine_refuses_an_id_whose_blocks_are_leased(cluster):
    engines, urls, tok = cluster
    params = _prefill(urls["p"], PROMPT_A, request_id="leased-id")

    def add(e: LLMEngine) -> None:
        e.add_request("leased-id", tok.encode(PROMPT_B), SamplingParams(max_tokens=1))
    with pytest.raises(DuplicateRequestIdError):
        engines["p"].call_threadsafe(add).result(timeout=WAIT_S)
    assert _complete(urls["d"], PROMPT_A, params)  # read and released
    assert _wait_nothing_held(engines["p"])
