"""The deployments the application builder makes (app.build_app; Ray is imported, no cluster
starts): a TP > 1 replica keeps its engine's ranks on one node, pools land on their nodes'
resources, the router on the head node, and the pools use the router that publishes them."""

from __future__ import annotations

from kvbridge.ray import app
from kvbridge.ray.engine_replica import EngineOptions


def bound(application):
    return application._bound_deployment


def test_tp_replica_reserves_its_ranks_on_one_node():
    config = app.AppConfig(model="m", prefill_tp=2, decode_tp=1, prefill_resources={"prefill_node": 1},
                           decode_resources={"decode_node": 1}).args()
    prefill, decode = bound(app._pool_deployment(config, "prefill")), bound(app._pool_deployment(config, "decode"))
    assert prefill._replica_config.placement_group_strategy == "STRICT_PACK"
    # bundle 0 holds the replica (and its node resource), one more per further rank
    assert prefill._replica_config.placement_group_bundles == [{"CPU": 0.01, "prefill_node": 1.0}, {"CPU": 0.01}]
    assert prefill.ray_actor_options["resources"] == {"prefill_node": 1.0}
    assert decode._replica_config.placement_group_bundles is None
    assert decode.ray_actor_options == {"num_cpus": 0.0, "resources": {"decode_node": 1.0}}
    for d in (prefill, decode):
        assert d._deployment_config.request_router_config.request_router_class == \
            "kvbridge.ray.pool_router.PoolRouter"
        assert d._deployment_config.health_check_period_s == 1.0
        assert d._deployment_config.graceful_shutdown_timeout_s > app.AppConfig(model="m").drain_grace_s


def test_router_on_the_head_and_engines_get_their_options():
    config = app.AppConfig(model="m", serve_args=("--max-model-len", "512"), decode_serve_args=("--seed", "3"),
                           api_key="k").args()
    router = bound(app.build_app(config))
    assert router.name == "router"
    assert router.ray_actor_options == {"num_cpus": 0, "resources": {app.HEAD_NODE_RESOURCE: 0.001}}
    engine = EngineOptions.from_json(bound(app._pool_deployment(config, "decode")).init_args[0])
    assert (engine.role, engine.serve_args, engine.api_key) == ("decode", ("--max-model-len", "512", "--seed", "3"), "k")
