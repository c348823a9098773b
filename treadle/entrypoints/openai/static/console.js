// treadle console: a chat playground over /v1/chat/completions (streamed), and a dashboard
// polling /v1/engine/status. Plain browser JavaScript: no build step, nothing from a CDN.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { model: null, conversation: [], busy: false, timer: null, keyRequired: false, needsKey: false };

// -- the API key, kept in this browser only --------------------------------------------------
$("api-key").value = localStorage.getItem("treadle-api-key") || "";
$("api-key").addEventListener("change", () => {
  localStorage.setItem("treadle-api-key", $("api-key").value);
  keyChanged();
});

function headers() {
  const h = { "Content-Type": "application/json" };
  if ($("api-key").value) h.Authorization = "Bearer " + $("api-key").value;
  return h;
}

async function errorText(resp) {
  try {
    const body = await resp.json();
    return (body.error && body.error.message) || resp.statusText;
  } catch (e) {
    return resp.statusText;
  }
}

function explain(status, message) {
  return status === 401 ? "401: the server needs its API key (enter it above): " + message
                        : status + ": " + message;
}

// -- tabs --------------------------------------------------------------------------------------
for (const tab of document.querySelectorAll(".tab")) {
  tab.addEventListener("click", () => {
    for (const t of document.querySelectorAll(".tab")) t.classList.toggle("active", t === tab);
    for (const v of document.querySelectorAll(".view")) v.hidden = v.id !== tab.dataset.view;
    if (dashboardOnScreen()) poll();
    else clearTimeout(state.timer);
  });
}

// -- playground --------------------------------------------------------------------------------
function samplingFields() {
  const body = {
    temperature: Number($("temperature").value),
    top_p: Number($("top-p").value),
    max_tokens: Number($("max-tokens").value),
  };
  const stop = $("stop").value.split(",").map((s) => s.trim()).filter(Boolean);
  if (stop.length) body.stop = stop;
  if ($("seed").value !== "") body.seed = Number($("seed").value);
  // Drafts never change the output, only its speed: vLLM's per-request extras turn them off.
  if (!$("spec-toggle").hidden && !$("speculation").checked) body.vllm_xargs = { speculative_decoding: false };
  return body;
}

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = "message " + role;
  const body = document.createElement("div");
  body.className = "text";
  body.textContent = text;
  div.appendChild(body);
  $("messages").appendChild(div);
  $("messages").scrollTop = $("messages").scrollHeight;
  return div;
}

function tokenColour(logprob) {
  const p = Math.exp(Math.max(logprob, -20));   // 1: green, 0: red
  return `hsl(${Math.round(120 * p)}, 75%, 82%)`;
}

// A thinking model's chain of thought (the server's --reasoning-parser splits it off) goes in
// a fold above the answer; the token view shows every token of the reply, the thought's too.
function renderReasoning(div, answer, hide) {
  let fold = div.querySelector(".reasoning");
  if (!answer.reasoning) return;
  if (!fold) {
    fold = document.createElement("details");
    fold.className = "reasoning";
    fold.open = true;
    const summary = document.createElement("summary");
    summary.textContent = "Reasoning";
    fold.append(summary, document.createElement("div"));
    div.prepend(fold);
  }
  fold.lastChild.textContent = answer.reasoning;
  fold.hidden = hide;
}

function renderAnswer(div, answer) {
  const body = div.querySelector(".text");
  body.textContent = "";
  const tokenView = $("show-tokens").checked && answer.tokens.length > 0;
  renderReasoning(div, answer, tokenView);
  if (tokenView) {
    for (const t of answer.tokens) {
      const span = document.createElement("span");
      span.className = "token";
      span.textContent = t.token;
      span.title = `logprob ${t.logprob.toFixed(3)}`;
      span.style.background = tokenColour(t.logprob);
      body.appendChild(span);
    }
  } else {
    body.textContent = answer.text;
  }
}

async function* sseEvents(resp) {
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}

async function send(text) {
  state.conversation.push({ role: "user", content: text });
  addMessage("user", text);
  const div = addMessage("assistant", "");
  div.dataset.state = "streaming";
  const stats = document.createElement("div");
  stats.className = "answer-stats";
  div.appendChild(stats);
  const answer = { text: "", reasoning: "", tokens: [] };
  const body = { model: state.model, messages: state.conversation, stream: true, logprobs: true,
                 stream_options: { include_usage: true }, ...samplingFields() };
  const start = performance.now();
  let first = null, numTokens = 0, finish = null;
  try {
    const resp = await fetch("/v1/chat/completions", { method: "POST", headers: headers(), body: JSON.stringify(body) });
    if (!resp.ok) throw new Error(explain(resp.status, await errorText(resp)));
    for await (const chunk of sseEvents(resp)) {
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) numTokens = chunk.usage.completion_tokens;
      for (const choice of chunk.choices || []) {
        const content = choice.delta.content || "";
        const reasoning = choice.delta.reasoning || choice.delta.reasoning_content || "";
        if ((content || reasoning) && first === null) first = performance.now();
        answer.text += content;
        answer.reasoning += reasoning;
        for (const t of (choice.logprobs && choice.logprobs.content) || []) answer.tokens.push(t);
        if (choice.finish_reason) finish = choice.finish_reason;
      }
      renderAnswer(div, answer);
    }
  } catch (e) {
    // The error takes the place of the stats, and the turn leaves the conversation: the next
    // message is not sent after one the model never answered.
    state.conversation.pop();
    stats.className = "error";
    stats.textContent = e.message;
    div.dataset.state = "failed";
    return;
  }
  const end = performance.now();
  state.conversation.push({ role: "assistant", content: answer.text });
  div.answer = answer;
  const ttft = first === null ? null : first - start;
  const rate = numTokens > 1 && first !== null && end > first ? (numTokens - 1) / ((end - first) / 1000) : null;
  stats.textContent = [ttft === null ? "no tokens" : `TTFT ${ttft.toFixed(0)} ms`,
                       rate === null ? null : `${rate.toFixed(1)} tok/s`,
                       `${numTokens} tokens`, finish && `finish: ${finish}`].filter(Boolean).join(" · ");
  div.dataset.state = "done";
}

$("chat-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || state.busy) return;
  $("prompt").value = "";
  state.busy = true;
  $("send").disabled = true;
  try {
    await send(text);
  } finally {
    state.busy = false;
    $("send").disabled = false;
  }
});
$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {
    event.preventDefault();
    $("chat-form").requestSubmit();
  }
});
$("clear-chat").addEventListener("click", () => {
  state.conversation = [];
  $("messages").textContent = "";
});
$("show-tokens").addEventListener("change", () => {
  for (const div of document.querySelectorAll(".message.assistant")) if (div.answer) renderAnswer(div, div.answer);
});

// -- dashboard ---------------------------------------------------------------------------------
function ownerColour(index) {
  return `hsl(${(index * 137) % 360}, 65%, 55%)`;   // golden-angle hues: neighbours differ
}

function percent(x) {
  return x === null || x === undefined ? "–" : `${(100 * x).toFixed(1)}%`;
}

const CHART = { left: 44, right: 12, top: 8, bottom: 20, seconds: 300 };   // margins in CSS px

function niceCeil(x) {   // the smallest 1, 2 or 5 times a power of ten that is >= x
  const power = 10 ** Math.floor(Math.log10(x));
  return [1, 2, 5, 10].map((m) => m * power).find((v) => v >= x * (1 - 1e-9));
}

function drawChart(canvas, history, key) {
  // The bitmap is sized to the CSS box in device pixels at every draw (the box follows the
  // window): a bitmap stretched to its box smears and distorts the text.
  const dpr = window.devicePixelRatio || 1;
  const w = canvas.clientWidth, h = canvas.clientHeight;
  if (!w || !h) return;
  canvas.width = Math.round(w * dpr);   // also clears it
  canvas.height = Math.round(h * dpr);
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  const { left, right, top, bottom, seconds } = CHART;
  const pw = w - left - right, ph = h - top - bottom;
  const max = niceCeil(Math.max(0, ...history.map((p) => p[key])) || 1);   // null counts as 0
  // Time runs to the newest point, by the server's clock: the browser's may be off.
  const end = history.length ? history[history.length - 1].t : 0;
  const x = (t) => left + pw * (1 - (end - t) / seconds);
  const y = (v) => top + ph * (1 - v / max);

  ctx.font = "11px system-ui, sans-serif";
  ctx.fillStyle = "#7a8194";
  ctx.strokeStyle = "#eceef2";
  ctx.lineWidth = 1;
  ctx.textAlign = "right";
  ctx.textBaseline = "middle";
  for (const v of [0, max / 2, max]) {
    ctx.fillText(String(Number(v.toPrecision(3))), left - 6, y(v));
    ctx.beginPath();
    ctx.moveTo(left, Math.round(y(v)) + 0.5);   // on a pixel's centre: a sharp 1 px line
    ctx.lineTo(w - right, Math.round(y(v)) + 0.5);
    ctx.stroke();
  }
  ctx.textAlign = "center";
  ctx.textBaseline = "top";
  for (let s = seconds; s >= 0; s -= 60) {
    ctx.fillText(s ? `-${s / 60} min` : "now", left + pw * (1 - s / seconds), top + ph + 5);
  }
  ctx.strokeStyle = "#55607a";
  ctx.beginPath();
  ctx.moveTo(left + 0.5, top);
  ctx.lineTo(left + 0.5, top + ph + 0.5);
  ctx.lineTo(w - right, top + ph + 0.5);
  ctx.stroke();

  // A second without a value (no first token in it) breaks the line; a point alone is a dot.
  ctx.strokeStyle = ctx.fillStyle = "#3b5bdb";
  ctx.lineWidth = 1.5;
  ctx.beginPath();
  history.forEach((p, i) => {
    const v = p[key];
    if (v === null) return;
    const joined = i > 0 && history[i - 1][key] !== null;
    if (joined) ctx.lineTo(x(p.t), y(v));
    else ctx.moveTo(x(p.t), y(v));
    const alone = !joined && (i === history.length - 1 || history[i + 1][key] === null);
    if (alone) ctx.fillRect(x(p.t) - 2, y(v) - 2, 4, 4);
  });
  ctx.stroke();
}

function renderRequests(status) {
  const rows = [...status.running.map((r, i) => ({ ...r, colour: ownerColour(i) })), ...status.waiting];
  const tbody = $("requests").querySelector("tbody");
  tbody.textContent = "";
  for (const r of rows) {
    const tr = document.createElement("tr");
    tr.dataset.requestId = r.id;
    const done = r.max_tokens ? r.output_tokens / r.max_tokens : 0;
    const cells = [r.id, r.state, r.prompt_tokens ?? "", r.computed_tokens ?? "", r.output_tokens ?? ""];
    for (const c of cells) {
      const td = document.createElement("td");
      td.textContent = c;
      tr.appendChild(td);
    }
    const td = document.createElement("td");
    td.innerHTML = `<div class="bar"><div style="width:${(100 * done).toFixed(1)}%"></div></div>`;
    if (r.colour) tr.firstChild.style.borderLeft = `6px solid ${r.colour}`;
    tr.appendChild(td);
    tbody.appendChild(tr);
  }
}

function renderGrid(kv) {
  const grid = $("kv-grid");
  while (grid.children.length > kv.cells.length) grid.lastChild.remove();
  while (grid.children.length < kv.cells.length) {
    const cell = document.createElement("div");
    grid.appendChild(cell);
  }
  kv.cells.forEach((v, i) => {
    const cell = grid.children[i];
    const kind = v >= 0 ? "running" : v === -1 ? "held" : v === -2 ? "cached" : "free";
    cell.className = "cell " + kind;
    cell.style.background = v >= 0 ? ownerColour(v) : "";
    cell.dataset.owner = v;
  });
  const per = kv.blocks_per_cell > 1 ? `, ${kv.blocks_per_cell} blocks a cell` : "";
  $("kv-legend").textContent = `${kv.num_blocks} blocks of ${kv.block_size} tokens${per}: ` +
    "grey free, blue-grey cached, coloured by request when in use";
}

function renderStatus(status) {
  state.model = state.model || status.model;
  $("model-name").textContent = status.model;
  const spec = status.speculative;
  $("spec-info").textContent = spec
    ? `n-gram speculation: on (server), ${spec.num_speculative_tokens} drafts`
    : "n-gram speculation: off (server)";
  $("spec-toggle").hidden = !spec;
  $("pause-state").textContent = status.pause_mode ? `paused (${status.pause_mode})` : "running";
  $("num-running").textContent = status.running.length;
  $("num-waiting").textContent = status.waiting.length;
  $("kv-usage").textContent = percent(status.stats.kv_cache_usage);
  $("prefix-hit-rate").textContent = percent(status.stats.prefix_cache_hit_rate);
  $("preemptions").textContent = status.stats.num_preemptions;
  $("spec-acceptance").textContent = percent(status.stats.spec_acceptance_rate);
  renderRequests(status);
  renderGrid(status.kv_cache);
  drawChart($("throughput-chart"), status.history, "tokens_per_s");
  drawChart($("ttft-chart"), status.history, "ttft_s");
}

// The status is asked once at load and after a key change (the playground shows the model and
// the speculation switch), and every 500 ms only while the dashboard is on screen. Without the
// key a server needs, nothing is asked: a 401 stops the polling until a key is entered.
function dashboardOnScreen() {
  return !$("dashboard").hidden && !document.hidden;
}

function needKey(message) {
  state.needsKey = true;
  $("key-needed").hidden = false;
  $("dashboard-error").textContent = message;
  $("dashboard-error").hidden = false;
}

function keyChanged() {
  $("key-needed").hidden = true;
  if (state.keyRequired && !$("api-key").value) {
    needKey("needs API key: the server has one; enter it above");
  } else {
    state.needsKey = false;
    poll();
  }
}

async function poll() {
  clearTimeout(state.timer);
  if (state.needsKey) return;
  try {
    const resp = await fetch("/v1/engine/status", { headers: headers() });
    if (resp.status === 401) return needKey(explain(401, await errorText(resp)));
    if (!resp.ok) throw new Error(explain(resp.status, await errorText(resp)));
    renderStatus(await resp.json());
    $("dashboard-error").hidden = true;
  } catch (e) {
    $("dashboard-error").textContent = e.message;
    $("dashboard-error").hidden = false;
  }
  clearTimeout(state.timer);   // a poll started meanwhile (a click) may have set one
  if (dashboardOnScreen()) state.timer = setTimeout(poll, 500);
}

document.addEventListener("visibilitychange", () => {
  if (dashboardOnScreen()) poll();
  else clearTimeout(state.timer);
});

for (const button of document.querySelectorAll(".control")) {
  button.addEventListener("click", async () => {
    $("control-message").textContent = `${button.textContent}…`;
    try {
      const resp = await fetch(button.dataset.path, { method: "POST", headers: headers() });
      $("control-message").textContent = resp.ok ? `${button.textContent}: done`
        : `${button.textContent} refused: ${explain(resp.status, await errorText(resp))}`;
    } catch (e) {
      $("control-message").textContent = `${button.textContent} failed: ${e.message}`;
    }
    poll();
  });
}

async function start() {
  try {
    const resp = await fetch("/console/config");
    if (!resp.ok) throw new Error(explain(resp.status, await errorText(resp)));
    state.keyRequired = (await resp.json()).api_key_required;
  } catch (e) {
    // Not knowing whether a key is needed, ask nothing (this is also a reload cutting it short).
    $("dashboard-error").textContent = `cannot read the console's config (reload the page): ${e.message}`;
    $("dashboard-error").hidden = false;
    return;
  }
  keyChanged();
}

start();
