// The operator's page: sign-in, hash-routed views, live polling of the visible view.

import { api, ApiError, items, NotAvailable, token, Unauthorized } from "./api.js";
import { lineChart } from "./charts.js";
import { download, fmtCompact, fmtDecimal, fmtNumber, fmtPercent, fmtSeconds, fmtSecondsShort, fmtTime, h, notAvailable, patch, replace, table, toast } from "./dom.js";

// Every path the page calls, in one place.
const API = {
  timeseries: "/admin/v1/ops/timeseries",
  workers: "/admin/v1/ops/workers",
  tenants: "/admin/v1/tenants",
  tenant: (id) => `/admin/v1/tenants/${encodeURIComponent(id)}`,
  keys: (tenant) => `/admin/v1/tenants/${encodeURIComponent(tenant)}/keys`,
  key: (tenant, key) => `/admin/v1/tenants/${encodeURIComponent(tenant)}/keys/${encodeURIComponent(key)}`,
  skus: "/admin/v1/skus",
  sku: (id) => `/admin/v1/skus/${encodeURIComponent(id)}`,
  prices: (sku) => `/admin/v1/skus/${encodeURIComponent(sku)}/price-plans`,
  usage: "/admin/v1/ops/usage",
  usageCsv: "/admin/v1/ops/usage.csv",
  invoices: "/admin/v1/invoices", // finalized ones; ?tenant_id=
  tenantInvoice: (tenant, period) => `/admin/v1/tenants/${encodeURIComponent(tenant)}/invoices/${encodeURIComponent(period)}`, // finalized, else the draft now
  finalize: (tenant, period) => `${API.tenantInvoice(tenant, period)}/finalize`,
  invoiceExport: (tenant, period) => `${API.tenantInvoice(tenant, period)}/export`, // ?format=json|csv
  showback: "/admin/v1/showback", // FOCUS CSV: ?period=YYYY-MM | from=&to=, &granularity=day|hour
  capacity: "/admin/v1/capacity", // the capacity job's latest per SKU
  skuCapacity: (sku) => `/admin/v1/capacity/${encodeURIComponent(sku)}`, // what-ifs as query
};

const POLL_MS = 2000;
// Admin lists read the Postgres read models; `consistent` waits for them to catch up with the
// event log, so the page shows its own writes at once.
const FRESH = { query: { consistent: true } };
const views = ["overview", "workers", "tenants", "skus", "usage", "invoices", "capacity"];
let pollTimer = null;
let selectedTenant = null;

// ---------------------------------------------------------------- shell
function show(el, visible) {
  document.getElementById(el).hidden = !visible;
}

function signedIn() {
  return Boolean(token.get());
}

function showSignIn(message = "") {
  token.clear();
  show("app", false);
  show("sign-out", false);
  show("sign-in", true);
  replace("health");
  document.getElementById("sign-in-error").textContent = message;
  document.getElementById("admin-token").focus();
  stopPolling();
}

async function signIn(event) {
  event.preventDefault();
  const input = document.getElementById("admin-token");
  const value = input.value.trim();
  if (!value) {
    document.getElementById("sign-in-error").textContent = "Enter the admin token.";
    return;
  }
  token.set(value);
  try {
    await api(API.workers); // any admin read proves the token
  } catch (err) {
    showSignIn(err instanceof Unauthorized ? "That token was refused." : `Cannot sign in: ${err.message}`);
    return;
  }
  input.value = "";
  enterApp();
}

function enterApp() {
  show("sign-in", false);
  show("app", true);
  show("sign-out", true);
  route();
}

function currentView() {
  const name = location.hash.replace(/^#/, "");
  return views.includes(name) ? name : "overview";
}

function route() {
  if (!signedIn()) return showSignIn();
  const name = currentView();
  for (const v of views) show(`view-${v}`, v === name);
  for (const a of document.querySelectorAll("nav a")) {
    if (a.getAttribute("href") === `#${name}`) a.setAttribute("aria-current", "page");
    else a.removeAttribute("aria-current");
  }
  stopPolling();
  refresh(true);
}

function stopPolling() {
  clearTimeout(pollTimer);
  pollTimer = null;
}

// Runs the visible view's loader; live views poll again after POLL_MS.
async function refresh(first = false) {
  const name = currentView();
  try {
    await Promise.all([loaders[name](first), loadHealth()]);
  } catch (err) {
    if (err instanceof Unauthorized) return showSignIn("The admin token was refused; sign in again.");
    toast(err.message);
  }
  const live = name === "workers" || (name === "overview" && document.getElementById("live").checked);
  if (live && signedIn() && currentView() === name) pollTimer = setTimeout(() => refresh(), POLL_MS);
}

// Latest-wins for loaders that may overlap (a click while the previous load is in flight):
// `const mine = turn("keys")` before the fetch, `if (!mine()) return` after it.
const turns = new Map();
function turn(key) {
  const n = (turns.get(key) || 0) + 1;
  turns.set(key, n);
  return () => turns.get(key) === n;
}

// Show a view's failure in place: "not available" for missing endpoints, else the message.
function failed(target, what, err) {
  if (err instanceof Unauthorized) throw err;
  replace(target, err instanceof NotAvailable ? notAvailable(what, err.message) : h("p", { class: "error" }, `${what}: ${err.message}`));
}

// ---------------------------------------------------------------- health
async function probe(path) {
  try {
    const r = await fetch(path, { headers: { Accept: "application/json" } });
    if (r.status === 404) return "na";
    return r.ok ? "ok" : "bad";
  } catch {
    return "bad";
  }
}

async function loadHealth() {
  const [live, ready] = await Promise.all([probe("/healthz"), probe("/readyz")]);
  const label = { ok: "ok", bad: "failing", na: "not available" };
  replace(
    "health",
    h("span", { class: `pill ${live}` }, `API ${label[live]}`),
    h("span", { class: `pill ${ready}` }, `Ready ${label[ready]}`),
  );
}

// ---------------------------------------------------------------- overview
const LAT = [
  ["ttft", "Time to first token"],
  ["itl", "Inter-token latency"],
  ["e2e", "End-to-end latency"],
];

function last(values) {
  for (let i = values.length - 1; i >= 0; i--) if (values[i] !== null && values[i] !== undefined) return values[i];
  return null;
}

function card(label, value) {
  return h("div", { class: "card" }, h("div", { class: "label" }, label), h("div", { class: "value" }, value));
}

// Prompt tokens served from the prefix cache over the window, as a share of all prompt tokens.
function prefixCacheStat(pc, windowLabel) {
  const { queries = 0, hits = 0, hit_rate: rate = null } = pc || {};
  return h(
    "p",
    { class: "sku-stat", "data-stat": "prefix-cache" },
    "Prefix-cache hit rate ",
    h("strong", {}, fmtPercent(rate)),
    queries
      ? ` (${fmtNumber(hits)} of ${fmtNumber(queries)} prompt tokens cached, last ${windowLabel})`
      : ` (no prompt tokens in the last ${windowLabel})`,
  );
}

async function loadOverview() {
  const select = document.getElementById("window");
  const windowS = select.value;
  const windowLabel = select.selectedOptions[0]?.textContent || `${windowS} s`;
  let ts;
  let workers = [];
  try {
    [ts, workers] = await Promise.all([api(API.timeseries, { query: { window_s: windowS } }), api(API.workers).then((b) => items(b, "workers"))]);
  } catch (err) {
    failed("sku-charts", "Metrics", err);
    return;
  }
  const skus = Object.entries(ts.skus);
  const sum = (f) => skus.reduce((acc, [, s]) => acc + f(s), 0);
  const recent = Math.max(1, Math.round(300 / ts.step_s)); // the last five minutes
  const requests5m = sum((s) => s.requests.slice(-recent).reduce((a, b) => a + (b || 0), 0));
  const tps = sum((s) => last(s.generation_tps.slice(0, -1)) || 0); // last closed step
  const liveWorkers = workers.filter((w) => w.state === "live").length;
  patch(
    "summary",
    card("Live workers", `${liveWorkers} / ${workers.length}`),
    card("SKUs with traffic", String(skus.length)),
    card("Requests, last 5 min", fmtNumber(requests5m)),
    card("Output tokens/s", fmtNumber(tps, 1)),
  );
  if (!skus.length) {
    patch("sku-charts", h("p", { class: "na" }, "No requests or workers seen yet: charts appear with the first request."));
    return;
  }
  patch(
    "sku-charts",
    skus.map(([sku, s]) =>
      h(
        "section",
        { class: "sku", "aria-label": `SKU ${sku}`, "data-sku": sku },
        h("h3", {}, sku, " ", h("span", { class: "muted" }, s.model)),
        prefixCacheStat(s.prefix_cache, windowLabel),
        h(
          "div",
          { class: "charts" },
          LAT.map(([kind, title]) =>
            lineChart({
              title,
              t: ts.t,
              format: fmtSeconds,
              tickFormat: fmtSecondsShort,
              series: [
                { name: "p50", values: s[`${kind}_p50`] },
                { name: "p90", values: s[`${kind}_p90`] },
                { name: "p99", values: s[`${kind}_p99`] },
              ],
            }),
          ),
          lineChart({
            title: "Throughput (tokens/s)",
            t: ts.t,
            format: (v) => fmtNumber(v, v !== null && v < 10 ? 1 : 0),
            series: [
              { name: "output", values: s.generation_tps },
              { name: "prompt", values: s.prompt_tps },
            ],
          }),
          lineChart({
            title: "Prefix-cache hit rate",
            t: ts.t,
            max: 1,
            format: fmtPercent,
            series: [{ name: "hits", values: s.prefix_cache_hit_rate || [] }],
          }),
          lineChart({
            title: "KV-cache pressure",
            t: ts.t,
            max: 1,
            format: fmtPercent,
            series: [
              { name: "mean", values: s.kv_usage },
              { name: "max", values: s.kv_usage_max },
            ],
          }),
          lineChart({
            title: "Requests in workers",
            t: ts.t,
            format: (v) => fmtNumber(v, 1),
            series: [
              { name: "running", values: s.running },
              { name: "waiting", values: s.waiting },
            ],
          }),
        ),
      ),
    ),
  );
}

// ---------------------------------------------------------------- workers
async function loadWorkers() {
  let workers;
  try {
    workers = items(await api(API.workers), "workers");
  } catch (err) {
    return failed("workers-table", "Workers", err);
  }
  patch(
    "workers-table",
    table("Workers", [
      { label: "Worker", value: (w) => h("span", { class: "mono" }, w.worker_id) },
      { label: "SKU", value: (w) => w.sku_id },
      { label: "Model", value: (w) => w.model },
      { label: "Backend", value: (w) => w.backend },
      { label: "State", value: (w) => h("span", { class: `status-${w.state}` }, w.state) },
      { label: "Running", num: true, value: (w) => fmtNumber(w.running) },
      { label: "Waiting", num: true, value: (w) => fmtNumber(w.waiting) },
      { label: "Capacity", num: true, value: (w) => fmtNumber(w.capacity) },
      { label: "KV cache", num: true, value: (w) => fmtPercent(w.kv_pressure) },
      { label: "Last seen", num: true, value: (w) => `${fmtNumber(w.seconds_since_seen, 1)} s ago` },
    ], workers),
  );
}

// ---------------------------------------------------------------- tenants & keys
const idOf = (x, ...names) => names.map((n) => x[n]).find((v) => v !== undefined && v !== null);
const tenantId = (t) => idOf(t, "tenant_id", "id");
const keyId = (k) => idOf(k, "key_id", "id");
const statusOf = (x) => x.status || (x.revoked_at ? "revoked" : x.suspended_at || x.suspended ? "suspended" : x.retired_at ? "retired" : "active");

async function action(fn, success) {
  try {
    const result = await fn();
    if (success) toast(success);
    return result;
  } catch (err) {
    if (err instanceof Unauthorized) return showSignIn("The admin token was refused; sign in again.");
    toast(err instanceof ApiError || err instanceof NotAvailable ? err.message : String(err));
    return undefined;
  }
}

// A destructive button asks once more on its own first press, rather than through a dialog.
// `key` names what it acts on (one key, one invoice): while armed, and while the action runs,
// a re-render keeps this very button in place of the new one (see replace), so a live update
// or a late load neither disarms it nor lets it be pressed twice.
function confirmButton(label, key, onConfirm, confirmLabel = `Confirm ${label.toLowerCase()}`) {
  const button = h("button", { type: "button", class: "danger", "data-key": key }, label);
  let timer;
  const disarm = () => {
    clearTimeout(timer);
    button.classList.remove("armed", "pending");
    button.disabled = false;
    button.textContent = label;
  };
  button.addEventListener("click", async () => {
    if (!button.classList.contains("armed")) {
      button.classList.add("armed");
      button.textContent = confirmLabel;
      timer = setTimeout(disarm, 5000);
      return;
    }
    clearTimeout(timer);
    button.classList.replace("armed", "pending");
    button.disabled = true;
    try {
      await onConfirm();
    } finally {
      disarm(); // still shown when the action was refused: ready to ask again
    }
  });
  return button;
}

async function loadTenants() {
  const mine = turn("tenants");
  let tenants;
  try {
    tenants = items(await api(API.tenants, FRESH), "tenants");
  } catch (err) {
    return failed("tenants-table", "Tenants", err);
  }
  if (!mine()) return;
  replace(
    "tenants-table",
    table(
      "Tenants",
      [
        { label: "Name", value: (t) => h("button", { type: "button", class: "secondary", "aria-label": `Keys of ${t.name}`, onclick: () => selectTenant(t) }, t.name) },
        { label: "Tenant id", value: (t) => h("span", { class: "mono" }, tenantId(t)) },
        { label: "Status", value: (t) => h("span", { class: `status-${statusOf(t)}` }, statusOf(t)) },
        { label: "Created", value: (t) => fmtTime(t.created_at) },
        {
          label: "Actions",
          value: (t) =>
            statusOf(t) === "suspended"
              ? h("button", { type: "button", class: "secondary", onclick: () => tenantAction(t, "reactivate") }, "Reactivate")
              : h("button", { type: "button", class: "secondary", onclick: () => tenantAction(t, "suspend") }, "Suspend"),
        },
      ],
      tenants,
      { rowAttrs: (t) => ({ class: tenantId(t) === selectedTenant?.id ? "selected" : undefined }) },
    ),
  );
  if (selectedTenant) await loadKeys();
}

async function tenantAction(t, verb) {
  await action(() => api(`${API.tenant(tenantId(t))}/${verb}`, { method: "POST", body: {} }), `Tenant ${t.name}: ${verb} done`);
  await loadTenants();
}

async function selectTenant(t) {
  selectedTenant = { id: tenantId(t), name: t.name };
  await loadTenants();
  document.getElementById("key-name")?.focus();
}

async function loadKeys(justIssued) {
  const { id, name } = selectedTenant;
  const mine = turn("keys");
  let keys;
  try {
    keys = items(await api(API.keys(id), FRESH), "keys", "api_keys");
  } catch (err) {
    return failed("keys-panel", `Keys of ${name}`, err);
  }
  if (!mine()) return;
  const form = h(
    "form",
    { class: "row", id: "key-form", onsubmit: (e) => issueKey(e) },
    h("label", { for: "key-name" }, "Key name"),
    h("input", { id: "key-name", name: "name", placeholder: "e.g. production" }),
    h("label", { for: "key-scopes" }, "SKU scopes"),
    h("input", { id: "key-scopes", name: "scopes", placeholder: "all SKUs (or comma-separated ids)" }),
    h("button", { type: "submit" }, "Issue key"),
  );
  replace(
    "keys-panel",
    h(
      "section",
      { class: "panel", "aria-labelledby": "keys-title" },
      h("h3", { id: "keys-title" }, `Keys of ${name}`),
      form,
      justIssued
        ? h(
            "div",
            { class: "secret", role: "alert", id: "issued-key" },
            h("p", {}, "The new key, shown this once only: copy it now."),
            h("code", { id: "issued-key-value" }, justIssued),
            " ",
            h("button", { type: "button", class: "secondary", onclick: () => navigator.clipboard?.writeText(justIssued).then(() => toast("Copied")) }, "Copy"),
          )
        : null,
      table(`Keys of ${name}`, [
        { label: "Prefix", value: (k) => h("span", { class: "mono" }, k.prefix) },
        { label: "Name", value: (k) => k.name },
        { label: "Scopes", value: (k) => (k.scopes?.length ? k.scopes.join(", ") : "all SKUs") },
        { label: "Status", value: (k) => h("span", { class: `status-${statusOf(k)}` }, statusOf(k)) },
        { label: "Issued", value: (k) => fmtTime(k.created_at || k.issued_at) },
        {
          label: "Actions",
          value: (k) => (statusOf(k) === "revoked" ? "—" : confirmButton("Revoke", `revoke ${keyId(k)}`, () => revokeKey(k))),
        },
      ], keys, { rowAttrs: (k) => ({ "data-key-prefix": k.prefix }) }),
    ),
  );
}

async function issueKey(event) {
  event.preventDefault();
  const data = new FormData(event.target);
  const scopes = String(data.get("scopes") || "").split(",").map((s) => s.trim()).filter(Boolean);
  const body = { name: data.get("name") || null };
  if (scopes.length) body.scopes = scopes;
  const issued = await action(() => api(API.keys(selectedTenant.id), { method: "POST", body }), "Key issued");
  if (issued) await loadKeys(issued.key || issued.api_key || issued.plaintext || issued.secret);
}

async function revokeKey(k) {
  await action(() => api(`${API.key(selectedTenant.id, keyId(k))}/revoke`, { method: "POST", body: {} }), `Key ${k.prefix} revoked`);
  await loadKeys();
}

async function createTenant(event) {
  event.preventDefault();
  const input = document.getElementById("tenant-name");
  const created = await action(() => api(API.tenants, { method: "POST", body: { name: input.value.trim() } }), "Tenant created");
  if (created) {
    input.value = "";
    selectedTenant = { id: tenantId(created), name: created.name };
    await loadTenants();
  }
}

// ---------------------------------------------------------------- SKUs & prices
let skuCache = [];

async function loadSkus() {
  let skus;
  try {
    skus = items(await api(API.skus, FRESH), "skus");
  } catch (err) {
    return failed("skus-table", "SKUs", err);
  }
  skuCache = skus;
  const prices = await Promise.all(
    skus.map((s) => api(API.prices(s.sku_id || s.id), FRESH).then((b) => items(b, "prices", "price_plans", "plans")).catch(() => null)),
  );
  const current = (plans) => (plans?.length ? [...plans].sort((a, b) => String(a.effective_from).localeCompare(String(b.effective_from))).filter((p) => new Date(p.effective_from) <= new Date()).pop() || plans[0] : null);
  const price = (i, field) => {
    const p = current(prices[i]);
    return p ? `${p[field]} ${p.currency}` : prices[i] === null ? "n/a" : "—";
  };
  const rows = skus.map((s, i) => ({ ...s, i }));
  replace(
    "skus-table",
    table("SKUs", [
      { label: "SKU", value: (s) => s.name },
      { label: "Id", value: (s) => h("span", { class: "mono" }, s.sku_id || s.id) },
      { label: "Model", value: (s) => s.model },
      { label: "Runtime", value: (s) => s.runtime },
      { label: "GPU", value: (s) => s.gpu_type },
      { label: "Status", value: (s) => h("span", { class: `status-${statusOf(s)}` }, statusOf(s)) },
      { label: "Input /1M", num: true, value: (s) => price(s.i, "input_per_mtok") },
      { label: "Cached /1M", num: true, value: (s) => price(s.i, "cached_input_per_mtok") },
      { label: "Output /1M", num: true, value: (s) => price(s.i, "output_per_mtok") },
      {
        label: "Actions",
        value: (s) =>
          h(
            "span",
            {},
            h("button", { type: "button", class: "secondary", onclick: () => editPrices(s, current(prices[s.i])) }, "Edit prices"),
            " ",
            statusOf(s) === "retired" ? null : confirmButton("Retire", `retire ${s.sku_id || s.id}`, () => retireSku(s)),
          ),
      },
    ], rows),
  );
}

function editPrices(sku, plan) {
  const id = sku.sku_id || sku.id;
  const now = new Date(Date.now() - new Date().getTimezoneOffset() * 60000).toISOString().slice(0, 16);
  const field = (name, label, value, attrs = {}) => [h("label", { for: `price-${name}` }, label), h("input", { id: `price-${name}`, name, value: value ?? "", required: true, ...attrs })];
  replace(
    "price-editor",
    h(
      "section",
      { class: "panel", "aria-labelledby": "price-title" },
      h("h3", { id: "price-title" }, `New price plan for ${sku.name}`),
      h(
        "form",
        { class: "grid-form", onsubmit: (e) => savePrices(e, id) },
        field("input_per_mtok", "Input per 1M tokens", plan?.input_per_mtok, { inputmode: "decimal" }),
        field("cached_input_per_mtok", "Cached input per 1M tokens", plan?.cached_input_per_mtok, { inputmode: "decimal" }),
        field("output_per_mtok", "Output per 1M tokens", plan?.output_per_mtok, { inputmode: "decimal" }),
        field("currency", "Currency", plan?.currency || "USD", { maxlength: 3 }),
        field("effective_from", "Effective from", now, { type: "datetime-local" }),
        h("span"),
        h("button", { type: "submit" }, "Save price plan"),
      ),
    ),
  );
  document.getElementById("price-input_per_mtok").focus();
}

async function savePrices(event, skuId) {
  event.preventDefault();
  const data = Object.fromEntries(new FormData(event.target));
  data.effective_from = new Date(data.effective_from).toISOString();
  const saved = await action(() => api(API.prices(skuId), { method: "POST", body: data }), "Price plan saved");
  if (saved !== undefined) {
    replace("price-editor");
    await loadSkus();
  }
}

async function retireSku(s) {
  await action(() => api(`${API.sku(s.sku_id || s.id)}/retire`, { method: "POST", body: {} }), `SKU ${s.name} retired`);
  await loadSkus();
}

async function publishSku(event) {
  event.preventDefault();
  const body = Object.fromEntries(new FormData(event.target));
  const created = await action(() => api(API.skus, { method: "POST", body }), "SKU published");
  if (created) {
    event.target.reset();
    await loadSkus();
  }
}

// ---------------------------------------------------------------- usage
const USAGE_COLUMNS = [
  { label: "Tenant", value: (r) => r.tenant_name || r.tenant_id },
  { label: "Tenant id", value: (r) => h("span", { class: "mono" }, r.tenant_id) },
  { label: "SKU", value: (r) => r.sku_name || r.sku_id },
  { label: "Requests", num: true, value: (r) => fmtNumber(r.requests) },
  { label: "Prompt tokens", num: true, value: (r) => fmtNumber(r.prompt_tokens) },
  { label: "Cached tokens", num: true, value: (r) => fmtNumber(r.cached_tokens) },
  { label: "Completion tokens", num: true, value: (r) => fmtNumber(r.completion_tokens) },
  { label: "Last request", value: (r) => fmtTime(r.last_at) },
];

function usageRange() {
  const from = document.getElementById("usage-from").value;
  const to = document.getElementById("usage-to").value;
  return { from: from || undefined, to: to || undefined };
}

async function loadUsage() {
  const status = document.getElementById("usage-status");
  let usageRows;
  try {
    usageRows = items(await api(API.usage, { query: usageRange() }));
    status.textContent = `${usageRows.length} ${usageRows.length === 1 ? "row" : "rows"}`;
  } catch (err) {
    status.textContent = "";
    return failed("usage-table", "Usage", err);
  }
  replace("usage-table", table("Usage by tenant", USAGE_COLUMNS, usageRows));
}

// Fetches a file with the admin token (a plain link cannot send it) and saves it under the
// name the server gave in Content-Disposition.
async function downloadFrom(path, query, fallbackName) {
  const response = await action(() => api(path, { query, raw: true }));
  if (!response) return false;
  const named = /filename="([^"]+)"/.exec(response.headers.get("content-disposition") || "");
  download(named ? named[1] : fallbackName, await response.blob());
  return true;
}

async function downloadUsageCsv() {
  const range = usageRange();
  if (await downloadFrom(API.usageCsv, range, `tokenmill-usage-${range.from || "start"}-${range.to || "now"}.csv`)) toast("Usage CSV downloaded");
}

const thisMonth = () => new Date().toISOString().slice(0, 7); // YYYY-MM, UTC like billing

// The usage view's days (inclusive, UTC) as the showback's [from, to); none: this month.
function showbackWindow() {
  const { from, to } = usageRange();
  if (!from && !to) return { period: thisMonth() };
  const end = new Date(`${to || new Date().toISOString().slice(0, 10)}T00:00:00Z`);
  end.setUTCDate(end.getUTCDate() + 1);
  return { from: `${from || `${(to || thisMonth()).slice(0, 7)}-01`}T00:00:00Z`, to: end.toISOString().replace(".000Z", "Z") };
}

async function downloadShowback(event) {
  event.preventDefault();
  const query = { ...showbackWindow(), granularity: document.getElementById("showback-granularity").value, consistent: true };
  if (await downloadFrom(API.showback, query, "showback.csv")) toast("Showback CSV downloaded");
}

// ---------------------------------------------------------------- invoices
let tenantNames = new Map(); // tenant id -> name, for the invoice lists
const skuName = (id) => skuCache.find((s) => (s.sku_id || s.id) === id)?.name || id;
// A list a view can do without ([] when unavailable), unless the token was refused.
const orNothing = (err) => (err instanceof Unauthorized ? Promise.reject(err) : []);
async function refreshSkuNames() {
  skuCache = await api(API.skus).then((b) => items(b, "skus")).catch(orNothing);
}
const money = (amount, currency) => `${fmtDecimal(amount)} ${currency}`;

async function loadInvoices(first) {
  const select = document.getElementById("invoice-tenant");
  const month = document.getElementById("invoice-period");
  if (first) {
    const [tenants] = await Promise.all([api(API.tenants).then((b) => items(b, "tenants")).catch(orNothing), refreshSkuNames()]);
    tenantNames = new Map(tenants.map((t) => [tenantId(t), t.name]));
    const chosen = select.value || selectedTenant?.id || "";
    replace(select, h("option", { value: "" }, "All tenants"), tenants.map((t) => h("option", { value: tenantId(t) }, t.name)));
    select.value = tenantNames.has(chosen) ? chosen : "";
    if (!month.value) month.value = thisMonth();
  }
  await Promise.all([loadFinalizedInvoices(), showInvoice()]);
}

async function loadFinalizedInvoices() {
  const tenant = document.getElementById("invoice-tenant").value;
  const mine = turn("invoices");
  let invoices;
  try {
    invoices = items(await api(API.invoices, { query: { tenant_id: tenant, consistent: true } }), "invoices");
  } catch (err) {
    return failed("invoices-table", "Invoices", err);
  }
  if (!mine()) return;
  replace(
    "invoices-table",
    table("Finalized invoices", [
      { label: "Invoice", value: (i) => h("span", { class: "mono" }, i.invoice_id) },
      { label: "Tenant", value: (i) => tenantNames.get(i.tenant_id) || i.tenant_id },
      { label: "Month", value: (i) => i.period },
      { label: "Status", value: (i) => h("span", { class: `status-${i.status}` }, i.status) },
      { label: "Lines", num: true, value: (i) => fmtNumber(i.lines) },
      { label: "Total", num: true, value: (i) => money(i.total, i.currency) },
      { label: "Finalized", value: (i) => fmtTime(i.finalized_at) },
      {
        label: "Actions",
        value: (i) =>
          h(
            "span",
            { class: "actions" },
            h("button", { type: "button", class: "secondary", "aria-label": `Open ${i.invoice_id}`, onclick: () => openInvoice(i.tenant_id, i.period) }, "Open"),
            exportButtons(i.tenant_id, i.period, i.invoice_id),
          ),
      },
    ], invoices, { rowAttrs: (i) => ({ "data-invoice": i.invoice_id }) }),
  );
}

function exportButtons(tenant, period, id) {
  return ["json", "csv"].map((format) =>
    h("button", {
      type: "button",
      class: "secondary",
      "aria-label": `Download ${id} as ${format.toUpperCase()}`,
      onclick: () => downloadFrom(API.invoiceExport(tenant, period), { format, consistent: true }, `${id}.${format}`),
    }, format.toUpperCase()),
  );
}

async function openInvoice(tenant, period) {
  document.getElementById("invoice-tenant").value = tenant;
  document.getElementById("invoice-period").value = period;
  await Promise.all([loadFinalizedInvoices(), showInvoice()]);
  document.getElementById("invoice-detail").scrollIntoView({ block: "nearest" });
}

// The chosen tenant's month: the finalized invoice, else its draft as of now.
async function showInvoice(problem) {
  const tenant = document.getElementById("invoice-tenant").value;
  const period = document.getElementById("invoice-period").value;
  if (!tenant || !period) {
    replace("invoice-detail", h("p", { class: "na" }, "Choose a tenant to see its invoice for the month: the draft so far, or the finalized one."));
    return;
  }
  const mine = turn("invoice");
  let invoice;
  try {
    invoice = await api(API.tenantInvoice(tenant, period), FRESH);
  } catch (err) {
    return failed("invoice-detail", `Invoice of ${tenantNames.get(tenant) || tenant} for ${period}`, err);
  }
  if (!mine()) return;
  const name = tenantNames.get(tenant) || tenant;
  const draft = invoice.status !== "finalized";
  const c = invoice.currency;
  replace(
    "invoice-detail",
    h(
      "section",
      { class: "panel", "aria-labelledby": "invoice-title", "data-status": invoice.status },
      h("h3", { id: "invoice-title" }, `${name} · ${period} `, h("span", { class: `badge status-${invoice.status}` }, invoice.status), " ", h("span", { class: "muted mono" }, invoice.invoice_id)),
      h(
        "p",
        { class: "muted" },
        draft
          ? "Draft as of now, from the usage ledger at the prices in force at each request; it changes as usage arrives until the month is finalized."
          : `Finalized ${fmtTime(invoice.finalized_at)}; immutable. Usage that arrives later becomes an adjustment on the next invoice.`,
      ),
      h(
        "div",
        { class: "cards" },
        card("Usage", money(invoice.usage_total, c)),
        card("Adjustments", money(invoice.adjustments_total, c)),
        card("Total", money(invoice.total, c)),
      ),
      table(`Lines of ${invoice.invoice_id}`, [
        { label: "Category", value: (l) => l.category },
        { label: "SKU", value: (l) => skuName(l.sku_id) },
        { label: "Tokens", value: (l) => l.token_class.replaceAll("_", " ") },
        { label: "Quantity", num: true, value: (l) => fmtNumber(l.quantity) },
        { label: "Unit price /1M", num: true, value: (l) => money(l.unit_price_per_mtok, c) },
        { label: "Amount", num: true, value: (l) => money(l.amount, c) },
        { label: "Requests", num: true, value: (l) => fmtNumber(l.requests) },
        { label: "Price in force", value: (l) => `${fmtTime(l.charge_period_start)} → ${fmtTime(l.charge_period_end)}` },
      ], invoice.lines),
      invoice.unpriced?.length
        ? h("p", { class: "warn", role: "note" }, "Usage without a price plan in force, billed at nothing: ", invoice.unpriced.map((u) => `${fmtNumber(u.quantity)} ${u.token_class} tokens of ${skuName(u.sku_id)}`).join("; "))
        : null,
      h(
        "div",
        { class: "row" },
        exportButtons(tenant, period, invoice.invoice_id),
        draft ? confirmButton("Finalize", `finalize ${tenant} ${period}`, () => finalizeInvoice(tenant, period), `Confirm: finalize ${period} (cannot be undone)`) : null,
      ),
      problem ? h("p", { class: "error", role: "alert", id: "invoice-problem" }, problem) : null,
    ),
  );
}

async function finalizeInvoice(tenant, period) {
  let problem;
  try {
    const invoice = await api(API.finalize(tenant, period), { method: "POST" });
    toast(`${invoice.invoice_id} finalized: ${money(invoice.total, invoice.currency)}`);
  } catch (err) {
    if (err instanceof Unauthorized) return showSignIn("The admin token was refused; sign in again.");
    // e.g. 409 period_not_ended: a month is finalized once it is over
    problem = `Not finalized: ${err.problem?.title ? `${err.problem.title}. ` : ""}${err.message}`;
  }
  await Promise.all([loadFinalizedInvoices(), showInvoice(problem)]);
}

// ---------------------------------------------------------------- capacity
const CAPACITY_COLUMNS = [
  { label: "SKU", value: (p) => skuName(p.sku_id) },
  { label: "Measured from", value: (p) => p.source },
  { label: "Output tok/s", num: true, value: (p) => fmtDecimal(p.output_tokens_per_second) },
  { label: "GPUs", num: true, value: (p) => fmtNumber(p.gpus) },
  { label: "Busy", num: true, value: (p) => fmtPercent(Number(p.busy_fraction)) },
  { label: "Tokens / period", num: true, value: (p) => `${fmtCompact(p.output_tokens_per_period)} / ${p.days} d` },
  { label: "GPU-h per 1M", num: true, value: (p) => fmtDecimal(p.gpu_hours_per_million_output) },
  { label: "Cost per 1M", num: true, value: (p) => money(p.cost_per_million_output, p.currency) },
  { label: "Margin per 1M", num: true, value: (p) => (p.margin_per_million_output === null ? "no price" : money(p.margin_per_million_output, p.currency)) },
  { label: "Computed", value: (p) => fmtTime(p.computed_at) },
];

async function loadCapacity(first) {
  if (!first) return;
  const select = document.getElementById("cap-sku");
  await refreshSkuNames();
  const chosen = select.value;
  replace(select, skuCache.map((s) => h("option", { value: s.name }, s.name)));
  if (chosen) select.value = chosen;
  try {
    const latest = items(await api(API.capacity), "projections");
    replace(
      "capacity-table",
      latest.length
        ? table("Latest capacity projection per SKU", CAPACITY_COLUMNS, latest)
        : h("p", { class: "na" }, "None yet: the capacity job projects each SKU with recent usage (every 15 minutes under tokenmill up). Try a what-if below."),
    );
  } catch (err) {
    return failed("capacity-table", "Capacity projection", err);
  }
}

// Blank what-if fields are left out: the server then uses the measured throughput, the
// configured GPU cost and the SKU's price plan.
function whatIf() {
  const form = Object.fromEntries(new FormData(document.getElementById("capacity-form")));
  const { sku, busy_percent: busy, ...query } = form;
  // 70 -> "0.7"; toPrecision drops binary noise (33.3 / 100 = 0.33299999999999996)
  query.busy_fraction = String(Number((Number(busy) / 100).toPrecision(12)));
  return { sku, query };
}

async function project(event) {
  event?.preventDefault();
  const { sku, query } = whatIf();
  if (!sku) return replace("capacity-result", h("p", { class: "na" }, "Publish a SKU first."));
  const mine = turn("capacity");
  let p;
  try {
    p = await api(API.skuCapacity(sku), { query });
  } catch (err) {
    if (err.problem?.reason === "no_throughput") {
      return replace("capacity-result", h("p", { class: "na" }, `Nothing measured for ${sku} recently: enter a throughput (tok/s) to project one.`));
    }
    return failed("capacity-result", "Capacity projection", err);
  }
  if (!mine()) return;
  const c = p.currency;
  const priced = p.revenue_per_million_output !== null;
  const breakeven = p.breakeven_busy_fraction === null ? null : Number(p.breakeven_busy_fraction);
  const margin = (v) => h("span", { class: Number(v) < 0 ? "loss" : "gain" }, money(v, c));
  replace(
    "capacity-result",
    h(
      "section",
      { class: "panel", "aria-label": `Capacity what-if for ${sku}`, id: "capacity-what-if" },
      h("h3", {}, `${sku}: ${fmtDecimal(p.output_tokens_per_second)} tok/s on ${p.gpus} × ${p.gpu_type}, ${fmtPercent(Number(p.busy_fraction))} busy, ${p.days} days`),
      h(
        "div",
        { class: "cards" },
        card(`Output tokens / ${p.days} days`, h("span", { title: `${fmtNumber(p.output_tokens_per_period)} tokens` }, fmtCompact(p.output_tokens_per_period))),
        card("GPU-hours per 1M tokens", fmtDecimal(p.gpu_hours_per_million_output)),
        card("Cost per 1M tokens", money(p.cost_per_million_output, c)),
        card("Revenue per 1M tokens", priced ? money(p.revenue_per_million_output, c) : "no price"),
        card("Margin per 1M tokens", priced ? margin(p.margin_per_million_output) : "—"),
        card(`Margin / ${p.days} days`, priced ? margin(p.margin_per_period) : "—"),
      ),
      table(`Capacity figures for ${sku}`, [
        { label: "Figure", value: (r) => r[0] },
        { label: "Value", num: true, value: (r) => r[1] },
      ], [
        ["Output tokens per period", `${fmtNumber(p.output_tokens_per_period)} tokens`],
        ["GPU cost per period", money(p.cost_per_period, c)],
        ["Revenue per period", priced ? money(p.revenue_per_period, c) : "no price"],
        ["Margin, share of revenue", p.margin_fraction === null ? "—" : fmtPercent(Number(p.margin_fraction))],
        ["Break-even busy fraction", breakeven === null ? "—" : breakeven > 1 ? `${fmtPercent(breakeven)}: the price does not cover the GPU even fully busy` : fmtPercent(breakeven)],
        ["Throughput from", p.source],
      ]),
    ),
  );
}

// ---------------------------------------------------------------- wiring
const loaders = {
  overview: loadOverview,
  workers: loadWorkers,
  tenants: loadTenants,
  skus: loadSkus,
  usage: loadUsage,
  invoices: loadInvoices,
  capacity: loadCapacity,
};

document.getElementById("sign-in-form").addEventListener("submit", signIn);
document.getElementById("sign-out").addEventListener("click", () => showSignIn("Signed out."));
document.getElementById("tenant-form").addEventListener("submit", createTenant);
document.getElementById("sku-form").addEventListener("submit", publishSku);
document.getElementById("usage-form").addEventListener("submit", (e) => {
  e.preventDefault();
  loadUsage();
});
document.getElementById("usage-csv").addEventListener("click", downloadUsageCsv);
document.getElementById("showback-form").addEventListener("submit", downloadShowback);
document.getElementById("invoice-form").addEventListener("submit", (e) => {
  e.preventDefault();
  openInvoice(document.getElementById("invoice-tenant").value, document.getElementById("invoice-period").value);
});
document.getElementById("invoice-tenant").addEventListener("change", () => Promise.all([loadFinalizedInvoices(), showInvoice()]));
document.getElementById("capacity-form").addEventListener("submit", project);
document.getElementById("window").addEventListener("change", () => refresh());
document.getElementById("live").addEventListener("change", () => {
  stopPolling();
  refresh();
});
window.addEventListener("hashchange", route);
if (signedIn()) enterApp();
else showSignIn();
