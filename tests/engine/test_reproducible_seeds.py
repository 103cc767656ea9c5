"""A seeded sampled request gives the same tokens however it is served: cold, with its
prefix cached, in one step with 8 other requests, and arriving while 8 others decode.

Default precision, real models; a 256-token step budget chunks the ~650-token prompts."""

from __future__ import annotations

import pytest

from shoal.catalog.resolve import ModelNotFound, resolve_model
from shoal.engine.config import EngineConfig
from shoal.engine.engine import Engine
from shoal.engine.sampling import SamplingParams

pytestmark = pytest.mark.slow

SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=40,
                        ignore_eos=True)
STORY = ("Write a short story about a lighthouse keeper who finds a message in a bottle. "
         "The storm has passed, the lamp needs oil, and the tide is turning. ")
LETTER = ("Draft a letter from a village baker to the mayor about the broken bridge. "
          "Flour carts cannot cross, the river is high, and the market is on Friday. ")
OTHERS = 8

Requests = dict[str, tuple[list[int], SamplingParams]]  # request id -> (prompt, params)


@pytest.fixture(scope="module", params=["qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct"])
def engine(request, tmp_path_factory) -> Engine:
    try:
        source = resolve_model(request.param)
    except ModelNotFound as missing:
        pytest.skip(str(missing))
    return Engine(EngineConfig(source=source, threads=2, max_num_batched_tokens=256,
                               kv_cache_bytes=64 * 2**20,
                               cache_dir=tmp_path_factory.mktemp("cache")))


def long_prompt(engine: Engine, paragraph: str) -> list[int]:
    ids = engine.tokenizer.encode(paragraph * 20, add_special_tokens=False)
    assert len(ids) > 2 * engine.config.max_num_batched_tokens  # prefilled in 3+ chunks
    return ids


def other_requests(engine: Engine, tag: str) -> Requests:
    """Prompts of 1 to 8 sentences; even ones sampled with their own seeds, odd ones greedy."""
    requests = {}
    for i in range(OTHERS):
        text = f"Request {i} of batch {tag}: tell me about rivers and {7 * i} mountains. "
        if i % 2 == 0:
            params = SamplingParams(temperature=0.7 + 0.1 * (i % 4), top_k=50, seed=i,
                                    max_tokens=30 + 3 * i, ignore_eos=True)
        else:
            params = SamplingParams(temperature=0.0, max_tokens=30 + 3 * i, ignore_eos=True)
        ids = engine.tokenizer.encode(text * (i + 1), add_special_tokens=False)
        requests[f"{tag}-other{i}"] = (ids, params)
    return requests


def generate(engine: Engine, requests: Requests,
             late: Requests | None = None) -> dict[str, list[int]]:
    """Token ids per request id. `late` requests are added once every request in
    `requests` has its first token, i.e. while those are decoding."""
    for request_id, (ids, params) in requests.items():
        engine.add_request(request_id, ids, params)
    pending = dict(late or {})
    tokens: dict[str, list[int]] = {request_id: [] for request_id in [*requests, *pending]}
    while engine.has_unfinished_requests():
        if pending and all(tokens[request_id] for request_id in requests):
            for request_id, (ids, params) in pending.items():
                engine.add_request(request_id, ids, params)
            pending = {}
        for out in engine.step():
            tokens[out.request_id].extend(out.token_ids)
    assert not pending, "the early requests finished before the late ones joined"
    return tokens


def assert_same_tokens(expected: list[int], actual: list[int], how: str) -> None:
    first_difference = next((i for i, (a, b) in enumerate(zip(expected, actual)) if a != b),
                            min(len(expected), len(actual)))
    assert actual == expected, (f"{how} differs from the reference at token "
                                f"{first_difference}:\nreference: {expected}\n{how}: {actual}")


def test_cold_cached_and_batched_give_the_same_tokens(engine):
    ids = long_prompt(engine, STORY)
    cold = generate(engine, {"cold": (ids, SEEDED)})["cold"]
    assert len(cold) == SEEDED.max_tokens

    hits_before = engine.stats()["prefix_cache_hit_tokens"]
    cached = generate(engine, {"cached": (ids, SEEDED)})["cached"]
    hits = engine.stats()["prefix_cache_hit_tokens"] - hits_before
    assert hits >= len(ids) - engine.config.block_size, f"only {hits} prompt tokens were cached"
    assert_same_tokens(cold, cached, "cached")

    # Added in the same step, in the middle of the batch.
    others = list(other_requests(engine, "same-step").items())
    batch = dict(others[:OTHERS // 2] + [("batched", (ids, SEEDED))] + others[OTHERS // 2:])
    assert_same_tokens(cold, generate(engine, batch)["batched"], "batched")


def test_cached_prompt_beside_running_decodes_gives_the_same_tokens(engine):
    ids = long_prompt(engine, STORY)
    alone = generate(engine, {"alone": (ids, SEEDED)})["alone"]
    joined = generate(engine, other_requests(engine, "decoding"),
                      late={"joined": (ids, SEEDED)})["joined"]
    assert_same_tokens(alone, joined, "joined")


# Decodes in the step move the prompt's chunk starts (256 - 8 = 248 tokens a chunk): every
# prompt row attends on its own (kernels attend_rows), so where its chunk starts changes
# nothing. (torch's attention moved by ~1e-7 with the split, enough to flip a bf16 rounding
# and, on Qwen2.5, token 15 of this request.)
def test_cold_prefill_beside_running_decodes_gives_the_same_tokens(engine):
    # A prompt never seen before, so its whole prefill is chunked between the decodes.
    ids = long_prompt(engine, LETTER)
    joined = generate(engine, other_requests(engine, "cold-decoding"),
                      late={"joined": (ids, SEEDED)})["joined"]
    alone = generate(engine, {"alone": (ids, SEEDED)})["alone"]
    assert_same_tokens(alone, joined, "joined")
