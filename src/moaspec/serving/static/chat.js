// The chat page of `moaspec serve`: a client of the server's own OpenAI-compatible API. Every figure and
// every token's origin comes from the stream's `moaspec` extension field (docs/serving.md), so what the page
// shows is what any client of /v1/chat/completions can read.
"use strict";

const $ = (id) => document.getElementById(id);
const COLOURS = { target: "#e9ecf1", suffix: "#c6efd0", lookup: "#c4e8f3", recycling: "#fddcb5", moa: "#d3dcff",
  eagle: "#e6d3fb", independent: "#f2d6c4", model: "#f9cde4" };
const EXTRA = ["#d9f2b4", "#ffd6d6", "#c8f1ec", "#efe3b4", "#dcd6f7"];
const state = { history: [], offer: null, controller: null, origins: new Set(["target"]) };

function colour(origin) {
  if (COLOURS[origin]) return COLOURS[origin];
  const first = origin.split("+")[0];  // a hybrid's token that both parts drafted: the first part's colour
  if (COLOURS[first]) return COLOURS[first];
  let h = 0;
  for (const c of origin) h = (h * 31 + c.charCodeAt(0)) >>> 0;
  return EXTRA[h % EXTRA.length];
}

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = sessionStorage.getItem("moaspec-key");
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

function status(text, error = false) {
  $("status").textContent = text;
  $("status").classList.toggle("error", error);
}

// ------------------------------------------------------------------ what the server offers
async function loadOffer() {
  const r = await fetch("/v1/moaspec", { headers: headers() });
  if (r.status === 401) {
    $("key-row").hidden = false;
    status("This server needs an API key: enter it under the settings.", true);
    return;
  }
  if (!r.ok) throw new Error(`GET /v1/moaspec: ${r.status}`);
  const offer = state.offer = await r.json();
  $("model").textContent = offer.model;
  fill($("drafter"), offer.drafters, offer.drafter);
  fill($("weights"), offer.weight_modes, offer.weights);
  $("weights").disabled = offer.weight_modes.length < 2;
  $("max-tokens").max = offer.max_tokens;
  $("max-tokens").value = Math.min(256, offer.max_tokens);
  showLink(offer.link);
  status(offer.target === "remote" ? "Drafting here, verifying on the target server." : "Ready.");
}

function fill(select, values, chosen) {
  select.replaceChildren(...values.map((v) => {
    const o = document.createElement("option");
    o.value = v;
    o.textContent = v === chosen ? `${v} (server's)` : v;
    o.selected = v === chosen;
    return o;
  }));
}

function showLink(link) {
  const el = $("fig-link");
  el.textContent = link;
  el.className = `link ${link}`;
}

function showFigures(ext) {
  $("fig-tps").textContent = ext.tokens_per_s.toFixed(1);
  $("fig-tau").textContent = ext.tau.toFixed(2);
  $("fig-acc").textContent = ext.acceptance === null ? "–" : `${Math.round(ext.acceptance * 100)}%`;
  $("fig-calls").textContent = ext.target_calls;
  showLink(ext.link);
}

function updateLegend() {
  const items = [...state.origins, "unverified"].map((o) => {
    const s = document.createElement("span");
    s.className = o === "unverified" ? "tok unverified" : "tok";
    if (o !== "unverified") s.style.background = colour(o);
    s.textContent = o === "target" ? "target's own token" : o === "unverified" ? "unverified (server away)" : o;
    s.dataset.origin = o;
    return s;
  });
  $("legend").replaceChildren(...items);
}

// ------------------------------------------------------------------ a message
function addMessage(role, text = "") {
  const el = document.createElement("div");
  el.className = `msg ${role}`;
  if (role === "user") {
    el.textContent = text;
  } else {
    el.innerHTML = '<div class="views"><div class="tokens"></div><div class="rendered"></div></div><div class="meta"></div>';
    el.classList.toggle("plain", !$("shade").checked);
    el.dataset.state = "streaming";
  }
  $("chat").append(el);
  el.scrollIntoView({ block: "end" });
  return { el, text: "", pieces: [], resync: false };
}

// Fenced code blocks in `text`: [{start, end, kind: prose | code | fence, lang}]
function regions(text) {
  const out = [];
  const fence = /^ {0,3}```.*$/gm;
  let last = 0, inCode = false, lang = "", m;
  while ((m = fence.exec(text))) {
    if (m.index > last) out.push({ start: last, end: m.index, kind: inCode ? "code" : "prose", lang });
    let end = m.index + m[0].length;
    if (text[end] === "\n") end += 1;
    lang = inCode ? "" : m[0].trim().slice(3).trim();
    out.push({ start: m.index, end, kind: "fence", lang });
    inCode = !inCode;
    last = end;
  }
  if (text.length > last) out.push({ start: last, end: text.length, kind: inCode ? "code" : "prose", lang });
  return out;
}

function container(region) {
  if (region.kind === "prose") return Object.assign(document.createElement("div"), { className: "prose" });
  if (region.kind === "fence") return Object.assign(document.createElement("span"), { className: "fence" });
  const pre = document.createElement("pre");
  pre.className = "code";
  if (region.lang) pre.append(Object.assign(document.createElement("span"), { className: "lang", textContent: region.lang }));
  const code = document.createElement("code");
  pre.append(code);
  pre.target = code;
  return pre;
}

function tokenSpan(piece, text, index) {
  const s = document.createElement("span");
  s.className = piece.origin === "unverified" ? "tok unverified" : "tok";
  if (piece.resynced) s.classList.add("resynced");
  if (piece.origin !== "unverified") s.style.setProperty("--c", colour(piece.origin));
  s.dataset.origin = piece.origin;
  s.dataset.round = piece.round;
  s.dataset.i = index;
  const who = piece.origin === "target" ? "the target's own token"
    : piece.origin === "unverified" ? "written by the drafter alone, not yet verified" : `${piece.origin}'s draft, accepted`;
  s.dataset.tip = `round ${piece.round}: ${who}`;
  s.textContent = text;
  return s;
}

function renderTokens(msg) {
  const full = msg.pieces.map((p) => p.text).join("");
  const boxes = regions(full).map((r) => ({ ...r, el: container(r) }));
  let at = 0, box = 0;
  msg.pieces.forEach((p, i) => {
    let rest = p.text, start = at;
    while (rest.length) {
      while (box < boxes.length - 1 && boxes[box].end <= start) box += 1;
      const take = Math.min(rest.length, boxes[box].end - start) || rest.length;
      (boxes[box].el.target || boxes[box].el).append(tokenSpan(p, rest.slice(0, take), i));
      rest = rest.slice(take);
      start += take;
    }
    at += p.text.length;
  });
  msg.el.querySelector(".tokens").replaceChildren(...boxes.map((b) => b.el));
}

function renderMarkdown(msg) {
  const view = msg.el.querySelector(".rendered");
  view.innerHTML = DOMPurify.sanitize(marked.parse(msg.text));
  view.querySelectorAll("pre code").forEach((c) => hljs.highlightElement(c));
}

// One streamed chunk: verified text with its pieces, and unverified text shown until the target settles it.
function apply(msg, chunk) {
  const choice = chunk.choices[0];
  const text = choice && choice.delta && choice.delta.content ? choice.delta.content : "";
  const ext = chunk.moaspec;
  msg.text += text;
  if (!ext) {  // another server: no origins to show
    if (text) msg.pieces.push({ text, origin: "target", round: 0 });
    return;
  }
  if (ext.retract) {
    msg.pieces.splice(msg.pieces.length - ext.retract, ext.retract);
    msg.resync = true;
  }
  for (const [t, origin] of ext.pieces) {
    msg.pieces.push({ text: t, origin, round: ext.round, resynced: msg.resync });
    state.origins.add(origin);
  }
  if (ext.pieces.length) msg.resync = false;
  for (const t of ext.pending || []) msg.pieces.push({ text: t, origin: "unverified", round: ext.round });
  msg.ext = ext;
  showFigures(ext);
}

function describe(msg, finish, usage) {
  const e = msg.ext;
  if (!e) return finish || "";
  const parts = [`drafter ${e.drafter}`, `weights ${e.weights}`, `${e.tokens} tokens`, `${e.tokens_per_s.toFixed(1)} tokens/s`,
    `τ ${e.tau.toFixed(2)}`, `${e.target_calls} target calls`];
  if (usage && usage.unverified_tokens) parts.push(`${usage.unverified_tokens} tokens never verified`);
  if (finish) parts.push(finish);
  return parts.join(" · ");
}

// ------------------------------------------------------------------ a request
async function* events(response) {
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
      const data = block.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart()).join("\n");
      if (data) yield data;
    }
  }
}

async function send(prompt) {
  const offer = state.offer;
  if (!offer) await loadOffer();
  if (!state.offer) return;
  addMessage("user", prompt);
  const messages = [...state.history, { role: "user", content: prompt }];
  const msg = addMessage("assistant");
  const body = {
    model: state.offer.model, messages, stream: true, stream_options: { include_usage: true },
    temperature: Number($("temperature").value), max_tokens: Number($("max-tokens").value),
    drafter: $("drafter").value, weights: $("weights").value,
  };
  state.controller = new AbortController();
  busy(true);
  status("Generating…");
  let finish = null, usage = null, failed = null;
  try {
    const r = await fetch("/v1/chat/completions", { method: "POST", headers: headers(), body: JSON.stringify(body),
      signal: state.controller.signal });
    if (!r.ok) {
      const err = await r.json().catch(() => ({}));
      throw new Error(err.error ? err.error.message : `HTTP ${r.status}`);
    }
    for await (const data of events(r)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      if (!chunk.choices.length) continue;
      apply(msg, chunk);
      finish = chunk.choices[0].finish_reason || finish;
      renderTokens(msg);
      renderMarkdown(msg);
      updateLegend();
      msg.el.scrollIntoView({ block: "end" });
    }
  } catch (e) {
    if (e.name !== "AbortError") failed = e;
  }
  const stopped = !failed && finish === null;
  msg.el.dataset.state = failed ? "error" : stopped ? "stopped" : "done";
  renderTokens(msg);
  renderMarkdown(msg);
  msg.el.querySelector(".meta").textContent = describe(msg, stopped ? "stopped" : finish, usage);
  if (failed) {
    msg.el.querySelector(".meta").append(Object.assign(document.createElement("div"), { className: "error",
      textContent: failed.message }));
    status(failed.message, true);
  } else {
    state.history = [...messages, { role: "assistant", content: msg.text }];
    status(stopped ? "Stopped: the server ended the generation." : "Ready.");
  }
  state.controller = null;
  busy(false);
}

function busy(on) {
  $("send").disabled = on;
  $("stop").disabled = !on;
}

// ------------------------------------------------------------------ wiring
function main() {
  $("ask").addEventListener("submit", (e) => {
    e.preventDefault();
    const prompt = $("prompt").value.trim();
    if (!prompt || state.controller) return;
    $("prompt").value = "";
    send(prompt).catch((err) => status(err.message, true));
  });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) {
      e.preventDefault();
      $("ask").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => state.controller && state.controller.abort());
  $("reset").addEventListener("click", () => {
    if (state.controller) state.controller.abort();
    state.history = [];
    $("chat").replaceChildren();
    status("A new conversation.");
  });
  $("shade").addEventListener("change", () => {
    document.querySelectorAll(".msg.assistant").forEach((m) => {
      m.classList.toggle("plain", !$("shade").checked);
    });
  });
  $("api-key").addEventListener("change", () => {
    sessionStorage.setItem("moaspec-key", $("api-key").value);
    loadOffer().catch((err) => status(err.message, true));
  });
  const tip = Object.assign(document.createElement("div"), { id: "tip", hidden: true, role: "tooltip" });
  document.body.append(tip);
  $("chat").addEventListener("mouseover", (e) => {  // a token's round and who wrote it
    const tok = e.target.closest(".tok");
    tip.hidden = !tok;
    if (!tok) return;
    tip.textContent = tok.dataset.tip;
    const r = tok.getBoundingClientRect();
    tip.style.left = `${Math.min(r.left, window.innerWidth - 320)}px`;
    tip.style.top = `${r.bottom + 4}px`;
  });
  $("chat").addEventListener("mouseleave", () => { tip.hidden = true; });
  updateLegend();
  loadOffer().catch((err) => status(err.message, true));
}

main();
