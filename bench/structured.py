"""Cost of grammar-constrained decoding on the built-in model; prints one JSON object.

    python bench/structured.py [--threads 2] [--rounds 3]

In-process engine, greedy decode. Reports ms per generated token for free text and for JSON
constrained by a schema, at batch 1 and batch 8 (half constrained), the time spent computing
the masks themselves (llguidance plus unpacking) per constrained token, and the one-off cost
of building the grammar engine's view of the vocabulary.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from shoal.catalog.resolve import DEFAULT_MODEL_ID, resolve_model
from shoal.engine.config import EngineConfig
from shoal.engine.engine import Engine
from shoal.engine.grammar_spec import GrammarSpec
from shoal.engine.sampling import SamplingParams

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 60},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "city": {"type": "string", "maxLength": 60},
                         "hobbies": {"type": "array", "items": {"type": "string",
                                                                "maxLength": 30},
                                     "maxItems": 4}},
          "required": ["name", "age", "city", "hobbies"], "additionalProperties": False}
PROMPT = "Describe a person, their city and their hobbies as JSON."


class MaskTimer:
    """Wraps the engine's mask computation and adds up its wall time."""

    def __init__(self, engine: Engine) -> None:
        self.seconds = 0.0
        self.rows = 0
        inner = engine.grammars.allowed_tokens

        def timed(constraints):
            start = time.perf_counter()
            result = inner(constraints)
            self.seconds += time.perf_counter() - start
            self.rows += len(constraints)
            return result

        engine.grammars.allowed_tokens = timed


def decode(engine: Engine, ids: list[int], constrained: list[bool], max_tokens: int) -> float:
    """ms per generated token over the decode steps (the prefill step is not counted)."""
    for index, grammar_on in enumerate(constrained):
        engine.add_request(f"r{time.monotonic_ns()}-{index}", ids,
                           SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                          ignore_eos=not grammar_on),
                           grammar=GrammarSpec(json_schema=SCHEMA) if grammar_on else None)
    engine.step()  # prefill (and the first token) for every request
    tokens, start = 0, time.perf_counter()
    while engine.has_unfinished_requests():
        tokens += sum(len(out.token_ids) for out in engine.step())
    return (time.perf_counter() - start) * 1000 / max(tokens, 1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engine = Engine(EngineConfig(source=resolve_model(DEFAULT_MODEL_ID),
                                 kv_cache_bytes=128 * 2**20))
    ids = engine.tokenizer.encode(engine.render_chat([{"role": "user", "content": PROMPT}]))
    start = time.perf_counter()
    _ = engine.grammars.tokenizer
    vocabulary_s = time.perf_counter() - start
    timer = MaskTimer(engine)
    cases = {"free_batch1": [False], "json_batch1": [True],
             "free_batch8": [False] * 8, "mixed_batch8": [True, False] * 4}
    results: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, constrained in cases.items():
            results[name].append(decode(engine, ids, constrained, max_tokens=48))
    report = {f"{name}_ms_per_token": round(statistics.median(values), 2)
              for name, values in results.items()}
    report["mask_ms_per_constrained_token"] = round(timer.seconds * 1000 / max(timer.rows, 1), 4)
    report["grammar_vocabulary_build_s"] = round(vocabulary_s, 3)
    report["threads"] = args.threads
    print(json.dumps(report))


if __name__ == "__main__":
    main()
