// Layers x experts heatmap of recent expert use on one <canvas>: one pixel per expert scaled up, so a
// 48 x 128 model draws in a few milliseconds, with markers on the cached and resident experts.

const WHERE = { dense: -1, host: 0, cached: 1, resident: 2 };
const WHERE_TEXT = { "-2": "on disk only", "-1": "dense layer", 0: "host RAM only", 1: "cached in a GPU slot", 2: "resident on the GPU" };
const HEAT_STOPS = [[13, 27, 42], [59, 44, 133], [192, 58, 118], [249, 154, 62], [252, 253, 191]];
const DENSE_RGB = [58, 63, 69];
const CACHED_COLOR = "#3df5ff";
const RESIDENT_COLOR = "#5dff7a";
const MARGIN = { left: 30, top: 16, bottom: 4 };
const MAX_HEIGHT = 400;  // CSS pixels for the cells: taller models get thinner rows

const LUT = heatLut(256);

function heatLut(size) {
  const lut = new Uint8ClampedArray(size * 3);
  for (let i = 0; i < size; i++) {
    const x = (i / (size - 1)) * (HEAT_STOPS.length - 1);
    const k = Math.min(Math.floor(x), HEAT_STOPS.length - 2);
    const f = x - k;
    for (let c = 0; c < 3; c++) lut[i * 3 + c] = HEAT_STOPS[k][c] * (1 - f) + HEAT_STOPS[k + 1][c] * f;
  }
  return lut;
}

export class Heatmap {
  constructor(canvas, tip) {
    this.canvas = canvas;
    this.tip = tip;
    this.state = null;
    this.layout = null;
    this.draws = 0;
    this.cells = document.createElement("canvas");  // experts x layers pixels, scaled up when drawn
    canvas.addEventListener("mousemove", (event) => this.hover(event));
    canvas.addEventListener("mouseleave", () => { tip.hidden = true; });
  }

  // state: {layers, experts, usage: [layers][experts], where: [layers][experts]}
  draw(state) {
    const started = performance.now();
    this.state = state;
    this.layout = this.fit(state.layers, state.experts);
    const ctx = this.canvas.getContext("2d");
    const { dpr } = this.layout;
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, this.canvas.width / dpr, this.canvas.height / dpr);
    if (state.layers && state.experts) {
      const counts = this.paintCells(state);
      this.drawCells(ctx);
      this.drawMarkers(ctx, state);
      this.drawAxes(ctx, state);
      Object.assign(this.canvas.dataset, counts);
    }
    this.draws += 1;
    Object.assign(this.canvas.dataset, {
      draws: this.draws, layers: state.layers, experts: state.experts,
      drawMs: (performance.now() - started).toFixed(2),
    });
  }

  fit(layers, experts) {
    const dpr = window.devicePixelRatio || 1;
    const width = this.canvas.clientWidth || 800;
    const cellW = (width - MARGIN.left) / Math.max(experts, 1);
    const cellH = Math.max(3, Math.min(16, Math.floor(MAX_HEIGHT / Math.max(layers, 1))));
    const height = MARGIN.top + layers * cellH + MARGIN.bottom;
    if (this.canvas.width !== Math.round(width * dpr) || this.canvas.height !== Math.round(height * dpr)) {
      this.canvas.width = Math.round(width * dpr);
      this.canvas.height = Math.round(height * dpr);
      this.canvas.style.height = `${height}px`;
    }
    return { dpr, width, height, cellW, cellH, left: MARGIN.left, top: MARGIN.top };
  }

  // One RGBA pixel per expert; returns the counts the page exposes as data attributes.
  paintCells({ layers, experts, usage, where }) {
    this.cells.width = experts;
    this.cells.height = layers;
    const ctx = this.cells.getContext("2d");
    const image = ctx.createImageData(experts, layers);
    const peak = Math.max(0, ...usage.map((row) => Math.max(...row)));
    const counts = { active: 0, cached: 0, resident: 0, peakUsage: peak.toFixed(2) };
    for (let l = 0; l < layers; l++) {
      for (let e = 0; e < experts; e++) {
        const u = usage[l][e];
        const w = where[l][e];
        const rgb = w === WHERE.dense ? DENSE_RGB : lutColor(peak > 0 ? Math.sqrt(u / peak) : 0);
        image.data.set(rgb, (l * experts + e) * 4);
        image.data[(l * experts + e) * 4 + 3] = 255;
        if (u > 0) counts.active += 1;
        if (w === WHERE.cached) counts.cached += 1;
        if (w === WHERE.resident) counts.resident += 1;
      }
    }
    ctx.putImageData(image, 0, 0);
    return counts;
  }

  drawCells(ctx) {
    const { cellW, cellH } = this.layout;
    ctx.imageSmoothingEnabled = false;
    ctx.drawImage(this.cells, MARGIN.left, MARGIN.top, this.cells.width * cellW, this.cells.height * cellH);
  }

  drawMarkers(ctx, { layers, experts, where }) {
    const { cellW, cellH } = this.layout;
    const size = Math.max(1.5, Math.min(cellW, cellH) * 0.4);
    for (let l = 0; l < layers; l++) {
      for (let e = 0; e < experts; e++) {
        const w = where[l][e];
        if (w !== WHERE.cached && w !== WHERE.resident) continue;
        ctx.fillStyle = w === WHERE.cached ? CACHED_COLOR : RESIDENT_COLOR;
        ctx.fillRect(MARGIN.left + e * cellW, MARGIN.top + l * cellH, size, size);
      }
    }
  }

  drawAxes(ctx, { layers, experts }) {
    const { cellW, cellH } = this.layout;
    ctx.fillStyle = "#8a96a3";
    ctx.font = "10px system-ui, sans-serif";
    ctx.textBaseline = "middle";
    ctx.textAlign = "right";
    const layerStep = tickStep(cellH, 12);
    for (let l = 0; l < layers; l += layerStep) ctx.fillText(String(l), MARGIN.left - 4, MARGIN.top + (l + 0.5) * cellH);
    ctx.textAlign = "center";
    const expertStep = tickStep(cellW, 24);
    for (let e = 0; e < experts; e += expertStep) ctx.fillText(String(e), MARGIN.left + (e + 0.5) * cellW, 7);
  }

  hover(event) {
    const cell = this.cellAt(event.offsetX, event.offsetY);
    if (!cell) { this.tip.hidden = true; return; }
    const { layer, expert } = cell;
    const u = this.state.usage[layer][expert];
    this.tip.textContent = `layer ${layer}, expert ${expert}: ${u.toFixed(2)} recent picks, ` +
      WHERE_TEXT[this.state.where[layer][expert]];
    this.tip.style.left = `${event.offsetX + 12}px`;
    this.tip.style.top = `${event.offsetY + 12}px`;
    this.tip.hidden = false;
  }

  cellAt(x, y) {
    if (!this.state || !this.layout) return null;
    const expert = Math.floor((x - MARGIN.left) / this.layout.cellW);
    const layer = Math.floor((y - MARGIN.top) / this.layout.cellH);
    if (layer < 0 || expert < 0 || layer >= this.state.layers || expert >= this.state.experts) return null;
    return { layer, expert };
  }
}

function lutColor(x) {
  const i = Math.max(0, Math.min(255, Math.round(x * 255))) * 3;
  return LUT.subarray(i, i + 3);
}

// The smallest power of two of cells whose labels are at least `minPixels` apart.
function tickStep(cellPixels, minPixels) {
  let step = 1;
  while (step * cellPixels < minPixels) step *= 2;
  return step;
}
