"""Rescaling a running application while clients stream (`kvbridge ray scale`'s path,
app.scale): 1P1D -> 2P2D -> 1P1D on the session's Ray cluster of three nodes on this machine. No replica
restarts on a change of size; new replicas take traffic once healthy; a replica that leaves
drains (a P until every lease it granted ended, a D until its streams finished) before its
engine exits. 0 failed requests, every answer equals the colocated one, every block free
afterwards, and no lease on a removed P ended by expiry. Then every kind of resize (fixed ->
MIN:MAX, MIN:MAX -> MIN:MAX, MIN:MAX -> fixed, of one pool or both) keeps every replica, the
router's included. Needs the instances' drain (`POST /kvbridge/drain`, SIGTERM) and load
(`GET /kvbridge/load`). About 4-6 minutes."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from openai import OpenAI

from kvbridge.ray import app
from tests.e2e.processes import alive, gone, metric
from tests.ray.cluster import (MODEL, Load, app_config, application, assert_blocks_free, running_replicas,
                               wait_router)

pytestmark = pytest.mark.timeout(1200)
NAME = "kvbridge-scale"
MAX_TOKENS = 16
PROMPTS = ["Hello there", "The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           ("The history of the Roman Empire spans many centuries, from the founding of the city to the fall of "
            "Constantinople. Summarise its three most important turning points, with a date for each:")]


def counts(endpoints: dict) -> tuple[int, int]:
    return len(endpoints["prefill"]), len(endpoints["decode"])


def healthy(members: dict) -> tuple[int, int]:
    return tuple(len([u for u in members[r] if u["healthy"]]) for r in ("prefill", "decode"))


class ExpiryWatch:
    """The last `kvbridge_kv_expired_leases_total` each prefill engine reported before it exited
    (scraped every 0.1 s until its /metrics refuses the connection)."""

    def __init__(self, urls: list[str]) -> None:
        self.last = {u: 0.0 for u in urls}
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self._watch, args=(u,), daemon=True) for u in urls]
        for t in self.threads:
            t.start()

    def _watch(self, url: str) -> None:
        while not self.stopping.is_set():
            try:
                self.last[url] = metric(url, "kvbridge_kv_expired_leases_total")
            except (httpx.HTTPError, AssertionError):
                return  # gone
            self.stopping.wait(0.1)

    def stop(self) -> dict[str, float]:
        self.stopping.set()
        for t in self.threads:
            t.join(30)
        return self.last


@pytest.fixture(scope="module")
def deployed(shared_ray, shared_colocated):
    reference = shared_colocated.get()
    with application(shared_ray, app_config(NAME, app.PoolSize(1, 1), app.PoolSize(1, 1))) as deployed:
        pools = deployed.pools
        pools.wait(lambda e: counts(e) == (1, 1), 60, "1 P and 1 D published")
        wait_router(NAME, lambda m: healthy(m) == (1, 1), 30, "the router has 1 healthy P and D")
        yield deployed.url, reference, pools


def reference_text(base: str, prompt: str) -> str:
    client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=300)
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0).choices[0].text


def test_scale_up_and_down_while_16_clients_stream(deployed):
    url, reference, pools = deployed
    want = {p: reference_text(reference, p) for p in PROMPTS}
    first = {e.replica_id for r in pools.endpoints.values() for e in r}
    with Load(url, PROMPTS, MAX_TOKENS) as load:
        load.wait_done(16, 300)
        started = time.monotonic()
        app.scale(NAME, app.PoolSize(2, 2), app.PoolSize(2, 2), timeout_s=600)
        up = pools.wait(lambda e: counts(e) == (2, 2), 120, "2 P and 2 D published")
        wait_router(NAME, lambda m: healthy(m) == (2, 2), 60, "the router has 2 healthy P and 2 healthy D")
        up_s = time.monotonic() - started
        assert first <= {e.replica_id for r in up.values() for e in r}, "a change of size restarted a replica"
        new = [e for r in up.values() for e in r if e.replica_id not in first]
        load.wait_done(len(load.results) + 48, 300)
        served = {e.url: metric(e.url, "kvbridge_prompt_tokens_total") for e in new}
        assert all(v > 0 for v in served.values()), f"a new replica took no traffic: {served}"

        watch = ExpiryWatch([e.url for e in up["prefill"]])
        started = time.monotonic()
        app.scale(NAME, app.PoolSize(1, 1), app.PoolSize(1, 1), timeout_s=600)
        down = pools.wait(lambda e: counts(e) == (1, 1), 120, "1 P and 1 D published")
        staying = {e.replica_id for r in down.values() for e in r}
        removed = [e for r in up.values() for e in r if e.replica_id not in staying]
        assert len(removed) == 2
        assert gone([e.pid for e in removed], 120) == [], "a removed replica's engine did not exit"
        down_s = time.monotonic() - started
        load.wait_done(len(load.results) + 16, 300)
    expired = watch.stop()
    print(f"scale-up to serving {up_s:.0f} s, scale-down to the drained engines' exit {down_s:.0f} s; "
          f"{len(load.results)} answers")
    failed = [r for r in load.results if r[3] is not None]
    assert failed == [], f"{len(failed)} failed requests, e.g. {failed[:3]}"
    assert [(p, t) for p, t, _, _ in load.results if t != want[p]] == []
    assert expired == {u: 0.0 for u in expired}, "a lease on a prefill replica ended by expiry"
    assert_blocks_free([e.url for r in down.values() for e in r])


# (prefill, decode) sizes in turn, from 1P1D fixed: the issue's `--decode-replicas 1:2` first.
RESIZES = [(None, "1:2"), ("1:2", None), ("1:3", "1:3"), ("1", None), (None, "1")]


def test_every_kind_of_resize_keeps_every_replica_while_clients_stream(deployed):
    """Issue 44.3: the first change from a fixed size to MIN:MAX changed Serve's code version,
    and Serve restarted every replica of the application (P, D and the router). Each resize in
    RESIZES, with 4 clients streaming: every replica Serve ran before still runs (same replica,
    same process, same engine process), answers keep coming, none fails, each equals the
    colocated one."""
    url, reference, pools = deployed
    want = {p: reference_text(reference, p) for p in PROMPTS}
    before = running_replicas(NAME)
    engines = {e.replica_id: e.pid for r in pools.endpoints.values() for e in r}
    assert [len(before[d]) for d in ("router", "prefill", "decode")] == [1, 1, 1], before
    with Load(url, PROMPTS, MAX_TOKENS, clients=4) as load:
        load.wait_done(4, 300)
        for prefill, decode in RESIZES:
            what = f"prefill {prefill or 'kept'}, decode {decode or 'kept'}"
            started = time.monotonic()
            app.scale(NAME, app.PoolSize.parse(prefill) if prefill else None,
                      app.PoolSize.parse(decode) if decode else None, timeout_s=600)
            now = running_replicas(NAME)
            for deployment, replicas in before.items():
                assert replicas.items() <= now[deployment].items(), f"{what} restarted a {deployment} replica: {now}"
            published = {e.replica_id: e.pid for r in pools.endpoints.values() for e in r}
            assert engines.items() <= published.items(), f"{what} restarted an engine: {published}"
            overrides = {d["name"]: d for d in app.deployed_schema(NAME)["deployments"]}
            for role, size in (("prefill", prefill), ("decode", decode)):
                if size is not None:  # N is deployed as MIN = MAX = N
                    low, _, high = size.partition(":")
                    bounds = overrides[role].get("autoscaling_config", {})
                    assert (bounds.get("min_replicas"), bounds.get("max_replicas")) == (int(low), int(high or low)), \
                        f"{what}: {role} deployed as {overrides[role]}"
            print(f"{what}: {time.monotonic() - started:.1f} s")
            load.wait_done(len(load.results) + 4, 300)
    assert all(alive(pid) for pid in engines.values()), "an engine of the first replicas exited"
    failed = [r for r in load.results if r[3] is not None]
    assert failed == [], f"{len(failed)} failed requests, e.g. {failed[:3]}"
    assert [(p, t) for p, t, _, _ in load.results if t != want[p]] == []
