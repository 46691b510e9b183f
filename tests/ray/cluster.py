"""The tests' Ray cluster: `ray.cluster_utils.Cluster` nodes on this machine, every one bound to
127.0.0.1 (conftest.py), a head without custom resources (the router runs there) and one node
each for prefill and decode; the kvbridge application deployed on it, and what the tests ask of
it (the engines' endpoints as Ray publishes them, the router's view, the engines' metrics).

One cluster serves the session (SharedRay, conftest.py's `shared_ray`): each module deploys its
application under its own name (`application`), and removes it at its end, leaving the cluster as
it found it (assert_clean: no application, replica, placement group or node resource left). The
colocated reference instance is shared the same way (SharedColocated)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
from openai import AsyncOpenAI

from kvbridge.launcher.cluster import DEFAULT_CLI, free_ports, http_url, spawn_child, stop_children
from kvbridge.ray import app, discovery
from tests.e2e.processes import gone, metric

MODEL = "SmolLM2-135M-Instruct"
ENGINE_ARGS = ("--kv-cache-memory-gb", "0.25", "--max-model-len", "1024", "--dtype", "float32")  # fp32: greedy P/D = colocated holds batch for batch (bf16 is not batch-invariant)
P_RESOURCE, D_RESOURCE = "kvbridge_prefill_node", "kvbridge_decode_node"
# The shared cluster's node resources: a replica takes one of its node's, so this bounds a pool's
# size. The most any module asks for: test_ray_scale's 1:3 pools; autoscale's 1:2, pd's 2 D.
SHARED_NODES = {P_RESOURCE: 4, D_RESOURCE: 4}


@contextlib.contextmanager
def ray_cluster(nodes: dict[str, float] | None = None) -> Iterator[object]:
    """A head node and one node per custom resource in `nodes` (name -> amount), all on
    127.0.0.1; this process is the driver. Stops every node afterwards."""
    import ray
    from ray.cluster_utils import Cluster
    # One logical CPU a node: Ray starts about one idle worker per CPU, and the replicas ask for
    # none (their engines share the cores, as `kvbridge up`'s do); a small object store each.
    node = dict(node_ip_address="127.0.0.1", num_cpus=1, include_dashboard=False,
                object_store_memory=96 << 20)
    cluster = Cluster(initialize_head=True, head_node_args=node)
    try:
        for name, amount in (nodes or {}).items():
            cluster.add_node(**node, resources={name: amount})
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, configure_logging=False, log_to_driver=False)
        yield cluster
    finally:
        from ray import serve
        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()
        cluster.shutdown()


class SharedRay:
    """The session's Ray cluster (ray_cluster(SHARED_NODES)), started on first `get()`. `stop()`
    stops it for a while (a later `get()` starts a new one: test_up_ray.py's own Ray must not run
    beside it); `close()` stops it for good (after its last test: conftest.py). A module that left
    it unclean (`application` failed its check) or a cluster that lost a node is replaced on the
    next `get()`, so one module's failure does not fail the next ones."""

    def __init__(self) -> None:
        self._stack: contextlib.ExitStack | None = None
        self.cluster: object | None = None
        self.closed, self.dirty, self.starts = False, False, 0

    def get(self) -> object:
        assert not self.closed, "the shared Ray cluster was asked for after its last test (conftest.py)"
        if self.cluster is not None and (self.dirty or not self._healthy()):
            self.stop()
        if self.cluster is None:
            stack = contextlib.ExitStack()
            started = time.monotonic()
            self.cluster = stack.enter_context(ray_cluster(SHARED_NODES))  # stops what it started if it fails
            self._stack, self.dirty = stack, False
            self.starts += 1
            print(f"shared Ray cluster started in {time.monotonic() - started:.0f} s (start {self.starts})")
        return self.cluster

    def _healthy(self) -> bool:
        import ray
        try:
            return ray.is_initialized() and len([n for n in ray.nodes() if n["Alive"]]) == 1 + len(SHARED_NODES)
        except Exception:
            return False

    def stop(self) -> None:
        stack, self._stack, self.cluster = self._stack, None, None
        if stack is not None:
            stack.close()

    def close(self) -> None:
        self.closed = True
        self.stop()


def assert_clean(pids: Iterable[int] = (), timeout_s: float = 60.0) -> None:
    """The connected cluster holds nothing of any application: Serve lists none, no Serve replica
    actor lives, no placement group is left, every node resource is free, and the processes in
    `pids` (engines and replicas an application ran) exited. Polled: Ray frees them a moment after
    Serve forgets the application."""
    import ray
    from ray import serve
    from ray.util import list_named_actors, placement_group_table

    def leftovers() -> dict[str, object]:
        total, free = ray.cluster_resources(), ray.available_resources()
        found = {
            "applications": sorted(serve.status().applications),
            "replica actors": sorted(a["name"] for a in list_named_actors(all_namespaces=True)
                                     if a["name"].startswith("SERVE_REPLICA::")),
            "placement groups": sorted(f"{g['name']} {g['state']}" for g in placement_group_table().values()
                                       if g["state"] != "REMOVED"),
            "resources in use": {r: total.get(r, 0) - free.get(r, 0) for r in SHARED_NODES
                                 if free.get(r, 0) != total.get(r, 0)},
        }
        return {k: v for k, v in found.items() if v}

    deadline = time.monotonic() + timeout_s
    while (left := leftovers()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"the Ray cluster is not clean after the application's removal: {left}"
    alive = gone(sorted(set(pids)), max(deadline - time.monotonic(), 1.0))
    assert alive == [], f"processes of a removed application still run: {alive}"


@dataclass
class Deployed:
    cluster: object
    url: str
    pools: Pools


@contextlib.contextmanager
def application(shared: SharedRay, config: app.AppConfig, timeout_s: float = 600.0) -> Iterator[Deployed]:
    """Deploy `config` (its own application name) on the shared cluster; afterwards remove it and
    check that the cluster is clean for the next module (assert_clean); a cluster left unclean
    is replaced on the next `shared.get()`. The test may remove the application itself."""
    from ray import serve
    cluster = shared.get()
    pools: Pools | None = None
    try:
        assert config.name not in serve.status().applications, f"{config.name} is already deployed"
        started = time.monotonic()
        url = app.deploy(config, timeout_s=timeout_s)
        print(f"deployed {config.name} in {time.monotonic() - started:.0f} s")
        pools = Pools(config.name)
        yield Deployed(cluster, url, pools)
    finally:
        try:
            if pools is not None:
                pools.close()
            if config.name in serve.status().applications:
                app.remove(config.name)
            assert_clean(pools.seen_pids if pools is not None else ())
        except BaseException:
            shared.dirty = True
            raise


def node_of(cluster: object, resource: str) -> str:
    """The id of the node holding `resource`."""
    import ray
    return next(n["NodeID"] for n in ray.nodes() if n["Alive"] and resource in n["Resources"])


class Pools:
    """The endpoints of the prefill and decode replicas as Ray publishes them to this process
    (discovery.py: this process's handles use PoolRouter too), with a condition to wait on."""

    def __init__(self, name: str) -> None:
        from ray import serve
        self.name = name
        self.cond = threading.Condition()
        self.endpoints: dict[str, list[discovery.ReplicaEndpoint]] = {"prefill": [], "decode": []}
        self.seen_pids: set[int] = set()  # of every engine and replica published (assert_clean)
        self.handles = {}
        for role in ("prefill", "decode"):
            discovery.listen(name, role, self._listener(role))
            self.handles[role] = serve.get_deployment_handle(role, name).options()

    def _listener(self, role: str):
        def on_change(endpoints: list[discovery.ReplicaEndpoint]) -> None:
            with self.cond:
                self.endpoints[role] = endpoints
                self.seen_pids.update(p for e in endpoints for p in (e.pid, e.replica_pid))
                self.cond.notify_all()
        return on_change

    def wait(self, predicate, timeout_s: float, what: str) -> dict[str, list[discovery.ReplicaEndpoint]]:
        with self.cond:
            assert self.cond.wait_for(lambda: predicate(self.endpoints), timeout_s), (
                f"not within {timeout_s:.0f} s: {what}; pools now {self.endpoints}")
            return {k: list(v) for k, v in self.endpoints.items()}

    def close(self) -> None:
        for role in ("prefill", "decode"):
            discovery.forget(self.name, role)


def running_replicas(name: str) -> dict[str, dict[str, int]]:
    """Each deployment's RUNNING replicas as Serve's controller lists them: {name: {replica id:
    replica process pid}}."""
    details = app._client().get_serve_details()["applications"][name]["deployments"]
    return {deployment: {r["replica_id"]: r["pid"] for r in d["replicas"] if str(r["state"]).endswith("RUNNING")}
            for deployment, d in details.items()}


def router_members(name: str) -> dict[str, list[dict]]:
    from ray import serve
    return serve.get_deployment_handle("router", name).members.remote().result(timeout_s=30)


def wait_router(name: str, predicate, timeout_s: float, what: str) -> dict[str, list[dict]]:
    """Poll the router's view (its health report) until `predicate` holds."""
    deadline = time.monotonic() + timeout_s
    while True:
        members = router_members(name)
        if predicate(members):
            return members
        assert time.monotonic() < deadline, f"not within {timeout_s:.0f} s: {what}; router sees {members}"
        time.sleep(0.1)


def assert_blocks_free(urls: list[str], timeout_s: float = 20.0) -> None:
    """Every KV block free on every engine, and no lease ended by expiry."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = {u: (metric(u, "kvbridge_kv_cache_free_blocks"), metric(u, "kvbridge_kv_cache_total_blocks"))
                 for u in urls}
        if all(free == total for free, total in state.values()):
            break
        assert time.monotonic() < deadline, f"KV blocks still allocated: {state}"
        time.sleep(0.1)


@contextlib.contextmanager
def colocated_instance(log_dir: Path, model: str = MODEL) -> Iterator[str]:
    """One plain `kvbridge serve` of `model` (no KV transfer, TP 1) with the replicas' engine
    options: the reference every answer through the Ray router must equal."""
    port = free_ports(1)[0]
    url = http_url("127.0.0.1", port)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    child = spawn_child("colocated", [*DEFAULT_CLI, "serve", model, "--host", "127.0.0.1", "--port", str(port),
                                      "--num-threads", "1", *ENGINE_ARGS], env, log_dir)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert child.alive(), f"the colocated instance exited:\n{child.tail()}"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=2, trust_env=False).status_code == 200:
                    break
            assert time.monotonic() < deadline, f"the colocated instance is not healthy:\n{child.tail()}"
            time.sleep(0.2)
        yield url
    finally:
        stop_children([child])


class SharedColocated:
    """The session's colocated reference instance of MODEL (colocated_instance), started on first
    `get()` and stopped by `close()` after its last test (conftest.py); one that died is replaced."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self._stack: contextlib.ExitStack | None = None
        self.url: str | None = None
        self.closed, self.starts = False, 0

    def get(self) -> str:
        assert not self.closed, "the shared colocated instance was asked for after its last test (conftest.py)"
        if self.url is not None and not self._healthy():
            self.stop()
        if self.url is None:
            stack = contextlib.ExitStack()
            log_dir = self.log_dir / (f"restart-{self.starts}" if self.starts else "")
            log_dir.mkdir(parents=True, exist_ok=True)
            self.url = stack.enter_context(colocated_instance(log_dir))
            self._stack = stack
            self.starts += 1
        return self.url

    def _healthy(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=10, trust_env=False).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        stack, self._stack, self.url = self._stack, None, None
        if stack is not None:
            stack.close()

    def close(self) -> None:
        self.closed = True
        self.stop()


def app_config(name: str, prefill: app.PoolSize, decode: app.PoolSize, model: str = MODEL,
               router: dict | None = None, **overrides) -> app.AppConfig:
    return app.AppConfig(model=model, prefill=prefill, decode=decode, name=name, serve_args=ENGINE_ARGS,
                         prefill_resources={P_RESOURCE: 1}, decode_resources={D_RESOURCE: 1},
                         router={"port": 0, "health_interval_s": 0.5, **(router or {})}, drain_grace_s=30.0,
                         **overrides)


class Load:
    """`clients` clients streaming greedy completions of `prompts` in turn until stopped, on a thread of
    their own. Each answer is recorded as (prompt, text, whether any byte arrived, error)."""

    def __init__(self, url: str, prompts: list[str], max_tokens: int, clients: int = 16) -> None:
        self.url, self.prompts, self.max_tokens, self.clients = url, prompts, max_tokens, clients
        self.results: list[tuple[str, str, bool, str | None]] = []
        self.cond = threading.Condition()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _one(self, client: AsyncOpenAI, i: int) -> None:
        n = i
        while not self.stopping.is_set():
            prompt, text, got, error = self.prompts[n % len(self.prompts)], "", False, None
            n += self.clients
            try:
                stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=self.max_tokens,
                                                         temperature=0, stream=True)
                async for chunk in stream:
                    got = True
                    text += chunk.choices[0].text if chunk.choices else ""
            except Exception as exc:  # recorded: the test judges it
                error = repr(exc)
            with self.cond:
                self.results.append((prompt, text, got, error))
                self.cond.notify_all()

    async def _run(self) -> None:
        client = AsyncOpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        await asyncio.gather(*(self._one(client, i) for i in range(self.clients)))

    def wait_done(self, count: int, timeout_s: float) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.results) >= count, timeout_s), (
                f"only {len(self.results)} of {count} answers in {timeout_s:.0f} s")

    def __enter__(self) -> Load:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        self.thread.join(180)
        assert not self.thread.is_alive(), "the load's clients did not finish"
