// The gateway console: reads the admin port's JSON endpoints, draws each route's and rule's
// decisions per second, and writes overrides and keys through the same endpoints as the API with
// the admin token typed in the page (sent as Authorization: Bearer; never stored). No library.
"use strict";

const SAMPLE_MS = 2000; // counters are read this often; each chart point is the rate between two reads
const SPAN_MS = 5 * 60 * 1000; // the charts show this much history
const SLOW_EVERY = 3; // the lists (top, overrides, keys, limits) every third sample
const SVG = "http://www.w3.org/2000/svg";

const samples = []; // {at, routes, rules, redis}
let limits = []; // GET /limits routes
let tick = 0;

function $(id) { return document.getElementById(id); }

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (name === "class") node.className = value;
    else if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else node.setAttribute(name, value);
  }
  for (const child of children) node.append(child instanceof Node ? child : String(child));
  return node;
}

function svg(tag, attrs) {
  const node = document.createElementNS(SVG, tag);
  for (const [name, value] of Object.entries(attrs)) node.setAttribute(name, value);
  return node;
}

async function getJSON(path) {
  const response = await fetch(path, { headers: { accept: "application/json" }, cache: "no-store" });
  const body = await response.json().catch(() => null);
  if (!response.ok) throw new Error((body && body.detail) || `${path}: ${response.status}`);
  return body;
}

// A write through the admin API: the token as the API wants it, the problem's detail on refusal.
async function write(method, path, body) {
  const headers = { accept: "application/json" };
  const token = $("token").value.trim();
  if (token) headers.authorization = `Bearer ${token}`;
  if (body !== undefined) headers["content-type"] = "application/json";
  const response = await fetch(path, {
    method, headers, body: body === undefined ? undefined : body, cache: "no-store", credentials: "omit",
  });
  const answer = await response.json().catch(() => null);
  if (!response.ok) {
    const detail = (answer && answer.detail) || response.statusText;
    throw new Error(`${response.status}: ${detail}`);
  }
  return answer;
}

function show(id, text, ok) {
  const node = $(id);
  node.textContent = text;
  node.className = `result ${ok ? "ok" : "error"}`;
}

// ---- decisions per second ------------------------------------------------------------------

function rates(pick) {
  // [time, admitted/s, refused/s] between consecutive samples; a counter that went down (a worker
  // restarted) counts as zero for that interval
  const out = [];
  for (let i = 1; i < samples.length; i++) {
    const a = pick(samples[i - 1]) || {};
    const b = pick(samples[i]) || {};
    const seconds = (samples[i].at - samples[i - 1].at) || 1;
    const rate = (name) => Math.max(0, ((b[name] || 0) - (a[name] || 0)) / seconds);
    out.push([samples[i].at, rate("admitted"), rate("refused")]);
  }
  return out;
}

function chart(points, width, height) {
  const box = svg("svg", { class: "chart", viewBox: `0 0 ${width} ${height}`, preserveAspectRatio: "none",
    role: "img", height });
  const now = samples.length ? samples[samples.length - 1].at : 0;
  const span = shown();
  const top = Math.max(1, ...points.map((p) => Math.max(p[1], p[2])));
  const x = (at) => width - ((now - at) / span) * width;
  const y = (value) => height - 2 - (value / top) * (height - 12);
  for (const [index, name] of [[1, "admitted"], [2, "refused"]]) {
    const line = points.map((p) => `${x(p[0]).toFixed(1)},${y(p[index]).toFixed(1)}`).join(" ");
    box.append(svg("polyline", { class: name, points: line, "vector-effect": "non-scaling-stroke" }));
  }
  box.setAttribute("aria-label", `peak ${formatRate(top)} decisions per second`);
  // the scale as HTML over the chart: text inside a stretched SVG would stretch with it
  return el("div", { class: "chartbox" }, box, el("span", { class: "peak" }, `${formatRate(top)}/s`));
}

// Seconds across a chart: the history kept, at least a minute and at most SPAN_MS.
function shown() {
  if (samples.length < 2) return 60;
  const kept = samples[samples.length - 1].at - samples[0].at;
  return Math.min(SPAN_MS / 1000, Math.max(60, kept));
}

function formatRate(value) {
  return value >= 100 ? value.toFixed(0) : value >= 10 ? value.toFixed(1) : value.toFixed(2).replace(/\.?0+$/, "");
}

function rateText(points) {
  const last = points.length ? points[points.length - 1] : [0, 0, 0];
  const peak = Math.max(0, ...points.map((p) => p[2]));
  const text = el("span", { class: "rate" }, `${formatRate(last[1])}/s admitted · ${formatRate(last[2])}/s refused`);
  text.dataset.admitted = last[1];
  text.dataset.refused = last[2];
  text.dataset.refusedPeak = peak;
  return text;
}

function drawRoutes() {
  const box = $("routes");
  const drawn = [];
  for (const route of limits) {
    const points = rates((s) => s.routes[route.name]);
    const card = el("div", { class: "route", "data-route": route.name },
      el("h3", {}, route.name, rateText(points)), chart(points, 480, 72));
    for (const rule of route.rules) {
      const rulePoints = rates((s) => (s.rules[route.name] || {})[rule.name]);
      const row = el("div", { class: "rule", "data-rule": rule.name },
        el("span", { class: "name", title: describe(rule) }, rule.name), chart(rulePoints, 200, 28), rateText(rulePoints));
      card.append(row);
    }
    drawn.push(card);
  }
  if (!limits.length) drawn.push(el("p", {}, "no limited routes"));
  box.replaceChildren(...drawn);
}

function describe(rule) {
  const numbers = rule.limit !== undefined ? `${rule.limit}` : `${rule.rate_per_second}/s burst ${rule.burst}`;
  const window = rule.window_seconds || rule.period_seconds;
  return `${rule.algorithm} ${numbers}${window ? ` per ${window}s` : ""} by ${rule.by.join(", ") || "none"}`;
}

// ---- status -----------------------------------------------------------------------------------

function pill(id, text, kind) {
  const node = $(id);
  node.textContent = text;
  node.className = `pill ${kind}`;
}

function drawStatus(state, health) {
  if (health) {
    const redis = health.redis;
    pill("health", health.ready ? "ready" : "not ready", health.ready ? "good" : "bad");
    if (redis) {
      const decision = decisionLatency();
      const ping = redis.answers ? `ping ${redis.latency_ms} ms` : "not answering";
      pill("redis-latency", `Redis ${ping}${decision === null ? "" : ` · decisions ${decision} ms avg`}`,
        redis.answers ? "good" : "bad");
    }
  }
  pill("breaker", `breaker ${state.breaker.replace("_", "-")}`, state.breaker === "closed" ? "good" : "bad");
  const last = state.last_reload;
  const failures = state.reloads.error || 0;
  if (last) {
    const when = new Date(last.at * 1000).toLocaleTimeString();
    pill("reload", `${last.ok ? "config loaded" : "reload refused"} ${when}${failures ? ` · ${failures} failed` : ""}`,
      last.ok ? (failures ? "warn" : "good") : "bad");
    const errors = $("reload-errors");
    errors.hidden = last.ok;
    errors.textContent = last.ok ? "" : `The last reload was refused; the config before it stays in force.\n${last.detail}`;
  }
}

function decisionLatency() {
  if (samples.length < 2) return null;
  const a = samples[samples.length - 2].redis;
  const b = samples[samples.length - 1].redis;
  const calls = b.calls - a.calls;
  return calls > 0 ? ((b.seconds - a.seconds) / calls * 1000).toFixed(2) : null;
}

// ---- lists ------------------------------------------------------------------------------------

function drawTop(found) {
  const rows = found.top.map((r) => el("tr", { "data-identity": r.identity },
    el("td", {}, el("code", {}, r.identity)), el("td", {}, r.route), el("td", {}, r.rule),
    el("td", { class: "num" }, r.error ? `≤ ${r.refusals}` : r.refusals),
    el("td", {}, el("button", { type: "button", onclick: () => prefill(r.route, r.rule, r.identity) }, "override…"))));
  if (!rows.length) rows.push(el("tr", {}, el("td", { colspan: 5 }, "nobody refused")));
  $("top").tBodies[0].replaceChildren(...rows);
}

function prefill(route, rule, key) {
  $("override-rule").value = `${route}/${rule}`;
  $("override-key").value = key;
  template();
  $("override-body").focus();
}

function overridePath(route, rule, key) {
  return `/overrides/${encodeURIComponent(route)}/${encodeURIComponent(rule)}?key=${encodeURIComponent(key)}`;
}

function drawOverrides(found) {
  const select = $("override-rule");
  const chosen = select.value;
  const options = found.rules.map((r) => el("option", { value: `${r.route}/${r.rule}` },
    `${r.route} / ${r.rule} (${r.algorithm}, ${r.overrides} of ${r.max_overrides})`));
  select.replaceChildren(...options);
  if (chosen) select.value = chosen;
  const rows = found.overrides.map((o) => el("tr", { "data-key": o.key },
    el("td", {}, o.route), el("td", {}, o.rule), el("td", {}, el("code", {}, o.key)),
    el("td", {}, el("code", {}, JSON.stringify(o.override))),
    el("td", {}, el("button", { type: "button", onclick: () => removeOverride(o) }, "delete"))));
  if (!rows.length) rows.push(el("tr", {}, el("td", { colspan: 5 }, "no overrides")));
  $("overrides").tBodies[0].replaceChildren(...rows);
}

function template() {
  const [routeName, ruleName] = $("override-rule").value.split("/");
  const route = limits.find((r) => r.name === routeName);
  const rule = route && route.rules.find((r) => r.name === ruleName);
  if (!rule) return;
  let body;
  if (rule.rate_per_second !== undefined) body = { rate: `${rule.rate_per_second}/s`, burst: rule.burst };
  else if (rule.window_seconds) body = { limit: rule.limit, window: `${rule.window_seconds}s` };
  else if (rule.period_seconds) body = { limit: rule.limit, period: `${rule.period_seconds}s` };
  else body = { limit: rule.limit };
  $("override-body").placeholder = `${JSON.stringify(body)} or {"unlimited": true}`;
}

async function removeOverride(o) {
  try {
    await write("DELETE", overridePath(o.route, o.rule, o.key));
    show("override-result", `deleted the override of ${o.route}/${o.rule} for ${o.key}`, true);
  } catch (error) {
    show("override-result", error.message, false);
  }
  refreshLists();
}

async function putOverride(event) {
  event.preventDefault();
  const [route, rule] = $("override-rule").value.split("/");
  const key = $("override-key").value;
  try {
    const answer = await write("PUT", overridePath(route, rule, key), $("override-body").value);
    show("override-result", `set: ${route}/${rule} for ${answer.key} is ${JSON.stringify(answer.override)} ` +
      `(every worker within ${answer.applies_within_seconds}s)${answer.warning ? `; ${answer.warning}` : ""}`, true);
  } catch (error) {
    show("override-result", error.message, false);
  }
  refreshLists();
}

async function drawKeys(plans) {
  $("keys-section").hidden = !plans;
  if (!plans) return;
  const select = $("key-plan");
  if (select.options.length !== plans.length) {
    select.replaceChildren(...plans.map((p) => el("option", { value: p }, p)));
  }
  const rows = [];
  for (const plan of plans) {
    const page = await getJSON(`/keys?plan=${encodeURIComponent(plan)}&limit=100`);
    for (const key of page.keys) {
      rows.push(el("tr", { "data-key": key }, el("td", {}, el("code", {}, key)), el("td", {}, plan),
        el("td", {}, el("button", { type: "button", onclick: () => removeKey(key) }, "delete"))));
    }
  }
  if (!rows.length) rows.push(el("tr", {}, el("td", { colspan: 3 }, "no keys")));
  $("keys").tBodies[0].replaceChildren(...rows);
}

async function putKey(event) {
  event.preventDefault();
  const key = $("key-value").value;
  try {
    const answer = await write("PUT", `/keys?key=${encodeURIComponent(key)}`, JSON.stringify({ plan: $("key-plan").value }));
    show("key-result", `${answer.key} is on plan ${answer.plan}`, true);
    $("key-value").value = "";
  } catch (error) {
    show("key-result", error.message, false);
  }
  refreshLists();
}

async function removeKey(fingerprint) {
  try {
    await write("DELETE", `/keys?key=${encodeURIComponent(fingerprint)}`);
    show("key-result", `deleted ${fingerprint}`, true);
  } catch (error) {
    show("key-result", error.message, false);
  }
  refreshLists();
}

// ---- the loop ---------------------------------------------------------------------------------

let plans = null;

async function refreshLists() {
  const [found, top, overrides] = await Promise.allSettled([
    getJSON("/limits"), getJSON("/top?window=5m&limit=20"), getJSON("/overrides?limit=100")]);
  if (found.status === "fulfilled") limits = found.value.routes;
  if (top.status === "fulfilled") drawTop(top.value);
  if (overrides.status === "fulfilled") {
    const fresh = !$("override-rule").options.length;
    drawOverrides(overrides.value);
    if (fresh) template();
  }
  await drawKeys(plans).catch((error) => show("key-result", error.message, false));
}

async function sample() {
  const [state, health] = await Promise.allSettled([getJSON("/console/state"), getJSON("/healthz")]);
  if (state.status === "fulfilled") {
    const s = state.value;
    samples.push({ at: s.at, routes: s.routes, rules: s.rules, redis: s.redis });
    while (samples.length > 2 && (s.at - samples[0].at) * 1000 > SPAN_MS) samples.shift();
    plans = s.plans;
    drawStatus(s, health.status === "fulfilled" ? health.value : null);
  } else {
    pill("health", "admin port not answering", "bad");
  }
  if (tick++ % SLOW_EVERY === 0) await refreshLists();
  drawRoutes();
  document.body.dataset.samples = samples.length;
  $("span-minutes").textContent = `${Math.round(shown() / 6) / 10} min`;
}

async function loop() {
  try {
    await sample();
  } finally {
    setTimeout(loop, SAMPLE_MS);
  }
}

document.addEventListener("DOMContentLoaded", () => {
  $("override-form").addEventListener("submit", putOverride);
  $("override-rule").addEventListener("change", template);
  $("key-form").addEventListener("submit", putKey);
  loop();
});
