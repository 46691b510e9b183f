"""Helpers the end-to-end tests share: a server's Prometheus counters, the processes a server
spawned (from /proc), to check that none is left behind, and the sockets a process listens on."""

from __future__ import annotations

import ipaddress
import os
import re
import subprocess
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


def metric_total(url: str, name: str) -> float:
    """The sum of every sample of `name` on `url`/metrics, whatever its labels."""
    text = httpx.get(url + "/metrics", timeout=10, trust_env=False).text
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.M))


def assert_all_blocks_free(urls: list[str], timeout_s: float = 15.0) -> None:
    """Every block free on each instance (polled: releases land a moment after the answer), but those
    retained for a conversation's next turn (--kv-retention-seconds: held under a lease of bounded
    life that any request ends; tests/integration/test_kv_retention.py proves each way it ends)."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = {u: (metric(u, "kvbridge_kv_cache_free_blocks") + metric_total(u, "kvbridge_kv_retained_blocks"),
                     metric(u, "kvbridge_kv_cache_total_blocks")) for u in urls}
        if all(free == total for free, total in state.values()):
            return
        assert time.monotonic() < deadline, f"KV blocks still allocated (free, total): {state}"
        time.sleep(0.1)


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


def _address(hex_address: str) -> str:
    """An address of /proc/net/tcp{,6} (hex, each 32-bit word in host byte order) as text."""
    raw = bytes.fromhex(hex_address)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(words))


def listening(pid: int) -> set[tuple[str, int]]:
    """The (address, port) of every TCP socket process `pid` listens on."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    found = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # state LISTEN, the socket's inode
                address, port = fields[1].rsplit(":", 1)
                found.add((_address(address), int(port, 16)))
    return found


UP_READY_LINE = "Ctrl-C stops everything."  # `kvbridge up` prints it once every process is healthy


def wait_until_ready(launcher: subprocess.Popen, stdout: Path, stderr: Path, timeout_s: float = 300.0) -> str:
    deadline = time.monotonic() + timeout_s
    while UP_READY_LINE not in (text := stdout.read_text()):
        assert launcher.poll() is None, f"kvbridge up exited with {launcher.returncode}:\n{stderr.read_text()}"
        assert time.monotonic() < deadline, f"kvbridge up not ready in {timeout_s}s:\n{stderr.read_text()}"
        time.sleep(0.2)
    return text
