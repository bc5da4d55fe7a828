"""Pinning adapters on the device: --pin-adapter at start, PUT/DELETE /admin/tenants/{name}/adapters/{adapter}/pin,
bounded per tenant by --max-pinned-adapters-per-tenant (a 409 naming it), on a server whose adapter memory
is paged by rank (--lora-page-rows)."""
from __future__ import annotations

import pytest

from server.api.state import ServerState
from tests.fixtures_server import api_redis_url, running_server, server_config


@pytest.fixture(scope="module")
def pinned_server(tmp_path_factory, tiny_model_dir, tiny_adapters, redis_server):
    # In-process whatever the default: the tests read the engine's slots (pinned, slot_of, paging), which
    # no protocol message carries; the pin routes' HTTP behaviour is the same in an engine core.
    config = server_config(tiny_model_dir, tmp_path_factory.mktemp("pin-data"), api_redis_url(redis_server),
                           engine_process="in-process", lora_page_rows=8, max_pinned_adapters_per_tenant=1,
                           adapters=(("acme", "first", str(tiny_adapters["r8_all"])),),
                           pin_adapters=(("acme", "first"),))
    with running_server(config) as handle:
        yield handle


def _version(state: ServerState, name: str) -> str:
    tenant = state.tenants.get("acme")
    return state.registry.get(tenant.id, name).version


def test_pins_from_the_flag_and_the_admin_endpoint_within_the_tenant_bound(pinned_server, tiny_adapters):
    state = pinned_server.state
    slots = state.engine.engine.lora_slots
    assert slots.paging.paged and slots.paging.page_rows == 8
    assert _version(state, "first") in slots.pinned  # --pin-adapter acme/first
    r = pinned_server.admin("POST", "/admin/tenants/acme/keys")
    key = r.json()["key"]
    assert pinned_server.upload(key, "second", tiny_adapters["r4_qv"]).status_code == 201
    r = pinned_server.admin("PUT", "/admin/tenants/acme/adapters/second/pin")
    assert r.status_code == 409 and r.json()["error"]["param"] == "max_pinned_adapters_per_tenant"
    assert "max_pinned_adapters_per_tenant (1)" in r.json()["error"]["message"]
    r = pinned_server.admin("DELETE", "/admin/tenants/acme/adapters/first/pin")
    assert r.status_code == 200 and r.json()["was_pinned"] is True and r.json()["pinned"] is False
    r = pinned_server.admin("PUT", "/admin/tenants/acme/adapters/second/pin")
    assert r.status_code == 200 and r.json() == {"adapter": "second", "version": _version(state, "second"),
                                                 "pinned": True}
    assert set(slots.pinned) == {_version(state, "second")}
    assert pinned_server.admin("PUT", "/admin/tenants/acme/adapters/nope/pin").status_code == 404
    assert pinned_server.admin("PUT", "/admin/tenants/nobody/adapters/second/pin").status_code == 404
    out = pinned_server.client(key).completions.create(model="second", prompt="hello", max_tokens=3)
    assert out.choices[0].finish_reason == "length"
    assert _version(state, "second") in slots.slot_of  # served from its pages, and stays there
