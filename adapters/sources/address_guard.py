"""SSRF guard: resolve a host ourselves, refuse it unless every address it resolves to may be
contacted, and hand back the checked address so the connection goes to exactly that one (a second
resolution could answer differently: DNS rebinding)."""
from __future__ import annotations

import ipaddress
import socket

from adapters.sources.errors import SourceError, refused
from adapters.sources.policy import SourcePolicy


def _normalised(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    ip = ipaddress.ip_address(text.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped  # ::ffff:127.0.0.1 is loopback
    return ip


def _forbidden(ip, policy: SourcePolicy) -> bool:
    if ip.is_multicast or ip.is_unspecified:
        return True  # never a file server
    if ip.is_link_local:
        return True  # cloud metadata (169.254.169.254, fe80::): refused even where private networks are allowed
    # not is_global: loopback, private (RFC 1918, ULA), link-local (cloud metadata), CGNAT, reserved ...
    return not ip.is_global and not policy.allow_private_networks


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
    addresses = [_normalised(info[4][0]) for info in infos]
    if not addresses:
        raise SourceError(502, f"adapter source host {name!r} has no address", "source_unreachable")
    bad = [str(ip) for ip in addresses if _forbidden(ip, policy)]
    if bad:
        raise refused(f"host {name!r} resolves to {bad[0]}, an address adapter sources may not use "
                      "(loopback, private or link-local; the operator can allow loopback and private networks, "
                      "never link-local)")
    return str(addresses[0])
