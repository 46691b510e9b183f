"""tests/ray: Ray must bind loopback only, in this process and in every process it starts (Ray
turns 127.0.0.1 into this host's routable address unless its single-machine mode is on, read when
ray is first imported: kvbridge/ray/app.py, start_local_ray)."""

import os

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# The machine's memory is shared with other work: Ray's own OOM killer, which judges the whole
# host's usage, would kill the replicas under test for memory others use.
os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")

# ---- the session's shared Ray cluster and colocated reference instance ---------------------------
# Starting a Ray cluster takes 10-20 s here and a colocated instance seconds more: the Ray modules
# share one of each (tests/ray/cluster.py: SharedRay, SharedColocated), started by the first test
# that asks and stopped right after the teardown of the last test of the session that uses it
# (pytest runs the tests in the order of `session.items`), module fixtures included: a module's
# application is removed before the cluster under it stops. test_up_ray.py's `kvbridge up --ray`
# starts a Ray of its own: `no_shared_ray` stops the shared one first, wherever the test runs (a
# later user starts a new one).

import pytest  # noqa: E402

from tests.last_users import last_users  # noqa: E402

SHARED = ("shared_ray", "shared_colocated")  # the session fixtures that stop after their last test
_open: dict[str, object] = {}  # name -> SharedRay / SharedColocated, once its fixture ran
_LAST_USERS = pytest.StashKey[dict]()


@pytest.fixture(scope="session")
def shared_ray():
    from tests.ray.cluster import SharedRay  # imports ray: only where a test needs it
    shared = _open["shared_ray"] = SharedRay()
    yield shared
    shared.close()


@pytest.fixture(scope="session")
def shared_colocated(tmp_path_factory):
    from tests.ray.cluster import SharedColocated
    shared = _open["shared_colocated"] = SharedColocated(tmp_path_factory.mktemp("colocated"))
    yield shared
    shared.close()


@pytest.fixture
def no_shared_ray():
    """No Ray runs in this process: the shared cluster, if up, stops (a later test restarts it)."""
    import ray
    shared = _open.get("shared_ray")
    if shared is not None:
        shared.stop()
    assert not ray.is_initialized(), "this process is still connected to a Ray cluster"


def pytest_collection_finish(session: pytest.Session) -> None:
    """Note each shared fixture's last test (item.fixturenames holds the fixtures it uses through
    others, its module's `deployed` among them)."""
    session.config.stash[_LAST_USERS] = last_users(session.items, SHARED)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    """After the last user's teardown (its module's fixtures finalized with it): stop the shared one."""
    try:
        return (yield)
    finally:
        for name, nodeid in item.config.stash.get(_LAST_USERS, {}).items():
            if nodeid == item.nodeid and name in _open:
                _open[name].close()
