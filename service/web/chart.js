// A small time-series line chart on a <canvas>: a fixed window of samples, gaps where a value is null.

const MARGIN = { left: 42, right: 8, top: 18, bottom: 16 };
const GRID = "#2a333c";
const TEXT = "#8a96a3";

export class LineChart {
  // series: [{name, color}]; yMax: a fixed top (e.g. 1 for ratios) or null to follow the data.
  constructor(canvas, { series, yMax = null, digits = 2, windowSeconds = 120 }) {
    this.canvas = canvas;
    this.series = series;
    this.yMax = yMax;
    this.digits = digits;
    this.windowSeconds = windowSeconds;
    this.samples = [];  // [{t, values: [number | null]}]
    this.withData = 0;  // samples holding at least one value
  }

  push(t, values) {
    this.samples.push({ t, values });
    if (values.some((v) => v !== null)) this.withData += 1;
    const oldest = t - this.windowSeconds;
    while (this.samples.length && this.samples[0].t < oldest) this.samples.shift();
    this.draw();
  }

  draw() {
    const dpr = window.devicePixelRatio || 1;
    const width = this.canvas.clientWidth || 800;
    const height = this.canvas.clientHeight || 160;
    if (this.canvas.width !== Math.round(width * dpr)) this.canvas.width = Math.round(width * dpr);
    if (this.canvas.height !== Math.round(height * dpr)) this.canvas.height = Math.round(height * dpr);
    const ctx = this.canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, width, height);
    const frame = this.frame(width, height);
    this.drawGrid(ctx, frame);
    this.series.forEach((s, i) => this.drawSeries(ctx, frame, i, s.color));
    this.drawLegend(ctx, width);
    Object.assign(this.canvas.dataset, { points: this.samples.length, samples: this.withData });
  }

  frame(width, height) {
    const last = this.samples.length ? this.samples[this.samples.length - 1].t : 0;
    const values = this.samples.flatMap((s) => s.values.filter((v) => v !== null));
    const top = this.yMax ?? niceCeil(Math.max(0, ...values));
    return {
      x: (t) => MARGIN.left + (1 - (last - t) / this.windowSeconds) * (width - MARGIN.left - MARGIN.right),
      y: (v) => height - MARGIN.bottom - (v / top) * (height - MARGIN.top - MARGIN.bottom),
      top, width, height,
    };
  }

  drawGrid(ctx, { y, top, width, height }) {
    ctx.strokeStyle = GRID;
    ctx.fillStyle = TEXT;
    ctx.lineWidth = 1;
    ctx.font = "10px system-ui, sans-serif";
    ctx.textAlign = "right";
    ctx.textBaseline = "middle";
    for (const v of [0, top / 2, top]) {
      ctx.beginPath();
      ctx.moveTo(MARGIN.left, y(v));
      ctx.lineTo(width - MARGIN.right, y(v));
      ctx.stroke();
      ctx.fillText(formatTick(v), MARGIN.left - 4, y(v));
    }
    ctx.textAlign = "left";
    ctx.fillText(`last ${this.windowSeconds} s`, MARGIN.left, height - 6);
  }

  drawSeries(ctx, frame, index, color) {
    ctx.strokeStyle = color;
    ctx.fillStyle = color;
    ctx.lineWidth = 1.5;
    let previous = null;
    for (const sample of this.samples) {
      const v = sample.values[index];
      if (v === null || v === undefined) { previous = null; continue; }
      const point = [frame.x(sample.t), frame.y(Math.min(v, frame.top))];
      if (previous) {
        ctx.beginPath();
        ctx.moveTo(...previous);
        ctx.lineTo(...point);
        ctx.stroke();
      } else {
        ctx.fillRect(point[0] - 1.5, point[1] - 1.5, 3, 3);  // a lone sample stays visible
      }
      previous = point;
    }
  }

  drawLegend(ctx, width) {
    const latest = this.samples.length ? this.samples[this.samples.length - 1].values : [];
    ctx.font = "11px system-ui, sans-serif";
    ctx.textAlign = "right";
    ctx.textBaseline = "middle";
    let x = width - MARGIN.right;
    for (let i = this.series.length - 1; i >= 0; i--) {
      const v = latest[i];
      const text = `${this.series[i].name} ${v === null || v === undefined ? "-" : v.toFixed(this.digits)}`;
      ctx.fillStyle = this.series[i].color;
      ctx.fillText(text, x, 8);
      x -= ctx.measureText(text).width + 14;
    }
  }
}

// 1, 2 or 5 times a power of ten, at least `v` (a readable top for the y axis).
function niceCeil(v) {
  if (v <= 0) return 1;
  const base = 10 ** Math.floor(Math.log10(v));
  for (const m of [1, 2, 5, 10]) if (m * base >= v) return m * base;
  return 10 * base;
}

function formatTick(v) {
  return Math.abs(v) >= 100 || Number.isInteger(v) ? String(Math.round(v)) : v.toFixed(2);
}
