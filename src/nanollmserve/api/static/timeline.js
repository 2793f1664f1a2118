// nanollmserve playground: the Timeline tab. While the tab is open it polls the engine's
// flight recorder (GET /debug/steps?since=N: JSON lines, needs --enable-debug-endpoints) and
// draws the last TIMELINE_WINDOW steps on a <canvas>: one row per request, one column per
// step, each cell coloured by what the request was doing in that step (queued, prefill chunk,
// decode, preempted, finished); underneath, a band with the KV pool's occupancy and the
// prefix-cache hits. Hovering a step shows its record.
//
// /debug/steps is an admin route: it is read with the key typed in the tab's own "admin key"
// field (the server's --admin-api-key, kept in sessionStorage like the API key), never the
// API key. Loaded after app.js, whose `$` it uses. The canvas is redrawn only when
// something changed, once per animation frame at most. `window.timelineModel` is a plain
// summary of what is drawn (for the browser tests, and anyone curious in the console).
// Like app.js, it never turns text into HTML: the record is shown with textContent.
"use strict";

const TIMELINE_WINDOW = 500; // steps kept and drawn
const TIMELINE_POLL_MS = 500;
const TIMELINE_RETRY_MS = 3000; // after an error answer (no key yet, endpoint off)
const TIMELINE_MIN_COLUMNS = 60; // fewer steps than this are drawn as wide columns
const HEADER_ONLY_SINCE = "9223372036854775807"; // the largest `since`: the engine line only
const PHASES = ["queued", "prefill", "decode", "preempted", "finished"];
// Canvas geometry in CSS pixels.
const GUTTER = 128; // row labels
const AXIS = 18; // step numbers on top
const BAND = 56; // KV pool band at the bottom
const MAX_ROW = 16;
const MIN_ROW = 3;

const timeline = {
  open: false, // the tab is shown: keep polling
  timer: null,
  polling: false, // a poll is in flight (a tab switch must not start a second loop)
  reanchor: false, // the tab was reopened during a poll: that poll's anchor is stale
  since: null, // the next step to ask for; null: find it from the engine line first
  numKvBlocks: 0,
  steps: [], // {record, cells: Map(request id -> phase), prefixHitBlocks}, oldest first
  live: new Map(), // unfinished request id -> "queued" | "running" | "preempted"
  rows: [], // request ids with a cell in the window, in order of first appearance
  status: "idle",
  message: "",
  hover: null, // {index (into steps), requestId}
  drawPending: false,
  draws: 0,
  colors: null,
};

// ---------------------------------------------------------------- polling

function showTimeline(open) {
  timeline.open = open;
  clearTimeout(timeline.timer);
  if (!open) return;
  timeline.since = null; // steps may have run while the tab was hidden: re-anchor
  // A poll still in flight read /stats and the engine before the tab reopened: the next
  // poll anchors again (else that poll's answer would set `since` and hide a router).
  if (timeline.polling) timeline.reanchor = true;
  else pollTimeline();
  scheduleTimelineDraw();
}

function nextTimelinePoll(delay) {
  clearTimeout(timeline.timer);
  if (timeline.open) timeline.timer = setTimeout(pollTimeline, delay);
}

const ADMIN_KEY_STORAGE = "nanollmserve.adminKey";

function adminHeaders() {
  const key = $("admin-key").value.trim();
  return key ? { Authorization: "Bearer " + key } : {};
}

async function fetchSteps(since) {
  const response = await fetch("/debug/steps?since=" + since, {
    headers: adminHeaders(),
    cache: "no-store",
  });
  if (!response.ok) return { response, lines: null };
  const lines = (await response.text())
    .split("\n")
    .filter((line) => line)
    .map((line) => JSON.parse(line));
  return { response, lines };
}

async function pollTimeline() {
  timeline.polling = true;
  let delay = TIMELINE_POLL_MS;
  try {
    if (timeline.since === null && !(await anchorTimeline())) {
      delay = TIMELINE_RETRY_MS;
    } else {
      const { response, lines } = await fetchSteps(timeline.since);
      if (!lines) {
        await setTimelineError(response);
        delay = TIMELINE_RETRY_MS;
      } else if (lines[0].num_steps < timeline.since) {
        resetTimeline(); // the server restarted: its steps count from 0 again
        timeline.since = null;
      } else {
        setTimelineStatus("live", "");
        ingestSteps(lines.slice(1));
      }
    }
  } catch (err) {
    setTimelineStatus("error", "cannot read /debug/steps: " + err.message);
    delay = TIMELINE_RETRY_MS;
  }
  timeline.polling = false;
  if (timeline.reanchor) {
    timeline.reanchor = false;
    timeline.since = null;
    delay = 0;
  }
  nextTimelinePoll(delay);
}

// Asks for the engine line alone and starts at most TIMELINE_WINDOW steps back, so opening
// the tab on a long-running server does not download its whole ring. Behind the router with
// several workers each poll could reach another engine: refused, saying what to do.
async function anchorTimeline() {
  const stats = await fetch("/stats", { headers: authHeaders(), cache: "no-store" });
  if (stats.ok) {
    const workers = (await stats.json()).workers;
    if (Array.isArray(workers) && workers.length > 1) {
      setTimelineStatus(
        "router",
        "This page is served by the router, which sends each request to one of its " +
          workers.length + " workers: open the playground on one worker's own address " +
          "(started with --enable-debug-endpoints) to see that engine's timeline.",
      );
      return false;
    }
  }
  const { response, lines } = await fetchSteps(HEADER_ONLY_SINCE);
  if (!lines) {
    await setTimelineError(response);
    return false;
  }
  const engine = lines[0];
  const start = Math.max(engine.first_step, engine.num_steps - TIMELINE_WINDOW);
  const kept = timeline.steps;
  const last = kept.length ? kept[kept.length - 1].record.step : -1;
  // Start afresh when steps were missed while the tab was hidden, or on another engine.
  const missed = start > last + 1 || engine.num_steps < last + 1;
  const fresh = missed || engine.num_kv_blocks !== timeline.numKvBlocks;
  if (fresh) resetTimeline();
  timeline.numKvBlocks = engine.num_kv_blocks;
  timeline.since = fresh ? start : last + 1;
  setTimelineStatus("live", "");
  return true;
}

async function setTimelineError(response) {
  let detail = "";
  try {
    detail = (await response.json()).error.message;
  } catch (_) {
    detail = response.statusText;
  }
  if (response.status === 404) {
    setTimelineStatus(
      "off",
      "The flight recorder is not served here (GET /debug/steps answered 404: " + detail +
        "). Start the server with --enable-debug-endpoints and --admin-api-key (and " +
        "--step-record above 0), e.g. `NANOLLMSERVE_ADMIN_API_KEY=... nanollmserve serve " +
        "--enable-debug-endpoints`, to see the timeline.",
    );
  } else if (response.status === 401) {
    setTimelineStatus(
      "needs-key",
      "401: enter the admin API key (--admin-api-key) in the admin key field (" + detail + ").",
    );
  } else {
    setTimelineStatus("error", "GET /debug/steps answered " + response.status + ": " + detail);
  }
}

function setTimelineStatus(status, message) {
  if (status === timeline.status && message === timeline.message) return;
  timeline.status = status;
  timeline.message = message;
  $("timeline-notice").textContent = message;
  $("timeline-notice").hidden = !message;
  publishTimelineModel();
}

// ---------------------------------------------------------------- the model

function resetTimeline() {
  timeline.steps = [];
  timeline.live = new Map();
  timeline.rows = [];
  timeline.hover = null;
}

function ingestSteps(records) {
  if (!records.length) return;
  for (const record of records) timeline.steps.push(stepView(record));
  timeline.since = records[records.length - 1].step + 1;
  if (timeline.steps.length > TIMELINE_WINDOW) {
    timeline.steps.splice(0, timeline.steps.length - TIMELINE_WINDOW);
    timeline.hover = null;
  }
  timeline.rows = rowsOf(timeline.steps);
  publishTimelineModel();
  scheduleTimelineDraw();
}

// One step's cells: what each request the engine knew about was doing in it. A request is
// queued from its arrival until it is scheduled, preempted from its preemption until it is
// scheduled again, and its last cell is "finished" (it finished or was aborted).
function stepView(record) {
  const live = timeline.live;
  const cells = new Map();
  for (const arrival of record.arrivals) live.set(arrival.request_id, "queued");
  for (const entry of record.batch) {
    live.set(entry.request_id, "running");
    cells.set(entry.request_id, entry.phase === "decode" ? "decode" : "prefill");
  }
  for (const preemption of record.preemptions) {
    live.set(preemption.request_id, "preempted");
    cells.set(preemption.request_id, "preempted");
  }
  const ended = record.finished.map((f) => f.request_id).concat(record.aborts);
  for (const requestId of ended) {
    if (cells.has(requestId) || live.has(requestId)) cells.set(requestId, "finished");
    live.delete(requestId);
  }
  for (const [requestId, state] of live) {
    if (!cells.has(requestId)) {
      cells.set(requestId, state === "preempted" ? "preempted" : "queued");
    }
  }
  let prefixHitBlocks = 0;
  for (const event of record.kv_blocks.requests) prefixHitBlocks += event.prefix_hit;
  return { record, cells, prefixHitBlocks };
}

function rowsOf(steps) {
  const seen = new Set();
  for (const view of steps) for (const requestId of view.cells.keys()) seen.add(requestId);
  return [...seen];
}

// What is drawn, as plain data, with the totals a hover would show (speculative drafts,
// grammar-masked samplings): window.timelineModel.
function publishTimelineModel() {
  const steps = timeline.steps;
  const cells = Object.fromEntries(PHASES.map((phase) => [phase, 0]));
  const preemptions = [];
  const prefixHits = [];
  let maxKvUsed = 0;
  const drafts = { proposed: 0, accepted: 0 };
  let grammarMasks = 0;
  for (const { record, cells: stepCells } of steps) {
    for (const entry of record.batch) {
      drafts.proposed += entry.draft_proposed;
      drafts.accepted += entry.draft_accepted;
    }
    grammarMasks += record.grammar_masks;
    for (const phase of stepCells.values()) cells[phase] += 1;
    for (const p of record.preemptions) {
      preemptions.push({ step: record.step, request_id: p.request_id, reason: p.reason });
    }
    for (const { request_id, prefix_hit } of record.kv_blocks.requests) {
      if (prefix_hit) prefixHits.push({ step: record.step, request_id, blocks: prefix_hit });
    }
    maxKvUsed = Math.max(maxKvUsed, record.kv_blocks.used);
  }
  const last = steps.length ? steps[steps.length - 1].record : null;
  window.timelineModel = {
    status: timeline.status,
    message: timeline.message,
    firstStep: steps.length ? steps[0].record.step : null,
    lastStep: last ? last.step : null,
    numSteps: steps.length,
    numKvBlocks: timeline.numKvBlocks,
    kvUsed: last ? last.kv_blocks.used : 0,
    maxKvUsed,
    rows: timeline.rows.slice(),
    cells,
    preemptions,
    prefixHits,
    drafts,
    grammarMasks,
    draws: timeline.draws,
  };
  $("timeline-summary").textContent = steps.length
    ? "steps " + steps[0].record.step + "–" + last.step + " · " + timeline.rows.length +
      " requests · KV " + last.kv_blocks.used + "/" + timeline.numKvBlocks + " blocks · " +
      preemptions.length + " preemptions · " + prefixHits.length + " prefix hits"
    : "";
}

// ---------------------------------------------------------------- drawing

function scheduleTimelineDraw() {
  if (timeline.drawPending) return;
  timeline.drawPending = true;
  requestAnimationFrame(() => {
    timeline.drawPending = false;
    drawTimeline();
  });
}

function timelineColors() {
  if (!timeline.colors) {
    const style = getComputedStyle(document.documentElement);
    const color = (name) => style.getPropertyValue(name).trim();
    timeline.colors = {
      ...Object.fromEntries(PHASES.map((phase) => [phase, color("--phase-" + phase)])),
      kv: color("--kv-used"),
      hit: color("--prefix-hit"),
      text: color("--muted"),
      grid: color("--border"),
    };
  }
  return timeline.colors;
}

// The canvas's layout for its current size: which rows fit, and where cells go.
function timelineLayout(canvas) {
  const width = canvas.clientWidth;
  const height = canvas.clientHeight;
  const plotHeight = Math.max(0, height - AXIS - BAND - 8);
  const fitted = Math.floor(plotHeight / Math.max(1, timeline.rows.length));
  const rowHeight = Math.min(MAX_ROW, Math.max(MIN_ROW, fitted));
  const maxRows = Math.max(1, Math.floor(plotHeight / rowHeight));
  const rows = timeline.rows.slice(-maxRows); // the most recent requests when they do not fit
  const columns = Math.max(timeline.steps.length, TIMELINE_MIN_COLUMNS);
  const cellWidth = Math.max(0, width - GUTTER) / columns;
  const bandTop = height - BAND;
  return { width, height, rows, rowHeight, cellWidth, bandTop };
}

function drawTimeline() {
  const canvas = $("timeline-canvas");
  const ratio = window.devicePixelRatio || 1;
  const width = Math.round(canvas.clientWidth * ratio);
  const height = Math.round(canvas.clientHeight * ratio);
  if (!width || !height) return; // hidden
  if (canvas.width !== width || canvas.height !== height) {
    canvas.width = width;
    canvas.height = height;
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  const layout = timelineLayout(canvas);
  const colors = timelineColors();
  ctx.clearRect(0, 0, layout.width, layout.height);
  ctx.font = "11px ui-monospace, Menlo, Consolas, monospace";
  ctx.textBaseline = "middle";

  const rowIndex = new Map(layout.rows.map((requestId, i) => [requestId, i]));
  const gap = layout.rowHeight > 6 ? 1 : 0; // a line between rows when they are tall enough
  const cellWidth = Math.max(1, layout.cellWidth > 3 ? layout.cellWidth - 0.5 : layout.cellWidth);
  // One path per phase: five fills a frame, however many cells.
  for (const phase of PHASES) {
    ctx.beginPath();
    timeline.steps.forEach((view, i) => {
      const x = GUTTER + i * layout.cellWidth;
      for (const [requestId, cellPhase] of view.cells) {
        const row = rowIndex.get(requestId);
        if (cellPhase !== phase || row === undefined) continue;
        ctx.rect(x, AXIS + row * layout.rowHeight, cellWidth, layout.rowHeight - gap);
      }
    });
    ctx.fillStyle = colors[phase];
    ctx.fill();
  }

  ctx.fillStyle = colors.text;
  if (layout.rowHeight >= 9) {
    layout.rows.forEach((requestId, i) => {
      ctx.fillText(shortRequestId(requestId), 4, AXIS + (i + 0.5) * layout.rowHeight, GUTTER - 8);
    });
  }
  drawStepAxis(ctx, layout, colors);
  drawKvBand(ctx, layout, colors);
  drawHover(ctx, layout, rowIndex);
  timeline.draws += 1;
  if (window.timelineModel) window.timelineModel.draws = timeline.draws;
}

function shortRequestId(requestId) {
  return requestId.length > 18 ? requestId.slice(0, 6) + "…" + requestId.slice(-9) : requestId;
}

function drawStepAxis(ctx, layout, colors) {
  const every = Math.max(1, Math.ceil(80 / Math.max(layout.cellWidth, 0.01)));
  ctx.fillStyle = colors.text;
  ctx.fillText("step", 4, AXIS / 2);
  timeline.steps.forEach((view, i) => {
    if (view.record.step % every === 0) {
      ctx.fillText(String(view.record.step), GUTTER + i * layout.cellWidth, AXIS / 2);
    }
  });
}

// KV blocks in use (grey, as a fraction of the pool) and prefix-hit blocks (on top) per step.
function drawKvBand(ctx, layout, colors) {
  const top = layout.bandTop + 4;
  const height = BAND - 8;
  ctx.strokeStyle = colors.grid;
  ctx.strokeRect(GUTTER - 0.5, top - 0.5, layout.width - GUTTER, height + 1);
  ctx.fillStyle = colors.text;
  ctx.fillText("KV pool", 4, top + height / 3);
  ctx.fillText(timeline.numKvBlocks + " blocks", 4, top + (2 * height) / 3);
  const total = Math.max(1, timeline.numKvBlocks);
  ctx.beginPath();
  timeline.steps.forEach((view, i) => {
    const used = Math.min(1, view.record.kv_blocks.used / total) * height;
    const x = GUTTER + i * layout.cellWidth;
    ctx.rect(x, top + height - used, Math.max(1, layout.cellWidth), used);
  });
  ctx.fillStyle = colors.kv;
  ctx.fill();
  ctx.beginPath();
  timeline.steps.forEach((view, i) => {
    if (!view.prefixHitBlocks) return;
    const hits = Math.max(6, Math.min(1, view.prefixHitBlocks / total) * height);
    ctx.rect(GUTTER + i * layout.cellWidth, top, Math.max(3, layout.cellWidth), hits);
  });
  ctx.fillStyle = colors.hit;
  ctx.fill();
}

function drawHover(ctx, layout, rowIndex) {
  const hover = timeline.hover;
  if (!hover || hover.index >= timeline.steps.length) return;
  const x = GUTTER + hover.index * layout.cellWidth;
  ctx.strokeStyle = "rgba(15, 23, 42, 0.6)";
  ctx.lineWidth = 1;
  ctx.strokeRect(x - 0.5, AXIS - 0.5, Math.max(1, layout.cellWidth) + 1, layout.height - AXIS);
  const row = rowIndex.get(hover.requestId);
  if (row !== undefined) {
    const y = AXIS + row * layout.rowHeight - 0.5;
    ctx.strokeRect(GUTTER - 0.5, y, layout.width - GUTTER, layout.rowHeight);
  }
}

// ---------------------------------------------------------------- hovering

function onTimelineHover(event) {
  const canvas = $("timeline-canvas");
  const box = canvas.getBoundingClientRect();
  const layout = timelineLayout(canvas);
  const index = Math.floor((event.clientX - box.left - GUTTER) / layout.cellWidth);
  if (index < 0 || index >= timeline.steps.length || layout.cellWidth <= 0) return;
  const row = Math.floor((event.clientY - box.top - AXIS) / layout.rowHeight);
  const requestId = row >= 0 && row < layout.rows.length ? layout.rows[row] : null;
  if (timeline.hover && timeline.hover.index === index && timeline.hover.requestId === requestId) {
    return;
  }
  timeline.hover = { index, requestId };
  showStepRecord(timeline.steps[index], requestId);
  scheduleTimelineDraw();
}

// The step's record as JSON text, headed by the hovered cell: one line per field, and per
// element of a list of objects (the batch, the KV events); prompt token ids are counted
// rather than listed, fractions rounded to 3 decimals.
function showStepRecord(view, requestId) {
  const phase = requestId ? view.cells.get(requestId) : null;
  const head = "step " + view.record.step + (phase ? " · " + requestId + ": " + phase : "");
  $("timeline-detail").textContent = head + "\n" + recordText(view.record);
}

function recordText(record) {
  const compact = (value) =>
    JSON.stringify(value, (key, item) => {
      if (key === "prompt_token_ids" && Array.isArray(item)) return item.length + " token ids";
      return typeof item === "number" && !Number.isInteger(item) ? Number(item.toFixed(3)) : item;
    });
  const field = ([key, value]) => {
    const name = "  " + JSON.stringify(key) + ": ";
    if (Array.isArray(value) && value.length && typeof value[0] === "object") {
      return name + "[\n" + value.map((item) => "    " + compact(item)).join(",\n") + "\n  ]";
    }
    if (key === "kv_blocks" && value.requests.length) {
      const requests = value.requests.map((item) => "    " + compact(item)).join(",\n");
      return name + '{"used": ' + value.used + ', "requests": [\n' + requests + "\n  ]}";
    }
    return name + compact(value);
  };
  return "{\n" + Object.entries(record).map(field).join(",\n") + "\n}";
}

// The centre of a request's cell at a step, in the canvas's CSS pixels (for tests and
// screenshots); null when it is not drawn.
function timelineCellCenter(step, requestId) {
  const canvas = $("timeline-canvas");
  const layout = timelineLayout(canvas);
  const index = timeline.steps.findIndex((view) => view.record.step === step);
  const row = layout.rows.indexOf(requestId);
  if (index < 0 || row < 0) return null;
  return {
    x: GUTTER + (index + 0.5) * layout.cellWidth,
    y: AXIS + (row + 0.5) * layout.rowHeight,
  };
}

function initTimeline() {
  // Like the API key: in sessionStorage only, gone when the tab closes.
  $("admin-key").value = sessionStorage.getItem(ADMIN_KEY_STORAGE) || "";
  $("admin-key").addEventListener("input", () => {
    sessionStorage.setItem(ADMIN_KEY_STORAGE, $("admin-key").value.trim());
  });
  const canvas = $("timeline-canvas");
  canvas.addEventListener("mousemove", onTimelineHover);
  new ResizeObserver(scheduleTimelineDraw).observe(canvas);
  document.addEventListener("playground:tab", (event) => {
    showTimeline(event.detail === "timeline");
  });
  publishTimelineModel();
}

document.addEventListener("DOMContentLoaded", initTimeline);
