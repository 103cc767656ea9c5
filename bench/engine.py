"""Engine and server speed on one model (the built-in one by default); prints one JSON object.

    python bench/engine.py [--model ID] [--threads 2] [--peer llama-cpp] [--rounds 3] [--skip-http]

Measures, in one run: prefill tokens/s, batch-1 decode tokens/s (engine in-process),
aggregate decode tokens/s with 1, 4 and 16 concurrent streams through the HTTP API, time to
first token p50/p95, time to first token for a prompt whose first 1,000 tokens were seen
before versus cold, and memory: the weights the model holds against its file, and the
serving runner's RSS, KV in use and the runtime floor (RSS - weights - KV). With --peer
llama-cpp the same GGUF and prompts run through llama-cpp-python and ratios are reported.

The peer is llama-cpp-python built from source for this CPU by bench/install_peer.sh (`make
install-bench`), which mends the one line of llama.cpp's AMX path that GCC 12 miscompiles, and
runs in a process of its own.

This machine's speed drifts by ~30% within a minute, so the prefill and batch-1 decode
comparisons (turn about with the peer) and the HTTP stream counts run --rounds turns each
and report medians (every turn a fresh prompt: a repeated one would hit the prefix cache).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import resource
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

from shoal.catalog.resolve import DEFAULT_MODEL_ID, resolve_model
from shoal.engine.config import EngineConfig
from shoal.engine.engine import Engine
from shoal.engine.sampling import SamplingParams

WORDS = ("river stone market lantern orchard signal harbor meadow copper violin thunder "
         "garden compass mirror velvet canyon ember glacier quartz meadow").split()


def synthetic_text(num_words: int, salt: int = 0) -> str:
    """Words in an order set by salt, led by the salt itself: distinct salts never share a
    first block, so no prompt of the run hits the prefix cache by chance."""
    words = (WORDS[(i * 7 + salt) % len(WORDS)] for i in range(num_words - 1))
    return " ".join((f"{salt}.", *words))


def prompt_of_tokens(engine: Engine, num_tokens: int, salt: int = 0) -> list[int]:
    ids = engine.tokenizer.encode(synthetic_text(num_tokens * 2, salt), add_special_tokens=False)
    return ids[:num_tokens]


def run_to_end(engine: Engine, prompts: list[list[int]], max_tokens: int) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(f"b{time.monotonic_ns()}-{i}", ids, params)
    first_token_at = None
    start = time.perf_counter()
    generated = 0
    decode_steps: list[float] = []  # seconds of each step after every request's first token
    while engine.has_unfinished_requests():
        step_start = time.perf_counter()
        outputs = engine.step()
        if sum(len(out.token_ids) for out in outputs) == len(prompts):
            decode_steps.append(time.perf_counter() - step_start)
        for out in outputs:
            generated += len(out.token_ids)
            if first_token_at is None and out.token_ids:
                first_token_at = time.perf_counter()
    end = time.perf_counter()
    return {"seconds": end - start, "ttft": (first_token_at or end) - start,
            "generated": generated, "decode_steps": decode_steps}


def step_ms(steps: list[float]) -> dict:
    """Median and 10th percentile of step times, in ms (the machine's noise hits the median)."""
    ordered = sorted(steps) or [0.0]
    return {"median": 1e3 * statistics.median(ordered),
            "p10": 1e3 * ordered[len(ordered) // 10]}


PREFILL_TOKENS = 500


def prefill_tokens_per_s(engine: Engine, salt: int) -> float:
    """A fresh 500-token prompt (its own words: no prefix-cache hit) up to its first token."""
    return PREFILL_TOKENS / run_to_end(engine, [prompt_of_tokens(engine, PREFILL_TOKENS,
                                                                 salt=salt)], 1)["ttft"]


def decode_tokens_per_s(engine: Engine) -> tuple[float, list[float]]:
    """Batch-1 greedy decode of 128 tokens after a 200-token prompt: (tokens/s, step times)."""
    decode = run_to_end(engine, [prompt_of_tokens(engine, 200, salt=2)], 129)
    return (decode["generated"] - 1) / (decode["seconds"] - decode["ttft"]), decode["decode_steps"]


def bench_engine(model: str, threads: int) -> tuple[dict, Engine]:
    engine = Engine(EngineConfig(source=resolve_model(model), threads=threads,
                                 max_num_batched_tokens=2048))
    run_to_end(engine, [prompt_of_tokens(engine, 64, salt=99)], 8)  # warm-up
    prefill_each = [prefill_tokens_per_s(engine, salt) for salt in (30, 31, 32)]
    decode_tps, decode_steps = decode_tokens_per_s(engine)
    batch = run_to_end(engine, [prompt_of_tokens(engine, 50, salt=10 + i) for i in range(16)], 64)
    return {
        "prefill_tokens": PREFILL_TOKENS,
        "prefill_tokens_per_s": statistics.median(prefill_each),
        "prefill_each_turn": prefill_each,
        "decode_batch1_tokens_per_s": decode_tps,
        # 16 requests of 50-token prompts, 64 tokens each, prefill included.
        "batch16_tokens_per_s": batch["generated"] / batch["seconds"],
        # Steps in which every request decoded one token.
        "decode_batch1_step_ms": step_ms(decode_steps),
        "decode_batch16_step_ms": step_ms(batch["decode_steps"]),
        "compute_dtype": str(engine.loaded.compute_dtype),
    }, engine


# ---- HTTP -----------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, threads: int, port: int, data_dir: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "shoal.cli.app", "serve", "--standalone", "--port", str(port),
           "--model", model, "--threads", str(threads), "--data-dir", str(data_dir)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError("shoal serve exited during start-up")
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("shoal serve did not become healthy within 180 s")


async def stream_one(client: httpx.AsyncClient, url: str, model: str, prompt: str,
                     max_tokens: int) -> tuple[float, int, float]:
    """Returns (ttft seconds, completion tokens, total seconds) for one streamed completion."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    start = time.perf_counter()
    ttft, tokens = None, 0
    async with client.stream("POST", url, json=body, timeout=600) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if ttft is None and event.get("choices") and event["choices"][0].get("text"):
                ttft = time.perf_counter() - start
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    return ttft or 0.0, tokens, time.perf_counter() - start


async def concurrent_streams(base: str, model: str, streams: int, max_tokens: int,
                             turn: int = 0) -> dict:
    """streams completions at once, each on a prompt no earlier turn has sent (so the prefix
    cache never shortens the prefill)."""
    url = f"{base}/v1/completions"
    async with httpx.AsyncClient() as client:
        start = time.perf_counter()
        results = await asyncio.gather(*[
            stream_one(client, url, model, f"Story {turn}-{i}: " + synthetic_text(40, i),
                       max_tokens)
            for i in range(streams)])
        elapsed = time.perf_counter() - start
    ttfts = sorted(r[0] for r in results)
    return {"aggregate_tokens_per_s": sum(r[1] for r in results) / elapsed,
            "ttft_p50_s": statistics.median(ttfts),
            "ttft_p95_s": ttfts[min(len(ttfts) - 1, int(0.95 * len(ttfts)))]}


def concurrency_turns(base: str, model: str, rounds: int) -> list[dict]:
    """1, 4 and 16 streams of 64 tokens, taken in turn rounds times; the median of each
    figure per stream count (every turn is on fresh prompts)."""
    runs: dict[int, list[dict]] = {n: [] for n in (1, 4, 16)}
    for turn in range(rounds):
        for streams, results in runs.items():
            results.append(asyncio.run(concurrent_streams(base, model, streams, 64,
                                                          turn * 100 + streams)))
    return [{"streams": streams, "rounds": rounds,
             **{key: statistics.median(r[key] for r in results) for key in results[0]},
             "aggregate_each_round": [r["aggregate_tokens_per_s"] for r in results]}
            for streams, results in runs.items()]


async def prefix_cache_ttft(base: str, model: str) -> dict:
    url = f"{base}/v1/completions"
    shared = synthetic_text(700, 5)  # ~1,000+ tokens
    async with httpx.AsyncClient() as client:
        cold, _, _ = await stream_one(client, url, model, shared + " Question one?", 1)
        warm, _, _ = await stream_one(client, url, model, shared + " Question two?", 1)
    return {"cold_ttft_s": cold, "cached_prefix_ttft_s": warm, "warm_over_cold": warm / cold}


def process_tree_rss(proc: subprocess.Popen) -> int:
    root = psutil.Process(proc.pid)
    return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])


def runner_memory(base: str, proc: subprocess.Popen) -> dict:
    """The model's runner as /api/ps reports it (weights, KV held: blocks in use plus those
    kept for the prefix cache) with its RSS measured here."""
    held = httpx.get(f"{base}/api/ps", timeout=10).json()["models"][0].get("shoal", {})
    runners = [p for p in psutil.Process(proc.pid).children(recursive=True)
               if "shoal.runner" in " ".join(p.cmdline())]
    kv_held = (held.get("kv_bytes_in_use") or 0) + (held.get("kv_bytes_cached") or 0)
    return {"weights_bytes": held.get("weights_bytes") or 0, "kv_held_bytes": kv_held,
            "runner_rss_bytes": sum(p.memory_info().rss for p in runners)}


def memory_rule(file_bytes: int, at_load: dict, after: dict) -> dict:
    """The floor is the fresh runner's RSS beyond its weights (Python, torch, the tokenizer,
    the kernels); after the workload, RSS <= 1.2 x file + KV held + floor must hold."""
    floor = at_load["runner_rss_bytes"] - at_load["weights_bytes"] - at_load["kv_held_bytes"]
    allowed = 1.2 * file_bytes + after["kv_held_bytes"] + floor
    return {"file_bytes": file_bytes, "weights_over_file": after["weights_bytes"] / file_bytes,
            "floor_bytes": floor, "at_load": at_load, "after_workload": after,
            "allowed_rss_bytes": int(allowed),
            "rss_within_rule": after["runner_rss_bytes"] <= allowed}


def bench_http(model: str, threads: int, rounds: int) -> dict:
    import tempfile

    port = free_port()
    file_bytes = resolve_model(model).path.stat().st_size
    with tempfile.TemporaryDirectory() as data_dir:
        proc = start_server(model, threads, port, Path(data_dir))
        base = f"http://127.0.0.1:{port}"
        try:
            at_load = runner_memory(base, proc)
            out = {"concurrency": concurrency_turns(base, model, rounds),
                   "prefix_cache": asyncio.run(prefix_cache_ttft(base, model)),
                   "server_rss_bytes": process_tree_rss(proc)}
            time.sleep(3)  # the runner reports its memory every 2 s
            out["memory"] = memory_rule(file_bytes, at_load, runner_memory(base, proc))
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    return out


# ---- the peer -------------------------------------------------------------------------------

class LlamaCppPeer:
    """llama-cpp-python on the same GGUF file, prompts built from the same text, in a process
    of its own (as a llama.cpp server would be): ggml and torch both run on OpenMP's thread
    pool, and in one process each one's AMX tile state is the other's to clobber. Timings are
    taken inside that process."""

    def __init__(self, model: str, threads: int) -> None:
        path = str(resolve_model(model).path)
        context = multiprocessing.get_context("spawn")
        self._pipe, child = context.Pipe()
        self._process = context.Process(target=_peer_process, args=(child, path, threads),
                                        daemon=True)
        self._process.start()
        self._call("ready")

    def _call(self, method: str, *args):
        self._pipe.send((method, args))
        if not self._pipe.poll(PEER_TIMEOUT_S):
            raise TimeoutError(f"llama.cpp peer: no answer to {method} in {PEER_TIMEOUT_S} s")
        ok, value = self._pipe.recv()
        if not ok:
            raise RuntimeError(f"llama.cpp peer: {value}")
        return value

    def prefill_tokens_per_s(self, salt: int) -> float:
        return self._call("prefill_tokens_per_s", salt)

    def decode_tokens_per_s(self, sample: bool) -> float:
        return self._call("decode_tokens_per_s", sample)

    def close(self) -> None:
        self._pipe.send(("stop", ()))
        self._process.join(30)
        if self._process.is_alive():
            self._process.kill()


PEER_TIMEOUT_S = 600


def _peer_process(pipe, path: str, threads: int) -> None:
    """The peer's process: answers (method, args) from the pipe with (ok, value)."""
    from llama_cpp import Llama

    llm = Llama(model_path=path, n_ctx=2048, n_threads=threads, n_threads_batch=threads,
                n_batch=512, verbose=False)

    def prefill_tokens_per_s(salt: int) -> float:
        prompt = llm.tokenize(synthetic_text(1000, salt).encode(), add_bos=False)[:PREFILL_TOKENS]
        llm.reset()
        start = time.perf_counter()
        llm.eval(prompt)
        return len(prompt) / (time.perf_counter() - start)

    def decode_tokens_per_s(sample: bool) -> float:
        """128 tokens after a 200-token prompt. sample=False times llama.cpp's forward alone
        (feeding back the same token): the C engine's speed without llama-cpp-python's
        per-token sampling call, which its users do pay."""
        llm.reset()
        llm.eval(llm.tokenize(synthetic_text(400, 2).encode(), add_bos=False)[:200])
        token = llm.sample(temp=0.0)
        start = time.perf_counter()
        for _ in range(128):
            llm.eval([token])
            if sample:
                token = llm.sample(temp=0.0)
        return 128 / (time.perf_counter() - start)

    methods = {"ready": lambda: True, "prefill_tokens_per_s": prefill_tokens_per_s,
               "decode_tokens_per_s": decode_tokens_per_s}
    while True:
        method, args = pipe.recv()
        if method == "stop":
            return
        try:
            pipe.send((True, methods[method](*args)))
        except Exception as error:  # the bench reports it and stops
            pipe.send((False, f"{type(error).__name__}: {error}"))


def interleaved_turns(engine: Engine, peer: LlamaCppPeer, rounds: int) -> dict:
    """Median 500-token prefill and batch-1 decode tokens/s of shoal and the peer, measured
    turn about: this machine's speed drifts by ~30% within a minute, and alternating keeps
    both sides under the same drift. Each prefill turn is a fresh prompt."""
    ours, peer_forward, peer_sampled, our_prefill, peer_prefill = [], [], [], [], []
    for turn in range(rounds):
        our_prefill.append(prefill_tokens_per_s(engine, salt=40 + turn))
        peer_prefill.append(peer.prefill_tokens_per_s(salt=40 + turn))
        ours.append(decode_tokens_per_s(engine)[0])
        peer_forward.append(peer.decode_tokens_per_s(sample=False))
        peer_sampled.append(peer.decode_tokens_per_s(sample=True))
    return {"prefill": {"rounds": rounds,
                        "shoal_tokens_per_s": statistics.median(our_prefill),
                        "peer_tokens_per_s": statistics.median(peer_prefill)},
            "decode": {"rounds": rounds,
                       "shoal_tokens_per_s": statistics.median(ours),
                       "peer_forward_tokens_per_s": statistics.median(peer_forward),
                       "peer_sampled_tokens_per_s": statistics.median(peer_sampled)}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL_ID)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--peer", choices=["llama-cpp"], default=None)
    parser.add_argument("--skip-http", action="store_true")
    parser.add_argument("--rounds", type=int, default=3,
                        help="turns of shoal / peer batch-1 decode, alternating, and of "
                             "the HTTP stream counts")
    args = parser.parse_args()

    engine_result, engine = bench_engine(args.model, args.threads)
    result: dict = {"model": args.model, "threads": args.threads,
                    "packed_backend": engine.loaded.module.plan.backend.describe(),
                    "weight_bytes": engine.loaded.weight_bytes, "engine": engine_result}
    # ru_maxrss is KiB on Linux: the peak of this process, which held the engine.
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result["engine_process_peak_rss_bytes"] = peak_kib * 1024
    if args.peer == "llama-cpp":
        peer = LlamaCppPeer(args.model, args.threads)
        result["peer_llama_cpp"] = interleaved_turns(engine, peer, args.rounds)
        peer.close()
    del engine
    if not args.skip_http:
        result["http"] = bench_http(args.model, args.threads, args.rounds)
    if "peer_llama_cpp" in result:
        peer_result = result["peer_llama_cpp"]
        decode = peer_result["decode"]
        # Ratios against llama.cpp's forward alone: the stricter comparison.
        peer_decode = decode["peer_forward_tokens_per_s"]
        ratios = {
            "decode_batch1": decode["shoal_tokens_per_s"] / peer_decode,
            "decode_batch1_vs_peer_with_python_sampling":
                decode["shoal_tokens_per_s"] / decode["peer_sampled_tokens_per_s"],
            "prefill": (peer_result["prefill"]["shoal_tokens_per_s"]
                        / peer_result["prefill"]["peer_tokens_per_s"]),
        }
        if "http" in result:
            agg16 = result["http"]["concurrency"][-1]["aggregate_tokens_per_s"]
            ratios["aggregate16_over_peer_decode_batch1"] = agg16 / peer_decode
        result["ratios"] = ratios
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
