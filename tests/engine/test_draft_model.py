"""The draft model proposer on a tiny random model: its KV follows the context it is given
(rejected guesses are cut, only new tokens are fed), its blocks come back, and a draft whose
tokenizer differs from the target's is refused, naming both."""

from __future__ import annotations

import asyncio

import pytest
import torch

from shoal.catalog.resolve import ModelNotFound, resolve_model
from shoal.engine.config import ModelSource
from shoal.engine.speculation.draft import (
    DraftMismatch,
    DraftModel,
    DraftSource,
    check_draft_pair,
)
from shoal.engine.speculation.proposer import common_prefix
from tests.engine import tiny_models


@pytest.fixture(scope="module")
def tiny_source(tmp_path_factory) -> ModelSource:
    checkpoint = tiny_models.build("llama", tmp_path_factory.mktemp("tiny"))
    return ModelSource(model_id="tiny-llama", format="safetensors",
                       path=checkpoint.safetensors_dir)


def draft_of(source: ModelSource, num_blocks: int = 16) -> DraftModel:
    return DraftModel.load(source, "float32", "cpu", num_blocks=num_blocks, block_size=4,
                           vocab_size=tiny_models.VOCAB)


def test_common_prefix_counts_the_shared_head():
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix([], [1]) == 0
    assert common_prefix([1, 2], [1, 2, 3]) == 2


def test_a_proposal_is_the_greedy_continuation_and_follows_rejections(tiny_source):
    draft = draft_of(tiny_source)
    context = [5, 17, 3, 99, 42, 8, 61]
    first = draft.propose("r", context, 4)
    assert len(first.tokens) == 4 and all(0 <= t < tiny_models.VOCAB for t in first.tokens)
    assert all(0.0 < p <= 1.0 for p in first.probs)
    # The guesses continue each other: proposing from the context plus the first guess
    # starts with the second.
    fresh = draft_of(tiny_source)
    assert fresh.propose("x", context + first.tokens[:1], 3).tokens == first.tokens[1:]

    # The target kept one guess, then chose another token: the draft's copy is cut back to
    # the shared prefix and only the new tokens are fed, giving what a fresh draft gives.
    rejected = (first.tokens[1] + 1) % tiny_models.VOCAB
    context2 = context + [first.tokens[0], rejected]
    again = draft.propose("r", context2, 4)
    reference = draft_of(tiny_source).propose("y", context2, 4)
    assert again.tokens == reference.tokens
    assert again.probs == pytest.approx(reference.probs, rel=1e-4)


def test_sessions_hold_blocks_until_forgotten_and_never_exceed_the_pool(tiny_source):
    draft = draft_of(tiny_source, num_blocks=6)  # 24 token slots
    total = draft.pool.num_free_blocks
    assert draft.propose("a", list(range(10)), 4) is not None
    assert draft.pool.num_free_blocks < total
    # A second session that does not fit gets no proposal (the step goes on unguessed).
    assert draft.propose("b", list(range(20)), 4) is None
    draft.forget("a")
    draft.forget("b")
    assert draft.pool.num_free_blocks == total
    # A context near the end of the cache gets fewer guesses, not an error.
    near_end = draft.propose("c", list(range(22)), 8)
    assert near_end is not None and len(near_end.tokens) == 3


def test_the_draft_reads_its_own_probabilities():
    draft = DraftModel.__new__(DraftModel)
    draft.vocab_size = 4
    logits = torch.tensor([0.0, 2.0, 1.0, 0.5, 9.0])  # the last id is beyond the target's
    token, prob = draft._pick(logits)
    assert token == 1
    assert prob == pytest.approx(float(torch.softmax(logits[:4], 0)[1]))


@pytest.mark.slow
def test_a_draft_with_another_tokenizer_is_refused_naming_both():
    try:
        target = resolve_model("gemma3-270m")
        draft = resolve_model("smollm2-135m-instruct")
        same = resolve_model("qwen2.5-coder-0.5b-instruct")
        other = resolve_model("qwen2.5-coder-1.5b-instruct")
    except ModelNotFound as missing:
        pytest.skip(str(missing))
    with pytest.raises(DraftMismatch) as refused:
        check_draft_pair(target, draft)
    assert target.model_id in str(refused.value) and draft.model_id in str(refused.value)
    check_draft_pair(other, same)  # the Qwen2.5-Coder pair shares one tokenizer


def test_a_proposer_node_s_draft_loads_on_the_first_ask_and_guesses_greedily(tiny_source):
    """--propose-for TARGET=draft:MODEL: the service's source, asked through the relay as
    a verifier on the same node would be, guesses what the draft model guesses."""
    from shoal.cluster.cards import CapabilityCard, ModelRole
    from shoal.cluster.proposal_relay import ProposalRelay
    from shoal.cluster.proposer_service import ProposerConfig, ProposerService
    from shoal.cluster.transport import MemoryHub

    source = f"draft:{tiny_source.path}"
    context = [5, 17, 3, 99, 42, 8, 61]
    reference = DraftModel.load(tiny_source, "auto", "cpu", num_blocks=16, block_size=4,
                                vocab_size=tiny_models.VOCAB).propose("x", context, 3)

    async def ask():
        alone = MemoryHub().connect("solo")
        service = ProposerService(alone, ProposerConfig(offers={"tiny": source}))
        card = CapabilityCard(node_id="solo", announced_at=0.0, ttl_s=1e12, models=(
            ModelRole(model="tiny", role="proposer", source=source),))
        relay = ProposalRelay(alone, lambda: [card], local=service)
        answer = await relay.ask("tiny", "r", 0, context, 3, timeout_s=60.0)
        await service.stop()
        return answer

    answer = asyncio.run(ask())
    assert answer["outcome"] == "ok"
    assert answer["tokens"] == reference.tokens
    assert answer["probs"] == pytest.approx(reference.probs, rel=1e-3)


def test_a_draft_source_needs_a_model_name():
    with pytest.raises(ValueError, match="draft:MODEL"):
        DraftSource("", resolve=lambda name: None)
