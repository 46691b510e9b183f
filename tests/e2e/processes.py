"""Helpers the end-to-end tests share: a server's Prometheus counters, and the processes a
server spawned (from /proc), to check that none is left behind."""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx


def metric(url: str, name: str, **labels: str) -> float:
    """The value of the sample `name` on `url`/metrics: unlabelled, or with exactly `labels`."""
    sample = name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else "")
    m = re.search(rf"^{re.escape(sample)} ([0-9.e+]+)$",
                  httpx.get(url + "/metrics", timeout=10, trust_env=False).text, re.M)
    assert m, f"{sample} missing from {url}/metrics"
    return float(m.group(1))


def children(pid: int) -> list[int]:
    """Every descendant process of pid."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = [], [pid]
    while frontier:
        kids = [c for c, p in parents.items() if p == frontier[-1]]
        frontier.pop()
        found += kids
        frontier += kids
    return found


def rank_pids(pid: int) -> list[int]:
    """The TP rank processes (torch.multiprocessing spawn) among pid's descendants."""
    found = []
    for child in children(pid):
        try:
            if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                found.append(child)
        except OSError:
            continue
    return found


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def gone(pids: list[int], timeout_s: float = 30.0) -> list[int]:
    """Wait until none of pids is alive (multiprocessing's resource tracker exits a moment after
    its parent); returns those still alive at the deadline."""
    deadline = time.monotonic() + timeout_s
    while (left := [pid for pid in pids if alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left
