// A small Markdown renderer for model replies: the text is HTML-escaped first, then fenced code (highlighted),
// inline code, emphasis, links (http/https only), headings, lists, quotes and paragraphs are turned into tags. So
// nothing the model writes becomes markup the page did not make. An unterminated fence (a reply still streaming)
// renders as code up to the end.
"use strict";

const md = (() => {
  const esc = (s) => s.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;")
    .replace(/"/g, "&quot;").replace(/'/g, "&#39;");

  const KEYWORDS = new Set(("and as assert async await break case catch class const continue def default del do elif " +
    "else enum except export extends false finally fn for from func function go if impl import in interface is " +
    "lambda let loop match mod mut new nil none None not null or package pass pub raise return self static struct " +
    "super switch this throw true True False try type typeof use var void while with yield").split(" "));

  // one pass over the code: comments, strings, numbers and keywords get a class (the rest stays plain)
  function highlight(code) {
    const re = /(#[^\n]*|\/\/[^\n]*|\/\*[\s\S]*?\*\/)|("""[\s\S]*?(?:"""|$)|\'\'\'[\s\S]*?(?:\'\'\'|$)|"(?:\\.|[^"\\\n])*"|'(?:\\.|[^'\\\n])*'|`(?:\\.|[^`\\])*`)|(\b\d[\d_]*(?:\.\d+)?(?:e[+-]?\d+)?\b)|([A-Za-z_][A-Za-z0-9_]*)/g;
    let out = "", last = 0, m;
    while ((m = re.exec(code)) !== null) {
      out += esc(code.slice(last, m.index));
      const t = esc(m[0]);
      if (m[1]) out += '<span class="hl-c">' + t + "</span>";
      else if (m[2]) out += '<span class="hl-s">' + t + "</span>";
      else if (m[3]) out += '<span class="hl-n">' + t + "</span>";
      else if (KEYWORDS.has(m[4])) out += '<span class="hl-k">' + t + "</span>";
      else out += t;
      last = re.lastIndex;
    }
    return out + esc(code.slice(last));
  }

  function inline(s) {  // s is escaped already, and holds no NUL (render replaced them): the placeholders are unique
    const codes = [];
    s = s.replace(/`([^`\n]+)`/g, (_, c) => { codes.push(c); return "\u0000" + (codes.length - 1) + "\u0000"; });
    // (a link's URL stops short of a placeholder: a code span's tags never land inside an href)
    s = s.replace(/\*\*([^*\n]+)\*\*/g, "<strong>$1</strong>")
      .replace(/(^|[^*\w])\*([^*\n]+)\*(?!\w)/g, "$1<em>$2</em>")
      .replace(/\[([^\]\n]+)\]\((https?:\/\/[^\s)\u0000]+)\)/g, '<a href="$2" target="_blank" rel="noopener noreferrer">$1</a>');
    return s.replace(/\u0000(\d+)\u0000/g, (_, i) => "<code>" + codes[+i] + "</code>");
  }

  function blocks(text) {
    const lines = esc(text).split("\n");
    let html = "", para = [], list = null;
    const flushPara = () => { if (para.length) { html += "<p>" + inline(para.join("\n")).replace(/\n/g, "<br>") + "</p>"; para = []; } };
    const flushList = () => { if (list) { html += "<" + list.tag + ">" + list.items.map((i) => "<li>" + inline(i) + "</li>").join("") + "</" + list.tag + ">"; list = null; } };
    for (const line of lines) {
      let m;
      if (!line.trim()) { flushPara(); flushList(); continue; }
      if ((m = /^(#{1,6})\s+(.*)$/.exec(line))) { flushPara(); flushList(); html += "<h" + m[1].length + ">" + inline(m[2]) + "</h" + m[1].length + ">"; continue; }
      if ((m = /^\s*[-*+]\s+(.*)$/.exec(line)) || (m = /^\s*\d+[.)]\s+(.*)$/.exec(line))) {
        flushPara();
        const tag = /^\s*\d/.test(line) ? "ol" : "ul";
        if (list && list.tag !== tag) flushList();
        if (!list) list = { tag, items: [] };
        list.items.push(m[1]);
        continue;
      }
      if ((m = /^&gt;\s?(.*)$/.exec(line))) { flushPara(); flushList(); html += "<blockquote>" + inline(m[1]) + "</blockquote>"; continue; }
      flushList();
      para.push(line);
    }
    flushPara(); flushList();
    return html;
  }

  function render(text) {
    // inline() marks code spans as NUL + index + NUL: a NUL in the text itself would read as one of them (another
    // span's code, or "undefined"). An HTML parser drops NULs anyway; U+FFFD (what they decode as) shows one was there.
    let html = "", rest = (text || "").replace(/\u0000/g, "\uFFFD");
    for (;;) {
      const start = rest.search(/^```/m);
      if (start < 0) { html += blocks(rest); break; }
      html += blocks(rest.slice(0, start));
      const after = rest.slice(start + 3);
      const nl = after.indexOf("\n");
      const lang = nl < 0 ? after.trim() : after.slice(0, nl).trim();
      const body = nl < 0 ? "" : after.slice(nl + 1);
      const end = body.search(/^```/m);
      const code = end < 0 ? body : body.slice(0, end);
      html += '<pre><code class="lang-' + esc(lang.replace(/[^A-Za-z0-9_+-]/g, "")) + '">' + highlight(code.replace(/\n$/, "")) + "</code></pre>";
      if (end < 0) break;
      const tail = body.slice(end + 3);
      rest = tail.slice(tail.indexOf("\n") + 1 || tail.length);
    }
    return html;
  }

  return { render, escape: esc, highlight };
})();
