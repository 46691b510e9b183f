"""P and D started with an API key: the connector halves authenticate every side-channel
request (handshake, lease check, read-done, release), and a D without P's key gets no
metadata and frees nothing. In process, on the real default model and side channel."""

from __future__ import annotations

import pytest

from kvbridge import cli
from kvbridge.config import CacheConfig, EngineConfig, KVRole, KVTransferConfig, LoadFailurePolicy
from kvbridge.engine.engine import LLMEngine
from kvbridge.engine.kv_connector_factory import build_connectors
from kvbridge.engine.loader import load_model
from kvbridge.engine.request import FinishReason
from kvbridge.engine.sampling_params import SamplingParams
from kvbridge.kv_transfer.backends.fake import FakeFabric
from kvbridge.kv_transfer.side_channel.control import ControlClient
from kvbridge.kv_transfer.side_channel.handshake import HandshakePeerError
from kvbridge.kv_transfer.side_channel.client import HandshakeClient
from tests.integration.pd_harness import decode, prefill, settle, tokens

GREEDY = SamplingParams(max_tokens=8, temperature=0)
KEY = "sk-shared-by-p-and-d"


@pytest.fixture(scope="module")
def loaded():
    return load_model("SmolLM2-135M-Instruct")


@pytest.fixture(scope="module")
def prompt(loaded):
    tok = loaded.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": "Name three rivers of Europe."}]))


@pytest.fixture(scope="module")
def want(loaded, prompt):
    colocated = LLMEngine(EngineConfig(cache=CacheConfig(num_blocks=96), num_threads=2), loaded, None)
    return colocated.generate([prompt], GREEDY)[0]


def engine(loaded, fabric: FakeFabric, role: KVRole, key: str | None,
           policy: LoadFailurePolicy = LoadFailurePolicy.RECOMPUTE, lease_s: float = 30.0) -> LLMEngine:
    name = "P" if role is KVRole.PRODUCER else "D"
    kv = KVTransferConfig(role=role, backend="fake", engine_id=name, lease_seconds=lease_s,
                          load_failure_policy=policy, handshake_timeout_s=2.0, side_channel_key=key)
    config = EngineConfig(cache=CacheConfig(num_blocks=96), kv_transfer=kv, num_threads=2)
    return LLMEngine(config, loaded, build_connectors(config, loaded.arch, loaded.name, fabric.create_agent(name)))


def test_serve_api_key_reaches_the_side_channel_config() -> None:
    args = cli.build_parser().parse_args(["serve", "--api-key", KEY, "--kv-role", "producer"])
    assert cli.engine_config_from_args(args).kv_transfer.side_channel_key == KEY
    args = cli.build_parser().parse_args(["serve", "--kv-role", "consumer", "--api-key", ""])
    assert cli.engine_config_from_args(args).kv_transfer.side_channel_key is None
    assert KEY not in repr(KVTransferConfig(role=KVRole.PRODUCER, side_channel_key=KEY))


def test_p_and_d_with_the_same_key_transfer_and_outsiders_are_refused(loaded, prompt, want):
    fabric = FakeFabric(seed=3)
    p, d = engine(loaded, fabric, KVRole.PRODUCER, KEY), engine(loaded, fabric, KVRole.CONSUMER, KEY)
    try:
        side_channel = p.connectors.worker.side_channel
        assert side_channel.authenticated
        params = prefill(p, prompt)
        host, port = params["remote_host"], params["remote_port"]
        gen = params["lease_generation"]
        # An outsider cannot release the lease nor fetch P's metadata.
        with pytest.raises(HandshakePeerError, match="authentication"):
            ControlClient(2.0).release(host, port, params["remote_request_id"], gen)
        with pytest.raises(HandshakePeerError, match="authentication"):
            HandshakeClient().fetch(host, port, 0, timeout=2.0)
        assert p.metrics().num_held_for_remote == 1 and side_channel.num_unauthenticated == 2
        # D, with the key: handshake, lease check, read and read-done all go through.
        assert tokens(decode(d, p, prompt, params, GREEDY)) == want
        settle(p, d)
        assert d.connectors.worker.stats.transfers == 1 and p.metrics().num_held_for_remote == 0
        assert side_channel.num_unauthenticated == 2
    finally:
        settle(p, d)
        p.shutdown()
        d.shutdown()


@pytest.mark.parametrize("policy", [LoadFailurePolicy.RECOMPUTE, LoadFailurePolicy.FAIL])
@pytest.mark.parametrize("d_key", [None, "not the key"])
def test_a_d_without_ps_key_gets_nothing_and_follows_the_policy(loaded, prompt, want, d_key, policy):
    fabric = FakeFabric(seed=4)
    p = engine(loaded, fabric, KVRole.PRODUCER, KEY, lease_s=1.0)  # D cannot release it: let it expire
    d = engine(loaded, fabric, KVRole.CONSUMER, d_key, policy)
    try:
        outs = decode(d, p, prompt, prefill(p, prompt), GREEDY)
        if policy is LoadFailurePolicy.RECOMPUTE:
            assert tokens(outs) == want
        else:
            assert outs[-1].finish_reason is FinishReason.ERROR and not tokens(outs)
        assert d.connectors.worker.stats.failed_transfers["handshake"] == 1
        assert d.connectors.worker.stats.transfers == 0
        assert p.connectors.worker.side_channel.num_unauthenticated >= 1
        assert p.connectors.worker.side_channel.num_served == 0  # no handler ran for D
    finally:
        settle(p, d)  # until P's lease expires
        p.shutdown()
        d.shutdown()
