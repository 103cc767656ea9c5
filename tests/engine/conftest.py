"""Fixtures for the forward-path tests: tiny random checkpoints of every family."""

from __future__ import annotations

import pytest
import tiny_models


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """family -> TinyCheckpoint (safetensors dir + GGUF + transformers references)."""
    directory = tmp_path_factory.mktemp("tiny-models")
    return {family: tiny_models.build(family, directory) for family in tiny_models.FAMILIES}


@pytest.fixture(scope="module")
def kernel():
    """The compiled kernels with their packed-weight paths (test modules that need only
    the kernels define their own; skips on a CPU without AVX2 and FMA or AVX-512, where
    weights load dequantized and decode runs in Python)."""
    from shoal.engine.kernels import build

    module = build.KERNEL.load()
    assert module is not None, "the kernels did not build (see the warning logged)"
    if not module.quant_fast_kernels():
        pytest.skip("this CPU has neither AVX2 with FMA nor AVX-512: weights load "
                    "dequantized, not packed")
    return module


@pytest.fixture(params=["torch", "cpu-kernels"])
def backend(request):
    """A model-level test's backend, as a function of the dtype the test asks for:
    TorchBackend computes in that dtype on dense weights; CpuKernels always computes in
    bfloat16 on packed weights (skips where the kernels have no fast packed paths)."""
    import torch

    from shoal.engine.backends import CpuKernels, TorchBackend
    from shoal.engine.kernels import build

    if request.param == "torch":
        return lambda dtype: TorchBackend(torch.device("cpu"), getattr(torch, dtype),
                                          unpacker=build.KERNEL.load())
    module = request.getfixturevalue("kernel")
    return lambda dtype: CpuKernels(module)
