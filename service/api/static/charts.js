// Charts, drawn by uPlot (service/api/static/vendor/uplot, loaded as the global `uPlot`).

const COLORS = {
  loss: "#1f4b99",
  lr: "#b35c00",
  lrMuon: "#7a3d9c",
  eval: "#0f7b5f",
  baseline: "#8a8f98",
  boundary: "rgba(60, 64, 72, 0.55)",
};

const HEIGHT = 240;

function widthOf(element) {
  return Math.max(240, Math.floor(element.clientWidth || element.parentElement.clientWidth || 480));
}

export function formatNumber(value, digits = 4) {
  if (value === null || value === undefined || !Number.isFinite(value)) return "–";
  const size = Math.abs(value);
  if (size !== 0 && (size < 1e-3 || size >= 1e6)) return value.toExponential(2);
  return Number(value.toPrecision(digits)).toString();
}

// `text`, cut short with an ellipsis to fit `room` canvas pixels ("" when nothing fits).
function fitText(ctx, text, room) {
  if (ctx.measureText(text).width <= room) return text;
  for (let n = text.length - 1; n > 0; n--) {
    const cut = text.slice(0, n) + "…";
    if (ctx.measureText(cut).width <= room) return cut;
  }
  return "";
}

// Vertical dashed lines where a phase ends and the next begins, each labelled with the name of
// the phase it starts (`boundaries`: [{step, name}], the first phase at step 0 included).
function phaseBoundaries(getBoundaries) {
  return {
    hooks: {
      draw: [
        (u) => {
          const boundaries = getBoundaries();
          if (!boundaries.length) return;
          const { ctx } = u;
          const { left, top, width, height } = u.bbox;
          const ratio = uPlot.pxRatio;
          ctx.save();
          ctx.beginPath();
          ctx.rect(left, top, width, height);
          ctx.clip();
          ctx.strokeStyle = COLORS.boundary;
          ctx.fillStyle = COLORS.boundary;
          ctx.lineWidth = ratio;
          ctx.setLineDash([5 * ratio, 4 * ratio]);
          ctx.font = `${11 * ratio}px system-ui, sans-serif`;
          ctx.textBaseline = "top";
          ctx.textAlign = "left"; // uPlot leaves its axes' alignment set
          boundaries.forEach(({ step, name }, i) => {
            const x = Math.round(u.valToPos(step, "x", true));
            const next = boundaries[i + 1];
            const end = next ? u.valToPos(next.step, "x", true) : Infinity;
            // A phase wholly outside the drawn steps gets neither a line nor a label.
            if (x > left + width || end <= left) return;
            if (x > left) {
              ctx.beginPath();
              ctx.moveTo(x, top);
              ctx.lineTo(x, top + height);
              ctx.stroke();
            }
            const start = Math.max(x, left) + 4 * ratio;
            const label = fitText(ctx, name, Math.min(end, left + width) - start - 4 * ratio);
            if (label) ctx.fillText(label, start, top + 4 * ratio);
          });
          ctx.restore();
        },
      ],
    },
  };
}

function xAxis() {
  return { label: "step", labelSize: 18, size: 36 };
}

// Perplexity spans orders of magnitude (an untrained model's ~500, a trained one's 2-10): on a
// linear axis the trained values are one flat line at the bottom. A log axis shows both.
const LOG_SCALE = { distr: 3, log: 10 };

function logAxis(label) {
  return {
    label,
    labelSize: 18,
    size: 56,
    // uPlot hides the labels of crowded log ticks by handing them over as null.
    values: (u, ticks) => ticks.map((t) => (t === null || t === undefined ? "" : formatNumber(t, 3))),
  };
}

function makePlot(element, options, data) {
  const plot = new uPlot({ width: widthOf(element), height: HEIGHT, ...options }, data, element);
  const observer = new ResizeObserver(() => {
    const width = widthOf(element);
    if (width !== plot.width) plot.setSize({ width, height: HEIGHT });
  });
  observer.observe(element);
  plot.trainctlObserver = observer;
  return plot;
}

export function destroyPlot(plot) {
  if (!plot) return;
  plot.trainctlObserver?.disconnect();
  plot.destroy();
}

// The x values of a chart: the union of the steps of `series` (sorted), and each series'
// values aligned to it (null where a series has no point at that step).
function align(series) {
  const steps = [...new Set(series.flatMap((s) => s.steps))].sort((a, b) => a - b);
  const index = new Map(steps.map((step, i) => [step, i]));
  const columns = series.map((s) => {
    const column = new Array(steps.length).fill(null);
    s.steps.forEach((step, i) => (column[index.get(step)] = s.values[i]));
    return column;
  });
  return [steps, ...columns];
}

export function lossChart(element, getBoundaries) {
  return makePlot(
    element,
    {
      plugins: [phaseBoundaries(getBoundaries)],
      scales: { x: { time: false } },
      axes: [xAxis(), { label: "loss", labelSize: 18, size: 56 }],
      series: [
        { label: "step" },
        { label: "loss", stroke: COLORS.loss, width: 1.5, value: (u, v) => formatNumber(v) },
      ],
    },
    [[], []],
  );
}

export function setLossData(plot, loss) {
  plot.setData([loss.steps, loss.values]);
}

export function lrChart(element, getBoundaries) {
  return makePlot(
    element,
    {
      plugins: [phaseBoundaries(getBoundaries)],
      scales: { x: { time: false } },
      axes: [
        xAxis(),
        { label: "AdamW lr", labelSize: 18, size: 64, values: (u, ticks) => ticks.map((t) => formatNumber(t, 2)) },
        {
          side: 1,
          scale: "muon",
          label: "Muon lr",
          labelSize: 18,
          size: 64,
          grid: { show: false },
          values: (u, ticks) => ticks.map((t) => formatNumber(t, 2)),
        },
      ],
      series: [
        { label: "step" },
        { label: "lr (AdamW)", stroke: COLORS.lr, width: 1.5, value: (u, v) => formatNumber(v) },
        { label: "lr (Muon)", scale: "muon", stroke: COLORS.lrMuon, width: 1.5, value: (u, v) => formatNumber(v) },
      ],
    },
    [[], [], []],
  );
}

export function setLrData(plot, lr, lrMuon) {
  plot.setData(align([lr, lrMuon]));
}

// One task's perplexity over steps, with the baseline (the evaluation before the first update)
// as a dashed horizontal reference line.
export function evalChart(element, task, getBoundaries) {
  return makePlot(
    element,
    {
      title: task,
      plugins: [phaseBoundaries(getBoundaries)],
      scales: { x: { time: false }, y: LOG_SCALE },
      axes: [xAxis(), logAxis("perplexity (log)")],
      series: [
        { label: "step" },
        { label: "perplexity", stroke: COLORS.eval, width: 1.5, points: { show: true, size: 5 }, value: (u, v) => formatNumber(v) },
        { label: "baseline", stroke: COLORS.baseline, width: 1.5, dash: [6, 4], points: { show: false }, value: (u, v) => formatNumber(v) },
      ],
    },
    [[], [], []],
  );
}

// `until`: the run's current step; the baseline line reaches it even before the next evaluation.
export function setEvalData(plot, history, baseline, until) {
  const steps = history.map((p) => p.step);
  const perplexity = history.map((p) => p.perplexity);
  if (steps.length && until > steps[steps.length - 1]) {
    steps.push(until);
    perplexity.push(null);
  }
  const reference = baseline && Number.isFinite(baseline.perplexity) ? baseline.perplexity : null;
  plot.setData([steps, perplexity, steps.map(() => reference)]);
}

// --- training loss by data source --------------------------------------------------------------

// `sources`: [{name, color}], a line each: the source's loss (`loss/<name>` in a mixture, the
// phase's loss where it is the phase's only source), with the phase boundaries. Replay text
// against supervised data, step by step.
export function sourceLossChart(element, sources, getBoundaries) {
  return makePlot(
    element,
    {
      plugins: [phaseBoundaries(getBoundaries)],
      scales: { x: { time: false } },
      axes: [xAxis(), { label: "loss", labelSize: 18, size: 56 }],
      series: [
        { label: "step" },
        ...sources.map((source) => ({
          label: source.name,
          stroke: source.color,
          width: 1.5,
          value: (u, v) => formatNumber(v),
        })),
      ],
    },
    [[], ...sources.map(() => [])],
  );
}

// `series`: [{steps, values}] per source, in the chart's order.
export function setSourceLossData(plot, series) {
  plot.setData(align(series));
}

// --- comparison charts: one line per run ------------------------------------------------------

// A run's colour in a comparison, by its position (the first run is the reference).
export const RUN_COLORS = ["#1f4b99", "#c2410c", "#0f7b5f", "#7a3d9c", "#b42318", "#0e7490", "#a16207", "#4b5563"];

export function runColor(index) {
  return RUN_COLORS[index % RUN_COLORS.length];
}

function withAlpha(hex, alpha) {
  const n = parseInt(hex.slice(1), 16);
  return `rgba(${(n >> 16) & 255}, ${(n >> 8) & 255}, ${n & 255}, ${alpha})`;
}

// Each run's phase boundaries as dashed lines in the run's colour (`getBoundaries`:
// [{step, name, color}]); a step several runs share is labelled once, with its phase's name.
function runBoundaries(getBoundaries) {
  return {
    hooks: {
      draw: [
        (u) => {
          const boundaries = getBoundaries();
          if (!boundaries.length) return;
          const { ctx } = u;
          const { left, top, width, height } = u.bbox;
          const ratio = uPlot.pxRatio;
          const labelled = new Set();
          ctx.save();
          ctx.beginPath();
          ctx.rect(left, top, width, height);
          ctx.clip();
          ctx.lineWidth = ratio;
          ctx.setLineDash([5 * ratio, 4 * ratio]);
          ctx.font = `${11 * ratio}px system-ui, sans-serif`;
          ctx.textBaseline = "top";
          ctx.textAlign = "left";
          boundaries.forEach(({ step, name, color }, i) => {
            const x = Math.round(u.valToPos(step, "x", true));
            if (x < left || x > left + width) return;
            ctx.strokeStyle = withAlpha(color, 0.6);
            if (x > left) {
              ctx.beginPath();
              ctx.moveTo(x, top);
              ctx.lineTo(x, top + height);
              ctx.stroke();
            }
            if (labelled.has(step)) return;
            labelled.add(step);
            ctx.fillStyle = COLORS.boundary;
            const label = fitText(ctx, name, 120 * ratio);
            if (label) ctx.fillText(label, Math.max(x, left) + 4 * ratio, top + 4 * ratio + (i % 2) * 13 * ratio);
          });
          ctx.restore();
        },
      ],
    },
  };
}

// `runs`: [{name, color}], one line each, in order. `points`: dots at each value (evaluations).
// `log`: a log y axis (perplexity).
export function compareChart(element, { runs, yLabel, getBoundaries, points = false, title, log = false }) {
  return makePlot(
    element,
    {
      title,
      plugins: [runBoundaries(getBoundaries)],
      scales: log ? { x: { time: false }, y: LOG_SCALE } : { x: { time: false } },
      axes: [
        xAxis(),
        log
          ? { ...logAxis(yLabel), size: 64 }
          : { label: yLabel, labelSize: 18, size: 64, values: (u, ticks) => ticks.map((t) => formatNumber(t, 3)) },
      ],
      series: [
        { label: "step" },
        ...runs.map((run) => ({
          label: run.name,
          stroke: run.color,
          width: 1.5,
          spanGaps: true,
          points: { show: points, size: 5 },
          value: (u, v) => formatNumber(v),
        })),
      ],
    },
    [[], ...runs.map(() => [])],
  );
}

// `series`: [{steps, values}] per run, in the chart's order; aligned on the union of steps.
export function setCompareData(plot, series) {
  plot.setData(align(series));
}
