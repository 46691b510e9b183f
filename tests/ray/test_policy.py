"""The Ray application's pure parts: the autoscaling policy of each pool (policy.py), pool sizes
and the Serve config the application is deployed with (app.py). No Ray cluster."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvbridge.ray import app, policy
from kvbridge.ray.policy import Load, decode_replicas, prefill_replicas


def test_prefill_grows_on_queued_prompt_tokens_and_on_a_long_wait():
    idle = Load()
    assert prefill_replicas([idle, idle], 2) == 0  # idle: shrink (Serve's MIN bound holds)
    assert prefill_replicas([Load(running=1)], 1) == 1  # busy, no queue: keep one
    assert prefill_replicas([Load(queued_prompt_tokens=5000, waiting=3)], 1, target_queued_tokens=2048) == 3
    assert prefill_replicas([Load(queued_prompt_tokens=100, waiting=1, oldest_wait_s=2.5)], 2,
                            target_wait_s=1.0) == 3  # a queue that waits too long asks for one more
    assert prefill_replicas([Load(queued_prompt_tokens=100, waiting=1, oldest_wait_s=0.5)], 2) == 1


def test_decode_grows_on_sequences_and_kv_usage():
    assert decode_replicas([Load(), Load()], 2) == 0
    assert decode_replicas([Load(running=40)], 1, target_running=16) == 3
    # KV: 90% of the blocks in use against a 0.7 target -> ceil(1 * 0.9 / 0.7) = 2
    assert decode_replicas([Load(running=4, kv_blocks_total=100, kv_blocks_used=90)], 1, target_kv_usage=0.7) == 2
    # sequences that keep waiting (for KV or a slot) ask for one more; a request's moment in line does not
    assert decode_replicas([Load(running=2, waiting=1, kv_blocks_total=100, kv_blocks_used=10)], 2) == 3
    assert decode_replicas([Load(running=2, waiting=0.2, kv_blocks_total=100, kv_blocks_used=10)], 2) == 1


def test_draining_replicas_do_not_count():
    leaving = Load(queued_prompt_tokens=10_000, running=50, waiting=5, draining=1)
    assert prefill_replicas([leaving, Load()], 2) == 0
    assert decode_replicas([leaving, Load()], 2) == 0


def test_bad_targets_are_refused():
    with pytest.raises(ValueError):
        prefill_replicas([], 1, target_queued_tokens=0)
    with pytest.raises(ValueError):
        decode_replicas([], 1, target_kv_usage=1.5)


def test_serve_policies_read_serves_aggregated_metrics():
    """The class-callables Serve runs: one Load per running replica from {metric: {replica: value}};
    a replica that has not reported yet counts as idle."""
    ctx = SimpleNamespace(running_replicas=["a", "b", "c"], current_num_replicas=3, total_queued_requests=0.0,
                          aggregated_metrics={
        "queued_prompt_tokens": {"a": 3000.0, "b": 2000.0}, "waiting": {"a": 2.0}, "running": {"b": 1.0},
        "kv_blocks_total": {"a": 100.0, "b": 100.0}, "kv_blocks_used": {"a": 50.0, "b": 80.0}})
    assert policy.PrefillPolicy(target_queued_tokens=1000)(ctx) == (5, {})
    # sequences 3 -> 1; KV 130/200 = 0.65 over 3 replicas against 0.5 -> ceil(3.9) = 4; a waiting one -> 4
    assert policy.DecodePolicy(target_running=16, target_kv_usage=0.5)(ctx) == (4, {})
    assert policy.loads_from_metrics(None, ["x"]) == [Load()]


def test_a_pool_at_zero_grows_on_the_requests_waiting_for_it():
    """No replica reports load; the router's wake calls waiting in the pool's handle queue ask
    for one replica (issue 44.2)."""
    for serve_policy in (policy.PrefillPolicy(), policy.DecodePolicy()):
        empty = SimpleNamespace(running_replicas=[], current_num_replicas=0, total_queued_requests=0.0,
                                aggregated_metrics={})
        assert serve_policy(empty) == (0, {})
        assert serve_policy(SimpleNamespace(**{**vars(empty), "total_queued_requests": 0.4})) == (1, {})


def test_pool_sizes():
    assert app.PoolSize.parse("3") == app.PoolSize(3, 3, autoscale=False)
    assert app.PoolSize.parse("0:4") == app.PoolSize(0, 4, autoscale=True)
    for bad in ("0", "3:1", "x", "1:0", "-1:2"):
        with pytest.raises(ValueError):
            app.PoolSize.parse(bad)


SIZES = (app.PoolSize(1, 1), app.PoolSize(2, 2), app.PoolSize(1, 2, True), app.PoolSize(0, 3, True))


def code_version(config: app.AppConfig, initial: bool = True) -> str:
    """Serve's code version of the config (a change restarts every replica of the application)."""
    from ray.serve._private.deploy_utils import get_app_code_version
    from ray.serve.schema import ServeApplicationSchema
    schema = config.schema()
    if not initial:
        schema["deployments"] = [config.size_override(r, initial=False) for r in ("prefill", "decode")]
    return get_app_code_version(ServeApplicationSchema(**schema))


def test_every_change_of_sizes_keeps_serves_code_version():
    """Issue 44.3: fixed -> MIN:MAX changed Serve's code version (the autoscaling policy is part
    of it), so the first `kvbridge ray scale` to a range restarted every replica. Every pool is
    deployed with the same autoscaling policy (a fixed N is MIN = MAX = N): any two sizes of
    either pool give one code version."""
    versions = {code_version(app.AppConfig(model="m", prefill=p, decode=d), initial)
                for p in SIZES for d in SIZES for initial in (True, False)}
    assert len(versions) == 1


def test_the_sizes_are_the_configs_only_lightweight_part():
    """Sizes and autoscaling live in the deployments' overrides, never in the builder's args."""
    fixed = app.AppConfig(model="m", prefill=app.PoolSize(1, 1), decode=app.PoolSize(2, 2))
    scaled = app.AppConfig(model="m", prefill=app.PoolSize(1, 4, True), decode=app.PoolSize(0, 3, True))
    assert fixed.schema()["args"] == scaled.schema()["args"]
    prefill, decode = fixed.schema()["deployments"]
    assert (prefill["autoscaling_config"]["min_replicas"], prefill["autoscaling_config"]["max_replicas"]) == (1, 1)
    assert (decode["autoscaling_config"]["min_replicas"], decode["autoscaling_config"]["max_replicas"]) == (2, 2)
    prefill, decode = scaled.schema()["deployments"]
    assert prefill["autoscaling_config"]["min_replicas"] == 1 and prefill["autoscaling_config"]["max_replicas"] == 4
    assert prefill["autoscaling_config"]["policy"]["policy_function"] == "kvbridge.ray.policy:PrefillPolicy"
    assert "initial_replicas" not in prefill["autoscaling_config"]  # a redeploy keeps the replicas there are
    assert decode["autoscaling_config"]["initial_replicas"] == 1  # MIN 0 still starts one when deployed
    assert "initial_replicas" not in scaled.size_override("decode", initial=False)["autoscaling_config"]
    assert decode["autoscaling_config"]["policy"]["policy_kwargs"] == {
        "target_running": policy.DEFAULT_TARGET_RUNNING, "target_kv_usage": policy.DEFAULT_TARGET_KV_USAGE}
    # What `kvbridge ray scale` reads back from a deployed config is what was deployed.
    assert app.autoscaling_of({d["name"]: d for d in scaled.schema()["deployments"]}) == scaled.autoscaling


def test_resources_parse():
    assert app.parse_resources("") == {}
    assert app.parse_resources("prefill_node=1,big=0.5") == {"prefill_node": 1.0, "big": 0.5}
    assert app.parse_resources('{"decode_node": 2}') == {"decode_node": 2.0}
