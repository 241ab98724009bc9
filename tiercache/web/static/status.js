// The status page: reads status.json every few seconds and draws it. Plain DOM and SVG, no library.
"use strict";

const REFRESH_MS = 5000;
const COLORS = { gpu: "#7c3aed", host: "#2563eb", disk: "#ea580c", remote: "#0891b2" };
let key = sessionStorage.getItem("tiercache-key") || "";

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) node.setAttribute(name, value);
  for (const child of children) node.append(child instanceof Node ? child : String(child));
  return node;
}

function svg(tag, attrs = {}) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [name, value] of Object.entries(attrs)) node.setAttribute(name, value);
  return node;
}

function bytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

const count = (n) => Number(n).toLocaleString("en-US");
const percent = (x) => (x === null || x === undefined ? "–" : `${(100 * x).toFixed(1)}%`);

function ago(t, now) {
  const s = Math.max(0, now - t);
  if (s < 60) return `${Math.round(s)} s ago`;
  if (s < 3600) return `${Math.round(s / 60)} min ago`;
  if (s < 86400) return `${Math.round(s / 3600)} h ago`;
  return `${Math.round(s / 86400)} d ago`;
}

function bar(parts) {
  const node = el("div", { class: "bar" });
  for (const [cls, share] of parts) {
    const part = el("span", { class: cls });
    part.style.width = `${Math.max(0, Math.min(1, share || 0)) * 100}%`;
    node.append(part);
  }
  return node;
}

function drawTiers(data) {
  const box = document.getElementById("tiers");
  box.replaceChildren(...data.tiers.map((t) => el("div", { class: "card tier", "data-tier": t.name },
    el("h3", {}, t.name),
    el("div", { class: "figure fill" }, percent(t.fill)),
    bar([["fill", t.fill]]),
    el("div", { class: "label" }, t.capacity_bytes ? `${bytes(t.used_bytes)} of ${bytes(t.capacity_bytes)}` : "shared cluster"),
    el("div", { class: "label blocks" }, `${count(t.num_blocks)} blocks`),
    el("div", { class: "label hits" }, `hit rate, last hour: ${percent(t.hit_rate)} (${count(t.hits)} blocks)`))));
}

function drawHour(data) {
  document.getElementById("hour-hit-rate").textContent = percent(data.hour.hit_rate);
  document.getElementById("hour-tokens-saved").textContent = count(data.hour.tokens_saved);
  document.getElementById("hour-tokens-computed").textContent = count(data.hour.tokens_computed);
  const s = data.series;
  // The last hour, or since the first reading when the server is younger than that.
  const start = Math.min(data.now - 10 * data.interval_s, Math.max(data.now - 3600, data.hour.since));
  const span = data.now - start;
  const x = (t) => ((t - start) / span) * 300;
  document.getElementById("span").textContent = span >= 3590 ? "last hour" : `since ${new Date(start * 1000).toLocaleTimeString()}`;
  const hit = document.getElementById("chart-hit-rate");
  const points = s.t.map((t, i) => [t, s.hit_rate[i]]).filter(([, v]) => v !== null);
  hit.replaceChildren(svg("line", { class: "axis", x1: 0, y1: 79, x2: 300, y2: 79 }),
    svg("polyline", { class: "hit", points: points.map(([t, v]) => `${x(t).toFixed(1)},${(78 - v * 76).toFixed(1)}`).join(" ") }));
  const tokens = document.getElementById("chart-tokens");
  const peak = Math.max(1, ...s.t.map((_, i) => s.tokens_saved[i] + s.tokens_computed[i]));
  const width = Math.max(1, (data.interval_s / span) * 300 - 0.3);
  const bars = [svg("line", { class: "axis", x1: 0, y1: 79, x2: 300, y2: 79 })];
  s.t.forEach((t, i) => {
    const hs = (s.tokens_saved[i] / peak) * 76;
    const hc = (s.tokens_computed[i] / peak) * 76;
    bars.push(svg("rect", { class: "saved", x: x(t) - width, y: 79 - hs, width, height: hs }));
    bars.push(svg("rect", { class: "computed", x: x(t) - width, y: 79 - hs - hc, width, height: hc }));
  });
  tokens.replaceChildren(...bars);
  const fill = document.getElementById("chart-fill");
  const lines = [svg("line", { class: "axis", x1: 0, y1: 79, x2: 300, y2: 79 })];
  const legend = [];
  for (const [tier, values] of Object.entries(s.fill)) {
    const pts = s.t.map((t, i) => [t, values[i]]).filter(([, v]) => v !== null && v !== undefined);
    const line = svg("polyline", { class: "hit", points: pts.map(([t, v]) => `${x(t).toFixed(1)},${(78 - v * 76).toFixed(1)}`).join(" ") });
    line.style.stroke = COLORS[tier] || "#000";
    lines.push(line);
    const swatch = el("span", {}, `— ${tier}`);
    swatch.style.color = COLORS[tier] || "#000";
    legend.push(swatch);
  }
  fill.replaceChildren(...lines);
  document.getElementById("fill-legend").replaceChildren(...legend);
}

function drawNamespaces(data) {
  const body = document.querySelector("#namespaces tbody");
  if (!data.namespaces.length) {
    body.replaceChildren(el("tr", {}, el("td", { colspan: 8, class: "muted" }, "nothing cached yet")));
    return;
  }
  body.replaceChildren(...data.namespaces.map((n) => el("tr", { class: "namespace", "data-namespace": n.namespace },
    el("td", { class: "model" }, n.model),
    el("td", { class: "num" }, count(n.blocks)),
    el("td", { class: "num tokens" }, count(n.tokens)),
    el("td", { class: "num hits" }, count(n.hits)),
    el("td", { class: "tiers" }, Object.entries(n.tiers).map(([t, k]) => `${t} ${count(k)}`).join(", ")),
    el("td", { class: "num" }, count(n.pinned)),
    el("td", {}, ago(n.last_use, data.now)),
    el("td", { class: "preview" }, n.salted ? el("em", { class: "muted" }, "salted: hidden") : n.preview))));
}

function drawRequests(data) {
  const body = document.querySelector("#requests tbody");
  if (!data.requests.length) {
    body.replaceChildren(el("tr", {}, el("td", { colspan: 7, class: "muted" }, "no request yet")));
    return;
  }
  body.replaceChildren(...data.requests.map((r) => el("tr", { class: "request" },
    el("td", {}, ago(r.at, data.now)),
    el("td", { class: "num prompt" }, count(r.prompt_tokens)),
    el("td", { class: "num cached" }, count(r.cached_tokens)),
    el("td", { class: "num computed" }, count(r.computed_tokens)),
    el("td", {}, bar([["saved", r.cached_tokens / Math.max(1, r.prompt_tokens)],
                      ["computed", r.computed_tokens / Math.max(1, r.prompt_tokens)]])),
    el("td", { class: "num" }, `${r.ttft_ms} ms`),
    el("td", {}, r.tiers.join(", ") || "–"))));
}

function draw(data) {
  const where = data.source === "api" ? `HTTP API serving ${data.model}` : "daemon";
  const workers = data.workers ? `, workers ${data.workers.ready}/${data.workers.total} ready, ${data.workers.busy} busy` : "";
  document.getElementById("summary").textContent = `${where}${workers} · version ${data.version}`;
  document.getElementById("updated").textContent = `updated ${new Date(data.now * 1000).toLocaleTimeString()}`;
  drawTiers(data);
  drawHour(data);
  drawNamespaces(data);
  drawRequests(data);
  document.getElementById("content").hidden = false;
  document.body.dataset.loaded = "true";
}

async function refresh() {
  const headers = key ? { Authorization: `Bearer ${key}` } : {};
  try {
    const response = await fetch("/status.json", { headers, cache: "no-store" });
    if (response.status === 401 || response.status === 403) {
      document.getElementById("content").hidden = true;
      document.getElementById("login").hidden = false;
      document.getElementById("summary").textContent = "a key is needed";
      if (key) document.getElementById("login-error").textContent = "that key was refused";
      return;
    }
    document.getElementById("login").hidden = true;
    draw(await response.json());
  } catch (error) {
    document.getElementById("updated").textContent = `could not reach the server: ${error}`;
  }
}

document.getElementById("login").addEventListener("submit", (event) => {
  event.preventDefault();
  key = document.getElementById("key").value.trim();
  sessionStorage.setItem("tiercache-key", key);
  refresh();
});

refresh();
setInterval(refresh, REFRESH_MS);
