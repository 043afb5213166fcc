// Wires the page: the chat box, and the cache view fed by the server's cache state.
import { LineChart } from "./chart.js";
import { Chat } from "./chat.js";
import { BATCH_CLASSES, CacheFeed } from "./feed.js";
import { Heatmap } from "./heatmap.js";

const $ = (id) => document.getElementById(id);
const CLASS_COLORS = ["#4fb3ff", "#f9a03e", "#c77dff"];

function start() {
  const chat = new Chat({
    form: $("chat-form"), prompt: $("prompt"), messages: $("messages"), apiKey: $("api-key"),
    maxTokens: $("max-tokens"), temperature: $("temperature"), send: $("send"), stop: $("stop"), clear: $("clear"), error: $("chat-error"),
  });
  const heatmap = new Heatmap($("heatmap"), $("heatmap-tip"));
  const hitChart = new LineChart($("hit-chart"), {
    series: BATCH_CLASSES.map((c, i) => ({ name: `${c} tokens`, color: CLASS_COLORS[i] })), yMax: 1,
  });
  const trafficChart = new LineChart($("traffic-chart"), {
    series: [{ name: "uploaded", color: "#3df5ff" }, { name: "streamed", color: "#f9a03e" }], digits: 1,
  });
  const feed = new CacheFeed({
    onStatus: showStatus,
    onState: (state, rates) => {
      showState(state, rates);
      heatmap.draw(state);
      if (!rates) return;
      hitChart.push(state.time, rates.hitRatio);
      trafficChart.push(state.time, [rates.uploadMiB, rates.streamMiB]);
    },
  });
  feed.start();
  // The page's parts, for scripts and the browser console.
  window.moecache = { chat, heatmap, hitChart, trafficChart, feed };
}

function showStatus(status) {
  $("status").dataset.status = status;
  $("status").textContent = status;
}

function showState(state, rates) {
  const s = state.stats;
  $("model").textContent = state.model;
  $("placement").textContent = state.placement;
  $("tile-hit").textContent = percent(s.recent_hit_ratio);
  $("tile-slots").textContent = String(s.slots);
  showDevices(s.devices || []);
  $("tile-decode").textContent = s.decode_tokens_per_second.toFixed(1);
  $("tile-requests").textContent = `${s.requests_running} / ${s.requests_waiting}`;
  if (!rates) return;
  $("tile-upload").textContent = rates.uploadMiB.toFixed(2);
  $("tile-stream").textContent = rates.streamMiB.toFixed(2);
  $("tile-tokens").textContent = rates.tokens.toFixed(1);
  $("tile-cpu").textContent = rates.cpuExperts.toFixed(0);
}

// A model split across several devices: each device's part of the cache.
function showDevices(devices) {
  $("devices").hidden = devices.length < 2;
  $("devices").textContent = devices.map((d) => `${d.device}: ${d.slots} slots, ${(d.cache_bytes / 2 ** 20).toFixed(0)} MiB, `
    + `${percent(d.recent_hit_ratio)} recent hits`).join(" · ");
}

function percent(x) {
  return `${(100 * x).toFixed(1)}%`;
}

start();
