// A small inline-SVG line chart: a few series over a shared time axis, gaps where a value is
// null. Accessible as an image whose label states the latest values.

const SVG = "http://www.w3.org/2000/svg";
const W = 360;
const H = 150;
const PAD = { left: 56, right: 8, top: 8, bottom: 20 };

function s(tag, attrs = {}, text) {
  const el = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
  if (text !== undefined) el.textContent = text;
  return el;
}

function niceMax(v) {
  if (!(v > 0)) return 1;
  const p = 10 ** Math.floor(Math.log10(v));
  for (const m of [1, 2, 2.5, 5, 10]) if (m * p >= v) return m * p;
  return 10 * p;
}

function lastValue(values) {
  for (let i = values.length - 1; i >= 0; i--) if (values[i] !== null && values[i] !== undefined) return values[i];
  return null;
}

// t: epoch seconds per point; series: [{name, values}]; format: value -> short text.
export function lineChart({ title, t, series, format, tickFormat = format, max }) {
  const all = series.flatMap((x) => x.values).filter((v) => v !== null && v !== undefined);
  const yMax = max ?? niceMax(Math.max(0, ...all));
  const x0 = t[0];
  const span = Math.max(1, t[t.length - 1] - x0);
  const px = (tt) => PAD.left + ((tt - x0) / span) * (W - PAD.left - PAD.right);
  const py = (v) => H - PAD.bottom - (Math.min(v, yMax) / yMax) * (H - PAD.top - PAD.bottom);

  const latest = series.map((x) => `${x.name} ${format(lastValue(x.values))}`).join(", ");
  const svg = s("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": `${title}: latest ${latest}` });
  for (let i = 0; i <= 4; i++) {
    const v = (yMax * i) / 4;
    const y = py(v);
    svg.append(s("line", { class: "grid", x1: PAD.left, x2: W - PAD.right, y1: y, y2: y }));
    svg.append(s("text", { class: "axis", x: PAD.left - 4, y: y + 3, "text-anchor": "end" }, tickFormat(v)));
  }
  const minutes = Math.round(span / 60);
  svg.append(s("text", { class: "axis", x: PAD.left, y: H - 5 }, `−${minutes} min`));
  svg.append(s("text", { class: "axis", x: W - PAD.right, y: H - 5, "text-anchor": "end" }, "now"));

  series.forEach((x, i) => {
    let d = "";
    let pen = false;
    x.values.forEach((v, k) => {
      if (v === null || v === undefined) {
        pen = false;
        return;
      }
      d += `${pen ? "L" : "M"}${px(t[k]).toFixed(1)},${py(v).toFixed(1)}`;
      pen = true;
    });
    // A lone point (one step with data) would not draw as a path; mark it with a dot.
    svg.append(s("path", { class: `line s${i}`, d }));
    x.values.forEach((v, k) => {
      const prev = x.values[k - 1];
      const next = x.values[k + 1];
      if (v !== null && v !== undefined && (prev === null || prev === undefined) && (next === null || next === undefined)) {
        svg.append(s("circle", { class: `s${i}`, cx: px(t[k]), cy: py(v), r: 2.5 }));
      }
    });
  });

  const figure = document.createElement("figure");
  figure.className = "chart";
  const caption = document.createElement("figcaption");
  caption.textContent = title;
  const legend = document.createElement("div");
  legend.className = "legend";
  legend.setAttribute("aria-hidden", "true");
  series.forEach((x, i) => {
    const item = document.createElement("span");
    const swatch = document.createElement("i");
    swatch.className = `s${i}`;
    item.append(swatch, `${x.name} ${format(lastValue(x.values))}`);
    legend.append(item);
  });
  figure.append(caption, svg, legend);
  return figure;
}
