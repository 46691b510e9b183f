"""P/D of a hybrid model (Qwen2 mixing full-attention and sliding-window layers: two KV cache
groups) end to end: real `kvbridge serve` processes, a real `kvbridge proxy`, the openai
client, over NIXL (over tcp: tests/integration/test_sliding_window_pd.py, real tcp agents); P at
TP 2, D at TP 1 (sliding groups split by head like any other).

Per pairing: a fresh prompt longer than the window (D reads every block of both groups), a
prompt sharing its long prefix (a partial prefix hit on D: D reads only the tail), and the
first prompt again (a full hit: D computes the short tail itself). Greedy text equals one
colocated TP 1 engine's; every block of every group is free on every instance afterwards and
no lease expired.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvbridge.config import KVRole
from kvbridge.engine.loader import load_model
from kvbridge.engine.loader.synthetic import TINY_QWEN2_SLIDING, write_synthetic_folder
from tests.e2e.processes import metric
from tests.fleet import SMOLLM2, FleetSpec, Member, Reference, assert_settled, complete

INSTANCES = {"p2": Member(KVRole.PRODUCER, 2), "d1": Member(KVRole.CONSUMER, 1)}
BASE = ("The history of the Roman Empire spans many centuries, from the founding of the city on the Tiber by "
        "its legendary twins, through the kings, the republic and its civil wars, to the fall of ")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("models") / "tiny-qwen2-sliding"
    write_synthetic_folder(folder, load_model(SMOLLM2).tokenizer, architecture="qwen2", **TINY_QWEN2_SLIDING)
    return str(folder)


@pytest.fixture(scope="module")
def want(model) -> Reference:
    return Reference(model)


@pytest.fixture(scope="module")
def fleet(model, fleets):
    return fleets.shared(FleetSpec.of(model, "nixl", INSTANCES))


def test_hybrid_pd_answers_like_one_engine_with_partial_and_full_hits_on_d(fleet, model, want):
    prefill = "p2"
    served, url, d = Path(model).name, fleet.proxy(prefill, "d1"), fleet.urls["d1"]
    first = f"[{prefill}] {BASE}Constantinople. Summarise it."
    assert len(want.loaded.tokenizer.encode(first)) > 2 * TINY_QWEN2_SLIDING["sliding_window"]
    steps = []
    for prompt in (first, f"[{prefill}] {BASE}the west. Who ruled first?", first):
        reads, moved = metric(d, "kvbridge_kv_transfers_total"), metric(d, "kvbridge_kv_transfer_bytes_total")
        hits = metric(d, "kvbridge_prefix_cache_hits_total")
        assert complete(url, served, prompt) == want(prompt), prompt
        steps.append((metric(d, "kvbridge_kv_transfers_total") - reads,
                      metric(d, "kvbridge_kv_transfer_bytes_total") - moved,
                      metric(d, "kvbridge_prefix_cache_hits_total") - hits))
    (reads0, bytes0, hits0), (reads1, bytes1, hits1), (reads2, bytes2, hits2) = steps
    assert reads0 == 1 and bytes0 > 0 and hits0 == 0  # everything read
    assert reads1 == 1 and 0 < bytes1 < bytes0 and hits1 > 0  # the shared prefix from D's cache
    assert bytes2 == 0 and hits2 > 0  # every full block already on D
    assert_settled(fleet, list(INSTANCES))
    assert metric(d, "kvbridge_kv_recomputed_requests_total") == 0
