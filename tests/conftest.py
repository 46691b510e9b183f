"""Suite-wide fixtures: thread settings, and the KV block leak check.

Every BlockPool created in this process is tracked; after each test, every live
pool must have all of its blocks free again (polled briefly, since engine threads
and leases release asynchronously). A test that leaves a block allocated fails.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("UCX_MODULES", "^ib")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import contextlib
import functools
import gc
import time
import weakref

from pathlib import Path

import pytest

from kvbridge.engine.block_pool import BlockPool

_live_pools: "weakref.WeakSet[BlockPool]" = weakref.WeakSet()
_original_init = BlockPool.__init__


def _tracking_init(self, *args, **kwargs):
    _original_init(self, *args, **kwargs)
    _live_pools.add(self)


BlockPool.__init__ = _tracking_init  # type: ignore[method-assign]

LEAK_WAIT_S = float(os.environ.get("KVBRIDGE_LEAK_WAIT_S", "10"))


def leaked_pools() -> list[str]:
    return [f"pool of {p.num_usable_blocks} blocks has {p.num_usable_blocks - p.num_free_blocks} allocated"
            for p in list(_live_pools) if p.num_free_blocks != p.num_usable_blocks]


def wait_all_blocks_free(timeout_s: float = LEAK_WAIT_S) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while True:
        leaks = leaked_pools()
        if not leaks or time.monotonic() > deadline:
            return leaks
        time.sleep(0.02)


@contextlib.contextmanager
def gguf_parsed_once(*readers):
    """While transformers loads from a GGUF file: each file is parsed once, and gguf's table of
    tensor names is built once per (architecture, layer count).

    transformers parses a file twice for a model (its config, then its tensors: about 5 s each for
    SmolLM2's 49k-token vocabulary) and builds the name table for every module it walks (about 400
    times, 4 s). Both are read-only, so this only memoises: the same config, tensors and tokenizer
    as without it. `readers`: gguf.GGUFReader objects already parsed (by the test's own code) to
    hand out for their files. kvbridge's loader imports GGUFReader itself and is not affected."""
    import gguf

    reader_cls, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    parsed = {os.path.realpath(r.data.filename): r for r in readers}

    def reader(path, mode="r"):
        key = os.path.realpath(path)
        if mode != "r":
            return reader_cls(path, mode)
        if key not in parsed:
            parsed[key] = reader_cls(path, mode)
        return parsed[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_cls, name_map


@pytest.fixture(scope="session", name="gguf_parsed_once")
def gguf_parsed_once_fixture():
    """`gguf_parsed_once` for test modules (`with gguf_parsed_once(reader): transformers...`)."""
    return gguf_parsed_once


@pytest.fixture(scope="session")
def hf_smollm2_from_gguf():
    """transformers' own model of the default GGUF (fp32, eval): the reference the loader and the
    engine are checked against. Loaded once per session (about 15 s)."""
    import torch
    import transformers

    from kvbridge.engine.loader import DEFAULT_MODEL, resolve_model
    path = resolve_model(DEFAULT_MODEL)
    with gguf_parsed_once():
        return transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                                 dtype=torch.float32).eval()


@pytest.fixture(autouse=True, scope="module")
def collect_garbage_after_each_module():
    """Engines (weights, KV cache: about a GB each) that tests drop are freed by the end of their
    module: some are in reference cycles that Python's cyclic collector, which counts objects
    rather than bytes, may not visit for a long time."""
    yield
    gc.collect()


MODULE_TIMES = os.environ.get("KVBRIDGE_MODULE_TIMES")  # a file: one JSON line per module, appended


@pytest.fixture(autouse=True, scope="module")
def module_cpu_and_wall(request):
    """With KVBRIDGE_MODULE_TIMES set: each module's wall time and the CPU time of this process and
    of the processes it reaped meanwhile (its fleets, Ray's), module and session fixtures it started
    included. A module whose wall far exceeds its CPU is waiting; one near a core's worth burns it."""
    if not MODULE_TIMES:
        yield
        return
    import json
    import resource

    def cpu() -> float:
        return sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                     resource.getrusage(resource.RUSAGE_CHILDREN)))

    wall0, cpu0 = time.monotonic(), cpu()
    yield
    line = {"module": request.node.nodeid, "wall_s": round(time.monotonic() - wall0, 2),
            "cpu_s": round(cpu() - cpu0, 2), "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
            "load1": round(os.getloadavg()[0], 2)}
    with open(MODULE_TIMES, "a") as f:
        f.write(json.dumps(line) + "\n")


@pytest.fixture(autouse=True)
def kv_block_leak_check(request):
    yield
    if request.node.get_closest_marker("allow_held_blocks"):
        return
    leaks = wait_all_blocks_free()
    assert not leaks, "KV blocks leaked after the test: " + "; ".join(leaks)


def pytest_configure(config):
    if os.environ.get("PYTEST_XDIST_WORKER", FLEET_WORKER) != FLEET_WORKER and not own_loopback():
        config.issue_config_time_warning(pytest.PytestWarning(
            "this lane shares the host's ports with the fleet lane (no network namespace: not root?)"), 2)
    config.addinivalue_line("markers", "allow_held_blocks: the test deliberately ends with blocks held")
    config.addinivalue_line("markers", "cluster: starts process fleets or Ray (tests/e2e, tests/ray)")
    config.addinivalue_line("markers", "model: loads the real default model (tests/integration, and the unit "
                                       "modules in MODEL_UNIT_MODULES)")


# The tiers (issue 45): `scripts/test.sh --fast` runs what is neither `cluster` nor `model`. A test's
# tier follows its folder; these unit modules load the real default model as well.
MODEL_UNIT_MODULES = frozenset({"test_attention_length_buckets", "test_linear_row_buckets", "test_loader",
                                "test_tokenizer", "test_tokenizer_threads", "test_vllm_peer_export"})
_TIER_BY_FOLDER = {"e2e": "cluster", "ray": "cluster", "integration": "model"}
# Ray's modules that start no Ray (policy arithmetic, pool membership on loopback, the CLI's checks)
QUICK_RAY_MODULES = frozenset({"test_cli_ray", "test_policy", "test_pool_membership"})


def pytest_collection_modifyitems(config, items):
    tests_root = Path(__file__).parent
    for item in items:
        try:
            parts = Path(str(item.fspath)).relative_to(tests_root).parts
        except ValueError:
            continue
        tier = _TIER_BY_FOLDER.get(parts[0]) if len(parts) > 1 else None
        if parts[0] == "ray" and Path(parts[-1]).stem in QUICK_RAY_MODULES:
            tier = None
        if tier is None and parts[0] == "unit" and Path(parts[-1]).stem in MODEL_UNIT_MODULES:
            tier = "model"
        if tier is not None:
            item.add_marker(getattr(pytest.mark, tier))


# The lanes: `scripts/test.sh` runs pytest-xdist workers, and whatever the `--dist` mode, tests go to
# the workers in units of `lane_group`: a unit runs on one worker, in collection order, and a worker
# gets its next unit when it is nearly done with the ones it has (xdist's LoadScopeScheduling; the
# biggest units first, FLEET_LANE before all, on FLEET_WORKER, whose lane alone stays on the host's
# network: own_loopback). Every test of tests/e2e and tests/ray is one unit, FLEET_LANE, so no two
# fleets or Ray clusters are up at once (their memory; the shared e2e and Ray clusters stop after their
# last user, who must run in the same process; `kvbridge up --ray` stops the shared Ray first; the netns hosts) and the fleet tests'
# timing is as it was in one process. Every other module is a unit of its own, so its module fixtures
# (engines on the real model) are built once, on one worker, and the type check's tests use their
# mypy cache folder one at a time. (Not xdist_group marks: xdist 3.8 sets them through a node id
# attribute pytest 9 no longer reads.)
FLEET_LANE = "fleets"
FLEET_WORKER = "gw0"  # the worker FLEET_LANE goes to; every other worker has a loopback of its own


def own_loopback() -> bool:
    """Move this process (its main thread, and so every thread and process it starts from now on) into
    a network namespace of its own with only its loopback, up. The fleet lane starts its servers on
    ports the OS reported free a moment before (free_ports), which they bind seconds later: a test
    of another lane binding port 0 meanwhile on the same loopback could take one. In a namespace of
    its own, a lane neither takes the fleet lane's ports nor sees its sockets. False where this
    process may not (not root)."""
    import ctypes
    import fcntl
    import socket
    import struct

    clone_newnet, siocgifflags, siocsifflags, iff_up = 0x40000000, 0x8913, 0x8914, 0x1
    if ctypes.CDLL(None, use_errno=True).unshare(clone_newnet) != 0:
        return False
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        flags = struct.unpack("16sH14x", fcntl.ioctl(s, siocgifflags, struct.pack("16sH14x", b"lo", 0)))[1]
        fcntl.ioctl(s, siocsifflags, struct.pack("16sH14x", b"lo", flags | iff_up))
    return True


def lane_group(nodeid: str) -> str:
    """The unit a test (by its node id, relative to the repository root) runs in."""
    path = Path(nodeid.split("::", 1)[0])
    parts = path.parts[1:] if path.parts[:1] == ("tests",) else path.parts
    if len(parts) > 1 and parts[0] in ("e2e", "ray"):
        return FLEET_LANE
    return str(path)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class LaneScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return lane_group(nodeid)

        def _assign_work_unit(self, node) -> None:
            if FLEET_LANE in self.workqueue:
                if node.gateway.id == FLEET_WORKER:  # the longest unit starts first, or it would be the tail
                    self.workqueue.move_to_end(FLEET_LANE, last=False)
                elif len(self.workqueue) > 1:
                    self.workqueue.move_to_end(FLEET_LANE)  # kept for FLEET_WORKER
            super()._assign_work_unit(node)

    return LaneScheduling(config, log)
