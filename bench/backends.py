"""shoal's llama-server runner against the same llama-server called directly; prints JSON.

    python bench/backends.py [--llama-server PATH] [--model ID] [--tokens 128]
                             [--concurrent 16] [--threads N] [--repeats 3]

Both sides run the same binary (default: the one tests/llama_server_build.py cached) on the
same GGUF with the same context, slots and threads, one after the other: first llama-server
alone, sent the very body shoal's runner sends, then a `shoal serve --standalone` node that
serves the model through it (--backend MODEL=llama-server). For each it measures, streaming a greedy completion of
--tokens tokens with EOS ignored:
- ttft_s: time to the first token (median of --repeats);
- decode_tokens_per_s: tokens after the first over the time after it (median);
- concurrent: --concurrent such streams at once, generated tokens per second in all.
"shoal_vs_direct" is shoal's over llama-server's for each figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from llama_server_build import cached_binary  # noqa: E402

from shoal.catalog.resolve import resolve_model  # noqa: E402
from shoal.engine.sampling import SamplingParams  # noqa: E402
from shoal.protocol import GenerationRequest  # noqa: E402
from shoal.runner.llama_server.request_body import to_llama_server  # noqa: E402
from shoal.runner.llama_server.launch import (  # noqa: E402
    LaunchSettings,
    free_port,
    launch_command,
)

PROMPT = "Write a long story about a lighthouse keeper and the sea."
CONTEXT = 8192


async def stream_once(client: httpx.AsyncClient, url: str, body: dict) -> tuple[float, float, int]:
    """(seconds to the first token, seconds from it to the last, tokens) of one stream."""
    start = time.perf_counter()
    first = last = None
    tokens = 0
    async with client.stream("POST", url, json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            text = event.get("content")
            if text is None:  # OpenAI's completion chunk
                choices = event.get("choices") or [{}]
                text = choices[0].get("text")
            if text:
                now = time.perf_counter()
                first = first if first is not None else now
                last = now
                tokens += 1
    if first is None or last is None:
        raise RuntimeError(f"{url} streamed no token")
    return first - start, last - first, tokens


async def measure(url: str, body: dict, repeats: int, concurrent: int) -> dict:
    async with httpx.AsyncClient(timeout=600) as client:
        await stream_once(client, url, {**body, "max_tokens": 4, "n_predict": 4})  # warm
        runs = [await stream_once(client, url, body) for _ in range(repeats)]
        started = time.perf_counter()
        together = await asyncio.gather(*(stream_once(client, url, body)
                                          for _ in range(concurrent)))
        elapsed = time.perf_counter() - started
    return {
        "ttft_s": round(statistics.median(r[0] for r in runs), 4),
        "decode_tokens_per_s": round(statistics.median((r[2] - 1) / r[1] for r in runs), 2),
        "concurrent": {"streams": concurrent,
                       "tokens_per_s": round(sum(r[2] for r in together) / elapsed, 2),
                       "ttft_s_median": round(statistics.median(r[0] for r in together), 4)},
    }


def wait_healthy(url: str, process: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{url}: the process exited with {process.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} was not healthy within {timeout_s:.0f} s")


def run_direct(args: argparse.Namespace, binary: Path, model_path: Path) -> dict:
    port = free_port()
    settings = LaunchSettings(binary=binary, slots=args.concurrent, context=CONTEXT,
                              threads=args.threads)
    process = subprocess.Popen(launch_command(settings, args.model, model_path, port),
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, process)
        # The very body shoal's runner sends for the same request (llama-server streams
        # far slower without return_progress: its first write then waits on the socket).
        call = to_llama_server(GenerationRequest(
            request_id="bench", model=args.model, prompt=PROMPT,
            sampling=SamplingParams(temperature=0.0, max_tokens=args.tokens,
                                    ignore_eos=True)))
        return asyncio.run(measure(url + call.path, call.body, args.repeats,
                                   args.concurrent))
    finally:
        process.terminate()
        process.wait(30)


def run_shoal(args: argparse.Namespace, binary: Path) -> dict:
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="shoal-bench-backends-") as data_dir:
        command = [sys.executable, "-m", "shoal.cli.app", "serve", "--standalone",
                   "--port", str(port), "--data-dir", data_dir, "--model", args.model,
                   "--llama-server", str(binary), "--backend", f"{args.model}=llama-server",
                   "--parallel", str(args.concurrent)]
        if args.threads is not None:
            command += ["--threads", str(args.threads)]
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL,
                                   env={**os.environ, "SHOAL_MAX_MODEL_LEN": str(CONTEXT)})
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(url, process)
            body = {"model": args.model, "prompt": PROMPT, "max_tokens": args.tokens,
                    "temperature": 0, "ignore_eos": True, "stream": True}
            return asyncio.run(measure(url + "/v1/completions", body, args.repeats,
                                       args.concurrent))
        finally:
            process.terminate()
            process.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-server", type=Path, default=None)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--concurrent", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    binary = args.llama_server or cached_binary()
    if binary is None:
        sys.exit("no llama-server: pass --llama-server or run tests/llama_server_build.py")
    model_path = resolve_model(args.model).path
    direct = run_direct(args, binary, model_path)
    shoal = run_shoal(args, binary)

    def ratio(ours: float, theirs: float) -> float:
        return round(ours / theirs, 3) if theirs else 0.0

    print(json.dumps({
        "model": args.model, "tokens": args.tokens, "binary": str(binary),
        "direct": direct, "shoal": shoal,
        "shoal_vs_direct": {
            "ttft": ratio(shoal["ttft_s"], direct["ttft_s"]),
            "decode_tokens_per_s": ratio(shoal["decode_tokens_per_s"],
                                         direct["decode_tokens_per_s"]),
            "concurrent_tokens_per_s": ratio(shoal["concurrent"]["tokens_per_s"],
                                             direct["concurrent"]["tokens_per_s"])},
    }, indent=2))


if __name__ == "__main__":
    main()
