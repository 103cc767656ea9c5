// The dashboard's entry point: the API key form, and a refresh every REFRESH_MS of what the
// node knows (GET /cluster, /api/ps, /health, /metrics, /v1/models), each request bounded
// by api.js's timeout, the next refresh starting only once the last has finished.

import { Unauthorized, apiKey, get, post, saveApiKey } from "./api.js";
import { ChatPane } from "./chat.js";
import {
  counterTotal, renderInstances, renderLoads, renderModels, renderNodes,
} from "./cluster.js";

const REFRESH_MS = 2000;
const byId = (id) => document.getElementById(id);

// Readings {seconds, total} of the generated-token counter over the last RATE_WINDOW_S: it
// grows as requests finish, so a rate over one refresh would flicker between 0 and bursts.
const RATE_WINDOW_S = 10;
let tokenReadings = [];

// The failure of one source under its section, whose figures then show as outdated.
function showError(source, error) {
  const box = document.querySelector(`.error[data-for="${source}"]`);
  if (!box) return;
  box.hidden = !error;
  box.textContent = error ? error.message : "";
  const section = box.closest("section");
  const failing = section.querySelectorAll(".error[data-for]:not([hidden])").length > 0;
  section.classList.toggle("outdated", failing);
}

function showAuthPrompt(show) {
  byId("auth-prompt").hidden = !show;
  if (show && document.activeElement !== byId("api-key")) byId("api-key").focus();
}

function tokensPerSecond(metricsText) {
  const now = performance.now() / 1000;
  const total = counterTotal(metricsText, "shoal_generated_tokens_total");
  const last = tokenReadings[tokenReadings.length - 1];
  if (last && total < last.total) tokenReadings = []; // the node restarted: start again
  tokenReadings.push({ seconds: now, total });
  tokenReadings = tokenReadings.filter((r) => now - r.seconds <= RATE_WINDOW_S);
  const first = tokenReadings[0];
  if (tokenReadings.length < 2) return "–";
  return ((total - first.total) / (now - first.seconds)).toFixed(1);
}

function renderHealth(health) {
  byId("health").textContent = health.status;
  byId("health").className = `status-${health.status}`;
  const queue = health.queue;
  byId("queue").textContent = queue ? `${queue.waiting} / ${queue.running}` : "–";
  // What the node warns of while it goes on serving (a full or read-only data dir).
  const warnings = health.warnings || [];
  byId("warnings").replaceChildren(...warnings.map((text) => {
    const item = document.createElement("li");
    item.textContent = text;
    return item;
  }));
  byId("warnings").hidden = warnings.length === 0;
}

async function refresh(chat) {
  const [cluster, ps, health, metrics, models] = await Promise.allSettled([
    get("/cluster"), get("/api/ps"), get("/health", { allow: [503] }),
    get("/metrics", { json: false }), get("/v1/models"),
  ]);
  const results = { cluster, ps, health, metrics, models };
  const unauthorized = Object.values(results).some((r) => r.reason instanceof Unauthorized);
  showAuthPrompt(unauthorized);
  for (const [source, result] of Object.entries(results)) {
    // A missing key is said once, by the banner, not under every section.
    const failed = result.status === "rejected" && !(result.reason instanceof Unauthorized);
    showError(source, failed ? result.reason : null);
  }
  const clusterView = cluster.status === "fulfilled" ? cluster.value : null;
  if (clusterView) {
    renderNodes(byId("nodes"), clusterView);
    renderInstances(byId("instances"), clusterView);
    const here = clusterView.nodes.find((n) => n.node_id === clusterView.node_id);
    byId("this-node").textContent = `node ${here && here.name ? here.name : clusterView.node_id}`;
  }
  if (ps.status === "fulfilled") renderModels(byId("models"), ps.value, clusterView);
  if (health.status === "fulfilled") renderHealth(health.value);
  renderLoads(byId("loads"), health.value, clusterView);
  if (metrics.status === "fulfilled") byId("tokens-per-second").textContent = tokensPerSecond(metrics.value);
  if (models.status === "fulfilled") chat.setModels(models.value.data || []);
  const failed = Object.values(results).filter((r) => r.status === "rejected").length;
  byId("refreshed").textContent = `updated ${new Date().toLocaleTimeString()}`
    + (failed ? `, ${failed} of 5 requests failed` : "");
}

function setUpKeyForm(chat) {
  const input = byId("api-key");
  input.value = apiKey();
  byId("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    saveApiKey(input.value.trim());
    refresh(chat);
  });
  byId("key-forget").addEventListener("click", () => {
    input.value = "";
    saveApiKey("");
    refresh(chat);
  });
}

// A pull runs on the node: its progress shows under Loading (/health's pulls); this form
// starts one and says how it ended.
function setUpPullForm() {
  byId("pull-form").addEventListener("submit", async (event) => {
    event.preventDefault();
    const model = byId("pull-model").value.trim();
    if (!model) return;
    const status = byId("pull-status");
    status.textContent = `pulling ${model}…`;
    try {
      await post("/api/pull", { model, stream: false }, { timeoutMs: null });
      status.textContent = `${model} is on disk`;
    } catch (error) {
      if (error instanceof Unauthorized) showAuthPrompt(true);
      status.textContent = `pull ${model}: ${error.message}`;
    }
  });
}

async function loop(chat) {
  try {
    await refresh(chat);
  } catch (error) { // a bug in rendering must not stop the refreshes
    byId("refreshed").textContent = `refresh failed: ${error.message}`;
  }
  setTimeout(() => loop(chat), REFRESH_MS);
}

const chat = new ChatPane(() => showAuthPrompt(true));
setUpKeyForm(chat);
setUpPullForm();
loop(chat);
