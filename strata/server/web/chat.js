// The chat page: conversations in localStorage, replies streamed from /v1/chat/completions.
"use strict";

const $ = (id) => document.getElementById(id);
const STORE = "strata.chats";
let chats = [];          // [{id, title, messages: [{role, content, reasoning, tool_calls, stats, error, stopped}]}]
let current = null;      // the chat shown
let running = null;      // {controller} while a reply streams
let modelId = "strata";

function load() {
  try { chats = JSON.parse(localStorage.getItem(STORE) || "[]"); } catch (e) { chats = []; }
  const s = JSON.parse(localStorage.getItem("strata.settings") || "{}");
  for (const k of ["system", "temperature", "top_p", "max_tokens"]) if (s[k] !== undefined) $(k).value = s[k];
}
function save() {
  localStorage.setItem(STORE, JSON.stringify(chats));
  const s = {};
  for (const k of ["system", "temperature", "top_p", "max_tokens"]) s[k] = $(k).value;
  localStorage.setItem("strata.settings", JSON.stringify(s));
}

function newChat() {
  current = { id: Date.now().toString(36) + Math.random().toString(36).slice(2, 6), title: "New chat", messages: [] };
  chats.unshift(current);
  save(); renderList(); renderMessages();
  $("input").focus();
}

function renderList() {
  const ul = $("convs");
  ul.replaceChildren();
  for (const c of chats) {
    const li = strata.el("li", { class: c === current ? "current" : "" },
      strata.el("button", { type: "button", class: "conv", title: c.title, "aria-current": c === current ? "true" : null,
        onclick: () => { if (running) return; current = c; renderList(); renderMessages(); } }, c.title),
      strata.el("button", { type: "button", title: "Delete this conversation", "aria-label": "Delete " + c.title,
        onclick: () => { if (running && c === current) return; chats = chats.filter((x) => x !== c);
          if (current === c) current = chats[0] || null; if (!current) newChat(); save(); renderList(); renderMessages(); } }, "×"));
    ul.append(li);
  }
}

function statsText(s) {
  if (!s) return "";
  const parts = [];
  if (s.predicted_n !== undefined) parts.push(s.predicted_n + " tokens");
  if (s.predicted_per_second) parts.push(s.predicted_per_second.toFixed(1) + " tok/s");
  if (s.prompt_n !== undefined) parts.push("prompt " + s.prompt_n + (s.prompt_per_second ? " at " + Math.round(s.prompt_per_second) + " tok/s" : ""));
  if (s.cache_n !== undefined) parts.push(s.cache_n + " cached");
  return parts.join(" · ");
}

function messageNode(m, i) {
  const isLast = i === current.messages.length - 1;
  const tools = [];
  if (m.role === "user") {
    tools.push(strata.el("button", { type: "button", title: "Edit and send again", disabled: !!running,
      onclick: () => editMessage(i) }, "Edit"));
  } else if (isLast) {
    tools.push(strata.el("button", { type: "button", title: "Regenerate this reply", disabled: !!running,
      onclick: () => regenerate() }, "Regenerate"));
  }
  const body = strata.el("div", { class: "body" });
  body.innerHTML = m.role === "user" ? "<p>" + md.escape(m.content || "").replace(/\n/g, "<br>") + "</p>" : md.render(m.content || "");
  const node = strata.el("div", { class: "msg " + m.role, "data-role": m.role },
    strata.el("div", { class: "role" }, strata.el("strong", {}, m.role === "user" ? "You" : "Assistant"),
      strata.el("span", { class: "grow" }), ...tools));
  if (m.reasoning) {
    const d = strata.el("details", { class: "reasoning" }, strata.el("summary", {}, "Reasoning"));
    d.append(strata.el("div", {}, m.reasoning));
    if (m.reasoningOpen) d.open = true;
    node.append(d);
  }
  node.append(body);
  for (const tc of m.tool_calls || []) {
    node.append(strata.el("div", { class: "tool" }, "tool call: " + (tc.function.name || "") + " " + (tc.function.arguments || "")));
  }
  if (m.error) node.append(strata.el("div", { class: "error", role: "alert" }, m.error));
  if (m.stopped) node.append(strata.el("div", { class: "stats" }, "stopped"));
  if (m.stats) node.append(strata.el("div", { class: "stats" }, statsText(m.stats)));
  return node;
}

function renderMessages() {
  const box = $("messages");
  box.replaceChildren(...current.messages.map(messageNode));
  box.scrollTop = box.scrollHeight;
}

function apiMessages() {
  const out = [];
  const sys = $("system").value.trim();
  if (sys) out.push({ role: "system", content: sys });
  for (const m of current.messages) {
    if (m.role === "assistant" && m.error && !m.content) continue;
    const x = { role: m.role, content: m.content || "" };
    if (m.tool_calls && m.tool_calls.length) x.tool_calls = m.tool_calls;
    out.push(x);
  }
  return out;
}

// The sampling fields as request keys: a blank field is left out, so the server's default applies (sent as +"",
// it was 0: refused for max_tokens and top_p, greedy decoding for temperature).
function sampling() {
  const out = {};
  for (const k of ["temperature", "top_p", "max_tokens"]) {
    const v = $(k).value.trim();
    if (v !== "" && Number.isFinite(+v)) out[k] = +v;
  }
  return out;
}

async function reply() {
  const msg = { role: "assistant", content: "", reasoning: "" };
  current.messages.push(msg);
  const controller = new AbortController();
  running = { controller };
  $("send").disabled = true; $("stop").disabled = false;
  renderMessages();
  const node = () => $("messages").lastElementChild;
  const t0 = performance.now();
  let n = 0;
  try {
    const body = { model: modelId, stream: true, messages: apiMessages().slice(0, -1), ...sampling() };
    const r = await strata.fetch("/v1/chat/completions", { method: "POST", signal: controller.signal,
      headers: { "Content-Type": "application/json" }, body: JSON.stringify(body) });
    await strata.readEvents(r, (ev) => {
      if (ev.error) { msg.error = ev.error.message || String(ev.error); return; }
      const ch = ev.choices && ev.choices[0];
      if (ch && ch.delta) {
        if (ch.delta.content) { msg.content += ch.delta.content; n++; }
        if (ch.delta.reasoning_content) { msg.reasoning += ch.delta.reasoning_content; n++; }
        for (const tc of ch.delta.tool_calls || []) {
          msg.tool_calls = msg.tool_calls || [];
          const cur = msg.tool_calls[tc.index] || (msg.tool_calls[tc.index] = { id: tc.id, type: "function", function: { name: "", arguments: "" } });
          if (tc.function && tc.function.name) cur.function.name += tc.function.name;
          if (tc.function && tc.function.arguments) cur.function.arguments += tc.function.arguments;
        }
      }
      if (ev.timings) msg.stats = ev.timings;
      const secs = (performance.now() - t0) / 1000;
      $("speed").textContent = n && secs > 0 ? (n / secs).toFixed(1) + " tok/s" : "";
      const open = node().querySelector("details.reasoning");
      msg.reasoningOpen = open ? open.open : false;
      node().replaceWith(messageNode(msg, current.messages.length - 1));
      $("messages").scrollTop = $("messages").scrollHeight;
    });
  } catch (e) {
    if (e.name === "AbortError") msg.stopped = true;
    else if (e.status === 401) {
      // the key was refused (a server restarted with another one): ask for it, then send the same turn again
      current.messages.pop(); running = null;
      await strata.ensureKey("/v1/models");
      $("send").disabled = false; $("stop").disabled = true;
      return reply();
    }
    else msg.error = e.message || String(e);
  }
  finish();
  function finish() {
    running = null;
    $("send").disabled = false; $("stop").disabled = true;
    if (msg.stats) $("speed").textContent = statsText(msg.stats);
    save(); renderMessages();
    $("input").focus();
  }
}

function send(text) {
  if (running || !text.trim()) return;
  current.messages.push({ role: "user", content: text });
  if (current.title === "New chat") current.title = text.trim().split("\n")[0].slice(0, 40);
  renderList();
  reply();
}

function regenerate() {
  if (running) return;
  if (current.messages.length && current.messages[current.messages.length - 1].role === "assistant") current.messages.pop();
  reply();
}

function editMessage(i) {
  if (running) return;
  const text = current.messages[i].content;
  current.messages = current.messages.slice(0, i);
  renderMessages();
  $("input").value = text;
  $("input").focus();
}

function stop() { if (running) running.controller.abort(); }

async function start() {
  load();
  if (!chats.length) newChat(); else { current = chats[0]; renderList(); renderMessages(); }
  $("composer").addEventListener("submit", (ev) => { ev.preventDefault(); const t = $("input").value; $("input").value = ""; send(t); });
  $("input").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) { ev.preventDefault(); $("composer").requestSubmit(); }
  });
  document.addEventListener("keydown", (ev) => {
    if (ev.key === "Escape" && running) { ev.preventDefault(); stop(); }
    if (ev.altKey && (ev.key === "n" || ev.key === "N")) { ev.preventDefault(); if (!running) newChat(); }
  });
  $("stop").addEventListener("click", stop);
  $("newchat").addEventListener("click", () => { if (!running) newChat(); });
  for (const k of ["system", "temperature", "top_p", "max_tokens"]) $(k).addEventListener("change", save);
  const h = await strata.waitReady($("banner"));
  await strata.ensureKey("/v1/models");
  const models = await (await strata.fetch("/v1/models")).json();
  modelId = (models.data && models.data[0] && models.data[0].id) || h.model || "strata";
  $("model").textContent = modelId;
  document.body.dataset.ready = "1";
}

start();
