"""KV memory: time to first token of a ~2,000-token prompt, cold and with its prefix kept in
RAM, on disk, or on another node; and the int8 KV cache against bf16.

    python bench/kv.py [--model qwen2.5-coder-0.5b-instruct] [--tokens 2000] [--threads 2]
                       [--rounds 1] [--sections ttft,fetched,int8]
                       [--cases cold,ram,disk_restart] [--kv-disk 2GiB]
                       [--fetch-rounds 3] [--contexts 1000,2000] [--new-tokens 32] [--rounds-int8 3]

Prints one JSON object with a key per section:
- ttft: the cases below on one node;
- fetched: two nodes on loopback, the prefix fetched from the other (bench/kv_fetch.py);
- int8: KV bytes per token and decode speed, int8 against bf16 (bench/kv_int8.py).

The ttft section runs a real `shoal serve --standalone` (--dtype auto unless told otherwise, a fresh data dir) and streams greedy completions over HTTP; TTFT is measured by the client, from sending
the request to the first streamed token. Each round uses its own prompt, so "cold" is cold.

Cases (functions in CASES, run in the order given; each gets the bench and the round's
prompt and returns its measurement; other cases join the same way, e.g. int8 KV or a prefix
fetched from another node):
- cold: the first time the node sees the prompt (after a warm-up request on another prompt);
- ram: the same prompt again: its full blocks come from the RAM prefix cache;
- disk_restart: the node stopped and started again (RAM empty): they come from --kv-disk.

Per case: the median TTFT over rounds, the cached prompt tokens, and its ratio to cold.
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import kv_fetch
import kv_int8

HEALTH_TIMEOUT_S = 300.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Bench:
    """One node under test (restartable on the same data dir) and the bench's options."""

    args: argparse.Namespace
    data_dir: Path
    proc: subprocess.Popen | None = None
    url: str = ""
    starts: list[float] = field(default_factory=list)

    def start(self) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        log = open(self.data_dir / "serve.log", "a")
        began = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "shoal.cli.app", "serve", "--standalone", "--port", str(port),
             "--data-dir", str(self.data_dir), "--model", self.args.model,
             "--threads", str(self.args.threads), "--dtype", self.args.dtype,
             "--kv-cache-memory", self.args.kv_cache_memory, "--kv-disk", self.args.kv_disk],
            stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + HEALTH_TIMEOUT_S
        while not self._healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = (self.data_dir / "serve.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"shoal serve did not start:\n{tail}")
            time.sleep(0.3)
        self.starts.append(time.monotonic() - began)
        self.first_token("A short warm-up request that shares nothing with the prompts.")

    def _healthy(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        """SIGTERM: the node shuts down gracefully (its disk tier writes out its queue)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def first_token(self, prompt: str) -> dict:
        """TTFT of a streamed greedy completion, with the usage the node reports."""
        body = {"model": self.args.model, "prompt": prompt, "max_tokens": 4, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        started = time.perf_counter()
        ttft, usage = None, None
        with httpx.stream("POST", self.url + "/v1/completions", json=body,
                          timeout=600) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if ttft is None and any(c.get("text") for c in event.get("choices", ())):
                    ttft = time.perf_counter() - started
                usage = event.get("usage") or usage
        if ttft is None or usage is None:
            raise RuntimeError("the stream ended without a token or usage")
        return {"ttft_s": ttft, "prompt_tokens": usage["prompt_tokens"],
                "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]}


def cold(bench: Bench, prompt: str) -> dict:
    return bench.first_token(prompt)


def ram(bench: Bench, prompt: str) -> dict:
    return bench.first_token(prompt)


def disk_restart(bench: Bench, prompt: str) -> dict:
    bench.restart()
    return bench.first_token(prompt)


CASES: dict[str, Callable[[Bench, str], dict]] = {
    "cold": cold, "ram": ram, "disk_restart": disk_restart}


def make_prompt(round_index: int, tokens: int) -> str:
    """About `tokens` tokens of plain prose, different in every round from its first word."""
    lines = [f"Round {round_index}: the ledger of the northern warehouse, line by line."]
    count = 0
    while len(" ".join(lines)) < tokens * 29 // 10:  # ~2.9 characters per token here
        count += 1
        lines.append(f"Entry {count}: crate {count * 7 % 997} of copper wire went to dock "
                     f"{count % 13}, signed by clerk number {count * 31 % 101}.")
    return "\n".join(lines) + "\nSummarise the ledger in one sentence:"


def ttft(args: argparse.Namespace) -> dict:
    names = [n.strip() for n in args.cases.split(",") if n.strip()]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        raise SystemExit(f"unknown cases {unknown}; choose from {sorted(CASES)}")
    results: dict[str, list[dict]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory(prefix="shoal-bench-kv-") as directory:
        bench = Bench(args, Path(directory))
        bench.start()
        try:
            for round_index in range(args.rounds):
                prompt = make_prompt(round_index, args.tokens)
                for name in names:
                    results[name].append(CASES[name](bench, prompt))
        finally:
            bench.stop()
        disk_bytes = sum(p.stat().st_size for p in Path(directory, "kv").rglob("*.kv"))
    report: dict = {"rounds": args.rounds, "node_start_s": [round(s, 2) for s in bench.starts],
                    "kv_disk_bytes": disk_bytes, "cases": {}}
    for name, runs in results.items():
        report["cases"][name] = {
            "ttft_s": round(statistics.median(r["ttft_s"] for r in runs), 4),
            "ttft_runs_s": [round(r["ttft_s"], 4) for r in runs],
            "prompt_tokens": runs[0]["prompt_tokens"],
            "cached_tokens": runs[0]["cached_tokens"]}
    if "cold" in report["cases"]:
        base = report["cases"]["cold"]["ttft_s"]
        for case in report["cases"].values():
            case["vs_cold"] = round(case["ttft_s"] / base, 4)
    return report


SECTIONS: dict[str, Callable[[argparse.Namespace], dict]] = {
    "ttft": ttft,
    "fetched": lambda args: kv_fetch.measure(args.model, args.tokens, args.fetch_rounds,
                                             args.dtype, args.threads),
    "int8": lambda args: kv_int8.measure(args.model, [int(c) for c in args.contexts.split(",")],
                                         args.new_tokens, args.rounds_int8, args.threads),
}


def run(args: argparse.Namespace) -> dict:
    names = [n.strip() for n in args.sections.split(",") if n.strip()]
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        raise SystemExit(f"unknown sections {unknown}; choose from {sorted(SECTIONS)}")
    report: dict = {"model": args.model, "dtype": args.dtype, "threads": args.threads}
    for name in names:
        report[name] = SECTIONS[name](args)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--tokens", type=int, default=2000, help="prompt length, about")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"))
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--kv-cache-memory", default="512MiB")
    parser.add_argument("--kv-disk", default="2GiB")
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--fetch-rounds", type=int, default=3)
    parser.add_argument("--contexts", default="1000,2000", help="int8: context lengths")
    parser.add_argument("--new-tokens", type=int, default=32, help="int8: tokens decoded")
    parser.add_argument("--rounds-int8", type=int, default=3)
    print(json.dumps(run(parser.parse_args()), indent=2))


if __name__ == "__main__":
    main()
