"use strict";
// srl dashboard: polls the server's JSON about once a second and draws it.
// Everything read from the board is untrusted: text reaches the DOM through textContent only
// (never innerHTML), class names come from fixed tables, and the curve is drawn on a canvas.

const POLL_MS = 1000;
const HEADERS = { "X-SRL-Dashboard": "1" };
const STATUS_CLASS = { INIT: "init", ACTIVE: "active", END: "end", FAILED: "failed" };
const STALE_HEARTBEAT_S = 5;

let selected = null; // name of the task shown in detail (from #task=NAME)
let detailTask = null; // the latest detail answer

// ------------------------------------------------------------------ small helpers
function el(tag, text, className) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (className) node.className = className;
  return node;
}

function isNum(v) {
  return typeof v === "number" && Number.isFinite(v);
}

function num(v, digits) {
  if (!isNum(v)) return v === null || v === undefined || v === "" ? "-" : String(v);
  if (Number.isInteger(v)) return v.toLocaleString("en-US");
  return v.toFixed(digits === undefined ? 2 : digits);
}

function seconds(v) {
  if (!isNum(v)) return "-";
  if (v < 60) return v.toFixed(1) + " s";
  if (v < 3600) return Math.floor(v / 60) + " min " + Math.round(v % 60) + " s";
  return Math.floor(v / 3600) + " h " + Math.round((v % 3600) / 60) + " min";
}

function clock(ts) {
  return isNum(ts) && ts > 0 ? new Date(ts * 1000).toLocaleTimeString() : "-";
}

function setField(name, text, value) {
  // value: the raw number, kept in data-value for scripts (and tests) that read the page
  for (const node of document.querySelectorAll('[data-field="' + name + '"]')) {
    node.textContent = text;
    node.dataset.value = isNum(value) ? String(value) : "";
  }
}

function show(node, text) {
  node.hidden = !text;
  node.textContent = text || "";
}

function statusBadge(node, status) {
  node.textContent = status || "?";
  node.className = "status " + (STATUS_CLASS[status] || "unknown");
}

async function getJSON(url, options) {
  const response = await fetch(url, { headers: HEADERS, cache: "no-store", ...(options || {}) });
  let body = null;
  try {
    body = await response.json();
  } catch (e) {
    body = null;
  }
  if (!response.ok) {
    const error = new Error((body && typeof body.error === "string" && body.error) || "HTTP " + response.status);
    error.status = response.status;
    throw error;
  }
  return body;
}

// ------------------------------------------------------------------ selection
function selectedFromHash() {
  const match = /^#task=(.+)$/.exec(location.hash);
  if (!match) return null;
  try {
    return decodeURIComponent(match[1]);
  } catch (e) {
    return null;
  }
}

function select(name) {
  location.hash = "task=" + encodeURIComponent(name);
}

window.addEventListener("hashchange", () => {
  selected = selectedFromHash();
  detailTask = null;
  poll();
});

// ------------------------------------------------------------------ stop
async function stopTask(name) {
  if (!window.confirm('Stop task "' + name + '"? Its trainer and actors end their work; this cannot be undone.')) {
    return;
  }
  try {
    const answer = await getJSON("/api/task/" + encodeURIComponent(name) + "/stop", { method: "POST" });
    show(document.getElementById("notice"), answer.ended ? 'Task "' + name + '" stopped.' : answer.reason);
  } catch (e) {
    show(document.getElementById("notice"), 'Could not stop "' + name + '": ' + e.message);
  }
  poll();
}

function stopButton(name) {
  const button = el("button", "Stop", "stop");
  button.type = "button";
  button.addEventListener("click", (event) => {
    event.stopPropagation();
    stopTask(name);
  });
  return button;
}

// ------------------------------------------------------------------ the task list
// Rows are kept per task name and updated in place (rebuilding them every poll could swallow a click).
const taskRows = new Map();
let shownNames = "";

function taskRow(name) {
  const known = taskRows.get(name);
  if (known) return known;
  const row = el("tr");
  row.dataset.task = name;
  row.addEventListener("click", () => select(name));
  const badge = el("span");
  const stop = stopButton(name);
  const cells = {
    name: el("td", name, "name"), status: el("td"), train: el("td", "", "number"), steps: el("td", "", "number"),
    reason: el("td"), actions: el("td"),
  };
  cells.status.append(badge);
  cells.actions.append(stop);
  row.append(cells.name, cells.status, cells.train, cells.steps, cells.reason, cells.actions);
  const parts = { row, badge, stop, cells };
  taskRows.set(name, parts);
  return parts;
}

function renderTasks(answer) {
  document.getElementById("board").textContent = "board: " + answer.redis;
  const rows = [];
  for (const task of answer.tasks) {
    const { row, badge, stop, cells } = taskRow(task.name);
    row.classList.toggle("selected", task.name === selected);
    statusBadge(badge, task.status);
    cells.train.textContent = num(task.train_count);
    cells.steps.textContent = num(task.env_steps);
    cells.reason.textContent = task.error || task.end_reason || "";
    cells.reason.className = task.error ? "error" : "";
    stop.hidden = !task.running;
    rows.push(row);
  }
  const names = answer.tasks.map((t) => t.name);
  if (JSON.stringify(names) !== shownNames) {
    shownNames = JSON.stringify(names);
    document.querySelector("#tasks tbody").replaceChildren(...rows);
    const current = new Set(names);
    for (const name of [...taskRows.keys()]) if (!current.has(name)) taskRows.delete(name);
  }
  document.getElementById("no-tasks").hidden = answer.tasks.length > 0;
  if (selected === null && answer.tasks.length > 0) {
    const running = answer.tasks.find((t) => t.running);
    selected = (running || answer.tasks[0]).name;
  }
}

// ------------------------------------------------------------------ one task
function heartbeatCell(age) {
  const cell = el("td", isNum(age) ? seconds(age) + " ago" : "never", "number");
  if (!isNum(age) || age > STALE_HEARTBEAT_S) cell.classList.add("stale");
  return cell;
}

function slotRow(label, slot, rate, stalls, lag, more, elastic) {
  const row = el("tr");
  row.append(el("td", label));
  const empty = elastic ? ["free", "muted"] : ["MISSING", "missing"];
  row.append(el("td", slot.holder || empty[0], slot.holder ? "holder" : empty[1]));
  row.append(heartbeatCell(slot.heartbeat_age_s));
  row.append(el("td", rate));
  row.append(el("td", stalls));
  row.append(el("td", lag));
  row.append(el("td", more, "muted"));
  return row;
}

function renderSlots(task) {
  const rows = [];
  const t = task.trainer.stats;
  rows.push(slotRow(
    "trainer", task.trainer,
    num(t.train_per_s, 1) + " train/s, ingest " + num(t.received_per_s, 1) + " rows/s",
    t.waiting_for ? "waiting for actor slot(s) " + t.waiting_for : "-",
    "p50 " + num(t.lag_p50) + " / p95 " + num(t.lag_p95) + " / max " + num(t.lag_max) + " versions",
    "buffer " + num(t.memory) + ", loss " + num(t.loss, 4) + ", params v" + num(t.params_version) +
      ", " + (t.device || "?"),
  ));
  for (const server of task.inference_servers || []) {  // central inference: the servers that act for the actors
    const i = server.stats;
    rows.push(slotRow(
      server.name, server,
      num(i.agent_steps_per_s, 1) + " actions/s, " + num(i.batch_envs_mean, 1) + " envs/batch",
      "backpressure " + num(i.backpressure_wait_s, 1) + " s",
      "request wait " + num(i.batch_wait_ms_mean, 2) + " ms",
      num(i.sessions) + " actor(s) connected, params v" + num(i.params_version) + ", refused " +
        num(i.refused_requests),
    ));
  }
  for (const actor of task.actors) {
    const s = actor.stats;
    const stalledNow = isNum(s.stalled_now_s) && s.stalled_now_s >= 1 ? ", WAITING now " + seconds(s.stalled_now_s) : "";
    rows.push(slotRow(
      "actor " + actor.slot, actor,
      num(s.env_steps_per_s, 1) + " steps/s",
      "backpressure " + num(s.backpressure_wait_s, 1) + " s" + stalledNow,
      num(s.params_lag) + " version(s) behind",
      num(s.episodes) + " episodes, reward " + num(s.reward) + ", params v" + num(s.params_version),
      task.elastic_actors,
    ));
  }
  if (task.actors_not_shown > 0) {
    const row = el("tr");
    const cell = el("td", "… and " + num(task.actors_not_shown) + " more actor slot(s)", "muted");
    cell.colSpan = 7;
    row.append(cell);
    rows.push(row);
  }
  document.querySelector("#slots tbody").replaceChildren(...rows);
}

function renderCounters(counters, inFlight) {
  const items = [];
  const main = [
    ["sent batches", counters.sent_batches || 0], ["received batches", counters.received_batches || 0],
    ["in flight", inFlight || 0], ["bad messages", counters.bad_messages || 0],
  ];
  const shown = new Set(["sent_batches", "received_batches", "bad_messages"]);
  for (const [name, value] of Object.entries(counters)) {
    if (!shown.has(name)) main.push([name.replace(/_/g, " "), value]);
  }
  for (const [name, value] of main) {
    const item = el("div");
    item.append(el("dt", name), el("dd", num(value, 1)));
    items.push(item);
  }
  document.getElementById("counters").replaceChildren(...items);
}

function renderLog(id, entries, line) {
  const items = entries.slice().reverse().map((entry) => {
    const item = el("li");
    for (const [text, className] of line(entry)) item.append(el("span", text, className));
    return item;
  });
  if (items.length === 0) items.push(el("li", "none", "muted"));
  document.getElementById(id).replaceChildren(...items);
}

function renderDetail(task) {
  const section = document.getElementById("detail");
  section.hidden = false;
  document.getElementById("detail-name").textContent = task.name;
  statusBadge(document.getElementById("detail-status"), task.status);
  const stop = document.getElementById("detail-stop");
  stop.hidden = !task.running;
  show(document.getElementById("detail-error"), task.error || task.config_error || "");
  setField("algorithm", task.algorithm || "-");
  setField("env", task.env || "-");
  setField("elapsed", seconds(task.elapsed_s));
  setField("train_count", num(task.train_count), task.train_count);
  setField("env_steps", num(task.env_steps), task.env_steps);
  setField("params_version", num(task.params_version), task.params_version);
  setField("end_reason", task.end_reason || "-");
  if (task.trainer) renderSlots(task);
  if (task.counters) renderCounters(task.counters, task.batches_in_flight);
  const curve = task.curve || { source: "", points: [] };
  document.getElementById("curve-source").textContent = curve.source ? "(" + curve.source + ")" : "";
  drawCurve(document.getElementById("curve"), curve.points);
  renderLog("events", task.events || [], (e) => [
    [clock(e.ts), "time"], [e.level, "level " + (e.level === "ERROR" || e.level === "WARNING" ? "warn" : "")],
    [e.source, "source"], [e.text, "text"],
  ]);
  renderLog("dead-letters", task.dead_letters || [], (d) => [
    [clock(d.ts), "time"], [num(d.size) + " bytes", "level"], [d.source, "source"], [d.reason, "text"],
  ]);
}

function clearDetail(message) {
  document.getElementById("detail").hidden = false;
  document.getElementById("detail-name").textContent = selected || "";
  statusBadge(document.getElementById("detail-status"), null);
  document.getElementById("detail-stop").hidden = true;
  show(document.getElementById("detail-error"), message);
}

document.getElementById("detail-stop").addEventListener("click", () => {
  if (detailTask) stopTask(detailTask.name);
});

// ------------------------------------------------------------------ the reward curve
function drawCurve(canvas, points) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth || 900;
  const height = canvas.clientHeight || 300;
  if (canvas.width !== Math.round(width * ratio)) canvas.width = Math.round(width * ratio);
  if (canvas.height !== Math.round(height * ratio)) canvas.height = Math.round(height * ratio);
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, width, height);
  canvas.dataset.points = String(points.length);

  const ys = [];
  for (const p of points) {
    for (const key of ["reward_mean", "reward_min", "reward_max", "eval_mean"]) if (isNum(p[key])) ys.push(p[key]);
  }
  const xs = points.filter((p) => isNum(p.x)).map((p) => p.x);
  ctx.font = "12px sans-serif";
  ctx.fillStyle = "#666";
  if (ys.length === 0 || xs.length === 0) {
    ctx.fillText("no rewards yet: the curve appears when an actor finishes an episode", 20, height / 2);
    return;
  }
  const pad = { left: 60, right: 16, top: 12, bottom: 32 };
  let [x0, x1] = [Math.min(...xs), Math.max(...xs)];
  let [y0, y1] = [Math.min(...ys), Math.max(...ys)];
  if (x1 === x0) x1 = x0 + 1;
  if (y1 === y0) [y0, y1] = [y0 - 1, y1 + 1];
  const sx = (x) => pad.left + ((x - x0) / (x1 - x0)) * (width - pad.left - pad.right);
  const sy = (y) => height - pad.bottom - ((y - y0) / (y1 - y0)) * (height - pad.top - pad.bottom);

  ctx.strokeStyle = "#bbb";
  ctx.beginPath();
  ctx.moveTo(pad.left, pad.top);
  ctx.lineTo(pad.left, height - pad.bottom);
  ctx.lineTo(width - pad.right, height - pad.bottom);
  ctx.stroke();
  ctx.fillText(num(y1), 4, pad.top + 10);
  ctx.fillText(num(y0), 4, height - pad.bottom);
  ctx.fillText(num(x0), pad.left, height - 10);
  const right = num(x1) + " env steps";
  ctx.fillText(right, width - pad.right - ctx.measureText(right).width, height - 10);

  const band = points.filter((p) => isNum(p.x) && isNum(p.reward_min) && isNum(p.reward_max));
  if (band.length > 1) {
    ctx.fillStyle = "rgba(31, 119, 180, 0.15)";
    ctx.beginPath();
    band.forEach((p, i) => (i === 0 ? ctx.moveTo(sx(p.x), sy(p.reward_max)) : ctx.lineTo(sx(p.x), sy(p.reward_max))));
    band.slice().reverse().forEach((p) => ctx.lineTo(sx(p.x), sy(p.reward_min)));
    ctx.closePath();
    ctx.fill();
  }
  line(ctx, points, "reward_mean", "#1f77b4", sx, sy);
  line(ctx, points, "eval_mean", "#ff7f0e", sx, sy);
}

function line(ctx, points, key, color, sx, sy) {
  const shown = points.filter((p) => isNum(p.x) && isNum(p[key]));
  if (shown.length === 0) return;
  ctx.strokeStyle = color;
  ctx.fillStyle = color;
  ctx.lineWidth = 2;
  ctx.beginPath();
  shown.forEach((p, i) => (i === 0 ? ctx.moveTo(sx(p.x), sy(p[key])) : ctx.lineTo(sx(p.x), sy(p[key]))));
  ctx.stroke();
  const last = shown[shown.length - 1];
  ctx.beginPath();
  ctx.arc(sx(last.x), sy(last[key]), 3, 0, 2 * Math.PI);
  ctx.fill();
  ctx.lineWidth = 1;
}

// ------------------------------------------------------------------ the poll loop
let polling = false;
let timer = null;

async function poll() {
  if (polling) return;
  polling = true;
  clearTimeout(timer);
  const banner = document.getElementById("banner");
  try {
    renderTasks(await getJSON("/api/tasks"));
    show(banner, "");
    if (selected !== null) {
      try {
        detailTask = await getJSON("/api/task/" + encodeURIComponent(selected));
        renderDetail(detailTask);
      } catch (e) {
        detailTask = null;
        clearDetail(e.message);
      }
    }
    document.getElementById("updated").textContent = "updated " + new Date().toLocaleTimeString();
  } catch (e) {
    show(banner, "Cannot read the board: " + e.message);
  } finally {
    polling = false;
    timer = setTimeout(poll, POLL_MS);
  }
}

selected = selectedFromHash();
poll();
