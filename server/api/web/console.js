"use strict";
// The console: the admin API of this server, no framework and no external assets (air-gapped sites).
// The admin token lives in this tab's sessionStorage: gone when the tab closes, never sent by the browser
// on its own (so no cross-site request can use it, unlike a cookie), and readable only by script of
// this origin, which the page's CSP limits to this server's own files (no inline script or handler,
// Trusted Types for DOM sinks; server.api.response_headers). So every node here is built with
// createElement and textContent, never from markup.
const KEY = "loraplex-admin-token";
const QUOTA_FIELDS = ["requests_per_minute", "tokens_per_minute", "max_concurrent_requests", "max_adapters",
                      "max_adapter_bytes", "max_lora_rank", "max_tokens_per_request", "weight"];
const PAGE = 50;
const REFRESH_MS = 3000;
const COLORS = ["#2f7dd1", "#2f9e5b", "#c98a16", "#8e44ad", "#16a2a8", "#d1495b", "#6b7385", "#7a9a01"];
const state = {tenants: [], tenantPage: 0, adapterPage: 0, selected: null, timer: null, tab: "engine",
               error: null, charts: new Map()};
const $ = id => document.getElementById(id);

class ApiError extends Error { constructor(status, message) { super(message); this.status = status; } }

async function api(method, path, body) {
  const headers = {"Authorization": `Bearer ${sessionStorage.getItem(KEY) || ""}`};
  const form = body instanceof FormData;  // multipart: the browser writes its Content-Type and boundary
  if (body !== undefined && !form) headers["Content-Type"] = "application/json";
  const r = await fetch(path, {method, headers, body: body === undefined || form ? body : JSON.stringify(body)});
  const data = await r.json().catch(() => ({}));
  if (!r.ok) throw new ApiError(r.status, (data.error && data.error.message) || `HTTP ${r.status}`);
  return data;
}

function cell(text) { const td = document.createElement("td"); td.textContent = text; return td; }
function fmt(v) { return v === null || v === undefined ? "unlimited" : String(v); }
function when(t) { return t ? new Date(t * 1000).toLocaleString() : "never"; }
function bytes(n) { return n === null || n === undefined ? "-" : n < 1048576 ? `${(n / 1024).toFixed(1)} KiB` : `${(n / 1048576).toFixed(1)} MiB`; }
function plural(n, one, many) { return `${n} ${n === 1 ? one : (many || one + "s")}`; }
function emptyRow(rows, columns, text) {
  const tr = document.createElement("tr"), td = cell(text);
  td.colSpan = columns; td.className = "muted"; tr.className = "empty";
  tr.append(td); rows.append(tr);
}
function button(text, cls, onClick) {
  const b = document.createElement("button");
  b.type = "button"; b.className = cls; b.textContent = text;
  b.addEventListener("click", onClick);
  return b;
}

// ---- errors: they stay until dismissed or until the user's next action; a refresh clears only its own.
function showError(e, source) {
  if (e instanceof ApiError && e.status === 401) { signOut("the admin token was refused: " + e.message); return; }
  state.error = source || "action";
  $("app-error-text").textContent = e.message;
  $("app-error").hidden = false;
}
function clearError(source) {
  if (source && state.error !== source) return;
  state.error = null;
  $("app-error").hidden = true;
  $("app-error-text").textContent = "";
}
// A user's action: it clears the last error, then shows its own should it fail.
function act(fn) { return (...args) => { clearError(); return Promise.resolve().then(() => fn(...args)).catch(e => showError(e)); }; }

// ---- confirmation before anything that cannot be undone.
function confirmAction(message, okLabel) {
  const dialog = $("confirm");
  $("confirm-text").textContent = message;
  $("confirm-ok").textContent = okLabel;
  dialog.returnValue = "";
  return new Promise(resolve => {
    dialog.addEventListener("close", () => resolve(dialog.returnValue === "ok"), {once: true});
    dialog.showModal();
  });
}

// ---- charts: SVG built node by node; each draws itself again when its box changes size.
const SVGNS = "http://www.w3.org/2000/svg";
function svgEl(tag, attrs, text) {
  const e = document.createElementNS(SVGNS, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}
function niceStep(max, ticks) {
  const raw = max / ticks, mag = 10 ** Math.floor(Math.log10(raw)), f = raw / mag;
  return (f <= 1 ? 1 : f <= 2 ? 2 : f <= 5 ? 5 : 10) * mag;
}
function short(v) {
  const a = Math.abs(v);
  if (a >= 1e9) return `${+(v / 1e9).toFixed(1)}G`;
  if (a >= 1e6) return `${+(v / 1e6).toFixed(1)}M`;
  if (a >= 1e3) return `${+(v / 1e3).toFixed(1)}k`;
  return `${+v.toPrecision(3)}`;
}
const chartObserver = new ResizeObserver(entries => {
  for (const entry of entries) {
    const spec = state.charts.get(entry.target);
    if (spec && Math.round(entry.contentRect.width) !== spec.drawnWidth) draw(entry.target, spec);
  }
});

function chart(svg, spec) {
  if (!state.charts.has(svg)) chartObserver.observe(svg);
  state.charts.set(svg, spec);
  draw(svg, spec);
}

function draw(svg, spec) {
  const w = Math.round(svg.clientWidth), h = Math.round(svg.clientHeight) || 160;
  spec.drawnWidth = w;
  if (!w) return;  // hidden: drawn when it is shown (the observer sees its new size)
  svg.setAttribute("viewBox", `0 0 ${w} ${h}`);
  svg.replaceChildren();
  const m = {left: 46, right: 10, top: 22, bottom: 22};
  const unit = svgEl("text", {x: 4, y: 12, class: "unit"}, spec.unit);
  svg.append(unit);
  const rows = spec.legend && spec.legend.length ? legend(svg, spec.legend, 4 + textWidth(unit) + 14, w - m.right) : 1;
  m.top += LEGEND_ROW * (rows - 1);  // a wrapped legend pushes the plot down rather than overflowing
  const pw = w - m.left - m.right, ph = h - m.top - m.bottom;
  const top = spec.max > 0 ? spec.max : 1;
  const step = niceStep(top, Math.max(2, Math.min(5, Math.floor(ph / 24))));
  const yMax = Math.ceil(top / step - 1e-9) * step;
  const y = v => m.top + ph - (v / yMax) * ph;
  for (let v = 0; v <= yMax + step / 2; v += step) {
    svg.append(svgEl("line", {x1: m.left, x2: w - m.right, y1: y(v), y2: y(v), class: "grid"}));
    svg.append(svgEl("text", {x: m.left - 4, y: y(v) + 4, class: "tick y", "text-anchor": "end"}, short(v)));
  }
  spec.plot(svg, {x0: m.left, pw, y, ybase: m.top + ph, h});
  if (spec.empty) svg.append(svgEl("text", {x: m.left + pw / 2, y: m.top + ph / 2, class: "empty",
                                            "text-anchor": "middle"}, spec.empty));
}

const LEGEND_ROW = 14;  // px between legend rows

function textWidth(t) {
  return Math.max(t.getComputedTextLength ? t.getComputedTextLength() : t.textContent.length * 6, 6);
}

// Swatch and name per series, left to right from `left`, wrapping to another row where the next would
// pass `right` (six refusal reasons do not fit one row of a narrow chart). Returns the rows used.
function legend(svg, entries, left, right) {
  let x = left, row = 0;
  for (const {name, color} of entries) {
    const t = svgEl("text", {class: "legend"}, name);
    svg.append(t);
    const need = 13 + textWidth(t);
    if (x + need > right && x > left) { x = left; row += 1; }
    const y = 12 + row * LEGEND_ROW;
    svg.append(svgEl("rect", {x, y: y - 8, width: 9, height: 9, fill: color, class: "swatch"}));
    t.setAttribute("x", x + 13);
    t.setAttribute("y", y);
    x += need + 10;
  }
  return row + 1;
}

// A time series: x is time; a null value or a missing sample (a gap of more than 3 sampling intervals)
// breaks the line, so an idle or unsampled period is drawn as nothing, not as a straight line across it.
function timeChart(svg, points, series, unit) {
  const ts = points.map(p => p.t);
  const dts = ts.slice(1).map((t, i) => t - ts[i]).sort((a, b) => a - b);
  const gap = 3 * (dts.length ? dts[Math.floor(dts.length / 2)] : 2);
  const values = series.flatMap(s => points.map(p => p[s.key]).filter(v => v !== null && v !== undefined));
  const t1 = ts.length ? ts[ts.length - 1] : Date.now() / 1000, t0 = Math.min(ts.length ? ts[0] : t1, t1 - 60);
  chart(svg, {unit, max: Math.max(0, ...values), legend: series.length > 1 ? series : null,
              empty: values.length ? null : "no data yet", plot(s, g) {
    const x = t => g.x0 + (t - t0) / Math.max(1, t1 - t0) * g.pw;
    const minutes = (t1 - t0) / 60, every = minutes > 8 ? 120 : 60;
    for (let t = Math.ceil(t0 / every) * every; t <= t1; t += every) {
      s.append(svgEl("line", {x1: x(t), x2: x(t), y1: g.ybase, y2: g.ybase + 4, class: "axis"}));
      s.append(svgEl("text", {x: x(t), y: g.h - 4, class: "tick x", "text-anchor": "middle"},
                     new Date(t * 1000).toLocaleTimeString([], {hour: "2-digit", minute: "2-digit", hourCycle: "h23"})));
    }
    for (const se of series) {
      let run = [];
      const flush = () => {
        if (run.length === 1) s.append(svgEl("circle", {cx: run[0][0], cy: run[0][1], r: 3, fill: se.color, class: "seg"}));
        else if (run.length > 1) s.append(svgEl("polyline", {points: run.map(p => p.join(",")).join(" "), fill: "none",
                                                             stroke: se.color, "stroke-width": 2, class: "seg"}));
        run = [];
      };
      points.forEach((p, i) => {
        const v = p[se.key];
        if (i > 0 && p.t - points[i - 1].t > gap) flush();
        if (v === null || v === undefined) { flush(); return; }
        run.push([x(p.t).toFixed(1), g.y(v).toFixed(1)]);
      });
      flush();
    }
  }});
}

// Bars per category (a UTC day), each stacked from `series` [{name, color, values}].
function barChart(svg, labels, series, unit) {
  const sums = labels.map((_, i) => series.reduce((a, s) => a + s.values[i], 0));
  const any = sums.some(v => v > 0);
  chart(svg, {unit, max: Math.max(0, ...sums), legend: series, empty: any ? null : "none in this period", plot(s, g) {
    const slot = g.pw / Math.max(1, labels.length), bw = Math.max(1, Math.min(40, slot * 0.7));
    const every = Math.max(1, Math.ceil(labels.length / Math.max(1, Math.floor(g.pw / 48))));
    labels.forEach((label, i) => {
      const cx = g.x0 + slot * (i + 0.5);
      let base = 0;
      for (const se of series) {
        const v = se.values[i];
        if (v > 0) {
          const r = svgEl("rect", {x: (cx - bw / 2).toFixed(1), y: g.y(base + v).toFixed(1), width: bw.toFixed(1),
                                   height: Math.max(1, g.y(base) - g.y(base + v)).toFixed(1), fill: se.color, class: "bar",
                                   "data-day": label, "data-series": se.name, "data-value": v});
          r.append(svgEl("title", {}, `${label} ${se.name}: ${v} ${unit}`));
          s.append(r);
        }
        base += v;
      }
      if (i % every === 0) s.append(svgEl("text", {x: cx, y: g.h - 4, class: "tick x", "text-anchor": "middle"},
                                          label.slice(5)));
    });
  }});
}

// ---- engine
const rate = (r) => r === null ? "-" : `${(100 * r).toFixed(1)}%`;

async function refreshEngine() {
  const e = await api("GET", "/admin/engine");
  const stats = [["running", e.running], ["waiting", e.waiting], ["KV blocks", `${e.kv_blocks.used} / ${e.kv_blocks.total} (${e.kv_cache.dtype})`],
                 ["adapter slots", `${e.slots.used} / ${e.slots.total}`], ["host adapters", e.host.adapters],
                 ["host bytes", `${bytes(e.host.bytes)} / ${bytes(e.host.budget_bytes)}`],
                 ["loads in flight", e.host.loads_in_flight],
                 ["adapter hit rate (slots / host)", `${rate(e.slots.hit_rate)} / ${rate(e.host.hit_rate)}`],
                 ["preemptions", e.preemptions],
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
  timeChart($("chart-tps"), e.history, [{key: "tokens_per_s", name: "tokens/s", color: COLORS[0]}], "tokens/s");
  timeChart($("chart-ttft"), e.history, [{key: "ttft_p50_s", name: "TTFT", color: COLORS[1]}], "seconds");
  timeChart($("chart-queue"), e.history, [{key: "running", name: "running", color: COLORS[0]},
                                          {key: "waiting", name: "waiting", color: COLORS[2]}], "requests");
}

// ---- tenants
async function loadTenants() {
  state.tenants = (await api("GET", "/admin/tenants")).data;
  await renderTenants();
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
  $("tenant-count").textContent = `${plural(list.length, "tenant")}, page ${state.tenantPage + 1} of ${pages}`;
  const rows = $("tenant-rows");
  rows.replaceChildren();
  for (const t of page) {
    const tr = document.createElement("tr"); tr.className = "pick"; tr.dataset.name = t.name;
    const q = t.quota;
    const live = ["adapters", "requests", "tokens", "refused"].map(k => { const c = cell("…"); c.dataset.col = k; return c; });
    tr.append(cell(t.name), cell(t.id), live[0], cell(fmt(q.max_adapters)), cell(fmt(q.requests_per_minute)),
              cell(fmt(q.tokens_per_minute)), cell(fmt(q.max_concurrent_requests)), cell(q.weight), ...live.slice(1));
    tr.addEventListener("click", act(() => selectTenant(t.name)));
    rows.append(tr);
  }
  // Today's numbers, per visible row only: bounded work however many tenants there are.
  await Promise.all(page.map(async t => {
    const path = `/admin/tenants/${encodeURIComponent(t.name)}`;
    const [u, r] = await Promise.all([api("GET", `${path}/usage`).catch(() => null),
                                      api("GET", `${path}/refusals`).catch(() => null)]);
    const tr = rows.querySelector(`tr[data-name="${CSS.escape(t.name)}"]`);
    if (!tr) return;
    const set = (col, v) => { tr.querySelector(`td[data-col=${col}]`).textContent = v; };
    if (u) {
      set("adapters", u.current.adapters);
      set("requests", u.total.requests);
      set("tokens", u.total.prompt_tokens + u.total.completion_tokens);
    }
    if (r) set("refused", r.total.refused);
  }));
}

function tenantPath(suffix) { return `/admin/tenants/${encodeURIComponent(state.selected)}${suffix || ""}`; }

async function selectTenant(name) {
  state.selected = name;
  const t = await api("GET", tenantPath());
  $("tenant-detail").hidden = false;
  $("detail-title").textContent = `${t.name} (${t.id}), ${plural(t.adapters, "adapter")}, ${plural(t.keys.length, "key")}`;
  $("new-key").hidden = true;
  $("quota-saved").textContent = "";
  $("upload-done").textContent = "";
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
  await Promise.all([renderKeys(), refreshTenantDetail()]);
}

// What changes under a selected tenant while it is shown: its usage, refusals and adapters.
async function refreshTenantDetail() {
  if (!state.selected) return;
  const days = $("usage-days").value;
  const [usage, refusals, adapters] = await Promise.all([
    api("GET", tenantPath(`/usage?days=${days}`)), api("GET", tenantPath(`/refusals?days=${days}`)),
    renderTenantAdapters()]);
  const labels = usage.days.map(d => d.date);
  const names = Object.keys(usage.total.adapters).sort();
  const byAdapter = key => names.map((n, i) => ({name: n || "base model", color: COLORS[i % COLORS.length],
    values: usage.days.map(d => d.adapters[n] ? (key === "tokens" ? d.adapters[n].prompt_tokens + d.adapters[n].completion_tokens
                                                                    : d.adapters[n].requests) : 0)}));
  barChart($("chart-tenant-tokens"), labels, byAdapter("tokens"), "tokens");
  barChart($("chart-tenant-requests"), labels, byAdapter("requests"), "requests");
  const reasons = Object.keys(refusals.total.reasons).sort();
  barChart($("chart-tenant-refusals"), refusals.days.map(d => d.date),
           reasons.map((r, i) => ({name: r, color: COLORS[(i + 5) % COLORS.length],
                                   values: refusals.days.map(d => d.reasons[r] || 0)})), "refused");
  const rows = $("adapter-usage-rows");
  rows.replaceChildren();
  for (const n of names) {
    const a = usage.total.adapters[n], tr = document.createElement("tr");
    tr.append(cell(n || "base model"), cell(a.requests), cell(a.prompt_tokens), cell(a.completion_tokens));
    rows.append(tr);
  }
  if (!names.length) emptyRow(rows, 4, "no requests in this period");
  return adapters;
}

async function renderTenantAdapters() {
  // The admin list filters by name substring; keep this tenant's own rows only.
  const page = await api("GET", `/admin/adapters?${new URLSearchParams({tenant: state.selected, limit: "500"})}`);
  const rows = $("tenant-adapter-rows");
  rows.replaceChildren();
  for (const a of page.data.filter(a => a.tenant === state.selected)) {
    const tr = document.createElement("tr"); tr.dataset.name = a.name;
    const badge = document.createElement("span");
    badge.className = `badge ${a.residency}`; badge.textContent = a.residency;
    const res = document.createElement("td"); res.append(badge);
    const acts = document.createElement("td");
    acts.append(button("Replace", "act plain", act(() => startReplace(a.name))),
                button("Delete", "act danger", act(() => deleteAdapter(a.name))));
    tr.append(cell(a.name), cell(a.version.slice(0, 12)), cell(a.rank), cell(bytes(a.size_bytes)),
              cell(when(a.created_at)), res, acts);
    rows.append(tr);
  }
  if (!rows.children.length) emptyRow(rows, 7, "no adapters yet: upload one below");
}

async function renderKeys() {
  const keys = (await api("GET", tenantPath("/keys"))).data;
  const rows = $("key-rows");
  rows.replaceChildren();
  for (const k of keys) {
    const tr = document.createElement("tr"); tr.dataset.id = k.id;
    const td = document.createElement("td");
    td.append(button("Revoke", "act danger", act(() => revokeKey(k.id))));
    tr.append(cell(k.id), cell(when(k.created_at)), cell(when(k.last_used_at)), td);
    rows.append(tr);
  }
  if (!keys.length) emptyRow(rows, 4, "no keys: this tenant cannot call the API until one is issued");
}

async function saveQuota() {
  const quota = {};
  for (const input of $("quota-form").querySelectorAll("input")) {
    const v = input.value.trim();
    quota[input.name] = v === "" ? (input.name === "weight" ? 1 : null) : Number(v);
  }
  $("quota-saved").textContent = "";
  await api("PATCH", tenantPath(), {quota});
  $("quota-saved").textContent = "saved";
  await loadTenants();
}

async function issueKey() {
  const k = await api("POST", tenantPath("/keys"));
  const box = $("new-key");
  box.hidden = false;
  box.textContent = `New key (shown once, copy it now): ${k.key}`;
  await renderKeys();
}

async function revokeKey(id) {
  if (!await confirmAction(`Revoke key ${id} of tenant ${state.selected}? Requests with it are refused from now on.`,
                           "Revoke")) return;
  await api("DELETE", tenantPath(`/keys/${encodeURIComponent(id)}`));
  await renderKeys();
}

async function deleteTenant() {
  const name = state.selected;
  if (!await confirmAction(`Delete tenant ${name}? Its API keys, usage and adapters are deleted with it; ` +
                           "this cannot be undone.", "Delete tenant")) return;
  await api("DELETE", tenantPath());
  state.selected = null;
  $("tenant-detail").hidden = true;
  await loadTenants();
}

async function deleteAdapter(name) {
  if (!await confirmAction(`Delete adapter ${name} of tenant ${state.selected}? Requests already running on it finish.`,
                           "Delete adapter")) return;
  await api("DELETE", tenantPath(`/adapters/${encodeURIComponent(name)}`));
  await refreshTenantDetail();
}

function startReplace(name) {
  $("upload-name").value = name;
  $("upload-replace").checked = true;
  $("upload-done").textContent = `choose the files that replace ${name}`;
  $("upload-config").focus();
}

async function uploadAdapter(event) {
  event.preventDefault();
  const name = $("upload-name").value.trim(), config = $("upload-config").files[0], weights = $("upload-weights").files[0];
  const form = new FormData();
  form.append("name", name);
  form.append("replace", $("upload-replace").checked ? "true" : "false");
  form.append("adapter_config.json", config, "adapter_config.json");
  form.append("adapter_model.safetensors", weights, "adapter_model.safetensors");
  $("upload-done").textContent = "uploading…";
  try {
    const a = await api("POST", tenantPath("/adapters"), form);
    $("upload-done").textContent = `${a.name}: version ${a.version.slice(0, 12)}, rank ${a.rank}, ${bytes(a.size_bytes)}`;
  } catch (e) { $("upload-done").textContent = ""; throw e; }
  $("upload-form").reset();
  await refreshTenantDetail();
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

// ---- adapters (every tenant's)
async function refreshAdapters() {
  const f = $("adapter-filter").value.trim();
  const q = new URLSearchParams({limit: "100", offset: String(state.adapterPage * 100)});
  if (f) q.set("tenant", f);
  const page = await api("GET", `/admin/adapters?${q}`);
  $("adapter-count").textContent = `${plural(page.total, "adapter")}, page ${state.adapterPage + 1} of ${Math.max(1, Math.ceil(page.total / 100))}`;
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
  return name === "tenants" ? loadTenants().then(refresh) : refresh();
}

// The periodic refresh: what is shown now. Its failure is shown until a later refresh succeeds (or the
// user acts); it never clears an error of the user's own action.
async function refresh() {
  try {
    if (state.tab === "engine") await refreshEngine();
    if (state.tab === "adapters") await refreshAdapters();
    if (state.tab === "tenants") await refreshTenantDetail();
    clearError("refresh");
  } catch (e) {
    if (e instanceof ApiError && e.status === 404 && state.tab === "tenants" && state.selected) {
      state.selected = null;  // deleted elsewhere
      $("tenant-detail").hidden = true;
    }
    if (state.error !== "action") showError(e, "refresh");
  }
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
  clearError();
  await tab("engine");
  clearInterval(state.timer);
  state.timer = setInterval(refresh, REFRESH_MS);
}

function signOut(message) {
  sessionStorage.removeItem(KEY);
  clearInterval(state.timer);
  $("app").hidden = true; $("login").hidden = false;
  $("login-error").textContent = message || "";
}

$("login-form").addEventListener("submit", e => { e.preventDefault(); signIn($("token").value.trim()); });
$("logout").addEventListener("click", () => signOut(""));
$("app-error-close").addEventListener("click", () => clearError());
for (const b of document.querySelectorAll("header nav button")) b.addEventListener("click", act(() => tab(b.dataset.tab)));
$("create-form").addEventListener("submit", act(createTenant));
$("upload-form").addEventListener("submit", act(uploadAdapter));
$("save-quota").addEventListener("click", act(saveQuota));
$("issue-key").addEventListener("click", act(issueKey));
$("delete-tenant").addEventListener("click", act(deleteTenant));
$("usage-days").addEventListener("change", act(refreshTenantDetail));
$("tenant-filter").addEventListener("input", act(() => { state.tenantPage = 0; return renderTenants(); }));
$("tenant-prev").addEventListener("click", act(() => { state.tenantPage = Math.max(0, state.tenantPage - 1); return renderTenants(); }));
$("tenant-next").addEventListener("click", act(() => { state.tenantPage += 1; return renderTenants(); }));
$("adapter-filter").addEventListener("input", act(() => { state.adapterPage = 0; return refreshAdapters(); }));
$("adapter-prev").addEventListener("click", act(() => { state.adapterPage = Math.max(0, state.adapterPage - 1); return refreshAdapters(); }));
$("adapter-next").addEventListener("click", act(() => { state.adapterPage += 1; return refreshAdapters(); }));
if (sessionStorage.getItem(KEY)) signIn(sessionStorage.getItem(KEY));
