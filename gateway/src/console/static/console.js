// Metronome operator console: snapshots from /console/api/*, then live updates from the
// SSE stream /console/api/events. Every value is written with textContent, never as HTML,
// so nothing a record holds can run in the page.
"use strict";

const $ = (sel) => document.querySelector(sel);

function el(tag, text, attrs) {
  const e = document.createElement(tag);
  if (text !== undefined && text !== null) e.textContent = String(text);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  return e;
}

function row(cells, attrs) {
  const tr = el("tr", null, attrs);
  for (const c of cells) {
    const num = typeof c === "number";
    tr.appendChild(el("td", c, num ? { class: "num" } : {}));
  }
  return tr;
}

const na = (v, f) => (v === null || v === undefined ? "n/a" : f(v));
const ms = (v) => na(v, (x) => `${Math.round(x)} ms`);
const tps = (v) => na(v, (x) => `${x.toFixed(1)} tok/s`);
const pct = (v) => na(v, (x) => `${(x * 100).toFixed(0)}%`);
const num3 = (v) => na(v, (x) => x.toFixed(3));
const clock = (t) => new Date(t).toISOString().slice(11, 23);

async function getJson(path) {
  const r = await fetch(path, { headers: { accept: "application/json" }, credentials: "same-origin" });
  const body = await r.json().catch(() => null);
  if (!r.ok) {
    const msg = body && body.error ? body.error.message : `HTTP ${r.status}`;
    throw new Error(msg);
  }
  return body;
}

let lastWorkers = [];
let lastStatus = null;
let lastQueues = [];

function renderWorkers(data) {
  lastWorkers = data.workers || [];
  lastWorkers.sort((a, b) => a.status.worker_id.localeCompare(b.status.worker_id));
  const body = $("#workers tbody");
  body.replaceChildren();
  for (const w of lastWorkers) {
    const s = w.status;
    const e = w.ewma || {};
    const tr = row([
      s.worker_id, s.model, w.state, `${s.active}/${s.max_concurrency}`, s.queued,
      s.kv ? pct(s.kv.used_frac) : "n/a", s.gpu ? pct(s.gpu.util_frac) : "n/a",
      ms(e.ttft_ms), ms(e.tpot_ms), tps(e.tok_s), tps(w.single_stream_tok_s),
      `${(w.heartbeat_age_ms / 1000).toFixed(1)} s`,
    ], { "data-worker": s.worker_id });
    tr.children[2].setAttribute("data-state", w.state);
    body.appendChild(tr);
  }
  $("#workers-note").textContent = lastWorkers.length
    ? `${lastWorkers.length} workers in the workers bucket`
    : "no worker has a heartbeat in the workers bucket";
  renderModels();
}

function renderStatus(report) {
  lastStatus = report;
  const l = report.leader;
  $("#leader").textContent = l ? l.holder : "none";
  $("#leader").setAttribute("data-state", l ? "up" : "down");
  $("#epoch").textContent = l && l.epoch !== null ? l.epoch : "n/a";
  $("#jobs-waiting").textContent = na(report.jobs_waiting, (x) => x);
  $("#rate").textContent = report.decisions_per_s.toFixed(2);
  // The status judges the snapshots against the leader's own epoch.
  if (report.queues) lastQueues = report.queues;
  renderModels();
}

function renderQueues(data) {
  lastQueues = data.queues || [];
  renderModels();
}

function staleReason(f) {
  if (!f || f.state === "fresh") return "";
  if (f.state === "old") return `stale: written ${(f.age_ms / 1000).toFixed(1)} s ago`;
  return `stale: from epoch ${f.epoch}, the leader is at ${f.leader_epoch}`;
}

function renderModels() {
  const models = new Map();
  const get = (m) => {
    if (!models.has(m)) models.set(m, { up: 0, running: 0, queued: 0, stats: null, queue: null });
    return models.get(m);
  };
  for (const w of lastWorkers) {
    const m = get(w.status.model);
    if (w.state === "up") m.up += 1;
    m.running += w.status.active;
    m.queued += w.status.queued;
  }
  for (const [name, stats] of Object.entries((lastStatus && lastStatus.models) || {})) {
    get(name).stats = stats;
  }
  for (const q of lastQueues) get(q.model).queue = q;
  const body = $("#models tbody");
  body.replaceChildren();
  for (const name of [...models.keys()].sort()) {
    const m = models.get(name);
    const st = m.stats || { assigned: 0, rejected: 0, expired: 0, mean_queue_wait_ms: null, max_queue_wait_ms: null };
    const q = m.queue;
    const stale = q ? staleReason(q.freshness) : "";
    const waiting = q ? (stale ? `${q.waiting} (${stale})` : q.waiting) : "n/a";
    const oldest = q && q.waiting > 0 ? ms(q.oldest_wait_ms) : (q ? "-" : "n/a");
    const tr = row([
      name, m.up, m.running, m.queued, waiting, oldest, st.assigned, st.rejected, st.expired,
      ms(st.mean_queue_wait_ms), ms(st.max_queue_wait_ms),
    ], { "data-model": name, "data-queue-state": q ? (stale ? "stale" : "fresh") : "none" });
    if (q) tr.children[4].setAttribute("data-waiting", q.waiting);
    body.appendChild(tr);
  }
}

const FEED_MAX = 200;

function feedRow(d) {
  const p = d.predicted || {};
  const tr = row([
    clock(d.decided_ms), d.job_id, d.model || "?", d.outcome, d.worker_id || "-",
    ms(p.ttft_ms), tps(p.decode_tok_s), ms(d.queue_wait_ms), d.reason || d.reason_code || "",
  ], { "data-job": d.job_id, "data-outcome": d.outcome });
  tr.addEventListener("click", () => showExplain(d.job_id));
  return tr;
}

function addDecision(d, atTop) {
  const body = $("#feed tbody");
  const tr = feedRow(d);
  if (atTop) body.insertBefore(tr, body.firstChild); else body.appendChild(tr);
  while (body.children.length > FEED_MAX) body.removeChild(body.lastChild);
}

function table(headings, rows, attrs) {
  const t = el("table", null, attrs);
  const head = el("tr");
  for (const h of headings) head.appendChild(el("th", h));
  t.appendChild(el("thead")).appendChild(head);
  const body = el("tbody");
  for (const r of rows) body.appendChild(r);
  t.appendChild(body);
  return t;
}

// A candidate's terms in full. Records of version 3 (what the API serves) give the term
// names and weights once per decision (`scoring`) and each candidate's raw and normalised
// values as arrays in that order; version 2 listed each term as an object.
function candidateTerms(candidate, scoring) {
  if (Array.isArray(candidate.terms)) return candidate.terms;
  const names = (scoring && scoring.terms) || [];
  return names.map((name, i) => {
    const raw = candidate.raw ? candidate.raw[i] : null;
    const normalised = candidate.normalised ? candidate.normalised[i] : 0;
    const weight = scoring.weights ? scoring.weights[i] : 0;
    return { term: name, raw, normalised, weight, contribution: normalised * weight,
      available: raw !== null && raw !== undefined };
  });
}

function termTable(candidate, scoring) {
  return table(["term", "raw", "normalised", "weight", "contribution", ""],
    candidateTerms(candidate, scoring).map((term) => row([
      term.term, na(term.raw, (x) => +x.toFixed(3)), num3(term.normalised), num3(term.weight),
      num3(term.contribution), term.available ? "" : "signal unavailable",
    ], { "data-term": term.term })),
    { class: "terms", "data-candidate": candidate.worker_id });
}

function renderExplain(story) {
  const box = $("#explain");
  box.replaceChildren();
  const s = story.summary || {};
  const last = story.decisions[story.decisions.length - 1];
  box.setAttribute("data-state", "shown");
  box.setAttribute("data-job", story.job_id);
  box.setAttribute("data-outcome", s.outcome || "");
  box.setAttribute("data-winner", s.winner || "");
  const headline = s.winner
    ? `Job ${story.job_id} (${last.model || "?"}): ${s.outcome} to ${s.winner}` +
      (s.runner_up ? `, ${num3(s.margin)} ahead of ${s.runner_up}` : "") +
      ` after ${s.queue_wait_ms} ms in queue (attempt ${last.attempt})`
    : `Job ${story.job_id} (${last.model || "?"}): ${s.outcome}` +
      (last.reason ? `: ${last.reason}` : "");
  box.appendChild(el("p", headline, { id: "explain-headline" }));
  if (s.slo) box.appendChild(el("p", `SLO: first token within ${s.slo.ttft_ms} ms, at least ${s.slo.min_tok_s} tok/s`));

  box.appendChild(el("h3", `Candidates (${last.candidates.length}, lowest total wins)`));
  const cands = [...last.candidates].sort((a, b) => a.total - b.total);
  for (const c of cands) {
    const p = c.prediction;
    const isWinner = c.worker_id === s.winner;
    box.appendChild(el("p",
      `${c.worker_id}  total ${num3(c.total)}${isWinner ? "  ← winner" : ""}` +
      (p ? `  predicted TTFT ${ms(p.ttft_ms)}, ${tps(p.decode_tok_s)}, ${p.streams_after} streams after` : "") +
      // Prompt tokens the worker was believed to hold in its prefix cache, and from what:
      // its model server's KV events, or the leader's estimate from its placements.
      (c.cached_prefix ? `  cached prefix ${c.cached_prefix.tokens} tokens (${c.cached_prefix.source})` : ""),
      { class: isWinner ? "candidate winner" : "candidate", "data-candidate-total": c.worker_id,
        "data-cached-source": c.cached_prefix ? c.cached_prefix.source : "" }));
    box.appendChild(termTable(c, last.scoring));
  }

  if (last.rejected.length) {
    box.appendChild(el("h3", `Not eligible (${last.rejected.length})`));
    box.appendChild(table(["worker", "code", "reason"],
      last.rejected.map((r) => row([r.worker_id, r.code, r.reason], { "data-rejected": r.worker_id })),
      { id: "explain-rejected" }));
  }

  box.appendChild(el("h3", "What happened"));
  const a = s.actual;
  const pr = s.predicted || {};
  const rows = [
    row(["TTFT on the worker", ms(pr.ttft_ms), a ? ms(a.ttft_ms) : "n/a"]),
    row(["decode rate", tps(pr.decode_tok_s), a ? tps(a.tok_s) : "n/a"]),
    row(["end-to-end", "-", a ? ms(a.e2e_ms) : "n/a"]),
    row(["outcome", "-", a ? `${a.outcome}, ${a.output_tokens} output tokens` : "no completion event yet"],
      { "data-actual-outcome": a ? a.outcome : "" }),
  ];
  if (s.slo_met !== null && s.slo_met !== undefined) rows.push(row(["SLO met", "-", s.slo_met ? "yes" : "no"]));
  box.appendChild(table(["", "predicted", "measured"], rows, { id: "explain-outcome" }));
  if (story.result) {
    const r = story.result;
    box.appendChild(el("p", r.error
      ? `Final result: ${r.error.code}: ${r.error.message}`
      : `Final result: ok from ${r.worker_id}, ${r.usage.prompt_tokens} prompt + ${r.usage.completion_tokens} completion tokens in ${r.chunks} chunks`,
      { id: "explain-result" }));
  }
  const details = el("details");
  details.appendChild(el("summary", "as `metronome explain` prints it"));
  details.appendChild(el("pre", story.text));
  box.appendChild(details);
}

async function showExplain(jobId) {
  jobId = (jobId || "").trim();
  if (!jobId) return;
  $("#explain-id").value = jobId;
  const url = new URL(location.href);
  url.searchParams.set("job", jobId);
  history.replaceState(null, "", url);
  const box = $("#explain");
  box.setAttribute("data-state", "loading");
  box.replaceChildren(el("p", `reading the records of ${jobId}…`));
  try {
    renderExplain(await getJson(`/console/api/explain/${encodeURIComponent(jobId)}`));
  } catch (e) {
    box.setAttribute("data-state", "error");
    box.replaceChildren(el("p", e.message, { class: "error" }));
  }
}

function follow() {
  const live = $("#live");
  const source = new EventSource("/console/api/events");
  source.addEventListener("open", () => { live.textContent = "connected"; live.setAttribute("data-state", "up"); });
  source.addEventListener("error", () => { live.textContent = "reconnecting"; live.setAttribute("data-state", "connecting"); });
  source.addEventListener("workers", (m) => renderWorkers(JSON.parse(m.data)));
  source.addEventListener("status", (m) => renderStatus(JSON.parse(m.data)));
  source.addEventListener("queues", (m) => renderQueues(JSON.parse(m.data)));
  source.addEventListener("decision", (m) => addDecision(JSON.parse(m.data), true));
  source.addEventListener("problem", (m) => { $("#workers-note").textContent = JSON.parse(m.data).message; });
}

async function start() {
  $("#explain-form").addEventListener("submit", (e) => { e.preventDefault(); showExplain($("#explain-id").value); });
  const job = new URLSearchParams(location.search).get("job");
  const loads = [
    getJson("/console/api/workers").then(renderWorkers),
    getJson("/console/api/status").then(renderStatus),
    getJson("/console/api/queues").then(renderQueues),
    getJson("/console/api/decisions?n=50").then((ds) => { for (const d of ds) addDecision(d, true); }),
  ];
  if (job) loads.push(showExplain(job));
  const results = await Promise.allSettled(loads);
  const failed = results.find((r) => r.status === "rejected");
  if (failed) $("#workers-note").textContent = `could not read the system: ${failed.reason.message}`;
  document.body.setAttribute("data-loaded", failed ? "partial" : "yes");
  // `?live=0`: a snapshot that stays as loaded (a page to print or attach to a ticket;
  // headless renderers also need the network to go quiet).
  if (new URLSearchParams(location.search).get("live") === "0") {
    $("#live").textContent = "off (snapshot)";
    $("#live").setAttribute("data-state", "draining");
  } else {
    follow();
  }
}

start();
