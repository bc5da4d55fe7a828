"""A reference checked against the operator's policy when it is registered: a lazy reference the
policy would refuse at its first use is refused at once instead. An http(s) host name is resolved
now and refused if any address it resolves to is (loopback, private, special-purpose, IPv4 embedded
in IPv6); the fetch resolves it again and checks every answer each time it runs (a name that
answers differently later, DNS rebinding, is refused then), and connects to the address it checked."""
from __future__ import annotations

from urllib.parse import urlsplit

from adapters.sources.address_guard import literal_refusal, resolved_refusal
from adapters.sources.errors import SourceError, refused
from adapters.sources.local_fetch import resolve_local
from adapters.sources.policy import SourcePolicy
from adapters.sources.reference import SourceRef


def _check_http(ref: SourceRef, policy: SourcePolicy) -> None:
    host = (urlsplit(ref.location).hostname or "").rstrip(".")
    if policy.http_hosts and host not in policy.http_hosts:
        raise refused(f"host {host!r} is not among the allowed adapter source hosts")
    if (host == "localhost" or host.endswith(".localhost")) and not policy.allow_private_networks:
        raise refused(f"host {host!r} is loopback, an address adapter sources may not use")
    why = literal_refusal(host, policy)
    if why is not None:
        raise refused(f"host {host!r} is an address adapter sources may not use ({why})")
    why = resolved_refusal(host, policy)
    if why is not None:
        raise refused(why)


def admit_reference(ref: SourceRef, policy: SourcePolicy) -> None:
    """SourceError (403) when `policy` refuses `ref` whatever its source answers."""
    if not policy.allows(ref.kind):
        raise refused(f"{ref.kind} adapter sources are not allowed on this server (--adapter-sources)")
    if ref.kind in ("http", "https"):
        _check_http(ref, policy)
    elif ref.kind == "s3":
        if policy.s3_buckets and ref.bucket not in policy.s3_buckets:
            raise refused(f"bucket {ref.bucket!r} is not among the allowed adapter source buckets")
    else:
        try:
            resolve_local(ref.location, policy)
        except SourceError as e:
            if e.status != 404:  # a directory that appears before first use is fine
                raise
