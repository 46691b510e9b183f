"""The tests' Ray cluster: `ray.cluster_utils.Cluster` nodes on this machine, every one bound to
127.0.0.1 (conftest.py), a head without custom resources (the router runs there) and one node
each for prefill and decode; the kvbridge application deployed on it, and what the tests ask of
it (the engines' endpoints as Ray publishes them, the router's view, the engines' metrics)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
from openai import AsyncOpenAI

from kvbridge.launcher.cluster import DEFAULT_CLI, free_ports, http_url, spawn_child, stop_children
from kvbridge.ray import app, discovery
from tests.e2e.processes import metric

MODEL = "SmolLM2-135M-Instruct"
ENGINE_ARGS = ("--kv-cache-memory-gb", "0.25", "--max-model-len", "1024", "--dtype", "float32")  # fp32: greedy P/D = colocated holds batch for batch (bf16 is not batch-invariant)
P_RESOURCE, D_RESOURCE = "kvbridge_prefill_node", "kvbridge_decode_node"


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
        self.handles = {}
        for role in ("prefill", "decode"):
            discovery.listen(name, role, self._listener(role))
            self.handles[role] = serve.get_deployment_handle(role, name).options()

    def _listener(self, role: str):
        def on_change(endpoints: list[discovery.ReplicaEndpoint]) -> None:
            with self.cond:
                self.endpoints[role] = endpoints
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
