"""Clusters the end-to-end tests share.

Starting real processes is most of the e2e tests' time (a `kvbridge serve` of the default model
takes seconds of CPU to start), so a cluster several modules use as it is starts once per session:
`smollm2_pd` is `kvbridge up`'s cluster of the default model (LocalCluster: one P, one D and the
proxy, NIXL, one thread each, 320 blocks, a 512-token context), started when a test first asks for
it and stopped right after the last test of the session that uses it (pytest runs the tests in
the order of `session.items`; other shapes start and stop meanwhile, so few processes are alive
at once). A test must leave it working: one that kills or breaks a process starts its own (if a
test breaks it anyway, the next test that asks for it gets a new one).

After every test that used it, every block is back in its pool on P and D (checked per test, not
only when it stops), and no lease expired during the test (counted per test: a test that failed
does not fail the next ones).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvbridge.launcher.cluster import LocalCluster
from tests.e2e.processes import assert_all_blocks_free, metric
from tests.fleet import Fleets
from tests.last_users import last_users

MODEL = "SmolLM2-135M-Instruct"
SMOLLM2_PD_ARGS = ("--num-blocks", "320", "--max-model-len", "512", "--dtype", "float32")  # fp32: the fleets beside it compare to fp32 instances
SHARED = ("smollm2_pd", "fleets")  # the session fixtures below that stop after their last test


class SharedCluster:
    """A LocalCluster started on first `get()`; `close()` stops it (safe to call twice)."""

    def __init__(self, log_dir: Path, **options) -> None:
        self.log_dir, self.options = log_dir, options
        self.cluster: LocalCluster | None = None
        self.closed, self.restarts = False, 0

    def get(self) -> LocalCluster:
        assert not self.closed, "a shared cluster was asked for after its last test (see SHARED)"
        if self.cluster is not None and self.cluster.first_dead_child() is not None:
            # A test broke it (that test failed its own checks): a new one, so the next tests
            # do not fail for it. The old logs stay in their own folder.
            self.cluster.stop()
            self.cluster, self.restarts = None, self.restarts + 1
        if self.cluster is None:
            log_dir = self.log_dir / (f"restart-{self.restarts}" if self.restarts else "")
            cluster = LocalCluster(MODEL, port=0, log_dir=log_dir, **self.options)
            cluster.start()  # stops what it started if it fails
            self.cluster = cluster
        return self.cluster

    def close(self) -> None:
        self.closed = True
        if self.cluster is not None:
            self.cluster.stop()


@pytest.fixture(scope="session")
def smollm2_pd(tmp_path_factory):
    shared = SharedCluster(tmp_path_factory.mktemp("logs-smollm2-pd"), kv_backend="nixl", num_threads=1,
                           extra_serve_args=SMOLLM2_PD_ARGS)
    yield shared
    shared.close()


@pytest.fixture(scope="session")
def fleets(tmp_path_factory):
    """The session's fleets by spec (tests/fleet.py); the shared ones stop after the last test using this."""
    registry = Fleets(tmp_path_factory.mktemp("logs-fleets"))
    yield registry
    registry.close()


@pytest.fixture
def smollm2_pd_cluster(smollm2_pd):
    """The shared cluster, checked after the test: every block free on P and D, no lease expired."""
    cluster = smollm2_pd.get()
    instances = [*cluster.urls.prefill, *cluster.urls.decode]
    expired = [metric(u, "kvbridge_kv_expired_leases_total") for u in instances]  # this test's own only
    yield cluster
    assert_all_blocks_free(instances)
    assert [metric(u, "kvbridge_kv_expired_leases_total") for u in instances] == expired, "a lease expired"


def pytest_collection_finish(session: pytest.Session) -> None:
    """Note each shared cluster's last test, after which it stops."""
    session.config.stash[_LAST_USERS] = last_users(session.items, SHARED)


_LAST_USERS = pytest.StashKey[dict]()


@pytest.fixture(autouse=True)
def stop_shared_clusters_after_their_last_test(request):
    yield
    for name, nodeid in request.config.stash.get(_LAST_USERS, {}).items():
        if nodeid == request.node.nodeid and name in request.fixturenames:
            request.getfixturevalue(name).close()

