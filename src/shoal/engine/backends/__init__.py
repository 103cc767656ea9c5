"""Execution backends: how the engine's layers compute (base.Backend).

CpuKernels runs the compiled CPU kernels on packed weights; TorchBackend runs torch's
operators on dense weights (float32 compute, and any device torch runs on). choose_backend
picks one at load.
"""

from shoal.engine.backends.base import Backend
from shoal.engine.backends.choose import choose_backend
from shoal.engine.backends.cpu_kernels import CpuKernels
from shoal.engine.backends.plain_torch import TorchBackend

__all__ = ["Backend", "CpuKernels", "TorchBackend", "choose_backend"]
