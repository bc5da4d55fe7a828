"use strict";
// The console: the admin API of this server, no framework and no external assets (air-gapped sites).
// The admin token lives in this tab's sessionStorage: gone when the tab closes, never sent by the browser
// on its own (so no cross-site request can use it, unlike a cookie), and readable only by script of
// this origin, which the page's CSP limits to this server's own files (no inline script or handler,
// Trusted Types for DOM sinks; server.api.security_headers).
const KEY = "loraplex-admin-token";
const QUOTA_FIELDS = ["requests_per_minute", "tokens_per_minute", "max_concurrent_requests", "max_adapters",
                      "max_adapter_bytes", "max_lora_rank", "max_tokens_per_request", "weight"];
const PAGE = 50;
const state = {tenants: [], tenantPage: 0, adapterPage: 0, selected: null, timer: null};
const $ = id => document.getElementById(id);

class ApiError extends Error { constructor(status, message) { super(message); this.status = status; } }

async function api(method, path, body) {
  const headers = {"Authorization": `Bearer ${sessionStorage.getItem(KEY) || ""}`};
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const r = await fetch(path, {method, headers, body: body === undefined ? undefined : JSON.stringify(body)});
  const data = await r.json().catch(() => ({}));
  if (!r.ok) throw new ApiError(r.status, (data.error && data.error.message) || `HTTP ${r.status}`);
  return data;
}

function cell(text) { const td = document.createElement("td"); td.textContent = text; return td; }
function fmt(v) { return v === null || v === undefined ? "unlimited" : String(v); }
function when(t) { return t ? new Date(t * 1000).toLocaleString() : "never"; }
function bytes(n) { return n === null || n === undefined ? "-" : n < 1048576 ? `${(n / 1024).toFixed(1)} KiB` : `${(n / 1048576).toFixed(1)} MiB`; }
function showError(e) {
  if (e instanceof ApiError && e.status === 401) { signOut("the admin token was refused: " + e.message); return; }
  $("app-error").textContent = e.message;
}

function chart(svg, series) {
  // series: [{values: [...], color}], drawn as polylines over a shared scale.
  const w = svg.clientWidth || 600, h = svg.clientHeight || 120;
  const all = series.flatMap(s => s.values.filter(v => v !== null));
  const top = Math.max(0, ...all);
  const max = top > 0 ? top : 1;
  svg.setAttribute("viewBox", `0 0 ${w} ${h}`);
  svg.replaceChildren();
  for (const s of series) {
    const n = s.values.length;
    const pts = s.values.map((v, i) => v === null ? null :
      `${(n < 2 ? w : i * w / (n - 1)).toFixed(1)},${(h - 14 - (v / max) * (h - 24)).toFixed(1)}`).filter(Boolean);
    const line = document.createElementNS("http://www.w3.org/2000/svg", "polyline");
    line.setAttribute("points", pts.join(" "));
    line.setAttribute("fill", "none"); line.setAttribute("stroke", s.color); line.setAttribute("stroke-width", "2");
    svg.append(line);
    if (pts.length === 1) {  // one sample is a dot, not an invisible line
      const [x, y] = pts[0].split(",");
      const dot = document.createElementNS("http://www.w3.org/2000/svg", "circle");
      dot.setAttribute("cx", Math.min(Number(x), w - 4)); dot.setAttribute("cy", y); dot.setAttribute("r", "3");
      dot.setAttribute("fill", s.color);
      svg.append(dot);
    }
  }
  const label = document.createElementNS("http://www.w3.org/2000/svg", "text");
  label.setAttribute("x", "6"); label.setAttribute("y", "12"); label.setAttribute("font-size", "11");
  label.textContent = all.length ? `max ${top.toPrecision(3)}, last ${Math.round(series[0].values.length * 2 / 60)} min`
                                 : "no data yet";
  svg.append(label);
}

async function refreshEngine() {
  const e = await api("GET", "/admin/engine");
  const stats = [["running", e.running], ["waiting", e.waiting], ["KV blocks", `${e.kv_blocks.used} / ${e.kv_blocks.total} (${e.kv_cache.dtype})`],
                 ["adapter slots", `${e.slots.used} / ${e.slots.total}`], ["host adapters", e.host.adapters],
                 ["host bytes", `${bytes(e.host.bytes)} / ${bytes(e.host.budget_bytes)}`],
                 ["loads in flight", e.host.loads_in_flight], ["preemptions", e.preemptions],
                 ["prefix cache hit rate", e.prefix_cache.enabled ? (e.prefix_cache.hit_rate === null ? "no lookups yet"
                   : `${(100 * e.prefix_cache.hit_rate).toFixed(1)}%`) : "off"],
                 ["engine", e.healthy ? "healthy" : `down: ${e.error}`]];
  const box = $("engine-stats");
  box.replaceChildren();
  for (const [name, value] of stats) {
    const d = document.createElement("div"); d.className = "stat";
    const b = document.createElement("b"); b.textContent = value;
    const s = document.createElement("span"); s.textContent = name;
    d.append(b, s); box.append(d);
  }
  chart($("chart-tps"), [{values: e.history.map(p => p.tokens_per_s), color: "#2f7dd1"}]);
  chart($("chart-ttft"), [{values: e.history.map(p => p.ttft_p50_s), color: "#2f9e5b"}]);
  chart($("chart-queue"), [{values: e.history.map(p => p.running), color: "#2f7dd1"},
                           {values: e.history.map(p => p.waiting), color: "#c98a16"}]);
}

async function loadTenants() {
  state.tenants = (await api("GET", "/admin/tenants")).data;
  renderTenants();
}

function visibleTenants() {
  const f = $("tenant-filter").value.trim();
  return state.tenants.filter(t => !f || t.name.includes(f));
}

async function renderTenants() {
  const list = visibleTenants();
  const pages = Math.max(1, Math.ceil(list.length / PAGE));
  state.tenantPage = Math.min(state.tenantPage, pages - 1);
  const page = list.slice(state.tenantPage * PAGE, (state.tenantPage + 1) * PAGE);
  $("tenant-count").textContent = `${list.length} tenants, page ${state.tenantPage + 1} of ${pages}`;
  const rows = $("tenant-rows");
  rows.replaceChildren();
  for (const t of page) {
    const tr = document.createElement("tr"); tr.className = "pick"; tr.dataset.name = t.name;
    const q = t.quota;
    tr.append(cell(t.name), cell(t.id), cell(fmt(q.requests_per_minute)), cell(fmt(q.tokens_per_minute)),
              cell(fmt(q.max_concurrent_requests)), cell(fmt(q.max_adapters)), cell(q.weight), cell("…"), cell("…"));
    tr.addEventListener("click", () => selectTenant(t.name));
    rows.append(tr);
  }
  // Today's usage, per visible row only: bounded work however many tenants there are.
  await Promise.all(page.map(async t => {
    const u = await api("GET", `/admin/tenants/${encodeURIComponent(t.name)}/usage`).catch(() => null);
    const tr = rows.querySelector(`tr[data-name="${CSS.escape(t.name)}"]`);
    if (u && tr) {
      tr.children[7].textContent = u.total.requests;
      tr.children[8].textContent = u.total.prompt_tokens + u.total.completion_tokens;
    }
  }));
}

async function selectTenant(name) {
  state.selected = name;
  const t = await api("GET", `/admin/tenants/${encodeURIComponent(name)}`);
  $("tenant-detail").hidden = false;
  $("detail-title").textContent = `${t.name} (${t.id}), ${t.adapters} adapters`;
  $("new-key").hidden = true;
  $("quota-saved").textContent = "";
  const form = $("quota-form");
  form.replaceChildren();
  for (const f of QUOTA_FIELDS) {
    const label = document.createElement("label");
    label.textContent = f + " ";
    const input = document.createElement("input");
    input.name = f; input.type = "number"; input.step = "any";
    input.placeholder = f === "weight" ? "1" : "unlimited";
    input.value = t.quota[f] === null || t.quota[f] === undefined ? "" : t.quota[f];
    label.append(input); form.append(label);
  }
  await renderKeys();
}

async function renderKeys() {
  const keys = (await api("GET", `/admin/tenants/${encodeURIComponent(state.selected)}/keys`)).data;
  const rows = $("key-rows");
  rows.replaceChildren();
  for (const k of keys) {
    const tr = document.createElement("tr");
    const td = document.createElement("td");
    const b = document.createElement("button");
    b.className = "act danger"; b.type = "button"; b.textContent = "Revoke";
    b.addEventListener("click", () => revokeKey(k.id).catch(showError));
    td.append(b);
    tr.append(cell(k.id), cell(when(k.created_at)), cell(when(k.last_used_at)), td);
    rows.append(tr);
  }
}

async function saveQuota() {
  const quota = {};
  for (const input of $("quota-form").querySelectorAll("input")) {
    const v = input.value.trim();
    quota[input.name] = v === "" ? (input.name === "weight" ? 1 : null) : Number(v);
  }
  await api("PATCH", `/admin/tenants/${encodeURIComponent(state.selected)}`, {quota});
  $("quota-saved").textContent = "saved";
  await loadTenants();
}

async function issueKey() {
  const k = await api("POST", `/admin/tenants/${encodeURIComponent(state.selected)}/keys`);
  const box = $("new-key");
  box.hidden = false;
  box.textContent = `New key (shown once, copy it now): ${k.key}`;
  await renderKeys();
}

async function revokeKey(id) {
  await api("DELETE", `/admin/tenants/${encodeURIComponent(state.selected)}/keys/${encodeURIComponent(id)}`);
  await renderKeys();
}

async function createTenant(event) {
  event.preventDefault();
  const quota = {};
  if ($("new-rpm").value !== "") quota.requests_per_minute = Number($("new-rpm").value);
  if ($("new-weight").value !== "") quota.weight = Number($("new-weight").value);
  const t = await api("POST", "/admin/tenants", {name: $("new-name").value.trim(), quota});
  $("new-name").value = ""; $("new-rpm").value = ""; $("new-weight").value = "";
  await loadTenants();
  await selectTenant(t.name);
}

async function refreshAdapters() {
  const f = $("adapter-filter").value.trim();
  const q = new URLSearchParams({limit: "100", offset: String(state.adapterPage * 100)});
  if (f) q.set("tenant", f);
  const page = await api("GET", `/admin/adapters?${q}`);
  $("adapter-count").textContent = `${page.total} adapters, page ${state.adapterPage + 1} of ${Math.max(1, Math.ceil(page.total / 100))}`;
  const rows = $("adapter-rows");
  rows.replaceChildren();
  for (const a of page.data) {
    const tr = document.createElement("tr");
    const td = document.createElement("td");
    const badge = document.createElement("span");
    badge.className = `badge ${a.residency}`; badge.textContent = a.residency;
    td.append(badge);
    tr.append(cell(a.tenant), cell(a.name), cell(a.version.slice(0, 12)), cell(a.rank),
              cell(a.target_modules.join(" ")), cell(bytes(a.size_bytes)), cell(when(a.created_at)), td);
    rows.append(tr);
  }
}

function tab(name) {
  for (const b of document.querySelectorAll("header nav button")) b.classList.toggle("on", b.dataset.tab === name);
  for (const s of document.querySelectorAll("section")) s.classList.toggle("on", s.id === name);
  state.tab = name;
  tick();
}

async function tick() {
  try {
    if (state.tab === "engine") await refreshEngine();
    if (state.tab === "adapters") await refreshAdapters();
    if (state.tab === "tenants" && !state.tenants.length) await loadTenants();
    $("app-error").textContent = "";
  } catch (e) { showError(e); }
}

async function signIn(token) {
  sessionStorage.setItem(KEY, token);
  try {
    await api("GET", "/admin/engine");
  } catch (e) {
    signOut(e instanceof ApiError && e.status === 401 ? "invalid admin token" : e.message);
    return;
  }
  $("login").hidden = true; $("app").hidden = false; $("whoami").textContent = "signed in with the admin token";
  tab("engine");
  clearInterval(state.timer);
  state.timer = setInterval(tick, 3000);
}

function signOut(message) {
  sessionStorage.removeItem(KEY);
  clearInterval(state.timer);
  $("app").hidden = true; $("login").hidden = false;
  $("login-error").textContent = message || "";
}

$("login-form").addEventListener("submit", e => { e.preventDefault(); signIn($("token").value.trim()); });
$("logout").addEventListener("click", () => signOut(""));
for (const b of document.querySelectorAll("header nav button")) b.addEventListener("click", () => tab(b.dataset.tab));
$("create-form").addEventListener("submit", e => createTenant(e).catch(showError));
$("save-quota").addEventListener("click", () => saveQuota().catch(showError));
$("issue-key").addEventListener("click", () => issueKey().catch(showError));
$("tenant-filter").addEventListener("input", () => { state.tenantPage = 0; renderTenants().catch(showError); });
$("tenant-prev").addEventListener("click", () => { state.tenantPage = Math.max(0, state.tenantPage - 1); renderTenants().catch(showError); });
$("tenant-next").addEventListener("click", () => { state.tenantPage += 1; renderTenants().catch(showError); });
$("adapter-filter").addEventListener("input", () => { state.adapterPage = 0; refreshAdapters().catch(showError); });
$("adapter-prev").addEventListener("click", () => { state.adapterPage = Math.max(0, state.adapterPage - 1); tick(); });
$("adapter-next").addEventListener("click", () => { state.adapterPage += 1; tick(); });
if (sessionStorage.getItem(KEY)) signIn(sessionStorage.getItem(KEY));
