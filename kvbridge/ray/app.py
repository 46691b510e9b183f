"""The Ray Serve application (router ingress + prefill pool + decode pool), how it is deployed,
rescaled and removed, and `kvbridge up --ray`.

The application is deployed declaratively (Serve's application config: an import path, its
args and per-deployment overrides), the way `serve deploy` does it: Serve derives the code
version from the import path and args, so a later deploy that only changes the pools' sizes
(`autoscaling_config`: the `deployments` overrides) is a lightweight update, and no replica
restarts (`kvbridge ray scale`, or `kvbridge up --ray` again with new bounds). Serve's code version
also hashes the overrides' autoscaling policies: every pool, a fixed one too, is deployed with
its policy (AppConfig.size_override), so only a change of the targets restarts the replicas.

Where Ray ends and kvbridge begins: Ray places the replicas (custom resources, a STRICT_PACK
placement group per TP > 1 replica), starts, health-checks, replaces and scales them, and tells
the router who is there (discovery.py); kvbridge runs the engines (engine_replica.py), the
router with its health checks, breakers and routing (ingress.py) and the scaling policy
(policy.py).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from kvbridge.launcher.stop_signals import (handle_stop_signals, ignore_stop_signals, restore_stop_signals,
                                            wait_for_interrupt)
from kvbridge.ray import policy
from kvbridge.ray.engine_replica import EngineOptions

logger = logging.getLogger(__name__)

DEFAULT_APP_NAME = "kvbridge"
IMPORT_PATH = "kvbridge.ray.app:build_app"
HEAD_NODE_RESOURCE = "node:__internal_head__"  # Ray's resource of the head node
STATUS_POLL_S = 0.5
RAY_LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": Ray keeps every node on loopback
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost"})
OBJECT_STORE_BYTES = 256 << 20


class DeployError(RuntimeError):
    """The application did not reach RUNNING (its status message says why)."""


@dataclass(frozen=True)
class PoolSize:
    """A pool's size: fixed (min == max, no autoscaling) or bounds for the autoscaler."""

    min: int
    max: int
    autoscale: bool = False

    @classmethod
    def parse(cls, text: str) -> PoolSize:
        """'N' (fixed) or 'MIN:MAX' (autoscaled; MIN may be 0)."""
        try:
            if ":" in text:
                low, high = (int(x) for x in text.split(":", 1))
                size = cls(low, high, autoscale=True)
            else:
                size = cls(int(text), int(text))
        except ValueError:
            raise ValueError(f"a pool size is N or MIN:MAX, not {text!r}") from None
        if size.min < 0 or size.max < 1 or size.min > size.max or (not size.autoscale and size.min < 1):
            raise ValueError(f"bad pool size {text!r}: 0 <= MIN <= MAX, MAX >= 1 (a fixed size >= 1)")
        return size


@dataclass(frozen=True)
class Autoscaling:
    """The policy's targets (policy.py) and Serve's autoscaler timing."""

    prefill_target_queued_tokens: float = policy.DEFAULT_TARGET_QUEUED_TOKENS
    prefill_target_wait_s: float = policy.DEFAULT_TARGET_WAIT_S
    decode_target_running: float = policy.DEFAULT_TARGET_RUNNING
    decode_target_kv_usage: float = policy.DEFAULT_TARGET_KV_USAGE
    metrics_interval_s: float = 1.0
    look_back_period_s: float = 5.0
    upscale_delay_s: float = 2.0
    downscale_delay_s: float = 30.0


@dataclass(frozen=True)
class AppConfig:
    """Everything the application is built from. `args()` is what the replicas are built from
    (a change restarts them); `prefill`/`decode` sizes and `autoscaling` are the lightweight part."""

    model: str
    prefill: PoolSize = PoolSize(1, 1)
    decode: PoolSize = PoolSize(1, 1)
    name: str = DEFAULT_APP_NAME
    kv_backend: str = "nixl"
    num_threads: int = 1
    prefill_tp: int = 1
    decode_tp: int = 1
    serve_args: tuple[str, ...] = ()
    prefill_serve_args: tuple[str, ...] = ()
    decode_serve_args: tuple[str, ...] = ()
    api_key: str | None = None
    # KV reuse across turns (proxy/kv_reuse.py): every engine of role both (it serves the history it
    # holds and reads a held one) and the router's kv_reuse on
    kv_reuse: bool = False
    prefill_resources: dict[str, float] = field(default_factory=dict)
    decode_resources: dict[str, float] = field(default_factory=dict)
    replica_cpus: float = 0.0  # logical CPUs Ray reserves per rank (0: engines share the node's cores)
    router: dict[str, Any] = field(default_factory=dict)  # ingress.RouterOptions fields
    router_on_head: bool = True  # the router's replica runs on the head node (where --host is)
    autoscaling: Autoscaling = Autoscaling()
    health_check_period_s: float = 1.0
    health_check_timeout_s: float = 10.0
    ready_timeout_s: float = 300.0
    drain_grace_s: float = 60.0  # a leaving replica's engine drains this long at most

    def args(self) -> dict:
        """The builder's arguments (build_app): all but the sizes and the autoscaling."""
        out = asdict(self)
        for key in ("prefill", "decode", "autoscaling", "name"):
            out.pop(key)
        out["serve_args"], out["prefill_serve_args"], out["decode_serve_args"] = (
            list(self.serve_args), list(self.prefill_serve_args), list(self.decode_serve_args))
        return out

    def size_override(self, role: str, initial: bool = True) -> dict:
        """The `deployments` override that sizes one pool. Every size is an autoscaling_config
        carrying the pool's policy, a fixed N as MIN = MAX = N: Serve's code version hashes the
        overrides' autoscaling policies, so a pool deployed once with `num_replicas` and once
        with a policy would change it, and Serve would restart every replica of the application.
        `initial`: a first deploy (a pool with MIN 0 then starts one replica);
        without it, Serve keeps the replicas there are, within the new bounds."""
        size = self.prefill if role == "prefill" else self.decode
        a = self.autoscaling
        if role == "prefill":
            policy_config = {"policy_function": "kvbridge.ray.policy:PrefillPolicy",
                             "policy_kwargs": {"target_queued_tokens": a.prefill_target_queued_tokens,
                                               "target_wait_s": a.prefill_target_wait_s}}
        else:
            policy_config = {"policy_function": "kvbridge.ray.policy:DecodePolicy",
                             "policy_kwargs": {"target_running": a.decode_target_running,
                                               "target_kv_usage": a.decode_target_kv_usage}}
        config: dict[str, Any] = {
            "min_replicas": size.min, "max_replicas": size.max,
            "metrics_interval_s": a.metrics_interval_s, "look_back_period_s": a.look_back_period_s,
            "upscale_delay_s": a.upscale_delay_s, "downscale_delay_s": a.downscale_delay_s,
            "downscale_to_zero_delay_s": a.downscale_delay_s, "policy": policy_config}
        if initial and size.min == 0:
            config["initial_replicas"] = 1
        return {"name": role, "autoscaling_config": config}

    def schema(self) -> dict:
        """Serve's application config (ServeApplicationSchema) for this application."""
        return {"name": self.name, "import_path": IMPORT_PATH, "route_prefix": None, "args": self.args(),
                "deployments": [self.size_override("prefill"), self.size_override("decode")]}


def _pool_deployment(config: dict, role: str):
    """One pool's deployment (sizes come from the config's overrides; 1 until then)."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from kvbridge.ray.pool_router import PoolRouter
    from kvbridge.ray.engine_replica import EngineReplica
    tp = config[f"{role}_tp"]
    cpus = float(config["replica_cpus"])
    resources = {k: float(v) for k, v in config[f"{role}_resources"].items()}
    options: dict[str, Any] = dict(
        name=role, num_replicas=1,
        health_check_period_s=config["health_check_period_s"],
        health_check_timeout_s=config["health_check_timeout_s"],
        # __del__ waits for the drained engine (drain_grace_s), then Serve kills the replica.
        graceful_shutdown_timeout_s=config["drain_grace_s"] + 10.0,
        graceful_shutdown_wait_loop_s=0.5,
        request_router_config=RequestRouterConfig(request_router_class=PoolRouter),
        ray_actor_options={"num_cpus": cpus, "resources": resources},
    )
    if tp > 1:
        # The replica (and so its engine and rank processes) on one node: bundle 0 holds the
        # replica actor (its resources), one more per further rank, packed onto one node.
        unit = max(cpus, 0.01)
        options["placement_group_bundles"] = [{"CPU": unit, **resources}] + [{"CPU": unit}] * (tp - 1)
        options["placement_group_strategy"] = "STRICT_PACK"
        options["ray_actor_options"] = {"num_cpus": unit, "resources": resources}
    engine = EngineOptions(**{**config_engine_fields(config, role)})
    return serve.deployment(EngineReplica).options(**options).bind(engine.to_json())


def config_engine_fields(config: dict, role: str) -> dict:
    extra = config["prefill_serve_args"] if role == "prefill" else config["decode_serve_args"]
    return dict(role=role, model=config["model"], kv_backend=config["kv_backend"], num_threads=config["num_threads"],
                tensor_parallel_size=config[f"{role}_tp"], serve_args=(*config["serve_args"], *extra),
                api_key=config["api_key"], ready_timeout_s=config["ready_timeout_s"],
                drain_grace_s=config["drain_grace_s"], kv_reuse=bool(config.get("kv_reuse", False)))


def build_app(args: dict):
    """Serve's application builder (IMPORT_PATH): router ingress bound to the two pools."""
    from ray import serve

    from kvbridge.ray.ingress import RouterIngress, RouterOptions
    router = RouterOptions(**{**args.get("router", {}), "api_key": args.get("api_key"),
                              "kv_reuse": bool(args.get("kv_reuse", False))})
    actor: dict[str, Any] = {"num_cpus": 0}
    if args.get("router_on_head", True):
        actor["resources"] = {HEAD_NODE_RESOURCE: 0.001}
    ingress = serve.deployment(RouterIngress).options(
        name="router", num_replicas=1, ray_actor_options=actor,
        health_check_period_s=args["health_check_period_s"], graceful_shutdown_timeout_s=20.0)
    return ingress.bind(_pool_deployment(args, "prefill"), _pool_deployment(args, "decode"), router.to_json())


# ---- deploy, scale, remove (the driver's side) ------------------------------------------------
def _client():
    from ray.serve._private.api import serve_start
    # No Serve HTTP proxy: the router serves HTTP itself (ingress.py). On a cluster where Serve
    # already runs, its settings stay as they are.
    return serve_start(proxy_location="Disabled")


def deploy(config: AppConfig, timeout_s: float = 600.0) -> str:
    """Deploy (or update in place) the application on the connected Ray cluster; wait until it
    runs; return the router's URL."""
    _apply(config.schema())
    wait_running(config.name, timeout_s)
    return router_url(config.name)


def _apply(schema: dict) -> None:
    """Deploy one application's config. A declarative deploy replaces the whole set of
    declaratively deployed applications, so the cluster's others are passed on unchanged."""
    from ray.serve.schema import ServeDeploySchema
    client = _client()
    others = [app["deployed_app_config"] for name, app in client.get_serve_details().get("applications", {}).items()
              if name != schema["name"] and app.get("source") == "declarative" and app.get("deployed_app_config")]
    client.deploy_apps(ServeDeploySchema(applications=[*others, schema]))


def wait_running(name: str, timeout_s: float) -> None:
    """Until the application is RUNNING; DeployError if it failed or the time ran out."""
    from ray import serve
    deadline = time.monotonic() + timeout_s
    while True:
        app = serve.status().applications.get(name)
        status = str(app.status) if app is not None else "NOT_STARTED"
        if status.endswith("RUNNING") and _sizes_reached(app):
            return
        if status.endswith("DEPLOY_FAILED"):
            raise DeployError(f"application {name} failed to deploy: {app.message}")
        if time.monotonic() >= deadline:
            raise DeployError(f"application {name} not running after {timeout_s:.0f} s (status {status}: "
                              f"{getattr(app, 'message', '')})")
        time.sleep(STATUS_POLL_S)


def _sizes_reached(app) -> bool:
    return all(str(d.status).endswith("HEALTHY") for d in app.deployments.values())


def router_url(name: str = DEFAULT_APP_NAME) -> str:
    from ray import serve
    return serve.get_deployment_handle("router", name).url.remote().result(timeout_s=60)


def deployed_schema(name: str = DEFAULT_APP_NAME) -> dict:
    """The application config last deployed (KeyError: no such application)."""
    details = _client().get_serve_details()
    return details["applications"][name]["deployed_app_config"]


def scale(name: str, prefill: PoolSize | None = None, decode: PoolSize | None = None,
          timeout_s: float = 600.0) -> dict:
    """Change a running application's pool sizes in place (no replica restarts): redeploy its
    config with new size overrides. Returns the overrides now deployed."""
    schema = deployed_schema(name)
    current = {d["name"]: d for d in schema.get("deployments", [])}
    base = AppConfig(model=schema["args"]["model"], name=name,
                     autoscaling=autoscaling_of(current))
    for role, size in (("prefill", prefill), ("decode", decode)):
        if size is not None:
            current[role] = replace(base, **{role: size}).size_override(role, initial=False)
    schema["deployments"] = [current["prefill"], current["decode"]]
    _apply(schema)
    wait_running(name, timeout_s)
    return {"prefill": current["prefill"], "decode": current["decode"]}


def autoscaling_of(overrides: dict[str, dict]) -> Autoscaling:
    """The Autoscaling a deployed config's overrides carry (defaults where they carry none)."""
    found: dict[str, Any] = {}
    for role in ("prefill", "decode"):
        a = overrides.get(role, {}).get("autoscaling_config")
        if not a:
            continue
        for key in ("metrics_interval_s", "look_back_period_s", "upscale_delay_s", "downscale_delay_s"):
            found[key] = a[key]
        for key, value in a.get("policy", {}).get("policy_kwargs", {}).items():
            found[f"{role}_{key}"] = value
    return Autoscaling(**found)


def connect(address: str | None) -> None:
    """Join the Ray cluster at `address` ("auto": the one this host belongs to) as a driver. A
    loopback address means a loopback-bound Ray: this process must see it as one too."""
    if address and address.split(":")[0] in LOOPBACK_HOSTS:
        loopback_ray_env(os.environ)
    if "RAY_AUTH_MODE" not in os.environ and (
            {"RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"} & os.environ.keys() or Path("~/.ray/auth_token").expanduser().exists()):
        # A cluster `ray.init()` or `ray start` made holds Ray's token (token auth is Ray's default
        # there); a driver that joins it only sends the token in token mode.
        os.environ["RAY_AUTH_MODE"] = "token"
    import ray
    ray.init(address=address, configure_logging=False, log_to_driver=False)


def status_report(name: str = DEFAULT_APP_NAME) -> dict:
    """Each pool's deployment status and replica counts (Serve's) and members (the router's)."""
    from ray import serve
    app = serve.status().applications[name]
    members = serve.get_deployment_handle("router", name).members.remote().result(timeout_s=60)
    return {"status": str(app.status), "pools": {
        role: {"status": str(app.deployments[role].status),
               "replicas": {str(k): v for k, v in app.deployments[role].replica_states.items()},
               "router": members.get(role, [])} for role in ("prefill", "decode")}}


def remove(name: str = DEFAULT_APP_NAME) -> None:
    """Delete the application and wait until every replica left (drained engines exited)."""
    from ray import serve
    serve.delete(name, _blocking=True)


# ---- kvbridge up --ray ---------------------------------------------------------------------
def start_local_ray(host: str = "127.0.0.1", num_cpus: int | None = None,
                    resources: dict[str, float] | None = None) -> None:
    """An embedded Ray instance bound to `host`, a child of this process. Ray turns a loopback
    `_node_ip_address` into this host's routable address unless its single-machine mode is on
    (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, read when ray is imported, here and in every process
    Ray starts): for a loopback `host`, it is."""
    if host in LOOPBACK_HOSTS:
        loopback_ray_env(os.environ)
    import ray
    # kvbridge passes little through Ray's object store: a small one, not 30% of the memory.
    ray.init(address="local", _node_ip_address=host, include_dashboard=False, num_cpus=num_cpus,
             resources=resources, object_store_memory=OBJECT_STORE_BYTES, configure_logging=False,
             log_to_driver=False)


def loopback_ray_env(env: dict[str, str] | os._Environ) -> None:
    """Make a Ray started from this environment bind loopback only (start_local_ray). It must be
    set before ray is first imported in this process; RuntimeError when that is too late."""
    env[RAY_LOOPBACK_ENV] = "0"
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None and constants.ENABLE_RAY_CLUSTER:
        raise RuntimeError(f"ray was imported before {RAY_LOOPBACK_ENV}=0 was set: it would not bind loopback")


def run_up(config: AppConfig, ray_address: str | None = None, host: str = "127.0.0.1",
           ready_timeout_s: float = 600.0) -> int:
    """`kvbridge up --ray`: deploy the application on an embedded Ray instance bound to `host`
    (or onto the cluster at `ray_address`), serve until Ctrl-C or SIGTERM, then remove the
    application and stop the Ray instance this process started (a cluster it joined keeps running)."""
    started = ray_address is None
    if started and host in LOOPBACK_HOSTS:
        loopback_ray_env(os.environ)  # before ray is imported
    import ray
    from ray import serve
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    previous = handle_stop_signals()
    try:
        if started:
            # Logical CPUs: as `kvbridge up`, the engines share this host's cores.
            start_local_ray(host, num_cpus=max(os.cpu_count() or 1, 16))
        else:
            connect(ray_address)
        url = deploy(config, ready_timeout_s)
        address = ray.get_runtime_context().gcs_address
        print(f"kvbridge on Ray ready: router {url} (application {config.name!r}; prefill "
              f"{_size_text(config.prefill)}, decode {_size_text(config.decode)}; Ray at {address})\n"
              f"  scale: kvbridge ray scale --ray-address {address} --prefill-replicas MIN:MAX "
              "--decode-replicas MIN:MAX\n"
              "Ctrl-C removes the application" + (" and stops Ray." if started else " (the cluster keeps running)."),
              flush=True)
        wait_for_interrupt()
        return 0
    except DeployError as exc:
        print(f"kvbridge up --ray: {exc}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print("kvbridge up --ray: removing the application", flush=True)
        return 0
    finally:
        ignore_stop_signals(previous)  # a second Ctrl-C must not cut the cleanup
        try:
            if ray.is_initialized():
                try:
                    remove(config.name)
                finally:
                    if started:
                        serve.shutdown()
        finally:
            if ray.is_initialized():
                ray.shutdown()
            restore_stop_signals(previous)


def _size_text(size: PoolSize) -> str:
    return f"{size.min}:{size.max} autoscaled" if size.autoscale else str(size.min)


def parse_resources(text: str) -> dict[str, float]:
    """'{"name": 1}' (JSON) or 'name=1,other=2' as Ray custom resources."""
    text = text.strip()
    if not text:
        return {}
    if text.startswith("{"):
        data = json.loads(text)
    else:
        data = dict(part.split("=", 1) for part in text.split(","))
    return {str(k): float(v) for k, v in data.items()}
