"""A soak of one node or a cluster of `shoal serve` processes on loopback; prints one JSON
object.

    python bench/soak.py [--minutes 15] [--nodes 3] [--concurrency 4]
                         [--fault-every-s 180] [--models smollm2,gemma3:270m]

Workers send chat streams without pause, to every node in turn, for models drawn from
--models, at random priorities (x_priority 0-9); one request in ten is cancelled by its
client (the stream closed after its first chunk). Every --fault-every-s one fault, in turn:
kill -9 of a serving runner; with several nodes, kill -9 of a node that is not the master
(restarted at once on the same data dir), then of the master (restarted likewise).

Reported: requests accepted (an HTTP 200 stream began) / completed / failed / cancelled /
hung (no end within REQUEST_BOUND_S: must be 0), errors by message, p50/p99 latency per
phase (warm-up, then one phase per fault), and the RSS of every long-lived process (each
node, each runner) when the warm-up ends and at the end, with its growth (at most 5% after
warm-up is the bound; a process restarted by a fault is listed with its restart), sampled
every minute, with the growth over the second half alone (bounded buffers, such as the
node's span ring, fill over the first thousands of requests; a leak goes on).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
from cluster import cluster_view, start_nodes, stop_nodes, wait_agreed

REQUEST_BOUND_S = 180.0
# The baseline for memory growth: a node's RSS steps up ~25 MB over its first ~1,000 requests
# (measured: 112 -> 140 MiB in the minute after a 30 s warm-up, then 0.5-1 MiB a minute).
WARMUP_S = 120.0
RSS_SAMPLE_S = 60.0
QUESTIONS = ("Name three rivers.", "Write a haiku about rain.", "What is 17 times 3?",
             "List two colours.")


@dataclass
class Record:
    phase: str
    started: float
    latency_s: float
    outcome: str  # completed, failed, cancelled, hung, refused
    message: str = ""


@dataclass
class Soak:
    urls: list[str]
    models: list[str]
    records: list[Record] = field(default_factory=list)
    phase: str = "warm-up"
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def worker(self, seed: int) -> None:
        rng = random.Random(seed)
        turn = seed
        while not self.stop.is_set():
            url = self.urls[turn % len(self.urls)]
            turn += 1
            self.one(url, rng)

    def one(self, url: str, rng: random.Random) -> None:
        body = {"model": rng.choice(self.models), "stream": True, "max_tokens": 24,
                "messages": [{"role": "user", "content": rng.choice(QUESTIONS)}],
                "x_priority": rng.randint(0, 9)}
        cancel = rng.random() < 0.1
        phase, started = self.phase, time.monotonic()
        outcome, message = "completed", ""
        try:
            with httpx.stream("POST", url + "/v1/chat/completions", json=body,
                              timeout=httpx.Timeout(REQUEST_BOUND_S)) as response:
                if response.status_code != 200:
                    response.read()
                    outcome, message = "refused", f"{response.status_code} {response.text}"
                else:
                    for line in response.iter_lines():
                        if cancel:
                            outcome = "cancelled"
                            break
                        if line.startswith("data: ") and '"error"' in line:
                            outcome, message = "failed", line[6:]
        except httpx.TimeoutException:
            outcome = "hung"
        except httpx.HTTPError as error:
            outcome, message = "failed", f"{type(error).__name__}: {error}"
        record = Record(phase, started, time.monotonic() - started, outcome, message[:200])
        with self.lock:
            self.records.append(record)


def processes(urls: list[str], nodes: list[tuple[subprocess.Popen, str]]) -> dict[str, int]:
    """name -> pid of every long-lived process: each node and each runner it reports."""
    found = {f"node{i + 1}": proc.pid for i, (proc, _) in enumerate(nodes)}
    for i, url in enumerate(urls):
        try:
            health = httpx.get(url + "/health", timeout=5).json()
        except (httpx.HTTPError, ValueError):
            continue
        for model in health.get("models", []):
            if model.get("pid"):
                found[f"node{i + 1}/{model.get('model')}"] = model["pid"]
    return found


def rss(pids: dict[str, int]) -> dict[str, int | None]:
    out: dict[str, int | None] = {}
    for name, pid in pids.items():
        try:
            out[name] = psutil.Process(pid).memory_info().rss
        except psutil.Error:
            out[name] = None
    return out


def master_index(urls: list[str]) -> int | None:
    view = cluster_view(urls[0])
    if view is None or view["master_id"] is None:
        return None
    for i, url in enumerate(urls):
        other = cluster_view(url)
        if other is not None and other["node_id"] == view["master_id"]:
            return i
    return None


def inject(fault: str, urls: list[str], nodes: list, root: Path, rng: random.Random) -> str:
    """Carry out one fault; what it did, in words."""
    if fault == "runner":
        runners = [(name, pid) for name, pid in processes(urls, nodes).items() if "/" in name]
        if not runners:
            return "no runner to kill"
        name, pid = rng.choice(runners)
        os.kill(pid, signal.SIGKILL)
        return f"kill -9 runner {name}"
    master = master_index(urls)
    if master is None:
        return "no agreed master: no node killed"
    index = master if fault == "master" else rng.choice(
        [i for i in range(len(nodes)) if i != master])
    proc, url = nodes[index]
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    nodes[index] = restart(root, nodes, index)
    return f"kill -9 node{index + 1} ({'master' if fault == 'master' else 'not master'}), " \
           "restarted"


def restart(root: Path, nodes: list, index: int) -> tuple[subprocess.Popen, str]:
    """The node of index again, on its data dir, ports and flags."""
    proc, url = nodes[index]
    args = proc.args
    data = root / f"node{index + 1}"
    log = open(data / "serve.log", "a")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT), url


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return round(values[min(len(values) - 1, int(q * len(values)))], 3)


def summary(records: list[Record]) -> dict:
    counts = {kind: sum(r.outcome == kind for r in records)
              for kind in ("completed", "failed", "cancelled", "hung", "refused")}
    phases = {}
    for phase in dict.fromkeys(r.phase for r in records):
        done = [r.latency_s for r in records if r.phase == phase and r.outcome == "completed"]
        phases[phase] = {"requests": sum(r.phase == phase for r in records),
                         "completed": len(done), "p50_s": percentile(done, 0.5),
                         "p99_s": percentile(done, 0.99)}
    errors: dict[str, int] = {}
    for record in records:
        if record.message:
            errors[record.message[:120]] = errors.get(record.message[:120], 0) + 1
    return {"requests": len(records),
            "accepted": sum(r.outcome != "refused" for r in records), **counts,
            "phases": phases, "errors": dict(sorted(errors.items(), key=lambda e: -e[1])[:10])}


def memory_growth(start: dict[str, int | None], end: dict[str, int | None],
                  start_pids: dict[str, int], end_pids: dict[str, int],
                  samples: dict[str, list[int]]) -> dict:
    """Each process's RSS after warm-up and at the end, and, from the samples taken every
    RSS_SAMPLE_S, its course and its growth over the second half alone: bounded buffers
    (the span ring: 16,384 spans, ~7 MiB) fill over thousands of requests, a leak goes on."""
    out = {}
    for name in sorted(set(start) | set(end)):
        before, after = start.get(name), end.get(name)
        same = start_pids.get(name) == end_pids.get(name)
        series = samples.get(name, [])
        middle = series[len(series) // 2] if series else None
        out[name] = {"rss_start": before, "rss_end": after, "restarted": not same,
                     "growth_percent": (round(100 * (after - before) / before, 1)
                                        if before and after and same else None),
                     "growth_second_half_percent": (
                         round(100 * (after - middle) / middle, 1)
                         if middle and after and same else None),
                     "rss_mib_sampled": [round(value / 2**20, 1) for value in series]}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=15.0)
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--fault-every-s", type=float, default=180.0)
    parser.add_argument("--models", default="smollm2,gemma3:270m")
    parser.add_argument("--threads", type=int, default=1, help="--threads of each node")
    args = parser.parse_args()
    models = [m for m in args.models.split(",") if m]
    rng = random.Random(0)
    faults = ["runner"] + (["node", "master"] if args.nodes > 1 else [])
    with tempfile.TemporaryDirectory(prefix="shoal-soak-") as tmp:
        root = Path(tmp)
        nodes = start_nodes(root, args.nodes, threads=args.threads)
        urls = [url for _, url in nodes]
        try:
            wait_agreed(urls, args.nodes, 180)
            for model in models:  # each model loaded once before the clock starts
                httpx.post(urls[0] + "/v1/chat/completions", timeout=300, json={
                    "model": model, "max_tokens": 1,
                    "messages": [{"role": "user", "content": "hi"}]})
            soak = Soak(urls, models)
            workers = [threading.Thread(target=soak.worker, args=(seed,))
                       for seed in range(args.concurrency)]
            for worker in workers:
                worker.start()
            began = time.monotonic()
            end = began + args.minutes * 60
            time.sleep(min(WARMUP_S, args.minutes * 60 / 4))
            start_pids = processes(urls, nodes)
            start_rss = rss(start_pids)
            samples: dict[str, list[int]] = {}
            next_sample = time.monotonic()
            fault_log = []
            next_fault, fault_index = time.monotonic() + args.fault_every_s, 0
            while time.monotonic() < end:
                time.sleep(min(1.0, max(0.0, end - time.monotonic())))
                if time.monotonic() >= next_sample:  # the processes alive since warm-up
                    for name, value in rss(start_pids).items():
                        if value:
                            samples.setdefault(name, []).append(value)
                    next_sample += RSS_SAMPLE_S
                if time.monotonic() >= next_fault and time.monotonic() < end - 10:
                    fault = faults[fault_index % len(faults)]
                    did = inject(fault, urls, nodes, root, rng)
                    fault_index += 1
                    soak.phase = f"after fault {fault_index}: {did}"
                    fault_log.append({"at_s": round(time.monotonic() - began, 1),
                                      "fault": did})
                    next_fault = time.monotonic() + args.fault_every_s
                elif soak.phase == "warm-up":
                    soak.phase = "steady"
            end_pids = processes(urls, nodes)
            end_rss = rss(end_pids)
            soak.stop.set()
            for worker in workers:
                worker.join(REQUEST_BOUND_S + 10)
        finally:
            stop_nodes(nodes)
    print(json.dumps({"nodes": args.nodes, "minutes": args.minutes, "models": models,
                      "concurrency": args.concurrency, "faults": fault_log,
                      **summary(soak.records),
                      "memory": memory_growth(start_rss, end_rss, start_pids, end_pids,
                                              samples)},
                     indent=2))


if __name__ == "__main__":
    sys.exit(main())
