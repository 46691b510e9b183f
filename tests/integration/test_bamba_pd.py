"""P/D of a hybrid Mamba model (Bamba: Mamba2 + attention) between engines in this process, over
real NIXL (UCX on loopback) and tcp, at equal and at different TP sizes.

The tiny Bamba's logical block is 6 kernel blocks of 4 tokens at TP 1 and 4 at TP 2
(shape/kv_cache_layout.py), so P and D at different TP sizes number their blocks differently: D
expands P's block ids with P's ratio and its own with its own (seed 004), and reads each Mamba
state as a whole, its heads from the P ranks holding them. P computes the prompt but its last
token, D that token from the N-1 state (scheduler_side.py). Greedy output equals the colocated
engine's; with different ratios and prefix caching on at D the handshake refuses with both
ratios and the option named, and the load-failure policy decides (recompute: the right answer;
fail: an error); the engines keep serving; a load that failed (no byte arrived) recomputes from
the first token; a one-token prompt leaves P nothing to send; every block of every group is
free afterwards.
"""

from __future__ import annotations

import pytest

from kvbridge.config import KVRole, LoadFailurePolicy
from kvbridge.engine.engine import EngineRequestError
from kvbridge.engine.loader import load_model
from kvbridge.engine.loader.synthetic import TINY_BAMBA, write_synthetic_folder
from kvbridge.engine.request import FinishReason
from kvbridge.engine.sampling_params import SamplingParams
from kvbridge.kv_transfer.backends.fake import FakeFabric, FaultConfig
from kvbridge.kv_transfer.params import parse_kv_transfer_params
from tests.integration.pd_harness import decode, make_engine, prefill, settle, tokens

GREEDY = SamplingParams(max_tokens=10, temperature=0)
BLOCK = 4  # kernel block: logical blocks of 24 (TP 1) and 16 (TP 2) tokens


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("models") / "tiny-bamba"
    write_synthetic_folder(folder, load_model("SmolLM2-135M-Instruct").tokenizer, architecture="bamba", **TINY_BAMBA)
    return load_model(str(folder))


@pytest.fixture(scope="module")
def prompts(model):
    tok = model.tokenizer
    texts = ["The history of the Roman Empire spans many centuries, from the founding of the city to the fall of "
             "Constantinople. Summarise it.", "Name three primary colors and one secondary color, please."]
    return [tok.encode(t) for t in texts]


@pytest.fixture(scope="module")
def want(model, prompts):
    e = make_engine(model, None, block_size=BLOCK)
    try:
        return [e.generate([p], GREEDY)[0] for p in prompts]
    finally:
        e.shutdown()


def all_free(*engines) -> bool:
    return all(e.metrics().num_free_blocks == e.metrics().num_total_blocks for e in engines)


# The end-to-end tests (tests/e2e/test_pd_hybrid_mamba.py) run P TP 2 -> D TP 1 over NIXL and
# P TP 1 -> D TP 2 over tcp; here the other two combinations and equal TP sizes.
@pytest.mark.parametrize("backend, p_tp, d_tp", [("nixl", 1, 1), ("nixl", 1, 2), ("tcp", 2, 1)])
def test_bamba_pd_at_any_tp_pairing_gives_the_colocated_text(model, prompts, want, backend, p_tp, d_tp):
    p = make_engine(model, KVRole.PRODUCER, backend_name=backend, block_size=BLOCK, tp=p_tp)
    d = make_engine(model, KVRole.CONSUMER, backend_name=backend, block_size=BLOCK, tp=d_tp,
                    prefix_caching=p_tp == d_tp)  # different ratios need prefix caching off on D
    try:
        assert (p.block_size, d.block_size) == (4 * {1: 6, 2: 4}[p_tp], 4 * {1: 6, 2: 4}[d_tp])
        stats = d.connectors.worker.stats
        for i, prompt in enumerate(prompts):
            params = prefill(p, prompt)
            assert params["remote_block_size"] == p.block_size
            assert params["remote_num_tokens"] == len(prompt) - 1  # N-1 prefill
            # one block per Mamba group, the attention group's blocks for N-1 tokens
            assert [len(g) for g in params["remote_block_ids"]] == [
                1, -(-(len(prompt) - 1) // p.block_size), 1, 1]
            assert tokens(decode(d, p, prompt, params, GREEDY)) == want[i]
        assert stats.transfers == len(prompts) and not stats.failed_transfers
        settle(p, d)
        assert all_free(p, d)
        assert p.connectors.worker.stats.expired_leases == 0 and p.metrics().num_held_for_remote == 0
    finally:
        p.shutdown()
        d.shutdown()


@pytest.mark.parametrize("policy", [LoadFailurePolicy.RECOMPUTE, LoadFailurePolicy.FAIL])
def test_different_ratios_with_prefix_caching_on_are_refused_per_policy(model, prompts, want, policy):
    p = make_engine(model, KVRole.PRODUCER, backend_name="tcp", block_size=BLOCK, tp=2)
    d = make_engine(model, KVRole.CONSUMER, backend_name="tcp", block_size=BLOCK, policy=policy)
    try:
        outs = decode(d, p, prompts[0], prefill(p, prompts[0]), GREEDY)
        stats = d.connectors.worker.stats
        assert stats.transfers == 0 and stats.handshake_failures.get("layout_mismatch") == 1
        if policy is LoadFailurePolicy.RECOMPUTE:
            assert tokens(outs) == want[0]
        else:
            assert outs[-1].finish_reason is FinishReason.ERROR
            assert "4" in outs[-1].error and "6" in outs[-1].error and "--no-prefix-caching" in outs[-1].error
        # D keeps serving: a colocated-style request on D, and P's blocks were released
        assert d.generate([prompts[1]], GREEDY)[0] == want[1]
        settle(p, d)
        assert all_free(p, d) and p.metrics().num_held_for_remote == 0
    finally:
        p.shutdown()
        d.shutdown()


def test_a_failed_load_recomputes_from_the_first_token_and_frees_every_group(model, prompts, want):
    # The reads end in ERROR: no byte of KV or of any Mamba state arrived. D marks its blocks of
    # every group invalid and recomputes from token 0 (a state is whole or useless).
    fabric = FakeFabric(seed=3)
    p = make_engine(model, KVRole.PRODUCER, fabric.create_agent("P"), engine_id="P", block_size=BLOCK)
    d = make_engine(model, KVRole.CONSUMER, fabric.create_agent("D", FaultConfig(error_state=True)), engine_id="D",
                    block_size=BLOCK)
    try:
        assert tokens(decode(d, p, prompts[0], prefill(p, prompts[0]), GREEDY)) == want[0]
        stats = d.connectors.worker.stats
        assert stats.recomputed_requests == 1 and sum(stats.failed_transfers.values()) == 1
        settle(p, d)
        assert all_free(p, d) and p.metrics().num_held_for_remote == 0
    finally:
        p.shutdown()
        d.shutdown()


def test_a_one_token_prompt_leaves_p_nothing_to_send(model, want):
    # N-1 prefill of one token is nothing: D computes the token itself and P only frees.
    p = make_engine(model, KVRole.PRODUCER, backend_name="tcp", block_size=BLOCK)
    d = make_engine(model, KVRole.CONSUMER, backend_name="tcp", block_size=BLOCK)
    colocated = make_engine(model, None, block_size=BLOCK)
    try:
        prompt = [model.tokenizer.encode("Hi")[0]]
        assert tokens(decode(d, p, prompt, prefill(p, prompt), GREEDY)) == colocated.generate([prompt], GREEDY)[0]
        assert d.connectors.worker.stats.transfers == 0
        settle(p, d)
        assert all_free(p, d) and p.metrics().num_held_for_remote == 0
    finally:
        for e in (p, d, colocated):
            e.shutdown()


def test_a_mamba_prefill_offers_no_token_to_continue_and_decode_refuses_one(model, prompts):
    """N-1 prefill: P's sampled token follows the prompt's N-1 tokens, not the prompt, so P names
    none (the proxy's first-token path then takes the ordinary path) and D refuses forged ones."""
    p = make_engine(model, KVRole.PRODUCER, backend_name="tcp", block_size=BLOCK)
    d = make_engine(model, KVRole.CONSUMER, backend_name="tcp", block_size=BLOCK)
    try:
        params = prefill(p, prompts[0])
        assert "generated_token_ids" not in params
        kv = parse_kv_transfer_params(params)
        with pytest.raises(EngineRequestError, match="Mamba"):
            d.add_request("d-continue-mamba", prompts[0], GREEDY, kv, continued=[5])
        d.notify_kv_transfer_rejected("d-continue-mamba", kv)  # what the API server's guard does
        settle(p, d)
        assert all_free(p, d) and p.metrics().num_held_for_remote == 0
    finally:
        p.shutdown()
        d.shutdown()
