"""The `kvbridge` command: serve, proxy, up, ray, bench, trace."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvbridge.proxy.kv_cost import PD_MODES
from kvbridge.proxy.routing import POLICIES
from kvbridge.ray import cli as ray_cli
from kvbridge.tracing import trace_command

ROUTING_POLICIES = list(POLICIES)

if TYPE_CHECKING:
    from kvbridge.config import EngineConfig

# The OpenMP wait policy, set before torch is imported anywhere (its thread pool reads it once).
# `kvbridge serve` of one rank owns its cores and keeps OpenMP's default, as vLLM does: threads
# spin briefly between ops, then sleep: a decode step at batch 1 is faster so than with PASSIVE
# (threads sleep at once; benchmarks/README.md, roofline, has both). ACTIVE spins forever: as
# fast, but an idle server then burns a core. Every other command sleeps (PASSIVE): `kvbridge up`
# runs P, D and the proxy on the same cores, where spinning threads made small ops many times
# slower. A value in the environment always wins (several `serve`s on one machine:
# OMP_WAIT_POLICY=PASSIVE).
_WAIT_POLICY_GIVEN = "OMP_WAIT_POLICY" in os.environ
if sys.argv[1:2] != ["serve"]:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


DEFAULT_MODEL = "SmolLM2-135M-Instruct"
# Engine options `kvbridge up` hands to LocalCluster itself rather than as serve options:
# the model and backend are positional/fixed in its command lines, the thread count also
# sets OMP_NUM_THREADS, and the API key travels in the environment (not visible in `ps`).
_SET_BY_UP = frozenset({"model", "kv_backend", "num_threads", "api_key"})
# serve options `kvbridge up` sets differently for each instance.
_PER_INSTANCE = ("host", "port", "kv_role", "kv_engine_id", "kv_side_channel_port", "tensor_parallel_size",
                 "otlp_service_name")


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    """The options of one engine that are the same for every instance (`serve` and `up`)."""
    p.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                   help=f"a GGUF file, a Hugging Face folder, or the default model's name (default: {DEFAULT_MODEL})")
    e = p.add_argument_group("engine")
    e.add_argument("--served-model-name", default=None, help="the model name the API reports and accepts "
                   "(default: from MODEL)")
    e.add_argument("--api-key", default=os.environ.get("KVBRIDGE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 routes, and authenticate the KV side channel "
                        "(P and D need the same key) (`up`: the proxy's and every instance's; "
                        "default: $KVBRIDGE_API_KEY, or none)")
    e.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights and KV cache dtype; auto: bfloat16 on a CPU with native bf16 arithmetic "
                        "(avx512_bf16 or amx_bf16), float32 on other CPUs, on CUDA the model's own dtype as vLLM "
                        "picks it; `up` gives every instance the dtype it resolved (default: %(default)s)")
    e.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="auto: cuda if available, else cpu (default: %(default)s)")
    e.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output in tokens (default: the model's own limit)")
    e.add_argument("--num-threads", type=int, default=None,
                   help="torch threads (default: all cores; `up` splits them between its instances)")
    e.add_argument("--cpu-bind", default="auto",
                   help="the CPUs each tensor-parallel rank computes on, as vLLM's VLLM_CPU_OMP_THREADS_BIND: auto "
                        "(on CPU at TP > 1, this process's CPUs split in equal runs, one per rank), none, or one "
                        "list per rank such as 0-3|4-7 (default: %(default)s)")
    e.add_argument("--seed", type=int, default=0, help="seed of the sampler (default: %(default)s)")
    e.add_argument("--generation-config", default="auto",
                   help="sampling defaults of requests that omit them, as vLLM's option: auto (the model folder's "
                        "generation_config.json; for the default model, the sampling its authors publish), vllm "
                        "(none: OpenAI's defaults) or a folder holding a generation_config.json; a request's own "
                        "values always win (default: %(default)s)")
    e.add_argument("--block-size", type=int, default=16, help="tokens per KV block, a power of two "
                   "(default: %(default)s)")
    e.add_argument("--num-blocks", type=int, default=None, help="KV blocks (default: from --kv-cache-memory-gb)")
    e.add_argument("--kv-cache-memory-gb", type=float, default=1.0,
                   help="memory for the KV cache when --num-blocks is not given (default: %(default)s)")
    e.add_argument("--no-prefix-caching", action="store_true", help="do not reuse cached KV of shared prefixes")
    e.add_argument("--kv-offloading-size", type=_non_negative_float, default=0.0, metavar="GIB",
                   help="GiB of local disk (all tensor-parallel ranks together, as vLLM's option) for a second KV "
                        "tier below the pool: cached blocks the pool evicts are kept there and a later prompt with "
                        "their prefix loads them back (verified) instead of recomputing, when that is measured "
                        "faster; CPU engines, models with one full-attention or MLA KV group (default: 0, off; "
                        "benchmarks/README.md, kv_tier)")
    e.add_argument("--kv-tier-dir", default=None, metavar="DIR",
                   help="where the KV tier's files go; each is unlinked once open, so nothing outlives the "
                        "process (default: the system's temporary directory)")
    e.add_argument("--max-num-seqs", type=int, default=64, help="requests running at once (default: %(default)s)")
    e.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="token budget of one engine step (default: %(default)s)")
    e.add_argument("--max-waiting", type=int, default=1024,
                   help="queued requests beyond which new ones get HTTP 503 (default: %(default)s)")
    e.add_argument("--drain-timeout-s", type=_non_negative_float, default=30.0, metavar="SECONDS",
                   help="on SIGTERM or POST /kvbridge/drain the instance takes no new requests and lets admitted "
                        "ones run this long; those left then end with an error (a stream's error event with code "
                        "drain_timeout); a prefill instance also waits until every lease on its KV ended, then "
                        "the process exits 0 (default: %(default)s)")
    e.add_argument("--log-level", default="info", help="debug, info, warning or error (default: %(default)s)")
    kv = p.add_argument_group("KV transfer (prefill/decode disaggregation)")
    # The `fake` backend (kvbridge/kv_transfer/backends/fake.py) is not offered here: it needs a
    # FakeFabric shared in one process, so tests and `kvbridge chaos` configure it in code.
    kv.add_argument("--kv-backend", choices=["nixl", "tcp"], default="nixl",
                    help="nixl: one-sided READs over UCX; tcp: a plain-socket fallback (default: %(default)s)")
    kv.add_argument("--kv-side-channel-host", default=None,
                    help="address a producer's side channel and the tcp backend listen on; with the nixl "
                         "backend UCX_NET_DEVICES is set to the interface holding it (or --kv-advertise-host) "
                         "unless already set (default: --host)")
    kv.add_argument("--kv-advertise-host", default="",
                    help="address a producer names in kv_transfer_params, where decode instances reach its side "
                         "channel and KV; required when the side channel binds 0.0.0.0 or :: "
                         "(default: the side channel's address)")
    kv.add_argument("--kv-lease-seconds", type=float, default=30.0,
                    help="how long a prefill instance holds KV for a reader that never comes (default: %(default)s)")
    kv.add_argument("--kv-retention-seconds", type=float, default=0.0,
                    help="keep each finished answer's KV (its conversation's history) for the next turn this "
                         "long after its last use, so other traffic does not evict it first; held within a "
                         "quarter of the KV cache and given up whenever a request needs the blocks; instances "
                         "that serve reads (role producer or both) only; 0: off (default: %(default)s; "
                         "`kvbridge up` with --kv-reuse on: 300)")
    kv.add_argument("--kv-handshake-timeout", type=float, default=5.0,
                    help="seconds a decode instance waits for a prefill instance's handshake (default: %(default)s)")
    kv.add_argument("--kv-transfer-timeout", type=float, default=30.0,
                    help="seconds a decode instance lets one KV read run (a cut link, a hung prefill instance) "
                         "before it fails the load and follows --kv-load-failure-policy (default: %(default)s)")
    kv.add_argument("--kv-load-failure-policy", choices=["recompute", "fail", "auto"], default="recompute",
                    help="when KV does not arrive: recompute the prompt, fail the request, or recompute "
                         "up to --kv-load-failure-recompute-max-tokens (default: %(default)s)")
    kv.add_argument("--kv-verify", choices=["on", "off"], default="on",
                    help="a decode instance checks every KV read against the prefill instance's digests before "
                         "decoding from it; P and D must agree (benchmarks/README.md, kv_verify) (default: %(default)s)")
    kv.add_argument("--kv-load-failure-recompute-max-tokens", type=int, default=2048,
                    help="the longest prompt policy auto recomputes (default: %(default)s)")
    kv.add_argument("--kv-trusted-hosts", default="",
                    help="comma-separated prefill hosts a decode instance may contact: names (compared "
                         "literally, never resolved), addresses and CIDR networks such as 10.0.1.0/24; "
                         "kv_transfer_params naming any other host are refused with HTTP 400 before any "
                         "connection is opened (default: this host's own addresses only)")


def _add_tracing_args(p: argparse.ArgumentParser, *, service_name: bool = True) -> None:
    """OpenTelemetry traces: `serve`, `proxy` and `up` (which passes them on)."""
    t = p.add_argument_group("tracing (OpenTelemetry)")
    t.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help="export spans over OTLP to this URL (http/protobuf, e.g. http://127.0.0.1:4318/v1/traces; "
                        "gRPC when OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=grpc) (default: tracing off)")
    t.add_argument("--otlp-traces-sample-ratio", type=float, default=1.0, metavar="RATIO",
                   help="share of the traces this process starts that are recorded; an incoming traceparent's "
                        "sampled flag decides for the traces it continues (default: %(default)s)")
    if service_name:
        t.add_argument("--otlp-service-name", default=None, metavar="NAME",
                       help="the resource's service.name (default: kvbridge-proxy for the proxy; an "
                            "instance's role by --kv-role (prefill, decode, serve) and its port; `up` names "
                            "each of its processes)")


def tracing_config_from_args(a: argparse.Namespace, default_name: str):
    """The process's TracingConfig (None when no endpoint); TracingConfigError for bad values."""
    from kvbridge.tracing import TracingConfig
    config = TracingConfig(a.otlp_traces_endpoint, getattr(a, "otlp_service_name", None) or default_name,
                           a.otlp_traces_sample_ratio)  # validated even when off: a bad value is an error
    return config if config.endpoint is not None else None


def serve_service_name(a: argparse.Namespace) -> str:
    role = {"producer": "prefill", "consumer": "decode"}.get(a.kv_role or "", "serve")
    return f"kvbridge-{role}-{a.port}"


def _add_instance_args(p: argparse.ArgumentParser) -> None:
    """The options of `serve` that `kvbridge up` sets for each of its instances."""
    i = p.add_argument_group("this instance (`kvbridge up` sets these for each instance)")
    i.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    i.add_argument("--port", type=int, default=8000, help="HTTP port (default: %(default)s)")
    i.add_argument("--kv-role", choices=["producer", "consumer", "both"], default=None,
                   help="producer: a prefill instance; consumer: a decode instance (default: no KV transfer)")
    i.add_argument("--kv-engine-id", default="", help="this engine's id among its peers (default: random)")
    i.add_argument("--kv-side-channel-port", type=int, default=0,
                   help="port a producer's side channel listens on (default: 0, any free port)")
    i.add_argument("--kv-events-config", default=None, metavar="JSON",
                   help="publish KV cache events as vLLM does: vLLM's KVEventsConfig as JSON, e.g. "
                        "'{\"enable_kv_cache_events\": true, \"replay_endpoint\": \"tcp://127.0.0.1:*\"}'; "
                        "the default endpoint is tcp://127.0.0.1:* (loopback, a free port; GET /kvbridge/kv_events "
                        "says which) (default: no events)")
    i.add_argument("-tp", "--tensor-parallel-size", type=int, default=1,
                   help="rank processes the model is split over (KV heads split across them, replicated "
                        "when there are more ranks than KV heads); a prefill and a decode instance may differ "
                        "(`up`: --prefill-tp, --decode-tp) (default: %(default)s)")


def dtype_choice(a: argparse.Namespace):
    """The dtype the engine options ask for, `auto` resolved for this machine (a DtypeChoice)."""
    from kvbridge.engine.setup.dtype_choice import resolve_dtype
    return resolve_dtype(a.dtype, a.device, a.model)


def dtype_line(a: argparse.Namespace) -> str:
    """The start-up line saying which dtype an instance computes in and why."""
    choice = dtype_choice(a)
    if a.dtype == "auto":
        return f"dtype {choice.dtype} (--dtype auto: {choice.reason})"
    return f"dtype {choice.dtype} (--dtype {a.dtype})"


def engine_config_from_args(a: argparse.Namespace):
    from kvbridge.config import (CacheConfig, EngineConfig, KVRole, KVTransferConfig, LoadFailurePolicy,
                                 SchedulerConfig, default_num_threads)
    kv = None
    if a.kv_role:
        kv = KVTransferConfig(
            role=KVRole(a.kv_role), backend=a.kv_backend, engine_id=a.kv_engine_id,
            side_channel_host=a.kv_side_channel_host or getattr(a, "host", None) or "127.0.0.1",
            advertise_host=a.kv_advertise_host, side_channel_port=a.kv_side_channel_port,
            lease_seconds=a.kv_lease_seconds, retention_seconds=a.kv_retention_seconds,
            handshake_timeout_s=a.kv_handshake_timeout,
            transfer_timeout_s=a.kv_transfer_timeout,
            load_failure_policy=LoadFailurePolicy(a.kv_load_failure_policy),
            recompute_max_tokens=a.kv_load_failure_recompute_max_tokens, kv_verify=a.kv_verify == "on",
            trusted_hosts=tuple(h for h in a.kv_trusted_hosts.split(",") if h),
            side_channel_key=a.api_key or None)  # P and D share it: it authenticates the side channel
    return EngineConfig(
        model=a.model, served_model_name=a.served_model_name, dtype=dtype_choice(a).dtype, device=a.device,
        max_model_len=a.max_model_len, seed=a.seed, num_threads=a.num_threads or default_num_threads(),
        cache=CacheConfig(block_size=a.block_size, num_blocks=a.num_blocks,
                          kv_cache_memory_bytes=int(a.kv_cache_memory_gb * (1 << 30)),
                          enable_prefix_caching=not a.no_prefix_caching,
                          kv_offloading_bytes=int(a.kv_offloading_size * (1 << 30)), kv_tier_dir=a.kv_tier_dir),
        scheduler=SchedulerConfig(max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
                                  max_waiting=a.max_waiting),
        kv_transfer=kv, tensor_parallel_size=getattr(a, "tensor_parallel_size", 1), cpu_bind=a.cpu_bind,
        generation_config=a.generation_config, kv_events=_kv_events_config(getattr(a, "kv_events_config", None)))


def _kv_events_config(text: str | None):
    """--kv-events-config's JSON as a KVEventsConfig, None when absent; ValueError naming what is bad."""
    if text is None:
        return None
    from kvbridge.kv_events.config import parse_kv_events_config
    return parse_kv_events_config(text)


def _checked_engine_config(a: argparse.Namespace, program: str) -> EngineConfig | None:
    """engine_config_from_args, or None after printing (as argparse would, as `kvbridge program`) why
    the options are invalid (a --generation-config whose file cannot be used included)."""
    from kvbridge.engine.setup.generation_config import sampling_defaults
    try:
        config = engine_config_from_args(a)
        sampling_defaults(config.generation_config, config.model)
        return config
    except ValueError as exc:
        print(f"kvbridge {program}: error: {exc}", file=sys.stderr)
        return None


def _checked_tracing_config(a: argparse.Namespace, program: str, default_name: str):
    """tracing_config_from_args, or False after printing why the options are invalid."""
    from kvbridge.tracing import TracingConfigError
    try:
        return tracing_config_from_args(a, default_name)
    except TracingConfigError as exc:
        print(f"kvbridge {program}: error: {exc}", file=sys.stderr)
        return False


def cmd_serve(a: argparse.Namespace) -> int:
    from kvbridge.server.api_server import run_server
    config = _checked_engine_config(a, "serve")
    tracing = _checked_tracing_config(a, "serve", serve_service_name(a))
    if config is None or tracing is False:
        return 2
    if config.tensor_parallel_size > 1 and not _WAIT_POLICY_GIVEN:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"  # the rank processes (spawned later) share the cores
    import logging
    if not logging.getLogger().handlers:  # as run_server configures it
        logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("kvbridge.cli").info("%s", dtype_line(a))
    return run_server(config, a.host, a.port, a.api_key, log_level=a.log_level, tracing=tracing,
                      drain_timeout_s=a.drain_timeout_s)


def cmd_proxy(a: argparse.Namespace) -> int:
    from kvbridge.proxy.proxy import RetryPolicy
    from kvbridge.proxy.app import run_proxy
    tracing = _checked_tracing_config(a, "proxy", "kvbridge-proxy")
    if tracing is False:
        return 2
    run_proxy(tracing=tracing, prefill_urls=a.prefill, decode_urls=a.decode, host=a.host, port=a.port,
              prefill_policy=a.prefill_policy, decode_policy=a.decode_policy,
              health_interval_s=a.health_interval, api_key=a.api_key,
              retry=RetryPolicy(retries=a.retries, budget_s=a.retry_budget,
                                decode_only_fallback=not a.no_decode_only_fallback),
              breaker_failures=a.breaker_failures, breaker_cooldown_s=a.breaker_cooldown,
              first_token_from_prefill=not a.no_first_token_from_prefill, max_body_bytes=a.max_body_bytes,
              first_byte_timeout_s=a.first_byte_timeout, pd_mode=a.pd_mode, kv_reuse=a.kv_reuse == "on")
    return 0


def forwarded_serve_args(a: argparse.Namespace) -> list[str]:
    """The engine options given to `up` that differ from their defaults, as `serve` options."""
    defaults = argparse.ArgumentParser()
    _add_engine_args(defaults)
    args: list[str] = []
    for dest, default in vars(defaults.parse_args([])).items():
        value = getattr(a, dest)
        if dest in _SET_BY_UP or value == default:
            continue
        flag = "--" + dest.replace("_", "-")
        args += [flag] if value is True else [flag, str(value)]
    return args


def cmd_up(a: argparse.Namespace) -> int:
    from kvbridge.config import KVRole
    from kvbridge.launcher.cluster import InstanceSpec, run_cluster, serve_command, threads_per_engine
    if a.model_option is not None and a.model != DEFAULT_MODEL:
        print("kvbridge up: error: give the model once, as MODEL or as --model", file=sys.stderr)
        return 2
    model = a.model_option or a.model
    from kvbridge.shape.hosts import is_unspecified
    if is_unspecified(a.host):
        print(f"kvbridge up: error: --host {a.host} is no address the proxy and the instances can reach each "
              "other at: give one address of this host (see README, multi-host recipe)", file=sys.stderr)
        return 2
    num_threads = a.num_threads or threads_per_engine(a.num_prefill + a.num_decode)
    tracing = _checked_tracing_config(a, "up", "kvbridge-proxy")
    if tracing is False:
        return 2
    extra = [*forwarded_serve_args(a), *up_tracing_args(a), *a.serve_args]
    # Parse an instance's command line as its `serve` will, so that bad options fail here (argparse
    # exits 2 with serve's message) before any process starts. The key only travels in the environment.
    probe = InstanceSpec("probe", KVRole.PRODUCER, port=1, side_channel_port=1, engine_id="probe")
    key = ["--api-key", a.api_key] if a.api_key is not None else []

    def parse_instance(extra_args: list[str]) -> argparse.Namespace:
        return build_parser().parse_args(serve_command((), model, probe, host=a.host, kv_backend=a.kv_backend,
                                                       num_threads=num_threads, extra_args=[*key, *extra_args]))
    try:
        planned, child = parse_instance([]), parse_instance(extra)
    except SystemExit as exc:  # argparse has printed serve's own message
        if exc.code:
            print(f"kvbridge up: invalid options for its `kvbridge serve` instances: {shlex.join(extra)}",
                  file=sys.stderr)
        raise
    for dest in _PER_INSTANCE:
        if getattr(child, dest) != getattr(planned, dest):
            print(f"kvbridge up: error: --{dest.replace('_', '-')} is set by `up` for each instance; "
                  "it cannot be passed after --", file=sys.stderr)
            return 2
    config = _checked_engine_config(child, "up")
    if config is None:
        return 2
    if child.dtype == "auto":  # resolved once here: P and D must agree on the KV dtype
        extra = ["--dtype", config.dtype, *extra]
        print(f"kvbridge up: every instance computes in {dtype_line(child)}", file=sys.stderr, flush=True)
    if a.ray or a.ray_address:
        return ray_cli.up_on_ray(a, model, child, extra)
    if (a.prefill_replicas or a.decode_replicas or a.prefill_resources or a.decode_resources
            or a.scale_from_zero_timeout is not None):
        print("kvbridge up: error: --prefill-replicas, --decode-replicas, --*-resources and "
              "--scale-from-zero-timeout need --ray", file=sys.stderr)
        return 2
    return run_cluster(model=model, num_prefill=a.num_prefill, num_decode=a.num_decode, port=a.port, host=a.host,
                       kv_backend=child.kv_backend, extra_serve_args=extra, num_threads=child.num_threads,
                       api_key=child.api_key, prefill_tp=a.prefill_tp, decode_tp=a.decode_tp,
                       proxy_args=up_proxy_args(a), kv_reuse=a.kv_reuse == "on")


def up_tracing_args(a: argparse.Namespace) -> list[str]:
    """The tracing options `up` passes to every process (each names itself: `serve_command`)."""
    if a.otlp_traces_endpoint is None:
        return []
    return ["--otlp-traces-endpoint", a.otlp_traces_endpoint,
            "--otlp-traces-sample-ratio", str(a.otlp_traces_sample_ratio)]


def up_proxy_args(a: argparse.Namespace) -> list[str]:
    """The `kvbridge proxy` options `up` was given for its proxy (tracing: as its instances')."""
    args = ["--max-body-bytes", str(a.max_body_bytes)] if a.max_body_bytes is not None else []
    if a.routing_policy is not None:
        args += ["--prefill-policy", a.routing_policy, "--decode-policy", a.routing_policy]
    return [*args, "--pd-mode", a.pd_mode, *up_tracing_args(a)]


def cmd_bench(a: argparse.Namespace) -> int:
    import runpy
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", f"{a.name}.py")
    if not os.path.exists(script):
        print(f"no benchmark named {a.name!r} (looked for {script})", file=sys.stderr)
        return 2
    sys.argv = [script, *a.args]
    runpy.run_path(script, run_name="__main__")
    return 0


def cmd_chaos(a: argparse.Namespace) -> int:
    from kvbridge.chaos import main as chaos_main
    return chaos_main(a.args)


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:  # NaN too
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvbridge", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve one model over an OpenAI-compatible API")
    _add_engine_args(serve)
    _add_instance_args(serve)
    _add_tracing_args(serve)
    serve.set_defaults(func=cmd_serve)

    proxy = sub.add_parser("proxy", help="a P/D proxy in front of prefill and decode instances")
    proxy.add_argument("--prefill", nargs="*", default=[],
                       help="prefill instance URLs (none: colocated mode, straight to --decode instances)")
    proxy.add_argument("--decode", nargs="+", required=True, help="decode instance URLs")
    proxy.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    proxy.add_argument("--port", type=int, default=8000, help="HTTP port (default: %(default)s)")
    proxy.add_argument("--prefill-policy", choices=ROUTING_POLICIES, default="round_robin",
                       help="how a prefill instance is picked for each request; prefix: requests sharing a "
                            "prompt prefix text go to the same instance unless it is overloaded; kv_aware: the "
                            "lowest cost from the blocks each instance holds (its KV events) and its load "
                            "(README, KV-aware routing) (default: %(default)s)")
    proxy.add_argument("--decode-policy", choices=ROUTING_POLICIES, default="round_robin",
                       help="how a decode instance is picked for each request (default: %(default)s)")
    proxy.add_argument("--pd-mode", choices=PD_MODES, default="always",
                       help="per request, through P or D alone: always, never, auto (the measured costs of both), "
                            "static (Dynamo's rule), threshold (llm-d's) (default: %(default)s)")
    proxy.add_argument("--kv-reuse", choices=["on", "off"], default="off",
                       help="before a request is sent, ask the instance holding the longest cached prefix of its "
                            "prompt (by its KV events) to hold it, and send the prefix's params along: P (or D "
                            "alone) reads it instead of computing it again. Needs instances that serve reads "
                            "(--kv-role both; `kvbridge up` starts them so) (default: %(default)s)")
    proxy.add_argument("--health-interval", type=float, default=2.0,
                       help="seconds between health checks of every instance (default: %(default)s)")
    proxy.add_argument("--api-key", default=os.environ.get("KVBRIDGE_API_KEY"),
                       help="require 'Authorization: Bearer KEY' on /v1 routes; the header is passed on to "
                            "the instances (default: $KVBRIDGE_API_KEY, or none)")
    proxy.add_argument("--retries", type=int, default=3,
                       help="retries of a failed prefill or decode leg on another instance, before any byte "
                            "reached the client (never after, never for a 4xx) (default: %(default)s)")
    proxy.add_argument("--retry-budget", type=float, default=30.0,
                       help="seconds after which a leg starts no new retry (default: %(default)s)")
    proxy.add_argument("--no-decode-only-fallback", action="store_true",
                       help="when no prefill instance can prefill a request, answer the error instead of "
                            "sending the request to a decode instance to prefill itself")
    proxy.add_argument("--no-first-token-from-prefill", action="store_true",
                       help="for streamed requests, do not send the prefill instance's token to the client at "
                            "once (with the decode instance continuing from it): the decode instance "
                            "recomputes it, as vLLM's P/D path does")
    proxy.add_argument("--breaker-failures", type=int, default=5,
                       help="consecutive failed requests that open an instance's circuit (default: %(default)s)")
    proxy.add_argument("--breaker-cooldown", type=float, default=10.0,
                       help="seconds an open circuit skips its instance before one probe request "
                            "(default: %(default)s)")
    proxy.add_argument("--max-body-bytes", type=_positive_int, default=32 << 20,
                       help="longest request body read: a longer one gets HTTP 413, read no further (an "
                            "instance's own limit is 32 MiB) (default: %(default)s)")
    proxy.add_argument("--first-byte-timeout", type=float, default=30.0,
                       help="seconds a decode instance may take to start a streamed answer (it sends the status "
                            "line once it admitted the request); a silent one (stopped, hung) is a failed attempt, "
                            "retried on another. An unstreamed answer starts when it is complete: the 300 s "
                            "timeout bounds it (default: %(default)s)")
    _add_tracing_args(proxy)
    proxy.set_defaults(func=cmd_proxy)

    up = sub.add_parser(
        "up", help="start a local proxy + prefill + decode cluster",
        description="Start a proxy and prefill and decode instances on this host; Ctrl-C stops them all.",
        epilog="The engine options apply to every instance. Options after `--` are passed verbatim to each "
               "`kvbridge serve` (see `kvbridge serve --help`), e.g. "
               "`kvbridge up --num-threads 1 --max-model-len 2048 -- --max-num-seqs 8`.")
    cluster = up.add_argument_group("cluster")
    cluster.add_argument("--model", dest="model_option", default=None, metavar="MODEL", help="same as MODEL")
    cluster.add_argument("--num-prefill", type=_positive_int, default=1,
                         help="prefill instances (default: %(default)s)")
    cluster.add_argument("--num-decode", type=_positive_int, default=1, help="decode instances (default: %(default)s)")
    cluster.add_argument("--port", type=int, default=8000,
                         help="the proxy's HTTP port; instances get free ports (default: %(default)s)")
    cluster.add_argument("--host", default="127.0.0.1",
                         help="the address of this host every process binds (HTTP, side channels, KV transfer); "
                              "decode instances trust it as their prefill host, and UCX_NET_DEVICES is set to "
                              "the interface holding it (default: %(default)s)")
    cluster.add_argument("--prefill-tp", type=_positive_int, default=1,
                         help="tensor parallel size of each prefill instance (default: %(default)s)")
    cluster.add_argument("--decode-tp", type=_positive_int, default=1,
                         help="tensor parallel size of each decode instance (default: %(default)s)")
    cluster.add_argument("--max-body-bytes", type=_positive_int, default=None,
                         help="the proxy's --max-body-bytes (default: the proxy's, 32 MiB)")
    cluster.add_argument("--routing-policy", choices=ROUTING_POLICIES, default=None,
                         help="the proxy's --prefill-policy and --decode-policy (default: the proxy's)")
    cluster.add_argument("--pd-mode", choices=PD_MODES, default="always", help="the proxy's --pd-mode (default: %(default)s)")
    cluster.add_argument("--kv-reuse", choices=["on", "off"], default="on",
                         help="KV reuse across turns and instances: every instance of role both, the proxy's "
                              "--kv-reuse on (a conversation's next turn reads its history from the instance that "
                              "answered the last; with --ray too: every replica of role both) "
                              "(default: %(default)s)")
    ray_cli.add_up_ray_args(up)
    _add_engine_args(up)
    _add_tracing_args(up, service_name=False)
    up.set_defaults(func=cmd_up, serve_args=[])

    ray_cli.add_ray_command(sub)

    bench = sub.add_parser("bench", help="run a benchmark from benchmarks/")
    bench.add_argument("name", help="e.g. engine_vs_transformers")
    bench.add_argument("args", nargs=argparse.REMAINDER)
    bench.set_defaults(func=cmd_bench)
    chaos = sub.add_parser("chaos", help="requests through a proxy with random injected transfer faults",
                           add_help=False)
    chaos.add_argument("args", nargs=argparse.REMAINDER)
    chaos.set_defaults(func=cmd_chaos)

    trace_command.add_trace_command(sub, _positive_int)
    return parser


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """Parse a command line; for `up`, what follows the first `--` goes verbatim to `serve_args`."""
    argv, serve_args = list(argv), []
    if argv[:1] == ["up"] and "--" in argv:
        cut = argv.index("--")
        argv, serve_args = argv[:cut], argv[cut + 1:]
    args = build_parser().parse_args(argv)
    if args.command == "up":
        args.serve_args = serve_args
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["chaos"]:  # its own options, parsed by kvbridge.chaos
        from kvbridge.chaos import main as chaos_main
        return chaos_main(argv[1:])
    args = parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
