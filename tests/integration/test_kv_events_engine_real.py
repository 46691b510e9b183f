"""A real engine (the default model, a small KV cache) publishing its prefix cache's KV events
through ZMQ: two engines agree on every hash, the router's fleet index and vLLM's own structs read
the stream (fetched through vLLM's replay protocol), eviction reaches the index."""

from __future__ import annotations

import msgspec
import pytest
import zmq

from kvbridge.engine.sampling_params import SamplingParams
from kvbridge.kv_events.events import BlockRemoved, decode_batch
from kvbridge.kv_events.hashing import block_hashes
from kvbridge.kv_events.index import FleetIndex
from kvbridge.kv_events.publisher import END_SEQ, SEQ_BYTES
from tests.unit.kv_events_vllm_reference import MapKVEventBatch


def _replay(endpoint: str) -> list[tuple[bytes, bytes]]:
    """Every batch the publisher kept, from seq 0, through vLLM's replay protocol."""
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    try:
        dealer.connect(endpoint)
        dealer.send_multipart((b"", (0).to_bytes(SEQ_BYTES, "big")))
        out = []
        while True:
            assert dealer.poll(5000), "no replay answer within 5 s"
            frames = dealer.recv_multipart()
            if frames[2] == END_SEQ:
                return out
            out.append((frames[2], frames[3]))
    finally:
        dealer.close(linger=0)


@pytest.fixture(scope="module")
def engines():
    from kvbridge.config import CacheConfig, EngineConfig
    from kvbridge.engine.engine import LLMEngine
    from kvbridge.kv_events.config import parse_kv_events_config
    built = []
    try:
        for _ in range(2):
            cfg = EngineConfig(num_threads=1, cache=CacheConfig(num_blocks=12), kv_events=parse_kv_events_config(
                '{"enable_kv_cache_events": true, "replay_endpoint": "tcp://127.0.0.1:*", "topic": "kv"}'))
            built.append(LLMEngine.from_config(cfg))
        yield built
    finally:
        for e in built:
            e.shutdown()


def test_a_real_engine_publishes_what_it_cached_and_a_vllm_consumer_reads_it(engines):
    a, b = engines
    assert a.kv_events is not None and a.kv_events.endpoint.startswith("tcp://127.0.0.1:")
    assert a.kv_events.hash_root == b.kv_events.hash_root  # same model: same root, in any engine
    prompt = list(range(300, 340))  # 2 full blocks of 16 + 8
    a.generate([prompt], SamplingParams(max_tokens=2, temperature=0))
    b.generate([prompt], SamplingParams(max_tokens=2, temperature=0))
    index = FleetIndex(bytes.fromhex(a.kv_events.hash_root), a.kv_events.block_size)
    stored: dict[str, list[int]] = {}
    for name, e in (("a", a), ("b", b)):
        batches = _replay(e.kv_events.replay_endpoint)
        for seq, payload in batches:
            assert index.ingest(name, [b"kv", seq, payload]).outcome.value == "applied"
            vllm = msgspec.msgpack.decode(payload, type=MapKVEventBatch)  # vLLM's own structs read it
            stored.setdefault(name, []).extend(h for ev in vllm.events if type(ev).__name__ == "MapBlockStored"
                                               for h in ev.block_hashes)
    assert stored["a"] == stored["b"] == block_hashes(bytes.fromhex(a.kv_events.hash_root), prompt, 16)
    assert index.overlap("a", prompt) == index.overlap("b", prompt) == 2
    # Eviction: a new prompt needs every block; the cached ones leave with BlockRemoved.
    before = len(_replay(a.kv_events.replay_endpoint))
    a.generate([list(range(1000, 1000 + 16 * 12 - 1))], SamplingParams(max_tokens=1, temperature=0))
    new = _replay(a.kv_events.replay_endpoint)[before:]
    events = [ev for _, p in new for ev in decode_batch(p).events]
    removed = {h for ev in events if isinstance(ev, BlockRemoved) for h in ev.block_hashes}
    assert set(stored["a"]) <= removed
    for seq, payload in new:
        index.ingest("a", [b"kv", seq, payload])
    assert index.overlap("a", prompt) == 0 and index.overlap("b", prompt) == 2
    assert a.kv_cache_manager.num_free_blocks == a.kv_cache_manager.pool.num_usable_blocks
    load = a.load()
    assert load.prefill_tokens_per_s is not None and load.prefill_tokens_per_s > 0
    assert load.kv_bytes_per_token > 0 and load.kv_pull_bytes_per_s is None


def test_an_endpoint_that_cannot_bind_is_a_clear_error(tmp_path):
    from kvbridge.config import CacheConfig, EngineConfig
    from kvbridge.engine.engine import LLMEngine
    from kvbridge.kv_events.config import parse_kv_events_config
    cfg = EngineConfig(num_threads=1, cache=CacheConfig(num_blocks=12), kv_events=parse_kv_events_config(
        '{"enable_kv_cache_events": true, "endpoint": "ipc://%s/no-such-folder/events"}' % tmp_path))
    with pytest.raises(ValueError, match="cannot publish KV events"):
        LLMEngine.from_config(cfg)
