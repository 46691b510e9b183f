"""KV digests over the real default model: in-process P and D (the fake transfer backend wrapped
in a CorruptingBackend on D, the real side channel and connectors). Every corrupted read is caught
before decode and the load recomputed (or failed, per policy); every answer equals the colocated
engine's; every block is back in its pool. With verification off on both ends, the same kind of
corruption yields a wrong answer: the check is what keeps it out."""

from __future__ import annotations

import dataclasses
import time

import pytest

from kvbridge.config import CacheConfig, EngineConfig, KVRole, KVTransferConfig, LoadFailurePolicy
from kvbridge.engine.engine import LLMEngine
from kvbridge.engine.kv_connector_factory import build_connectors
from kvbridge.engine.loader import load_model
from kvbridge.engine.request import FinishReason
from kvbridge.engine.sampling_params import SamplingParams
from kvbridge.kv_transfer.backends.corrupting import KINDS, CorruptingBackend
from kvbridge.kv_transfer.backends.fake import FakeFabric, FaultConfig
from kvbridge.kv_transfer.params import parse_kv_transfer_params
from tests.integration.pd_harness import decode, make_engine, prefill, settle, tokens
from tests.unit.receiver_world import ManualClock

GREEDY = SamplingParams(max_tokens=6, temperature=0)
QUESTIONS = ["Which ocean is the largest?", "Name three primary colours.", "What is the capital of France?",
             "How many legs does a spider have?", "Why is the sky blue?", "Who wrote Hamlet?"]


@pytest.fixture(scope="module")
def loaded():
    return load_model("SmolLM2-135M-Instruct")


@pytest.fixture(scope="module")
def prompts(loaded):
    tok = loaded.tokenizer
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in QUESTIONS]


@pytest.fixture(scope="module")
def wants(loaded, prompts):
    colocated = make_engine(loaded, None)
    try:
        return colocated.generate(prompts, GREEDY)
    finally:
        colocated.shutdown()


def pd_engine(loaded, role: KVRole, backend, *, kv_verify: bool, policy: LoadFailurePolicy) -> LLMEngine:
    kv = KVTransferConfig(role=role, backend="fake", engine_id=role.value, lease_seconds=30.0,
                          load_failure_policy=policy, handshake_timeout_s=5.0, transfer_timeout_s=7.0,
                          kv_verify=kv_verify)
    config = EngineConfig(model=loaded.source, kv_transfer=kv, num_threads=2,
                          cache=CacheConfig(block_size=16, num_blocks=96, enable_prefix_caching=True))
    return LLMEngine(config, loaded, build_connectors(config, loaded.arch, loaded.name, backend))


def pair(loaded, rate: float, kinds, *, kv_verify: bool = True, policy=LoadFailurePolicy.RECOMPUTE):
    fabric = FakeFabric(seed=3)
    corrupting = CorruptingBackend(fabric.create_agent("D"), rate, kinds, seed=11)
    p = pd_engine(loaded, KVRole.PRODUCER, fabric.create_agent("P"), kv_verify=kv_verify, policy=policy)
    d = pd_engine(loaded, KVRole.CONSUMER, corrupting, kv_verify=kv_verify, policy=policy)
    return corrupting, p, d


def all_blocks_free(*engines: LLMEngine) -> bool:
    return all(e.metrics().num_free_blocks == e.metrics().num_total_blocks and e.metrics().num_held_for_remote == 0
               for e in engines)


def test_corrupted_reads_are_caught_and_every_answer_is_colocated(loaded, prompts, wants):
    corrupting, p, d = pair(loaded, 0.5, KINDS)
    try:
        for prompt, want in zip(prompts + prompts, wants + wants):  # twice: "foreign" has earlier reads to take
            assert tokens(decode(d, p, prompt, prefill(p, prompt), GREEDY)) == want
        settle(p, d)
        hit = sum(corrupting.counts.values())
        failed = dict(d.connectors.worker.stats.failed_transfers)
        assert hit > 0 and set(failed) <= {"kv_content_mismatch", "transfer_setup"}, failed
        # every corrupted read failed its load (a shift off P's region fails at setup, before any byte)
        assert sum(failed.values()) == hit and d.connectors.worker.stats.recomputed_requests == hit
        assert p.connectors.worker.stats.kv_content_mismatches == failed.get("kv_content_mismatch", 0) > 0
        assert d.connectors.worker.stats.unverified_reads == 0
        assert all_blocks_free(p, d)
    finally:
        p.shutdown()
        d.shutdown()


def test_a_corrupted_read_fails_the_request_under_the_fail_policy(loaded, prompts, wants):
    corrupting, p, d = pair(loaded, 1.0, ("corrupt",), policy=LoadFailurePolicy.FAIL)
    try:
        outs = decode(d, p, prompts[0], prefill(p, prompts[0]), GREEDY)
        assert outs[-1].finish_reason is FinishReason.ERROR and not tokens(outs)
        assert "kv_content_mismatch" in outs[-1].error
        corrupting.rate = 0.0  # D serves on: the next load is intact and verified
        assert tokens(decode(d, p, prompts[1], prefill(p, prompts[1]), GREEDY)) == wants[1]
        settle(p, d)
        assert all_blocks_free(p, d)
    finally:
        p.shutdown()
        d.shutdown()


def test_with_verification_off_the_same_corruption_answers_wrong(loaded, prompts, wants):
    """A read of another request's KV (the earlier request's blocks: foreign, or shifted onto them)
    lands unverified: D decodes from it and answers something else than the colocated engine."""
    corrupting, p, d = pair(loaded, 0.0, ("foreign", "shift"), kv_verify=False)
    try:
        first, second = prompts[0], prompts[1]
        assert tokens(decode(d, p, first, prefill(p, first), GREEDY)) == wants[0]
        corrupting.rate = 1.0
        got = tokens(decode(d, p, second, prefill(p, second), GREEDY))
        assert sum(corrupting.counts.values()) == 1 and got != wants[1]
        assert not d.connectors.worker.stats.failed_transfers  # nothing noticed
        settle(p, d)
        assert all_blocks_free(p, d)
    finally:
        p.shutdown()
        d.shutdown()


def test_a_p_and_d_with_different_digest_settings_refuse_cleanly(loaded, prompts, wants):
    fabric = FakeFabric(seed=5)
    p = pd_engine(loaded, KVRole.PRODUCER, fabric.create_agent("P"), kv_verify=False,
                  policy=LoadFailurePolicy.RECOMPUTE)
    d = pd_engine(loaded, KVRole.CONSUMER, fabric.create_agent("D"), kv_verify=True,
                  policy=LoadFailurePolicy.RECOMPUTE)
    try:
        assert tokens(decode(d, p, prompts[0], prefill(p, prompts[0]), GREEDY)) == wants[0]  # recomputed
        stats = d.connectors.worker.stats
        assert dict(stats.failed_transfers) == {"handshake": 1} and dict(stats.handshake_failures) == {"hash_mismatch": 1}
        settle(p, d)
        assert all_blocks_free(p, d)
    finally:
        p.shutdown()
        d.shutdown()


def test_the_digest_setting_is_part_of_the_compatibility_hash(loaded):
    fabric = FakeFabric()
    on = pd_engine(loaded, KVRole.CONSUMER, fabric.create_agent("a"), kv_verify=True, policy=LoadFailurePolicy.FAIL)
    off = pd_engine(loaded, KVRole.CONSUMER, fabric.create_agent("b"), kv_verify=False, policy=LoadFailurePolicy.FAIL)
    try:
        c_on, c_off = on.connectors.worker.compat, off.connectors.worker.compat
        assert c_on.kv_digest == "xxh3_64/v1" and c_off.kv_digest == "off"
        assert c_on.hash() != c_off.hash() and dataclasses.replace(c_on, kv_digest="off") == c_off
    finally:
        on.shutdown()
        off.shutdown()


@pytest.mark.parametrize("read_hold_fix, kv_verify", [(False, True), (False, False), (True, True)],
                         ids=["fix-reverted-verified", "fix-reverted-unverified", "fix-in-place"])
def test_blocks_reused_under_a_read_are_caught_by_the_digest(loaded, prompts, wants, monkeypatch,
                                                             read_hold_fix, kv_verify):
    """The abort grid's old bug, replayed: P's lease expired while D's granted read was still copying
    (before a granted read held its blocks for twice D's read timeout: lease.READ_HOLD_TIMEOUTS), P
    reused the blocks for another prompt, and D's read copied that prompt's KV. With the fix reverted,
    the digest (computed when the read was granted) catches it and D recomputes the right answer;
    unverified, D answers from the other prompt's KV; with the fix, the lease outlives the read."""
    from kvbridge.kv_transfer import lease as lease_module
    if not read_hold_fix:
        monkeypatch.setattr(lease_module, "READ_HOLD_TIMEOUTS", 0)
    fabric, clock = FakeFabric(seed=5), ManualClock()
    policy = LoadFailurePolicy.RECOMPUTE

    def engine(role: KVRole, agent, lease_s: float, num_blocks: int, time_of) -> LLMEngine:
        kv = KVTransferConfig(role=role, backend="fake", engine_id=role.value, lease_seconds=lease_s,
                              load_failure_policy=policy, kv_verify=kv_verify)
        config = EngineConfig(model=loaded.source, kv_transfer=kv, num_threads=2,
                              cache=CacheConfig(block_size=16, num_blocks=num_blocks, enable_prefix_caching=True))
        return LLMEngine(config, loaded, build_connectors(config, loaded.arch, loaded.name, agent, time_of))
    prompt = prompts[0]
    blocks = -(-len(prompt) // 16)
    p_agent, d_agent = fabric.create_agent("P"), fabric.create_agent("D")
    p = engine(KVRole.PRODUCER, p_agent, 30.0, blocks + 1, clock)  # room for the prompt and one block more
    d = engine(KVRole.CONSUMER, d_agent, 600.0, 96, time.monotonic)  # no heartbeat within the test
    try:
        d_agent.set_faults(FaultConfig(hold_reads=True))  # D's read stays in flight until lifted
        params = prefill(p, prompt)
        d.add_request("d-1", prompt, GREEDY, parse_kv_transfer_params(params))
        outs = []
        deadline = time.monotonic() + 30
        while not p.connectors.worker.leases.reads_in_flight():  # P granted D's read; its bytes wait
            assert time.monotonic() < deadline, "D's read was never granted"
            outs += d.step().outputs
            p.step()
        clock.now += 45.0  # past the lease's 30 s (and 2/3 of it after the grant), within 2 x D's 30 s read timeout
        p.step()
        expired = p.connectors.worker.stats.expired_leases
        assert expired == (0 if read_hold_fix else 1)
        if not read_hold_fix:  # P reuses the freed blocks: another prompt's KV is written into them
            other = list(range(3000, 3000 + (blocks + 1) * 16 - 2))
            assert p.generate([other], SamplingParams(max_tokens=1))
        d_agent.set_faults(FaultConfig())  # the read completes: it copies what the blocks hold now
        while not (outs and outs[-1].finished):
            assert time.monotonic() < deadline, "D did not finish"
            outs += [o for o in d.step().outputs if o.request_id == "d-1"]
            p.step()
        got, failed = tokens(outs), dict(d.connectors.worker.stats.failed_transfers)
        if read_hold_fix:
            assert got == wants[0] and not failed
        elif kv_verify:
            assert got == wants[0] and failed == {"kv_content_mismatch": 1}
            assert d.connectors.worker.stats.recomputed_requests == 1
        else:
            assert got != wants[0] and not failed  # decoded from the other prompt's KV, unnoticed
        settle(p, d)
        assert all_blocks_free(p, d)
    finally:
        p.shutdown()
        d.shutdown()


@pytest.fixture(scope="module")
def layouts(tmp_path_factory, loaded):
    """Tiny random-weight models of the two other layouts a read covers: MLA (DeepSeek-V2: one latent
    per token) and hybrid (Bamba: an attention group and Mamba state pages; kernel blocks of 4)."""
    from kvbridge.engine.loader.synthetic import TINY_BAMBA, TINY_DEEPSEEK_V2_MOE, write_synthetic_folder
    out = {}
    for name, architecture, geometry, block in (("mla", "deepseek_v2", TINY_DEEPSEEK_V2_MOE, 16),
                                                ("hybrid", "bamba", TINY_BAMBA, 4)):
        folder = write_synthetic_folder(tmp_path_factory.mktemp("models") / name, loaded.tokenizer,
                                        architecture=architecture, **geometry)
        out[name] = (load_model(str(folder)), block)
    return out


@pytest.mark.parametrize("layout", ["mla", "hybrid"])
def test_mla_and_hybrid_reads_are_verified_and_a_corrupted_one_is_caught(layouts, prompts, layout):
    """What D reads of an MLA latent or of a hybrid model's attention blocks and Mamba state pages is
    digested by P the same way (the reader's spans): a clean read lands verified, a corrupted one is
    caught and recomputed to the colocated answer; every block free."""
    model, block = layouts[layout]
    colocated = make_engine(model, None, block_size=block)
    try:
        want = colocated.generate(prompts[:2], GREEDY)
    finally:
        colocated.shutdown()
    fabric = FakeFabric(seed=7)
    corrupting = CorruptingBackend(fabric.create_agent("D"), 0.0, ("corrupt",), seed=13)
    p = make_engine(model, KVRole.PRODUCER, fabric.create_agent("P"), block_size=block, engine_id="P")
    d = make_engine(model, KVRole.CONSUMER, corrupting, block_size=block, engine_id="D")
    try:
        stats = d.connectors.worker.stats
        assert tokens(decode(d, p, prompts[0], prefill(p, prompts[0]), GREEDY)) == want[0]
        assert stats.transfers >= 1 and stats.unverified_reads == 0 and not stats.failed_transfers
        corrupting.rate = 1.0
        assert tokens(decode(d, p, prompts[1], prefill(p, prompts[1]), GREEDY)) == want[1]
        assert dict(stats.failed_transfers) == {"kv_content_mismatch": 1} and stats.recomputed_requests == 1
        assert p.connectors.worker.stats.kv_content_mismatches == 1
        settle(p, d)
        assert all_blocks_free(p, d)
    finally:
        p.shutdown()
        d.shutdown()
