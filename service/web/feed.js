// The cache view's data: one GET /v1/cache/state for a first paint, then /v1/cache/events while the
// page is visible. Rates come from the difference of two states' totals over their server times.

export const BATCH_CLASSES = ["<=8", "9-32", ">32"];
const MIB = 1024 * 1024;
const TOTALS = ["uploaded_bytes", "streamed_bytes", "generation_tokens", "cpu_experts"];

export class CacheFeed {
  // onState(state, rates | null); onStatus(text) with "offline" while the stream is down.
  constructor({ onState, onStatus }) {
    this.onState = onState;
    this.onStatus = onStatus;
    this.previous = null;
    this.source = null;
    document.addEventListener("visibilitychange", () => (document.hidden ? this.close() : this.open()));
  }

  async start() {
    try {
      const response = await fetch("/v1/cache/state");
      if (response.ok) this.accept(await response.json());
    } catch {
      this.onStatus("offline");
    }
    if (!document.hidden) this.open();
  }

  open() {
    if (this.source) return;
    this.source = new EventSource("/v1/cache/events");
    this.source.onmessage = (event) => this.accept(JSON.parse(event.data));
    this.source.onerror = () => this.onStatus("offline");  // EventSource reconnects by itself
  }

  close() {
    this.source?.close();
    this.source = null;
  }

  accept(state) {
    if (this.previous && state.time <= this.previous.time) return;  // an older state arriving late
    const rates = this.previous ? ratesBetween(this.previous, state) : null;
    this.previous = state;
    this.onStatus(state.status);
    this.onState(state, rates);
  }
}

// Per-second rates and per-interval hit ratios; null after a restart (totals went down).
export function ratesBetween(a, b) {
  const dt = b.time - a.time;
  if (dt <= 0 || TOTALS.some((k) => b.stats[k] < a.stats[k])) return null;
  const per = (k) => (b.stats[k] - a.stats[k]) / dt;
  return {
    uploadMiB: per("uploaded_bytes") / MIB,
    streamMiB: per("streamed_bytes") / MIB,
    tokens: per("generation_tokens"),
    cpuExperts: per("cpu_experts"),
    hitRatio: BATCH_CLASSES.map((c) => intervalRatio(a.stats.batch_classes[c], b.stats.batch_classes[c])),
  };
}

// Hits over picks between two states, or null when the class saw no picks in the interval.
function intervalRatio(a, b) {
  const hits = b.hits - a.hits;
  const picks = hits + b.misses - a.misses;
  return picks > 0 ? hits / picks : null;
}
