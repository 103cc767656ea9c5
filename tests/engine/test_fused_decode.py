"""The compiled decode kernel (engine/kernels) against the Python path it replaces."""

from __future__ import annotations

import logging
import threading

import pytest
import tiny_models
import torch
from forward_helpers import chunk
from test_models import BLOCK, PROMPT, load, shuffled_blocks
from tiny_models import VOCAB

from shoal.engine.kernels import build
from shoal.engine.kernels.decode import FUSED_MAX_ROWS
from shoal.engine.model_runner import ModelRunner
from shoal.engine.models.layers.linear import QUANT_MAX_ROWS, Int4Linear
from shoal.engine.scheduler_output import SchedulerOutput

# Rows of different context lengths; more than QUANT_MAX_ROWS of them run the dense copies.
PROMPTS = [PROMPT, PROMPT[:5], PROMPT[3:] + PROMPT, PROMPT[7:], PROMPT * 2, PROMPT[:1]]
BLOCKS_PER_ROW = 8


@pytest.fixture(scope="module")
def kernel():
    module = build.KERNEL.load()
    assert module is not None, "the decode kernel did not build (see the warning logged)"
    return module


def runners(checkpoint, fused: bool, num_blocks: int = BLOCKS_PER_ROW * len(PROMPTS)):
    loaded = load(checkpoint, "gguf", dtype="bfloat16")
    loaded.module.fused_decode_allowed = fused
    return ModelRunner(loaded, num_blocks, BLOCK)


def prefill(runner: ModelRunner, tables, prompts=PROMPTS) -> None:
    """Each prompt prefilled on its own (the Python path, on either runner)."""
    for i, (prompt, blocks) in enumerate(zip(prompts, tables)):
        runner.execute(SchedulerOutput((chunk(str(i), prompt, 0, blocks),)))


def decode_step(runner: ModelRunner, tokens, tables, lengths) -> tuple[torch.Tensor, bool]:
    """One decode step of every row: (logits, whether it ran on the kernel)."""
    output = SchedulerOutput(tuple(chunk(str(i), [t], n, blocks) for i, (t, n, blocks)
                                   in enumerate(zip(tokens, lengths, tables))))
    with torch.inference_mode():
        meta, ids = runner.prepare(output)
        return runner.execute_prepared(meta, ids), meta.decode is not None


# Head shapes beside the tiny models' own (head size 16, 2 query heads per KV head):
# a head size with no vector form (8: the scalar loop), and 8 query heads per KV head
# (the vector form takes them 4 at a time).
SHAPES = {"head-size-8": {"num_attention_heads": 8, "num_key_value_heads": 2},
          "group-of-8": {"num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 16}}


@pytest.fixture(scope="module")
def shaped_checkpoints(tmp_path_factory):
    return {name: tiny_models.build("llama", tmp_path_factory.mktemp(name), **shape)
            for name, shape in SHAPES.items()}


@pytest.mark.parametrize("rows", [3, len(PROMPTS)])  # 6 rows: the dense copies
@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: q/k/v biases
def test_kernel_decode_matches_the_python_path(kernel, tiny_checkpoints, family, rows):
    assert len(PROMPTS) > QUANT_MAX_ROWS >= 3
    assert_decode_matches(tiny_checkpoints[family], PROMPTS[:rows])


@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_decode_matches_for_other_head_shapes(kernel, shaped_checkpoints, shape):
    assert_decode_matches(shaped_checkpoints[shape], PROMPTS)


def test_kernel_decode_matches_with_its_threads(kernel, tiny_checkpoints):
    # 12 rows of ~80 keys: the row passes and attention run on torch's intra-op threads.
    assert torch.get_num_threads() > 1
    prompts = [(PROMPT * 7)[i:] for i in range(12)]
    assert_decode_matches(tiny_checkpoints["llama"], prompts)


def assert_decode_matches(checkpoint, prompts) -> None:
    rows = len(prompts)
    per_row = -(-(max(len(p) for p in prompts) + 6) // BLOCK)  # blocks for prompt + 6 steps
    fused, python = (runners(checkpoint, on_kernel, per_row * rows) for on_kernel in (True, False))
    # Each row's blocks scattered over the cache, so keys are read through the table.
    order = shuffled_blocks(per_row * rows, seed=3)
    tables = [order[i * per_row:(i + 1) * per_row] for i in range(rows)]
    prefill(fused, tables, prompts)
    prefill(python, tables, prompts)
    lengths = [len(p) for p in prompts]
    tokens = [(7 + 31 * i) % VOCAB for i in range(rows)]
    for _ in range(6):  # the same tokens fed to both: every step compares like with like
        ours, on_kernel = decode_step(fused, tokens, tables, lengths)
        theirs, on_python = decode_step(python, tokens, tables, lengths)
        assert on_kernel and not on_python
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
            assert ours[:, slot].abs().sum() > 0
            torch.testing.assert_close(ours[:, slot], theirs[:, slot], atol=0.02, rtol=0.02)


def test_kernel_takes_decode_steps_up_to_its_row_limit(kernel, tiny_checkpoints):
    loaded = load(tiny_checkpoints["llama"], "gguf", dtype="bfloat16")
    runner = ModelRunner(loaded, FUSED_MAX_ROWS + 2, BLOCK)
    assert runner.model.fused_decoder().max_rows == FUSED_MAX_ROWS  # dense copies present
    many = FUSED_MAX_ROWS + 1
    decodes = [chunk(str(i), [9], 3, [i]) for i in range(many)]
    assert runner.prepare(SchedulerOutput(tuple(decodes[:-1])))[0].decode is not None
    assert runner.prepare(SchedulerOutput(tuple(decodes)))[0].decode is None
    mixed = (decodes[0], chunk("new", [1, 2], 0, [many]))
    assert runner.prepare(SchedulerOutput(mixed))[0].decode is None  # a prefill chunk


def test_without_dense_copies_the_kernel_takes_few_rows(kernel, tiny_checkpoints):
    loaded = load(tiny_checkpoints["llama"], "gguf", dtype="bfloat16")
    for module in loaded.module.modules():
        if isinstance(module, Int4Linear):
            module.dense = None  # as when the dense copies do not fit in memory
    runner = ModelRunner(loaded, 8, BLOCK)
    assert runner.model.fused_decoder().max_rows == QUANT_MAX_ROWS
    decodes = [chunk(str(i), [9], 3, [i]) for i in range(QUANT_MAX_ROWS + 1)]
    assert runner.prepare(SchedulerOutput(tuple(decodes[:-1])))[0].decode is not None
    assert runner.prepare(SchedulerOutput(tuple(decodes)))[0].decode is None


@pytest.mark.parametrize("family, dtype", [("llama", "float32"), ("gemma3", "bfloat16"),
                                           ("qwen3", "bfloat16")])
def test_kernel_is_not_used_where_it_does_not_apply(tiny_checkpoints, family, dtype):
    # fp32 is the exact reference path; Gemma 3 and Qwen3 have q/k norms the kernel lacks.
    loaded = load(tiny_checkpoints[family], "gguf", dtype=dtype)
    assert not loaded.module.fused_decode_allowed
    assert loaded.module.fused_decoder() is None


def test_kernel_is_used_on_the_built_in_model(kernel):
    from shoal.catalog.resolve import DEFAULT_MODEL_ID, resolve_model
    from shoal.engine.models.loader import load_model

    loaded = load_model(resolve_model(DEFAULT_MODEL_ID), "auto")
    # "auto" computes in bf16 with 4-bit weights where the CPU has bf16 (the kernel's case),
    # else in fp32 (the Python path).
    on_kernel = loaded.compute_dtype == torch.bfloat16
    assert loaded.module.fused_decode_allowed == on_kernel
    assert (loaded.module.fused_decoder() is not None) == on_kernel


# ---- building and loading ------------------------------------------------------------------

@pytest.fixture
def fresh_kernel(monkeypatch, tmp_path):
    """A _Kernel whose build folder is empty and whose compile step is replaced."""
    monkeypatch.setenv("SHOAL_KERNEL_DIR", str(tmp_path))
    monkeypatch.delenv("SHOAL_FUSED_DECODE", raising=False)
    return build._Kernel()


def test_a_missing_kernel_builds_in_the_background(fresh_kernel, monkeypatch):
    release = threading.Event()
    built = object()

    def slow_compile(directory):
        assert release.wait(10)
        return built

    monkeypatch.setattr(build, "_compile", slow_compile)
    assert fresh_kernel.get() is None  # not built: the caller decodes on the Python path
    assert fresh_kernel.get() is None  # and a second ask starts no second build
    release.set()
    fresh_kernel._thread.join(10)
    assert fresh_kernel.get() is built


def test_a_failed_build_is_logged_once_and_not_retried(fresh_kernel, monkeypatch, caplog):
    calls = []

    def broken_compile(directory):
        calls.append(directory)
        raise RuntimeError("no compiler")

    monkeypatch.setattr(build, "_compile", broken_compile)
    with caplog.at_level(logging.WARNING, logger=build.__name__):
        assert fresh_kernel.load() is None
        assert fresh_kernel.load() is None
        assert fresh_kernel.get() is None
    assert len(calls) == 1
    assert "no compiler" in caplog.text


def test_the_kernel_can_be_turned_off(fresh_kernel, monkeypatch):
    monkeypatch.setattr(build, "_compile", lambda directory: pytest.fail("must not build"))
    monkeypatch.setenv("SHOAL_FUSED_DECODE", "0")
    assert fresh_kernel.get() is None


def test_build_folder_follows_the_source(monkeypatch, tmp_path):
    monkeypatch.setenv("SHOAL_KERNEL_DIR", str(tmp_path))
    first = build.build_dir()
    assert first.parent == tmp_path and first.name.startswith(build.NAME)
    edited = tmp_path / "decode.cpp"
    edited.write_text(build.SOURCE.read_text() + "\n// edited\n")
    monkeypatch.setattr(build, "SOURCE", edited)
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
    module = build._Kernel().get()
    assert module is not None and hasattr(module, "LlamaDecoder")


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
