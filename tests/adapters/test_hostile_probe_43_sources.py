"""Issue 43's hostile probe, its source findings, against the real server: the SSRF forms that
carry an IPv4 address inside an IPv6 one and the special-purpose ranges (finding 4), S3 keys with
dot segments (4), malformed URLs as 400s naming the field (5), and references checked against the
operator's policy when registered and counted with uploads (7)."""
from __future__ import annotations

import socket
import threading

import pytest

from adapters.sources import SourceError, SourcePolicy, fetch_adapter, parse_reference
from adapters.sources.address_guard import checked_address
from tests.fixtures_server import api_redis_url, running_server, server_config
from tests.source_servers import FileServer

BUCKET = "adapters"
# Each carries 127.0.0.1 (or 10.0.0.1) inside an IPv6 address.
EMBEDDED = {"nat64": "64:ff9b::7f00:1", "nat64-local": "64:ff9b:1::a00:1", "6to4": "2002:7f00:1::1",
            "compatible": "::7f00:1", "mapped": "::ffff:7f00:1", "teredo": "2001:0:4136:e378:8000:63bf:80ff:fffe"}
SPECIAL_V4 = ["192.0.0.8", "192.0.0.170", "192.0.2.1", "198.18.0.1", "198.51.100.1", "203.0.113.1", "240.0.0.1",
              "192.88.99.1", "0.1.2.3"]


@pytest.fixture(scope="module")
def canary():
    with FileServer() as server:
        server.files["/a/adapter_config.json"] = b"{}"
        yield server


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir, tiny_adapters, redis_server, core_starter):
    root = tmp_path_factory.mktemp("probe43-root")
    for name, d in tiny_adapters.items():
        (root / name).mkdir()
        for f in ("adapter_config.json", "adapter_model.safetensors"):
            (root / name / f).write_bytes((d / f).read_bytes())
    config = server_config(
        tiny_model_dir, tmp_path_factory.mktemp("probe43-data"), api_redis_url(redis_server),
        adapter_sources=("s3", "http", "https", "local"), adapter_local_root=str(root),
        adapter_s3_endpoint="http://127.0.0.1:9", adapter_s3_buckets=(BUCKET,), adapter_fetch_timeout=3.0)
    with running_server(config, starter=core_starter) as handle:
        yield handle


def _policy(**kw) -> SourcePolicy:
    return SourcePolicy(kinds=frozenset({"http", "https"}), timeout_seconds=2.0, max_file_bytes=1 << 20, **kw)


@pytest.mark.parametrize("form", sorted(EMBEDDED))
def test_ipv4_embedded_in_ipv6_is_refused_before_a_connect(form, canary):
    # finding 4: http://[64:ff9b::7f00:1]/ reached a connect
    with pytest.raises(SourceError) as e:
        fetch_adapter(parse_reference(f"http://[{EMBEDDED[form]}]:{canary.port}/a/"), _policy())
    assert e.value.status == 403, e.value.message
    assert canary.requests == []


def test_a_name_that_resolves_to_an_embedded_or_special_address_is_refused(monkeypatch):
    answers = [*EMBEDDED.values(), *SPECIAL_V4]
    for address in answers:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        monkeypatch.setattr(socket, "getaddrinfo", lambda *a, _ip=address, _f=family, **k: [
            (_f, socket.SOCK_STREAM, 6, "", (_ip, 80))])
        with pytest.raises(SourceError) as e:
            checked_address("files.example", 80, _policy())
        assert e.value.status == 403 and (address in e.value.message or "127.0.0.0/8" in e.value.message), address
    # A public address in NAT64's well-known prefix is a real IPv6-only network's way out: allowed.
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: [
        (socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("64:ff9b::808:808", 80, 0, 0))])
    assert checked_address("files.example", 80, _policy()) == "64:ff9b::808:808"


@pytest.mark.parametrize("address", SPECIAL_V4)
def test_special_purpose_ipv4_is_refused_and_the_refusal_names_the_range(address):
    with pytest.raises(SourceError) as e:
        checked_address(address, 80, _policy(allow_private_networks=True))
    assert e.value.status == 403
    assert "/" in e.value.message.split("(", 1)[1], e.value.message  # the range, e.g. 192.0.0.0/24


def test_the_operator_can_still_allow_loopback_and_private_networks():
    assert checked_address("127.0.0.1", 80, _policy(allow_private_networks=True)) == "127.0.0.1"
    with pytest.raises(SourceError) as e:
        checked_address("127.0.0.1", 80, _policy())
    assert "127.0.0.0/8 is loopback" in e.value.message


@pytest.mark.parametrize("key", ["a/../b", "a/./b", "../b", "a//b", "a/%2e%2e/b", "a/b/..", "a/b/../x.zip"])
def test_s3_keys_with_dot_or_empty_segments_are_refused(server, key):
    _, token = server.new_tenant()
    with server.http(token) as h:
        r = h.post("/v1/adapters", json={"name": "dots", "source": f"s3://{BUCKET}/{key}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "source", r.text
    with pytest.raises(SourceError) as e:
        parse_reference(f"s3://{BUCKET}/{key}")
    assert e.value.status == 400


@pytest.mark.parametrize("source", ["http://[::1/", "s3://[::1/x", "https://[64:ff9b::1/a/", "http://h:99999/a/",
                                    "http://h:port/a/"])
def test_malformed_urls_are_400s_naming_the_field(server, source):
    # finding 5: an uncaught ValueError from urlsplit was a 500
    _, token = server.new_tenant()
    base = server.state.model_id
    with server.http(token) as h:
        cases = [(h.post("/v1/load_lora_adapter", json={"lora_name": "m", "lora_path": source}), "lora_path"),
                 (h.post("/v1/adapters", json={"name": "m", "source": source}), "source"),
                 (h.post("/v1/completions", json={"model": base, "prompt": "x", "max_tokens": 1,
                                                  "adapter_id": source, "adapter_source": "url"}), "adapter_id")]
    for r, param in cases:
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param, r.text


def _reference_count(server, name: str) -> int:
    tenant_id = server.admin("GET", f"/admin/tenants/{name}").json()["id"]
    return len(server.state.references.list(tenant_id))


@pytest.mark.parametrize("source", ["http://127.0.0.1:9/a/", "http://localhost/a/", "http://[fe80::1]/a/",
                                    "http://2130706433/a/", "http://0x7f.1/a/", "s3://other-bucket/a", "/etc",
                                    *(f"http://[{a}]/a/" for a in EMBEDDED.values()),
                                    *(f"http://{a}/a/" for a in SPECIAL_V4)])
def test_a_lazy_reference_the_policy_refuses_is_refused_at_registration(server, source):
    # finding 7: it was a 201, failing only on use
    name, token = server.new_tenant()
    with server.http(token) as h:
        lazy = h.post("/v1/adapters", json={"name": "lazy", "source": source})
        vllm = h.post("/v1/load_lora_adapter", json={"lora_name": "lazy", "lora_path": source, "prefetch": False})
    for r in (lazy, vllm):
        assert r.status_code == 403, r.text
        assert r.json()["error"]["code"] == "source_not_allowed"
    assert _reference_count(server, name) == 0


def test_refused_lorax_references_are_never_registered_nor_counted(server):
    name, token = server.new_tenant(quota={"max_adapters": 1})
    base = server.state.model_id
    with server.http(token) as h:
        def lorax(adapter_id: str, adapter_source: str):
            return h.post("/v1/completions", json={"model": base, "prompt": "x", "max_tokens": 1,
                                                   "adapter_id": adapter_id, "adapter_source": adapter_source})
        assert lorax("http://[64:ff9b::7f00:1]/a/", "url").status_code == 403
        assert lorax("other-bucket/a", "s3").status_code == 403
        failed = lorax(f"{BUCKET}/missing", "s3")  # allowed, but the store is unreachable
        assert failed.status_code in (502, 504), failed.text
        assert _reference_count(server, name) == 0
        # The one place under max_adapters is still free.
        assert h.post("/v1/adapters", json={"name": "one", "source": "r4_qv"}).status_code == 201


def test_uploads_count_lazy_references_toward_max_adapters(server, tiny_adapters):
    _, token = server.new_tenant(quota={"max_adapters": 1})
    with server.http(token) as h:
        assert h.post("/v1/adapters", json={"name": "lazy", "source": "r4_qv"}).status_code == 201
    refused = server.upload(token, "uploaded", tiny_adapters["r8_all"])
    assert refused.status_code == 403 and "max_adapters" in refused.text, refused.text
    assert server.upload(token, "lazy", tiny_adapters["r8_all"], replace=True).status_code == 201


def test_concurrent_registrations_cannot_pass_max_adapters(server, tiny_adapters):
    # Each registration's room check and its write were separate Redis calls: a burst of lazy
    # references (no bytes to send) all saw room and all stayed, far past max_adapters.
    name, token = server.new_tenant(quota={"max_adapters": 2})
    statuses: list[int] = []

    def register(i: int) -> None:
        with server.http(token) as h:
            statuses.append(h.post("/v1/adapters", json={"name": f"burst{i}", "source": "r4_qv"}).status_code)

    threads = [threading.Thread(target=register, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(statuses) == [201, 201] + [403] * 10, statuses
    assert _reference_count(server, name) == 2
    # An upload racing nothing still sees the references: no room.
    refused = server.upload(token, "uploaded", tiny_adapters["r8_all"])
    assert refused.status_code == 403 and "max_adapters" in refused.text, refused.text
