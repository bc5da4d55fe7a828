"""A fuzz of hostile adapter references against the source layer, with canary file servers on
loopback that count every request they get: every spelling of a forbidden address, redirect chains
from an allowed host into forbidden ones, userinfo and fragment tricks, huge objects and slow drips.
The claim measured: 0 requests reach an endpoint the policy does not allow, every reference fails
with a SourceError, and an allowed host sees at most max_redirects + 1 requests per reference."""
from __future__ import annotations

import itertools

import pytest

from adapters.sources import SourceError, SourcePolicy, fetch_adapter, parse_reference
from adapters.sources.clients import SourceClients
from tests.source_servers import FileServer

pytestmark = pytest.mark.unit

CANARY_HOST = "127.0.0.2"  # loopback too, but not the allowed host name
MAX_REDIRECTS = 3


def _spellings(octets: tuple[int, int, int, int]) -> list[str]:
    """Ways to write one IPv4 address that resolvers accept."""
    a, b, c, d = octets
    n = (a << 24) | (b << 16) | (c << 8) | d
    return [f"{a}.{b}.{c}.{d}", f"{a}.{b}.{c}.{d}.", str(n), hex(n), f"0{a:o}.{b}.{c}.{d}",
            f"{a}.{(b << 16) | (c << 8) | d}", f"[::ffff:{a}.{b}.{c}.{d}]", f"[::ffff:{n >> 16:x}:{n & 0xffff:x}]"]


def _refused_everywhere(urls: list[str], policy: SourcePolicy) -> list[int]:
    clients = SourceClients()  # one TLS context for all, as a server has
    statuses = []
    for url in urls:
        try:
            ref = parse_reference(url)
        except SourceError as e:
            statuses.append(e.status)
            continue
        with pytest.raises(SourceError) as e:
            fetch_adapter(ref, policy, clients)
        statuses.append(e.value.status)
    return statuses


def test_forbidden_addresses_in_every_spelling_are_never_contacted():
    policy = SourcePolicy(kinds=frozenset({"http", "https"}), timeout_seconds=2.0, max_file_bytes=1 << 20)
    with FileServer() as canary:
        canary.files["/a/adapter_config.json"] = b"{}"
        hosts = [*_spellings((127, 0, 0, 1)), "localhost", "LOCALHOST.", "[::1]", "[0:0:0:0:0:0:0:1]", "0.0.0.0",
                 "0", "[::]", *_spellings((169, 254, 169, 254)), "[fe80::1]", "10.0.0.1", "192.168.1.1",
                 "172.16.0.1", "100.64.0.1", "224.0.0.1", "255.255.255.255"]
        paths = ["/a/", "/a.tar.gz", "/a.zip?x=1", "/a/#frag"]
        urls = [f"{scheme}://{host}:{port}{path}" for scheme, host, port, path in
                itertools.product(("http", "https"), hosts, (canary.port, 80), paths)]
        urls += [f"http://user:pw@{h}:{canary.port}/a/" for h in ("127.0.0.1", "localhost")]
        statuses = _refused_everywhere(urls, policy)
        assert len(urls) >= 300
        assert canary.requests == []
        assert set(statuses) <= {400, 403, 502}, sorted(set(statuses))


def test_redirects_from_an_allowed_host_into_forbidden_ones_stop_at_the_first_forbidden_hop():
    policy = SourcePolicy(kinds=frozenset({"http"}), http_hosts=frozenset({"127.0.0.1"}),
                          allow_private_networks=True, max_redirects=MAX_REDIRECTS, timeout_seconds=2.0,
                          max_file_bytes=1 << 20)
    with FileServer() as origin, FileServer(CANARY_HOST) as canary:
        canary.files["/x/adapter_config.json"] = b"{}"
        targets = [f"http://{h}:{canary.port}/x/adapter_config.json" for h in _spellings((127, 0, 0, 2))]
        targets += [f"//{CANARY_HOST}:{canary.port}/x/adapter_config.json",
                    f"http://127.0.0.1@{CANARY_HOST}:{canary.port}/x/adapter_config.json",
                    f"http://localhost:{canary.port}/x/adapter_config.json",
                    f"http://[::1]:{canary.port}/x/adapter_config.json",
                    "http://169.254.169.254/latest/meta-data/", f"https://{CANARY_HOST}:{canary.port}/x/",
                    "file:///etc/passwd", f"gopher://{CANARY_HOST}:{canary.port}/"]
        urls = []
        for i, target in enumerate(targets):
            for depth in range(MAX_REDIRECTS + 1):
                hops = [f"/c{i}-{depth}-{k}" for k in range(depth + 1)]
                for here, there in zip(hops, hops[1:]):
                    origin.redirects[f"{here}/adapter_config.json"] = f"{there}/adapter_config.json"
                origin.redirects[f"{hops[-1]}/adapter_config.json"] = target
                urls.append(f"{origin.url}{hops[0]}/")
        before = len(origin.requests)
        statuses = _refused_everywhere(urls, policy)
        assert canary.requests == []
        assert len(origin.requests) - before <= len(urls) * (MAX_REDIRECTS + 1)
        assert set(statuses) <= {400, 403, 502}, sorted(set(statuses))


def test_huge_objects_and_slow_drips_are_cut_off_within_the_bounds():
    policy = SourcePolicy(kinds=frozenset({"http"}), allow_private_networks=True, timeout_seconds=1.0,
                          max_file_bytes=1 << 16)
    with FileServer() as files:
        files.huge.add("/big.tar.gz")
        files.drip.add("/slow.tar.gz")
        with pytest.raises(SourceError) as e:
            fetch_adapter(parse_reference(f"{files.url}/big.tar.gz"), policy)
        assert e.value.status == 413
        with pytest.raises(SourceError) as e:
            fetch_adapter(parse_reference(f"{files.url}/slow.tar.gz"), policy)
        assert e.value.status == 504
