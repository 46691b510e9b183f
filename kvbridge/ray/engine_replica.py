"""One replica of the prefill or decode pool: a Ray Serve replica that runs one kvbridge engine
instance (`kvbridge serve`, with its KV connector) as its child process.

Ray owns the replica: where it runs (its node's resources, a placement group for TP > 1) and
how long (started, health-checked, replaced, scaled down). The replica owns its engine:
- start: `kvbridge serve` on this node's address with free ports, in a session of its own,
  SIGTERMed if the replica dies (launcher.cluster.spawn_child); the replica is ready (Serve's
  constructor returns) once the engine's /health answered 200, so a replica Serve lists always
  has a serving engine;
- events: the engine publishes its KV events on the node's address (ports the OS picks; unless the
  serve args configure them), which the router follows when it routes kv_aware or per request;
- publish: its URL, role, engine id and KV side channel as Serve replica metadata
  (`record_replica_metadata`), which the router learns through Ray (discovery.py);
- health: `check_health` fails once the engine exited or stopped answering, and Serve replaces
  the replica;
- load: the engine's `GET /kvbridge/load` as Serve custom autoscaling metrics (policy.py); a pool
  at zero learns of its demand from the router's `wake` calls instead (ingress.py);
- leave: Serve's graceful shutdown calls `__del__`, which SIGTERMs the engine: it drains (a P
  until every lease it granted ended, a D until its streams finished or its drain timeout) and
  exits; past `drain_grace_s` it is killed.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from kvbridge.config import KVRole
from kvbridge.launcher.cluster import (DEFAULT_CLI, LOOPBACK_HOSTS, ChildProcess, InstanceSpec, child_env,
                                       free_ports, http_url, serve_command, spawn_child, stop_children,
                                       with_kv_events, with_retention)
from kvbridge.kv_transfer.net import apply_ucx_net_devices
from kvbridge.proxy.transport import UpstreamTransport

logger = logging.getLogger(__name__)

ROLES = {"prefill": KVRole.PRODUCER, "decode": KVRole.CONSUMER}
LOAD_PATH = "/kvbridge/load"


class EngineStartError(RuntimeError):
    """The engine exited or stayed unhealthy during start-up; the message quotes its log."""


@dataclass(frozen=True)
class EngineOptions:
    """How each replica of one pool runs its engine (JSON-able: it travels in Serve's config)."""

    role: str  # "prefill" or "decode"
    model: str
    kv_backend: str = "nixl"
    num_threads: int = 1
    tensor_parallel_size: int = 1
    serve_args: tuple[str, ...] = ()  # further `kvbridge serve` options
    api_key: str | None = None  # reaches the engine in KVBRIDGE_API_KEY, never on its command line
    kv_reuse: bool = False  # KV role both (serves and reads held prefixes), whichever pool
    ready_timeout_s: float = 300.0
    drain_grace_s: float = 60.0  # how long __del__ waits for the drained engine to exit
    cli: tuple[str, ...] = field(default=DEFAULT_CLI)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {sorted(ROLES)}, not {self.role!r}")
        if self.num_threads < 1 or self.tensor_parallel_size < 1:
            raise ValueError("num_threads and tensor_parallel_size must be at least 1")

    def to_json(self) -> dict:
        return {**asdict(self), "serve_args": list(self.serve_args), "cli": list(self.cli)}

    @classmethod
    def from_json(cls, data: dict) -> EngineOptions:
        return cls(**{**data, "serve_args": tuple(data.get("serve_args", ())),
                      "cli": tuple(data.get("cli", DEFAULT_CLI))})


def node_address() -> str:
    """This node's address as Ray knows it (the address every node of the cluster binds)."""
    import ray
    return ray.util.get_node_ip_address()


class EngineReplica:
    """The body of the prefill and decode deployments (app.py wraps it in serve.deployment)."""

    def __init__(self, options: dict) -> None:
        from ray import serve
        self.options = EngineOptions.from_json(options)
        replica_id = serve.get_replica_context().replica_id.unique_id
        self.host = node_address()
        port, side_port = free_ports(2, self.host)
        self.engine_id = f"{self.options.role}-{replica_id}"
        self.url = http_url(self.host, port)
        self.side_channel_port = side_port
        self.log_dir = Path(tempfile.mkdtemp(prefix=f"kvbridge-{self.engine_id}-"))
        kv_role = KVRole.BOTH if self.options.kv_reuse else ROLES[self.options.role]
        spec = InstanceSpec(self.engine_id, kv_role, port, side_port, self.engine_id,
                            self.options.tensor_parallel_size)
        # KV events on the node's address (the router subscribes from its own node), unless configured
        argv = serve_command(self.options.cli, self.options.model, spec, host=self.host,
                             kv_backend=self.options.kv_backend, num_threads=self.options.num_threads,
                             extra_args=with_kv_events(with_retention(self.options.serve_args) if self.options.kv_reuse
                                                       else self.options.serve_args, self.host))
        loopback = self.host in LOOPBACK_HOSTS
        env = child_env(os.environ, loopback_only=loopback, num_threads=self.options.num_threads,
                        api_key=self.options.api_key or "")
        if not loopback:
            env.pop("UCX_NET_DEVICES", None)
            apply_ucx_net_devices(env, self.host)
            env.setdefault("UCX_MODULES", "^ib")
        self._client = httpx.Client(timeout=5.0, trust_env=False, headers=self._auth())
        self._aclient: httpx.AsyncClient | None = None
        self.child = self._spawn_kept(argv, env)
        try:
            self._wait_healthy(self.options.ready_timeout_s)
        except BaseException:
            self._stop_child(grace_s=5.0)
            raise
        logger.info("%s serving at %s (pid %d, side channel %s:%d)", self.engine_id, self.url, self.child.pid,
                    self.host, side_port)

    def _auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.options.api_key}"} if self.options.api_key else {}

    def _spawn_kept(self, argv: list[str], env: dict[str, str]) -> ChildProcess:
        """Spawn the engine from a thread that lives as long as the engine: its parent-death
        signal fires when the spawning thread ends, so not from a pool thread Serve may retire."""
        spawned: list[ChildProcess | BaseException] = []
        ready = threading.Event()

        def keeper() -> None:
            try:
                child = spawn_child(self.engine_id, argv, env, self.log_dir)
            except BaseException as exc:  # reported to the constructor
                spawned.append(exc)
                ready.set()
                return
            spawned.append(child)
            ready.set()
            child.popen.wait()

        threading.Thread(target=keeper, name=f"kvbridge-{self.engine_id}", daemon=True).start()
        ready.wait()
        if isinstance(spawned[0], BaseException):
            raise spawned[0]
        return spawned[0]

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if not self.child.alive():
                raise EngineStartError(f"{self.engine_id} exited with code {self.child.popen.returncode} during "
                                       f"start-up; last output lines ({self.child.log_path}):\n{self.child.tail()}")
            try:
                if self._client.get(self.url + "/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() >= deadline:
                raise EngineStartError(f"{self.engine_id} not healthy in {timeout_s:.0f} s; last output lines "
                                       f"({self.child.log_path}):\n{self.child.tail()}")
            time.sleep(0.2)

    # ---- what Serve calls ----------------------------------------------------------------
    def record_replica_metadata(self) -> dict:
        """What the router learns of this replica through Ray (discovery.py)."""
        import ray
        return {"kvbridge": 1, "role": self.options.role, "url": self.url, "engine_id": self.engine_id,
                "host": self.host, "side_channel_port": self.side_channel_port, "pid": self.child.pid,
                "replica_pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id(),
                "tp": self.options.tensor_parallel_size, "log": str(self.child.log_path)}

    async def check_health(self) -> None:
        """Raises when the engine exited or does not answer: Serve then replaces this replica. A
        draining engine (503 "draining") is healthy: it is leaving on purpose."""
        if not self.child.alive():
            raise RuntimeError(f"{self.engine_id}: engine exited with code {self.child.popen.returncode}")
        try:
            r = await self._async_client().get(self.url + "/health")
        except httpx.HTTPError as exc:
            raise RuntimeError(f"{self.engine_id}: /health failed: {exc!r}") from exc
        if r.status_code != 200 and not _draining(r):
            raise RuntimeError(f"{self.engine_id}: /health answered {r.status_code}")

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """The engine's /kvbridge/load figures, as numbers (policy.py reads them)."""
        try:
            r = await self._async_client().get(self.url + LOAD_PATH)
            figures = r.json() if r.status_code == 200 else {}
        except (httpx.HTTPError, ValueError):
            figures = {}
        return {k: float(v) for k, v in figures.items() if isinstance(v, (int, float))}

    async def wake(self) -> str:
        """Nothing: the router's call through Serve that asks a pool at zero for a replica
        (ingress.ScaleFromZero); it returns once this replica took it."""
        return self.engine_id

    async def info(self) -> dict:
        """This replica's metadata and whether its engine runs (tests, `kvbridge ray status`)."""
        return {**self.record_replica_metadata(), "alive": self.child.alive()}

    async def __del__(self) -> None:
        """Serve's graceful shutdown: the engine drains and exits (bounded by drain_grace_s)."""
        await asyncio.to_thread(self._stop_child, self.options.drain_grace_s)
        if self._aclient is not None:
            await self._aclient.aclose()

    # ---- internals -------------------------------------------------------------------------
    def _async_client(self) -> httpx.AsyncClient:
        if self._aclient is None:
            # UpstreamTransport: its engine killed while a connection opens is an httpx error here too.
            self._aclient = httpx.AsyncClient(timeout=5.0, trust_env=False, headers=self._auth(),
                                              transport=UpstreamTransport(trust_env=False))
        return self._aclient

    def _stop_child(self, grace_s: float) -> None:
        """SIGTERM the engine (it drains), wait up to `grace_s`, then SIGKILL; reap it."""
        stop_children([self.child], grace_s, signal.SIGTERM)
        self._client.close()

def _draining(r: httpx.Response) -> bool:
    try:
        return r.status_code == 503 and r.json().get("status") == "draining"
    except (ValueError, AttributeError):
        return False
