"""The admin console in a real headless Chromium (Debian's, driven by playwright): sign in with the
admin token, create a tenant, set a quota, issue a key and see it once, revoke it, watch an adapter
become resident after a request; a wrong token shows an error, not a blank page."""
from __future__ import annotations

import shutil

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
playwright_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed")
if CHROMIUM is None:
    pytest.skip("no Chromium installed (apt-get install chromium); scripts/test installs it when run as root",
                allow_module_level=True)

# What the environment probe found necessary on this closed network (no background connections).
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def page():
    with playwright_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        context = browser.new_context(viewport={"width": 1280, "height": 900})
        tab = context.new_page()
        tab.set_default_timeout(20_000)
        yield tab
        browser.close()


def test_console_runs_a_day_of_the_service(api_server, page, tiny_adapters, tmp_path):
    base = api_server.url
    page.goto(f"{base}/admin/ui")
    # A wrong token: an error on the sign-in card.
    page.fill("#token", "not-the-admin-token-at-all")
    page.click("#login-form button")
    page.wait_for_selector("#login-error:has-text('invalid admin token')")
    assert page.is_hidden("#app")
    # The right one: the engine view with its numbers.
    page.fill("#token", api_server.config.admin_token)
    page.click("#login-form button")
    page.wait_for_selector("#engine-stats .stat")
    assert "64" in page.inner_text("#engine-stats")  # KV blocks total

    # Create a tenant with a rate limit; it appears and opens.
    page.click("header nav button[data-tab=tenants]")
    page.fill("#new-name", "console-acme")
    page.fill("#new-rpm", "30")
    page.click("#create-form button")
    page.wait_for_selector("#detail-title:has-text('console-acme')")
    tenant = api_server.admin("GET", "/admin/tenants/console-acme").json()
    assert tenant["quota"]["requests_per_minute"] == 30

    # Edit a quota.
    page.fill("#quota-form input[name=max_adapters]", "3")
    page.click("#save-quota")
    page.wait_for_selector("#quota-saved:has-text('saved')")
    assert api_server.admin("GET", "/admin/tenants/console-acme").json()["quota"]["max_adapters"] == 3

    # Issue a key: shown once, and it works.
    page.click("#issue-key")
    page.wait_for_selector("#new-key:has-text('lp-')")
    key = page.inner_text("#new-key").split(": ")[-1].strip()
    assert api_server.client(key).models.list().data
    page.wait_for_selector("#key-rows tr")

    # The tenant uploads an adapter and uses it: the adapters tab shows it resident.
    assert api_server.upload(key, "console-ad", tiny_adapters["r4_qv"]).status_code == 201
    api_server.client(key).completions.create(model="console-ad", prompt="hi", max_tokens=2)
    page.click("header nav button[data-tab=adapters]")
    page.fill("#adapter-filter", "console-acme")
    page.wait_for_selector("#adapter-rows tr:has-text('console-ad') .badge.device")
    page.screenshot(path=str(tmp_path / "console-adapters.png"), full_page=True)

    # Revoke the key: it stops working.
    page.click("header nav button[data-tab=tenants]")
    page.fill("#tenant-filter", "console-acme")
    page.click("#tenant-rows tr[data-name=console-acme]")
    page.wait_for_selector("#key-rows tr button")
    page.click("#key-rows tr button")
    page.wait_for_selector("#key-rows tr", state="detached")
    with api_server.http(key) as h:
        assert h.get("/v1/models").status_code == 401
    page.click("header nav button[data-tab=engine]")
    page.wait_for_selector("#engine-stats .stat")
    shot = tmp_path / "console-engine.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 10_000
    print(f"console screenshots: {tmp_path}")


def test_console_pages_through_200_tenants_and_2000_adapters(api_server, page, tiny_adapters):
    """At the scale the console must stay usable: pages of 50 tenants and 100 adapters, with filters."""
    import time as _time

    from adapters.format import inspect_adapter_bytes

    state = api_server.state
    config_json = (tiny_adapters["r4_qv"] / "adapter_config.json").read_bytes()
    weights = (tiny_adapters["r4_qv"] / "adapter_model.safetensors").read_bytes()
    summary = inspect_adapter_bytes(config_json, weights, state.engine.engine.adapter_shape, state.config.max_lora_rank)
    for t in range(200):  # straight into the stores: the point here is the console, not uploads
        tenant = state.tenants.create(f"scale-{t:03d}")
        for a in range(10):
            state.registry.put(tenant.id, f"ad-{a}", config_json, weights, summary=summary)
    start = _time.monotonic()
    listed = api_server.admin("GET", "/admin/adapters", params={"tenant": "scale-", "limit": 100}).json()
    assert listed["total"] == 2000 and len(listed["data"]) == 100 and _time.monotonic() - start < 5
    page.goto(f"{api_server.url}/admin/ui")
    page.wait_for_selector("#engine-stats .stat")  # still signed in (session storage)
    page.click("header nav button[data-tab=tenants]")
    page.fill("#tenant-filter", "scale-")
    page.wait_for_selector("#tenant-count:has-text('200 tenants, page 1 of 4')")
    assert page.locator("#tenant-rows tr").count() == 50
    page.click("#tenant-next")
    page.wait_for_selector("#tenant-rows tr[data-name=scale-050]")
    page.click("header nav button[data-tab=adapters]")
    page.fill("#adapter-filter", "scale-1")
    page.wait_for_selector("#adapter-count:has-text('1000 adapters, page 1 of 10')")
    assert page.locator("#adapter-rows tr").count() == 100
