"""Guesses from a proposer on another node (over loopback) against plain decoding.

    python bench/remote_speculative.py [--model qwen2.5-coder-1.5b-instruct] [--threads 2]
                                       [--rounds 3] [--max-tokens 200] [--num-drafts 10]
                                       [--source ngram|draft:MODEL] [--cases chat,...]

Prints JSON. Two `shoal serve` processes dial each other on 127.0.0.1: the verifier serves
the model with --speculative MODEL=remote:K, the proposer offers --propose-for MODEL=SOURCE
(--source: n-gram guesses, or a draft model's, from the context the verifier streams to it). For each case of
bench/speculative.py a greedy streamed request runs on the verifier with guessing off, with
the remote proposer (the model's setting) and with local n-gram guessing (x_speculative
"ngram"), turn about for `rounds` rounds; each side's median decode tokens/s (first token
to last) is taken, and the remote side's ratio to plain reported, with the guesses made and
kept and whether every side produced the same text.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx
from cluster import cluster_view, start_nodes, stop_nodes, wait_agreed
from speculative import CASES


def wait_until(check, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not reached within {timeout_s:.0f} s")
        time.sleep(0.2)


def streamed(url: str, model: str, text: str, max_tokens: int, speculative: str | None
             ) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": text}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    if speculative is not None:
        body["x_speculative"] = speculative
    parts, usage, first, last = [], {}, None, None
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[len("data: "):])
            usage = event.get("usage") or usage
            for choice in event.get("choices", ()):
                if choice["delta"].get("content"):
                    parts.append(choice["delta"]["content"])
                    first = first or time.perf_counter()
                    last = time.perf_counter()
    tokens = usage.get("completion_tokens", 0)
    decode_s = (last - first) if first and last else 0.0
    guesses = usage.get("x_speculative", {})
    return {"text": "".join(parts), "tokens": tokens,
            "tokens_per_s": (tokens - 1) / decode_s if decode_s else 0.0,
            "proposed": guesses.get("proposed_tokens", 0),
            "accepted": guesses.get("accepted_tokens", 0)}


def bench(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as root:
        nodes = start_nodes(Path(root), 2, threads=args.threads, extra={
            0: ["--force-master", "--speculative", f"{args.model}=remote:{args.num_drafts}"],
            1: ["--propose-for", f"{args.model}={args.source}"]})
        urls = [url for _, url in nodes]
        try:
            wait_agreed(urls, 2, 60)
            verifier, proposer = urls
            proposer_id = cluster_view(proposer)["node_id"]
            wait_until(lambda: proposer_id in {c["node_id"] for c in
                                               httpx.get(verifier + "/cluster/cards").json()[
                                                   "cards"]}, 30, "the proposer's card")
            placed = httpx.post(verifier + "/instances", timeout=60, json={
                "model": args.model, "excluded_nodes": [proposer_id]})
            placed.raise_for_status()
            wait_until(lambda: [i["status"] for i in cluster_view(verifier)["instances"]]
                       == ["ready"], 600, "the model ready on the verifier")
            return run_cases(verifier, args)
        finally:
            stop_nodes(nodes)


def run_cases(url: str, args: argparse.Namespace) -> dict:
    sides = {"plain": "off", "remote": None, "ngram": "ngram"}
    results = {}
    for name in args.cases.split(","):
        text = CASES[name]
        streamed(url, args.model, text, 8, "off")  # warm-up (and the prompt's prefix cached)
        runs: dict[str, list[dict]] = {side: [] for side in sides}
        for round_index in range(args.rounds):
            order = list(sides) if round_index % 2 == 0 else list(reversed(sides))
            for side in order:
                runs[side].append(streamed(url, args.model, text, args.max_tokens, sides[side]))
        medians = {side: statistics.median(r["tokens_per_s"] for r in runs[side])
                   for side in sides}
        results[name] = {
            "generated_tokens": runs["plain"][0]["tokens"],
            **{f"{side}_tokens_per_s": round(medians[side], 2) for side in sides},
            "remote_speedup": round(medians["remote"] / medians["plain"], 3),
            "ngram_speedup": round(medians["ngram"] / medians["plain"], 3),
            "remote_proposed": runs["remote"][0]["proposed"],
            "remote_accepted": runs["remote"][0]["accepted"],
            "same_text": len({r["text"] for side in runs for r in runs[side]}) == 1,
            "rounds": {side: [round(r["tokens_per_s"], 2) for r in runs[side]]
                       for side in runs},
        }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--num-drafts", type=int, default=10)
    parser.add_argument("--source", default="ngram",
                        help="the proposer's source: ngram, or draft:MODEL")
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args()
    print(json.dumps({"model": args.model, "threads": args.threads, "batch": 1,
                      "proposer": f"another node over loopback ({args.source})",
                      "cases": bench(args)}, indent=2))


if __name__ == "__main__":
    main()
