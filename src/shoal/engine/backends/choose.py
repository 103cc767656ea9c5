"""choose_backend: which backend a model loads with, decided once at load."""

from __future__ import annotations

import logging

import torch

from shoal.engine.backends.base import Backend
from shoal.engine.backends.cpu_kernels import CpuKernels
from shoal.engine.backends.plain_torch import TorchBackend
from shoal.engine.kernels.build import KERNEL

log = logging.getLogger(__name__)


def choose_backend(device: torch.device, compute_dtype: torch.dtype) -> Backend:
    """The compiled kernels where weights can stay packed (CPU, bf16 compute, a CPU with
    AVX512-BF16 or AVX2); plain torch otherwise, with dequantized weights (said once in the
    log when it is a loss)."""
    kernel = KERNEL.load()  # also unpacks GGUF types for torch, wherever it built
    if device.type == "cpu" and compute_dtype == torch.bfloat16:
        if kernel is not None and kernel.quant_fast_kernels():
            return CpuKernels(kernel)
        log.warning("no packed-weight kernel on this machine: weights load dequantized "
                    "(about 3-4x the memory of a 4-bit file)")
    return TorchBackend(device, compute_dtype, unpacker=kernel)
