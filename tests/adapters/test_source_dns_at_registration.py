"""DNS at registration (issue 43, build item 4's name form): an http source whose host *name* resolves
to a refused address (here: a name this machine's resolver answers with loopback, not the literal
`localhost` the admission already refuses by name) is refused when it is registered, lazy or not, by
every route, naming the name and the address; the fetch resolves it again and refuses it then too
(a name that answers differently later: DNS rebinding); the operator's allowance lets it through."""
from __future__ import annotations

import socket

import pytest

from adapters.sources import SourceError, SourcePolicy
from adapters.sources.address_guard import checked_address, refusal, resolved_refusal
from adapters.sources.address_guard import _parsed as parsed_address
from tests.fixtures_server import api_redis_url, running_server, server_config


def _loopback_name() -> str:
    """A host name (not localhost) the real resolver answers only with refused addresses."""
    policy = _policy()
    for name in (socket.gethostname(), "localhost.localdomain", "ip6-localhost"):
        if name in ("", "localhost") or name.endswith(".localhost"):
            continue
        try:
            infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
        except (socket.gaierror, UnicodeError):
            continue
        if infos and all(refusal(parsed_address(i[4][0]), policy) is not None for i in infos):
            return name
    pytest.skip("no host name here resolves to loopback or a private address")


def _policy(**kw) -> SourcePolicy:
    return SourcePolicy(kinds=frozenset({"http", "https"}), timeout_seconds=2.0, max_file_bytes=1 << 20, **kw)


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir, redis_server, core_starter):
    config = server_config(tiny_model_dir, tmp_path_factory.mktemp("dns-data"), api_redis_url(redis_server),
                           adapter_sources=("http", "https"), adapter_fetch_timeout=3.0)
    with running_server(config, starter=core_starter) as handle:
        yield handle


def test_a_name_resolving_to_loopback_is_refused_at_registration_by_every_route(server):
    name = _loopback_name()
    source = f"http://{name}:9/a/"
    tenant, token = server.new_tenant()
    base = server.state.model_id
    with server.http(token) as h:
        answers = [h.post("/v1/adapters", json={"name": "lazy", "source": source}),
                   h.post("/v1/load_lora_adapter", json={"lora_name": "lazy", "lora_path": source, "prefetch": False}),
                   h.post("/v1/completions", json={"model": base, "prompt": "x", "max_tokens": 1,
                                                   "adapter_id": source, "adapter_source": "url"})]
    for r in answers:
        assert r.status_code == 403, r.text
        error = r.json()["error"]
        assert error["code"] == "source_not_allowed"
        assert f"host {name!r} resolves to" in error["message"] and "may not use" in error["message"], error
    tenant_id = server.admin("GET", f"/admin/tenants/{tenant}").json()["id"]
    assert not server.state.references.list(tenant_id)


def test_the_fetch_resolves_again_and_the_operator_can_allow_it():
    name = _loopback_name()
    assert resolved_refusal(name, _policy()) is not None
    with pytest.raises(SourceError) as e:  # the fetch's own check, on a fresh answer
        checked_address(name, 80, _policy())
    assert e.value.status == 403 and repr(name) in e.value.message
    allowed = _policy(allow_private_networks=True)
    assert resolved_refusal(name, allowed) is None
    assert checked_address(name, 80, allowed)


def test_names_that_do_not_resolve_now_and_literals_are_left_to_the_fetch(monkeypatch):
    def no_answer(*a, **k):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
    monkeypatch.setattr(socket, "getaddrinfo", no_answer)
    assert resolved_refusal("files.example", _policy()) is None  # the fetch answers 502 then
    assert resolved_refusal("127.0.0.1", _policy()) is None  # literals: literal_refusal's job
