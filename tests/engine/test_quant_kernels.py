"""The packed GGUF weight kernels (engine/kernels/quant_*) against gguf's own dequantization.

Random file blocks (random codes, sane fp16 scales) for every weight type: the packed form
dequantizes to exactly gguf's values, and the matmul equals dequantize-then-matmul with the
same bf16 activations up to float32 summation, on every path this machine has, for 1, 4, 16
and 128 rows, with each row's result independent of the rows beside it.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from shoal.engine.backends.packing import QTYPES

TYPES = list(QTYPES)
# Byte offsets of each type's fp16 fields in one file block (ggml's block layouts).
FP16_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
               "IQ4_NL": [0], "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2],
               "Q6_K": [208], "IQ4_XS": [0]}
# Byte offsets of each type's E8M0 scale (a power of two: 2^(e - 128) in ggml's convention).
E8M0_FIELDS = {"MXFP4": [0]}
ROWS = (1, 4, 16, 128)
AUTO, AVX512, AMX, PORTABLE, AVX2 = 0, 1, 2, 3, 4


def paths(kernel) -> list[tuple[int, bool]]:
    """(backend, prompt rows) pairs this machine can run: on AVX512-BF16 the vector order,
    with AMX also AMX's order (generated tokens) and the split-weight tiles (prompt tokens);
    on any AVX2 machine (AVX-512 ones too) the AVX2 path."""
    found = []
    if kernel.quant_default_backend() in ("avx512", "amx"):
        found += [(AVX512, False), (AVX512, True)]
    if kernel.quant_default_backend() == "amx":
        found += [(AMX, False), (AMX, True)]
    if kernel.quant_avx2_available():
        found += [(AVX2, False), (AVX2, True)]
    return found


def random_blocks(name: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """[rows, bytes per row] uint8 of random file blocks (floats for F32/F16/BF16)."""
    rng = np.random.default_rng(seed)
    if name == "F32":
        return rng.standard_normal((rows, cols)).astype(np.float32).view(np.uint8)
    if name == "F16":
        return rng.standard_normal((rows, cols)).astype(np.float16).view(np.uint8)
    if name == "BF16":
        values = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
        return values.bfloat16().view(torch.int16).numpy().view(np.uint8)
    block_weights, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]]
    raw = rng.integers(0, 256, size=(rows, cols // block_weights, block_bytes), dtype=np.uint8)
    for offset in FP16_FIELDS.get(name, ()):
        scale = (rng.standard_normal(raw.shape[:2]) * 0.01).astype(np.float16)
        raw[:, :, offset:offset + 2] = scale.view(np.uint8).reshape(*raw.shape[:2], 2)
    for offset in E8M0_FIELDS.get(name, ()):  # scales 2^-12 .. 2^-4
        raw[:, :, offset] = rng.integers(116, 125, size=raw.shape[:2], dtype=np.uint8)
    return raw.reshape(rows, -1)


def gguf_values(name: str, raw: np.ndarray, rows: int, cols: int) -> torch.Tensor:
    """float32 [rows, cols] as the gguf package dequantizes the blocks."""
    if name == "F32":
        return torch.from_numpy(raw.view(np.float32).reshape(rows, cols).copy())
    if name == "F16":
        return torch.from_numpy(raw.view(np.float16).reshape(rows, cols).astype(np.float32))
    if name == "BF16":
        bits = torch.from_numpy(raw.copy()).view(torch.int16)
        return bits.view(torch.bfloat16).float().reshape(rows, cols)
    values = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[name])
    return torch.from_numpy(np.array(values, dtype=np.float32)).reshape(rows, cols)


def packed(kernel, name: str, raw: np.ndarray, rows: int, cols: int) -> torch.Tensor:
    data = torch.from_numpy(np.ascontiguousarray(raw).reshape(-1).copy())
    return kernel.quant_pack(QTYPES[name], data, rows, cols)


def relative_error(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> float:
    """Largest |y - x w^T| over the sum of |x| |w| it came from (float64 reference)."""
    exact = x.double() @ w.double().t()
    scale = x.double().abs() @ w.double().abs().t()
    return ((y.double() - exact).abs() / scale.clamp(min=1e-30)).max().item()


@pytest.mark.parametrize("name", TYPES)
def test_packed_weights_dequantize_to_gguf_values(kernel, name):
    rows, cols = 40, 512  # 40: a strip of 16 columns is padded
    raw = random_blocks(name, rows, cols, seed=1)
    weights = packed(kernel, name, raw, rows, cols)
    assert torch.equal(kernel.quant_dequantize(QTYPES[name], weights, rows, cols),
                       gguf_values(name, raw, rows, cols))
    picked = torch.tensor([39, 0, 17, 17])
    assert torch.equal(kernel.quant_dequantize_rows(QTYPES[name], weights, rows, cols, picked),
                       gguf_values(name, raw, rows, cols)[picked])
    assert weights.numel() == kernel.quant_packed_bytes(QTYPES[name], rows, cols)


def test_mxfp4_keeps_every_e8m0_scale_exactly(kernel):
    """An MXFP4 scale is any power of two 2^-128 .. 2^127 (fp16 holds few of them): every
    exponent byte dequantizes to gguf's values, subnormal scales included."""
    rows, cols = 16, 256 * 32
    raw = random_blocks("MXFP4", rows, cols, seed=31).reshape(rows, -1, 17)
    raw[:, :, 0] = np.arange(256, dtype=np.uint8)  # each row's blocks take every exponent
    raw = raw.reshape(rows, -1)
    weights = packed(kernel, "MXFP4", raw, rows, cols)
    assert torch.equal(kernel.quant_dequantize(QTYPES["MXFP4"], weights, rows, cols),
                       gguf_values("MXFP4", raw, rows, cols))


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q5_0", "Q2_K", "BF16", "MXFP4"])
def test_dense_weights_take_gguf_values(kernel, name):
    """Weights that stay dense (float32 compute) are unpacked by the kernels where they are
    built, and equal what Python's dequantization gives."""
    from shoal.engine.backends.packing import dense_values
    from shoal.engine.weights.quant import RawTensor

    rows, cols = 40, 512
    raw = random_blocks(name, rows, cols, seed=4)
    expected = RawTensor((rows, cols), name, raw).dequantize()
    assert torch.equal(dense_values(RawTensor((rows, cols), name, raw), kernel), expected)
    assert torch.equal(expected, gguf_values(name, raw, rows, cols))
    assert torch.equal(dense_values(RawTensor((rows, cols), name, raw), None), expected)


@pytest.mark.parametrize("name", TYPES)
def test_packed_matmul_equals_dequantize_then_matmul(kernel, name):
    out_features, cols = 48, 512
    raw = random_blocks(name, out_features, cols, seed=2)
    weights = gguf_values(name, raw, out_features, cols)
    data = packed(kernel, name, raw, out_features, cols)
    generator = torch.Generator().manual_seed(3)
    # The portable loop (CPUs with neither AVX2 nor AVX-512) runs anywhere.
    for backend, prompt in [*paths(kernel), (PORTABLE, False)]:
        linear = kernel.QuantLinear([QTYPES[name]], [data], [out_features], cols, None, backend)
        for rows in ROWS:
            x = torch.randn(rows, cols, generator=generator).bfloat16()
            y = linear.forward(x, True, prompt)
            assert y.shape == (rows, out_features) and y.dtype == torch.float32
            # float32 sums of exact products; the split weights of prompt rows on AMX are
            # within 2^-18 of the file's values.
            error = relative_error(y, x, weights)
            assert error < 1e-5, f"{name} backend {backend} prompt {prompt} rows {rows}: {error}"


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q5_0", "Q8_0", "BF16", "F16", "MXFP4"])
def test_a_rows_result_does_not_depend_on_its_batch(kernel, name):
    out_features, cols = 64, 512
    raw = random_blocks(name, out_features, cols, seed=4)
    data = packed(kernel, name, raw, out_features, cols)
    x = torch.randn(40, cols, generator=torch.Generator().manual_seed(5)).bfloat16()
    for backend, prompt in paths(kernel):
        linear = kernel.QuantLinear([QTYPES[name]], [data], [out_features], cols, None, backend)
        everything = linear.forward(x, True, prompt)
        for start, count in ((0, 1), (3, 4), (5, 2), (10, 9), (2, 16), (1, 17), (4, 32), (0, 40)):
            part = linear.forward(x[start:start + count], True, prompt)
            assert torch.equal(part, everything[start:start + count]), (backend, prompt, count)


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "BF16"])
@pytest.mark.parametrize("threads", [1, 2])
def test_many_prompt_rows_over_panels_chunks_and_row_blocks(kernel, name, threads):
    """Enough prompt rows, strips and k that the long prompt path cuts them every way: panels
    of strips (a narrower last one, the last strip padded), k in chunks (a short last one),
    rows in blocks and passes (a short last pass); equal to the float64 product and, row by
    row, to the same rows run alone."""
    out_features, cols, rows = 300, 4352, 300
    raw = random_blocks(name, out_features, cols, seed=6)
    weights = gguf_values(name, raw, out_features, cols)
    data = packed(kernel, name, raw, out_features, cols)
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(7)).bfloat16()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for backend, prompt in paths(kernel):
            linear = kernel.QuantLinear([QTYPES[name]], [data], [out_features], cols, None,
                                        backend)
            everything = linear.forward(x, True, prompt)
            assert relative_error(everything, x, weights) < 1e-5, (backend, prompt)
            for start, count in ((0, 1), (5, 7), (120, 20), (290, 10)):
                part = linear.forward(x[start:start + count], True, prompt)
                assert torch.equal(part, everything[start:start + count]), (backend, count)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q8_0", "Q5_0", "Q3_K"])
def test_avx2_prompt_rows_take_the_generated_rows_steps(kernel, name):
    # On AVX2 a plane type's rows all take the same int16 steps: a few rows decode the codes
    # in registers, more (a prompt, a batch) read them unpacked once per strip. So a token's
    # row has the same bits whether it came in a prompt or was generated.
    if not kernel.quant_avx2_available():
        pytest.skip("this build has no AVX2 path")
    raw = random_blocks(name, 64, 1024, seed=8)
    linear = kernel.QuantLinear([QTYPES[name]], [packed(kernel, name, raw, 64, 1024)], [64],
                                1024, None, AVX2)
    x = torch.randn(21, 1024, generator=torch.Generator().manual_seed(9)).bfloat16()
    prompt = linear.forward(x, True, True)
    one_by_one = torch.cat([linear.forward(x[i:i + 1], True, False) for i in range(21)])
    assert torch.equal(prompt, one_by_one)


@pytest.mark.parametrize("name,out_features,cols", [
    ("Q4_K", 64, 1024), ("Q6_K", 64, 1024), ("Q8_0", 64, 1024), ("F16", 64, 1024),
    # Without AMX, many rows run over blocks of strips: several blocks per thread here.
    ("Q4_K", 512, 4096)])
def test_generated_rows_take_the_same_bits_on_every_path(kernel, name, out_features, cols):
    # Generated tokens sum in AMX's order on AVX512-BF16: a few rows on vectors (tiles
    # decoded in registers), more on AMX tiles, or without AMX the same vectors 4 rows a pass.
    # The AVX2 path has an int16 order of its own, the same for any rows.
    raw = random_blocks(name, out_features, cols, seed=6)
    data = packed(kernel, name, raw, out_features, cols)
    x = torch.randn(24, cols, generator=torch.Generator().manual_seed(7)).bfloat16()
    results = {}
    for backend in sorted({backend for backend, _ in paths(kernel)}):
        linear = kernel.QuantLinear([QTYPES[name]], [data], [out_features], cols, None, backend)
        many = linear.forward(x, True, False)  # 24 rows: AMX tiles, or passes of 4 rows
        assert torch.equal(linear.forward(x[:13], True, False), many[:13]), backend
        few = torch.cat([linear.forward(x[i:i + 3], True, False) for i in range(0, 24, 3)])
        assert torch.equal(few, many), backend
        results[backend] = many
    if AMX in results:
        assert torch.equal(results[AMX], results[AVX512])


def test_segments_of_different_types_stack_with_a_bias(kernel):
    cols = 256
    parts = [("Q5_0", 32), ("Q5_0", 16), ("Q8_0", 24), ("Q6_K", 40)]
    raws = [random_blocks(name, rows, cols, seed=10 + i) for i, (name, rows) in enumerate(parts)]
    weights = torch.cat([gguf_values(name, raw, rows, cols)
                         for (name, rows), raw in zip(parts, raws)])
    bias = torch.randn(weights.shape[0], generator=torch.Generator().manual_seed(8))
    linear = kernel.QuantLinear([QTYPES[name] for name, _ in parts],
                                [packed(kernel, name, raw, rows, cols)
                                 for (name, rows), raw in zip(parts, raws)],
                                [rows for _, rows in parts], cols, bias)
    assert linear.out_features == 112 and linear.in_features == cols
    x = torch.randn(5, cols, generator=torch.Generator().manual_seed(9)).bfloat16()
    for prompt in (False, True):
        y = linear.forward(x, True, prompt)
        assert relative_error(y - bias, x, weights) < 1e-5
    rounded = linear.forward(x, False)
    assert rounded.dtype == torch.bfloat16
    assert torch.equal(rounded, linear.forward(x, True).bfloat16())


def test_bad_shapes_are_refused_with_a_message(kernel):
    raw = random_blocks("Q4_K", 16, 256, seed=11)
    with pytest.raises(RuntimeError, match="multiple of 256"):
        kernel.quant_pack(QTYPES["Q4_K"], torch.zeros(100, dtype=torch.uint8), 16, 200)
    with pytest.raises(RuntimeError, match="contiguous bytes"):
        kernel.quant_pack(QTYPES["Q4_K"], torch.zeros(100, dtype=torch.uint8), 16, 256)
    data = packed(kernel, "Q4_K", raw, 16, 256)
    with pytest.raises(RuntimeError, match="not a packed Q6_K"):
        kernel.QuantLinear([QTYPES["Q6_K"]], [data], [16], 256, None)
    linear = kernel.QuantLinear([QTYPES["Q4_K"]], [data], [16], 256, None)
    with pytest.raises(RuntimeError, match=r"x must be \[M, 256\] bfloat16"):
        linear.forward(torch.zeros(2, 256))
    with pytest.raises(RuntimeError, match="unknown weight type"):
        kernel.quant_pack(99, torch.zeros(4, dtype=torch.uint8), 1, 32)


@pytest.mark.parametrize("bits", [3, 4])
def test_a_head_copy_and_its_int8_estimate(kernel, bits):
    if not kernel.quant_copy_estimate_available():
        pytest.skip("this CPU has neither AVX512-VNNI nor AVX2")
    out_features, cols = 40, 512  # 40: a strip of 16 rows is padded
    weights = torch.randn(out_features, cols, generator=torch.Generator().manual_seed(16))
    weights[3, :64] = 0.25  # a constant block: d = 0
    packed = kernel.quant_head_copy_pack(weights, bits)
    assert packed.numel() == 3 * (cols // 64) * (64 + 128 * bits)
    values = kernel.quant_head_copy_values(packed, out_features, cols, bits)
    # Per 64 weights: 2^bits levels from the minimum to the maximum, each weight rounded to one.
    groups = weights.view(out_features, cols // 64, 64)
    step = (groups.amax(dim=-1) - groups.amin(dim=-1)) / (2**bits - 1)           # [40, 8]
    error = (values - weights).abs().view(out_features, cols // 64, 64).amax(dim=-1)
    assert (error <= step * 0.51 + 1e-3).all()
    assert torch.equal(values[3, :64], torch.full((64,), 0.25))
    assert all(len(block.unique()) <= 2**bits for block in values.view(-1, 64))
    assert len(values.view(-1, 64)[0].unique()) > 2**(bits - 1)  # every code bit in use
    x = torch.randn(20, cols, generator=torch.Generator().manual_seed(17)).bfloat16()
    estimate = kernel.quant_int8_estimate_copy(packed, out_features, cols, bits, x)
    assert estimate.shape == (20, out_features) and estimate.dtype == torch.float32
    # x is rounded to int8 steps of max|x| / 127 per 64 values: at most half a step each.
    x_step = x.float().view(20, cols // 64, 64).abs().amax(dim=-1) / 127          # [20, 8]
    mass = values.abs().view(out_features, cols // 64, 64).sum(dim=-1)            # [40, 8]
    exact = x.double() @ values.double().t()
    assert ((estimate.double() - exact).abs() <= (x_step / 2) @ mass.t() * 1.001 + 1e-4).all()
    for start, count in ((0, 1), (3, 4), (5, 9), (19, 1)):  # rows independent of the batch
        part = kernel.quant_int8_estimate_copy(packed, out_features, cols, bits,
                                               x[start:start + count])
        assert torch.equal(part, estimate[start:start + count])
    with pytest.raises(RuntimeError, match="not a packed"):
        kernel.quant_int8_estimate_copy(packed[:-64], out_features, cols, bits, x)
    with pytest.raises(RuntimeError, match=r"x must be \[M, 512\] bfloat16"):
        kernel.quant_int8_estimate_copy(packed, out_features, cols, bits, x.float())
    with pytest.raises(RuntimeError, match="bits must be 3 or 4, not 5"):
        kernel.quant_int8_estimate_copy(packed, out_features, cols, 5, x)
    with pytest.raises(RuntimeError, match="multiple of 64"):
        kernel.quant_head_copy_pack(torch.zeros(4, 96), bits)
    with pytest.raises(RuntimeError, match="fp16's range"):
        kernel.quant_head_copy_pack(torch.full((1, 64), 1e6), bits)


def test_a_head_beyond_fp16_s_range_keeps_no_copy(kernel, monkeypatch):
    """A copy's scales and minima are fp16: a Q8_0 head with a weight past 65504 splits its
    table instead (Q8_0's own fp16 scales), rather than failing to load or estimating
    infinities."""
    from shoal.engine.backends import CpuKernels
    from shoal.engine.backends import head_estimates as head_module
    from shoal.engine.models.layers.head import build_head
    from shoal.engine.models.layers.linear import WeightPlan
    from shoal.engine.weights.quant import RawTensor

    if not kernel.quant_split_estimate_available():
        pytest.skip("this CPU has neither AVX512-VNNI nor AVX2")
    monkeypatch.setattr(head_module, "ESTIMATE_MIN_WEIGHTS", 0)
    vocab, hidden = 4096, 256
    blocks = random_blocks("Q8_0", vocab, hidden, seed=14)
    blocks[4000, :2] = np.array([60000.0], dtype=np.float16).view(np.uint8)  # row 4000: d
    blocks[4000, 2] = 127  # its first weight 127 * 60000
    raw = RawTensor((vocab, hidden), "Q8_0", blocks)
    plan = WeightPlan(CpuKernels(kernel))
    head = build_head(raw, plan, None, spare_bytes=10**9)
    assert isinstance(head, head_module.SplitHead)  # no copy
    assert head.nbytes() == kernel.quant_packed_bytes(QTYPES["Q8_0"], vocab, hidden)
    x = torch.zeros(2, hidden, dtype=torch.bfloat16)
    x[:, 0] = 1.0
    logits = head(x)
    assert torch.isfinite(logits).all() and logits[0, 4000] == 127 * 60000.0
    assert torch.equal(logits.argmax(dim=-1), torch.tensor([4000, 4000]))


def test_a_q8_0_head_splits_its_table_with_or_without_room_for_a_copy(kernel, monkeypatch):
    """The split table estimates as fast as a copy and takes no memory of its own."""
    from shoal.engine.backends import CpuKernels
    from shoal.engine.backends import head_estimates as head_module
    from shoal.engine.models.layers.head import build_head
    from shoal.engine.models.layers.linear import WeightPlan
    from shoal.engine.weights.quant import RawTensor

    if not kernel.quant_split_estimate_available():
        pytest.skip("this CPU has neither AVX512-VNNI nor AVX2")
    vocab, hidden = 4096, 256
    plan = WeightPlan(CpuKernels(kernel))
    monkeypatch.setattr(head_module, "ESTIMATE_MIN_WEIGHTS", 0)
    for spare in (0, 10**9):
        raw = RawTensor((vocab, hidden), "Q8_0", random_blocks("Q8_0", vocab, hidden, seed=12))
        head = build_head(raw, plan, None, spare_bytes=spare)
        assert isinstance(head, head_module.SplitHead) and head.nbytes() == \
            kernel.quant_packed_bytes(QTYPES["Q8_0"], vocab, hidden)


@pytest.mark.parametrize("name,hidden", [("Q6_K", 256), ("Q6_K", 1024)])
def test_an_estimated_head_rescores_its_candidates_exactly(kernel, monkeypatch, name, hidden):
    from shoal.engine.backends import CpuKernels
    from shoal.engine.backends import head_estimates as head_module
    from shoal.engine.models.layers.head import build_head
    from shoal.engine.models.layers.linear import WeightPlan
    from shoal.engine.weights.quant import RawTensor

    if not kernel.quant_copy_estimate_available():
        pytest.skip("this CPU has neither AVX512-VNNI nor AVX2")
    vocab = 4096
    raw = RawTensor((vocab, hidden), name, random_blocks(name, vocab, hidden, seed=12))
    plan = WeightPlan(CpuKernels(kernel))
    monkeypatch.setattr(head_module, "ESTIMATE_MIN_WEIGHTS", 0)
    # No room for a copy: the exact head alone.
    cramped = build_head(raw, plan, None, spare_bytes=1000)
    assert isinstance(cramped, head_module.ExactHead)
    # Room for a copy of the head, bytes of its own: per 16 x 64 weights, 448 or 576.
    head = build_head(raw, plan, None, spare_bytes=10**9)
    assert isinstance(head, head_module.EstimatedHead)
    bits = 3 if hidden >= head_module.COPY_3_BITS_MIN_HIDDEN else 4
    assert head.estimate.bits == bits
    assert head.candidates == (head_module.RESCORE_CANDIDATES if bits == 3
                               else head_module.NARROW_RESCORE_CANDIDATES)
    assert head.nbytes() == head.exact.nbytes() + vocab * hidden // 1024 * (64 + 128 * bits)
    x = torch.randn(3, hidden, generator=torch.Generator().manual_seed(13)).bfloat16()
    exact = head.exact(x)  # the exact head, as generated rows compute it
    ours = head(x)
    candidates = head.estimate.forward(x, True, False).topk(head.candidates, dim=-1).indices
    assert torch.equal(ours.gather(1, candidates), exact.gather(1, candidates))
    assert torch.equal(ours.argmax(dim=-1), exact.argmax(dim=-1))
    # Prompt rows (from prompt_from on) get the exact head all through, on the
    # generated-token arithmetic (a row's logits are the same bits alone or in a batch).
    assert torch.equal(head(x, 1)[1:], exact[1:])
    assert torch.equal(head(x[2:], 0), exact[2:])
    monkeypatch.setattr(head_module, "ESTIMATE_MIN_WEIGHTS", 10**12)
    plain = build_head(raw, plan, None, spare_bytes=0)
    assert torch.equal(plain(x, 0), plain(x)) and torch.equal(plain(x, 0), exact)


def split_estimate_weights(raw: np.ndarray, weights: torch.Tensor) -> torch.Tensor:
    """What a split Q8_0 table's estimate multiplies (kernels/quant_head_split.h): per weight
    d (16 h - 120.5), h the high nibble of q + 128."""
    rows, cols = weights.shape
    d = torch.from_numpy(raw.reshape(rows, cols // 32, 34)[:, :, :2].copy().view(np.float16)
                         .astype(np.float32)).view(rows, cols // 32, 1)
    q = (weights.view(rows, cols // 32, 32) / d).round().nan_to_num(0.0)
    high = torch.div(q + 128, 16, rounding_mode="floor")
    return (d * (16 * high - 120.5)).view(rows, cols)


def test_a_split_q8_0_table_keeps_gguf_s_values(kernel):
    """A Q8_0 table split into its codes' nibbles takes Q8_0's bytes; its rows are gguf's
    values and its chosen columns exact dot products."""
    out_features, cols = 40, 512  # 40: a strip of 16 rows is padded
    raw = random_blocks("Q8_0", out_features, cols, seed=18)
    weights = gguf_values("Q8_0", raw, out_features, cols)
    file = torch.from_numpy(raw.reshape(-1).copy())
    split = kernel.quant_head_split_from_file(file, out_features, cols)
    assert split.numel() == packed(kernel, "Q8_0", raw, out_features, cols).numel()
    rows = torch.tensor([0, 39, 17, 17, 5])
    assert torch.equal(kernel.quant_head_split_rows(split, out_features, cols, rows),
                       weights[rows])
    x = torch.randn(6, cols, generator=torch.Generator().manual_seed(19)).bfloat16()
    columns = torch.randint(0, out_features, (6, 9), generator=torch.Generator().manual_seed(20))
    ours = kernel.quant_head_split_columns(split, out_features, cols, x, columns)
    exact = (x.double() @ weights.double().t()).gather(1, columns)
    mass = (x.double().abs() @ weights.double().abs().t()).gather(1, columns)
    assert ((ours.double() - exact).abs() <= mass * 1e-6).all()  # float32 summation
    with pytest.raises(RuntimeError, match=r"row 40 outside \[0, 40\)"):
        kernel.quant_head_split_rows(split, out_features, cols, torch.tensor([40]))
    with pytest.raises(RuntimeError, match=r"row -1 outside"):
        kernel.quant_head_split_columns(split, out_features, cols, x, columns - 1 - columns)
    with pytest.raises(RuntimeError, match=r"not a split \[40, 512\] Q8_0 table"):
        kernel.quant_head_split_rows(split[:-64], out_features, cols, rows)
    with pytest.raises(RuntimeError, match=r"not the file bytes of a \[40, 512\] Q8_0"):
        kernel.quant_head_split_from_file(file[:-34], out_features, cols)


def test_a_split_q8_0_table_s_int8_estimate(kernel):
    if not kernel.quant_split_estimate_available():
        pytest.skip("this CPU has neither AVX512-VNNI nor AVX2")
    out_features, cols = 40, 512
    raw = random_blocks("Q8_0", out_features, cols, seed=21)
    weights = gguf_values("Q8_0", raw, out_features, cols)
    split = kernel.quant_head_split_from_file(torch.from_numpy(raw.reshape(-1).copy()),
                                              out_features, cols)
    x = torch.randn(20, cols, generator=torch.Generator().manual_seed(22)).bfloat16()
    estimate = kernel.quant_int8_estimate_split(split, out_features, cols, x)
    assert estimate.shape == (20, out_features) and estimate.dtype == torch.float32
    # The high nibbles' weights times x rounded to int8 steps of max|x| / 127 per 32 values.
    high = split_estimate_weights(raw, weights)
    assert (high - weights).abs().max() > 0
    x_step = x.float().view(20, cols // 32, 32).abs().amax(dim=-1) / 127          # [20, 16]
    mass = high.abs().view(out_features, cols // 32, 32).sum(dim=-1)              # [40, 16]
    reference = x.double() @ high.double().t()
    assert ((estimate.double() - reference).abs() <= (x_step / 2) @ mass.t() * 1.001 + 1e-4).all()
    for start, count in ((0, 1), (3, 4), (5, 9), (19, 1)):  # rows independent of the batch
        part = kernel.quant_int8_estimate_split(split, out_features, cols, x[start:start + count])
        assert torch.equal(part, estimate[start:start + count])
    with pytest.raises(RuntimeError, match="not a split"):
        kernel.quant_int8_estimate_split(split[:-64], out_features, cols, x)
    with pytest.raises(RuntimeError, match=r"x must be \[M, 512\] bfloat16"):
        kernel.quant_int8_estimate_split(split, out_features, cols, x.float())


def test_a_tied_q8_0_head_without_room_splits_the_shared_table(kernel, monkeypatch):
    """A tied Q8_0 head with no room for a copy splits the embedding's table (no bytes of its own): the embedding's rows stay gguf's values, and each row's
    top candidates of the high nibbles' estimate get exact logits, prompt rows too."""
    from shoal.engine.backends import CpuKernels
    from shoal.engine.backends import head_estimates as head_module
    from shoal.engine.models.layers.head import build_head
    from shoal.engine.models.layers.embedding import Embedding
    from shoal.engine.models.layers.linear import WeightPlan
    from shoal.engine.weights.quant import RawTensor

    if not kernel.quant_split_estimate_available():
        pytest.skip("this CPU has neither AVX512-VNNI nor AVX2")
    monkeypatch.setattr(head_module, "ESTIMATE_MIN_WEIGHTS", 0)
    vocab, hidden = 4096, 256
    blocks = random_blocks("Q8_0", vocab, hidden, seed=23)
    weights = gguf_values("Q8_0", blocks, vocab, hidden)
    plan = WeightPlan(CpuKernels(kernel))
    embedding = Embedding(RawTensor((vocab, hidden), "Q8_0", blocks), plan)
    table_bytes = embedding.nbytes()
    head = build_head(RawTensor((vocab, hidden), "Q8_0", blocks), plan, embedding,
                                  spare_bytes=1000)
    assert isinstance(head, head_module.SplitHead) and head.tied
    assert embedding.split is head.table and embedding.packed is None
    assert head.nbytes() == 0 and embedding.nbytes() == table_bytes
    assert head.candidates == head_module.NARROW_RESCORE_CANDIDATES
    ids = torch.tensor([3, 4095, 3, 0])
    assert torch.equal(embedding(ids), weights[ids].bfloat16())
    x = torch.randn(5, hidden, generator=torch.Generator().manual_seed(24)).bfloat16()
    logits = head(x)
    candidates = head.table.estimate(x).topk(head.candidates, dim=-1).indices
    exact = x.float() @ weights.t()
    assert torch.allclose(logits.gather(1, candidates), exact.gather(1, candidates),
                          rtol=1e-5, atol=1e-4)
    assert torch.equal(logits.argmax(dim=-1), exact.argmax(dim=-1))
    assert torch.equal(head(x, 0), logits)  # prompt rows take the same path
    assert torch.equal(head(x[2:3]), logits[2:3])  # a row alone gets the same bits
    assert head(x[:0]).shape == (0, vocab)
