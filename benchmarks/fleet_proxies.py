"""What the fleet benchmarks share (kv_aware_routing.py, multi_turn.py): a `kvbridge proxy` of their
own in front of a LocalCluster's instances, started and waited for, and the CPU's name for the
figures. Imported with this folder on sys.path (as the benchmarks are run, and by `kvbridge bench`)."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from kvbridge.launcher import cluster


def start_proxy(name: str, urls: cluster.ClusterUrls, extra_args: Sequence[str], log_dir: Path,
                http: httpx.Client, timeout_s: float = 60.0) -> tuple[cluster.ChildProcess, str]:
    """A `kvbridge proxy` named `name` (its log file) in front of `urls`' instances, healthy; its URL."""
    port = cluster.free_ports(1)[0]
    argv = cluster.proxy_command(cluster.DEFAULT_CLI, urls.prefill, urls.decode, host="127.0.0.1", port=port,
                                 extra_args=list(extra_args))
    child = cluster.spawn_child(name, argv, cluster.child_env(os.environ, loopback_only=True, num_threads=1), log_dir)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if http.get(url + "/health", timeout=5).status_code == 200:
                return child, url
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline or not child.alive():
            cluster.stop_children([child], 5.0)
            raise RuntimeError(f"the proxy {name} did not start: {log_dir}")
        time.sleep(0.2)


def cpu_name() -> str:
    return next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name")), "unknown CPU")
