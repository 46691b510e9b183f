"""Every failure class x {recompute, fail}, injected for real: rogue or dead side
channels for the handshake classes, the fake backend's knobs for the transfer classes.

recompute: D's greedy output equals the colocated engine's. fail: the request finishes
with an error saying the KV transfer failed. Both: the class is counted, D serves the
next request, and every block is free on P and D afterwards (P's by the lease)."""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import struct
import threading

import pytest

from kvbridge.config import EngineConfig, KVRole, LoadFailurePolicy
from kvbridge.engine.kv_connector_factory import compatibility_of
from kvbridge.engine.loader import load_model
from kvbridge.engine.request import FinishReason
from kvbridge.engine.sampling_params import SamplingParams
from kvbridge.kv_transfer.backends.fake import FakeFabric, FaultConfig
from kvbridge.kv_transfer.side_channel.handshake import HandshakeMetadata, HandshakeRefused, encode_payload
from kvbridge.kv_transfer.params import parse_kv_transfer_params
from kvbridge.kv_transfer.side_channel.server import SideChannelServer
from kvbridge.shape.model_config import MLAConfig, ModelArchConfig, ModelFamily
from tests.integration.pd_harness import decode, make_engine, prefill, settle, tokens

GREEDY = SamplingParams(max_tokens=6, temperature=0)
HANDSHAKE_FAULTS = ["refused", "timeout", "version", "hash", "engine_id", "layout", "tp_pairing", "huge_tp",
                    "mla", "undecodable"]
# A DeepSeek-V2-shaped MLA model: its KV cache is one latent of 512 + 64 values per token.
MLA_ARCH = ModelArchConfig(ModelFamily.DEEPSEEK_V2, vocab_size=64, hidden_size=1024, intermediate_size=2048,
                           num_layers=4, num_heads=16, num_kv_heads=16, head_dim=192,
                           mla=MLAConfig(kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128,
                                         qk_rope_head_dim=64, v_head_dim=128))
MLA_REASON = ("the prefill engine serves an MLA model (latent KV cache) and this engine a non-MLA one: "
              "they cannot exchange KV")
TRANSFER_FAULTS = {"fail_read_setup": "transfer_setup", "error_state": "transfer_state",
                   "raise_on_check_state": "transfer_poll", "peer_killed": "transfer_state"}


@pytest.fixture(scope="module")
def loaded():
    return load_model("SmolLM2-135M-Instruct")


@pytest.fixture(scope="module")
def prompt(loaded):
    tok = loaded.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": "Which ocean is the largest?"}]))


@pytest.fixture(scope="module")
def want(loaded, prompt):
    return make_engine(loaded, None).generate([prompt], GREEDY)[0]


def p_payload(p) -> bytes:
    return p.connectors.worker.side_channel._payloads[0]


@contextlib.contextmanager
def rogue_side_channel(fault: str, p):
    """A side channel at another port that misbehaves as `fault` says; yields its port."""
    if fault in ("refused",):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()  # nothing listens there any more
        yield port
        return
    if fault == "timeout":
        s = socket.create_server(("127.0.0.1", 0))
        conns = []
        stop = threading.Event()

        def accept_and_hold():
            s.settimeout(0.1)
            while not stop.is_set():
                with contextlib.suppress(OSError):
                    conns.append(s.accept()[0])
        t = threading.Thread(target=accept_and_hold, daemon=True)
        t.start()
        yield s.getsockname()[1]
        stop.set()
        t.join()
        for c in conns:
            c.close()
        s.close()
        return
    good = p_payload(p)
    if fault == "version":
        payload = good[:4] + struct.pack("!H", 99) + good[6:]
    elif fault == "hash":
        payload = good[:6] + bytes(b ^ 0xFF for b in good[6:38]) + good[38:]
    elif fault == "layout":
        w = p.connectors.worker
        meta = HandshakeMetadata(w.engine_id, w.config.backend, w.backend.agent_metadata(),
                                 dataclasses.replace(w.ranks[0].layout, block_size=32, kv_layout="NHD"))
        payload = encode_payload(meta, w.compat.hash())
    elif fault == "tp_pairing":  # a P of TP 1 that holds only KV head 0 of 3: D's heads 1, 2 are nowhere
        w = p.connectors.worker
        layout = w.ranks[0].layout
        meta = HandshakeMetadata(w.engine_id, w.config.backend, w.backend.agent_metadata(), dataclasses.replace(
            layout, num_kv_heads=1, block_len_bytes=(layout.block_len_bytes[0] // layout.num_kv_heads,)))
        payload = encode_payload(meta, w.compat.hash())
    elif fault == "huge_tp":  # a P claiming a million ranks: D refuses rather than fetch them all
        w = p.connectors.worker
        meta = HandshakeMetadata(w.engine_id, w.config.backend, w.backend.agent_metadata(),
                                 dataclasses.replace(w.ranks[0].layout, tp_size=10**6))
        payload = encode_payload(meta, w.compat.hash())
    elif fault == "mla":  # a P serving an MLA model (its real description and hash) to D's SmolLM2
        w = p.connectors.worker
        meta = HandshakeMetadata(w.engine_id, w.config.backend, w.backend.agent_metadata(), w.ranks[0].layout)
        payload = encode_payload(meta, compatibility_of(EngineConfig(), MLA_ARCH, "tiny-deepseek-v2"))
    else:  # undecodable
        payload = good[:38] + struct.pack("!I", 9) + b"not json!"
    with SideChannelServer({0: payload}).start() as server:
        yield server.port


# A lease the test waits out: short, so that it expires soon. A lease that must not expire
# (D frees the blocks first): long, so that no slow step on a loaded machine outlasts it.
SHORT_LEASE_S, LONG_LEASE_S = 1.0, 30.0


def engines(loaded, policy, d_faults=None, lease_s=SHORT_LEASE_S):
    fabric = FakeFabric(seed=7)
    p = make_engine(loaded, KVRole.PRODUCER, fabric.create_agent("P"), engine_id="P", lease_s=lease_s)
    # D's read timeout well under the lease: a granted read holds P's blocks for two of them.
    d = make_engine(loaded, KVRole.CONSUMER, fabric.create_agent("D", d_faults), engine_id="D", policy=policy,
                    handshake_timeout_s=0.5, transfer_timeout_s=lease_s / 4)
    return fabric, p, d


def check_outcome(outs, policy, want):
    if policy is LoadFailurePolicy.RECOMPUTE:
        assert tokens(outs) == want
    else:
        assert outs[-1].finish_reason is FinishReason.ERROR and not tokens(outs)
        assert "KV transfer failed" in outs[-1].error and "retried" in outs[-1].error


# Every class under recompute (the answer equals colocated); under fail, the classes whose error names
# a reason of its own, and one of a dead and one of a silent peer. The policy is applied the same way
# whatever the class (the receiver reports a failed load; the scheduler applies the policy): the other
# five classes under fail were the same path, and each class's own handling is in test_kv_receiver.
FAIL_TOO = ("refused", "timeout", "tp_pairing", "huge_tp", "mla")
HANDSHAKE_CASES = [(fault, LoadFailurePolicy.RECOMPUTE) for fault in HANDSHAKE_FAULTS] + \
    [(fault, LoadFailurePolicy.FAIL) for fault in FAIL_TOO]


@pytest.mark.parametrize(("fault", "policy"), HANDSHAKE_CASES, ids=[f"{f}-{p.value}" for f, p in HANDSHAKE_CASES])
def test_handshake_failures_follow_the_policy(loaded, prompt, want, fault, policy):
    fabric, p, d = engines(loaded, policy)
    try:
        params = prefill(p, prompt)
        if fault == "engine_id":
            outs = decode(d, p, prompt, {**params, "remote_engine_id": "not-P"}, GREEDY)
        else:
            with rogue_side_channel(fault, p) as port:
                outs = decode(d, p, prompt, {**params, "remote_port": port}, GREEDY)
        check_outcome(outs, policy, want)
        assert d.connectors.worker.stats.failed_transfers["handshake"] == 1
        if fault in ("tp_pairing", "huge_tp"):  # refused before any read, with the reason
            assert d.connectors.worker.stats.handshake_failures["layout_mismatch"] == 1
            assert d.connectors.worker.stats.transfers == 0
            if policy is LoadFailurePolicy.FAIL:
                reason = "different KV heads (3 here, 1 remote)" if fault == "tp_pairing" else "TP size 1000000"
                assert reason in outs[-1].error
        if fault == "mla":  # refused on the hash, before any read, saying why
            assert d.connectors.worker.stats.handshake_failures["hash_mismatch"] == 1
            assert d.connectors.worker.stats.transfers == 0
            if policy is LoadFailurePolicy.FAIL:
                assert MLA_REASON in outs[-1].error and "use_mla (peer true, local false)" in outs[-1].error
        # The engine lives on and the real P still works.
        assert tokens(decode(d, p, prompt, prefill(p, prompt), GREEDY)) == want
        settle(p, d)  # the abandoned lease expires on P
        assert p.connectors.worker.stats.expired_leases == 1
    finally:
        p.shutdown()
        d.shutdown()


@pytest.mark.parametrize("policy", [LoadFailurePolicy.RECOMPUTE, LoadFailurePolicy.FAIL])
@pytest.mark.parametrize("fault", list(TRANSFER_FAULTS))
def test_transfer_failures_follow_the_policy(loaded, prompt, want, fault, policy):
    faults = None if fault == "peer_killed" else FaultConfig(**{fault: True})
    fabric, p, d = engines(loaded, policy, faults, lease_s=LONG_LEASE_S)
    try:
        params = prefill(p, prompt)
        if fault == "peer_killed":
            fabric.kill("P")  # P's transfer agent dies; its side channel still answers
        check_outcome(decode(d, p, prompt, params, GREEDY), policy, want)
        # One failure, counted once in its own class (a failed READ setup was once also
        # polled as a READ and failed again as transfer_poll).
        assert dict(d.connectors.worker.stats.failed_transfers) == {TRANSFER_FAULTS[fault]: 1}
        # D's release after the failure frees P's blocks (settle waits for the message to be sent
        # and applied); the 30 s lease cannot have expired, and P counts the release as early.
        settle(p, d)
        stats = p.connectors.worker.stats
        assert p.metrics().num_held_for_remote == 0 and stats.expired_leases == 0 and stats.early_releases == 1
        # The engine lives on: with the fault gone (a fresh P if it died), D serves again.
        if fault == "peer_killed":
            p.shutdown()
            p = make_engine(loaded, KVRole.PRODUCER, fabric.create_agent("P2"), engine_id="P2", lease_s=LONG_LEASE_S)
        else:
            d.connectors.worker.backend.set_faults(FaultConfig())
        assert tokens(decode(d, p, prompt, prefill(p, prompt), GREEDY)) == want
        settle(p, d)  # the read-done frees the second request's blocks
        assert p.metrics().num_held_for_remote == 0 and p.connectors.worker.stats.expired_leases == 0
    finally:
        p.shutdown()
        d.shutdown()


def test_lost_read_done_notification_is_covered_by_the_lease(loaded, prompt, want):
    fabric, p, d = engines(loaded, LoadFailurePolicy.FAIL)

    def unreachable(host, port, rid, gen):  # P's side channel fails for this one message
        raise HandshakeRefused(f"injected: cannot connect to side channel {host}:{port}")
    d.connectors.worker.receiving.control.read_done = unreachable
    try:
        assert tokens(decode(d, p, prompt, prefill(p, prompt), GREEDY)) == want  # the read itself succeeded
        # No "P still holds the blocks" check here: the 1 s lease may already have expired
        # during a slow decode. What freed them is told by the counters: the lease, no release.
        settle(p, d)
        assert d.connectors.worker.stats.failed_notifications == 1 and d.connectors.worker.stats.transfers == 1
        stats = p.connectors.worker.stats
        assert stats.expired_leases == 1 and stats.early_releases == 0 and p.metrics().num_held_for_remote == 0
    finally:
        p.shutdown()
        d.shutdown()


def test_failed_release_notification_is_counted_and_the_lease_frees(loaded, prompt):
    fabric, p, d = engines(loaded, LoadFailurePolicy.RECOMPUTE)
    try:
        params = prefill(p, prompt)
        with rogue_side_channel("refused", p) as port:
            d.add_request("gone", prompt, GREEDY, parse_kv_transfer_params({**params, "remote_port": port}))
            d.abort_request("gone")  # aborted before scheduling: D sends a release to a dead port
            settle(p, d)
        assert d.connectors.worker.stats.failed_notifications == 1
        assert p.connectors.worker.stats.expired_leases == 1
    finally:
        p.shutdown()
        d.shutdown()


# ---- MLA: a real DeepSeek-V2 engine pair (tiny random weights, MoE) --------------------------

@pytest.fixture(scope="module")
def mla(tmp_path_factory, loaded):
    from kvbridge.engine.loader.synthetic import TINY_DEEPSEEK_V2_MOE, write_synthetic_folder
    folder = write_synthetic_folder(tmp_path_factory.mktemp("models") / "tiny-deepseek-v2-moe", loaded.tokenizer,
                                    architecture="deepseek_v2", **TINY_DEEPSEEK_V2_MOE)
    model = load_model(str(folder))
    ids = model.tokenizer.encode(model.tokenizer.apply_chat_template([{"role": "user", "content": "Name a colour."}]))
    colocated = make_engine(model, None)
    try:
        want = [t for o in colocated.generate([ids], GREEDY) for t in o]
    finally:
        colocated.shutdown()
    return model, ids, want


@pytest.mark.parametrize("policy", [LoadFailurePolicy.RECOMPUTE, LoadFailurePolicy.FAIL])
def test_mla_read_failure_follows_the_policy_and_frees_p(mla, policy):
    """The read of the latent from the (one) chosen P rank fails: the policy applies on the MLA
    engine, D's release frees P's blocks at once (no lease expires), and D serves on."""
    model, prompt, want = mla
    assert model.arch.use_mla
    fabric, p, d = engines(model, policy, FaultConfig(error_state=True), lease_s=LONG_LEASE_S)
    try:
        check_outcome(decode(d, p, prompt, prefill(p, prompt), GREEDY), policy, want)
        assert dict(d.connectors.worker.stats.failed_transfers) == {"transfer_state": 1}
        settle(p, d)
        stats = p.connectors.worker.stats
        assert p.metrics().num_held_for_remote == 0 and stats.expired_leases == 0 and stats.early_releases == 1
        d.connectors.worker.backend.set_faults(FaultConfig())
        assert tokens(decode(d, p, prompt, prefill(p, prompt), GREEDY)) == want
        settle(p, d)
        assert p.metrics().num_held_for_remote == 0 and p.connectors.worker.stats.expired_leases == 0
        for e in (p, d):
            assert e.metrics().num_free_blocks == e.metrics().num_total_blocks
    finally:
        p.shutdown()
        d.shutdown()


@pytest.mark.parametrize("policy", [LoadFailurePolicy.RECOMPUTE, LoadFailurePolicy.FAIL])
def test_a_bf16_prefill_is_refused_at_an_fp32_decodes_handshake(loaded, prompt, want, policy):
    """Real engines in different dtypes (what two `--dtype auto` on different CPUs would give): D's
    handshake refuses P's KV on the hash, naming the dtype, before any read; recompute answers as
    the fp32 engine alone, fail says why. P's blocks are released at once, every block comes back."""
    fabric = FakeFabric(seed=7)
    p = make_engine(loaded, KVRole.PRODUCER, fabric.create_agent("P"), engine_id="P", lease_s=LONG_LEASE_S,
                    dtype="bfloat16")
    d = make_engine(loaded, KVRole.CONSUMER, fabric.create_agent("D"), engine_id="D", policy=policy)
    try:
        outs = decode(d, p, prompt, prefill(p, prompt), GREEDY)
        check_outcome(outs, policy, want)
        stats = d.connectors.worker.stats
        assert stats.failed_transfers["handshake"] == 1 and stats.handshake_failures["hash_mismatch"] == 1
        assert stats.transfers == 0
        if policy is LoadFailurePolicy.FAIL:
            assert 'dtype (peer "bfloat16", local "float32")' in outs[-1].error
        settle(p, d)
        assert p.connectors.worker.stats.early_releases == 1 and p.connectors.worker.stats.expired_leases == 0
        for e in (p, d):
            assert e.metrics().num_free_blocks == e.metrics().num_total_blocks
    finally:
        p.shutdown()
        d.shutdown()


@pytest.mark.parametrize("fault", ["hash", "version", "layout"])
def test_a_prefill_refused_at_its_own_handshake_is_released_at_once(loaded, prompt, want, fault):
    """P itself answers D's handshake with a payload D refuses (another dtype or model: the hash; another
    protocol version; a layout D cannot map): P's side channel answered, so D tells P to release the
    lease at once instead of leaving the blocks to the lease's expiry (seen end to end with a bf16 P
    in front of an fp32 D: P's blocks stayed 30 s)."""
    fabric, p, d = engines(loaded, LoadFailurePolicy.RECOMPUTE, lease_s=LONG_LEASE_S)
    try:
        w = p.connectors.worker
        good = p_payload(p)
        if fault == "hash":
            bad = good[:6] + bytes(b ^ 0xFF for b in good[6:38]) + good[38:]
        elif fault == "version":
            bad = good[:4] + struct.pack("!H", 99) + good[6:]
        else:
            meta = HandshakeMetadata(w.engine_id, w.config.backend, w.backend.agent_metadata(),
                                     dataclasses.replace(w.ranks[0].layout, block_size=32, kv_layout="NHD"))
            bad = encode_payload(meta, w.compat.hash())
        w.side_channel._payloads[0] = bad
        outs = decode(d, p, prompt, prefill(p, prompt), GREEDY)
        assert tokens(outs) == want  # recomputed on D
        assert d.connectors.worker.stats.failed_transfers["handshake"] == 1
        settle(p, d)
        stats = p.connectors.worker.stats
        assert p.metrics().num_held_for_remote == 0 and stats.expired_leases == 0 and stats.early_releases == 1
    finally:
        p.shutdown()
        d.shutdown()
