"""One node's Prometheus metrics, served at GET /metrics (prometheus-client's text format).

Two kinds: what requests observe as they run (counters and histograms the API middleware and
the router update), and what is read at scrape time from the node's own objects (queue,
runners' memory and restarts, loads and evictions, the replicated cluster state), so no
figure is copied and left to go stale. Each node has its own CollectorRegistry: several nodes
in one process (tests) never share a series.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

# Latency buckets (seconds): a first token from tens of ms (warm, short prompt) to a minute
# (cold load of a large model); tokens from ~1 ms apart (batched, small model) to ~1 s.
FIRST_TOKEN_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
INTER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)


class NodeMetrics:
    """The metrics of one node; `registry` is what GET /metrics renders."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.http_requests = Counter(
            "shoal_http_requests", "HTTP requests answered, by route, model and status",
            ["route", "model", "status"], registry=self.registry)
        self.prompt_tokens = Counter(
            "shoal_prompt_tokens", "Prompt tokens of requests this node accepted",
            ["model"], registry=self.registry)
        self.generated_tokens = Counter(
            "shoal_generated_tokens", "Tokens generated for requests this node accepted",
            ["model"], registry=self.registry)
        self.prefix_cache_hit_tokens = Counter(
            "shoal_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache",
            ["model"], registry=self.registry)
        self.time_to_first_token = Histogram(
            "shoal_time_to_first_token_seconds", "From a request's arrival at the router to "
            "its first generated token (queue and load included)", ["model"],
            buckets=FIRST_TOKEN_BUCKETS, registry=self.registry)
        self.inter_token_latency = Histogram(
            "shoal_inter_token_latency_seconds", "Between consecutive generated tokens of a "
            "request", ["model"], buckets=INTER_TOKEN_BUCKETS, registry=self.registry)

        self.pulled_bytes = Counter(
            "shoal_pulled_bytes", "Bytes of model files pulls downloaded (resumed bytes "
            "already on disk not counted), by source", ["source"], registry=self.registry)

    def count_pulled(self, event: Any) -> None:
        """A pull's progress event (shoal.catalog.pull.progress.PullEvent): its new bytes."""
        if event.new_bytes:
            self.pulled_bytes.labels(event.source or "unknown").inc(event.new_bytes)

    def watch(self, router: Any) -> None:
        """Add the figures read at scrape time from router (its pool, queue and cluster)."""
        self.registry.register(NodeCollector(router))

    def observe(self, model: str) -> RequestObserver:
        return RequestObserver(self, model)


class RequestObserver:
    """Feeds one generation's chunks into the metrics: tokens, first-token and inter-token
    times (monotonic clock)."""

    def __init__(self, metrics: NodeMetrics, model: str) -> None:
        self._metrics = metrics
        self._clock = time.monotonic
        self._started = self._clock()
        self._last_token: float | None = None
        self.model = model

    def chunk(self, chunk: Any) -> None:
        metrics = self._metrics
        if chunk.kind == "accepted" and chunk.model:
            self.model = chunk.model  # a ladder's choice: the model that serves
        elif chunk.kind in ("token", "reasoning"):
            now = self._clock()
            if self._last_token is None:
                metrics.time_to_first_token.labels(self.model).observe(now - self._started)
            else:
                metrics.inter_token_latency.labels(self.model).observe(now - self._last_token)
            self._last_token = now
        elif chunk.kind == "finish":
            usage = chunk.usage
            metrics.prompt_tokens.labels(self.model).inc(usage.prompt_tokens)
            metrics.generated_tokens.labels(self.model).inc(usage.completion_tokens)
            metrics.prefix_cache_hit_tokens.labels(self.model).inc(usage.cached_tokens)


class NodeCollector(Collector):
    """Gauges and counters read from the node's objects at each scrape."""

    def __init__(self, router: Any) -> None:
        self._router = router

    def collect(self) -> Iterator[Metric]:
        router = self._router
        yield from _queue_metrics(router.queue)
        yield from _runner_metrics(router.pool)
        yield from _cluster_metrics(router.cluster)


def _queue_metrics(queue: Any) -> Iterator[Metric]:
    waiting = GaugeMetricFamily("shoal_queue_waiting", "Requests waiting for a turn in this "
                                "node's queue", labels=["model"])
    for model, depth in sorted(queue.depths().items()):
        waiting.add_metric([model], depth)
    running = GaugeMetricFamily("shoal_queue_running", "Requests holding a turn (admitted)",
                                labels=["model"])
    for model in sorted(queue.running_models()):
        running.add_metric([model], queue.running(model))
    yield waiting
    yield running


def _runner_metrics(pool: Any) -> Iterator[Metric]:
    kv = GaugeMetricFamily("shoal_kv_cache_bytes", "KV cache of this node's runners: blocks "
                           "requests hold (in_use), kept for the prefix cache (cached), and "
                           "the rest (free)", labels=["model", "state"])
    restarts = CounterMetricFamily("shoal_runner_restarts", "Runner processes restarted "
                                   "after a crash", labels=["model"])
    resident = GaugeMetricFamily("shoal_runner_resident_bytes", "Resident memory of each "
                                 "runner process, by the backend that serves its model",
                                 labels=["model", "backend"])
    device = GaugeMetricFamily("shoal_runner_device_bytes", "Accelerator (GPU) memory each "
                               "runner holds, by the backend that serves its model",
                               labels=["model", "backend"])
    for supervisor in pool.registry.supervisors:
        model = supervisor.model_id
        restarts.add_metric([model], supervisor.restarts)
        memory = supervisor.memory
        if memory is not None and memory.rss_bytes is not None:
            resident.add_metric([model, supervisor.backend], memory.rss_bytes)
        if memory is not None and memory.device_bytes is not None:
            device.add_metric([model, supervisor.backend], memory.device_bytes)
        if memory is None or memory.kv_bytes_capacity is None:
            continue
        in_use, cached = memory.kv_bytes_in_use or 0, memory.kv_bytes_cached or 0
        kv.add_metric([model, "in_use"], in_use)
        kv.add_metric([model, "cached"], cached)
        # Free within what the node granted it (the capacity beyond is address space).
        room = (memory.kv_bytes_granted if memory.kv_bytes_granted is not None
                else memory.kv_bytes_capacity)
        kv.add_metric([model, "free"], max(0, room - in_use - cached))
    loads = CounterMetricFamily("shoal_model_loads", "Models started on this node",
                                labels=["model"])
    for model, count in sorted(pool.counts.loads.items()):
        loads.add_metric([model], count)
    evictions = CounterMetricFamily("shoal_model_evictions", "Idle models unloaded to make "
                                    "room for another", labels=["model"])
    for model, count in sorted(pool.counts.evictions.items()):
        evictions.add_metric([model], count)
    yield from (kv, restarts, resident, device, loads, evictions)


def _cluster_metrics(cluster: Any) -> Iterator[Metric]:
    state = cluster.state
    yield GaugeMetricFamily("shoal_cluster_nodes", "Nodes in the cluster state",
                            value=len(state.nodes))
    yield GaugeMetricFamily("shoal_cluster_instances", "Model instances in the cluster state",
                            value=len(state.instances))
    replica = cluster.plane.replica
    yield CounterMetricFamily("shoal_cluster_master_changes", "Times this node followed a "
                              "new master's session after its first",
                              value=max(0, replica.sessions_followed - 1))
    yield CounterMetricFamily("shoal_cluster_events_applied", "Cluster events this node "
                              "applied to its state", value=replica.events_applied)
    outbox = cluster.plane.transport.outbox_stats
    yield GaugeMetricFamily("shoal_cluster_outbox_messages", "Cluster messages queued for the "
                            "network (sent off the event loop)", value=outbox.queued_messages)
    yield GaugeMetricFamily("shoal_cluster_outbox_bytes", "Bytes of the queued cluster "
                            "messages", value=outbox.queued_bytes)
    unsent = CounterMetricFamily("shoal_cluster_messages_unsent", "Cluster messages not sent: "
                                 "best-effort ones (telemetry, prefix updates) dropped while "
                                 "the link was congested, others refused with an error, or "
                                 "failed by the network layer", labels=["reason"])
    unsent.add_metric(["dropped"], outbox.dropped)
    unsent.add_metric(["refused"], outbox.refused)
    unsent.add_metric(["failed"], outbox.failed)
    yield unsent
