"""Sampler: each parameter's effect on hand-made logits, seeds, logprobs, the greedy path."""

from __future__ import annotations

import math

import pytest
import torch

from shoal.engine.sampler import Sampler, SamplingRow, _top_k_top_p
from shoal.engine.sampling import SamplingParams

EOS = 0
VOCAB = 8


def row(prompt=(1,), output=(), generator=None, **params) -> SamplingRow:
    return SamplingRow(params=SamplingParams(**params), prompt_token_ids=list(prompt),
                       output_token_ids=list(output), generator=generator)


def seeded(seed: int) -> torch.Generator:
    generator = torch.Generator()
    generator.manual_seed(seed)
    return generator


def logits_of(*values) -> torch.Tensor:
    return torch.tensor([values], dtype=torch.float32)


def draw_counts(logits: torch.Tensor, n=2000, **params) -> torch.Tensor:
    sampler = Sampler([EOS])
    batch = logits.expand(n, -1)
    result = sampler(batch, [row(**params)] * n)
    return torch.bincount(torch.tensor(result.token_ids), minlength=logits.shape[1])


def test_greedy_fast_path_is_argmax_and_leaves_logits_alone():
    logits = torch.randn(3, VOCAB)
    before = logits.clone()
    result = Sampler([EOS])(logits, [row(temperature=0.0)] * 3)
    assert result.token_ids == logits.argmax(-1).tolist()
    assert result.logprobs == [None, None, None]
    assert torch.equal(logits, before)


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError):
        Sampler([EOS])(torch.zeros(2, VOCAB), [row()])


def test_temperature_sharpens_and_flattens():
    logits = logits_of(0.0, 1.0, 0.0, 0.0)
    cold = draw_counts(logits, temperature=0.1)
    hot = draw_counts(logits, temperature=5.0)
    assert cold[1] > 1950
    assert 300 < hot[0] < 700 and hot[1] < 900


def test_top_k_keeps_only_the_k_best():
    counts = draw_counts(logits_of(3.0, 2.9, 2.8, 0.0, -1.0), top_k=2, temperature=1.0)
    assert counts[2:].sum() == 0 and counts[0] > 0 and counts[1] > 0


def test_top_p_keeps_the_smallest_set_reaching_p():
    # probabilities 0.5, 0.3, 0.2 (up to rounding)
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    counts = draw_counts(logits, top_p=0.6)
    assert counts[2] == 0 and counts[0] > 0 and counts[1] > 0
    only_first = draw_counts(logits, top_p=0.4)
    assert only_first[0] == 2000


def test_top_k_and_top_p_combine():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    counts = draw_counts(logits, top_k=3, top_p=0.65)
    assert counts[2:].sum() == 0 and counts[1] > 0


def test_min_p_drops_tokens_far_below_the_best():
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1]]))
    counts = draw_counts(logits, min_p=0.25)  # threshold 0.15
    assert counts[2] == 0 and counts[1] > 0


def test_repetition_penalty_follows_hf_semantics():
    logits = logits_of(0.0, 2.0, -2.0, 1.9)
    result = Sampler([EOS])(logits, [row(prompt=(1,), output=(2,), temperature=0.0,
                                         repetition_penalty=2.0, logprobs=True,
                                         top_logprobs=4)])
    assert result.token_ids == [3]  # 2.0 / 2 = 1.0 < 1.9
    expected = torch.log_softmax(torch.tensor([0.0, 1.0, -4.0, 1.9]), dim=-1)
    top = dict(result.logprobs[0].top)
    assert top[2] == pytest.approx(float(expected[2]), abs=1e-5)  # -2 * 2 = -4


def test_presence_and_frequency_penalties_count_output_tokens_only():
    logits = logits_of(0.0, 3.0, 2.5, 0.0)
    prompt_only = row(prompt=(1, 1, 1), temperature=0.0, frequency_penalty=1.0)
    twice = row(prompt=(5,), output=(1, 1), temperature=0.0, frequency_penalty=0.3)
    present = row(prompt=(5,), output=(1,), temperature=0.0, presence_penalty=0.6)
    result = Sampler([EOS])(logits.expand(3, -1), [prompt_only, twice, present])
    assert result.token_ids == [1, 2, 2]


def test_logit_bias_moves_tokens():
    logits = logits_of(0.0, 1.0, 0.0)
    result = Sampler([EOS])(logits, [row(temperature=0.0, logit_bias={2: 5.0})])
    assert result.token_ids == [2]
    banned = draw_counts(logits_of(0.0, 5.0, 0.0), logit_bias={1: -100.0}, n=500)
    assert banned[1] == 0


def test_min_tokens_bans_eos_and_stop_ids_until_reached():
    logits = logits_of(9.0, 0.0, 8.0, 1.0)
    sampler = Sampler([EOS])
    early = row(output=(3,), temperature=0.0, min_tokens=2, stop_token_ids=(2,))
    done = row(output=(3, 3), temperature=0.0, min_tokens=2, stop_token_ids=(2,))
    ignoring = row(output=(), temperature=0.0, min_tokens=2, ignore_eos=True)
    result = sampler(logits.expand(3, -1), [early, done, ignoring])
    assert result.token_ids == [3, 0, 0]


def test_logprobs_are_log_softmax_before_temperature():
    logits = logits_of(1.0, 2.0, 3.0, 0.5)
    expected = torch.log_softmax(logits[0], dim=-1)
    result = Sampler([EOS])(logits, [row(temperature=0.3, seed=None, logprobs=True,
                                         top_logprobs=2, generator=seeded(1))])
    sampled = result.logprobs[0]
    assert sampled.token_id == result.token_ids[0]
    assert sampled.logprob == pytest.approx(float(expected[sampled.token_id]), abs=1e-6)
    assert [t for t, _ in sampled.top] == [2, 1]
    assert sampled.top[0][1] == pytest.approx(float(expected[2]), abs=1e-6)
    assert math.exp(sampled.top[0][1]) + math.exp(sampled.top[1][1]) < 1.0


def test_logprobs_only_for_rows_that_ask_and_never_infinite():
    logits = logits_of(5.0, 1.0, 0.0)
    result = Sampler([EOS])(logits.expand(2, -1), [
        row(temperature=0.0, logprobs=True, top_logprobs=3, logit_bias={2: -100.0},
            min_tokens=1),
        row(temperature=0.0)])
    first, second = result.logprobs
    assert second is None
    assert first.token_id == 1 and len(first.top) == 3
    assert all(math.isfinite(lp) for _, lp in first.top)
    assert first.top[0][0] == 1


def test_same_seed_gives_same_tokens_whatever_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(5, 50)
    sampler = Sampler([EOS])

    def tokens(batch_rows, steps=20):
        out = []
        for _ in range(steps):
            out.append(sampler(logits[:len(batch_rows)], batch_rows).token_ids[0])
        return out

    alone = tokens([row(generator=seeded(42))])
    crowded = tokens([row(generator=seeded(42)), row(), row(generator=seeded(7), top_k=5),
                      row(temperature=0.0), row(top_p=0.5)])
    assert alone == tokens([row(generator=seeded(42))]) == crowded
    assert len(set(alone)) > 1
    assert tokens([row(generator=seeded(43))]) != alone


def test_sampling_follows_the_distribution():
    probs = torch.tensor([[0.1, 0.6, 0.3]])
    counts = draw_counts(torch.log(probs), n=6000).float() / 6000
    assert torch.allclose(counts, probs[0], atol=0.03)


def test_mixed_batch_greedy_rows_stay_greedy():
    logits = torch.tensor([[0.0, 1.0, 0.9]] * 2)
    for _ in range(20):
        result = Sampler([EOS])(logits, [row(temperature=0.0, presence_penalty=0.1),
                                         row(temperature=2.0)])
        assert result.token_ids[0] == 1


def reference_kept(logits: torch.Tensor, top_k: int, top_p: float) -> set[int]:
    """Tokens a plain full sort keeps (HF order: top_k, then top_p on the renormalised rest)."""
    values, ids = logits.sort(descending=True)
    if top_k:
        values, ids = values[:top_k], ids[:top_k]
    probs = torch.softmax(values, dim=-1)
    keep = (probs.cumsum(0) - probs) < top_p
    return set(ids[keep].tolist())


@pytest.mark.parametrize("scale,top_k,top_p", [(0.2, 0, 0.9), (4.0, 0, 0.9), (1.0, 3000, 0.8),
                                               (1.0, 5, 0.5), (0.01, 0, 0.3)])
def test_top_k_top_p_keeps_exactly_what_a_full_sort_keeps(scale, top_k, top_p):
    # 5000 tokens: more than the first candidate window, so flat rows must widen it.
    torch.manual_seed(1)
    logits = torch.randn(5000) * scale
    values, ids = _top_k_top_p(logits.unsqueeze(0), torch.tensor([top_k or 5000]),
                               torch.tensor([top_p]))
    kept = set(ids[0][values[0] > float("-inf")].tolist())
    assert kept == reference_kept(logits, top_k, top_p)
    counts = draw_counts(logits.unsqueeze(0), n=200, top_k=top_k, top_p=top_p)
    assert set(torch.nonzero(counts).flatten().tolist()) <= kept
