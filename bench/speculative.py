"""Speculative decoding against plain decoding: batch-1 tokens/s, one engine, one run.

    python bench/speculative.py [--model qwen2.5-coder-1.5b-instruct] [--threads 2]
                                [--rounds 3] [--max-tokens 200]

Prints JSON. For each case, a greedy request runs with guessing off, with n-gram guessing
and with the draft model guessing (the x_speculative choice, so all use the same loaded
weights), turn about for `rounds` rounds, since this host's speed drifts within minutes; each side's median tokens/s is taken
and their ratio reported, with how many guesses were made and kept. The outputs of the two
sides are compared token for token (greedy decoding must not change).

Cases:
- code_edit: a function given in the prompt, rewritten with a small change (guesses right);
- chat: a free answer (guesses rarely made, sometimes wrong);
- misleading: a prompt full of repeated phrases whose answer repeats none of them (guesses
  made often and mostly wrong: what guessing costs when it fails).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from shoal.catalog.resolve import resolve_model
from shoal.engine.config import EngineConfig
from shoal.engine.engine import Engine
from shoal.engine.sampling import SamplingParams

FUNCTION = '''def moving_average(values, window):
    """Average of each run of `window` consecutive values."""
    if window <= 0:
        raise ValueError("window must be positive")
    result = []
    total = 0.0
    for index, value in enumerate(values):
        total += value
        if index >= window:
            total -= values[index - window]
        if index >= window - 1:
            result.append(total / window)
    return result


def summarize(values):
    """Count, mean, smallest and largest of values."""
    if not values:
        return {"count": 0}
    return {
        "count": len(values),
        "mean": sum(values) / len(values),
        "min": min(values),
        "max": max(values),
    }
'''
CASES = {
    "code_edit": "In the code below, rename moving_average to rolling_mean everywhere and "
                 "change nothing else. Reply with the whole code only.\n\n" + FUNCTION,
    "chat": "Explain to a new programmer why version control matters, in a few paragraphs.",
    "misleading": "the cat sat on the mat and the dog sat on the log and the cat sat on the "
                  "log and the dog sat on the mat. " * 12
                  + "\n\nIgnore the text above. Write a short poem about mountains at dawn.",
}


def run_one(engine: Engine, ids: list[int], params: SamplingParams, tag: str) -> dict:
    engine.add_request(tag, ids, params)
    tokens: list[int] = []
    last = None
    first = None
    started = time.perf_counter()
    while engine.has_unfinished_requests():
        for output in engine.step():
            if first is None and output.token_ids:
                first = time.perf_counter()  # decode speed is timed from the first token
            tokens.extend(output.token_ids)
            last = output
    ended = time.perf_counter()
    decode_s = ended - (first or started)
    return {"tokens": tokens, "tokens_per_s": (len(tokens) - 1) / decode_s if decode_s else 0.0,
            "proposed": last.draft_tokens, "accepted": last.accepted_draft_tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct",
                        help="the draft model ('' for n-gram guessing only)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--num-drafts", type=int, default=None,
                        help="most tokens guessed per step (default: the engine's)")
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args()
    from shoal.engine.speculation import speculator
    from shoal.engine.speculation.config import DEFAULT_NUM_DRAFTS, SpeculativeConfig
    most = args.num_drafts or DEFAULT_NUM_DRAFTS
    speculative = SpeculativeConfig("draft", most, args.draft) if args.draft else None
    engine = Engine(EngineConfig(source=resolve_model(args.model), threads=args.threads,
                                 kv_cache_bytes=256 * 2**20, enable_prefix_caching=False,
                                 speculative=speculative))
    speculator.NGRAM = SpeculativeConfig("ngram", most)
    guessers = ["ngram", "draft"] if args.draft else ["ngram"]
    results = {}
    counter = 0
    for name in args.cases.split(","):
        ids = engine.tokenizer.encode(engine.render_chat(
            [{"role": "user", "content": CASES[name]}]), add_special_tokens=False)
        sides = {side: SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                                      speculative=side) for side in ["off"] + guessers}
        runs: dict[str, list[dict]] = {side: [] for side in sides}
        for side in sides:  # warm each path (and the draft's KV pages) once
            run_one(engine, ids[:32], sides[side], f"warm-{name}-{side}")
        for round_index in range(args.rounds):
            order = list(sides) if round_index % 2 == 0 else list(reversed(sides))
            for side in order:
                counter += 1
                runs[side].append(run_one(engine, ids, sides[side], f"{side}-{counter}"))
        speed = {side: statistics.median(r["tokens_per_s"] for r in runs[side])
                 for side in sides}
        results[name] = {
            "prompt_tokens": len(ids),
            "generated_tokens": len(runs["off"][0]["tokens"]),
            "plain_tokens_per_s": round(speed["off"], 2),
            **{f"{side}_tokens_per_s": round(speed[side], 2) for side in guessers},
            **{f"{side}_speedup": round(speed[side] / speed["off"], 3) for side in guessers},
            **{f"{side}_proposed_accepted": [runs[side][-1]["proposed"],
                                             runs[side][-1]["accepted"]] for side in guessers},
            "same_tokens": all(r["tokens"] == runs["off"][0]["tokens"]
                               for side in runs for r in runs[side]),
            "rounds": {side: [round(r["tokens_per_s"], 2) for r in runs[side]]
                       for side in runs},
        }
    print(json.dumps({"model": args.model, "draft": args.draft or None,
                      "threads": args.threads, "batch": 1, "cases": results}, indent=2))


if __name__ == "__main__":
    main()
