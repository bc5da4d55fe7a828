"""The admin console in a real headless Chromium (Debian's, driven by playwright), against a real server:
sign in with the admin token, create a tenant (an error stays on screen across refreshes until dismissed
or the next action), set a quota, issue a key and see it once, upload, replace and delete an adapter,
watch it become resident and its usage and the tenant's refusals charted from real traffic, revoke the
key and delete the tenant (each asked first), read the engine's charts (time axis, units, gaps), and the
same on a narrow window; a wrong token shows an error, not a blank page. Under the pages' CSP all
of that runs without a single violation, /docs renders offline, and script injected into the DOM (an
inline handler, a script element, markup) never runs: the browser blocks it and reports it."""
from __future__ import annotations

import re
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
        # Every CSP or Trusted Types violation of a document, as the browser reports it to the page.
        context.add_init_script("window.__violations = []; document.addEventListener('securitypolicyviolation',"
                                " e => window.__violations.push(e.effectiveDirective));")
        tab = context.new_page()
        tab.set_default_timeout(20_000)
        yield tab
        browser.close()


def _confirm(page, accept: bool) -> None:
    """Answer the console's confirmation dialog, which must be open and modal."""
    page.wait_for_selector("#confirm[open]")
    page.click("#confirm-ok" if accept else "#confirm-cancel")
    page.wait_for_selector("#confirm", state="hidden")


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
    assert "0 adapters, 0 keys" in page.inner_text("#detail-title")
    tenant = api_server.admin("GET", "/admin/tenants/console-acme").json()
    assert tenant["quota"]["requests_per_minute"] == 30

    # Creating it again fails, and the error stays across the 3-second refreshes until dismissed.
    page.fill("#new-name", "console-acme")
    page.click("#create-form button")
    page.wait_for_selector("#app-error:has-text(\"tenant 'console-acme' already exists\")")
    page.wait_for_timeout(3500)
    assert page.is_visible("#app-error") and "already exists" in page.inner_text("#app-error")
    page.screenshot(path=str(tmp_path / "console-error-kept.png"))
    page.click("#app-error-close")
    assert page.is_hidden("#app-error")
    # Another error is cleared by the next action instead.
    page.fill("#new-name", "Not A Valid Name")
    page.click("#create-form button")
    page.wait_for_selector("#app-error:visible")
    page.fill("#quota-form input[name=max_adapters]", "3")
    page.click("#save-quota")
    page.wait_for_selector("#quota-saved:has-text('saved')")
    assert page.is_hidden("#app-error")
    assert api_server.admin("GET", "/admin/tenants/console-acme").json()["quota"]["max_adapters"] == 3

    # Issue a key: shown once, and it works.
    page.click("#issue-key")
    page.wait_for_selector("#new-key:has-text('lp-')")
    key = page.inner_text("#new-key").split(": ")[-1].strip()
    assert api_server.client(key).models.list().data
    page.wait_for_selector("#key-rows tr[data-id]")

    # Upload an adapter for the tenant from the console; the table counts it (1 of a quota of 3).
    page.fill("#upload-name", "console-ad")
    page.set_input_files("#upload-config", str(tiny_adapters["r4_qv"] / "adapter_config.json"))
    page.set_input_files("#upload-weights", str(tiny_adapters["r4_qv"] / "adapter_model.safetensors"))
    page.click("#upload-form button[type=submit]")
    page.wait_for_selector("#upload-done:has-text('rank 4')")
    page.wait_for_selector("#tenant-adapter-rows tr[data-name=console-ad]")
    with api_server.http(key) as h:
        assert h.get("/v1/adapters/console-ad").json()["rank"] == 4
    page.fill("#tenant-filter", "console-acme")
    page.wait_for_selector("#tenant-rows tr[data-name=console-acme] td[data-col=adapters]:text-is('1')")
    assert page.locator("#tenant-rows tr[data-name=console-acme] td").nth(3).inner_text() == "3"
    page.click("#tenant-rows tr[data-name=console-acme]")
    page.wait_for_selector("#detail-title:has-text('1 adapter,')")

    # Real traffic: the adapter and the base model, and refusals (an unknown model, a bad request).
    c = api_server.client(key)
    c.completions.create(model="console-ad", prompt="hi", max_tokens=3, extra_body={"ignore_eos": True})
    c.completions.create(model=api_server.state.model_id, prompt="hi", max_tokens=2, extra_body={"ignore_eos": True})
    with api_server.http(key) as h:
        assert h.post("/v1/completions", json={"model": "nope", "prompt": "hi"}).status_code == 404
        assert h.post("/v1/completions", json={"model": "console-ad", "prompt": "hi", "max_tokens": -1}).status_code in (400, 422)
    usage = api_server.admin("GET", "/admin/tenants/console-acme/usage").json()["total"]["adapters"]
    tokens = usage["console-ad"]["prompt_tokens"] + usage["console-ad"]["completion_tokens"]
    # The charts show it at the next refresh: a bar per adapter for today, the refusals by reason.
    page.wait_for_selector(f"#chart-tenant-tokens rect.bar[data-series=console-ad][data-value='{tokens}']")
    page.wait_for_selector("#chart-tenant-refusals rect.bar[data-series=not_found][data-value='1']")
    page.wait_for_selector("#chart-tenant-refusals rect.bar[data-series=invalid_request][data-value='1']")
    assert page.locator("#chart-tenant-requests rect.bar").count() == 2  # console-ad and the base model today
    assert {"console-ad", api_server.state.model_id} <= set(
        page.locator("#chart-tenant-tokens text.legend").all_text_contents())
    assert page.locator("#chart-tenant-tokens text.tick.y").count() >= 3
    assert page.locator("#chart-tenant-tokens text.unit").text_content() == "tokens"
    assert page.locator("#adapter-usage-rows tr:has-text('console-ad') td").nth(1).inner_text() == "1"
    page.select_option("#usage-days", "30")
    page.wait_for_selector("#chart-tenant-tokens text.tick.x >> nth=4")  # a month of days on the axis
    page.locator("#tenant-detail").screenshot(path=str(tmp_path / "console-tenant-usage.png"))

    # The adapters tab shows it resident after that request.
    page.click("header nav button[data-tab=adapters]")
    page.fill("#adapter-filter", "console-acme")
    page.wait_for_selector("#adapter-rows tr:has-text('console-ad') .badge.device")
    page.screenshot(path=str(tmp_path / "console-adapters.png"), full_page=True)

    # Replace it (another rank), then delete it: asked first, and Cancel keeps it.
    page.click("header nav button[data-tab=tenants]")
    page.click("#tenant-rows tr[data-name=console-acme]")
    page.click("#tenant-adapter-rows tr[data-name=console-ad] button:has-text('Replace')")
    assert page.input_value("#upload-name") == "console-ad" and page.is_checked("#upload-replace")
    page.set_input_files("#upload-config", str(tiny_adapters["r8_all"] / "adapter_config.json"))
    page.set_input_files("#upload-weights", str(tiny_adapters["r8_all"] / "adapter_model.safetensors"))
    page.click("#upload-form button[type=submit]")
    page.wait_for_selector("#upload-done:has-text('rank 8')")
    with api_server.http(key) as h:
        assert h.get("/v1/adapters/console-ad").json()["rank"] == 8
    page.click("#tenant-adapter-rows tr[data-name=console-ad] button:has-text('Delete')")
    _confirm(page, accept=False)
    with api_server.http(key) as h:
        assert h.get("/v1/adapters/console-ad").status_code == 200
    page.click("#tenant-adapter-rows tr[data-name=console-ad] button:has-text('Delete')")
    _confirm(page, accept=True)
    page.wait_for_selector("#tenant-adapter-rows tr[data-name=console-ad]", state="detached")
    with api_server.http(key) as h:
        assert h.get("/v1/adapters/console-ad").status_code == 404

    # Revoke the key: asked first; Cancel keeps it working, OK stops it.
    page.click("#key-rows tr button")
    page.wait_for_selector("#confirm[open]")
    assert "Revoke key" in page.inner_text("#confirm-text")
    page.screenshot(path=str(tmp_path / "console-confirm-revoke.png"))
    _confirm(page, accept=False)
    with api_server.http(key) as h:
        assert h.get("/v1/models").status_code == 200
    assert page.locator("#key-rows tr[data-id]").count() == 1
    page.click("#key-rows tr button")
    _confirm(page, accept=True)
    page.wait_for_selector("#key-rows tr[data-id]", state="detached")
    page.wait_for_selector("#key-rows tr.empty")
    with api_server.http(key) as h:
        assert h.get("/v1/models").status_code == 401

    # Delete the tenant: asked first, then gone with everything it owned.
    page.click("#delete-tenant")
    _confirm(page, accept=False)
    assert api_server.admin("GET", "/admin/tenants/console-acme").status_code == 200
    page.click("#delete-tenant")
    _confirm(page, accept=True)
    page.wait_for_selector("#tenant-rows tr[data-name=console-acme]", state="detached")
    assert page.is_hidden("#tenant-detail")
    assert api_server.admin("GET", "/admin/tenants/console-acme").status_code == 404

    # The engine's charts: a time axis, y ticks with a unit, and an idle spell is a gap, not a line.
    _, key2 = api_server.new_tenant()
    c = api_server.client(key2)
    c.completions.create(model=api_server.state.model_id, prompt="hi", max_tokens=2)
    page.wait_for_timeout(4500)  # two samples (2 s apart) with no first token: no TTFT in them
    c.completions.create(model=api_server.state.model_id, prompt="hi", max_tokens=2)
    page.click("header nav button[data-tab=engine]")
    page.wait_for_selector("#engine-stats .stat")
    _until(page, "document.querySelectorAll('#chart-ttft .seg').length >= 2")
    for chart, unit in (("#chart-tps", "tokens/s"), ("#chart-ttft", "seconds"), ("#chart-queue", "requests")):
        assert page.locator(f"{chart} text.unit").text_content() == unit
        assert page.locator(f"{chart} text.tick.y").count() >= 3
        assert re.fullmatch(r"\d\d:\d\d", page.locator(f"{chart} text.tick.x").first.text_content()), chart
    assert page.evaluate("window.__violations") == []  # the whole console ran under its CSP
    shot = tmp_path / "console-engine.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 10_000

    # A narrow window: one column, nothing wider than the window, the charts drawn again at their new width.
    page.set_viewport_size({"width": 390, "height": 844})
    try:
        _until(page, "(() => { const s = document.getElementById('chart-tps');"
                     " return s.viewBox.baseVal.width === Math.round(s.clientWidth) && s.clientWidth < 390; })()")
        assert page.evaluate("document.documentElement.scrollWidth") <= 390
        page.screenshot(path=str(tmp_path / "console-narrow-engine.png"), full_page=True)
        page.click("header nav button[data-tab=tenants]")
        page.wait_for_selector("#tenant-count:has-text('tenant')")
        assert page.evaluate("document.documentElement.scrollWidth") <= 390  # the wide table scrolls in its box
        page.screenshot(path=str(tmp_path / "console-narrow-tenants.png"), full_page=True)
    finally:
        page.set_viewport_size({"width": 1280, "height": 900})

    # The favicon is served, not a 404.
    icon = page.request.get(f"{base}/favicon.ico")
    assert icon.status == 200 and icon.headers["content-type"] == "image/svg+xml"
    assert page.evaluate("window.__violations") == []
    print(f"console screenshots: {tmp_path}")


def test_console_pages_through_200_tenants_and_2000_adapters(api_server, page, tiny_adapters):
    """At the scale the console must stay usable: pages of 50 tenants and 100 adapters, with filters."""
    import time as _time

    from adapters.format import inspect_adapter_bytes

    state = api_server.state
    config_json = (tiny_adapters["r4_qv"] / "adapter_config.json").read_bytes()
    weights = (tiny_adapters["r4_qv"] / "adapter_model.safetensors").read_bytes()
    summary = inspect_adapter_bytes(config_json, weights, state.engine.info.adapter_shape,
                                    state.config.engine.lora.max_lora_rank)
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


@pytest.mark.parametrize("width", [1280, 520])
def test_refusals_legend_labels_every_reason_inside_the_chart(api_server, page, width):
    """Issue 42: with six or more reasons the legend overflowed the chart's left edge (3 of 6 unlabeled).
    Every reason is labelled, inside the chart, no label overlapping another."""
    from tenants.refusals import REASONS

    name = f"legend-{width}"
    api_server.admin("POST", "/admin/tenants", json={"name": name})
    tenant = api_server.state.tenants.get(name)
    for reason in REASONS:
        api_server.state.refusals.record(tenant, reason)
    page.set_viewport_size({"width": width, "height": 900})
    try:
        page.goto(f"{api_server.url}/admin/ui")
        page.wait_for_selector("#engine-stats .stat, #token:visible")
        if page.is_visible("#token"):  # run alone: the first test's session is not there
            page.fill("#token", api_server.config.admin_token)
            page.click("#login-form button")
            page.wait_for_selector("#engine-stats .stat")
        page.click("header nav button[data-tab=tenants]")
        page.fill("#tenant-filter", name)
        page.click(f"#tenant-rows tr[data-name={name}]")
        page.wait_for_selector(f"#detail-title:has-text('{name}')")
        page.wait_for_selector(f"#chart-tenant-refusals rect.bar[data-series={REASONS[-1]}]")
        boxes = page.evaluate("""() => {
            const svg = document.getElementById('chart-tenant-refusals'), s = svg.getBoundingClientRect();
            return {svg: [s.left, s.top, s.right, s.bottom], labels: [...svg.querySelectorAll('text.legend')].map(
                t => { const b = t.getBoundingClientRect(); return [t.textContent, b.left, b.top, b.right, b.bottom]; })};
        }""")
    finally:
        page.set_viewport_size({"width": 1280, "height": 900})
    labels = boxes["labels"]
    assert sorted(label[0] for label in labels) == sorted(REASONS)
    left, top, right, bottom = boxes["svg"]
    for text, x0, y0, x1, y1 in labels:
        assert left <= x0 and x1 <= right and top <= y0 and y1 <= bottom, (text, boxes)
    for i, a in enumerate(labels):
        for b in labels[i + 1:]:
            assert a[3] <= b[1] or b[3] <= a[1] or a[4] <= b[2] or b[4] <= a[2], (a, b)


def _until(page, condition: str, seconds: float = 20.0) -> None:
    """Polls `condition` with evaluate (DevTools, outside the page's CSP; wait_for_function would eval a
    string inside the page, which a policy without 'unsafe-eval' refuses)."""
    import time

    deadline = time.monotonic() + seconds
    while not page.evaluate(condition):
        assert time.monotonic() < deadline, f"never true: {condition}"
        page.wait_for_timeout(100)


def test_csp_blocks_and_reports_injected_script(api_server, page):
    page.goto(f"{api_server.url}/docs")  # the reference renders from this server alone, under its CSP
    page.wait_for_selector("details.op .path:has-text('/v1/completions')")
    assert page.evaluate("window.__violations") == []
    loaded = page.evaluate("performance.getEntriesByType('resource').map(e => e.name)")
    assert f"{api_server.url}/openapi.json" in loaded and all(u.startswith(api_server.url) for u in loaded)
    page.evaluate("token => sessionStorage.setItem('loraplex-admin-token', token)", api_server.config.admin_token)

    # Markup injected into the page as served (what a stored XSS would be), the server's real headers
    # kept: its inline script and inline handler are blocked by script-src and reported.
    injected = '<img src="/no-such-image" onerror="window.__pwned = 1"><script>window.__pwned = 2</script>'

    def inject(route):
        served = route.fetch()
        route.fulfill(response=served, body=served.text().replace("</body>", injected + "</body>"))

    page.route(f"{api_server.url}/admin/ui", inject)
    try:
        page.goto(f"{api_server.url}/admin/ui")
        page.wait_for_selector("#engine-stats .stat")  # the console itself runs (signed in: session storage)
        _until(page, "['script-src-attr', 'script-src-elem'].every(d => window.__violations.includes(d))")
    finally:
        page.unroute(f"{api_server.url}/admin/ui", inject)
    assert page.locator("img[onerror]").count() == 1 and page.evaluate("window.__pwned") is None
    # Script put into the DOM at run time (a handler attribute, a script element's text, markup): the
    # page's Trusted Types policy refuses each string before it reaches the DOM, and reports it.
    reported = page.evaluate("window.__violations.length")
    for attempt in ("""() => document.createElement("img").setAttribute("onerror", "window.__pwned = 3")""",
                    """() => { document.createElement("script").text = "window.__pwned = 4"; }""",
                    """() => document.body.insertAdjacentHTML("beforeend", '<img src=/x onerror="window.__pwned = 5">')"""):
        with pytest.raises(playwright_api.Error, match="requires 'Trusted(Script|HTML)' assignment"):
            page.evaluate(attempt)
    _until(page, f"window.__violations.length === {reported} + 3")
    assert page.evaluate("window.__violations").count("require-trusted-types-for") == 3
    assert page.evaluate("window.__pwned") is None
    # The page keeps working under the same policy.
    page.click("header nav button[data-tab=tenants]")
    page.wait_for_selector("#tenant-count:has-text('tenants')")
