"""The `kvbridge` command: serve, proxy, up, bench."""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch is imported anywhere


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default="SmolLM2-135M-Instruct",
                   help="a GGUF file, a Hugging Face folder, or the default model's name")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--api-key", default=os.environ.get("KVBRIDGE_API_KEY"))
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--num-threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=None, help="KV blocks (default: from --kv-cache-memory-gb)")
    p.add_argument("--kv-cache-memory-gb", type=float, default=1.0)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-waiting", type=int, default=1024)
    p.add_argument("--log-level", default="info")
    kv = p.add_argument_group("KV transfer (prefill/decode disaggregation)")
    kv.add_argument("--kv-role", choices=["producer", "consumer", "both"], default=None,
                    help="producer: a prefill instance; consumer: a decode instance")
    kv.add_argument("--kv-backend", choices=["nixl", "tcp", "fake"], default="nixl")
    kv.add_argument("--kv-engine-id", default="")
    kv.add_argument("--kv-side-channel-host", default="127.0.0.1")
    kv.add_argument("--kv-side-channel-port", type=int, default=0)
    kv.add_argument("--kv-lease-seconds", type=float, default=30.0)
    kv.add_argument("--kv-handshake-timeout", type=float, default=5.0)
    kv.add_argument("--kv-load-failure-policy", choices=["recompute", "fail", "auto"], default="recompute")
    kv.add_argument("--kv-load-failure-recompute-max-tokens", type=int, default=2048)
    kv.add_argument("--kv-trusted-hosts", default="",
                    help="comma-separated prefill hosts a decode instance may read from (default: this host)")


def engine_config_from_args(a: argparse.Namespace):
    from kvbridge.config import (CacheConfig, EngineConfig, KVRole, KVTransferConfig, LoadFailurePolicy,
                                 SchedulerConfig, default_num_threads)
    kv = None
    if a.kv_role:
        kv = KVTransferConfig(
            role=KVRole(a.kv_role), backend=a.kv_backend, engine_id=a.kv_engine_id,
            side_channel_host=a.kv_side_channel_host, side_channel_port=a.kv_side_channel_port,
            lease_seconds=a.kv_lease_seconds, handshake_timeout_s=a.kv_handshake_timeout,
            load_failure_policy=LoadFailurePolicy(a.kv_load_failure_policy),
            recompute_max_tokens=a.kv_load_failure_recompute_max_tokens,
            trusted_hosts=tuple(h for h in a.kv_trusted_hosts.split(",") if h))
    return EngineConfig(
        model=a.model, served_model_name=a.served_model_name, dtype=a.dtype, device=a.device,
        max_model_len=a.max_model_len, seed=a.seed, num_threads=a.num_threads or default_num_threads(),
        cache=CacheConfig(block_size=a.block_size, num_blocks=a.num_blocks,
                          kv_cache_memory_bytes=int(a.kv_cache_memory_gb * (1 << 30)),
                          enable_prefix_caching=not a.no_prefix_caching),
        scheduler=SchedulerConfig(max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
                                  max_waiting=a.max_waiting),
        kv_transfer=kv)


def cmd_serve(a: argparse.Namespace) -> int:
    from kvbridge.serving.api_server import run_server
    run_server(engine_config_from_args(a), a.host, a.port, a.api_key, log_level=a.log_level)
    return 0


def cmd_proxy(a: argparse.Namespace) -> int:
    from kvbridge.serving.proxy_app import run_proxy
    run_proxy(prefill_urls=a.prefill, decode_urls=a.decode, host=a.host, port=a.port,
              prefill_policy=a.prefill_policy, decode_policy=a.decode_policy,
              health_interval_s=a.health_interval, api_key=a.api_key)
    return 0


def cmd_up(a: argparse.Namespace) -> int:
    from kvbridge.serving.cluster import run_cluster
    return run_cluster(model=a.model, num_prefill=a.num_prefill, num_decode=a.num_decode, port=a.port,
                       kv_backend=a.kv_backend, extra_serve_args=a.serve_args)


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvbridge", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve one model over an OpenAI-compatible API")
    _add_engine_args(serve)
    serve.set_defaults(func=cmd_serve)

    proxy = sub.add_parser("proxy", help="a P/D proxy in front of prefill and decode instances")
    proxy.add_argument("--prefill", nargs="*", default=[],
                       help="prefill instance URLs (none: colocated mode, straight to --decode instances)")
    proxy.add_argument("--decode", nargs="+", required=True, help="decode instance URLs")
    proxy.add_argument("--host", default="127.0.0.1")
    proxy.add_argument("--port", type=int, default=8000)
    proxy.add_argument("--prefill-policy", choices=["round_robin", "least_outstanding"], default="round_robin")
    proxy.add_argument("--decode-policy", choices=["round_robin", "least_outstanding"], default="round_robin")
    proxy.add_argument("--health-interval", type=float, default=2.0)
    proxy.add_argument("--api-key", default=os.environ.get("KVBRIDGE_API_KEY"))
    proxy.set_defaults(func=cmd_proxy)

    up = sub.add_parser("up", help="start a local proxy + prefill + decode cluster")
    up.add_argument("--model", default="SmolLM2-135M-Instruct")
    up.add_argument("--num-prefill", type=int, default=1)
    up.add_argument("--num-decode", type=int, default=1)
    up.add_argument("--port", type=int, default=8000)
    up.add_argument("--kv-backend", choices=["nixl", "tcp"], default="nixl")
    up.add_argument("serve_args", nargs=argparse.REMAINDER, help="extra options for every `kvbridge serve`")
    up.set_defaults(func=cmd_up)

    bench = sub.add_parser("bench", help="run a benchmark from benchmarks/")
    bench.add_argument("name", help="e.g. engine_vs_transformers")
    bench.add_argument("args", nargs=argparse.REMAINDER)
    bench.set_defaults(func=cmd_bench)
    chaos = sub.add_parser("chaos", help="requests through a proxy with random injected transfer faults",
                           add_help=False)
    chaos.add_argument("args", nargs=argparse.REMAINDER)
    chaos.set_defaults(func=cmd_chaos)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["chaos"]:  # its own options, parsed by kvbridge.chaos
        from kvbridge.chaos import main as chaos_main
        return chaos_main(argv[1:])
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
