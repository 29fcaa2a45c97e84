// The dashboard: a runs table (#/), a run page (#/runs/<id>) that follows the run's events, and
// a comparison of runs (#/compare?ids=<a>,<b>,...) that keeps polling while one of them trains.
// Data from the API is always inserted as text (textContent), never as markup.

import {
  ApiError,
  followRunEvents,
  forgetToken,
  getJson,
  getToken,
  patchJson,
  postJson,
  setToken,
} from "./api.js";
import {
  compareChart,
  destroyPlot,
  evalChart,
  formatNumber,
  lossChart,
  lrChart,
  runColor,
  setCompareData,
  setEvalData,
  setLossData,
  setLrData,
  setSourceLossData,
  sourceLossChart,
} from "./charts.js";

const METRICS = ["loss", "lr", "lr_muon"];
// Points per series in the first read of a run; live points are added at full resolution.
const MAX_POINTS = 2000;
const RUNS_REFRESH_MS = 5000;
const FINISHED = new Set(["succeeded", "failed", "cancelled"]);
// A comparison reads each run's curves thinned to this many points, and again every
// COMPARE_REFRESH_MS while one of its runs has not finished.
const COMPARE_POINTS = 1000;
const COMPARE_REFRESH_MS = 3000;
const COMPARE_METRICS = ["loss", "lr"];
// Why an eval set skips a record, in words, and the share of its records past which a set is
// marked: contracts/reports.py's SKIP_REASONS and SKIPPED_MARK_SHARE.
const SKIP_REASONS = { malformed_json: "malformed JSON", wrong_shape: "wrong shape", no_target: "no target tokens" };
const SKIPPED_MARK_SHARE = 0.02;

// The runs table's filters and the runs ticked for a comparison (in the order ticked: the
// first is the reference), kept while the page lives.
const runsFilter = { status: "", tag: "", name: "" };
const selected = new Set();

const $ = (selector) => document.querySelector(selector);

// Everything the open page holds, so that leaving it stops its timers, stream and charts.
let page = null;

// What the token may do (GET /whoami), read once per token: the page offers only that.
let me = null;

// Read by the browser tests and handy in the console: the open run page's state and charts,
// and the token's role.
window.trainctl = { page: null, me: null };

// --- small DOM helpers ------------------------------------------------------------------

function el(tag, attributes = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attributes)) {
    if (value === undefined || value === null) continue;
    if (key === "class") node.className = value;
    else if (key === "dataset") Object.assign(node.dataset, value);
    else node.setAttribute(key, value);
  }
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : String(child));
  }
  return node;
}

function show(view) {
  for (const id of ["token-view", "runs-view", "run-view", "compare-view"]) $(`#${id}`).hidden = id !== view;
  $("#forget-token").hidden = !getToken();
  const who = $("#whoami");
  who.textContent = me ? `${me.name} (${me.role})` : "";
  who.hidden = !me || !getToken();
}

function showMessage(text) {
  const box = $("#message");
  box.textContent = text;
  box.hidden = false;
}

function clearMessage() {
  $("#message").hidden = true;
  $("#message").textContent = "";
}

function statusBadge(status) {
  return el("span", { class: `status status-${status}` }, status);
}

function ago(iso) {
  if (!iso) return "–";
  const seconds = Math.max(0, (Date.now() - Date.parse(iso)) / 1000);
  if (seconds < 60) return `${Math.round(seconds)} s`;
  if (seconds < 3600) return `${Math.round(seconds / 60)} min`;
  if (seconds < 86400) return `${(seconds / 3600).toFixed(1)} h`;
  return `${(seconds / 86400).toFixed(1)} d`;
}

function when(iso) {
  if (!iso) return "–";
  const date = new Date(iso);
  const pad = (n) => String(n).padStart(2, "0");
  return (
    `${date.getFullYear()}-${pad(date.getMonth() + 1)}-${pad(date.getDate())} ` +
    `${pad(date.getHours())}:${pad(date.getMinutes())}:${pad(date.getSeconds())}`
  );
}

// "preparing: 41% of pretrain.jsonl": the attempt tokenizes a data file into its token store.
function preparingText(preparing) {
  const name = preparing.file.split("/").pop();
  return `preparing: ${Math.round(preparing.fraction * 100)}% of ${name}`;
}

function phaseLabel(run) {
  const phases = run.plan.phases;
  if (run.phase === null) return "–";
  return `${run.phase} (${run.phase_index + 1} of ${phases.length})`;
}

// --- errors and the token -------------------------------------------------------------------

function handleError(err) {
  if (err instanceof ApiError && err.unauthorized) {
    forgetToken();
    forgetMe();
    stopPage();
    show("token-view");
    const what =
      err.status === 401
        ? "The service did not accept the token"
        : "This token may not read runs (the dashboard needs an admin, user or viewer token)";
    showMessage(`${what} (${err.status} ${err.code}): ${err.message}`);
    $("#token-input").focus();
    return;
  }
  if (err instanceof ApiError) {
    showMessage(`${err.status} ${err.code}: ${err.message}`);
    return;
  }
  if (err && err.name === "AbortError") return;
  showMessage(`The service could not be reached: ${err && err.message ? err.message : err}`);
}

$("#token-form").addEventListener("submit", (event) => {
  event.preventDefault();
  const token = $("#token-input").value.trim();
  if (!token) return;
  forgetMe();
  setToken(token);
  $("#token-input").value = "";
  clearMessage();
  route();
});

$("#forget-token").addEventListener("click", () => {
  forgetToken();
  forgetMe();
  stopPage();
  clearMessage();
  route();
});

// --- routing ----------------------------------------------------------------------------------

function stopPage() {
  if (!page) return;
  page.abort.abort();
  for (const timer of page.timers) clearInterval(timer);
  if (page.plots && page.kind === "compare") {
    destroyPlot(page.plots.loss);
    destroyPlot(page.plots.lr);
    for (const plot of Object.values(page.plots.evals)) destroyPlot(plot);
  } else if (page.plots) {
    destroyPlot(page.plots.loss);
    destroyPlot(page.plots.lr);
    destroyPlot(page.plots.sources);
    for (const plot of Object.values(page.plots.evals)) destroyPlot(plot);
  }
  page = null;
  window.trainctl.page = null;
}

function forgetMe() {
  me = null;
  window.trainctl.me = null;
}

async function route() {
  stopPage();
  if (!getToken()) {
    show("token-view");
    $("#token-input").focus();
    return;
  }
  if (!me) {
    try {
      me = await getJson("/whoami");
      window.trainctl.me = me;
    } catch (err) {
      handleError(err);
      return;
    }
  }
  const match = location.hash.match(/^#\/runs\/([^/?#]+)$/);
  const comparing = location.hash.match(/^#\/compare\?ids=([^&#]*)$/);
  if (match) openRun(decodeURIComponent(match[1]));
  else if (comparing) openCompare(decodeURIComponent(comparing[1]).split(",").filter(Boolean));
  else openRuns();
}

window.addEventListener("hashchange", () => {
  clearMessage();
  route();
});

// --- the runs table ---------------------------------------------------------------------------

function openRuns() {
  show("runs-view");
  page = { kind: "runs", abort: new AbortController(), timers: [] };
  const current = page;
  $("#filter-status").value = runsFilter.status;
  $("#filter-tag").value = runsFilter.tag;
  $("#filter-name").value = runsFilter.name;
  renderSelection();
  let reads = 0;
  const load = async () => {
    // A read that a newer one (other filters) overtook is dropped when it answers.
    const read = ++reads;
    try {
      const { signal } = current.abort;
      const filters = {
        limit: 100,
        status: runsFilter.status || undefined,
        tag: runsFilter.tag || undefined,
        name: runsFilter.name || undefined,
      };
      const [runs, workers] = await Promise.all([
        getJson("/runs", filters, { signal }),
        getJson("/workers", { limit: 100 }, { signal }),
      ]);
      if (page !== current || read !== reads) return;
      renderRuns(runs);
      renderWorkers(workers);
    } catch (err) {
      if (page === current) handleError(err);
    }
  };
  current.load = load;
  load();
  page.timers.push(setInterval(load, RUNS_REFRESH_MS));
}

function filtered() {
  return Boolean(runsFilter.status || runsFilter.tag || runsFilter.name);
}

let filterTimer = null;

function applyFilters() {
  runsFilter.status = $("#filter-status").value;
  runsFilter.tag = $("#filter-tag").value.trim();
  runsFilter.name = $("#filter-name").value.trim();
  clearTimeout(filterTimer);
  // Typing reads the runs once it pauses, not at every key.
  filterTimer = setTimeout(() => {
    if (page && page.kind === "runs" && page.load) page.load();
  }, 250);
}

$("#runs-filter").addEventListener("submit", (event) => {
  event.preventDefault();
  applyFilters();
});
for (const id of ["#filter-status", "#filter-tag", "#filter-name"]) {
  $(id).addEventListener("input", applyFilters);
}
$("#filter-clear").addEventListener("click", () => {
  $("#filter-status").value = "";
  $("#filter-tag").value = "";
  $("#filter-name").value = "";
  applyFilters();
});

function renderSelection() {
  const n = selected.size;
  $("#selected-count").textContent = n ? `${n} selected` : "";
  $("#compare-selected").disabled = n < 2;
}

$("#compare-selected").addEventListener("click", () => {
  if (selected.size < 2) return;
  location.hash = `#/compare?ids=${[...selected].map(encodeURIComponent).join(",")}`;
});

function selectBox(run) {
  const box = el("input", {
    type: "checkbox",
    class: "select-run",
    title: "Select for comparison",
    "aria-label": `select ${run.name} for comparison`,
    dataset: { runId: run.id },
  });
  box.checked = selected.has(run.id);
  box.addEventListener("change", () => {
    if (box.checked) selected.add(run.id);
    else selected.delete(run.id);
    renderSelection();
  });
  return box;
}

function tagChips(tags, { clickable = false } = {}) {
  return el(
    "span",
    { class: "tags" },
    ...tags.map((tag) => {
      const chip = el(clickable ? "button" : "span", { class: "tag", type: clickable ? "button" : undefined, dataset: { tag } }, tag);
      if (clickable) {
        chip.title = `Show only runs tagged ${tag}`;
        chip.addEventListener("click", () => {
          $("#filter-tag").value = tag;
          applyFilters();
        });
      }
      return chip;
    }),
  );
}

function renderRuns({ runs, count }) {
  const body = $("#runs-table tbody");
  body.replaceChildren(
    ...runs.map((run) =>
      el(
        "tr",
        { dataset: { runId: run.id, status: run.status } },
        el(
          "td",
          {},
          el(
            "div",
            { class: "run-cell" },
            selectBox(run),
            el(
              "span",
              { class: "run-name" },
              el("a", { href: `#/runs/${encodeURIComponent(run.id)}` }, run.name),
              el("div", { class: "muted mono" }, run.id),
              run.tags && run.tags.length ? tagChips(run.tags, { clickable: true }) : null,
            ),
          ),
        ),
        el(
          "td",
          {},
          statusBadge(run.status),
          run.waiting_for_worker
            ? el("div", { class: "waiting", title: run.waiting_reason }, "waiting for a worker")
            : run.queue_position
              ? el(
                  "div",
                  { class: "waiting", title: run.waiting_reason || "placed on a worker" },
                  `queue #${run.queue_position}`,
                )
              : null,
          run.priority ? el("div", { class: "muted" }, `priority ${run.priority}`) : null,
          run.preparing ? el("div", { class: "muted preparing" }, preparingText(run.preparing)) : null,
        ),
        el("td", {}, phaseLabel(run)),
        el(
          "td",
          { class: "num" },
          `${run.step} / ${run.total_steps}`,
          el("div", { class: "mini-progress" }, progressBar(run.step, run.total_steps)),
        ),
        el("td", { class: "num" }, `${run.restarts} / ${run.max_restarts}`),
        el("td", { class: "num" }, `${run.preemptions} / ${run.max_preemptions}`),
        el("td", { class: "num", title: when(run.created_at) }, ago(run.created_at)),
      ),
    ),
  );
  $("#runs-table").hidden = runs.length === 0;
  $("#runs-empty").hidden = runs.length !== 0 || filtered();
  $("#runs-none-match").hidden = runs.length !== 0 || !filtered();
  $("#runs-count").textContent = count > runs.length ? `${runs.length} newest of ${count}` : `${count}`;
}

function renderWorkers({ workers, count, live }) {
  $("#workers-table tbody").replaceChildren(
    ...workers.map((w) =>
      el(
        "tr",
        { dataset: { pid: w.pid, live: w.live } },
        el("td", { class: "mono" }, `${w.hostname}:${w.pid}`),
        el("td", { class: "mono" }, w.version),
        el("td", {}, w.queue || "–"),
        el("td", {}, el("span", { class: `status status-${w.live ? "live" : "silent"}` }, w.live ? "live" : "silent")),
        el("td", { class: "num", title: when(w.last_seen_at) }, `${ago(w.last_seen_at)} ago`),
        el(
          "td",
          {},
          w.run_id ? el("a", { href: `#/runs/${encodeURIComponent(w.run_id)}` }, w.run_id) : w.busy ? "busy" : "idle",
          assignmentText(w) ? el("div", { class: "muted" }, assignmentText(w)) : null,
        ),
      ),
    ),
  );
  $("#workers-table").hidden = workers.length === 0;
  $("#workers-empty").hidden = workers.length !== 0;
  $("#workers-count").textContent = `${live} live of ${count}`;
}

// What the scheduler placed on the worker (GET /workers `assignment`), or "" when nothing.
function assignmentText(w) {
  const a = w.assignment;
  if (!a) return "";
  const member = a.member ? ` member ${a.member}` : "";
  const what = a.run_id ? `${a.run_id}${member}` : `another owner's run${member}`;
  return `${a.claimed ? "running" : "placed"}: ${what}, priority ${a.priority}`;
}

function progressBar(step, total) {
  const bar = el("div", { class: "progress-bar" });
  bar.style.width = `${total ? Math.min(100, (100 * step) / total) : 0}%`;
  return bar;
}

// --- the run page -----------------------------------------------------------------------------

function emptySeries() {
  return { steps: [], values: [] };
}

// Put points into a series kept sorted by step; a step already there takes the new value.
function mergeSeries(series, steps, values) {
  steps.forEach((step, i) => {
    const n = series.steps.length;
    if (n === 0 || step > series.steps[n - 1]) {
      series.steps.push(step);
      series.values.push(values[i]);
      return;
    }
    let lo = 0;
    let hi = n;
    while (lo < hi) {
      const mid = (lo + hi) >> 1;
      if (series.steps[mid] < step) lo = mid + 1;
      else hi = mid;
    }
    if (series.steps[lo] === step) series.values[lo] = values[i];
    else {
      series.steps.splice(lo, 0, step);
      series.values.splice(lo, 0, values[i]);
    }
  });
}

function truncateSeries(series, step) {
  const keep = series.steps.findIndex((s) => s > step);
  if (keep === -1) return;
  series.steps.length = keep;
  series.values.length = keep;
}

function lastStep(series) {
  return series.steps.length ? series.steps[series.steps.length - 1] : null;
}

function bestOf(history) {
  let best = null;
  for (const point of history) {
    if (point.cross_entropy === null) continue;
    if (best === null || point.cross_entropy < best.cross_entropy) best = point;
  }
  return best;
}

function newestClaim(run) {
  const claimed = run.attempts.filter((a) => a.claimed_at);
  return claimed.length ? claimed[claimed.length - 1].id : null;
}

function phaseBoundaries(run) {
  return run.plan.phases.map((phase) => ({ step: phase.first_step - 1, name: phase.name }));
}

async function openRun(runId) {
  show("run-view");
  const current = {
    kind: "run",
    runId,
    abort: new AbortController(),
    timers: [],
    run: null,
    metrics: Object.fromEntries(METRICS.map((name) => [name, emptySeries()])),
    evals: {},
    checkpointStep: null,
    plots: null,
    live: "connecting",
    events: 0,
    redrawQueued: false,
    sources: [],
    phases: null,
  };
  page = current;
  window.trainctl.page = current;
  setLive("connecting");
  const { signal } = current.abort;
  try {
    const [run, metrics, evals, checkpoints, phases] = await Promise.all([
      getJson(`/runs/${encodeURIComponent(runId)}`, {}, { signal }),
      getJson(`/runs/${encodeURIComponent(runId)}/metrics`, { names: METRICS.join(","), max_points: MAX_POINTS }, { signal }),
      getJson(`/runs/${encodeURIComponent(runId)}/eval`, { max_points: MAX_POINTS }, { signal }),
      getJson(`/runs/${encodeURIComponent(runId)}/checkpoints`, {}, { signal }),
      getJson(`/runs/${encodeURIComponent(runId)}/eval/phases`, {}, { signal }),
    ]);
    if (page !== current) return;
    current.run = run;
    current.phases = phases;
    await loadSourceLoss(current);
    if (page !== current) return;
    for (const name of METRICS) {
      if (metrics[name]) mergeSeries(current.metrics[name], metrics[name].steps, metrics[name].values);
    }
    // Eval sets by name (default: their task); two sets of one task are two entries.
    for (const [name, summary] of Object.entries(evals.tasks)) {
      current.evals[name] = { task: summary.task, baseline: summary.baseline, best: summary.best, history: [...summary.history] };
    }
    current.skippedExamples = skippedExamplesOf(evals);
    const boundaries = () => (current.run ? phaseBoundaries(current.run) : []);
    $("#source-loss-card").hidden = current.sources.length === 0;
    current.plots = {
      loss: lossChart($("#loss-chart"), boundaries),
      lr: lrChart($("#lr-chart"), boundaries),
      sources: current.sources.length ? sourceLossChart($("#source-loss-chart"), current.sources, boundaries) : null,
      evals: {},
      boundaries,
    };
    $("#eval-charts").replaceChildren();
    renderRun(current);
    renderCheckpoints(checkpoints);
    current.checkpointStep = run.latest_checkpoint ? run.latest_checkpoint.step : null;
    redraw(current);
    renderPhaseMatrix(current);
    refreshLedger(current);
  } catch (err) {
    if (page === current) handleError(err);
    return;
  }
  follow(current);
}

function follow(current) {
  let knownClaim = newestClaim(current.run);
  let first = true;
  followRunEvents(current.runId, {
    signal: current.abort.signal,
    cursor: () => cursor(current),
    onState: (state) => {
      if (page !== current) return;
      if (state === "live") first = true;
      setLive(state);
    },
    onError: (err) => page === current && handleError(err),
    on: {
      run: (run) => {
        current.events += 1;
        // An attempt claimed while no stream was open (before the first, or between a drop
        // and the reconnect) may have dropped points this page holds: read everything again.
        const claim = newestClaim(run);
        if (first && claim !== knownClaim) {
          stopPage();
          openRun(current.runId);
          return;
        }
        first = false;
        knownClaim = claim;
        current.run = run;
        renderRun(current);
        const step = run.latest_checkpoint ? run.latest_checkpoint.step : null;
        if (step !== current.checkpointStep) {
          current.checkpointStep = step;
          refreshCheckpoints(current);
        }
        queueLedger(current);
        queueRedraw(current);
      },
      metrics: ({ series }) => {
        current.events += 1;
        for (const [name, column] of Object.entries(series)) {
          if (!current.metrics[name]) current.metrics[name] = emptySeries();
          mergeSeries(current.metrics[name], column.steps, column.values);
        }
        queueRedraw(current);
      },
      evals: ({ points }) => {
        current.events += 1;
        for (const point of points) addEval(current, point);
        queueRedraw(current);
        schedulePhaseMatrix(current);
      },
      rewind: ({ step }) => {
        current.events += 1;
        for (const series of Object.values(current.metrics)) truncateSeries(series, step);
        for (const set of Object.values(current.evals)) {
          set.history = set.history.filter((p) => p.step <= step);
          set.best = bestOf(set.history);
        }
        queueRedraw(current);
        schedulePhaseMatrix(current);
      },
      end: () => {
        current.events += 1;
      },
      error: ({ message }) => {
        current.events += 1;
        showMessage(`Live updates interrupted: ${message}`);
      },
    },
  });
}

// What the page has: the stream sends only what comes after (a repeat is harmless).
function cursor(current) {
  const metricSteps = METRICS.map((name) => lastStep(current.metrics[name])).filter((s) => s !== null);
  const evalSteps = Object.values(current.evals)
    .map((set) => (set.history.length ? set.history[set.history.length - 1].step : null))
    .filter((s) => s !== null);
  return {
    names: [...METRICS, ...current.sources.flatMap((s) => s.metrics)].join(","),
    metrics_after: metricSteps.length ? Math.min(...metricSteps) : -1,
    evals_after: evalSteps.length ? Math.min(...evalSteps) : -1,
  };
}

function addEval(current, point) {
  const { name, task, ...rest } = point;
  const entry = (current.evals[name] ||= { task, baseline: null, best: null, history: [] });
  const at = entry.history.findIndex((p) => p.step >= rest.step);
  if (at === -1) entry.history.push(rest);
  else if (entry.history[at].step === rest.step) entry.history[at] = rest;
  else entry.history.splice(at, 0, rest);
  if (rest.step === 0) entry.baseline = rest;
  if (rest.cross_entropy !== null && (entry.best === null || rest.cross_entropy < entry.best.cross_entropy)) {
    entry.best = rest;
  }
}

async function refreshCheckpoints(current) {
  try {
    const checkpoints = await getJson(
      `/runs/${encodeURIComponent(current.runId)}/checkpoints`,
      {},
      { signal: current.abort.signal },
    );
    if (page === current) renderCheckpoints(checkpoints);
  } catch (err) {
    if (page === current) handleError(err);
  }
}

function setLive(state) {
  const badge = $("#live");
  const labels = {
    connecting: "connecting…",
    live: "live",
    reconnecting: "reconnecting…",
    ended: "finished: no more updates",
    stopped: "not following",
  };
  badge.dataset.state = state;
  badge.textContent = labels[state] || state;
  if (page) page.live = state;
}

// --- run controls: shown only to tokens that may write (user tokens see only their own runs) ---

const ACTIVE = new Set(["queued", "running", "recovering"]);
const RESUMABLE = new Set(["failed", "paused", "cancelled"]);

function renderControls(run) {
  const controls = $("#run-controls");
  controls.hidden = !(me && me.can_write);
  if (controls.hidden) return;
  $("#pause-run").disabled = !ACTIVE.has(run.status) || Boolean(run.pause_requested_at);
  $("#resume-run").disabled = !RESUMABLE.has(run.status);
  $("#cancel-run").disabled = FINISHED.has(run.status);
}

for (const button of document.querySelectorAll("#run-controls button")) {
  button.addEventListener("click", async () => {
    const current = page;
    if (!current || current.kind !== "run" || !current.run) return;
    const action = button.dataset.action;
    if (action === "cancel" && !window.confirm(`Cancel run ${current.run.name}?`)) return;
    button.disabled = true;
    try {
      const run = await postJson(
        `/runs/${encodeURIComponent(current.runId)}/${action}`,
        action === "resume" ? {} : undefined,
      );
      clearMessage();
      if (page !== current) return;
      current.run = run;
      renderRun(current);
      // A resumed run gets a new attempt: follow it from the start again.
      if (action === "resume" && current.live !== "live") {
        stopPage();
        openRun(current.runId);
      }
    } catch (err) {
      if (err instanceof ApiError) showMessage(`${action}: ${err.status} ${err.code}: ${err.message}`);
      else handleError(err);
      if (page === current) renderControls(current.run);
    }
  });
}

function renderRun(current) {
  const { run } = current;
  renderControls(run);
  document.title = `${run.name} · trainctl`;
  $("#run-title").textContent = run.name;
  renderMeta(run);
  const status = $("#run-status");
  status.className = `status status-${run.status}`;
  status.textContent = run.status;
  const message = $("#run-message");
  const text = run.cause || run.message ? [run.cause, run.message].filter(Boolean).join(": ") : "";
  message.textContent = text;
  message.hidden = !text;
  $("#run-waiting").hidden = !run.waiting_for_worker;
  $("#run-waiting-reason").textContent =
    run.waiting_reason || "none was heard from within the lease period";
  const preparing = $("#run-preparing");
  preparing.textContent = run.preparing ? preparingText(run.preparing) : "";
  preparing.hidden = !run.preparing;
  const latest = run.latest_checkpoint ? `step ${run.latest_checkpoint.step}` : "none";
  const facts = [
    ["Run", run.id],
    ["Phase", phaseLabel(run)],
    ["Step", `${run.step} / ${run.total_steps}`],
    ["Restarts", `${run.restarts} / ${run.max_restarts}`],
    ["Preemptions", `${run.preemptions} / ${run.max_preemptions}`],
    ["Recovery", `${run.recovery_seconds.toFixed(1)} s`],
    ["Latest checkpoint", latest],
    ...initialCheckpointFacts(run),
    ["Created", `${when(run.created_at)} (${ago(run.created_at)} ago)`],
    ["Finished", when(run.finished_at)],
    ["Signature", run.signature.slice(0, 16)],
  ];
  $("#run-facts").replaceChildren(
    ...facts.map(([term, value]) => el("div", {}, el("dt", {}, term), el("dd", {}, value))),
  );
  $("#run-progress").style.width = `${run.total_steps ? Math.min(100, (100 * run.step) / run.total_steps) : 0}%`;
  renderAttempts(run.attempts, run.plan.phases);
}

function renderAttempts(attempts, phases) {
  $("#attempts-table tbody").replaceChildren(
    ...[...attempts]
      .sort((a, b) => b.number - a.number)
      .map((a) =>
        el(
          "tr",
          { dataset: { attempt: a.number, status: a.status } },
          el("td", { class: "num" }, a.number),
          el("td", {}, phases[a.phase_index] ? phases[a.phase_index].name : a.phase_index),
          el("td", {}, statusBadge(a.status)),
          el("td", { class: "mono" }, a.worker_hostname ? `${a.worker_hostname}:${a.worker_pid}` : "–"),
          el("td", {}, when(a.claimed_at)),
          el("td", {}, when(a.finished_at)),
          el("td", { title: a.message || "" }, a.cause || "–"),
        ),
      ),
  );
}

function renderCheckpoints({ checkpoints, best = [] }) {
  renderBestCheckpoints(best);
  const phases = page && page.run ? page.run.plan.phases : [];
  $("#checkpoints-table tbody").replaceChildren(
    ...[...checkpoints]
      .sort((a, b) => b.step - a.step)
      .map((c) =>
        el(
          "tr",
          { dataset: { step: c.step } },
          el("td", { class: "num" }, c.step),
          el("td", {}, phases[c.phase_index] ? phases[c.phase_index].name : c.phase_index),
          el("td", { class: "num" }, c.phase_step),
          el("td", {}, when(c.created_at)),
          el("td", { class: "mono path", title: c.path }, c.path),
        ),
      ),
  );
  $("#checkpoints-table").hidden = checkpoints.length === 0;
  $("#checkpoints-empty").hidden = checkpoints.length !== 0;
}

// --- the token ledger and best checkpoints -------------------------------------------------

// The ledger is read again at most this often while the run's events come in.
const LEDGER_REFRESH_MS = 3000;

function initialCheckpointFacts(run) {
  const from = run.initial_checkpoint_from;
  if (from) {
    const best = from.best ? ` (best of ${from.best})` : "";
    return [["Initial checkpoint", `run ${from.run}, step ${from.step}${best}`]];
  }
  return run.initial_checkpoint ? [["Initial checkpoint", run.initial_checkpoint]] : [];
}

function renderBestCheckpoints(best) {
  const list = $("#best-checkpoints");
  list.replaceChildren(
    ...best.map((b) =>
      el(
        "li",
        { dataset: { set: b.name, step: b.step === null ? "" : b.step }, title: b.note || "" },
        el("strong", {}, b.name),
        b.step === null ? ": no checkpoint of a step it was evaluated at" : `: step ${b.step}`,
        b.kept ? el("span", { class: "tag" }, "kept") : "",
        b.note ? el("span", { class: "muted" }, ` best evaluation at step ${b.best_eval_step}, which has no checkpoint`) : "",
      ),
    ),
  );
  $("#best-checkpoints-card").hidden = best.length === 0;
}

async function refreshLedger(current) {
  current.ledgerQueued = false;
  try {
    const ledger = await getJson(`/runs/${encodeURIComponent(current.runId)}/ledger`, {}, { signal: current.abort.signal });
    if (page === current) renderLedger(ledger);
  } catch (err) {
    if (page === current) handleError(err);
  }
}

function queueLedger(current) {
  if (current.ledgerQueued) return;
  current.ledgerQueued = true;
  const timer = setTimeout(() => {
    current.timers = current.timers.filter((t) => t !== timer);
    if (page === current) refreshLedger(current);
  }, LEDGER_REFRESH_MS);
  current.timers.push(timer); // cleared with the page
}

function tokenCount(value) {
  return value === null ? "–" : value.toLocaleString("en-US");
}

function share(value) {
  return value === null ? "–" : `${(100 * value).toFixed(1)}%`;
}

function renderLedger(ledger) {
  const rows = [];
  for (const phase of ledger.phases) {
    const replay = phase.planned_replay_share || phase.replay_share;
    rows.push(
      el(
        "tr",
        { class: "ledger-phase", dataset: { phase: phase.name } },
        el("td", {}, phase.name, phase.role === "replay" ? el("span", { class: "muted" }, " (replay)") : ""),
        el("td", { class: "num" }, tokenCount(phase.planned_tokens)),
        el("td", { class: "num" }, tokenCount(phase.trained_tokens)),
        el("td", { class: "num", title: "share of the phase's tokens that is replay" }, replay ? share(phase.replay_share) : ""),
        el("td", { class: "num" }, replay ? share(phase.planned_replay_share) : ""),
        el("td", { class: "num" }, ""),
        el("td", { class: "num" }, ""),
      ),
    );
    for (const source of phase.sources) {
      rows.push(
        el(
          "tr",
          { class: "ledger-source", dataset: { phase: phase.name, source: source.name } },
          el("td", {}, source.name, source.replay ? el("span", { class: "tag" }, "replay") : ""),
          el("td", { class: "num" }, tokenCount(source.planned_tokens)),
          el("td", { class: "num" }, tokenCount(source.trained_tokens)),
          el("td", { class: "num" }, share(source.trained_share)),
          el("td", { class: "num" }, share(source.planned_share)),
          el("td", { class: "num" }, tokenCount(source.target_tokens)),
          el("td", { class: "num" }, source.epochs === null ? "–" : source.epochs.toFixed(2)),
        ),
      );
    }
  }
  $("#ledger-table tbody").replaceChildren(...rows);
  $("#ledger-summary").textContent =
    ledger.trained_tokens === null
      ? "Replay: not counted for every phase begun (a worker from before the ledger)."
      : `Replay: ${tokenCount(ledger.replay_tokens)} of ${tokenCount(ledger.trained_tokens)} tokens trained, ` +
        `${share(ledger.replay_share)} (plan ${share(ledger.planned_replay_share)}); ` +
        `of post-training tokens ${share(ledger.post_training_replay_share)} (plan ${share(ledger.planned_post_training_replay_share)}).`;
}

function queueRedraw(current) {
  if (current.redrawQueued) return;
  current.redrawQueued = true;
  requestAnimationFrame(() => {
    current.redrawQueued = false;
    if (page === current) redraw(current);
  });
}

function redraw(current) {
  const { plots, metrics } = current;
  setLossData(plots.loss, metrics.loss);
  setLrData(plots.lr, metrics.lr, metrics.lr_muon);
  renderSourceLoss(current);
  renderEvals(current);
}

function change(latest, baseline) {
  if (!latest || !baseline || !baseline.perplexity || latest.perplexity === null) return null;
  return (100 * (latest.perplexity - baseline.perplexity)) / baseline.perplexity;
}

// Latest vs baseline perplexity, as "−12.3%" with a class saying whether that is better.
function changeBadge(tag, percent, extraClass = "") {
  if (percent === null) return el(tag, { class: extraClass }, "–");
  const sign = percent > 0 ? "+" : percent < 0 ? "−" : "±";
  const kind = percent < 0 ? "better" : percent > 0 ? "worse" : "same";
  return el(tag, { class: `${extraClass} change ${kind}`.trim() }, `${sign}${Math.abs(percent).toFixed(1)}%`);
}

function renderEvals(current) {
  const names = Object.keys(current.evals).sort();
  const rows = [];
  for (const name of names) {
    const entry = current.evals[name];
    const latest = entry.history.length ? entry.history[entry.history.length - 1] : null;
    const percent = change(latest, entry.baseline);
    rows.push(
      el(
        "tr",
        { dataset: { set: name, task: entry.task } },
        el("td", {}, name),
        el("td", {}, entry.task),
        el("td", { class: "num" }, entry.baseline ? formatNumber(entry.baseline.perplexity) : "–"),
        el("td", { class: "num" }, latest ? formatNumber(latest.perplexity) : "–"),
        changeBadge("td", percent, "num"),
        el("td", { class: "num" }, entry.best ? `${formatNumber(entry.best.perplexity)} @ ${entry.best.step}` : "–"),
        el("td", { class: "num" }, latest ? latest.step : "–"),
        el("td", { class: "num scored" }, latest ? latest.records.toLocaleString() : "–"),
        skippedCell(latest),
      ),
    );
    let plot = current.plots.evals[name];
    if (!plot) {
      const holder = el("div", { class: "chart", id: `eval-chart-${name}` });
      const caption = el("figcaption", { class: "eval-caption" });
      $("#eval-charts").append(el("figure", { class: "card chart-card", dataset: { set: name } }, caption, holder));
      plot = evalChart(holder, name, current.plots.boundaries);
      current.plots.evals[name] = plot;
    }
    const caption = $(`#eval-charts figure[data-set="${CSS.escape(name)}"] figcaption`);
    caption.replaceChildren(
      el("strong", {}, name),
      " ",
      name === entry.task ? "" : el("span", { class: "muted" }, `(${entry.task})`),
      " ",
      el(
        "span",
        { class: "muted" },
        entry.baseline && latest
          ? `baseline ${formatNumber(entry.baseline.perplexity)} → latest ${formatNumber(latest.perplexity)} at step ${latest.step}`
          : "no baseline yet",
      ),
      " ",
      percent === null ? "" : changeBadge("span", percent),
    );
    setEvalData(plot, entry.history, entry.baseline, current.run ? current.run.step : 0);
  }
  $("#eval-table tbody").replaceChildren(...rows);
  $("#eval-table").hidden = names.length === 0;
  $("#eval-empty").hidden = names.length !== 0;
  renderSkipped(current);
}

// --- what an eval set skipped: counted by reason on every point, the first records per set ------

function skippedExamplesOf(answer) {
  return Object.fromEntries(Object.entries(answer.tasks).map(([name, summary]) => [name, summary.skipped_examples || []]));
}

// Records an evaluation skipped: too long, and the others by reason (none from older services).
function skippedOf(point) {
  const reasons = point.skipped_records || {};
  const count = point.oversized_records + Object.values(reasons).reduce((a, b) => a + b, 0);
  const share = count ? count / (point.records + count) : 0;
  const why = [
    ...(point.oversized_records ? [`${point.oversized_records.toLocaleString()} too long`] : []),
    ...Object.entries(reasons)
      .filter(([, n]) => n > 0)
      .map(([reason, n]) => `${n.toLocaleString()} ${SKIP_REASONS[reason] || reason}`),
  ];
  return { count, share, why: why.join(", "), marked: share > SKIPPED_MARK_SHARE };
}

function skippedCell(latest) {
  if (!latest) return el("td", { class: "num skipped" }, "–");
  const { count, share, why, marked } = skippedOf(latest);
  const title = count ? `${why} (${(100 * share).toFixed(1)}% of the set's records)` : "none skipped";
  return el(
    "td",
    { class: `num skipped${marked ? " skipped-many" : ""}`, title },
    count.toLocaleString(),
    marked ? el("span", { class: "skipped-mark", title: `more than ${100 * SKIPPED_MARK_SHARE}% skipped` }, " !") : null,
  );
}

// Below the eval table, per set that skipped records: how many, why, and the first ones. The
// examples come with GET /eval; a set whose first skips arrive live has them read once.
function renderSkipped(current) {
  const items = [];
  const missing = [];
  current.skippedExamples ||= {};
  current.skippedAsked ||= new Set();
  for (const name of Object.keys(current.evals).sort()) {
    const history = current.evals[name].history;
    const latest = history.length ? history[history.length - 1] : null;
    if (!latest) continue;
    const { count, share, why, marked } = skippedOf(latest);
    if (!count) continue;
    const examples = current.skippedExamples[name];
    if (!(examples && examples.length) && !current.skippedAsked.has(name)) missing.push(name);
    items.push(
      el(
        "li",
        { class: marked ? "skipped-many" : "", dataset: { set: name } },
        el("strong", {}, name),
        ` skipped ${count.toLocaleString()} of ${(latest.records + count).toLocaleString()} records (${(100 * share).toFixed(1)}%): ${why}`,
        marked ? el("span", { class: "skipped-mark" }, " !") : null,
        examples && examples.length ? el("ul", {}, ...examples.map((example) => el("li", {}, el("code", {}, example)))) : null,
      ),
    );
  }
  $("#eval-skipped").replaceChildren(...items);
  $("#eval-skipped").hidden = items.length === 0;
  if (missing.length) readSkippedExamples(current, missing);
}

async function readSkippedExamples(current, names) {
  for (const name of names) current.skippedAsked.add(name);
  try {
    const answer = await getJson(`/runs/${encodeURIComponent(current.runId)}/eval`, { max_points: 1 }, { signal: current.abort.signal });
    if (page !== current) return;
    const read = skippedExamplesOf(answer);
    for (const name of names) current.skippedExamples[name] = read[name] || [];
    queueRedraw(current);
  } catch (err) {
    if (page === current) handleError(err);
  }
}

// --- training loss by data source ------------------------------------------------------------------

// The most series one stream or read may name (service.reads.series.MAX_SERIES_PER_READ).
const MAX_SERIES = 64;

// The run's data sources by name, each with the phases it is trained in: a mixture phase reports
// `loss/<name>` per source (worker.train.loop), a one-source phase only `loss`, which is then
// its source's. [] when a line per source would only repeat the loss chart (every phase has
// one source of its own).
function sourceLines(plan) {
  const byName = new Map();
  for (const phase of plan.phases) {
    for (const source of phase.sources || []) {
      if (!byName.has(source.name)) byName.set(source.name, { name: source.name, mixed: [], alone: [] });
      const line = byName.get(source.name);
      (phase.sources.length > 1 ? line.mixed : line.alone).push(phase);
    }
  }
  const lines = [...byName.values()];
  const informative = lines.some((line) => line.mixed.length > 0 || line.alone.length > 1);
  if (!informative) return [];
  return lines.slice(0, MAX_SERIES - METRICS.length).map((line, i) => ({
    ...line,
    color: runColor(i),
    metrics: line.mixed.length ? [`loss/${line.name}`] : [],
  }));
}

async function loadSourceLoss(current) {
  current.sources = sourceLines(current.run.plan);
  const names = current.sources.flatMap((s) => s.metrics);
  for (const name of names) current.metrics[name] = emptySeries();
  if (!names.length) return;
  const read = await getJson(
    `/runs/${encodeURIComponent(current.runId)}/metrics`,
    { names: names.join(","), max_points: MAX_POINTS },
    { signal: current.abort.signal },
  );
  for (const name of names) {
    if (read[name]) mergeSeries(current.metrics[name], read[name].steps, read[name].values);
  }
}

// One source's points: its `loss/<name>` in mixture phases and the loss of the phases it alone
// is trained in.
function sourceSeries(current, line) {
  const points = [];
  const mixed = current.metrics[`loss/${line.name}`] || emptySeries();
  mixed.steps.forEach((step, i) => points.push([step, mixed.values[i]]));
  const loss = current.metrics.loss;
  for (const phase of line.alone) {
    loss.steps.forEach((step, i) => {
      if (step >= phase.first_step && step <= phase.last_step) points.push([step, loss.values[i]]);
    });
  }
  points.sort((a, b) => a[0] - b[0]);
  return { steps: points.map((p) => p[0]), values: points.map((p) => p[1]) };
}

function renderSourceLoss(current) {
  if (!current.plots.sources) return;
  setSourceLossData(current.plots.sources, current.sources.map((line) => sourceSeries(current, line)));
}

// --- forgetting, phase by phase (GET /runs/{id}/eval/phases) ---------------------------------------

// Read the matrix again shortly after new evaluations arrive (once for a burst of them).
function schedulePhaseMatrix(current) {
  if (current.phasesTimer) return;
  current.phasesTimer = setTimeout(async () => {
    current.phasesTimer = null;
    try {
      const phases = await getJson(
        `/runs/${encodeURIComponent(current.runId)}/eval/phases`,
        {},
        { signal: current.abort.signal },
      );
      if (page !== current) return;
      current.phases = phases;
      renderPhaseMatrix(current);
    } catch (err) {
      if (page === current) handleError(err);
    }
  }, 500);
  current.timers.push(current.phasesTimer);
}

// Green when the perplexity fell over the phase, red when it rose, stronger the larger the
// change (full at a factor of 4 either way).
function changeColor(change) {
  const ratio = Math.abs(Math.log(1 + change / 100));
  const alpha = 0.08 + 0.5 * Math.min(1, ratio / Math.log(4));
  return change < 0 ? `rgba(15, 123, 95, ${alpha.toFixed(3)})` : `rgba(180, 35, 24, ${alpha.toFixed(3)})`;
}

function phaseCell(cell, set) {
  if (!cell.end || cell.end.perplexity === null) {
    return el("td", { class: "num muted", dataset: { set: set.name } }, "–");
  }
  const start = cell.start ? `${formatNumber(cell.start.perplexity)} at step ${cell.start.step}` : "none";
  const title =
    `${set.name}: ${formatNumber(cell.end.perplexity)} at step ${cell.end.step}, from ${start}` +
    (cell.complete ? "" : " (the phase has not evaluated its last step yet)");
  const td = el(
    "td",
    { class: "num phase-cell", title, dataset: { set: set.name, complete: String(cell.complete) } },
    el("span", { class: "value" }, formatNumber(cell.end.perplexity)),
    cell.complete ? null : el("span", { class: "so-far" }, "*"),
  );
  if (cell.change !== null) {
    const sign = cell.change > 0 ? "+" : cell.change < 0 ? "−" : "±";
    const size = Math.abs(cell.change);
    td.append(el("span", { class: "delta" }, `${sign}${size < 10 ? size.toFixed(1) : size.toFixed(0)}%`));
    td.dataset.change = cell.change > 0 ? "worse" : cell.change < 0 ? "better" : "same";
    if (cell.change !== 0) td.style.backgroundColor = changeColor(cell.change);
  }
  return td;
}

function renderPhaseMatrix(current) {
  const answer = current.phases;
  const card = $("#phase-card");
  card.hidden = !answer || answer.sets.length === 0;
  if (card.hidden) return;
  const { sets, phases } = answer;
  $("#phase-matrix thead").replaceChildren(
    el(
      "tr",
      {},
      el("th", {}, "Phase"),
      el("th", { class: "num" }, "Steps"),
      ...sets.map((set) => el("th", { class: "num", title: set.task }, set.name)),
    ),
  );
  const baseline = el(
    "tr",
    { class: "baseline-row", dataset: { phase: "" } },
    el("td", {}, "Baseline"),
    el("td", { class: "num" }, "0"),
    ...sets.map((set) =>
      el("td", { class: "num", dataset: { set: set.name } }, set.baseline ? formatNumber(set.baseline.perplexity) : "–"),
    ),
  );
  $("#phase-matrix tbody").replaceChildren(
    baseline,
    ...phases.map((phase) =>
      el(
        "tr",
        { dataset: { phase: phase.name } },
        el("td", {}, phase.name, phase.role === "replay" ? el("span", { class: "tag replay-tag" }, "replay") : null),
        el("td", { class: "num muted" }, `${phase.first_step}–${phase.last_step}`),
        ...phase.sets.map((cell, i) => phaseCell(cell, sets[i])),
      ),
    ),
  );
}

// --- a run's name, tags and note: shown on its page, editable by tokens that write ---------------

function renderMeta(run) {
  const tags = run.tags || [];
  $("#run-tags").replaceChildren(...(tags.length ? [tagChips(tags)] : [el("span", { class: "muted" }, "no tags")]));
  const note = $("#run-note");
  note.textContent = run.note || "";
  note.hidden = !run.note;
  $("#edit-run").hidden = !(me && me.can_write) || !$("#run-edit").hidden;
}

function parseTags(text) {
  return [...new Set(text.split(/[\s,]+/).filter(Boolean))];
}

$("#edit-run").addEventListener("click", () => {
  const current = page;
  if (!current || current.kind !== "run" || !current.run) return;
  $("#edit-name").value = current.run.name;
  $("#edit-tags").value = (current.run.tags || []).join(", ");
  $("#edit-note").value = current.run.note || "";
  $("#run-edit").hidden = false;
  $("#edit-run").hidden = true;
  $("#edit-name").focus();
});

function closeEdit() {
  $("#run-edit").hidden = true;
  $("#edit-run").hidden = !(me && me.can_write);
}

$("#edit-cancel").addEventListener("click", closeEdit);

$("#run-edit").addEventListener("submit", async (event) => {
  event.preventDefault();
  const current = page;
  if (!current || current.kind !== "run" || !current.run) return;
  const body = {
    name: $("#edit-name").value.trim(),
    tags: parseTags($("#edit-tags").value),
    note: $("#edit-note").value.trim(),
  };
  const save = $("#run-edit button[type=submit]");
  save.disabled = true;
  try {
    const run = await patchJson(`/runs/${encodeURIComponent(current.runId)}`, body);
    clearMessage();
    if (page !== current) return;
    current.run = run;
    closeEdit();
    renderRun(current);
  } catch (err) {
    if (err instanceof ApiError) showMessage(`Saving the run: ${err.status} ${err.code}: ${err.message}`);
    else handleError(err);
  } finally {
    save.disabled = false;
  }
});

// --- comparing runs -------------------------------------------------------------------------------

async function openCompare(ids) {
  show("compare-view");
  const current = {
    kind: "compare",
    ids,
    abort: new AbortController(),
    timers: [],
    comparison: null,
    series: {},
    evalHistory: {},
    plots: null,
    refreshes: 0,
    live: "connecting",
  };
  page = current;
  window.trainctl.page = current;
  setCompareLive("connecting");
  $("#compare-runs").replaceChildren();
  $("#compare-eval-charts").replaceChildren();
  if (ids.length < 2) {
    showMessage("Select two or more runs in the runs table to compare them.");
    return;
  }
  const ok = await loadCompare(current, ids);
  if (!ok || page !== current) return;
  const runs = current.comparison.runs.map((run, i) => ({ name: run.name, color: runColor(i) }));
  const boundaries = () =>
    current.comparison
      ? current.comparison.runs.flatMap((run, i) =>
          run.phases.slice(1).map((phase) => ({ step: phase.first_step - 1, name: phase.name, color: runColor(i) })),
        )
      : [];
  current.plots = {
    loss: compareChart($("#compare-loss-chart"), { runs, yLabel: "loss", getBoundaries: boundaries }),
    lr: compareChart($("#compare-lr-chart"), { runs, yLabel: "AdamW lr", getBoundaries: boundaries }),
    evals: {},
    boundaries,
  };
  renderCompare(current);
  if (current.comparison.runs.some((run) => !FINISHED.has(run.status))) {
    setCompareLive("live");
    current.timers.push(setInterval(() => refreshCompare(current), COMPARE_REFRESH_MS));
  } else {
    setCompareLive("ended");
  }
}

// Read the comparison, then the curves of `ids` (all runs at first, then those unfinished at
// the previous read). The comparison is read first: a run it says finished had reported every
// point before, so the curves read after it are its last.
async function loadCompare(current, ids) {
  const { signal } = current.abort;
  const path = (id, what) => `/runs/${encodeURIComponent(id)}/${what}`;
  try {
    const comparison = await getJson("/runs/compare", { ids: current.ids.join(",") }, { signal });
    const curves = await Promise.all(
      ids.flatMap((id) => [
        getJson(path(id, "metrics"), { names: COMPARE_METRICS.join(","), max_points: COMPARE_POINTS }, { signal }),
        getJson(path(id, "eval"), { max_points: COMPARE_POINTS }, { signal }),
      ]),
    );
    if (page !== current) return false;
    current.comparison = comparison;
    ids.forEach((id, i) => {
      const metrics = curves[2 * i];
      const evals = curves[2 * i + 1];
      current.series[id] = Object.fromEntries(
        COMPARE_METRICS.map((name) => [name, metrics[name] || { steps: [], values: [] }]),
      );
      current.evalHistory[id] = Object.fromEntries(
        Object.entries(evals.tasks).map(([name, summary]) => [name, summary.history]),
      );
    });
    return true;
  } catch (err) {
    if (page === current) {
      handleError(err);
      setCompareLive("stopped");
    }
    return false;
  }
}

async function refreshCompare(current) {
  if (page !== current || current.refreshing) return;
  current.refreshing = true;
  try {
    const unfinished = current.comparison.runs.filter((run) => !FINISHED.has(run.status)).map((run) => run.id);
    if (!(await loadCompare(current, unfinished)) || page !== current) return;
    current.refreshes += 1;
    renderCompare(current);
    if (current.comparison.runs.every((run) => FINISHED.has(run.status))) {
      for (const timer of current.timers) clearInterval(timer);
      current.timers = [];
      setCompareLive("ended");
    }
  } finally {
    current.refreshing = false;
  }
}

function setCompareLive(state) {
  const badge = $("#compare-live");
  const labels = {
    connecting: "loading…",
    live: `updating every ${COMPARE_REFRESH_MS / 1000} s`,
    ended: "every run finished: no more updates",
    stopped: "not updating",
  };
  badge.dataset.state = state;
  badge.textContent = labels[state] || state;
  if (page) page.live = state;
}

function swatch(i) {
  const mark = el("span", { class: "swatch" });
  mark.style.background = runColor(i);
  return mark;
}

function renderCompare(current) {
  const { comparison, plots } = current;
  const { runs } = comparison;
  document.title = `Compare ${runs.length} runs · trainctl`;
  $("#compare-title").textContent = `Compare ${runs.length} runs`;
  $("#compare-runs").replaceChildren(
    ...runs.map((run, i) =>
      el(
        "li",
        { dataset: { runId: run.id } },
        swatch(i),
        el("a", { href: `#/runs/${encodeURIComponent(run.id)}` }, run.name),
        " ",
        el("span", { class: "muted mono" }, run.id),
        " ",
        statusBadge(run.status),
        " ",
        el("span", { class: "muted" }, `step ${run.step} / ${run.total_steps}`),
        i === 0 ? el("span", { class: "reference" }, "reference") : null,
        run.tags.length ? tagChips(run.tags) : null,
        run.note ? el("div", { class: "note muted" }, run.note) : null,
      ),
    ),
  );
  renderInputs(comparison);
  setCompareData(plots.loss, runs.map((run) => current.series[run.id].loss));
  setCompareData(plots.lr, runs.map((run) => current.series[run.id].lr));
  renderCompareEvals(current);
}

function shown(value) {
  if (value === null || value === undefined) return "(none)";
  return typeof value === "string" ? value : JSON.stringify(value);
}

// A group of more fields than this is folded (a <details> closed until clicked).
const FOLD_AFTER = 5;

function renderInputs(comparison) {
  const { inputs, runs } = comparison;
  const identical = $("#compare-identical");
  const container = $("#compare-inputs");
  const summary = $("#compare-summary");
  identical.hidden = !inputs.identical;
  identical.textContent = inputs.identical ? `Identical inputs: ${inputs.summary.replace(/^identical inputs: /, "")}.` : "";
  container.hidden = inputs.identical;
  summary.hidden = inputs.identical;
  summary.textContent = inputs.identical ? "" : inputs.summary;
  if (inputs.identical) {
    container.replaceChildren();
    return;
  }
  // An answer from a service without groups: one group of every difference.
  const groups = inputs.groups && inputs.groups.length
    ? inputs.groups
    : [{ name: "other", title: "inputs", count: inputs.differences.length, summary: `${inputs.differences.length} fields` }];
  // Keep what the user opened or closed across refreshes.
  const wasOpen = Object.fromEntries([...container.querySelectorAll("details")].map((d) => [d.dataset.group, d.open]));
  container.replaceChildren(
    ...groups.map((group) => {
      const members = inputs.differences.filter((d) => (d.group || "other") === group.name);
      const details = el(
        "details",
        { class: "input-group", dataset: { group: group.name, count: members.length } },
        el("summary", {}, el("strong", {}, group.title), " ", el("span", { class: "muted" }, group.summary)),
        inputsTable(members, runs),
      );
      details.open = group.name in wasOpen ? wasOpen[group.name] : members.length <= FOLD_AFTER;
      return details;
    }),
  );
}

function inputsTable(differences, runs) {
  return el(
    "table",
    { class: "table compact" },
    el("thead", {}, el("tr", {}, el("th", {}, "Field"), ...runs.map((run, i) => el("th", {}, swatch(i), run.name)))),
    el(
      "tbody",
      {},
      ...differences.map((d) =>
        el(
          "tr",
          { dataset: { field: d.field } },
          el("td", { class: "mono" }, d.field),
          ...d.values.map((value, i) => {
            const change = (d.changes || [])[i];
            const data = change ? { run: runs[i].id, change } : { run: runs[i].id };
            return el(
              "td",
              { class: `mono value${change ? " differs" : ""}`, dataset: data },
              el("span", { class: "shown" }, shown(value)),
              change ? el("span", { class: `change-tag change-${change}` }, change) : null,
            );
          }),
        ),
      ),
    ),
  );
}

function perplexityAt(point) {
  return point && point.perplexity !== null ? `${formatNumber(point.perplexity)} @ ${point.step}` : "–";
}

function renderCompareEvals(current) {
  const { comparison, plots } = current;
  const { runs, evals } = comparison;
  const table = $("#compare-evals");
  table.querySelector("thead").replaceChildren(
    el(
      "tr",
      {},
      el("th", { rowspan: 2 }, "Eval set"),
      el("th", { rowspan: 2 }, "Task"),
      ...runs.map((run, i) => el("th", { colspan: 4, class: "run-head" }, swatch(i), run.name)),
    ),
    el(
      "tr",
      {},
      ...runs.flatMap((run, i) => [
        el("th", { class: "num" }, "Baseline"),
        el("th", { class: "num" }, "Final"),
        el("th", { class: "num" }, "Best"),
        el("th", { class: "num" }, i === 0 ? "vs baseline" : "vs first"),
      ]),
    ),
  );
  table.querySelector("tbody").replaceChildren(
    ...evals.map((set) =>
      el(
        "tr",
        { dataset: { set: set.name, task: set.task } },
        el("td", {}, set.name),
        el("td", {}, set.task),
        ...set.runs.flatMap((row, i) => [
          el("td", { class: "num", dataset: { run: row.run_id, field: "baseline" } }, perplexityAt(row.baseline)),
          el("td", { class: "num", dataset: { run: row.run_id, field: "final" } }, perplexityAt(row.final)),
          el("td", { class: "num", dataset: { run: row.run_id, field: "best" } }, perplexityAt(row.best)),
          withData(changeBadge("td", i === 0 ? row.final_vs_baseline : row.final_vs_first, "num"), { run: row.run_id, field: "change" }),
        ]),
      ),
    ),
  );
  table.hidden = evals.length === 0;
  $("#compare-evals-empty").hidden = evals.length !== 0;
  for (const set of evals) {
    let plot = plots.evals[set.name];
    if (!plot) {
      const holder = el("div", { class: "chart", id: `compare-eval-chart-${set.name}` });
      const caption = el(
        "figcaption",
        { class: "eval-caption" },
        el("strong", {}, set.name),
        " ",
        set.name === set.task ? "" : el("span", { class: "muted" }, `(${set.task})`),
        " ",
        el("span", { class: "muted" }, "perplexity by step, one line per run"),
      );
      $("#compare-eval-charts").append(el("figure", { class: "card chart-card", dataset: { set: set.name } }, caption, holder));
      plot = compareChart(holder, {
        runs: runs.map((run, i) => ({ name: run.name, color: runColor(i) })),
        yLabel: "perplexity (log)",
        getBoundaries: plots.boundaries,
        points: true,
        title: set.name,
        log: true,
      });
      plots.evals[set.name] = plot;
    }
    setCompareData(
      plot,
      runs.map((run) => {
        const history = (current.evalHistory[run.id] || {})[set.name] || [];
        return { steps: history.map((p) => p.step), values: history.map((p) => p.perplexity) };
      }),
    );
  }
}

function withData(node, data) {
  Object.assign(node.dataset, data);
  return node;
}

route();
