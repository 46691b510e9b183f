"""The command-line side of kvbridge on Ray: `kvbridge up --ray`'s options and launch, and
`kvbridge ray scale|status`. Imported by kvbridge/cli.py; Ray itself is imported only when one of
these commands runs (app.py), so the default install parses every command line without it."""

from __future__ import annotations

import argparse
import sys


SCALE_FROM_ZERO_TIMEOUT_S = 120.0  # kvbridge up --ray --scale-from-zero-timeout


def add_up_ray_args(up: argparse.ArgumentParser) -> None:
    """`kvbridge up`'s options for a deployment on Ray."""
    on_ray = up.add_argument_group("on Ray (the `kvbridge[ray]` extra; README, \"kvbridge on Ray\")")
    on_ray.add_argument("--ray", action="store_true",
                        help="deploy the router, a prefill pool and a decode pool as a Ray Serve application on an "
                             "embedded Ray instance bound to --host (Ctrl-C removes the application and stops Ray)")
    on_ray.add_argument("--ray-address", default=None, metavar="ADDR",
                        help="deploy onto the running Ray cluster at ADDR instead (implies --ray; Ctrl-C removes "
                             "the application, the cluster keeps running)")
    on_ray.add_argument("--prefill-replicas", default=None, metavar="N|MIN:MAX",
                        help="prefill pool size: N fixed, or MIN:MAX autoscaled on queued prompt tokens and queue "
                             "wait (default: --num-prefill)")
    on_ray.add_argument("--decode-replicas", default=None, metavar="N|MIN:MAX",
                        help="decode pool size: N fixed, or MIN:MAX autoscaled on running sequences against KV "
                             "capacity (default: --num-decode)")
    on_ray.add_argument("--prefill-resources", default="", metavar="RES",
                        help="Ray custom resources each prefill replica needs, as name=amount,... or JSON, e.g. "
                             "prefill_node=1 (nodes started with --resources '{\"prefill_node\": 4}')")
    on_ray.add_argument("--decode-resources", default="", metavar="RES",
                        help="Ray custom resources each decode replica needs (as --prefill-resources)")
    on_ray.add_argument("--replica-cpus", type=float, default=0.0,
                        help="logical CPUs Ray reserves for each engine rank (default: 0, engines share the node's "
                             "cores as `kvbridge up`'s do)")
    on_ray.add_argument("--scale-from-zero-timeout", type=float, default=None, metavar="SECONDS",
                        help="how long a request that finds a pool at zero (MIN 0) waits for a replica to start "
                             f"before its 503 (default: {SCALE_FROM_ZERO_TIMEOUT_S})")
    on_ray.add_argument("--app-name", default="kvbridge", help="the Serve application's name (default: %(default)s)")


def add_ray_command(sub) -> None:
    """`kvbridge ray scale|status`."""
    ray_cmd = sub.add_parser("ray", help="a kvbridge application running on Ray: scale, status")
    ray_sub = ray_cmd.add_subparsers(dest="ray_command", required=True)
    for name, text in (("scale", "change a pool's size or autoscaling bounds in place (no replica restarts)"),
                       ("status", "the router's URL and each pool's replicas, as the router sees them")):
        r = ray_sub.add_parser(name, help=text, description=text)
        r.add_argument("--ray-address", default="auto", metavar="ADDR",
                       help="the Ray cluster (default: %(default)s, the cluster this host belongs to)")
        r.add_argument("--app-name", default="kvbridge", help="the Serve application's name (default: %(default)s)")
        r.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the new sizes "
                       "(default: %(default)s)")
        if name == "scale":
            r.add_argument("--prefill-replicas", default=None, metavar="N|MIN:MAX", help="the prefill pool's size")
            r.add_argument("--decode-replicas", default=None, metavar="N|MIN:MAX", help="the decode pool's size")
        r.set_defaults(func=cmd_ray)


def up_on_ray(a: argparse.Namespace, model: str, child: argparse.Namespace, extra: list[str]) -> int:
    """`kvbridge up --ray`: the application on Ray (kvbridge/ray/app.py)."""
    from kvbridge.ray.app import AppConfig, PoolSize, parse_resources, run_up
    try:
        prefill = PoolSize.parse(a.prefill_replicas) if a.prefill_replicas else PoolSize(a.num_prefill, a.num_prefill)
        decode = PoolSize.parse(a.decode_replicas) if a.decode_replicas else PoolSize(a.num_decode, a.num_decode)
        prefill_resources, decode_resources = parse_resources(a.prefill_resources), parse_resources(a.decode_resources)
        wait_s = SCALE_FROM_ZERO_TIMEOUT_S if a.scale_from_zero_timeout is None else a.scale_from_zero_timeout
        if not wait_s > 0:
            raise ValueError(f"--scale-from-zero-timeout must be positive, not {wait_s}")
    except ValueError as exc:
        print(f"kvbridge up --ray: error: {exc}", file=sys.stderr)
        return 2
    router = {"host": a.host, "port": a.port, "scale_from_zero_timeout_s": wait_s}
    if a.max_body_bytes is not None:
        router["max_body_bytes"] = a.max_body_bytes
    if a.routing_policy is not None:
        router["prefill_policy"] = router["decode_policy"] = a.routing_policy
    router["pd_mode"] = a.pd_mode
    config = AppConfig(model=model, prefill=prefill, decode=decode, name=a.app_name, kv_backend=child.kv_backend,
                       num_threads=child.num_threads, prefill_tp=a.prefill_tp, decode_tp=a.decode_tp,
                       serve_args=tuple(extra), api_key=child.api_key, prefill_resources=prefill_resources,
                       decode_resources=decode_resources, replica_cpus=a.replica_cpus, router=router,
                       kv_reuse=a.kv_reuse == "on")
    return run_up(config, ray_address=a.ray_address, host=a.host)


def cmd_ray(a: argparse.Namespace) -> int:
    """`kvbridge ray scale|status`: a running application on a Ray cluster."""
    import json

    from kvbridge.ray.app import DeployError, PoolSize, connect, router_url, scale, status_report
    try:
        prefill = PoolSize.parse(a.prefill_replicas) if getattr(a, "prefill_replicas", None) else None
        decode = PoolSize.parse(a.decode_replicas) if getattr(a, "decode_replicas", None) else None
    except ValueError as exc:
        print(f"kvbridge ray: error: {exc}", file=sys.stderr)
        return 2
    connect(a.ray_address)
    try:
        if a.ray_command == "scale":
            if prefill is None and decode is None:
                print("kvbridge ray scale: error: give --prefill-replicas and/or --decode-replicas", file=sys.stderr)
                return 2
            print(json.dumps(scale(a.app_name, prefill, decode, timeout_s=a.timeout), indent=2))
        else:
            print(json.dumps({"router": router_url(a.app_name), **status_report(a.app_name)}, indent=2))
    except KeyError:
        print(f"kvbridge ray: no application {a.app_name!r} on this cluster", file=sys.stderr)
        return 1
    except DeployError as exc:
        print(f"kvbridge ray: {exc}", file=sys.stderr)
        return 1
    return 0
