"""The backend's load-time choices: float32 CPU weights stream (W @ x.T for the row counts
where that reads W faster) only on CPUs whose x @ W.T is the slow one, with the same values
either way."""

from __future__ import annotations

import pytest
import torch

from shoal.engine.backends import base
from shoal.engine.backends.plain_torch import TorchBackend


@pytest.mark.parametrize("vendor, dtype, streams", [
    ("AuthenticAMD", torch.float32, True),
    ("GenuineIntel", torch.float32, False),
    ("", torch.float32, False),
    ("AuthenticAMD", torch.bfloat16, False),
])
def test_float32_weights_stream_on_amd_cpus_only(monkeypatch, vendor, dtype, streams):
    monkeypatch.setattr(base, "cpu_vendor", lambda: vendor)
    backend = TorchBackend(torch.device("cpu"), dtype)
    assert backend.streams_weight is streams
    assert backend.dense_linear(torch.ones(8, 4, dtype=dtype)).streams_weight is streams


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 16])
def test_a_streamed_linear_gives_what_f_linear_gives(rows):
    generator = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(48, 32, generator=generator), torch.randn(48, generator=generator)
    x = torch.randn(rows, 32, generator=generator)
    streamed = TorchBackend(torch.device("cpu"), torch.float32).dense_linear(weight, bias)
    streamed.streams_weight = True
    torch.testing.assert_close(streamed(x), torch.nn.functional.linear(x, weight, bias))
