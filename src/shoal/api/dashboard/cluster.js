// Rendering the node's answers into the page's tables. Every value from the server goes in
// as text (never as HTML): model and node names are whatever their owners chose.

export function el(tag, attributes = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attributes)) {
    if (value !== undefined && value !== null) node.setAttribute(name, value);
  }
  for (const child of children.flat()) {
    if (child !== null && child !== undefined) {
      node.append(child instanceof Node ? child : String(child));
    }
  }
  return node;
}

export function formatBytes(bytes) {
  if (bytes === null || bytes === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let value = bytes, unit = 0;
  while (value >= 1024 && unit < units.length - 1) { value /= 1024; unit += 1; }
  return `${value.toFixed(unit === 0 ? 0 : 1)} ${units[unit]}`;
}

export function formatSeconds(seconds) {
  seconds = Math.max(0, Math.round(seconds));
  if (seconds < 60) return `${seconds} s`;
  if (seconds < 3600) return `${Math.floor(seconds / 60)}m ${seconds % 60}s`;
  return `${Math.floor(seconds / 3600)}h ${Math.floor((seconds % 3600) / 60)}m`;
}

const nowSeconds = () => Date.now() / 1000;

// A node is healthy while its readings keep coming (telemetry every 2 s; 10 s of silence and
// the master removes it).
const STALE_AFTER_S = 6;

function nodeName(cluster, nodeId) {
  const node = (cluster.nodes || []).find((n) => n.node_id === nodeId);
  return node && node.name ? node.name : String(nodeId).slice(0, 8);
}

function fillTable(table, rows, emptyText) {
  const body = table.tBodies[0];
  const columns = table.tHead.rows[0].cells.length;
  body.replaceChildren(...(rows.length ? rows
    : [el("tr", {}, el("td", { colspan: columns, class: "muted" }, emptyText))]));
}

function usageBar(used, total) {
  if (!total) return "–";
  const fraction = Math.min(1, Math.max(0, used / total));
  return el("span", { class: "usage" },
    el("meter", { min: 0, max: 1, value: fraction.toFixed(3) }),
    ` ${formatBytes(used)} / ${formatBytes(total)}`);
}

function healthCell(node) {
  if (node.last_seen === null || node.last_seen === undefined) {
    return el("td", { class: "stale" }, "no reading yet");
  }
  const age = nowSeconds() - node.last_seen;
  const fresh = age < STALE_AFTER_S;
  return el("td", { class: fresh ? "ok" : "stale" },
    `${fresh ? "ok" : "silent"}, seen ${formatSeconds(age)} ago`);
}

// A node's GPUs (their names and memory), and what models hold there where a backend
// drives them (llama-server built for the GPU).
function gpuLines(node) {
  const gpus = node.gpus || [];
  if (!gpus.length) return [];
  const names = gpus.map((g) => g.name).join(", ");
  const text = node.device_budget === null || node.device_budget === undefined
    ? `GPU ${names}: no backend drives it`
    : `GPU ${formatBytes(node.device_held)} / ${formatBytes(node.device_budget)} (${names})`;
  return [el("br"), el("span", { class: "gpu" }, text)];
}

export function renderNodes(table, cluster) {
  const rows = (cluster.nodes || []).map((node) => {
    const badges = [];
    if (node.node_id === cluster.master_id) badges.push(el("span", { class: "badge master" }, "master"));
    if (node.node_id === cluster.node_id) badges.push(el("span", { class: "badge" }, "this node"));
    const used = node.memory_total ? node.memory_total - node.memory_available : null;
    const load = node.cpu_percent === null || node.cpu_percent === undefined ? "–"
      : `${node.cpu_percent.toFixed(0)}% of ${node.cpu_count} cores`;
    return el("tr", { "data-node-id": node.node_id },
      el("td", { title: [node.node_id, ...(node.models || []).map((m) => `holds ${m.model} (${formatBytes(m.size)})`)].join("\n") },
        el("span", { class: "node-name" }, nodeName(cluster, node.node_id)), ...badges),
      el("td", {}, usageBar(used, node.memory_total)),
      el("td", {}, `${formatBytes(node.memory_held)} / ${formatBytes(node.memory_budget)}`,
        ...gpuLines(node)),
      el("td", {}, load),
      el("td", {}, node.queue_depth ?? 0),
      healthCell(node));
  });
  fillTable(table, rows, "no nodes reported yet");
}

function keepAlive(instance) {
  if (instance.pinned) return "pinned";
  if (instance.expires_at !== null && instance.expires_at !== undefined) {
    return `expires in ${formatSeconds(instance.expires_at - nowSeconds())}`;
  }
  return instance.keep_alive_s === null || instance.keep_alive_s === undefined
    ? "kept loaded" : `in use (then ${formatSeconds(instance.keep_alive_s)})`;
}

// An expert rank holds every layer and a range of experts; other ranks a range of layers.
function rankHolds(rank) {
  if (rank.experts) return `experts ${rank.experts[0]}–${rank.experts[1]}`;
  return `layers ${rank.layers[0]}–${rank.layers[1]}`;
}

export function renderInstances(table, cluster) {
  const rows = (cluster.instances || []).map((instance) => el("tr", { "data-instance-id": instance.instance_id },
    el("td", {}, instance.model, el("div", { class: "muted small" }, instance.sharding)),
    el("td", { class: `status-${instance.status}` }, instance.status),
    el("td", {}, instance.ranks.map((rank) => el("div", {},
      `rank ${rank.rank}: ${nodeName(cluster, rank.node_id)}, ${rankHolds(rank)}, ${rank.phase || "pending"}`))),
    el("td", {}, formatBytes(instance.memory_bytes)),
    el("td", {}, keepAlive(instance)),
    el("td", {}, instance.queue_depth ?? 0)));
  fillTable(table, rows, "no model instances");
}

function expiry(isoTime) {
  if (!isoTime) return "kept loaded or in use";
  return `in ${formatSeconds(Date.parse(isoTime) / 1000 - nowSeconds())}`;
}

// /api/ps: this node's runners, then (in a cluster) instances other nodes serve.
export function renderModels(table, ps, cluster) {
  const rows = (ps.models || []).map((model) => {
    const where = model.shoal && model.shoal.node_id;
    return el("tr", {},
      el("td", {}, model.model),
      el("td", {}, where ? nodeName(cluster || {}, where) : "this node"),
      el("td", {}, formatBytes(model.size)),
      el("td", {}, expiry(model.expires_at)));
  });
  fillTable(table, rows, "no models loaded");
}

// Loads in progress: this node's pulls (bytes fetched so far), its runners with their
// reported stage, images being drawn (step k of n), and instances of the cluster that are
// not ready yet.
export function renderLoads(list, health, cluster) {
  const items = [];
  for (const pull of (health && health.pulls) || []) {
    const fraction = pull.total ? pull.completed / pull.total : 0;
    items.push(el("li", {}, `${pull.model} pulling: ${pull.status} `,
      el("progress", { max: 1, value: fraction.toFixed(3) }),
      ` ${formatBytes(pull.completed)} / ${formatBytes(pull.total)}`));
  }
  for (const model of (health && health.models) || []) {
    // An image model drawing: denoising step k of n of each request.
    for (const drawing of model.image_steps || []) {
      items.push(el("li", {}, `${model.model} drawing: step ${drawing.step} of ${drawing.steps} `,
        el("progress", { max: drawing.steps, value: drawing.step })));
    }
    if (!["starting", "restarting"].includes(model.state)) continue;
    const load = model.load || {};
    items.push(el("li", {}, `${model.model} here: ${load.stage || "starting"} `,
      el("progress", { max: 1, value: (load.progress || 0).toFixed(3) }),
      ` ${Math.round((load.progress || 0) * 100)}%`));
  }
  for (const instance of (cluster && cluster.instances) || []) {
    if (instance.status === "ready" || instance.status === "failed") continue;
    const phases = instance.ranks.map((r) => `${nodeName(cluster, r.node_id)} ${r.phase || "pending"}`);
    items.push(el("li", {}, `${instance.model}: ${instance.status} (${phases.join(", ")})`));
  }
  // Nodes where a model's download or load failed: left out of its next placements.
  for (const [model, failed] of Object.entries((cluster && cluster.load_failures) || {})) {
    for (const [nodeId, reason] of Object.entries(failed)) {
      items.push(el("li", { class: "stale" },
        `${model} failed on ${nodeName(cluster, nodeId)} (placed elsewhere next): ${reason}`));
    }
  }
  list.replaceChildren(...(items.length ? items : [el("li", { class: "muted" }, "nothing loading")]));
}

// The sum of a Prometheus counter over all its label sets, from /metrics' text.
export function counterTotal(metricsText, name) {
  let total = 0;
  for (const line of metricsText.split("\n")) {
    if (line.startsWith(`${name}{`) || line.startsWith(`${name} `)) {
      const value = Number(line.slice(line.lastIndexOf(" ") + 1));
      if (Number.isFinite(value)) total += value;
    }
  }
  return total;
}
