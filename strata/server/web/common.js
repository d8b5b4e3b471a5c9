// strata web pages: the API key (kept for this tab only), authorized fetches, server-sent events over fetch,
// the server's health. Plain script, no dependencies: every page loads it first.
"use strict";

const strata = {
  key() { return sessionStorage.getItem("strata.key") || ""; },
  setKey(k) { if (k) sessionStorage.setItem("strata.key", k); else sessionStorage.removeItem("strata.key"); },

  headers(extra) {
    const h = Object.assign({}, extra || {});
    const k = strata.key();
    if (k) h["Authorization"] = "Bearer " + k;
    return h;
  },

  // fetch with the key; a 401 raises an Error whose .status is 401 (the caller asks for the key)
  async fetch(path, opts) {
    opts = Object.assign({}, opts || {});
    opts.headers = strata.headers(opts.headers);
    const r = await fetch(path, opts);
    if (!r.ok) {
      let msg = r.status + " " + r.statusText;
      try { const j = await r.json(); if (j && j.error && j.error.message) msg = j.error.message; } catch (e) { /* not JSON */ }
      const err = new Error(msg);
      err.status = r.status;
      throw err;
    }
    return r;
  },

  // Read a text/event-stream response, calling onData(parsed JSON) for each `data:` event ("[DONE]" ends it).
  async readEvents(response, onData) {
    const reader = response.body.getReader();
    const dec = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += dec.decode(value, { stream: true });
      let i;
      while ((i = buf.indexOf("\n\n")) >= 0) {
        const block = buf.slice(0, i);
        buf = buf.slice(i + 2);
        for (const line of block.split("\n")) {
          if (!line.startsWith("data:")) continue;
          const data = line.slice(5).trim();
          if (data === "[DONE]") return;
          try { onData(JSON.parse(data)); } catch (e) { /* a malformed event is skipped */ }
        }
      }
    }
  },

  // {state: "ok" | "loading" | "error" | "down", message}
  async health() {
    try {
      const r = await fetch("/health");
      const j = await r.json().catch(() => ({}));
      if (r.ok) return { state: "ok", message: "", model: j.model };
      if (r.status === 503) return { state: "loading", message: "The model is loading…" };
      return { state: "error", message: (j.error && j.error.message) || ("HTTP " + r.status) };
    } catch (e) {
      return { state: "down", message: "The server does not answer." };
    }
  },

  // Wait until /health says ok, showing its state in `banner` (an element) meanwhile.
  async waitReady(banner) {
    for (;;) {
      const h = await strata.health();
      if (h.state === "ok") { banner.hidden = true; return h; }
      banner.hidden = false;
      banner.textContent = h.message + (h.state === "loading" ? " (this page goes on by itself when it is ready)" : "");
      banner.className = "banner " + h.state;
      await new Promise((res) => setTimeout(res, 1000));
    }
  },

  // Ask for the key in the page's <dialog id="keydialog"> until the server takes it; `probe` is a path that
  // needs it. Resolves once a request to it succeeds.
  async ensureKey(probe) {
    const dlg = document.getElementById("keydialog");
    const input = document.getElementById("keyinput");
    const note = document.getElementById("keynote");
    for (let attempt = 0; ; attempt++) {
      try { await strata.fetch(probe); if (dlg.open) dlg.close(); return; } catch (e) {
        if (e.status !== 401) throw e;
      }
      note.textContent = attempt === 0 && !strata.key()
        ? "This server needs an API key."
        : "The server refused this key: check it and try again.";
      note.className = attempt === 0 && !strata.key() ? "note" : "note bad";
      input.value = "";
      if (!dlg.open) dlg.showModal();
      input.focus();
      const key = await new Promise((res) => {
        dlg.querySelector("form").onsubmit = (ev) => { ev.preventDefault(); res(input.value.trim()); };
      });
      strata.setKey(key);
    }
  },

  el(tag, attrs, ...children) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "class") e.className = v;
      else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
      else if (v !== undefined && v !== null && v !== false) e.setAttribute(k, v === true ? "" : v);
    }
    for (const c of children) if (c !== null && c !== undefined) e.append(c);
    return e;
  },
};
