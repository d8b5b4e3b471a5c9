// The monitor: snapshots from /monitor/stream (one a second), drawn as numbers, small charts, the VRAM split,
// the slots and the expert cache's heat map.
"use strict";

const $ = (id) => document.getElementById(id);
const N = 120;  // points kept per chart (two minutes)
const series = { decode: [], prefill: [], hit: [], cpu: [], pcie: [], cpuGbps: [], pcieGbps: [] };
let prev = null;
const COLORS = { a: "#2f6fde", b: "#d9822b" };
const VRAM_COLORS = { context: "#8a8f98", dense: "#6b5bd2", kv: "#2a9d8f", other: "#b0b4ba", prefill: "#e9c46a",
  chunk_buffers: "#f4a261", staging: "#e76f51", cache: "#2f6fde", reserve: "#c9ccd1", unused: "#eceef1" };

function push(name, v) { const s = series[name]; s.push(v); if (s.length > N) s.shift(); }

function chart(id, lines) {
  const c = $(id), dpr = window.devicePixelRatio || 1;
  const w = c.clientWidth, h = c.clientHeight;
  c.width = w * dpr; c.height = h * dpr;
  const g = c.getContext("2d");
  g.scale(dpr, dpr);
  g.clearRect(0, 0, w, h);
  const vals = lines.flatMap((l) => l.data.filter((v) => v !== null));
  const max = Math.max(1e-9, ...vals) * 1.1;
  g.strokeStyle = getComputedStyle(document.body).getPropertyValue("--line");
  g.beginPath(); g.moveTo(0, h - 0.5); g.lineTo(w, h - 0.5); g.stroke();
  for (const l of lines) {
    g.strokeStyle = l.color; g.lineWidth = 1.5; g.beginPath();
    let started = false;
    l.data.forEach((v, i) => {
      if (v === null) { started = false; return; }
      const x = (i + N - l.data.length) / (N - 1) * w, y = h - (v / max) * (h - 4) - 2;
      if (started) g.lineTo(x, y); else { g.moveTo(x, y); started = true; }
    });
    g.stroke();
  }
  g.fillStyle = getComputedStyle(document.body).getPropertyValue("--muted");
  g.font = "11px system-ui"; g.fillText(max.toPrecision(3), 4, 12);
}

const fmt = (v, d = 1) => (v === null || v === undefined || Number.isNaN(v)) ? "–" : (+v).toFixed(d);

function update(s) {
  if (s.status !== "ok") {
    $("status").textContent = s.status === "loading" ? "loading the model…" : (s.error || s.status);
    return;
  }
  $("status").textContent = s.state.status + " · " + s.state.running + " running · " + s.state.waiting + " waiting";
  $("model").textContent = s.model;
  $("model").dataset.model = s.model;
  const m = s.machine || {};
  const gpus = (m.gpus || []).map((g) => g.name).filter(Boolean);
  $("machine").textContent = [m.cpu ? m.cpu.count + " CPUs" : "", m.ram ? (m.ram.total_bytes / 2 ** 30).toFixed(0) + " GiB RAM" : "",
    gpus.length ? gpus.join(", ") : "no GPU"].filter(Boolean).join(" · ");
  // where the model runs: the server's --device (settings.device, e.g. "cpu", "cuda:0"); a server that does not
  // say is taken to be on a GPU when NVML lists one. On a CPU there is no VRAM: the expert "cache" is RAM too.
  const device = (s.settings && s.settings.device) || (gpus.length ? "cuda" : "cpu");
  const onGpu = device.startsWith("cuda");
  const ex = s.experts || {};
  let hit = null, cpu = null, pcie = null;
  if (prev && prev.experts && ex.lookups !== undefined) {
    const dl = ex.lookups - (prev.experts.lookups || 0), dt = ex.tokens - (prev.experts.tokens || 0);
    if (dl > 0) hit = (ex.hits - prev.experts.hits) / dl;
    if (dt > 0) { cpu = (ex.cpu - prev.experts.cpu) / dt; pcie = (ex.pcie - prev.experts.pcie) / dt; }
  }
  const last = (s.recent_requests || []).slice(-1)[0];
  const prefill = last && last.prompt_ms ? (last.prompt_tokens - (last.cached_tokens || 0)) / (last.prompt_ms / 1000) : null;
  push("decode", s.state.tokens_per_second); push("prefill", prefill); push("hit", hit === null ? null : 100 * hit);
  push("cpu", cpu); push("pcie", pcie);
  const lanes = ex.decode_lanes || {};
  push("cpuGbps", lanes.experts_cpu_gbps ?? null); push("pcieGbps", lanes.experts_pcie_gbps ?? null);
  $("decode").textContent = fmt(s.state.tokens_per_second);
  $("prefill").textContent = prefill === null ? "–" : fmt(prefill, 0);
  const overall = ex.lookups ? ex.hits / ex.lookups : null;
  $("hit").textContent = hit !== null ? fmt(100 * hit) + "%" : overall !== null ? fmt(100 * overall) + "% overall" : "–";
  $("hit").dataset.overall = overall === null ? "" : overall.toFixed(4);
  $("misses").textContent = ex.lookups ? fmt(ex.cpu_per_token) + " / " + fmt(ex.pcie_per_token) : "–";
  $("lanes").textContent = (lanes.experts_cpu_gbps !== undefined) ? fmt(lanes.experts_cpu_gbps) + " / " + fmt(lanes.experts_pcie_gbps) : "–";
  chart("c-decode", [{ data: series.decode, color: COLORS.a }]);
  chart("c-prefill", [{ data: series.prefill, color: COLORS.a }]);
  chart("c-hit", [{ data: series.hit, color: COLORS.a }]);
  chart("c-misses", [{ data: series.cpu, color: COLORS.b }, { data: series.pcie, color: COLORS.a }]);
  chart("c-lanes", [{ data: series.cpuGbps, color: COLORS.b }, { data: series.pcieGbps, color: COLORS.a }]);
  breakdown(ex.profile);
  vram(s.vram_split, onGpu);
  slots(s.state.slots || []);
  totals(s.totals || {}, s.prompt_cache || {});
  if (s.cache !== undefined) heat(s.cache, onGpu);
  prev = s;
  document.body.dataset.ready = "1";
}

function breakdown(p) {
  const tb = $("breakdown").tBodies[0];
  if (!p || !p.ms_per_token) return;
  tb.replaceChildren(...Object.entries(p.ms_per_token).map(([k, v]) =>
    strata.el("tr", {}, strata.el("td", {}, k), strata.el("td", {}, fmt(v, 2)))));
}

function vram(v, onGpu) {
  const bar = $("vram"), legend = $("vram-legend");
  if (!v) {
    bar.replaceChildren();
    legend.textContent = onGpu ? "no VRAM budget (no --vram-gb)" : "no VRAM: this server runs on the CPU, every weight in RAM";
    return;
  }
  const parts = Object.keys(VRAM_COLORS).filter((k) => v[k + "_gib"] > 0);
  bar.replaceChildren(...parts.map((k) => strata.el("span", { title: k + " " + v[k + "_gib"].toFixed(2) + " GiB",
    style: "width:" + (100 * v[k + "_gib"] / v.budget_gib) + "%;background:" + VRAM_COLORS[k] })));
  legend.replaceChildren(...parts.map((k) => strata.el("span", {}, strata.el("i", { style: "background:" + VRAM_COLORS[k] }),
    k.replace("_", " ") + " " + v[k + "_gib"].toFixed(2))),
    strata.el("span", {}, "budget " + v.budget_gib.toFixed(2) + " GiB; " + v.slots_per_layer + " of " + v.n_experts + " slots a layer"));
}

function slots(list) {
  const tb = $("slots").tBodies[0];
  tb.replaceChildren(...list.map((s) => strata.el("tr", {}, strata.el("td", {}, String(s.id)), strata.el("td", {}, s.state),
    strata.el("td", {}, String(s.n_prompt_tokens)), strata.el("td", {}, String(s.n_decoded)), strata.el("td", {}, String(s.n_cached)))));
}

function totals(t, pc) {
  const rows = Object.entries(t).concat(Object.entries(pc).filter(([k]) => ["entries", "restores"].includes(k))
    .map(([k, v]) => ["prompt cache " + k, v]));
  $("totals").tBodies[0].replaceChildren(...rows.map(([k, v]) => strata.el("tr", {}, strata.el("td", {}, k.replace(/_/g, " ")), strata.el("td", {}, String(v)))));
}

// The heat map's words: blue is "in the expert cache's slots", which are VRAM only on a GPU. On a CPU the slots
// (tiered experts) are RAM, and resident experts (every expert in a slot) are all simply in RAM.
function heatWords(c, n, onGpu) {
  const all = c.slots_per_layer >= c.experts;
  if (onGpu) return { hot: "in VRAM", cold: "in RAM only", note: n + " in VRAM (" + c.slots_per_layer + " slots a layer)" };
  if (all) return { hot: "resident in RAM", cold: null, note: "all resident in RAM (a CPU run: no VRAM cache)" };
  return { hot: "in a cache slot (RAM)", cold: "not in a slot (RAM)",
    note: n + " in cache slots (" + c.slots_per_layer + " a layer; a CPU run: slots in RAM, no VRAM)" };
}

function heat(c, onGpu) {
  const cv = $("heat"), note = $("heat-note");
  if (!c) { note.textContent = "this model has no routed experts"; return; }
  const L = c.layers, E = c.experts, cell = Math.max(2, Math.floor((cv.clientWidth || 900) / E));
  cv.width = E * cell; cv.height = L * cell;
  cv.style.height = L * cell + "px";
  const g = cv.getContext("2d");
  for (let l = 0; l < L; l++) for (let e = 0; e < E; e++) {
    const i = l * E + e, h = c.heat ? c.heat[i] / 255 : 1, inVram = c.resident[i];
    const a = 0.15 + 0.85 * h;
    g.fillStyle = inVram ? "rgba(47,111,222," + a + ")" : "rgba(217,130,43," + a + ")";
    g.fillRect(e * cell, l * cell, cell, cell);
  }
  const n = c.resident.reduce((x, y) => x + y, 0);
  const w = heatWords(c, n, onGpu);
  note.textContent = L + " layers × " + E + " experts, " + w.note;
  $("heat-hot").textContent = w.hot + " (brighter: hotter)";
  $("heat-cold").textContent = (w.cold || "") + " (brighter: hotter)";
  $("heat-cold").parentElement.hidden = !w.cold;
  cv.dataset.resident = String(n);
}

async function start() {
  await strata.waitReady($("banner"));
  await strata.ensureKey("/v1/models");
  for (;;) {
    try {
      const r = await strata.fetch("/monitor/stream");
      await strata.readEvents(r, update);
    } catch (e) {
      if (e.status === 401) { await strata.ensureKey("/v1/models"); continue; }
      $("status").textContent = "disconnected: " + (e.message || e) + "; retrying";
    }
    await new Promise((res) => setTimeout(res, 2000));
    await strata.waitReady($("banner"));
  }
}

start();
