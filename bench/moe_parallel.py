"""A mixture-of-experts model on one node versus two ranks on loopback, split by experts and
by layers (a pipeline); prints JSON.

    python bench/moe_parallel.py --model PATH.gguf [--dtype auto] [--tokens 64]
                                 [--prompt 200] [--rounds 5]
    python bench/moe_parallel.py --synthetic DIR   # builds a small qwen3moe GGUF in DIR first

Each rank is its own process pinned to one core with one torch thread, as two one-core
machines would be; "one node" is one such core. For each configuration: batch-1 decode
tokens/s, prefill tokens/s of a --prompt token prompt (prompt over time to first token),
rank 0's time blocked on the other rank per decoded token, and the bytes of weights each
rank holds. The experts are split in two equal ranges, the layers in two equal halves.
Configurations measure in turn, --rounds times; medians are reported (bench/distributed.py
runs the processes).

--synthetic writes a qwen3moe with random weights through the tests' tiny-model builder
(transformers' own class, the gguf package's writer; packed types Q4_1, Q4_0, Q8_0): 6
layers, hidden 512, 8/2 heads of 64, 16 experts of 512, top 4, a byte-level tokenizer. Its
routed experts are ~85% of its weights, as in Qwen3-30B-A3B.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import distributed  # bench/distributed.py: the rank processes and the measurement

SYNTHETIC = dict(hidden_size=512, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                 num_hidden_layers=6, num_experts=16, num_experts_per_tok=4,
                 moe_intermediate_size=512, max_position_embeddings=4096)


def synthetic_model(directory: Path) -> Path:
    """A small qwen3moe GGUF with a tokenizer, built once in directory."""
    path = directory / "qwen3moe.gguf"
    if path.exists():
        return path
    tests = Path(__file__).resolve().parents[1] / "tests"
    sys.path[:0] = [str(tests / "engine"), str(tests)]
    import tiny_models
    from tokenizer_fixtures import tiny_byte_level_metadata

    metadata = tiny_byte_level_metadata()
    built = tiny_models.build("qwen3moe", directory, metadata=metadata,
                              vocab_size=len(metadata["tokenizer.ggml.tokens"]), **SYNTHETIC)
    return built.gguf_path


def held_bytes(model: str, dtype: str, ranks: dict[str, list[dict]]) -> dict[str, list[int]]:
    """Bytes of weights each rank of each configuration holds once loaded (each share
    loaded alone, in turn, in this process)."""
    from shoal.catalog.resolve import resolve_model
    from shoal.engine.models.loader import load_model

    source = resolve_model(model)
    held = {}
    for name, shares in ranks.items():
        sizes = []
        for share in shares:
            loaded = load_model(source, dtype, reduce=lambda partial: partial, **share)
            sizes.append(loaded.weight_bytes)
            del loaded
        held[name] = sizes
    return held


def main() -> None:
    from shoal.engine.models.loader import read_model_config
    from shoal.runner.process_env import runner_environment

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a mixture-of-experts GGUF file")
    parser.add_argument("--synthetic", type=Path, help="build a small synthetic model here")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if (args.model is None) == (args.synthetic is None):
        parser.error("give exactly one of --model and --synthetic")
    model = args.model or str(synthetic_model(args.synthetic))
    os.environ.update(runner_environment())  # the OpenMP settings of shoal's runners
    from shoal.catalog.resolve import resolve_model

    config = read_model_config(resolve_model(model))
    if not config.num_experts:
        parser.error(f"{model} is not a mixture-of-experts model")
    layers, experts, half = config.num_layers, config.num_experts, config.num_experts // 2
    cores = distributed.core_halves()
    base = {"model": model, "dtype": args.dtype, "tokens": args.tokens, "prompt": args.prompt,
            "threads": 1}
    one_core = [cores[0][:1], cores[1][:1]]
    configs = {
        "one_node": {**base, "cores": one_core[:1]},
        "expert_2": {**base, "cores": one_core, "sharding": "expert",
                     "layers": [(0, layers)] * 2, "experts": [(0, half), (half, experts)]},
        "pipeline_2": {**base, "cores": one_core, "sharding": "pipeline",
                       "layers": [(0, layers // 2), (layers // 2, layers)]},
    }
    running = {name: distributed.Configuration(values) for name, values in configs.items()}
    runs: dict[str, list[dict]] = {name: [] for name in running}
    try:
        for turn in range(args.rounds):
            for name, configuration in running.items():
                runs[name].append(configuration.measure(turn))
    finally:
        for configuration in running.values():
            configuration.stop()
    held = held_bytes(model, args.dtype, {
        "one_node": [{}],
        "expert_2": [{"experts": (0, half)}, {"experts": (half, experts)}],
        "pipeline_2": [{"layer_range": (0, layers // 2)}, {"layer_range": (layers // 2, layers)}],
    })
    result = {"model": model, "dtype": args.dtype, "rounds": args.rounds,
              "prompt_tokens": args.prompt, "new_tokens": args.tokens,
              "layers": layers, "experts": experts,
              "experts_per_token": config.num_experts_per_token, "threads_per_rank": 1}
    for name, config_runs in runs.items():
        medians = distributed.median_run(config_runs)
        result[name] = {"decode_tokens_per_s": medians["decode_tokens_per_s"],
                        "prefill_tokens_per_s": args.prompt / medians["ttft_s"],
                        "rank0_wait_ms_per_token": medians["rank0_wait_ms_per_token"],
                        "weight_bytes_per_rank": held[name]}
    one = result["one_node"]
    for name in ("expert_2", "pipeline_2"):
        for key in ("decode_tokens_per_s", "prefill_tokens_per_s"):
            result[name][key.replace("tokens_per_s", "vs_one_node")] = (
                result[name][key] / one[key])
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
