"""Speculative decoding without a model: guesses, their verification, the adaptive length,
and the scheduler's side (drafts in a step, the KV tail cut, the prefix cache)."""

from __future__ import annotations

import time

import pytest

from shoal.engine.kv.prefix_cache import extend_block_hashes
from shoal.engine.request import Request
from shoal.engine.sampling import InvalidParameter, SamplingParams
from shoal.engine.scheduler import Scheduler, SchedulerConfig
from shoal.engine.speculation.config import SpeculativeConfig, parse_assignment
from shoal.engine.speculation.length import DraftLength, StepCosts, expected_tokens
from shoal.engine.speculation.ngram import NgramIndex
from shoal.engine.speculation.proposer import Proposal
from shoal.engine.speculation.speculator import Speculator
from shoal.engine.speculation.verify import kept_tokens

EOS = 0


# ---- guesses ------------------------------------------------------------------------------

def index_of(tokens, **sizes) -> NgramIndex:
    index = NgramIndex(**sizes)
    index.extend(tokens)
    return index


def test_ngram_proposes_what_followed_the_latest_earlier_occurrence_of_the_tail():
    #          0  1  2  3  4  5  6  7  8  9 10
    tokens = [5, 6, 7, 8, 1, 5, 6, 9, 2, 5, 6]
    # Tail (5, 6) occurred at 0 and 5; the latest earlier one is followed by 9, 2, 5, 6.
    assert index_of(tokens).propose(3) == [9, 2, 5]
    assert index_of(tokens).propose(10) == [9, 2, 5, 6]  # never past the end


def test_ngram_prefers_the_longest_matching_tail():
    tokens = [1, 2, 3, 40, 9, 2, 3, 50, 1, 2, 3]
    # (2, 3) last occurred before 50, but (1, 2, 3) matches longer: before 40.
    assert index_of(tokens).propose(2) == [40, 9]


def test_ngram_has_no_guess_for_a_new_tail_and_never_matches_the_tail_itself():
    assert index_of([1, 2, 3, 4]).propose(4) == []
    assert index_of([7]).propose(4) == []
    assert index_of([3, 3]).propose(2) == []  # (3, 3) only occurs as the tail


def test_ngram_index_grows_with_accepted_tokens():
    index = index_of([4, 5, 6, 7])
    assert index.propose(2) == []
    index.extend([4, 5])
    assert index.propose(2) == [6, 7]
    index.extend([6, 8, 4, 5])
    assert index.propose(2) == [6, 8]  # the latest occurrence wins


def test_verification_keeps_the_agreeing_prefix_and_one_token_of_the_model():
    assert kept_tokens([7, 8, 9], [7, 8, 9, 4]) == [7, 8, 9, 4]  # all kept, plus a bonus
    assert kept_tokens([7, 8, 9], [7, 3, 9, 4]) == [7, 3]        # second guess wrong
    assert kept_tokens([7, 8, 9], [1, 8, 9, 4]) == [1]           # first guess wrong
    with pytest.raises(ValueError):
        kept_tokens([7, 8], [7])


@pytest.mark.parametrize("text, expected", [
    ("ngram", SpeculativeConfig("ngram")),
    ("ngram:4", SpeculativeConfig("ngram", 4)),
    ("draft:qwen2.5-coder-0.5b-instruct", SpeculativeConfig("draft", 10,
                                                           "qwen2.5-coder-0.5b-instruct")),
    ("draft:my:model:3", SpeculativeConfig("draft", 3, "my:model")),
])
def test_speculative_setting_parses(text, expected):
    assert SpeculativeConfig.parse(text) == expected


@pytest.mark.parametrize("text", ["ngram:0", "ngram:17", "ngram:x", "draft", "draft:",
                                  "medusa", "model"])
def test_bad_speculative_settings_are_refused(text):
    with pytest.raises(ValueError):
        parse_assignment(text if "=" in text else f"smollm2={text}")


def test_speculative_assignment_names_the_model():
    assert parse_assignment("qwen=ngram:3") == ("qwen", SpeculativeConfig("ngram", 3))
    with pytest.raises(ValueError, match="MODEL=ngram"):
        parse_assignment("ngram")


# ---- how many to guess ----------------------------------------------------------------

def test_expected_tokens_follow_the_kept_rate():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_draft_length_grows_with_kept_guesses_and_rests_when_they_do_not_pay():
    costs = StepCosts()
    length = DraftLength(8, costs)
    for _ in range(6):
        length.record(4, 4)
    assert length.wanted() == 1  # nothing measured yet: one guess first
    costs.observe(1, 0.0135)
    assert length.wanted() == 0  # a plain step, to price the guessing step against
    costs.observe(0, 0.010)
    tried = []
    for _ in range(4):  # near-certain guesses: twice as many as each length is measured
        guesses = length.wanted()
        tried.append(guesses)
        costs.observe(guesses, 0.010 * (1 + 0.35 * guesses))
        length.record(guesses, guesses)
    assert tried == [2, 4, 8, 8]
    for _ in range(8):
        length.record(3, 0)
    assert length.wanted() == 0  # nothing kept: a plain step is worth more
    rests = 1
    while length.wanted() == 0:
        rests += 1
        assert rests < 100
    assert rests >= 8  # it rested, then tries again with fresh hopes


def test_an_unmeasured_length_is_priced_at_the_nearest_measured_cost_per_guess():
    costs = StepCosts()
    costs.observe(0, 0.010)
    costs.observe(1, 0.019)  # a draft model: one guess costs 0.9 of a plain step
    assert abs(costs.relative(3) - 3.7) < 1e-9
    costs.observe(4, 0.070)
    assert abs(costs.relative(6) - (1 + 6 * 6.0 / 4)) < 1e-9  # from 4, the nearest below
    assert costs.largest_measured() == 4


def test_measured_costs_decide_the_length():
    costs = StepCosts()
    costs.observe(0, 0.010)
    for guesses in range(1, 9):
        costs.observe(guesses, 0.010 * (1 + guesses))  # each guess as dear as a plain step
    length = DraftLength(8, costs)
    assert length.wanted() == 0  # a 60% kept rate cannot pay for that


def test_speculator_guesses_for_requests_that_ask_and_refuses_a_missing_draft_model():
    speculator = Speculator(None, "smollm2")
    prompt = [1, 2, 3, 4, 1, 2]
    speculator.add("on", prompt, SamplingParams(speculative="ngram"), constrained=False)
    speculator.add("off", prompt, SamplingParams(), constrained=False)
    speculator.add("grammar", prompt, SamplingParams(speculative="ngram"), constrained=True)
    requests = [Request(rid, prompt, SamplingParams(max_tokens=5))
                for rid in ("on", "off", "grammar")]
    speculator.propose(requests, max_rows=64)
    guessed, off, constrained = (r.draft_token_ids for r in requests)
    assert guessed and guessed == [3, 4, 1, 2][:len(guessed)]  # the length is adaptive
    assert off == constrained == []
    with pytest.raises(InvalidParameter, match="no draft model") as refused:
        speculator.add("draft", prompt, SamplingParams(speculative="draft"), constrained=False)
    assert refused.value.param == "x_speculative"


def test_guesses_never_reach_past_max_tokens():
    speculator = Speculator(SpeculativeConfig("ngram", 8), "m")
    speculator.add("r", [1, 2, 3, 4, 5, 1, 2], SamplingParams(), constrained=False)
    request = Request("r", [1, 2, 3, 4, 5, 1, 2], SamplingParams(max_tokens=3))
    request.output_token_ids = [3]
    speculator.propose([request], max_rows=64)
    assert request.draft_token_ids == [4]  # 1 output + 1 kept guess + 1 own token = 3


def measured_cheap(costs: StepCosts, most: int) -> None:
    """Steps of every length up to `most` measured, each guess a tenth of a plain step."""
    costs.observe(0, 0.010)
    for guesses in range(1, most + 1):
        costs.observe(guesses, 0.010 * (1 + 0.1 * guesses))


class SlowFeeder:
    """A Proposer whose first ask for a request feeds it the context at 0.5 ms a token."""

    def __init__(self) -> None:
        self.asked: list[str] = []
        self._fed: set[str] = set()

    def propose(self, request_id, context, k):
        if request_id not in self._fed:
            time.sleep(0.0005 * len(context))
            self._fed.add(request_id)
        self.asked.append(request_id)
        return Proposal(tokens=[7] * k, probs=[1.0] * k)

    def forget(self, request_id) -> None:
        self._fed.discard(request_id)


def test_a_proposer_is_fed_a_long_context_only_where_guessing_would_pay_for_it():
    feeder = SlowFeeder()
    speculator = Speculator(SpeculativeConfig("draft", 8, "d"), "m", feeder)
    measured_cheap(speculator.proposer_costs, 8)  # a plain step: 10 ms
    params = SamplingParams(max_tokens=100)

    def first_guesses(request_id: str, prompt: list[int]) -> list[int]:
        speculator.add(request_id, prompt, params, constrained=False)
        request = Request(request_id, prompt, params)
        speculator.propose([request], max_rows=64)
        return request.draft_token_ids

    # The first ask is priced by nothing: it is made, and its feeding time measured.
    assert first_guesses("short", [1] * 40)
    # Feeding 4,000 tokens (~2 s) costs more than guessing can save over 100 tokens of
    # 10 ms (under 1 s at any kept rate): that request decodes alone.
    assert first_guesses("long", [1] * 4000) == [] and "long" not in feeder.asked
    # 40 more tokens (~20 ms) still pay, and so do 400 (~0.2 s) while guesses are kept.
    assert first_guesses("another", [2] * 40)
    assert first_guesses("medium", [3] * 400)
    # Once the Proposer's guesses have been rejected over and over, on other requests
    # too, no catch-up pays: a new request is not fed to it.
    for _ in range(30):
        speculator.record("another", 4, 0)
    assert first_guesses("later", [4] * 400) == [] and "later" not in feeder.asked
    # Each request turned away moves the rate back towards the hopeful start, so a run of
    # them is not held against every later request.
    turned_away = 0
    while not first_guesses(f"r{turned_away}", [5] * 400):
        turned_away += 1
        assert turned_away < 60, "the rate never recovered"
    assert turned_away >= 3


def test_guesses_keep_the_step_within_the_fused_kernel_s_rows():
    speculator = Speculator(SpeculativeConfig("ngram", 8), "m")
    measured_cheap(speculator.costs, 8)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2]
    requests = [Request(f"r{i}", prompt, SamplingParams()) for i in range(3)]
    for request in requests:
        speculator.add(request.request_id, prompt, SamplingParams(), constrained=False)
    speculator.propose(requests, max_rows=8)  # 3 rows of their own leave 5 for guesses
    assert sum(len(r.draft_token_ids) for r in requests) == 5


def test_a_bad_per_request_choice_names_the_field():
    with pytest.raises(InvalidParameter) as bad:
        SamplingParams(speculative="maybe")
    assert bad.value.param == "x_speculative"


# ---- the scheduler's side ---------------------------------------------------------------

def make_scheduler(num_blocks=32, block_size=4, budget=64, max_model_len=256) -> Scheduler:
    return Scheduler(SchedulerConfig(num_blocks=num_blocks, block_size=block_size,
                                     max_num_batched_tokens=budget, max_num_seqs=4,
                                     max_model_len=max_model_len), eos_token_ids=[EOS])


def decoding_request(scheduler: Scheduler, prompt, first_token=20, **params) -> Request:
    """A request past its prompt, about to decode (its first token sampled)."""
    request = Request("r", list(prompt), SamplingParams(max_tokens=50, **params))
    scheduler.add(request)
    output = scheduler.schedule()
    scheduler.update(output, {"r": first_token})
    return request


def test_drafts_ride_in_the_decode_chunk_and_rejected_ones_give_their_blocks_back():
    scheduler = make_scheduler()
    request = decoding_request(scheduler, range(1, 8))  # 7 prompt tokens + 1 output
    assert len(request.block_ids) == 2
    request.draft_token_ids = [21, 22, 23, 24, 25, 26]
    output = scheduler.schedule()
    (chunk,) = output.chunks
    assert chunk.token_ids == (20, 21, 22, 23, 24, 25, 26)
    assert (chunk.start_position, chunk.num_drafts, chunk.num_logits) == (7, 6, 7)
    assert len(request.block_ids) == 4  # room for 14 positions
    assert request.draft_token_ids == []  # consumed
    # The model agreed with two guesses, then chose 99.
    scheduler.update(output, {"r": [21, 22, 99]})
    assert request.output_token_ids == [20, 21, 22, 99]
    assert request.num_computed_tokens == 10  # prompt, 20, 21, 22: KV of 23..26 dropped
    assert request.num_tokens == 11
    assert len(request.block_ids) == 3  # the fourth block held only rejected guesses
    assert scheduler.pool.num_used_blocks == 3
    assert (request.num_draft_tokens, request.num_accepted_tokens) == (6, 2)


def test_only_verified_tokens_enter_the_prefix_cache():
    scheduler = make_scheduler()
    request = decoding_request(scheduler, range(1, 7))  # positions 0-5, then 20 at 6
    request.draft_token_ids = [21, 22, 23, 24, 25]      # positions 7-11
    output = scheduler.schedule()
    scheduler.update(output, {"r": [21, 22, 30]})  # 23-25 rejected: their KV is stale
    assert request.num_computed_tokens == 9
    assert request.num_registered_blocks == 2  # block 2 holds 22 and stale guesses
    for token in (31, 32, 33):  # plain steps overwrite the stale slots; block 2 fills
        output = scheduler.schedule()
        assert output.chunks[0].num_drafts == 0
        scheduler.update(output, {"r": token})
    assert request.num_registered_blocks == 3
    tokens = list(range(1, 7)) + [20, 21, 22, 30, 31, 32]
    hashes = extend_block_hashes([], tokens, 4, prompt_len=6)
    # The cache holds exactly the blocks of the verified text, under its hashes.
    assert scheduler.pool.find_cached(hashes) == request.block_ids[:3]
    guessed = extend_block_hashes([], list(range(1, 7)) + [20, 21, 22, 23, 24, 25], 4,
                                  prompt_len=6)
    assert scheduler.pool.find_cached(guessed) == request.block_ids[:2]


def test_drafts_yield_to_the_budget_the_context_and_free_blocks():
    scheduler = make_scheduler(budget=4)
    request = decoding_request(scheduler, range(1, 4))
    request.draft_token_ids = [5, 6, 7, 8, 9]
    assert scheduler.schedule().chunks[0].num_drafts == 3  # 1 + 3 fill the budget of 4
    scheduler = make_scheduler(max_model_len=12)
    request = decoding_request(scheduler, range(1, 9))  # 9 tokens of 12
    request.draft_token_ids = [5, 6, 7, 8, 9]
    assert scheduler.schedule().chunks[0].num_drafts == 2
    scheduler = make_scheduler(num_blocks=5)  # a context of 20
    request = Request("r", list(range(1, 8)), SamplingParams())
    scheduler.add(request)
    scheduler.add(Request("other", list(range(30, 37)), SamplingParams()))
    scheduler.update(scheduler.schedule(), {"r": 20, "other": 40})  # 2 blocks each; 1 free
    request.draft_token_ids = [5, 6, 7, 8, 9, 10]  # 6 would need a 6th block
    chunks = {c.request_id: c for c in scheduler.schedule().chunks}
    assert chunks["r"].num_drafts == 4 and chunks["other"].num_drafts == 0
    assert scheduler.pool.num_free_blocks == 0 and scheduler.num_preemptions == 0


def test_an_end_token_among_kept_guesses_ends_the_request_there():
    scheduler = make_scheduler()
    request = decoding_request(scheduler, range(1, 8))
    request.draft_token_ids = [21, EOS, 23]
    output = scheduler.schedule()
    (finished,) = scheduler.update(output, {"r": [21, EOS, 23, 24]})
    assert finished is request
    assert request.output_token_ids == [20, 21, EOS]
    assert request.finish_reason == "stop"
    assert scheduler.pool.num_used_blocks == 0


def test_a_wrong_count_of_kept_tokens_is_an_error():
    scheduler = make_scheduler()
    request = decoding_request(scheduler, range(1, 8))
    request.draft_token_ids = [21]
    output = scheduler.schedule()
    with pytest.raises(ValueError, match="1 drafts"):
        scheduler.update(output, {"r": [21, 22, 23]})
