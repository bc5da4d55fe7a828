"""What an address really reaches, and which special-purpose range it is in: the IANA IPv4 and IPv6
special-purpose address registries written out (Python's ipaddress tables lag them: 3.11 calls
192.0.0.8 global), and the IPv6 forms that carry an IPv4 address (mapped, compatible, NAT64, 6to4,
Teredo), unwrapped so the IPv4 inside is judged like a plain one."""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


@dataclass(frozen=True)
class SpecialRange:
    network: ipaddress.IPv4Network | ipaddress.IPv6Network
    name: str
    private: bool = False  # one the operator may allow (--adapter-sources on a private network)


def _ranges(*rows: tuple[str, str] | tuple[str, str, bool]) -> tuple[SpecialRange, ...]:
    return tuple(SpecialRange(ipaddress.ip_network(row[0]), *row[1:]) for row in rows)


# Most specific first: the first match names the range in a refusal.
SPECIAL_RANGES = _ranges(
    ("127.0.0.0/8", "loopback", True),
    ("10.0.0.0/8", "private-use (RFC 1918)", True),
    ("172.16.0.0/12", "private-use (RFC 1918)", True),
    ("192.168.0.0/16", "private-use (RFC 1918)", True),
    ("100.64.0.0/10", "shared address space (CGNAT)", True),
    ("0.0.0.0/8", "this network"),
    ("169.254.0.0/16", "link-local (cloud metadata)"),
    ("192.0.0.0/24", "IETF protocol assignments"),
    ("192.0.2.0/24", "documentation (TEST-NET-1)"),
    ("192.31.196.0/24", "AS112-v4"),
    ("192.52.193.0/24", "AMT"),
    ("192.88.99.0/24", "deprecated 6to4 relay anycast"),
    ("192.175.48.0/24", "direct delegation AS112 service"),
    ("198.18.0.0/15", "benchmarking"),
    ("198.51.100.0/24", "documentation (TEST-NET-2)"),
    ("203.0.113.0/24", "documentation (TEST-NET-3)"),
    ("224.0.0.0/4", "multicast"),
    ("255.255.255.255/32", "limited broadcast"),
    ("240.0.0.0/4", "reserved"),
    ("::1/128", "loopback", True),
    ("fc00::/7", "unique-local", True),
    ("::/128", "unspecified"),
    ("64:ff9b:1::/48", "local-use IPv4/IPv6 translation"),
    ("100::/64", "discard-only"),
    ("100:0:0:1::/64", "dummy prefix"),
    ("2001:db8::/32", "documentation"),
    ("2001::/23", "IETF protocol assignments"),
    ("2002::/16", "6to4"),
    ("2620:4f:8000::/48", "direct delegation AS112 service"),
    ("3fff::/20", "documentation"),
    ("5f00::/16", "segment routing (SRv6) SIDs"),
    ("fe80::/10", "link-local"),
    ("fec0::/10", "deprecated site-local"),
    ("ff00::/8", "multicast"),
    ("::/96", "IPv4-compatible (deprecated)"),
)

_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_COMPATIBLE = ipaddress.ip_network("::/96")
_TEREDO = ipaddress.ip_network("2001::/32")


def embedded_ipv4(ip: ipaddress.IPv6Address) -> list[ipaddress.IPv4Address]:
    """The IPv4 addresses an IPv6 one leads to (empty: none)."""
    if ip.ipv4_mapped is not None:
        return [ip.ipv4_mapped]
    if ip.sixtofour is not None:
        return [ip.sixtofour]
    if ip in _TEREDO and ip.teredo is not None:
        return list(ip.teredo)  # (server, client): both are contacted on the way
    if ip in _NAT64 or (ip in _COMPATIBLE and int(ip) > 1):
        return [ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)]
    return []


def special_range(ip: IPAddress) -> SpecialRange | None:
    """The special-purpose range `ip` is in (None: an ordinary global address). A non-global address
    the table misses is still caught, by ipaddress's own is_global."""
    for row in SPECIAL_RANGES:
        if ip.version == row.network.version and ip in row.network:
            return row
    if not ip.is_global:
        return SpecialRange(ipaddress.ip_network(ip), "not globally reachable (ipaddress.is_global)")
    return None
