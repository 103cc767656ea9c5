"""Prompt (prefill) matmul: packed GGUF weights on the kernel's exact prompt path
(QuantLinear.forward(x, prompt=True), bf16 out) against torch's dense bf16 F.linear with
the dequantized weight, on the same bf16 x.

Random file blocks (random codes, small fp16 scales) of each type and shape; the two are
timed interleaved (packed, dense, packed, ...) so a noisy shared machine slows both alike.
Prints JSON: per case, the median TFLOP/s of each and packed / dense.

    PYTHONPATH=src python bench/prompt_matmul.py [--threads 2] [--repeats 7] [--rows 512 128]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from shoal.engine.kernels.build import KERNEL
from shoal.engine.backends.packing import QTYPES

# (type, N out, K in): Qwen2.5-Coder-1.5B's projections.
SHAPES = [("Q4_K", 17920, 1536), ("Q4_K", 8960, 1536), ("Q6_K", 1536, 8960),
          ("Q8_0", 3072, 576)]
# Weights and bytes per file block, and the byte offsets of its fp16 scales (ggml layouts).
BLOCKS = {"Q4_K": (256, 144, (0, 2)), "Q6_K": (256, 210, (208,)), "Q8_0": (32, 34, (0,))}


def random_packed(kernel, name: str, n: int, k: int, seed: int) -> torch.Tensor:
    block_k, block_bytes, scales = BLOCKS[name]
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n, k // block_k, block_bytes), generator=g, dtype=torch.uint8)
    for offset in scales:
        scale = (torch.randn(n, k // block_k, generator=g) * 0.01).half()
        raw[:, :, offset:offset + 2] = scale.view(torch.uint8).view(n, k // block_k, 2)
    return kernel.quant_pack(QTYPES[name], raw.reshape(-1), n, k)


def seconds(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def measure(kernel, name: str, n: int, k: int, m: int, repeats: int) -> dict:
    data = random_packed(kernel, name, n, k, seed=n + k)
    op = kernel.QuantLinear([QTYPES[name]], [data], [n], k, None)
    dense = kernel.quant_dequantize(QTYPES[name], data, n, k).bfloat16()
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16()
    packed_call = lambda: op.forward(x, False, True)  # noqa: E731
    dense_call = lambda: F.linear(x, dense)  # noqa: E731
    flop = 2.0 * m * n * k
    calls = max(1, int(0.05 * 2e12 / flop))  # ~50 ms of work per timing
    for fn in (packed_call, dense_call):
        fn()  # warm: buffers, oneDNN's kernel choice
    packed_s, dense_s = [], []
    for _ in range(repeats):
        packed_s.append(seconds(packed_call, calls))
        dense_s.append(seconds(dense_call, calls))
    packed_tf = flop / statistics.median(packed_s) / 1e12
    dense_tf = flop / statistics.median(dense_s) / 1e12
    return {"type": name, "n": n, "k": k, "m": m, "packed_tflops": round(packed_tf, 3),
            "dense_tflops": round(dense_tf, 3), "ratio": round(packed_tf / dense_tf, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--rows", type=int, nargs="+", default=[512, 128])
    parser.add_argument("--types", nargs="+", default=list(BLOCKS))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernel = KERNEL.load()
    if kernel is None or not kernel.quant_fast_kernels():
        raise SystemExit("the packed kernels need a CPU with AVX512-BF16")
    results = [measure(kernel, name, n, k, m, args.repeats)
               for m in args.rows for name, n, k in SHAPES if name in args.types]
    print(json.dumps({"threads": args.threads, "repeats": args.repeats,
                      "backend": kernel.quant_default_backend(), "results": results}, indent=1))


if __name__ == "__main__":
    main()
