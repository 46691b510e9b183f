"""What a host string names: an IP address (`parse_ip`), or the unspecified address that binds
every interface but that no peer can be told (`is_unspecified`). The configuration checks its
addresses with these; kv_transfer/net.py and the handshake's trust check read addresses with
`parse_ip`."""

from __future__ import annotations

import ipaddress

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def parse_ip(host: str) -> IPAddress | None:
    """`host` as an address ("[::1]" too; an IPv4-mapped IPv6 address as its IPv4 one:
    ::ffff:127.0.0.1 is 127.0.0.1), or None for a name or garbage."""
    try:
        ip = ipaddress.ip_address(host.strip().strip("[]"))
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def is_unspecified(host: str) -> bool:
    """0.0.0.0 or :: (bind to every interface): not an address a peer can be told."""
    ip = parse_ip(host)
    return ip is not None and ip.is_unspecified
