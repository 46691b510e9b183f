"""Hosts on one machine for multi-host tests and benchmarks: network namespaces on a bridge.

`NetnsLan` makes one Linux bridge in the root namespace and, per host, a namespace with a
veth pair: one end inside the namespace (holding the host's address, which exists only
there), the other end enslaved to the bridge. The bridge itself holds the subnet's first
address, so a test in the root namespace reaches every host over the bridge, like a client
on the same LAN. Processes run inside a host with `ip netns exec` (`argv`).

Needs root, iproute2 (`ip`, `tc`) and util-linux's `nsenter`; `require_iproute2` fails loudly
otherwise: CI runs as root, so these tests never skip. Every `ip` command runs in the namespace
this module was imported in, whatever namespace the calling thread has entered. Names carry
this process's pid and a counter (interface names are at most 15 characters), and the subnet
is one no route of this machine overlaps, so parallel runs on one machine do not collide.
`close()` deletes every veth pair, namespace and the bridge; it is safe to call twice and
after a failed start.
"""

from __future__ import annotations

import ipaddress
import itertools
import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

_counter = itertools.count()
_HOME_NETNS_FD = os.open("/proc/thread-self/ns/net", os.O_RDONLY)  # kept open: `ip` runs there
_IP_TIMEOUT_S = 30.0  # a loaded 2-core CI machine


class NetnsError(RuntimeError):
    """An `ip` command failed; the message has its stderr."""


def require_iproute2() -> None:
    """Raise NetnsError unless `ip`, `tc` and `nsenter` exist and this process is root (CI: all true)."""
    if any(shutil.which(tool) is None for tool in ("ip", "tc", "nsenter")):
        raise NetnsError("iproute2 is missing: the multi-host tests need `ip`, `tc` and `nsenter` "
                         "(apt-get install iproute2 util-linux)")
    if os.geteuid() != 0:
        raise NetnsError("the multi-host tests make network namespaces and must run as root")


def ip(*args: str, netns: str | None = None, check: bool = True) -> str:
    """Run `ip [-n netns] args...`; its stdout. Raises NetnsError (with stderr) when it fails."""
    # Always in the namespace this module was imported in, whatever namespace the calling thread is in.
    argv = ["nsenter", f"--net=/proc/{os.getpid()}/fd/{_HOME_NETNS_FD}", "ip", *(["-n", netns] if netns else []), *args]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=_IP_TIMEOUT_S)
    if check and done.returncode != 0:
        raise NetnsError(f"{' '.join(argv)} failed: {done.stderr.strip()}")
    return done.stdout


@dataclass(frozen=True)
class Host:
    role: str  # "p", "d", "x": one letter, part of the interface names
    netns: str  # the namespace's name
    addr: str  # the host's address: exists only inside its namespace
    veth: str  # its interface, inside the namespace
    bridge_port: str  # the veth's other end, on the bridge in the root namespace

    def argv(self, command: list[str]) -> list[str]:
        """`command` run inside this host's namespace (ip netns exec: the same pid, exec'd)."""
        return ["ip", "netns", "exec", self.netns, *command]

    def rx_bytes(self) -> int:
        """Bytes this host's veth received (its bridge end's tx counter, read in the root namespace)."""
        return int(Path(f"/sys/class/net/{self.bridge_port}/statistics/tx_bytes").read_text())

    def tx_bytes(self) -> int:
        """Bytes this host's veth sent (its bridge end's rx counter)."""
        return int(Path(f"/sys/class/net/{self.bridge_port}/statistics/rx_bytes").read_text())

    def shape(self, rate: str) -> None:
        """Limit what this host sends to `rate` ("80mbit"): a token bucket (tc tbf) on its veth."""
        run = subprocess.run(self.argv(["tc", "qdisc", "replace", "dev", self.veth, "root", "tbf", "rate", rate,
                                        "burst", "64kb", "latency", "100ms"]),
                             capture_output=True, text=True, timeout=_IP_TIMEOUT_S)
        if run.returncode != 0:
            raise NetnsError(f"tc on {self.netns}: {run.stderr.strip()}")

    def unshape(self) -> None:
        """Remove shape()'s limit (nothing if none)."""
        subprocess.run(self.argv(["tc", "qdisc", "del", "dev", self.veth, "root"]), capture_output=True,
                       timeout=_IP_TIMEOUT_S)

    def set_link(self, up: bool) -> None:
        """Cut (or restore) this host's link: its veth inside the namespace goes down (or up)."""
        ip("link", "set", self.veth, "up" if up else "down", netns=self.netns)


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 in 10.200.0.0/13 that overlaps no route of the root namespace (nor another run's bridge)."""
    taken = []
    for route in json.loads(ip("-j", "route", "show", "table", "all") or "[]"):
        try:
            taken.append(ipaddress.ip_network(route.get("dst", ""), strict=False))
        except ValueError:
            continue  # "default", multicast names, ...
    start = (os.getpid() * 7) % 2048
    for k in range(2048):
        n = (start + k) % 2048
        net = ipaddress.IPv4Network(f"10.{200 + n // 256}.{n % 256}.0/24")
        if not any(net.overlaps(t) for t in taken if t.version == 4 and t.prefixlen > 0):
            return net
    raise NetnsError("no free /24 in 10.200.0.0/13")


class NetnsLan:
    """A bridge and one namespace per role. Use as a context manager (or start()/close())."""

    def __init__(self, roles: tuple[str, ...] = ("p", "d", "x")) -> None:
        if any(len(r) != 1 for r in roles) or len(set(roles)) != len(roles):
            raise ValueError("roles are distinct single letters")
        self.tag = f"kvb{os.getpid() % 10000:04d}{next(_counter) % 100:02d}"  # 9 chars
        self.bridge = f"{self.tag}br"
        self.subnet = _free_subnet()
        addrs = list(self.subnet.hosts())
        self.gateway = str(addrs[0])  # the bridge's own address, in the root namespace
        self.hosts = {r: Host(r, f"{self.tag}{r}", str(addrs[10 + i]), f"{self.tag}{r}", f"{self.tag}{r}b")
                      for i, r in enumerate(roles)}
        self._made_bridge = False
        self._made_netns: list[str] = []

    def __getitem__(self, role: str) -> Host:
        return self.hosts[role]

    def start(self) -> NetnsLan:
        require_iproute2()
        try:
            plen = str(self.subnet.prefixlen)
            ip("link", "add", self.bridge, "type", "bridge")
            self._made_bridge = True
            ip("addr", "add", f"{self.gateway}/{plen}", "dev", self.bridge)
            ip("link", "set", self.bridge, "up")
            for h in self.hosts.values():
                ip("netns", "add", h.netns)
                self._made_netns.append(h.netns)
                ip("link", "add", h.veth, "type", "veth", "peer", "name", h.bridge_port)
                ip("link", "set", h.veth, "netns", h.netns)
                ip("link", "set", h.bridge_port, "master", self.bridge, "up")
                ip("addr", "add", f"{h.addr}/{plen}", "dev", h.veth, netns=h.netns)
                ip("link", "set", h.veth, "up", netns=h.netns)
                ip("link", "set", "lo", "up", netns=h.netns)  # down in a new namespace
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Delete the namespaces (with their veth pairs) and the bridge. Processes must be stopped
        first: a namespace a process still runs in outlives `ip netns del`."""
        errors = []
        for netns in reversed(self._made_netns):
            host = next(h for h in self.hosts.values() if h.netns == netns)
            try:
                # The pair first: with the namespace alone its veth goes only once the kernel
                # has finished with the namespace, after `ip netns del` returned.
                ip("link", "del", host.bridge_port, check=False)
                ip("netns", "del", netns)
            except (NetnsError, subprocess.TimeoutExpired) as exc:
                errors.append(str(exc))
        self._made_netns = []
        if self._made_bridge:
            try:
                ip("link", "del", self.bridge)
                self._made_bridge = False
            except (NetnsError, subprocess.TimeoutExpired) as exc:
                errors.append(str(exc))
        if errors:
            raise NetnsError("; ".join(errors))

    def leftovers(self) -> list[str]:
        """Namespaces and links of this LAN that still exist (empty after close())."""
        names = set(ip("netns", "list").split())
        links = {link["ifname"] for link in json.loads(ip("-j", "link", "show") or "[]")}
        return sorted(n for n in (names | links) if n.startswith(self.tag))

    def __enter__(self) -> NetnsLan:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
