"""Scheduler driven in a loop with fake sampled tokens: no torch, no model, milliseconds."""

from __future__ import annotations

import subprocess
import sys

import pytest

from shoal.engine.errors import ContextLengthExceeded
from shoal.engine.request import Request, RequestStatus
from shoal.engine.sampling import SamplingParams
from shoal.engine.scheduler import Scheduler, SchedulerConfig
from shoal.engine.scheduler_output import SchedulerOutput

EOS = 0


def make_scheduler(num_blocks=64, block_size=4, budget=16, max_seqs=8, max_model_len=512,
                   prefix_caching=True) -> Scheduler:
    return Scheduler(SchedulerConfig(num_blocks=num_blocks, block_size=block_size,
                                     max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                                     max_model_len=max_model_len,
                                     enable_prefix_caching=prefix_caching),
                     eos_token_ids=[EOS])


def make_request(request_id, prompt, max_tokens=4, priority=0, **params) -> Request:
    return Request(request_id=request_id, prompt_token_ids=list(prompt), priority=priority,
                   params=SamplingParams(max_tokens=max_tokens, **params))


def fake_token(request: Request) -> int:
    """Deterministic 'model': the next token depends only on the request's tokens so far."""
    tokens = request.prompt_token_ids + request.output_token_ids
    return 10 + (sum(t * (i + 1) for i, t in enumerate(tokens)) % 977)


def check_invariants(scheduler: Scheduler, output: SchedulerOutput) -> None:
    assert output.num_tokens <= scheduler.config.max_num_batched_tokens
    assert scheduler.num_running <= scheduler.config.max_num_seqs
    block_size = scheduler.block_size
    for chunk in output.chunks:
        request = scheduler.get(chunk.request_id)
        assert chunk.start_position == request.num_computed_tokens
        end = chunk.context_len
        assert list(chunk.token_ids) == request.token_ids_slice(chunk.start_position, end)
        assert chunk.needs_sample == (end == request.num_tokens)
        assert len(chunk.block_ids) * block_size >= end
        # Blocks this chunk writes into belong to this request alone.
        for position in (chunk.start_position, end - 1):
            assert scheduler.pool.ref_count(chunk.block_ids[position // block_size]) == 1


def step(scheduler: Scheduler, token_for=fake_token):
    output = scheduler.schedule()
    check_invariants(scheduler, output)
    sampled = {c.request_id: token_for(scheduler.get(c.request_id))
               for c in output.chunks if c.needs_sample}
    return output, scheduler.update(output, sampled)


def run_to_completion(scheduler: Scheduler, max_steps=1000):
    outputs, finished = [], {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished():
            return outputs, finished
        output, done = step(scheduler)
        outputs.append(output)
        finished.update({r.request_id: r for r in done})
    raise AssertionError("scheduler did not finish")


def chunk_lengths(outputs, request_id):
    return [len(c.token_ids) for o in outputs for c in o.chunks if c.request_id == request_id]


def test_long_prompt_is_prefilled_in_chunks():
    scheduler = make_scheduler(budget=16)
    scheduler.add(make_request("a", range(1, 41), max_tokens=3))
    outputs, finished = run_to_completion(scheduler)
    assert chunk_lengths(outputs, "a") == [16, 16, 8, 1, 1]
    samples = [c.needs_sample for o in outputs for c in o.chunks]
    assert samples == [False, False, True, True, True]
    assert finished["a"].finish_reason == "length"
    assert len(finished["a"].output_token_ids) == 3


def test_decodes_go_first_and_prefill_takes_the_remaining_budget():
    scheduler = make_scheduler(budget=16)
    scheduler.add(make_request("a", range(1, 5), max_tokens=10))
    scheduler.add(make_request("b", range(5, 9), max_tokens=10))
    step(scheduler)  # both prompts prefilled together (continuous batching)
    scheduler.add(make_request("c", range(100, 140), max_tokens=1))
    output, _ = step(scheduler)
    assert [(c.request_id, len(c.token_ids)) for c in output.chunks] == [
        ("a", 1), ("b", 1), ("c", 14)]
    output, _ = step(scheduler)
    assert [(c.request_id, len(c.token_ids)) for c in output.chunks] == [
        ("a", 1), ("b", 1), ("c", 14)]


def test_prefix_cache_hit_skips_cached_blocks():
    scheduler = make_scheduler(budget=64)
    shared = list(range(1, 33))  # 8 full blocks of 4
    scheduler.add(make_request("a", shared + [50, 51], max_tokens=2))
    run_to_completion(scheduler)
    assert scheduler.stats()["prefix_cache_hit_tokens"] == 0
    scheduler.add(make_request("b", shared + [60, 61, 62], max_tokens=2))
    output, _ = step(scheduler)
    (chunk,) = output.chunks
    assert chunk.start_position == 32 and chunk.token_ids == (60, 61, 62)
    assert scheduler.get("b").num_cached_tokens == 32
    assert scheduler.stats()["prefix_cache_hit_tokens"] == 32
    assert scheduler.stats()["prefix_cache_hit_requests"] == 1


def test_full_prompt_hit_still_computes_one_block():
    scheduler = make_scheduler(budget=64)
    prompt = list(range(1, 33))
    scheduler.add(make_request("a", prompt, max_tokens=1))
    _, finished_a = run_to_completion(scheduler)
    scheduler.add(make_request("b", prompt, max_tokens=1))
    outputs, finished_b = run_to_completion(scheduler)
    (chunk,) = outputs[0].chunks
    assert chunk.start_position == 28 and chunk.needs_sample
    assert finished_b["b"].output_token_ids == finished_a["a"].output_token_ids


def test_a_later_prompt_reuses_prompt_blocks_not_generated_ones():
    # A generated token's KV is computed another way than a prompt token's (the decode
    # kernel), so a follow-up whose prompt holds a's reply reuses only a's prompt blocks:
    # its result must not depend on what the cache held.
    scheduler = make_scheduler(budget=64)
    scheduler.add(make_request("a", range(1, 7), max_tokens=6))
    _, finished = run_to_completion(scheduler)
    follow_up = list(range(1, 7)) + finished["a"].output_token_ids + [99]
    scheduler.add(make_request("b", follow_up, max_tokens=1))
    output, _ = step(scheduler)
    # a's first block is prompt; its second already holds generated tokens
    assert output.chunks[0].start_position == 4
    assert output.chunks[0].prompt
    run_to_completion(scheduler)
    scheduler.add(make_request("c", follow_up + [7], max_tokens=1))
    output, _ = step(scheduler)
    assert output.chunks[0].start_position == 12  # b's prompt blocks serve c's prompt


def test_chunks_say_whether_they_are_prompt_tokens():
    scheduler = make_scheduler(budget=64)
    scheduler.add(make_request("a", range(1, 7), max_tokens=3))
    output, _ = step(scheduler)
    assert [c.prompt for c in output.chunks] == [True]
    output, _ = step(scheduler)
    assert [c.prompt for c in output.chunks] == [False]  # a generated token


def test_prefix_caching_can_be_disabled():
    scheduler = make_scheduler(budget=64, prefix_caching=False)
    prompt = list(range(1, 33))
    for request_id in ("a", "b"):
        scheduler.add(make_request(request_id, prompt, max_tokens=1))
        outputs, _ = run_to_completion(scheduler)
        assert outputs[0].chunks[0].start_position == 0
    assert scheduler.stats()["prefix_cache_hit_tokens"] == 0


def test_preempted_request_recomputes_and_finishes_with_the_same_tokens():
    prompts = {"a": list(range(1, 13)), "b": list(range(20, 32))}
    alone = {}
    for request_id, prompt in prompts.items():
        scheduler = make_scheduler(num_blocks=64)
        scheduler.add(make_request(request_id, prompt, max_tokens=12))
        alone.update(run_to_completion(scheduler)[1])
    # 12 blocks of 4 = 48 slots; each request grows to 24 tokens: both cannot fit.
    scheduler = make_scheduler(num_blocks=10, budget=32, prefix_caching=False)
    for request_id, prompt in prompts.items():
        scheduler.add(make_request(request_id, prompt, max_tokens=12))
    outputs, finished = run_to_completion(scheduler)
    preempted = [rid for o in outputs for rid in o.preempted_ids]
    assert preempted and set(preempted) == {"b"}  # the later arrival gives way
    assert finished["b"].num_preemptions >= 1
    for request_id in prompts:
        assert finished[request_id].output_token_ids == alone[request_id].output_token_ids
    assert scheduler.pool.num_free_blocks == 10
    assert scheduler.stats()["num_preemptions"] == len(preempted)


def test_preemption_takes_the_lowest_priority_first():
    scheduler = make_scheduler(num_blocks=10, budget=32, prefix_caching=False)
    scheduler.add(make_request("low", range(1, 13), max_tokens=12, priority=5))
    scheduler.add(make_request("high", range(20, 32), max_tokens=12, priority=0))
    outputs, finished = run_to_completion(scheduler)
    preempted = {rid for o in outputs for rid in o.preempted_ids}
    assert preempted == {"low"}
    assert set(finished) == {"low", "high"}


def test_waiting_order_is_priority_then_arrival():
    scheduler = make_scheduler(max_seqs=1, budget=16)
    scheduler.add(make_request("late-normal", [1, 2], max_tokens=1, priority=1))
    scheduler.add(make_request("urgent", [3, 4], max_tokens=1, priority=0))
    scheduler.add(make_request("later-normal", [5, 6], max_tokens=1, priority=1))
    outputs, _ = run_to_completion(scheduler)
    order = [o.chunks[0].request_id for o in outputs]
    assert order == ["urgent", "late-normal", "later-normal"]


def test_max_num_seqs_bounds_running_requests():
    scheduler = make_scheduler(max_seqs=2, budget=64)
    for index in range(3):
        scheduler.add(make_request(f"r{index}", [index + 1] * 3, max_tokens=3))
    output, _ = step(scheduler)
    assert {c.request_id for c in output.chunks} == {"r0", "r1"}
    assert (scheduler.num_running, scheduler.num_waiting) == (2, 1)
    _, finished = run_to_completion(scheduler)
    assert set(finished) == {"r0", "r1", "r2"}


def test_admission_waits_for_free_blocks():
    scheduler = make_scheduler(num_blocks=4, budget=32, prefix_caching=False)
    scheduler.add(make_request("a", range(1, 13), max_tokens=2))  # 3 blocks, then a 4th
    scheduler.add(make_request("b", range(20, 28), max_tokens=1))  # needs 2 blocks
    outputs, finished = run_to_completion(scheduler)
    ids_per_step = [[c.request_id for c in o.chunks] for o in outputs]
    # "a" grows to 4 blocks; "b" starts only once "a" has finished and freed them.
    assert ids_per_step == [["a"], ["a"], ["b"]]
    assert set(finished) == {"a", "b"}


def test_abort_frees_running_and_waiting_requests():
    scheduler = make_scheduler(max_seqs=1)
    scheduler.add(make_request("running", range(1, 10), max_tokens=50))
    scheduler.add(make_request("waiting", range(1, 10), max_tokens=50))
    step(scheduler)
    assert scheduler.pool.num_used_blocks > 0
    scheduler.abort("running")
    scheduler.abort("waiting")
    scheduler.abort("unknown")
    assert not scheduler.has_unfinished()
    assert scheduler.pool.num_used_blocks == 0
    assert scheduler.schedule().is_empty


def test_abort_between_schedule_and_update_discards_the_work():
    scheduler = make_scheduler()
    request = make_request("a", range(1, 10))
    scheduler.add(request)
    output = scheduler.schedule()
    scheduler.abort("a")
    assert scheduler.update(output, {"a": 5}) == []
    assert request.status is RequestStatus.FINISHED and request.finish_reason == "abort"


def test_finish_from_outside_frees_blocks():
    scheduler = make_scheduler()
    request = make_request("a", range(1, 10), max_tokens=50)
    scheduler.add(request)
    step(scheduler)
    scheduler.finish("a", "stop")
    assert request.finish_reason == "stop" and request.block_ids == []
    assert scheduler.pool.num_used_blocks == 0 and not scheduler.has_unfinished()


def test_eos_finishes_with_stop():
    scheduler = make_scheduler()
    scheduler.add(make_request("a", [1, 2, 3], max_tokens=10))
    step(scheduler, token_for=lambda r: 7)
    _, finished = step(scheduler, token_for=lambda r: EOS)
    assert [(r.request_id, r.finish_reason, r.output_token_ids) for r in finished] == [
        ("a", "stop", [7, EOS])]


def test_context_limit_finishes_with_length():
    scheduler = make_scheduler(max_model_len=8)
    scheduler.add(make_request("a", range(1, 6), max_tokens=None))
    _, finished = run_to_completion(scheduler)
    assert finished["a"].finish_reason == "length" and finished["a"].num_tokens == 8


def test_prompts_that_can_never_fit_are_rejected():
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_model_len=512)
    with pytest.raises(ContextLengthExceeded):
        scheduler.add(make_request("big", range(1, 17)))  # pool holds 16 tokens in all
    with pytest.raises(ContextLengthExceeded):
        make_scheduler(max_model_len=16).add(make_request("long", range(1, 17)))
    scheduler.add(make_request("ok", range(1, 16), max_tokens=None))
    assert scheduler.num_waiting == 1


def test_duplicate_ids_and_bad_config_are_rejected():
    scheduler = make_scheduler()
    scheduler.add(make_request("a", [1]))
    with pytest.raises(ValueError):
        scheduler.add(make_request("a", [1]))
    with pytest.raises(ValueError):
        make_scheduler(budget=4, max_seqs=8)


def test_many_requests_under_pressure_all_complete():
    scheduler = make_scheduler(num_blocks=24, block_size=4, budget=24, max_seqs=6)
    prompts = {f"r{i}": [(i * 7 + j) % 50 + 1 for j in range(3 + i * 3)] for i in range(10)}
    for index, (request_id, prompt) in enumerate(prompts.items()):
        scheduler.add(make_request(request_id, prompt, max_tokens=8, priority=index % 3))
    outputs, finished = run_to_completion(scheduler)
    assert any(o.preempted_ids for o in outputs)
    assert set(finished) == set(prompts)
    for request_id, prompt in prompts.items():
        alone = make_scheduler(num_blocks=64)
        alone.add(make_request(request_id, prompt, max_tokens=8))
        expected = run_to_completion(alone)[1][request_id].output_token_ids
        assert finished[request_id].output_token_ids == expected
    assert scheduler.pool.num_used_blocks == 0


def test_bookkeeping_imports_no_torch():
    code = ("import sys, shoal.engine.scheduler, shoal.engine.kv.block_pool; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_newly_cached_prompt_blocks_are_listed_once_with_their_chain():
    from shoal.engine.kv.prefix_cache import ROOT_HASH, extend_block_hashes

    scheduler = Scheduler(SchedulerConfig(num_blocks=64, block_size=4, max_num_batched_tokens=6,
                                          max_num_seqs=4, max_model_len=512,
                                          record_cached_blocks=True), eos_token_ids=[EOS])
    prompt = list(range(1, 15))  # 3 full prompt blocks; generated tokens fill a 4th
    scheduler.add(make_request("a", prompt, max_tokens=6, ignore_eos=True))
    listed = []
    while scheduler.has_unfinished():
        step(scheduler)
        listed += scheduler.drain_cached_blocks()
    hashes = extend_block_hashes([], prompt, 4)
    assert [b.block_hash for b in listed] == hashes
    assert [b.parent_hash for b in listed] == [ROOT_HASH] + hashes[:2]
    assert [b.token_ids for b in listed] == [tuple(prompt[i:i + 4]) for i in (0, 4, 8)]
    # The same prompt again hits the cache: nothing new to list.
    scheduler.add(make_request("b", prompt, max_tokens=1))
    while scheduler.has_unfinished():
        step(scheduler)
    assert scheduler.drain_cached_blocks() == []
