"""The compiled row attention (kernels attend_rows): prompt rows through the prompt kernel,
generated rows through the decode kernel's arithmetic, each row over its own keys.

A row's result must be a function of its query and its own keys and values alone: whatever
other rows share the call, however its prompt was cut into chunks, the same bits."""

from __future__ import annotations

import pytest
import torch

from shoal.engine.kernels import build
from shoal.engine.kv.quant import dequantize, quantize


@pytest.fixture(scope="module")
def kernel():
    module = build.KERNEL.load()
    assert module is not None, "the kernels did not build (see the warning logged)"
    return module


class Case:
    """Two requests of 70 and 33 positions whose keys lie scattered over a 512-slot cache;
    every position of both is a row (request 1's rows after request 0's)."""

    def __init__(self, dim: int, heads: int, kv_heads: int, dtype: torch.dtype,
                 window: int | None, seed: int = 0, sinks: bool = False) -> None:
        generator = torch.Generator().manual_seed(seed)
        values = torch.randn(2 * kv_heads, 512, dim, generator=generator)
        # An int8 cache holds rows of values and a scale (kv/quant.py).
        self.cache = quantize(values) if dtype == torch.int8 else values.to(dtype)
        order = torch.randperm(512, generator=generator)
        self.key_slots = torch.cat((order[:70], order[100:133]))
        base, position, lo = [], [], []
        for start, length in ((0, 70), (70, 33)):
            for p in range(length):
                base.append(start)
                position.append(p)
                lo.append(0 if window is None else max(0, p - window + 1))
        self.base, self.position, self.lo = (torch.tensor(v) for v in (base, position, lo))
        self.q = torch.randn(len(position), heads, dim, generator=generator)
        self.scale = dim ** -0.5
        self.kv_heads = kv_heads
        # gpt-oss's sink logits per head (some large enough to take most of the weight).
        self.sinks = torch.randn(heads, generator=generator) * 3 if sinks else None

    def run(self, kernel, rows: slice | list[int] = slice(None), prompt: bool = True):
        pick = (lambda t: t[rows])
        return kernel.attend_rows(pick(self.q), self.cache, self.key_slots, pick(self.base),
                                  pick(self.position), pick(self.lo), self.scale, prompt,
                                  self.sinks)

    def reference(self) -> torch.Tensor:
        """Float64 softmax attention, row by row: [rows, heads * dim]."""
        rows, heads, dim = self.q.shape
        group = heads // self.kv_heads
        out = torch.empty(rows, heads, dim, dtype=torch.float64)
        cache = dequantize(self.cache, dim) if self.cache.dtype == torch.int8 else self.cache
        for r in range(rows):
            keys = self.key_slots[self.base[r] + torch.arange(self.lo[r], self.position[r] + 1)]
            for h in range(heads):
                g = h // group
                k = cache[g, keys].double()
                v = cache[self.kv_heads + g, keys].double()
                scores = k @ self.q[r, h].double() * self.scale
                if self.sinks is not None:  # the sink joins the softmax and has no value
                    scores = torch.cat((scores, self.sinks[h:h + 1].double()))
                weights = torch.softmax(scores, dim=0)[:len(keys)]
                out[r, h] = weights @ v
        return out.view(rows, heads * dim)


SHAPES = [  # head size, heads, KV heads, cache dtype, sliding window
    (64, 9, 3, torch.float32, None),
    (64, 14, 2, torch.bfloat16, None),
    (128, 4, 2, torch.bfloat16, None),
    (256, 4, 1, torch.bfloat16, 40),
    (40, 4, 2, torch.float32, 7),  # a head size with no vector form
    (80, 10, 2, torch.bfloat16, None),  # a last column pass of one vector; 5 heads a group
    (64, 14, 2, torch.int8, None),  # int8 rows with their scales
    (128, 4, 2, torch.int8, None),
    (256, 4, 1, torch.int8, 40),
    (40, 4, 2, torch.int8, 7),
]


@pytest.mark.parametrize("shape", SHAPES,
                         ids=lambda s: f"d{s[0]}-h{s[1]}-kv{s[2]}-{str(s[3])[6:]}")
@pytest.mark.parametrize("prompt", [True, False], ids=["prompt", "generated"])
def test_rows_match_float64_attention(kernel, shape, prompt):
    case = Case(*shape)
    out = case.run(kernel, prompt=prompt)
    assert out.dtype == torch.bfloat16 and out.shape == (103, shape[1] * shape[0])
    # bf16 output: within a rounding of the exact result (values are O(1)).
    torch.testing.assert_close(out.double(), case.reference(), atol=1e-2, rtol=8e-3)


@pytest.mark.parametrize("shape", SHAPES,
                         ids=lambda s: f"d{s[0]}-h{s[1]}-kv{s[2]}-{str(s[3])[6:]}")
@pytest.mark.parametrize("prompt", [True, False], ids=["prompt", "generated"])
def test_a_row_does_not_depend_on_what_shares_its_call(kernel, shape, prompt):
    case = Case(*shape)
    together = case.run(kernel, prompt=prompt)
    alone = torch.cat([case.run(kernel, slice(r, r + 1), prompt) for r in range(103)])
    assert torch.equal(together, alone)
    # Chunks cut anywhere (mid-item, mid-request), and rows in another order.
    cuts = [0, 5, 17, 40, 69, 71, 90, 103]
    chunked = torch.cat([case.run(kernel, slice(a, b), prompt) for a, b in zip(cuts, cuts[1:])])
    assert torch.equal(together, chunked)
    reverse = list(range(102, -1, -1))
    assert torch.equal(together[reverse], case.run(kernel, reverse, prompt))


@pytest.mark.parametrize("shape", [(64, 9, 3, torch.float32, None), (16, 4, 2, torch.bfloat16, 8),
                                   (40, 4, 2, torch.float32, 7), (64, 14, 2, torch.int8, 5)],
                         ids=lambda s: f"d{s[0]}-h{s[1]}-kv{s[2]}-{str(s[3])[6:]}")
@pytest.mark.parametrize("prompt", [True, False], ids=["prompt", "generated"])
def test_rows_with_attention_sinks_match_float64_attention(kernel, shape, prompt):
    """gpt-oss: a logit per head joins the softmax's denominator (with no value), in full
    and sliding-window rows; a row still does not depend on what shares its call."""
    case = Case(*shape, sinks=True)
    out = case.run(kernel, prompt=prompt)
    torch.testing.assert_close(out.double(), case.reference(), atol=1e-2, rtol=8e-3)
    without = Case(*shape).run(kernel, prompt=prompt)
    assert (out.double() - without.double()).abs().max() > 0.05  # the sinks took weight
    alone = torch.cat([case.run(kernel, slice(r, r + 1), prompt) for r in range(103)])
    assert torch.equal(out, alone)
    with pytest.raises(RuntimeError, match="one logit per head"):
        kernel.attend_rows(case.q, case.cache, case.key_slots, case.base, case.position,
                           case.lo, case.scale, prompt, case.sinks[:1])


def test_bad_rows_are_refused(kernel):
    case = Case(64, 9, 3, torch.float32, None)
    with pytest.raises(RuntimeError, match="lie outside key_slots"):
        kernel.attend_rows(case.q[:1], case.cache, case.key_slots, case.base[:1],
                           torch.tensor([200]), case.lo[:1], case.scale, True)
    with pytest.raises(RuntimeError, match="lie outside key_slots"):
        kernel.attend_rows(case.q[:1], case.cache, case.key_slots, case.base[:1],
                           torch.tensor([3]), torch.tensor([4]), case.scale, True)
    with pytest.raises(RuntimeError, match="one base, position and lo per row"):
        kernel.attend_rows(case.q[:2], case.cache, case.key_slots, case.base[:1],
                           case.position[:1], case.lo[:1], case.scale, True)
    with pytest.raises(RuntimeError, match="key slot out of range"):
        kernel.attend_rows(case.q[:1], case.cache, case.key_slots + 1000, case.base[:1],
                           case.position[:1], case.lo[:1], case.scale, True)
