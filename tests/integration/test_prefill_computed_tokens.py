"""What each instance computed in prefill, per request, on the real default model: the prompt less
its local prefix hit and the KV it read from another instance (vllm:request_prefill_kv_computed_tokens),
and the rest (vllm:prompt_tokens_cached). One instance over HTTP, scraped from /metrics; a P/D pair in
process over NIXL, P's and D's outputs through each instance's own ServerMetrics."""

from __future__ import annotations

import time

import pytest

from kvbridge.config import KVRole
from kvbridge.engine.engine import LLMEngine
from kvbridge.engine.outputs import RequestOutput
from kvbridge.engine.sampling_params import SamplingParams
from kvbridge.kv_transfer.backends.fake import FakeFabric, FaultConfig
from kvbridge.kv_transfer.params import parse_kv_transfer_params, to_wire
from kvbridge.server.metrics import ServerMetrics
from tests.integration.api_instance import CONFIG, MODEL, Instance, inst, llm, loaded  # noqa: F401
from tests.integration.pd_harness import decode, make_engine, settle, tokens

COMPUTED = "vllm:request_prefill_kv_computed_tokens"
CACHED = "vllm:prompt_tokens_cached_total"
LABELS = {"model_name": MODEL, "engine": "0"}


def _scrape(inst: Instance) -> tuple[float, float, float]:
    return (inst.metric(COMPUTED + "_sum", **LABELS), inst.metric(COMPUTED + "_count", **LABELS),
            inst.metric(CACHED, **LABELS))


def test_the_same_prompt_again_computes_only_the_tail_past_the_last_full_block(inst: Instance) -> None:
    client = inst.client()
    prompt = ("Tell me everything about the history of Rome: its kings, its republic and its emperors, the roads "
              "it built across Europe, its aqueducts and baths, its laws, and how its western half fell.")
    bs = CONFIG.cache.block_size
    s0, n0, c0 = _scrape(inst)
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage is not None
    n_prompt = first.usage.prompt_tokens
    assert n_prompt > 2 * bs  # several full blocks
    s1, n1, c1 = _scrape(inst)
    assert (s1 - s0, n1 - n0, c1 - c0) == (n_prompt, 1, 0)  # nothing cached yet: the whole prompt

    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert second.usage is not None and second.usage.prompt_tokens == n_prompt
    hit = ((n_prompt - 1) // bs) * bs  # every full block but one that would leave nothing to compute
    assert second.usage.prompt_tokens_details is not None
    assert second.usage.prompt_tokens_details.cached_tokens == hit
    s2, n2, c2 = _scrape(inst)
    assert (s2 - s1, n2 - n1, c2 - c1) == (n_prompt - hit, 1, hit)
    m = inst.wait_all_blocks_free()
    assert m.num_free_blocks == m.num_total_blocks


def _prefill(p: LLMEngine, prompt: list[int], rid: str) -> RequestOutput:
    p.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0),
                  parse_kv_transfer_params({"do_remote_decode": True}))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for out in p.step().outputs:
            if out.request_id == rid and out.finished:
                return out
    raise TimeoutError("P did not finish the prefill")


def _record(metrics: ServerMetrics, outs: list[RequestOutput]) -> None:
    timer = metrics.request_timer()
    for out in outs:
        timer.on_output(out)


def _value(metrics: ServerMetrics, name: str) -> float:
    got = metrics.registry.get_sample_value(name, LABELS)
    assert got is not None, name
    return got


@pytest.mark.parametrize("backend", ["nixl"])
def test_pd_loaded_kv_counts_as_cached_on_d_and_p_computes_the_prompt(loaded, backend):  # noqa: F811
    pytest.importorskip("nixl._api")
    p = make_engine(loaded, KVRole.PRODUCER, backend_name=backend, engine_id="P")
    d = make_engine(loaded, KVRole.CONSUMER, backend_name=backend, engine_id="D")
    pm, dm = ServerMetrics(MODEL, 512), ServerMetrics(MODEL, 512)
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    try:
        bs = d.block_size
        first = list(range(500, 540))  # 2 full blocks + 8
        # Turn 1: P computes the whole prompt; D reads all of it but the last token, which it computes.
        p_out = _prefill(p, first, "p-1")
        assert (p_out.num_cached_tokens, p_out.num_loaded_tokens) == (0, 0)
        d_outs = decode(d, p, first, _wire(p_out), greedy, request_id="d-1")
        assert len(tokens(d_outs)) == 4
        assert (d_outs[-1].num_cached_tokens, d_outs[-1].num_loaded_tokens) == (0, len(first) - 1)
        assert d_outs[-1].num_reused_tokens == 0  # P computed the whole prompt for it: cached_tokens 0
        _record(pm, [p_out])
        _record(dm, d_outs)
        assert _value(pm, COMPUTED + "_sum") == len(first) and _value(pm, CACHED) == 0
        assert _value(dm, COMPUTED + "_sum") == 1 and _value(dm, CACHED) == len(first) - 1

        # Turn 2, a longer prompt sharing turn 1's full blocks: both hit them locally; P computes
        # the rest, D reads the rest from P but the last token.
        second = first + list(range(800, 830))  # 4 full blocks + 6
        hit = 2 * bs
        p_out = _prefill(p, second, "p-2")
        assert (p_out.num_cached_tokens, p_out.num_loaded_tokens) == (hit, 0)
        d_outs = decode(d, p, second, _wire(p_out), greedy, request_id="d-2")
        assert (d_outs[-1].num_cached_tokens, d_outs[-1].num_loaded_tokens) == (hit, len(second) - 1 - hit)
        assert (p_out.num_reused_tokens, d_outs[-1].num_reused_tokens) == (hit, hit)  # computed nowhere
        _record(pm, [p_out])
        _record(dm, d_outs)
        assert _value(pm, COMPUTED + "_sum") == len(first) + len(second) - hit
        assert _value(pm, CACHED) == hit
        assert _value(dm, COMPUTED + "_sum") == 2 and _value(dm, COMPUTED + "_count") == 2
        assert _value(dm, CACHED) == len(first) - 1 + len(second) - 1
        # The fleet computed each prompt token once per request that needed it, plus D's last token.
        fleet = _value(pm, COMPUTED + "_sum") + _value(dm, COMPUTED + "_sum")
        assert fleet == len(first) + 1 + len(second) - hit + 1

        # Turn 3, P's cache emptied: D still hits turn 2's blocks locally, but P computed the whole
        # prompt for this request, so nothing of it was reused in the fleet (usage's cached_tokens 0).
        p.reset_prefix_cache()
        p_out = _prefill(p, second, "p-3")
        d_outs = decode(d, p, second, _wire(p_out), greedy, request_id="d-3")
        assert p_out.num_cached_tokens == 0 and d_outs[-1].num_cached_tokens == len(second) - 1 - (len(second) - 1) % bs
        assert d_outs[-1].num_reused_tokens == 0
        settle(p, d)
        for e in (p, d):
            assert e.kv_cache_manager.num_free_blocks == e.kv_cache_manager.pool.num_usable_blocks
    finally:
        settle(p, d)
        p.shutdown()
        d.shutdown()


def test_a_failed_read_counts_nothing_as_loaded_and_d_computes_past_its_own_hit(loaded):  # noqa: F811
    fabric = FakeFabric(seed=5)
    p = make_engine(loaded, KVRole.PRODUCER, fabric.create_agent("P"), engine_id="P")
    d = make_engine(loaded, KVRole.CONSUMER, fabric.create_agent("D"), engine_id="D")
    dm = ServerMetrics(MODEL, 512)
    greedy = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    try:
        first = list(range(500, 540))
        decode(d, p, first, _wire(_prefill(p, first, "p-1")), greedy, request_id="d-1")  # D now holds 2 blocks
        second = first + list(range(800, 830))
        hit = 2 * d.block_size
        fabric.lookup("D").set_faults(FaultConfig(error_state=True))  # D's read fails: recompute locally
        d_outs = decode(d, p, second, _wire(_prefill(p, second, "p-2")), greedy, request_id="d-2")
        assert len(tokens(d_outs)) == 2
        assert (d_outs[-1].num_cached_tokens, d_outs[-1].num_loaded_tokens) == (hit, 0)
        assert d_outs[-1].num_reused_tokens == hit  # P hit it too; D computed the rest
        _record(dm, d_outs)
        assert _value(dm, COMPUTED + "_sum") == len(second) - hit and _value(dm, CACHED) == hit
        settle(p, d)
        for e in (p, d):
            assert e.kv_cache_manager.num_free_blocks == e.kv_cache_manager.pool.num_usable_blocks
    finally:
        settle(p, d)
        p.shutdown()
        d.shutdown()


def _wire(out: RequestOutput) -> dict:
    assert out.kv_transfer_params is not None
    return to_wire(out.kv_transfer_params)  # as P's HTTP answer carries them
