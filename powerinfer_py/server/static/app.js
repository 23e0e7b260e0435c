// The chat page of powerinfer_py.server: plain JavaScript, no dependencies, nothing fetched
// from elsewhere. URLs are relative to the page, so it works behind --root_path too.
"use strict";

const $ = (id) => document.getElementById(id);
const state = {
  history: [],          // chat messages sent so far ({role, content})
  controller: null,     // the running request's AbortController
  props: null,          // GET /props
  prevLayers: null,     // last poll's per-layer counts: [[active, total], ...]
  shares: null,         // per-layer shares last drawn
  overall: [],          // overall share per poll with sparse steps (the sparkline)
};

function headers(json) {
  const h = {};
  if (json) h["Content-Type"] = "application/json";
  const key = $("api-key").value.trim() || localStorage.getItem("powerinfer-api-key") || "";
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

async function api(path, options = {}) {
  const r = await fetch(path, { ...options, headers: headers(options.body !== undefined) });
  if (r.status === 401) throw new Error("the server needs an API key (Settings)");
  return r;
}

// ---- the model's facts ---------------------------------------------------------------------

async function loadProps() {
  try {
    const r = await api("props");
    if (!r.ok) throw new Error("GET /props: " + r.status);
    const p = await r.json();
    state.props = p;
    const file = (p.model_path || "?").split("/").pop();
    const alias = (p.model_alias || file).split("/").pop();
    $("model-name").textContent = alias === file ? file : alias + " (" + file + ")";
    $("model-name").title = p.model_path || alias;
    const facts = [
      ["engine", p.engine], ["sparse mode", p.sparse_mode], ["kernels", p.sparse_kernels],
      ["slots", p.total_slots], ["n_ctx", (p.default_generation_settings || {}).n_ctx],
    ].filter(([, v]) => v !== null && v !== undefined);
    $("facts").replaceChildren(...facts.map(([k, v]) => {
      const s = document.createElement("span");
      s.textContent = k + ": " + v;
      return s;
    }));
  } catch (e) {
    $("model-name").textContent = "(" + e.message + ")";
    setTimeout(loadProps, 2000);  // loading: /props answers 503 until the model is in
  }
}

// ---- chat ------------------------------------------------------------------------------------

function addMessage(role, text) {
  const hint = document.querySelector("#messages .hint");
  if (hint) hint.remove();
  const div = document.createElement("div");
  div.className = "msg " + role;
  const body = document.createElement("span");
  body.className = "text";
  body.textContent = text;
  div.appendChild(body);
  $("messages").appendChild(div);
  $("messages").scrollTop = $("messages").scrollHeight;
  return div;
}

function setMeta(div, text) {
  let meta = div.querySelector(".meta");
  if (!meta) {
    meta = document.createElement("small");
    meta.className = "meta";
    div.appendChild(meta);
  }
  meta.textContent = text;
}

// Server-sent events of a fetch body, one `data:` payload at a time.
async function* sseData(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data: ")).map((l) => l.slice(6)).join("\n");
      if (data) yield data;
    }
  }
}

async function send(text) {
  const system = $("system").value.trim();
  state.history.push({ role: "user", content: text });
  addMessage("user", text);
  const div = addMessage("assistant", "");
  div.classList.add("streaming");
  const out = div.querySelector(".text");
  const messages = (system ? [{ role: "system", content: system }] : []).concat(state.history);
  const body = {
    messages, stream: true,
    max_tokens: parseInt($("max-tokens").value, 10) || 256,
    temperature: parseFloat($("temperature").value) || 0,
  };
  state.controller = new AbortController();
  $("send").disabled = true;
  $("stop").disabled = false;
  let n = 0, first = 0, last = 0, reply = "";
  try {
    const r = await fetch("v1/chat/completions", {
      method: "POST", headers: headers(true), body: JSON.stringify(body), signal: state.controller.signal,
    });
    if (!r.ok) {
      const err = await r.json().catch(() => ({}));
      throw new Error((err.error && err.error.message) || ("HTTP " + r.status));
    }
    for await (const data of sseData(r)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      const delta = ((chunk.choices || [])[0] || {}).delta || {};
      if (delta.content) {
        const now = performance.now();
        if (!n) first = now;
        last = now;
        n += 1;
        reply += delta.content;
        out.textContent = reply;
        $("messages").scrollTop = $("messages").scrollHeight;
        if (n > 1) $("tps").textContent = ((n - 1) / ((last - first) / 1000)).toFixed(1);
      }
    }
  } catch (e) {
    if (e.name !== "AbortError") {
      div.classList.add("error");
      out.textContent = reply + (reply ? "\n" : "") + "Error: " + e.message;
    }
  } finally {
    state.controller = null;
    $("send").disabled = false;
    $("stop").disabled = true;
    div.classList.remove("streaming");
    div.classList.add("done");
  }
  if (reply) state.history.push({ role: "assistant", content: reply });
  const speed = n > 1 ? ", " + ((n - 1) / ((last - first) / 1000)).toFixed(1) + " tokens/s" : "";
  setMeta(div, n + " tokens" + speed);
}

$("composer").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || state.controller) return;
  $("prompt").value = "";
  send(text);
});
$("prompt").addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey) {
    ev.preventDefault();
    $("composer").requestSubmit();
  }
});
$("stop").addEventListener("click", () => state.controller && state.controller.abort());
$("clear").addEventListener("click", () => {
  state.history = [];
  $("messages").replaceChildren();
});
$("api-key").addEventListener("change", () => localStorage.setItem("powerinfer-api-key", $("api-key").value.trim()));

// ---- /metrics: speed and the sparse share ------------------------------------------------------

function parseMetrics(text) {
  const scalars = {}, layers = {};
  for (const line of text.split("\n")) {
    if (!line || line[0] === "#") continue;
    const m = line.match(/^(\w+)(?:\{layer="(\d+)"\})?\s+(\S+)$/);
    if (!m) continue;
    const value = parseFloat(m[3]);
    if (m[2] === undefined) scalars[m[1]] = value;
    else (layers[m[1]] = layers[m[1]] || [])[parseInt(m[2], 10)] = value;
  }
  return { scalars, layers };
}

async function pollMetrics() {
  try {
    const r = await api("metrics");
    if (r.ok) update(parseMetrics(await r.text()));
  } catch (e) { /* the next poll tries again */ }
  setTimeout(pollMetrics, 1000);
}

function update({ scalars, layers }) {
  const tps = scalars.powerinfer_tokens_per_second;
  if (tps !== undefined) $("server-tps").textContent = tps.toFixed(1);
  if (scalars.powerinfer_slots_total !== undefined) {
    $("slots").textContent = (scalars.powerinfer_slots_busy || 0) + " / " + scalars.powerinfer_slots_total;
  }
  const active = layers.powerinfer_sparse_layer_neurons_active_total;
  const total = layers.powerinfer_sparse_layer_neurons_total;
  if (!active || !total) {
    const mode = state.props ? state.props.sparse_mode : null;
    $("sparse-note").textContent = mode === "dense" || mode === null
      ? "Dense model: every FFN neuron is computed, so there is no sparse share to plot. Serve a sparse model "
        + "(a PowerInfer GGUF, or one made by `powerinfer sparsify`) to see it here."
      : "Sparse mode " + mode + ": no sparse step yet (prompts run dense; the share shows once tokens are generated).";
    drawBars(null);
    $("sparse-history").hidden = true;
    return;
  }
  $("sparse-history").hidden = false;
  const counts = total.map((t, i) => [active[i] || 0, t || 0]);
  const prev = state.prevLayers;
  let shares, live = false;
  if (prev && prev.length === counts.length) {
    const d = counts.map(([a, t], i) => [a - prev[i][0], t - prev[i][1]]);
    if (d.some(([, t]) => t > 0) && d.every(([, t]) => t >= 0)) {
      shares = d.map(([a, t]) => (t > 0 ? a / t : null));
      live = true;
      const sum = d.reduce((s, [a, t]) => [s[0] + a, s[1] + t], [0, 0]);
      state.overall.push(sum[0] / sum[1]);
      if (state.overall.length > 120) state.overall.shift();
    }
  }
  const since = live ? "over the last second" : state.shares ? "over the last second with sparse steps" : "since the start";
  if (!shares) shares = state.shares || counts.map(([a, t]) => (t > 0 ? a / t : null));
  state.prevLayers = counts;
  state.shares = shares;
  const all = counts.reduce((s, [a, t]) => [s[0] + a, s[1] + t], [0, 0]);
  const mode = state.props ? state.props.sparse_mode : "?";
  // Input mode counts the matrices' input entries read, the other modes FFN neurons.
  const what = mode === "input" ? "of the matrices' input entries read" : "of FFN neurons computed";
  $("sparse-note").textContent = "Per layer, " + since + "; "
    + (100 * all[0] / all[1]).toFixed(1) + "% " + what + " since the start (sparse mode " + mode + ").";
  drawBars(shares);
  drawHistory();
}

function drawBars(shares) {
  const c = $("sparse-plot"), g = c.getContext("2d");
  const W = c.width, H = c.height, left = 28, bottom = 16;
  g.clearRect(0, 0, W, H);
  g.font = "10px sans-serif";
  g.fillStyle = "#6b7383";
  g.strokeStyle = "#dde1e8";
  for (const y of [0, 0.5, 1]) {
    const py = H - bottom - y * (H - bottom - 6);
    g.beginPath(); g.moveTo(left, py); g.lineTo(W, py); g.stroke();
    g.fillText(y * 100 + "%", 0, py + 3);
  }
  if (!shares) {
    g.fillText("no sparse steps", left + 8, (H - bottom) / 2);
    return;
  }
  const n = shares.length, w = (W - left) / n;
  shares.forEach((s, i) => {
    if (s === null) return;
    const h = s * (H - bottom - 6);
    g.fillStyle = "#3a8f5c";
    g.fillRect(left + i * w + 1, H - bottom - h, Math.max(w - 2, 1), h);
  });
  g.fillStyle = "#6b7383";
  const step = Math.max(1, Math.ceil(n / 8));
  for (let i = 0; i < n; i += step) g.fillText(String(i), left + i * w + 1, H - 3);
}

function drawHistory() {
  const c = $("sparse-history"), g = c.getContext("2d");
  const W = c.width, H = c.height, v = state.overall;
  g.clearRect(0, 0, W, H);
  g.fillStyle = "#6b7383";
  g.font = "10px sans-serif";
  g.fillText("overall share, per second", 4, 11);
  if (v.length < 2) return;
  g.strokeStyle = "#2f6fdf";
  g.beginPath();
  v.forEach((s, i) => {
    const x = (i / (v.length - 1)) * W, y = H - 2 - s * (H - 16);
    if (i) g.lineTo(x, y); else g.moveTo(x, y);
  });
  g.stroke();
}

loadProps();
pollMetrics();
