"""A replica with TP > 1 on Ray (issue 29): the prefill replica's engine runs at tensor parallel
size 2 (two rank processes), its placement group (STRICT_PACK, one bundle per rank) holds both
bundles on the prefill node, the decode replica (TP 1) sits on the decode node, and greedy
answers through the Ray router equal a colocated TP 1 instance's, the KV crossing from P's two
ranks to D. The model is a small random-weight Llama with 4 KV heads (SmolLM2's 9 heads split
only at TP 3), so its colocated reference is its own, not the session's. Removing the application
leaves no engine or rank process behind. On the session's Ray cluster (conftest.py)."""

from __future__ import annotations

import pytest
from openai import OpenAI

from kvbridge.engine.loader import load_model
from kvbridge.engine.loader.synthetic import TINY_4_KV_HEADS, write_synthetic_folder
from kvbridge.ray import app
from tests.e2e.processes import gone, metric, rank_pids
from tests.ray.cluster import (D_RESOURCE, MODEL, P_RESOURCE, app_config, application, assert_blocks_free,
                               colocated_instance, node_of, wait_router)

pytestmark = pytest.mark.timeout(900)
NAME = "kvbridge-tp"
ONE_EACH = {"prefill": 1, "decode": 1}
PROMPTS = ["Hello there",
           ("The history of the Roman Empire spans many centuries, from the founding of the city to the fall of "
            "Constantinople. Summarise its three most important turning points:")]  # several blocks


def answers(base: str) -> list[str]:
    client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=300)
    [model] = [m.id for m in client.models.list().data]
    out = []
    for prompt in PROMPTS:
        out.append(client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0).choices[0].text)
        chunks = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0, stream=True)
        out.append("".join(c.choices[0].text for c in chunks if c.choices))
    return out


def test_a_tp2_prefill_replica_on_its_node_answers_equal_colocated(tmp_path, shared_ray):
    from ray.util import placement_group_table

    folder = write_synthetic_folder(tmp_path / "tiny-llama", load_model(MODEL).tokenizer, **TINY_4_KV_HEADS)
    model = str(folder)
    (tmp_path / "colocated").mkdir()
    config = app_config(NAME, app.PoolSize(1, 1), app.PoolSize(1, 1), model=model, prefill_tp=2)
    with colocated_instance(tmp_path / "colocated", model) as reference, \
            application(shared_ray, config) as deployed:
        cluster, url, pools = deployed.cluster, deployed.url, deployed.pools
        pools.wait(lambda e: {r: len(e[r]) for r in ONE_EACH} == ONE_EACH, 60, "1 P and 1 D published")
        wait_router(NAME, lambda m: {r: len([u for u in m[r] if u["healthy"]]) for r in ONE_EACH} == ONE_EACH,
                    30, "the router has a healthy P and D")
        [p], [d] = pools.endpoints["prefill"], pools.endpoints["decode"]
        p_node, d_node = node_of(cluster, P_RESOURCE), node_of(cluster, D_RESOURCE)
        assert (p.node_id, d.node_id) == (p_node, d_node)
        # The P replica's placement group: one bundle per rank, all on the prefill node (Serve
        # names a replica's group after the replica: SERVE_REPLICA::app#deployment#id).
        groups = [g for g in placement_group_table().values()
                  if g["state"] == "CREATED" and g["name"].startswith(f"SERVE_REPLICA::{NAME}#")]
        assert [(g["strategy"], len(g["bundles"])) for g in groups] == [("STRICT_PACK", 2)], groups
        assert set(groups[0]["bundles_to_node_id"].values()) == {p_node}
        ranks = rank_pids(p.pid)  # the engine really runs two rank processes; D's runs in its own
        assert len(ranks) == 2 and rank_pids(d.pid) == [], (ranks, rank_pids(d.pid))
        served = answers(url)
        assert served == answers(reference)
        assert len(set(served)) > 1  # the answers depend on the prompt (the weights are not degenerate)
        assert metric(d.url, "kvbridge_kv_transfer_bytes_total") > 0  # the KV came from P's two ranks
        assert_blocks_free([p.url, d.url])
        assert metric(p.url, "kvbridge_kv_expired_leases_total") == 0
        engines = [p.pid, d.pid, *ranks]
        app.remove(NAME)
        assert gone(engines, 120) == [], "engine or rank processes outlived their replica"
