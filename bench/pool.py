"""Model swaps and queue overhead of the memory-gated pool; prints JSON.

    python bench/pool.py [--budget 900MiB] [--rounds 3] [--queued 64] [--admits 2000]

Swaps: one `shoal serve --standalone --no-preload` node whose --budget holds SmolLM2 or
Gemma 3 270M but not both. Time to first token (streamed, 1-token prompt budget) of:
- cold: the model loads into free memory (the other unloaded with keep_alive 0 first);
- swap: the other model is idle and loaded, so it is evicted, then this one loads.
Each is measured --rounds times per model, turn about; medians reported.

Queue overhead: the node's admission queue alone (pool/queue.py, in process): the time one
request takes to be admitted and release its slot with an idle queue, and with --queued
requests already waiting for a busy model (the queue scans them at every admission).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from shoal.pool.queue import AdmissionQueue, QueueLimits

MODELS = ("smollm2", "gemma3:270m")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_node(budget: str, data_dir: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = open(data_dir / "serve.log", "w")  # noqa: SIM115 - lives as long as the node
    proc = subprocess.Popen(
        [sys.executable, "-m", "shoal.cli.app", "serve", "--standalone", "--no-preload",
         "--memory-budget", budget, "--port", str(port), "--data-dir", str(data_dir)],
        stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"the node did not start; see {data_dir / 'serve.log'}")


def first_token_s(url: str, model: str, keep_alive: float | None = None) -> float:
    """Seconds from sending a streamed completion to its first token."""
    body = {"model": model, "prompt": "The capital of France is", "max_tokens": 1,
            "temperature": 0, "stream": True}
    if keep_alive is not None:
        body["keep_alive"] = keep_alive
    started = time.monotonic()
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as response:
        if response.status_code != 200:
            raise SystemExit(f"{model}: {response.status_code} {response.read()[:300]!r}")
        took = None
        for line in response.iter_lines():  # read to the end: the request then finishes
            if took is None and line.startswith("data: {"):
                took = time.monotonic() - started
    if took is None:
        raise SystemExit(f"{model}: the stream carried no token")
    return took


def loaded(url: str) -> list[str]:
    return [m["model"] for m in httpx.get(url + "/api/ps", timeout=10).json()["models"]]


def wait_empty(url: str) -> None:
    deadline = time.monotonic() + 60
    while loaded(url) and time.monotonic() < deadline:
        time.sleep(0.1)


def measure_swaps(budget: str, rounds: int) -> dict:
    cold: dict[str, list[float]] = {m: [] for m in MODELS}
    swap: dict[str, list[float]] = {m: [] for m in MODELS}
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = start_node(budget, Path(tmp))
        try:
            first_token_s(url, MODELS[0], keep_alive=0)  # joins part files, warms caches
            wait_empty(url)
            for _ in range(rounds):
                for model, other in (MODELS, MODELS[::-1]):
                    wait_empty(url)
                    cold[model].append(first_token_s(url, model))
                    swap[other].append(first_token_s(url, other, keep_alive=0))
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    return {model: {"cold_first_token_s": round(statistics.median(cold[model]), 3),
                    "swap_first_token_s": round(statistics.median(swap[model]), 3),
                    "swap_over_cold": round(statistics.median(swap[model])
                                            / statistics.median(cold[model]), 3)}
            for model in MODELS}


async def admission_us(queued: int, admits: int) -> float:
    """Microseconds per admit + release of a free model's request with `queued` requests
    waiting for a busy one."""
    queue = AdmissionQueue(QueueLimits(parallel=1, max_queue=queued + 1))
    busy = await queue.admit("busy", 5, None, warm=True)
    waiting = [asyncio.create_task(queue.admit("busy", p % 10, None, warm=True))
               for p in range(queued)]
    await asyncio.sleep(0)
    started = time.perf_counter()
    for _ in range(admits):
        queue.release(await queue.admit("free", 5, None, warm=True))
    took = time.perf_counter() - started
    for task in waiting:
        task.cancel()
    queue.release(busy)
    return took / admits * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", default="900MiB")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--queued", type=int, default=64)
    parser.add_argument("--admits", type=int, default=2000)
    args = parser.parse_args()
    result = {
        "budget": args.budget,
        "swaps": measure_swaps(args.budget, args.rounds),
        "queue_overhead_us": {
            "idle": round(asyncio.run(admission_us(0, args.admits)), 1),
            f"{args.queued}_queued": round(asyncio.run(admission_us(args.queued,
                                                                    args.admits)), 1)},
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
