"""Which network interface carries an instance's KV traffic.

An instance binds its side channel (and the tcp backend's server) to one address; NIXL's
UCX must open its lanes on the interface owning that address, or it may pick another
interface (a management network, a NAT'd address) that the peer cannot reach.
`interface_of` names that interface; `apply_ucx_net_devices` sets `UCX_NET_DEVICES` to it in
an environment unless the user already did.

Linux only: IPv4 addresses come from the SIOCGIFADDR ioctl (each interface's primary
address; a secondary address added with `ip addr add` is not seen: set UCX_NET_DEVICES
yourself then), IPv6 ones from /proc/net/if_inet6.
"""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import socket
import struct
from collections.abc import MutableMapping

from kvbridge.shape.hosts import parse_ip

logger = logging.getLogger(__name__)

_SIOCGIFADDR = 0x8915  # from <linux/sockios.h>


def _ipv4_of(name: str) -> ipaddress.IPv4Address | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:  # no IPv4 address on it
            return None
    return ipaddress.IPv4Address(packed[20:24])


def _ipv6_owners() -> dict[ipaddress.IPv6Address, str]:
    try:
        lines = open("/proc/net/if_inet6", encoding="ascii").read().splitlines()
    except OSError:
        return {}
    return {ipaddress.IPv6Address(int(f[0], 16)): f[5] for f in (line.split() for line in lines) if len(f) == 6}


def interface_of(address: str) -> str | None:
    """The name of this host's (this network namespace's) interface holding `address`, or None.

    Any loopback address is "lo"'s; 0.0.0.0, ::, names and addresses no interface holds are None."""
    ip = parse_ip(address)
    if ip is None or ip.is_unspecified:
        return None
    if ip.is_loopback:
        return "lo"
    if isinstance(ip, ipaddress.IPv6Address):
        return _ipv6_owners().get(ip)
    return next((name for _, name in socket.if_nameindex() if _ipv4_of(name) == ip), None)


def apply_ucx_net_devices(env: MutableMapping[str, str], address: str) -> str | None:
    """Set env["UCX_NET_DEVICES"] to the interface of `address` unless it is set already.

    Returns the value now in effect (None: neither set nor derivable; UCX then uses every
    interface, which the NIXL backend warns about)."""
    if env.get("UCX_NET_DEVICES"):
        return env["UCX_NET_DEVICES"]
    device = interface_of(address)
    if device is None:
        logger.warning("no interface of this host holds %s: UCX_NET_DEVICES is left unset", address)
        return None
    env["UCX_NET_DEVICES"] = device
    logger.info("UCX_NET_DEVICES=%s (the interface of %s)", device, address)
    return device
