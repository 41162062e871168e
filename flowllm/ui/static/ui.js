// flowllm's web page: a playground, the live graph view and a request timeline.
// Plain browser JavaScript, no build step. Every call carries the API key when the
// server wants one (kept for this tab only, in sessionStorage).
"use strict";

const $ = (id) => document.getElementById(id);
const SVG = "http://www.w3.org/2000/svg";
const KEY_STORE = "flowllm.apiKey";

// -- the API key ---------------------------------------------------------------------------

const auth = {
  required: false,
  key: sessionStorage.getItem(KEY_STORE) || "",
  headers(extra) {
    const h = Object.assign({}, extra || {});
    if (this.key) h["Authorization"] = "Bearer " + this.key;
    return h;
  },
  waiting: null,
  ask(message) {
    // One dialog for every caller that needs the key; resolves once a key is entered.
    if (this.waiting) return this.waiting;
    $("key-message").textContent = message;
    $("api-key").value = "";
    $("key-dialog").showModal();
    this.waiting = new Promise((resolve) => {
      $("key-form").addEventListener("submit", () => {
        this.key = $("api-key").value.trim();
        sessionStorage.setItem(KEY_STORE, this.key);
        this.waiting = null;
        resolve();
      }, { once: true });
    });
    return this.waiting;
  },
};

// fetch() with the key; a 401 asks for the key once and retries.
async function api(path, options) {
  for (;;) {
    const opts = Object.assign({}, options || {});
    opts.headers = auth.headers(opts.headers);
    const response = await fetch(path, opts);
    if (response.status !== 401) return response;
    await auth.ask(auth.key ? "The key was refused: enter the server's API key."
                            : "This server asks for an API key.");
  }
}

async function errorText(response) {
  try {
    const body = await response.json();
    if (body && body.error) return body.error.message;
  } catch (e) { /* not JSON */ }
  return response.status + " " + response.statusText;
}

// Server-sent events over fetch (EventSource cannot send the Authorization header).
async function* sseEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      let event = "message";
      const data = [];
      for (const line of block.split("\n")) {
        if (line.startsWith("event:")) event = line.slice(6).trim();
        else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
      }
      if (data.length) yield { event, data: data.join("\n") };
    }
  }
}

// -- formatting ----------------------------------------------------------------------------

function fmtSeconds(s) {
  if (s === null || s === undefined) return "–";
  if (s < 1e-3) return (s * 1e6).toFixed(0) + " µs";
  if (s < 1) return (s * 1e3).toFixed(s < 0.01 ? 2 : 1) + " ms";
  return s.toFixed(2) + " s";
}
function fmtRate(r) { return r === null || r === undefined ? "–" : r < 10 ? r.toFixed(1) : r.toFixed(0); }
function fmtPercent(f) {
  if (f === null || f === undefined) return "–";
  return (f * 100).toFixed(f > 0 && f < 0.1 ? 1 : 0) + "%";
}
function el(tag, attrs, text) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}
function svg(tag, attrs, text) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

// -- views ---------------------------------------------------------------------------------

function showView(name) {
  for (const tab of document.querySelectorAll(".tab")) {
    tab.classList.toggle("active", tab.dataset.view === name);
  }
  for (const view of document.querySelectorAll(".view")) {
    view.hidden = view.id !== "view-" + name;
  }
  if (name === "timeline") timeline.refreshList();
}

// -- playground ----------------------------------------------------------------------------

const play = {
  model: null,
  history: [],  // the chat so far: {role, content}
  controller: null,
  lastRequestId: null,

  mode() { return $("mode-chat").checked ? "chat" : "completion"; },

  // The request body from the form; only what the user set beyond the defaults.
  body() {
    const body = { model: this.model, stream: true, stream_options: { include_usage: true } };
    const num = (id) => $(id).value.trim() === "" ? null : Number($(id).value);
    body.temperature = num("temperature");
    body.top_p = num("top_p");
    body.top_k = num("top_k");
    body.max_tokens = num("max_tokens");
    const seed = num("seed");
    if (seed !== null) body.seed = seed;
    const stop = $("stop-strings").value.split("\n").filter((s) => s.length > 0);
    if (stop.length) body.stop = stop;
    const top = num("top_logprobs") || 0;
    const prompt = $("prompt").value;
    if (this.mode() === "chat") {
      const messages = [];
      const system = $("system").value.trim();
      if (system) messages.push({ role: "system", content: system });
      messages.push(...this.history);
      if (prompt) messages.push({ role: "user", content: prompt });
      body.messages = messages;
      body.logprobs = true;
      body.top_logprobs = top;
    } else {
      body.prompt = prompt;
      body.logprobs = top;
    }
    for (const k of Object.keys(body)) if (body[k] === null) delete body[k];
    return body;
  },

  path() { return this.mode() === "chat" ? "/v1/chat/completions" : "/v1/completions"; },

  renderHistory() {
    const box = $("conversation");
    box.textContent = "";
    if (this.mode() !== "chat") return;
    for (const m of this.history) {
      const div = el("div", { class: "msg " + m.role });
      div.append(el("span", { class: "role" }, m.role), document.createTextNode(m.content));
      box.append(div);
    }
  },

  async send() {
    const body = this.body();
    const chat = this.mode() === "chat";
    const prompt = $("prompt").value;
    const answer = $("answer");
    answer.textContent = "";
    $("stats").textContent = "";
    $("error").hidden = true;
    $("send").disabled = true;
    $("stop").disabled = false;
    this.controller = new AbortController();
    const started = performance.now();
    let first = null, last = null, tokens = 0, usage = null, finish = null, text = "";
    let responseId = null;
    try {
      const response = await api(this.path(), {
        method: "POST",
        headers: { "Content-Type": "application/json" },
        body: JSON.stringify(body),
        signal: this.controller.signal,
      });
      if (!response.ok) throw new Error(await errorText(response));
      for await (const { event, data } of sseEvents(response)) {
        if (data === "[DONE]") break;
        const chunk = JSON.parse(data);
        if (event === "error" || chunk.error) throw new Error(chunk.error ? chunk.error.message : data);
        responseId = responseId || chunk.id;
        if (chunk.usage) usage = chunk.usage;
        for (const choice of chunk.choices || []) {
          const cut = chat ? chatPieces(choice) : completionPieces(choice);
          for (const piece of cut) {
            if (first === null) first = performance.now();
            last = performance.now();
            tokens += piece.logprob !== undefined ? 1 : 0;
            text += piece.text;
            answer.append(tokenSpan(piece));
          }
          if (choice.finish_reason) finish = choice.finish_reason;
        }
      }
      if (chat) {
        if (prompt) this.history.push({ role: "user", content: prompt });
        this.history.push({ role: "assistant", content: text });
        $("prompt").value = "";
        this.renderHistory();
      }
      const generated = usage ? usage.completion_tokens : tokens;
      const ttft = first === null ? null : (first - started) / 1000;
      const decode = first !== null && last > first ? (last - first) / 1000 : null;
      const rate = decode ? (generated - 1) / decode : null;
      $("stats").textContent = [
        "TTFT " + fmtSeconds(ttft),
        (rate === null ? "–" : rate.toFixed(1)) + " tokens/s",
        generated + " tokens",
        usage ? usage.prompt_tokens + " prompt tokens" : null,
        "finish: " + (finish || "–"),
      ].filter(Boolean).join(" · ");
      $("stats").dataset.ttft = ttft;
      $("stats").dataset.tokensPerS = rate;
      // The graph's id of the request: the response id (completions add the prompt's index).
      this.lastRequestId = responseId ? (chat ? responseId : responseId + "-0") : null;
      timeline.latest = this.lastRequestId;
    } catch (e) {
      if (e.name !== "AbortError") {
        $("error").textContent = e.message;
        $("error").hidden = false;
      }
    } finally {
      $("send").disabled = false;
      $("stop").disabled = true;
      this.controller = null;
    }
  },

  stop() { if (this.controller) this.controller.abort(); },

  snippet(kind) {
    const body = this.body();
    const url = location.origin + this.path();
    if (kind === "curl") {
      const json = JSON.stringify(body, null, 2).replace(/'/g, "'\\''");
      const lines = ["curl -sN " + url, "  -H 'Content-Type: application/json'"];
      if (auth.key) lines.push("  -H \"Authorization: Bearer $FLOWLLM_API_KEY\"");
      lines.push("  -d '" + json + "'");
      return lines.join(" \\\n");
    }
    return pythonSnippet(body, this.mode() === "chat");
  },

  async copy(kind) {
    const text = this.snippet(kind);
    $("snippet-title").textContent = kind === "curl" ? "curl" : "Python (openai)";
    $("snippet").textContent = text;
    $("snippet-box").hidden = false;
    $("snippet").dataset.kind = kind;
    try {
      await navigator.clipboard.writeText(text);
      $("copied").textContent = "copied to the clipboard";
    } catch (e) {
      $("copied").textContent = "select and copy";
    }
  },
};

function pyValue(v) {
  if (v === null || v === undefined) return "None";
  if (v === true) return "True";
  if (v === false) return "False";
  if (Array.isArray(v)) return "[" + v.map(pyValue).join(", ") + "]";
  if (typeof v === "object") {
    return "{" + Object.entries(v).map(([k, x]) => JSON.stringify(k) + ": " + pyValue(x)).join(", ") + "}";
  }
  return JSON.stringify(v);
}

function pythonSnippet(body, chat) {
  // The openai SDK's own arguments; vLLM's extras (top_k) go in extra_body.
  const args = Object.assign({}, body);
  const extra = {};
  if ("top_k" in args) { extra.top_k = args.top_k; delete args.top_k; }
  const lines = [
    "import os",
    "",
    "from openai import OpenAI",
    "",
    "client = OpenAI(base_url=" + JSON.stringify(location.origin + "/v1") +
      ", api_key=os.environ.get(\"FLOWLLM_API_KEY\", \"unused\"))",
    "stream = client." + (chat ? "chat.completions" : "completions") + ".create(",
  ];
  for (const [k, v] of Object.entries(args)) lines.push("    " + k + "=" + pyValue(v) + ",");
  if (Object.keys(extra).length) lines.push("    extra_body=" + pyValue(extra) + ",");
  lines.push(")");
  lines.push("for chunk in stream:");
  lines.push("    for choice in chunk.choices:");
  lines.push("        print(choice." + (chat ? "delta.content or \"\"" : "text") + ", end=\"\", flush=True)");
  lines.push("print()");
  return lines.join("\n");
}

// A chunk's text cut at its tokens: [{text, logprob, top: [[token, logprob]...]}]. A
// token whose text is not in the answer (the end-of-sequence token, whose text the server
// skips) is kept with `special` set; text no token matched stays as it is.
function pieces(text, tokens) {
  const out = [];
  let at = 0;
  for (const t of tokens) {
    if (t.text.length && text.startsWith(t.text, at)) {
      out.push(t);
      at += t.text.length;
    } else {
      out.push(Object.assign({}, t, { special: t.text, text: "" }));
    }
  }
  if (at < text.length) out.push({ text: text.slice(at) });
  return out;
}

function chatPieces(choice) {
  const content = (choice.logprobs && choice.logprobs.content) || [];
  return pieces((choice.delta && choice.delta.content) || "", content.map((t) => ({
    text: t.token, logprob: t.logprob,
    top: (t.top_logprobs || []).map((a) => [a.token, a.logprob]),
  })));
}

function completionPieces(choice) {
  const lp = choice.logprobs;
  const tokens = lp && lp.tokens ? lp.tokens.map((token, i) => ({
    text: token, logprob: lp.token_logprobs[i],
    top: Object.entries((lp.top_logprobs && lp.top_logprobs[i]) || {}),
  })) : [];
  return pieces(choice.text || "", tokens);
}

function tokenSpan(piece) {
  const span = el("span", { class: "tok" }, piece.text);
  if (piece.special !== undefined) {
    // Shown by CSS from the attribute, so it is not part of the answer's text.
    span.classList.add("special");
    span.dataset.label = piece.special;
  }
  if (piece.logprob !== undefined && piece.logprob !== null) {
    span.dataset.logprob = piece.logprob;
    span.dataset.top = JSON.stringify(piece.top || []);
    // Less likely tokens are shaded: p = 1 white, p -> 0 orange.
    const p = Math.exp(piece.logprob);
    span.style.backgroundColor = "rgba(246, 173, 85, " + (0.6 * (1 - p)).toFixed(3) + ")";
  }
  return span;
}

function showTokenTip(event) {
  const span = event.target.closest(".tok");
  const tip = $("token-tip");
  if (!span || span.dataset.logprob === undefined) { tip.hidden = true; return; }
  const chosen = span.dataset.label !== undefined ? span.dataset.label : span.textContent;
  const table = el("table");
  const head = el("tr");
  head.append(el("td", {}, "token"), el("td", {}, "logprob"), el("td", {}, "p"));
  table.append(head);
  const rows = JSON.parse(span.dataset.top);
  if (!rows.some(([t]) => t === chosen)) rows.unshift([chosen, Number(span.dataset.logprob)]);
  for (const [token, logprob] of rows) {
    const tr = el("tr", token === chosen ? { class: "chosen" } : {});
    tr.append(el("td", {}, JSON.stringify(token)), el("td", {}, Number(logprob).toFixed(3)),
      el("td", {}, (Math.exp(logprob) * 100).toFixed(1) + "%"));
    table.append(tr);
  }
  tip.textContent = "";
  tip.append(table);
  tip.hidden = false;
  const box = span.getBoundingClientRect();
  tip.style.left = Math.min(box.left, window.innerWidth - 260) + "px";
  tip.style.top = (box.bottom + 6) + "px";
}

// -- the live graph view -------------------------------------------------------------------

const graph = {
  shape: null,
  boxes: {},   // stage -> {group, busybar, metrics: [text...]}
  edges: {},   // channel -> [{path, label, bg}]
  latest: null,

  async load() {
    const response = await api("/ui/graph");
    if (!response.ok) {
      $("graph-canvas").textContent = await errorText(response);
      return false;
    }
    this.shape = await response.json();
    $("graph-name").textContent = "graph " + this.shape.name;
    $("graph-source").textContent = " (" + this.shape.source + ")";
    this.draw();
    return true;
  },

  // Columns by longest path from the sources; edges that go back (the step loop) are
  // drawn below the boxes.
  layout() {
    const names = this.shape.stages.map((s) => s.name);
    const out = {};
    for (const n of names) out[n] = [];
    for (const e of this.shape.edges) out[e.from].push(e.to);
    const back = new Set(), state = {};
    const visit = (n) => {
      state[n] = 1;
      for (const m of out[n]) {
        if (state[m] === 1) back.add(n + ">" + m);
        else if (!state[m]) visit(m);
      }
      state[n] = 2;
    };
    for (const n of names) if (!state[n]) visit(n);
    const column = {};
    for (const n of names) column[n] = 0;
    for (let pass = 0; pass < names.length; pass++) {
      for (const e of this.shape.edges) {
        if (!back.has(e.from + ">" + e.to) && column[e.to] < column[e.from] + 1) {
          column[e.to] = column[e.from] + 1;
        }
      }
    }
    const rows = {}, row = {};
    for (const n of names) {
      rows[column[n]] = (rows[column[n]] || 0) + 1;
      row[n] = rows[column[n]] - 1;
    }
    return { column, row, back, depth: Math.max(...Object.values(rows)) };
  },

  draw() {
    const W = 150, H = 96, GX = 60, GY = 40, M = 20;
    const { column, row, back, depth } = this.layout();
    const columns = Math.max(...Object.values(column)) + 1;
    // Edges that skip columns arc above the boxes, those that go back below them.
    const skips = this.shape.edges.filter((e) => !back.has(e.from + ">" + e.to) &&
      column[e.to] - column[e.from] > 1).length;
    const TOP = M + 22 * skips;
    const width = M * 2 + columns * W + (columns - 1) * GX;
    const height = TOP + M + depth * H + (depth - 1) * GY + 90;
    const root = svg("svg", { viewBox: `0 0 ${width} ${height}`, role: "img",
      "aria-label": "the stage graph" });
    const defs = svg("defs");
    const marker = svg("marker", { id: "arrow", viewBox: "0 0 10 10", refX: 9, refY: 5,
      markerWidth: 7, markerHeight: 7, orient: "auto-start-reverse" });
    marker.append(svg("path", { d: "M 0 0 L 10 5 L 0 10 z", fill: "#8a96a3" }));
    defs.append(marker);
    root.append(defs);
    const pos = {};
    for (const s of this.shape.stages) {
      pos[s.name] = { x: M + column[s.name] * (W + GX), y: TOP + row[s.name] * (H + GY) };
    }
    const edgeLayer = svg("g"), boxLayer = svg("g"), labelLayer = svg("g");
    root.append(edgeLayer, boxLayer, labelLayer);
    let lane = 0, above = 0;
    this.edges = {};
    for (const e of this.shape.edges) {
      const a = pos[e.from], b = pos[e.to];
      let d, lx, ly;
      if (back.has(e.from + ">" + e.to) || column[e.to] <= column[e.from]) {
        const yb = TOP + depth * H + (depth - 1) * GY + 20 + 22 * lane++;
        const x1 = a.x + W / 2 + 10, x2 = b.x + W / 2 - 10;
        d = `M ${x1} ${a.y + H} C ${x1} ${yb}, ${x2} ${yb}, ${x2} ${b.y + H}`;
        lx = (x1 + x2) / 2; ly = yb - 3;
      } else if (column[e.to] - column[e.from] > 1) {
        const yt = TOP - 16 - 22 * above++;
        const x1 = a.x + W / 2 + 10, x2 = b.x + W / 2 - 10;
        d = `M ${x1} ${a.y} C ${x1} ${yt}, ${x2} ${yt}, ${x2} ${b.y}`;
        lx = (x1 + x2) / 2; ly = yt + 4;
      } else {
        const x1 = a.x + W, y1 = a.y + H / 2 + (row[e.to] - row[e.from]) * 8;
        const x2 = b.x, y2 = b.y + H / 2 + (row[e.from] - row[e.to]) * 8;
        const mx = (x1 + x2) / 2;
        d = `M ${x1} ${y1} C ${mx} ${y1}, ${mx} ${y2}, ${x2} ${y2}`;
        lx = mx; ly = (y1 + y2) / 2 - 4;
      }
      const path = svg("path", { d, class: "edge", "marker-end": "url(#arrow)" });
      path.append(svg("title", {}, `${e.from}.${e.port} -> ${e.channel} (capacity ${e.capacity})`));
      edgeLayer.append(path);
      const bg = svg("rect", { class: "depth-bg", x: lx - 18, y: ly - 11, width: 36, height: 14, rx: 3 });
      const label = svg("text", { class: "depth", x: lx, y: ly, "text-anchor": "middle",
        "data-channel": e.channel }, `–/${e.capacity}`);
      labelLayer.append(bg, label);
      (this.edges[e.channel] = this.edges[e.channel] || []).push({ path, label, capacity: e.capacity });
    }
    this.boxes = {};
    for (const s of this.shape.stages) {
      const { x, y } = pos[s.name];
      const g = svg("g", { "data-stage": s.name });
      const rect = svg("rect", { class: "box" + (s.process ? " process-" + s.process : ""),
        x, y, width: W, height: H, rx: 6 });
      rect.append(svg("title", {}, `${s.name}: ${s.use}` + (s.replicas > 1 ? ` ×${s.replicas}` : "") +
        `\nsupervision: ${s.on_error} (group ${s.group})` +
        (s.process ? `\nprocess: ${s.process}` : "")));
      const busybar = svg("rect", { class: "busybar", x, y: y + H - 5, width: 0, height: 5, rx: 2 });
      const name = svg("text", { class: "name", x: x + 8, y: y + 18 },
        s.name + (s.replicas > 1 ? ` ×${s.replicas}` : ""));
      const lines = [0, 1, 2, 3].map((i) => svg("text", { class: "metric", x: x + 8, y: y + 36 + i * 14 }));
      g.append(rect, busybar, name, ...lines);
      if (s.process) {
        g.append(svg("text", { class: "process", x: x + W - 8, y: y + 18, "text-anchor": "end",
          "data-process": s.process }, s.process));
      }
      boxLayer.append(g);
      this.boxes[s.name] = { rect, busybar, lines, width: W };
    }
    const canvas = $("graph-canvas");
    canvas.textContent = "";
    canvas.append(root);
    this.renderTable();
  },

  renderTable() {
    const body = document.querySelector("#stage-table tbody");
    body.textContent = "";
    for (const s of this.shape.stages) {
      const tr = el("tr", { "data-stage": s.name });
      tr.append(el("td", {}, s.name));
      for (const key of ["busy", "rate", "p50", "messages", "errors", "restarts"]) {
        tr.append(el("td", { "data-key": key }, "–"));
      }
      body.append(tr);
    }
  },

  update(snap) {
    this.latest = snap;
    const engine = snap.engine || {};
    $("eng-running").textContent = engine.running ?? "–";
    $("eng-waiting").textContent = engine.waiting ?? "–";
    $("eng-kv").textContent = fmtPercent(engine.kv_cache_usage);
    $("eng-tps").textContent = engine.tokens_per_s == null ? "–" : fmtRate(engine.tokens_per_s) + " tok/s";
    $("graph-updated").textContent = "updated " + new Date(snap.time * 1000).toLocaleTimeString();
    if (!this.shape) return;
    for (const [name, st] of Object.entries(snap.stages)) {
      const box = this.boxes[name];
      const tr = document.querySelector(`#stage-table tr[data-stage="${CSS.escape(name)}"]`);
      const values = {
        busy: fmtPercent(st.busy), rate: fmtRate(st.rate), p50: fmtSeconds(st.p50_s),
        messages: String(st.messages), errors: String(st.errors), restarts: String(st.restarts),
      };
      if (tr) for (const [k, v] of Object.entries(values)) tr.querySelector(`[data-key="${k}"]`).textContent = v;
      if (!box) continue;
      box.lines[0].textContent = `busy ${values.busy}`;
      box.lines[1].textContent = `${values.rate} msg/s · p50 ${values.p50}`;
      box.lines[2].textContent = `${values.messages} messages`;
      box.lines[3].textContent = `errors ${values.errors} · restarts ${values.restarts}`;
      box.busybar.setAttribute("width", String(Math.round((st.busy || 0) * box.width)));
      box.rect.classList.toggle("busy", (st.busy || 0) > 0.8);
      box.rect.classList.toggle("failing", st.errors > 0 || st.restarts > 0);
    }
    for (const [channel, c] of Object.entries(snap.channels)) {
      for (const edge of this.edges[channel] || []) {
        edge.label.textContent = `${c.depth}/${c.capacity}`;
        edge.path.classList.toggle("full", c.depth >= c.capacity);
        edge.path.classList.toggle("queued", c.depth > 0 && c.depth < c.capacity);
      }
    }
  },
};

// The feed: one snapshot a second while the page is open; reconnects after a failure.
async function followFeed() {
  for (;;) {
    try {
      const response = await api("/ui/feed");
      if (response.ok) {
        $("feed-state").className = "feed-state on";
        for await (const { event, data } of sseEvents(response)) {
          if (event === "message") graph.update(JSON.parse(data));
        }
      }
    } catch (e) { /* the server went away: retry below */ }
    $("feed-state").className = "feed-state off";
    await new Promise((resolve) => setTimeout(resolve, 3000));
  }
}

// -- the request timeline ------------------------------------------------------------------

const timeline = {
  latest: null,   // the playground's last request
  file: null,     // trace events loaded from a file, when one was opened

  async refreshList() {
    const select = $("timeline-request");
    let ids = [];
    if (this.file) {
      const seen = new Set();
      for (const e of this.file.traceEvents) {
        if (e.ph === "X") for (const id of (e.args && e.args.request_ids) || []) seen.add(id);
      }
      ids = [...seen];
    } else {
      const response = await api("/ui/timeline");
      if (response.ok) ids = (await response.json()).requests.slice().reverse();
    }
    const keep = this.file ? select.value : (this.latest || select.value);
    select.textContent = "";
    for (const id of ids) select.append(el("option", { value: id }, id + (id === this.latest ? " (last answer)" : "")));
    if (ids.includes(keep)) select.value = keep;
    if (ids.length) await this.show(select.value);
    else {
      $("timeline").textContent = "";
      $("timeline-summary").textContent = "No request yet: spans are kept for requests that ran while this page was open.";
    }
  },

  async show(requestId) {
    let data;
    if (this.file) {
      data = this.file;
    } else {
      const response = await api("/ui/timeline/" + encodeURIComponent(requestId));
      if (!response.ok) { $("timeline-summary").textContent = await errorText(response); return; }
      data = await response.json();
    }
    this.render(data, requestId);
  },

  // One lane per stage (the trace's thread names, in order); a bar per span, its queue
  // wait hatched before it.
  render(data, requestId) {
    const events = data.traceEvents;
    const lanes = new Map();
    for (const e of events) {
      if (e.ph === "M" && e.name === "thread_name") lanes.set(e.tid, { name: e.args.name, spans: [] });
    }
    const spans = events.filter((e) => e.ph === "X" && (e.args.request_ids || []).includes(requestId));
    if (!spans.length) { $("timeline-summary").textContent = "No spans for " + requestId; return; }
    const start = Math.min(...spans.map((e) => e.ts - (e.args.queue_wait_us || 0)));
    const end = Math.max(...spans.map((e) => e.ts + e.dur));
    const total = Math.max(end - start, 1);
    for (const e of spans) {
      if (!lanes.has(e.tid)) lanes.set(e.tid, { name: e.cat, spans: [] });
      lanes.get(e.tid).spans.push(e);
    }
    const box = $("timeline");
    box.textContent = "";
    const axis = el("div", { class: "axis" });
    for (let i = 0; i <= 4; i++) {
      const tick = el("span", {}, fmtSeconds((total * i) / 4 / 1e6));
      tick.style.left = (i * 25) + "%";
      axis.append(tick);
    }
    box.append(axis);
    const tbody = document.querySelector("#timeline-table tbody");
    tbody.textContent = "";
    const pct = (us) => ((us - start) / total) * 100;
    for (const [, laneData] of [...lanes.entries()].sort((a, b) => a[0] - b[0])) {
      const lane = el("div", { class: "lane", "data-stage": laneData.name });
      const track = el("div", { class: "track" });
      lane.append(el("span", { class: "label" }, laneData.name), track);
      let busy = 0, wait = 0;
      for (const e of laneData.spans) {
        const waitUs = e.args.queue_wait_us || 0;
        busy += e.dur; wait += waitUs;
        if (waitUs > 0) {
          const w = el("div", { class: "span wait" });
          w.style.left = pct(e.ts - waitUs) + "%";
          w.style.width = (waitUs / total) * 100 + "%";
          track.append(w);
        }
        const bar = el("div", { class: "span", title:
          `${e.name}\n${laneData.name}: ${fmtSeconds(e.dur / 1e6)} (waited ${fmtSeconds(waitUs / 1e6)})` });
        bar.style.left = pct(e.ts) + "%";
        bar.style.width = (e.dur / total) * 100 + "%";
        track.append(bar);
      }
      box.append(lane);
      const tr = el("tr", { "data-stage": laneData.name });
      tr.append(el("td", {}, laneData.name), el("td", {}, String(laneData.spans.length)),
        el("td", {}, fmtSeconds(busy / 1e6)), el("td", {}, fmtSeconds(wait / 1e6)));
      tbody.append(tr);
    }
    const other = data.otherData || {};
    $("timeline-summary").textContent = `${requestId}: ${spans.length} spans over ${fmtSeconds(total / 1e6)}` +
      (other.truncated ? " (only its first spans were kept)" : "");
  },

  async openFile(file) {
    const data = JSON.parse(await file.text());
    if (!data || !Array.isArray(data.traceEvents)) throw new Error("not a trace-event JSON file");
    this.file = data;
    await this.refreshList();
  },
};

// -- start ---------------------------------------------------------------------------------

async function start() {
  for (const tab of document.querySelectorAll(".tab")) {
    tab.addEventListener("click", () => showView(tab.dataset.view));
  }
  $("send").addEventListener("click", () => play.send());
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) play.send();
  });
  $("stop").addEventListener("click", () => play.stop());
  $("clear").addEventListener("click", () => {
    play.history = []; play.renderHistory(); $("answer").textContent = ""; $("stats").textContent = "";
  });
  for (const id of ["mode-chat", "mode-completion"]) {
    $(id).addEventListener("change", () => {
      $("system-row").hidden = play.mode() !== "chat";
      $("prompt").placeholder = play.mode() === "chat" ? "Message" : "Prompt";
      play.renderHistory();
    });
  }
  $("temperature").addEventListener("input", () => { $("temperature-range").value = $("temperature").value; });
  $("temperature-range").addEventListener("input", () => { $("temperature").value = $("temperature-range").value; });
  $("copy-curl").addEventListener("click", () => play.copy("curl"));
  $("copy-python").addEventListener("click", () => play.copy("python"));
  $("answer").addEventListener("mouseover", showTokenTip);
  $("answer").addEventListener("mouseleave", () => { $("token-tip").hidden = true; });
  $("timeline-request").addEventListener("change", () => timeline.show($("timeline-request").value));
  $("timeline-refresh").addEventListener("click", () => { timeline.file = null; timeline.refreshList(); });
  $("trace-file").addEventListener("change", async () => {
    const file = $("trace-file").files[0];
    if (!file) return;
    try { await timeline.openFile(file); } catch (e) { $("timeline-summary").textContent = e.message; }
  });
  $("key-button").addEventListener("click", () => auth.ask("Enter the server's API key."));

  const info = await (await fetch("/ui/auth")).json();
  auth.required = info.api_key_required;
  $("key-button").hidden = !auth.required;
  if (auth.required && !auth.key) await auth.ask("This server asks for an API key.");
  const models = await api("/v1/models");
  if (models.ok) {
    const list = await models.json();
    play.model = list.data[0].id;
    $("model-name").textContent = play.model;
  }
  if (await graph.load()) followFeed();
  document.body.dataset.ready = "true";
}

start();
