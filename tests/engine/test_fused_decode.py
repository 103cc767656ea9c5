"""The compiled decode kernel (engine/kernels/decode.cpp) against the Python path it replaces,
and building and loading the compiled extension."""

from __future__ import annotations

import logging

import pytest
import tiny_models
import torch
from forward_helpers import chunk
from test_models import BLOCK, PROMPT, load, shuffled_blocks
from tiny_models import VOCAB

from shoal.engine.backends.fused_decode import FUSED_MAX_ROWS
from shoal.engine.kernels import build
from shoal.engine.model_runner import ModelRunner
from shoal.engine.scheduler_output import SchedulerOutput

# Rows of different context lengths.
PROMPTS = [PROMPT, PROMPT[:5], PROMPT[3:] + PROMPT, PROMPT[7:], PROMPT * 2, PROMPT[:1]]
BLOCKS_PER_ROW = 8


def runners(checkpoint, fused: bool, num_blocks: int = BLOCKS_PER_ROW * len(PROMPTS),
            kv_cache_dtype: str = "auto"):
    loaded = load(checkpoint, "gguf", dtype="bfloat16", kv_cache_dtype=kv_cache_dtype)
    loaded.module.fused_decode_allowed = fused
    return ModelRunner(loaded, num_blocks, BLOCK)


def prefill(runner: ModelRunner, tables, prompts=PROMPTS) -> None:
    """Each prompt prefilled on its own (the Python path, on either runner)."""
    for i, (prompt, blocks) in enumerate(zip(prompts, tables)):
        runner.execute(SchedulerOutput((chunk(str(i), prompt, 0, blocks),)))


def on_kernel(runner: ModelRunner, output: SchedulerOutput) -> list[bool]:
    """For each part the step splits into, whether it runs on the decode kernel."""
    return [part.meta.decode is not None for part in runner.prepare(output).parts]


def decode_step(runner: ModelRunner, tokens, tables, lengths) -> tuple[torch.Tensor, bool]:
    """One decode step of every row: (logits, whether it ran on the kernel)."""
    output = SchedulerOutput(tuple(chunk(str(i), [t], n, blocks) for i, (t, n, blocks)
                                   in enumerate(zip(tokens, lengths, tables))))
    with torch.inference_mode():
        step = runner.prepare(output)
        return runner.execute_prepared(step), step.parts[0].meta.decode is not None


# Head shapes beside the tiny models' own (head size 16, 2 query heads per KV head):
# a head size with no vector form (8: the scalar loop), and 8 query heads per KV head
# (the vector form takes them 4 at a time).
SHAPES = {"head-size-8": {"num_attention_heads": 8, "num_key_value_heads": 2},
          "group-of-8": {"num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 16}}


@pytest.fixture(scope="module")
def shaped_checkpoints(tmp_path_factory):
    return {name: tiny_models.build("llama", tmp_path_factory.mktemp(name), **shape)
            for name, shape in SHAPES.items()}


@pytest.mark.parametrize("rows", [1, 3, len(PROMPTS)])
# qwen2: q/k/v biases; gemma3: q/k norms, post-norms, gelu, sliding layers (a window of 5
# keys, shorter than most prompts); qwen3: q/k norms
@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3", "qwen3"])
def test_kernel_decode_matches_the_python_path(kernel, tiny_checkpoints, family, rows):
    assert_decode_matches(tiny_checkpoints[family], PROMPTS[:rows])


@pytest.mark.parametrize("rows", [1, len(PROMPTS)])
# Mixture-of-experts blocks: their experts in one compiled call (qwen2moe: a gated shared
# expert beside them).
@pytest.mark.parametrize("family", ["qwen3moe", "qwen2moe", "mixtral"])
def test_kernel_decode_of_expert_models_matches_the_python_path(kernel, tiny_checkpoints,
                                                                family, rows):
    assert_decode_matches(tiny_checkpoints[family], PROMPTS[:rows])


@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_decode_matches_for_other_head_shapes(kernel, shaped_checkpoints, shape):
    assert_decode_matches(shaped_checkpoints[shape], PROMPTS)


def test_kernel_decode_matches_with_its_threads(kernel, tiny_checkpoints):
    # 12 rows of ~80 keys: the row passes and attention run on torch's intra-op threads.
    assert torch.get_num_threads() > 1
    prompts = [(PROMPT * 7)[i:] for i in range(12)]
    assert_decode_matches(tiny_checkpoints["llama"], prompts)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_kernel_decode_matches_over_a_float32_cache(kernel, tiny_checkpoints, family):
    assert_decode_matches(tiny_checkpoints[family], PROMPTS, kv_cache_dtype="float32")


def assert_decode_matches(checkpoint, prompts, kv_cache_dtype: str = "auto") -> None:
    rows = len(prompts)
    per_row = -(-(max(len(p) for p in prompts) + 6) // BLOCK)  # blocks for prompt + 6 steps
    fused, python = (runners(checkpoint, kernel_on, per_row * rows, kv_cache_dtype)
                     for kernel_on in (True, False))
    # Each row's blocks scattered over the cache, so keys are read through the table.
    order = shuffled_blocks(per_row * rows, seed=3)
    tables = [order[i * per_row:(i + 1) * per_row] for i in range(rows)]
    prefill(fused, tables, prompts)
    prefill(python, tables, prompts)
    lengths = [len(p) for p in prompts]
    tokens = [(7 + 31 * i) % VOCAB for i in range(rows)]
    for _ in range(6):  # the same tokens fed to both: every step compares like with like
        ours, kernel_ran = decode_step(fused, tokens, tables, lengths)
        theirs, python_ran = decode_step(python, tokens, tables, lengths)
        assert kernel_ran and not python_ran
        assert ours.shape == theirs.shape == (rows, checkpoint.hf_model.config.vocab_size)
        # bf16 rounding differs in a few places; logits stay within bf16 noise.
        torch.testing.assert_close(ours, theirs, atol=0.01 * theirs.abs().max().item(), rtol=0)
        cosine = torch.nn.functional.cosine_similarity(ours, theirs, dim=-1)
        assert cosine.min() > 0.9999
        tokens = [int(row.argmax()) for row in theirs]
        lengths = [n + 1 for n in lengths]


def test_kernel_writes_the_same_kv_cache(kernel, tiny_checkpoints):
    checkpoint = tiny_checkpoints["llama"]
    fused, python = runners(checkpoint, True), runners(checkpoint, False)
    tables = [list(range(8)), list(range(8, 16)), list(range(16, 24))]
    prefill(fused, tables)
    prefill(python, tables)
    lengths = [len(p) for p in PROMPTS[:3]]
    decode_step(fused, [1, 2, 3], tables, lengths)
    decode_step(python, [1, 2, 3], tables, lengths)
    for row, n in enumerate(lengths):
        slot = tables[row][n // BLOCK] * BLOCK + n % BLOCK
        for ours, theirs in zip(fused.kv_caches, python.kv_caches):
            assert ours.dtype == torch.bfloat16 and ours[:, slot].abs().sum() > 0
            torch.testing.assert_close(ours[:, slot].float(), theirs[:, slot].float(),
                                       atol=0.02, rtol=0.02)


def test_kernel_takes_decode_steps_up_to_its_row_limit(kernel, tiny_checkpoints):
    loaded = load(tiny_checkpoints["llama"], "gguf", dtype="bfloat16")
    runner = ModelRunner(loaded, FUSED_MAX_ROWS + 2, BLOCK)
    many = FUSED_MAX_ROWS + 1
    decodes = [chunk(str(i), [9], 3, [i]) for i in range(many)]
    assert on_kernel(runner, SchedulerOutput(tuple(decodes[:-1]))) == [True]
    assert on_kernel(runner, SchedulerOutput(tuple(decodes))) == [False]


def test_a_mixed_step_decodes_on_the_kernel_and_prefills_in_python(kernel, tiny_checkpoints):
    # Generated tokens take the kernel whatever shares their step, so a request's tokens
    # do not depend on other requests' prefills; logits come back in chunk order.
    checkpoint = tiny_checkpoints["llama"]
    mixed, alone = runners(checkpoint, True, 24), runners(checkpoint, True, 24)
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(3)]
    prefill(mixed, tables[:2], PROMPTS[:2])
    prefill(alone, tables[:2], PROMPTS[:2])
    lengths = [len(p) for p in PROMPTS[:2]]
    decodes = [chunk(str(i), [11 + i], n, t) for i, (n, t) in enumerate(zip(lengths, tables))]
    fresh = chunk("new", PROMPT, 0, tables[2])
    step = SchedulerOutput((decodes[0], fresh, decodes[1]))
    assert on_kernel(mixed, step) == [True, False]
    together = mixed.execute(step)
    apart = torch.cat([alone.execute(SchedulerOutput((decodes[0],))),
                       alone.execute(SchedulerOutput((fresh,))),
                       alone.execute(SchedulerOutput((decodes[1],)))])
    assert torch.equal(together, apart)


def test_a_prompts_last_token_is_not_a_decode(kernel, tiny_checkpoints):
    # A cached prompt leaves one token to compute: it is a prompt token, computed as in
    # the cold prefill, not on the decode kernel.
    loaded = load(tiny_checkpoints["llama"], "gguf", dtype="bfloat16")
    runner = ModelRunner(loaded, 8, BLOCK)
    last = chunk("a", PROMPT[-1:], len(PROMPT) - 1, [0, 1, 2, 3], prompt=True)
    assert on_kernel(runner, SchedulerOutput((last,))) == [False]


@pytest.mark.parametrize("family, dtype", [("llama", "float32"), ("gemma3", "float32")])
def test_kernel_is_not_used_where_it_does_not_apply(tiny_checkpoints, family, dtype):
    # float32 is the exact reference path: dense weights, the Python path.
    loaded = load(tiny_checkpoints[family], "gguf", dtype=dtype)
    assert not loaded.module.fused_decode_allowed
    assert loaded.module.fused_decoder() is None


def test_the_decode_kernel_can_be_turned_off(kernel, tiny_checkpoints, monkeypatch):
    monkeypatch.setenv("SHOAL_FUSED_DECODE", "0")
    loaded = load(tiny_checkpoints["llama"], "gguf", dtype="bfloat16")
    assert loaded.module.fused_decoder() is None
    assert loaded.module.plan.backend.packs_weights  # the weights stay packed all the same


def test_kernel_is_used_on_the_built_in_model(kernel):
    from shoal.catalog.resolve import DEFAULT_MODEL_ID, resolve_model
    from shoal.engine.models.loader import load_model

    loaded = load_model(resolve_model(DEFAULT_MODEL_ID), "auto")
    # "auto" computes in bf16 with packed weights where the CPU has bf16 (the kernel's
    # case), else in fp32 (the Python path).
    on_bf16 = loaded.compute_dtype == torch.bfloat16
    assert loaded.module.fused_decode_allowed == on_bf16
    assert (loaded.module.fused_decoder() is not None) == on_bf16


# ---- building and loading ------------------------------------------------------------------

@pytest.fixture
def fresh_kernel(monkeypatch, tmp_path):
    """A _Kernel whose build folder is empty and whose compile step is replaced."""
    monkeypatch.setenv("SHOAL_KERNEL_DIR", str(tmp_path))
    return build._Kernel()


def test_a_failed_build_is_logged_once_and_not_retried(fresh_kernel, monkeypatch, caplog):
    calls = []

    def broken_compile(directory):
        calls.append(directory)
        raise RuntimeError("no compiler")

    monkeypatch.setattr(build, "_compile", broken_compile)
    with caplog.at_level(logging.WARNING, logger=build.__name__):
        assert fresh_kernel.load() is None
        assert fresh_kernel.load() is None
    assert len(calls) == 1
    assert "no compiler" in caplog.text


def test_build_folder_follows_the_source(monkeypatch, tmp_path):
    monkeypatch.setenv("SHOAL_KERNEL_DIR", str(tmp_path))
    first = build.build_dir()
    assert first.parent == tmp_path and first.name.startswith(build.NAME)
    edited = tmp_path / "quant_pack.cpp"
    edited.write_text(build.SOURCES[1].read_text() + "\n// edited\n")
    monkeypatch.setattr(build, "SOURCES", (build.SOURCES[0], edited, *build.SOURCES[2:]))
    assert build.build_dir() != first


def test_a_finished_build_loads_without_the_build_lock(kernel, monkeypatch, tmp_path):
    # A process killed while building leaves `lock` behind; loading a finished build must
    # not wait on it.
    import shutil

    monkeypatch.setenv("SHOAL_KERNEL_DIR", str(tmp_path))
    directory = build.build_dir()
    directory.mkdir()
    shutil.copy(kernel.__file__, directory / f"{build.NAME}.so")
    (directory / "lock").touch()
    monkeypatch.setattr(build, "_compile", lambda directory: pytest.fail("must not build"))
    module = build._Kernel().load()
    assert module is not None and hasattr(module, "Decoder")


def test_a_stale_build_lock_is_cleared_before_building(monkeypatch, tmp_path):
    import os
    import time

    from torch.utils import cpp_extension

    monkeypatch.setattr(cpp_extension, "load", lambda *args, **kwargs: "built")
    stale, fresh = tmp_path / "stale", tmp_path / "fresh"
    for directory in (stale, fresh):
        directory.mkdir()
        (directory / "lock").touch()
    old = time.time() - build.STALE_LOCK_S - 60
    os.utime(stale / "lock", (old, old))
    assert build._compile(stale) == "built" and not (stale / "lock").exists()
    assert build._compile(fresh) == "built" and (fresh / "lock").exists()  # a live build's


def test_a_broken_build_is_built_again(monkeypatch, tmp_path):
    monkeypatch.setenv("SHOAL_KERNEL_DIR", str(tmp_path))
    monkeypatch.delenv("SHOAL_FUSED_DECODE", raising=False)
    directory = build.build_dir()
    directory.mkdir()
    library = directory / f"{build.NAME}.so"
    library.write_bytes(b"\x7fELF truncated")  # a build killed while linking
    rebuilt = object()

    def fresh_compile(path):
        assert path == directory and not library.exists()  # the broken file is gone first
        return rebuilt

    monkeypatch.setattr(build, "_compile", fresh_compile)
    assert build._Kernel().load() is rebuilt


def test_the_kernels_link_the_cxx_runtime_torch_loaded(monkeypatch, tmp_path):
    # A compiler whose own C++ library is static only would put a second runtime in the
    # extension, whose first number formatted into an error message crashed the process
    # (seen on an image whose $CXX wrapper links libstdc++.a alone).
    from pathlib import Path

    from torch.utils import cpp_extension

    runtime = build._cxx_runtime()
    assert len(runtime) == 1 and Path(runtime[0]).name.startswith("libstdc++.so")
    assert Path(runtime[0]).is_file()
    seen = {}
    monkeypatch.setattr(cpp_extension, "load", lambda *args, **kwargs: seen.update(kwargs))
    build._compile(tmp_path / "kernels")
    assert seen["extra_ldflags"] == runtime


def test_bf16_rows_are_normed_in_one_rounding(kernel):
    from shoal.engine.models.layers.norm import RMSNorm

    generator = torch.Generator().manual_seed(21)
    x = (torch.randn(37, 640, generator=generator) * 3).bfloat16()
    weight = (torch.rand(640, generator=generator) + 0.5).bfloat16()
    norm = RMSNorm(weight, 1e-6, kernel.rms_norm_rows)
    ours = norm(x)
    assert ours.dtype == torch.bfloat16 and ours.shape == x.shape
    # float32 arithmetic, rounded once: within half a bf16 step of the float32 result.
    exact = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6) * weight.float()
    assert ((ours.float() - exact).abs() <= exact.abs() * 2**-8 + 1e-6).all()
    assert torch.equal(norm(x[5:9]), ours[5:9])  # each row alone
    assert torch.equal(norm(x.float()), torch.nn.functional.rms_norm(
        x.float(), (640,), weight, 1e-6))  # other inputs take torch's
    with pytest.raises(RuntimeError, match=r"weight must be \[640\] bfloat16"):
        kernel.rms_norm_rows(x, weight[:320], 1e-6)
    with pytest.raises(RuntimeError, match="x must be"):
        kernel.rms_norm_rows(x.float(), weight, 1e-6)
