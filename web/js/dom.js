// Small DOM helpers: element builder, tables, number formats. Text always goes in as text
// nodes (never innerHTML), so nothing from the API can inject markup.

export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === undefined || v === null || v === false) continue;
    if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else if (k === "class") el.className = v;
    else el.setAttribute(k, v === true ? "" : v);
  }
  for (const child of children.flat()) {
    if (child === undefined || child === null || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return el;
}

// Re-renders (live polling, a load that lands after another) must not take away what the
// operator is in the middle of. An armed or pending confirmation (a `data-key` button with
// class "armed" or "pending") is moved, as the very same element, into the place of its
// counterpart in the new content; the keyboard focus goes back to the focused control or its
// counterpart, with what was typed in it.
export function replace(target, ...children) {
  const el = typeof target === "string" ? document.getElementById(target) : target;
  const fresh = children.flat().filter((c) => c !== null && c !== undefined);
  const active = document.activeElement;
  const focused = active && active !== el && el.contains(active) ? active : null;
  let refocus = null;
  for (const kept of el.querySelectorAll("[data-key].armed, [data-key].pending")) {
    const counterpart = findIn(fresh, `[data-key="${CSS.escape(kept.dataset.key)}"]`);
    if (!counterpart) continue; // gone from the data (revoked, finalized): so is the confirmation
    counterpart.replaceWith(kept);
    if (kept === focused) refocus = kept;
  }
  if (focused && !refocus) refocus = counterpartOf(focused, fresh);
  el.replaceChildren(...fresh);
  if (refocus) {
    const typed = refocus !== focused && focused.matches("input, textarea") && focused.tagName === refocus.tagName && focused.type === refocus.type;
    if (typed) {
      refocus.value = focused.value; // what the operator typed wins over the refreshed value
      if (focused.selectionStart !== null) refocus.setSelectionRange(focused.selectionStart, focused.selectionEnd);
    }
    refocus.focus({ preventScroll: true });
  }
  return el;
}

// For live views whose content has no controls (charts, the workers table): the new content
// is patched into the old, node by node, so what did not change stays the same element (a
// chart's <svg> keeps its identity and only its label and lines change) and nothing flickers.
// Not for content with listeners: a patched element keeps its old ones.
export function patch(target, ...children) {
  const el = typeof target === "string" ? document.getElementById(target) : target;
  patchChildren(el, children.flat().filter((c) => c !== null && c !== undefined));
  return el;
}

function patchChildren(el, fresh) {
  const old = [...el.childNodes];
  fresh.forEach((node, i) => {
    const before = old[i];
    if (!before) el.append(node);
    else if (before.nodeType !== node.nodeType || before.nodeName !== node.nodeName) before.replaceWith(node);
    else if (node.nodeType === Node.ELEMENT_NODE) patchElement(before, node);
    else if (before.nodeValue !== node.nodeValue) before.nodeValue = node.nodeValue;
  });
  for (const extra of old.slice(fresh.length)) extra.remove();
}

function patchElement(el, fresh) {
  for (const { name } of [...el.attributes]) if (!fresh.hasAttribute(name)) el.removeAttribute(name);
  for (const { name, value } of fresh.attributes) if (el.getAttribute(name) !== value) el.setAttribute(name, value);
  patchChildren(el, [...fresh.childNodes]);
}

function findIn(nodes, selector) {
  for (const node of nodes) {
    if (!(node instanceof Element)) continue;
    if (node.matches(selector)) return node;
    const found = node.querySelector(selector);
    if (found) return found;
  }
  return null;
}

// The same control in new content: by data-key, else id, else tag and accessible name.
const FOCUSABLE = "button, input, select, textarea, a[href], [tabindex]";
function identity(el) {
  if (el.dataset.key) return `key ${el.dataset.key}`;
  if (el.id) return `id ${el.id}`;
  return `${el.tagName} ${el.getAttribute("aria-label") || el.getAttribute("name") || el.textContent.trim()}`;
}

function counterpartOf(focused, nodes) {
  const wanted = identity(focused);
  for (const node of nodes) {
    if (!(node instanceof Element)) continue;
    for (const candidate of [node, ...node.querySelectorAll(FOCUSABLE)]) {
      if (candidate.matches(FOCUSABLE) && identity(candidate) === wanted) return candidate;
    }
  }
  return null;
}

export function notAvailable(what, reason) {
  return h("p", { class: "na" }, `${what}: not available`, reason ? ` (${reason})` : "");
}

// columns: [{label, value: row => text|Node, num?: bool}]
export function table(caption, columns, rows, { rowAttrs } = {}) {
  return h(
    "table",
    {},
    h("caption", { class: "visually-hidden" }, caption),
    h("thead", {}, h("tr", {}, columns.map((c) => h("th", { scope: "col", class: c.num ? "num" : undefined }, c.label)))),
    h(
      "tbody",
      {},
      rows.length
        ? rows.map((row) =>
            h("tr", rowAttrs ? rowAttrs(row) : {}, columns.map((c) => h("td", { class: c.num ? "num" : undefined }, c.value(row) ?? "—"))),
          )
        : h("tr", {}, h("td", { colspan: columns.length, class: "na" }, "none yet")),
    ),
  );
}

export function fmtSeconds(s) {
  if (s === null || s === undefined || Number.isNaN(s)) return "—";
  if (s < 1) return `${(s * 1000).toFixed(s < 0.01 ? 2 : 1)} ms`;
  return `${s.toFixed(2)} s`;
}

// Axis ticks: short, no trailing zeros ("250 ms", "1.5 s").
export function fmtSecondsShort(s) {
  if (s === null || s === undefined) return "";
  return s < 1 ? `${Number((s * 1000).toPrecision(3))} ms` : `${Number(s.toPrecision(3))} s`;
}

export function fmtNumber(n, digits = 0) {
  if (n === null || n === undefined || n === "" || Number.isNaN(Number(n))) return "—";
  return Number(n).toLocaleString(undefined, { maximumFractionDigits: digits, minimumFractionDigits: 0 });
}

// Money and other decimals arrive as strings ("2520.00"): grouped for reading, never turned
// into floats, so what is shown is exactly what was billed.
export function fmtDecimal(text) {
  if (text === null || text === undefined || text === "") return "—";
  const [whole, frac] = String(text).split(".");
  const sign = whole.startsWith("-") ? "-" : "";
  const digits = whole.replace("-", "").replace(/\B(?=(\d{3})+(?!\d))/g, ",");
  return `${sign}${digits}${frac === undefined ? "" : `.${frac}`}`;
}

// 703261440 -> "703.3M"
export function fmtCompact(n) {
  if (n === null || n === undefined || Number.isNaN(Number(n))) return "—";
  return new Intl.NumberFormat("en", { notation: "compact", maximumFractionDigits: 1 }).format(Number(n));
}

export function fmtPercent(x) {
  return x === null || x === undefined ? "—" : `${(x * 100).toFixed(1)} %`;
}

export function fmtTime(value) {
  if (!value) return "—";
  const d = typeof value === "number" ? new Date(value * 1000) : new Date(value);
  return Number.isNaN(d.getTime()) ? String(value) : d.toLocaleString();
}

let toastTimer;
export function toast(message) {
  const el = document.getElementById("toast");
  el.textContent = message;
  clearTimeout(toastTimer);
  toastTimer = setTimeout(() => (el.textContent = ""), 6000);
}

export function download(filename, blob) {
  const url = URL.createObjectURL(blob);
  const a = h("a", { href: url, download: filename });
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 1000);
}
