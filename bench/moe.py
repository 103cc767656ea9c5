"""Mixture-of-experts speed on one node against llama.cpp, on synthetic GGUF files of real
shapes; prints one JSON object.

    python bench/moe.py [--family qwen3moe|gpt-oss] [--layers 12] [--threads 2] [--rounds 3]
                        [--work-dir DIR] [--skip-peer] [--skip-http]

No MoE weights can be downloaded here, so the file (bench/moe_gguf.py) has every tensor of
Qwen3-30B-A3B (or gpt-oss-20b) in the types llama.cpp's Q4_K_M recipe (or the MXFP4 file)
gives it, random valid blocks, the Qwen2.5 tokenizer, and the depth cut to --layers so that
shoal and llama.cpp fit in memory side by side. It is written once under --work-dir
(default: <data dir>/bench-moe) and reused.

Measures, in one run, 2 threads, the same file: batch-1 decode (shoal and llama.cpp turn
about, medians) and its bound: the bytes a token reads (the chosen experts of each layer,
attention, router, norms, head, one embedding row) over the read bandwidth measured in this
run (a float32 sum over 1 GiB); a 500-token prefill; 16 concurrent HTTP streams through
`shoal serve` against llama.cpp's batch-1 decode; and one MoE layer's experts for one row
with their weights from memory (each call another layer) against the same layer again (in
cache): how much of a layer's time is the arithmetic's own. The engine, peer and HTTP parts
are bench/engine.py's.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import torch
from engine import LlamaCppPeer, bench_engine, bench_http, interleaved_turns
from moe_gguf import SHAPES, bytes_per_token, model_path

from shoal.catalog.resolve import data_dir_or_default

BANDWIDTH_BYTES = 1 << 30  # well beyond any cache


def read_bandwidth(threads: int, turns: int = 5) -> float:
    """Bytes/s a float32 sum over 1 GiB reads on `threads` threads: the best of `turns`."""
    torch.set_num_threads(threads)
    data = torch.ones(BANDWIDTH_BYTES // 4)
    data.sum()  # pages touched, code warm
    best = 0.0
    for _ in range(turns):
        start = time.perf_counter()
        data.sum()
        best = max(best, BANDWIDTH_BYTES / (time.perf_counter() - start))
    del data
    return best


def expert_layer_ms(engine, turns: int = 200) -> dict:
    """One generated row through a MoE layer's experts (router, grouped experts, shared
    expert), ms per call: "cold", every call another layer and other experts (their weights
    come from memory, as in a decode step), and "warm", the same layer and row again (the
    same experts, their weights in cache): the arithmetic's own time, which no memory speed
    lowers."""
    layers = [block.mlp for block in engine.loaded.module.blocks
              if hasattr(block.mlp, "router")]
    hidden = layers[0].router.weight.shape[1]
    generator = torch.Generator().manual_seed(0)
    rows = [torch.randn(1, hidden, generator=generator).to(torch.bfloat16)
            for _ in range(turns)]

    def per_call(pick) -> float:
        with torch.inference_mode():
            pick(0)
            start = time.perf_counter()
            for i in range(turns):
                pick(i)
        return (time.perf_counter() - start) / turns * 1e3

    return {"cold_ms": per_call(lambda i: layers[i % len(layers)](rows[i], 1)),
            "warm_ms": per_call(lambda i: layers[0](rows[0], 1)),
            "layers": len(layers)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=sorted(SHAPES), default="qwen3moe")
    parser.add_argument("--layers", type=int, default=12,
                        help="decoder layers kept (qwen3moe has 48, gpt-oss-20b 24)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--work-dir", type=Path, default=None)
    parser.add_argument("--skip-peer", action="store_true")
    parser.add_argument("--skip-http", action="store_true")
    args = parser.parse_args()

    work_dir = args.work_dir or data_dir_or_default(None) / "bench-moe"
    start = time.perf_counter()
    path = model_path(work_dir, args.family, args.layers)
    shape = SHAPES[args.family]
    result: dict = {"family": args.family, "file": str(path), "layers": args.layers,
                    "full_layers": shape.full_layers, "threads": args.threads,
                    "file_ready_s": time.perf_counter() - start,
                    "shape": {"hidden": shape.hidden, "experts": shape.experts,
                              "top_k": shape.top_k, "expert_ffn": shape.expert_ffn,
                              "heads": shape.heads, "kv_heads": shape.kv_heads,
                              "head_dim": shape.head_dim, "vocab": shape.vocab}}
    if shape.note:
        result["note"] = shape.note
    reads = bytes_per_token(path)
    bandwidth = [read_bandwidth(args.threads)]

    engine_result, engine = bench_engine(str(path), args.threads)
    result["engine"] = engine_result
    result["weight_bytes"] = engine.loaded.weight_bytes
    result["expert_layer_one_row"] = expert_layer_ms(engine)
    decode = engine_result["decode_batch1_tokens_per_s"]
    if not args.skip_peer:
        peer = LlamaCppPeer(str(path), args.threads)
        turns = interleaved_turns(engine, peer, args.rounds)
        result["peer_llama_cpp"] = turns
        decode = turns["decode"]["shoal_tokens_per_s"]
        peer.close()
    bandwidth.append(read_bandwidth(args.threads))
    del engine
    gc.collect()

    bound = max(bandwidth) / reads["read_per_token_bytes"]
    result["bandwidth_bound"] = {**reads, "read_bandwidth_bytes_per_s": bandwidth,
                                 "bound_tokens_per_s": bound,
                                 "decode_tokens_per_s": decode,
                                 "fraction_of_bound": decode / bound}
    if not args.skip_http:
        result["http"] = bench_http(str(path), args.threads, args.rounds)
    if "peer_llama_cpp" in result:
        peer_result = result["peer_llama_cpp"]
        peer_decode = peer_result["decode"]["peer_forward_tokens_per_s"]
        ratios = {"decode_batch1": decode / peer_decode,
                  "prefill_500": (peer_result["prefill"]["shoal_tokens_per_s"]
                                  / peer_result["prefill"]["peer_tokens_per_s"])}
        if "http" in result:
            streams16 = [c for c in result["http"]["concurrency"] if c["streams"] == 16][0]
            ratios["streams16_over_peer_decode_batch1"] = (
                streams16["aggregate_tokens_per_s"] / peer_decode)
        result["ratios"] = ratios
        result["targets"] = {"decode_batch1": 1.1, "fraction_of_bound": 0.75,
                             "prefill_500": 1.3, "streams16_over_peer_decode_batch1": 2.5}
    result["median_bandwidth_gb_s"] = statistics.median(bandwidth) / 1e9
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
