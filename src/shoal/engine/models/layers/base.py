"""Layer: the nn.Module base of the decoder's parts, without per-call Python overhead.

A batch-1 decode step calls ~10 modules per block (~300 per step). nn.Module.__call__ runs
its hook machinery on each (~2 us here) and reading a submodule attribute goes through
nn.Module.__getattr__ (~0.8 us): together about 1 ms of a ~10 ms step. Layers use no hooks,
so calling forward directly is the same computation.
"""

from __future__ import annotations

from typing import Any

from torch import nn


class Layer(nn.Module):
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        modules = self.__dict__.get("_modules")
        if modules is not None and name in modules:
            # Registered in _modules as usual; the __dict__ copy only makes reads fast.
            self.__dict__[name] = value

    def __delattr__(self, name: str) -> None:
        if name in self._modules:
            del self.__dict__[name]
        super().__delattr__(name)
