"""Local cluster launcher: prefill and decode instances plus the P/D proxy, as child
processes of this one on one host (`kvbridge up`, and tests through LocalCluster).

It starts each child with the kvbridge CLI, keeps each child's stdout and stderr in a
log file of its own, waits (bounded) until every child's /health answers 200, and
stops exactly the pids it started: SIGINT (stop now: an instance's SIGTERM is a drain that
may take up to its --drain-timeout-s), a grace period, then SIGKILL.

Contract with kvbridge/cli.py (the launcher builds these command lines):
  serve MODEL --host H --port P --kv-role producer|consumer --kv-backend B
        --kv-engine-id ID --kv-side-channel-port S --num-threads N [extra args]
  proxy --prefill URL... --decode URL... --host H --port P
Every instance publishes KV events (--kv-events-config) on OS-picked ports of the cluster's
address. With --host other than loopback, each decode instance also gets --kv-trusted-hosts HOST
(unless the extra args name trusted hosts) and UCX_NET_DEVICES names HOST's interface.
Both must answer GET /health with 200 once ready, and exit on SIGINT. An API key reaches
both in KVBRIDGE_API_KEY.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import httpx

from kvbridge.config import KVRole
from kvbridge.kv_transfer.net import apply_ucx_net_devices
from kvbridge.launcher.stop_signals import handle_stop_signals, ignore_stop_signals, restore_stop_signals

logger = logging.getLogger(__name__)

DEFAULT_CLI: tuple[str, ...] = (sys.executable, "-m", "kvbridge.cli")
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})
_PR_SET_PDEATHSIG = 1  # from <sys/prctl.h>
# Looked up now: between fork and exec the child should only call, never load.
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


class ClusterStartError(RuntimeError):
    """A child died or stayed unhealthy during start-up; the message names it and quotes its log."""


@dataclass(frozen=True)
class InstanceSpec:
    """One engine instance to launch."""

    name: str  # "prefill-0", "decode-1": names its log file and error messages
    role: KVRole
    port: int
    side_channel_port: int
    engine_id: str
    tensor_parallel_size: int = 1
    pool: str = ""  # "prefill" or "decode": the proxy's pool (its role alone does not say with KV reuse on)

    @property
    def in_prefill_pool(self) -> bool:
        return self.pool == "prefill" if self.pool else self.role is KVRole.PRODUCER


@dataclass(frozen=True)
class ClusterUrls:
    proxy: str
    prefill: tuple[str, ...]
    decode: tuple[str, ...]


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct ports the OS reports free now (all sockets held open together)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sockets = [socket.socket(family, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for s in sockets:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def http_url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def plan_instances(num_prefill: int, num_decode: int, host: str = "127.0.0.1", prefill_tp: int = 1,
                   decode_tp: int = 1, kv_reuse: bool = False) -> list[InstanceSpec]:
    """Prefill instances first, then decode ones, each with two fresh ports and a unique engine id.
    `kv_reuse`: every instance both reads and serves KV (role both): a D serves the history it holds
    to the P prefilling the next turn, a P reads it (proxy/kv_reuse.py)."""
    ports = free_ports(2 * (num_prefill + num_decode), host)
    run_tag = secrets.token_hex(3)  # engine ids differ between runs, so a restarted P is a new peer
    producer, consumer = (KVRole.BOTH, KVRole.BOTH) if kv_reuse else (KVRole.PRODUCER, KVRole.CONSUMER)
    roles = [("prefill", producer, i, prefill_tp) for i in range(num_prefill)]
    roles += [("decode", consumer, i, decode_tp) for i in range(num_decode)]
    return [InstanceSpec(name=f"{kind}-{i}", role=role, port=ports[2 * k], side_channel_port=ports[2 * k + 1],
                         engine_id=f"{kind}-{i}-{run_tag}", tensor_parallel_size=tp, pool=kind)
            for k, (kind, role, i, tp) in enumerate(roles)]


def threads_per_engine(num_engines: int, cores: int | None = None) -> int:
    """Split the cores this process may use evenly between engines (at least one each)."""
    cores = cores if cores is not None else len(os.sched_getaffinity(0))
    return max(1, cores // max(1, num_engines))


def serve_command(cli: Sequence[str], model: str, spec: InstanceSpec, *, host: str, kv_backend: str,
                  num_threads: int, extra_args: Sequence[str] = ()) -> list[str]:
    return [*cli, "serve", model, "--host", host, "--port", str(spec.port), "--kv-role", spec.role.value,
            "--kv-backend", kv_backend, "--kv-engine-id", spec.engine_id,
            "--kv-side-channel-port", str(spec.side_channel_port), "--num-threads", str(num_threads),
            "--tensor-parallel-size", str(spec.tensor_parallel_size),
            "--otlp-service-name", f"kvbridge-{spec.name}", *extra_args]


def kv_events_json(host: str = "127.0.0.1") -> str:
    """Every instance `up` starts publishes KV events (and answers replays) on ports of its own that
    the OS picks, on loopback whatever the cluster's address: the events carry every prompt's
    token ids and ZMQ checks no peer, and the one subscriber, the proxy `up` starts, runs on this
    host. GET /kvbridge/kv_events tells it which ports. `host`: another address (a Ray replica's
    node address, where the router on another node subscribes)."""
    address = f"[{host}]" if ":" in host else host
    return json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://{address}:*",
                       "replay_endpoint": f"tcp://{address}:*"})


# How long an instance of a cluster with KV reuse keeps a finished answer's KV for the conversation's
# next turn after its last use (--kv-retention-seconds; engine/retention.py): a person's think time.
# Bounded to a quarter of the pool with holds, and given up whenever a request needs the blocks.
REUSE_RETENTION_S = 300.0


def _unless_given(args: Sequence[str], flag: str, value: str) -> list[str]:
    """`args`, plus `flag value` unless they already give `flag` (the user's word wins)."""
    return list(args) if any(a.startswith(flag) for a in args) else [*args, flag, value]


def with_retention(args: Sequence[str], seconds: float = REUSE_RETENTION_S) -> list[str]:
    """`args` retaining answers for their next turn unless they already say how long."""
    return _unless_given(args, "--kv-retention-seconds", str(seconds))


def with_kv_events(args: Sequence[str], host: str = "127.0.0.1") -> list[str]:
    """`args` publishing KV events (kv_events_json) unless they already say how (--kv-events-config)."""
    return _unless_given(args, "--kv-events-config", kv_events_json(host))


def proxy_command(cli: Sequence[str], prefill_urls: Sequence[str], decode_urls: Sequence[str], *,
                  host: str, port: int, extra_args: Sequence[str] = ()) -> list[str]:
    return [*cli, "proxy", "--prefill", *prefill_urls, "--decode", *decode_urls,
            "--host", host, "--port", str(port), *extra_args]


def child_env(base: Mapping[str, str], *, loopback_only: bool, num_threads: int,
              api_key: str | None = None) -> dict[str, str]:
    """The children's environment: `base` plus what engines sharing one host need.

    `api_key` goes in KVBRIDGE_API_KEY, which `serve` and `proxy` read (not on their command lines,
    where any local user could read it); "" removes it, None keeps `base`'s."""
    env = dict(base)
    if api_key:
        env["KVBRIDGE_API_KEY"] = api_key
    elif api_key == "":
        env.pop("KVBRIDGE_API_KEY", None)
    env["PYTHONUNBUFFERED"] = "1"  # logs reach the log files as they happen
    # Busy-waiting OpenMP threads of one engine steal the cores of the others.
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    env["OMP_NUM_THREADS"] = str(num_threads)
    if loopback_only:
        # UCX otherwise opens lanes on every interface; every peer here is on loopback.
        env["UCX_NET_DEVICES"] = "lo"
        env.setdefault("UCX_MODULES", "^ib")  # NIXL crashes at exit when ibverbs providers load
    return env


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGTERM it if the launcher dies without stopping it."""
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class ChildProcess:
    """One process this launcher started, with a log file holding its stdout and stderr."""

    def __init__(self, name: str, argv: Sequence[str], popen: subprocess.Popen, log_path: Path,
                 log_file: IO[bytes]) -> None:
        self.name, self.argv, self.popen, self.log_path = name, list(argv), popen, log_path
        self._log_file = log_file

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, lines: int = 20) -> str:
        """The last `lines` lines of its output (empty if it wrote nothing)."""
        try:
            data = self.log_path.read_bytes()[-65536:]
        except OSError:
            return ""
        return "\n".join(data.decode(errors="replace").splitlines()[-lines:])

    def close_log(self) -> None:
        self._log_file.close()


def spawn_child(name: str, argv: Sequence[str], env: Mapping[str, str], log_dir: Path) -> ChildProcess:
    """Start `argv` in its own session (a terminal's Ctrl-C reaches only the launcher, which
    then stops children in order), logging to `log_dir/<name>.log`.

    On Linux the child gets SIGTERM if the thread that spawned it dies first.
    """
    log_path = Path(log_dir) / f"{name}.log"
    log_file = open(log_path, "wb")
    try:
        popen = subprocess.Popen(list(argv), env=dict(env), stdin=subprocess.DEVNULL, stdout=log_file,
                                 stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_die_with_parent)
    except BaseException:
        log_file.close()
        raise
    logger.info("started %s (pid %d): %s", name, popen.pid, " ".join(argv))
    return ChildProcess(name, argv, popen, log_path, log_file)


def stop_children(children: Sequence[ChildProcess], grace_s: float = 10.0,
                  sig: signal.Signals = signal.SIGINT) -> None:
    """Send `sig` to each child still running (SIGINT, the default: stop now; SIGTERM would start
    an instance's drain), wait up to `grace_s` in all, SIGKILL the rest, reap all.

    Signals only these pids, and only while Popen has not reaped them (no pid reuse race).
    """
    for child in children:
        if child.alive():
            child.popen.send_signal(sig)
    deadline = time.monotonic() + grace_s
    for child in children:
        try:
            child.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            logger.warning("%s (pid %d) ignored %s for %.1fs: killing it", child.name, child.pid, sig.name, grace_s)
            child.popen.kill()
            child.popen.wait()
        child.close_log()

class LocalCluster:
    """num_prefill P + num_decode D instances and a proxy on one host.

    Use as a context manager, or call start() / stop(). `port` is the proxy's (0: any free).
    `cli` is the command prefix that runs the kvbridge CLI (tests pass a stand-in).
    """

    def __init__(self, model: str, num_prefill: int = 1, num_decode: int = 1, port: int = 8000,
                 kv_backend: str = "nixl", host: str = "127.0.0.1", extra_serve_args: Sequence[str] = (),
                 ready_timeout_s: float = 300.0, *, cli: Sequence[str] = DEFAULT_CLI,
                 log_dir: str | Path | None = None, num_threads: int | None = None,
                 stop_grace_s: float = 10.0, api_key: str | None = None, prefill_tp: int = 1,
                 decode_tp: int = 1, proxy_args: Sequence[str] = (), kv_reuse: bool = False) -> None:
        """`kv_reuse`: instances of role both and the proxy's --kv-reuse on (plan_instances)."""
        if num_prefill < 1 or num_decode < 1:
            raise ValueError("a cluster needs at least one prefill and one decode instance")
        if ready_timeout_s <= 0 or stop_grace_s < 0:
            raise ValueError("ready_timeout_s must be positive and stop_grace_s non-negative")
        self.model, self.num_prefill, self.num_decode = model, num_prefill, num_decode
        self.port, self.kv_backend, self.host = port, kv_backend, host
        self.extra_serve_args, self.ready_timeout_s = tuple(extra_serve_args), ready_timeout_s
        self.cli, self.stop_grace_s, self.api_key = tuple(cli), stop_grace_s, api_key
        if prefill_tp < 1 or decode_tp < 1:
            raise ValueError("tensor parallel sizes must be at least 1")
        self.prefill_tp, self.decode_tp = prefill_tp, decode_tp
        self.proxy_args = tuple(proxy_args)  # extra `kvbridge proxy` options
        self.kv_reuse = kv_reuse
        if kv_reuse and not any(a.startswith("--kv-reuse") for a in self.proxy_args):
            self.proxy_args += ("--kv-reuse", "on")
        self.num_threads = num_threads or threads_per_engine(num_prefill + num_decode)
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self.children: list[ChildProcess] = []  # in start order: instances, then the proxy
        self._urls: ClusterUrls | None = None
        self._health_urls: dict[str, str] = {}  # child name -> base URL

    @property
    def urls(self) -> ClusterUrls:
        if self._urls is None:
            raise RuntimeError("the cluster is not started")
        return self._urls

    def start(self) -> ClusterUrls:
        """Launch every instance, wait until they are healthy, then the proxy, and wait for it.

        Raises ClusterStartError (after stopping every child) if one dies or the deadline passes.
        """
        if any(c.alive() for c in self.children):
            raise RuntimeError("the cluster is already started")
        self.children, self._health_urls = [], {}
        if self.log_dir is None:
            self.log_dir = Path(tempfile.mkdtemp(prefix="kvbridge-cluster-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + self.ready_timeout_s
        env = child_env(os.environ, loopback_only=self.host in LOOPBACK_HOSTS, num_threads=self.num_threads,
                        api_key=self.api_key)
        if self.host not in LOOPBACK_HOSTS:
            # Every peer is at self.host: UCX stays on its interface (kv_transfer/net.py), whatever
            # the launcher's own environment says.
            env.pop("UCX_NET_DEVICES", None)
            apply_ucx_net_devices(env, self.host)
            env.setdefault("UCX_MODULES", "^ib")
        try:
            specs = plan_instances(self.num_prefill, self.num_decode, self.host, self.prefill_tp, self.decode_tp,
                                   self.kv_reuse)
            for spec in specs:
                argv = serve_command(self.cli, self.model, spec, host=self.host, kv_backend=self.kv_backend,
                                     num_threads=self.num_threads,
                                     extra_args=[*self._instance_args(spec), *self._kv_events_args()])
                self._spawn(spec.name, argv, env, http_url(self.host, spec.port))
            self.wait_healthy(deadline - time.monotonic())
            prefill = tuple(self._health_urls[s.name] for s in specs if s.in_prefill_pool)
            decode = tuple(self._health_urls[s.name] for s in specs if not s.in_prefill_pool)
            proxy_port = self.port or free_ports(1, self.host)[0]
            argv = proxy_command(self.cli, prefill, decode, host=self.host, port=proxy_port,
                                 extra_args=self.proxy_args)
            self._spawn("proxy", argv, env, http_url(self.host, proxy_port))
            self.wait_healthy(deadline - time.monotonic())
        except BaseException:
            self.stop()
            raise
        self._urls = ClusterUrls(http_url(self.host, proxy_port), prefill, decode)
        return self._urls

    def _instance_args(self, spec: InstanceSpec) -> list[str]:
        """The extra serve args, plus for a decode instance on another address than loopback its
        prefill instances' address as its only trusted host (unless the args name trusted hosts):
        a decode instance trusts only this host's own addresses by default. With KV reuse, answers
        are retained for their next turn (REUSE_RETENTION_S, unless the args say otherwise)."""
        args = with_retention(self.extra_serve_args) if self.kv_reuse else list(self.extra_serve_args)
        if (spec.role is not KVRole.PRODUCER and self.host not in LOOPBACK_HOSTS
                and not any(a.startswith("--kv-trusted-hosts") for a in args)):
            args += ["--kv-trusted-hosts", self.host]
        return args

    def _kv_events_args(self) -> list[str]:
        """KV events on for every instance, unless the serve args configure them."""
        return with_kv_events(self.extra_serve_args)[len(self.extra_serve_args):]

    def _spawn(self, name: str, argv: list[str], env: dict[str, str], url: str) -> None:
        assert self.log_dir is not None
        self.children.append(spawn_child(name, argv, env, self.log_dir))
        self._health_urls[name] = url

    def first_dead_child(self) -> ChildProcess | None:
        return next((c for c in self.children if not c.alive()), None)

    def wait_healthy(self, timeout_s: float | None = None) -> None:
        """Block until every started child's /health answers 200 (timeout: ready_timeout_s).

        Raises ClusterStartError naming the child that exited, or those still unhealthy.
        """
        deadline = time.monotonic() + (self.ready_timeout_s if timeout_s is None else timeout_s)
        pending = list(self.children)
        with httpx.Client(timeout=2.0, trust_env=False) as client:
            while pending:
                if (dead := next((c for c in pending if not c.alive()), None)) is not None:
                    raise ClusterStartError(f"{dead.name} exited with code {dead.popen.returncode} during "
                                            f"start-up; last output lines ({dead.log_path}):\n{dead.tail()}")
                pending = [c for c in pending if not self._healthy(client, c)]
                if pending and time.monotonic() >= deadline:
                    names = ", ".join(c.name for c in pending)
                    tails = "\n".join(f"--- {c.name} ({c.log_path}):\n{c.tail(10)}" for c in pending)
                    raise ClusterStartError(f"not healthy in time: {names}\n{tails}")
                if pending:
                    time.sleep(0.2)

    def _healthy(self, client: httpx.Client, child: ChildProcess) -> bool:
        try:
            return client.get(self._health_urls[child.name] + "/health").status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        """Stop every child this cluster started, the proxy first; safe to call twice.
        `children` keeps the stopped (reaped) processes for inspection."""
        stop_children(list(reversed(self.children)), self.stop_grace_s)
        self._urls = None

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def curl_example(proxy_url: str, model: str, with_api_key: bool = False) -> str:
    auth = " -H \"Authorization: Bearer $KVBRIDGE_API_KEY\"" if with_api_key else ""
    return (f"curl {proxy_url}/v1/chat/completions{auth} -H 'Content-Type: application/json' -d "
            f"'{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}], "
            f"\"max_tokens\": 32}}'")


def run_cluster(model: str, num_prefill: int = 1, num_decode: int = 1, port: int = 8000,
                kv_backend: str = "nixl", host: str = "127.0.0.1", extra_serve_args: Sequence[str] = (),
                ready_timeout_s: float = 300.0, *, cli: Sequence[str] = DEFAULT_CLI,
                num_threads: int | None = None, api_key: str | None = None, prefill_tp: int = 1,
                decode_tp: int = 1, proxy_args: Sequence[str] = (), kv_reuse: bool = False) -> int:
    """`kvbridge up`: run a LocalCluster until Ctrl-C or SIGTERM (exit 0) or a child dies (exit 1).

    Call it from the main thread so it can turn SIGTERM into an orderly stop.
    """
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cluster = LocalCluster(model, num_prefill, num_decode, port, kv_backend, host, extra_serve_args,
                           ready_timeout_s, cli=cli, num_threads=num_threads, api_key=api_key,
                           prefill_tp=prefill_tp, decode_tp=decode_tp, proxy_args=proxy_args, kv_reuse=kv_reuse)
    previous = handle_stop_signals()  # SIGINT and SIGTERM stop it, even if started with SIGINT ignored
    try:
        urls = cluster.start()
        print(f"kvbridge cluster ready: proxy {urls.proxy}\n  prefill: {' '.join(urls.prefill)}\n"
              f"  decode:  {' '.join(urls.decode)}\n  logs:    {cluster.log_dir}\n"
              f"try:\n  {curl_example(urls.proxy, model, with_api_key=bool(api_key))}\n"
              "Ctrl-C stops everything.", flush=True)
        while (dead := cluster.first_dead_child()) is None:
            time.sleep(0.5)
        print(f"kvbridge up: {dead.name} exited with code {dead.popen.returncode}; stopping the cluster. "
              f"Last output lines ({dead.log_path}):\n{dead.tail()}", file=sys.stderr, flush=True)
        return 1
    except ClusterStartError as exc:
        print(f"kvbridge up: {exc}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print("kvbridge up: stopping the cluster", flush=True)
        return 0
    finally:
        ignore_stop_signals(previous)  # a second Ctrl-C must not leave children half-stopped
        cluster.stop()
        restore_stop_signals(previous)
