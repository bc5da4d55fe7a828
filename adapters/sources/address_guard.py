"""SSRF guard: resolve a host ourselves, refuse it unless every address it resolves to may be
contacted, and hand back the checked address so the connection goes to exactly that one (a second
resolution could answer differently: DNS rebinding)."""
from __future__ import annotations

import ipaddress
import socket

from adapters.sources.errors import SourceError, refused
from adapters.sources.policy import SourcePolicy
from adapters.sources.special_addresses import IPAddress, embedded_ipv4, special_range


def _parsed(text: str) -> IPAddress:
    ip = ipaddress.ip_address(text.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped  # ::ffff:127.0.0.1 is 127.0.0.1 on the wire
    return ip


def refusal(ip: IPAddress, policy: SourcePolicy) -> str | None:
    """Why `ip` may not be contacted (None: it may). An IPv6 address that carries an IPv4 one (NAT64,
    6to4, Teredo, IPv4-compatible) is judged by that IPv4 address first, then by its own range."""
    if isinstance(ip, ipaddress.IPv6Address):
        for inner in embedded_ipv4(ip):
            why = refusal(inner, policy)
            if why is not None:
                return f"it embeds {inner}: {why}"
    row = special_range(ip)
    if row is None or (row.private and policy.allow_private_networks):
        return None
    hint = "; the operator can allow loopback and private networks" if row.private else ""
    return f"{row.network} is {row.name}{hint}"


def checked_address(host: str, port: int, policy: SourcePolicy) -> str:
    """The address to connect to for `host`; SourceError if the host or any of its addresses is not
    allowed. Blocking (DNS): call it off the event loop."""
    name = host.lower().rstrip(".")
    if policy.http_hosts and name not in policy.http_hosts:
        raise refused(f"host {name!r} is not among the allowed adapter source hosts")
    try:
        infos = socket.getaddrinfo(name, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise SourceError(502, f"cannot resolve adapter source host {name!r}: {e}", "source_unreachable") from None
    addresses = [_parsed(info[4][0]) for info in infos]
    if not addresses:
        raise SourceError(502, f"adapter source host {name!r} has no address", "source_unreachable")
    why = _addresses_refusal(name, addresses, policy)
    if why is not None:
        raise refused(why)
    return str(addresses[0])


def _addresses_refusal(name: str, addresses: list[IPAddress], policy: SourcePolicy) -> str | None:
    for ip in addresses:
        why = refusal(ip, policy)
        if why is not None:
            return f"host {name!r} resolves to {ip}, an address adapter sources may not use ({why})"
    return None


def resolved_refusal(host: str, policy: SourcePolicy) -> str | None:
    """Why a host name, as DNS answers now, may not be contacted (None: allowed, a literal address, or
    no answer now: the fetch resolves it again and refuses then). Blocking (DNS): off the event loop."""
    name = host.lower().rstrip(".")
    if not name or _is_literal(name):
        return None
    try:
        infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return None
    return _addresses_refusal(name, [_parsed(info[4][0]) for info in infos], policy)


def _is_literal(host: str) -> bool:
    try:
        _parsed(host)
    except ValueError:
        return False
    return True


def literal_refusal(host: str, policy: SourcePolicy) -> str | None:
    """Why a host written as an IP address may not be contacted (None: allowed, or not a literal);
    no DNS, so it can run at registration."""
    try:
        ip = _parsed(host)
    except ValueError:
        return None
    return refusal(ip, policy)
