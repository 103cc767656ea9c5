"""The whole engine on the built-in model: batching, seeds, stops, prefix cache, aborts."""

from __future__ import annotations

import pytest

from shoal.catalog.resolve import DEFAULT_MODEL_ID, resolve_model
from shoal.engine.config import EngineConfig
from shoal.engine.engine import Engine
from shoal.engine.errors import ContextLengthExceeded
from shoal.engine.sampling import InvalidParameter, SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "The three primary colours are",
    "def fibonacci(n):",
    "Once upon a time in a small village,",
    "The capital of Japan is",
]


def run(engine: Engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict:
    for request_id, (ids, params) in requests.items():
        engine.add_request(request_id, ids, params)
    results = {rid: {"ids": [], "text": "", "reason": None, "outputs": []} for rid in requests}
    for _ in range(10_000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            entry = results[out.request_id]
            entry["ids"].extend(out.token_ids)
            entry["text"] += out.text
            entry["outputs"].append(out)
            if out.finished:
                assert entry["reason"] is None, "finish reported twice"
                entry["reason"] = out.finish_reason
    assert not engine.has_unfinished_requests()
    return results


@pytest.fixture(scope="module")
def fp32_engine(tmp_path_factory) -> Engine:
    return Engine(EngineConfig(source=resolve_model(DEFAULT_MODEL_ID), dtype="float32",
                               kv_cache_bytes=64 * 2**20, max_num_batched_tokens=256,
                               cache_dir=tmp_path_factory.mktemp("cache")))


@pytest.fixture(scope="module")
def fast_engine(tmp_path_factory) -> Engine:
    return Engine(EngineConfig(source=resolve_model(DEFAULT_MODEL_ID),
                               kv_cache_bytes=64 * 2**20,
                               cache_dir=tmp_path_factory.mktemp("cache")))


def encode(engine: Engine, text: str) -> list[int]:
    return engine.tokenizer.encode(text)


def test_batched_equals_one_at_a_time_in_fp32(fp32_engine):
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    alone = {}
    for i, prompt in enumerate(PROMPTS):
        alone.update(run(fp32_engine, {f"solo{i}": (encode(fp32_engine, prompt), greedy)}))
    together = run(fp32_engine, {f"batch{i}": (encode(fp32_engine, p), greedy)
                                 for i, p in enumerate(PROMPTS)})
    for i in range(len(PROMPTS)):
        assert together[f"batch{i}"]["ids"] == alone[f"solo{i}"]["ids"]
        assert len(alone[f"solo{i}"]["ids"]) == 24
        assert together[f"batch{i}"]["reason"] == "length"


def test_text_deltas_concatenate_to_the_decoded_output(fast_engine):
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    result = run(fast_engine, {"t": (encode(fast_engine, "List some fruits:"), params)})["t"]
    assert result["text"] == fast_engine.tokenizer.decode(result["ids"])
    usage = result["outputs"][-1]
    assert usage.completion_tokens == 40 and usage.prompt_tokens > 0


def test_same_seed_gives_same_output_and_other_seed_differs(fast_engine):
    ids = encode(fast_engine, "Tell me a story about a fox.")

    def sample(seed: int, tag: str) -> list[int]:
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=24, ignore_eos=True)
        return run(fast_engine, {tag: (ids, params)})[tag]["ids"]

    first, again, other = sample(7, "s1"), sample(7, "s2"), sample(8, "s3")
    assert first == again
    assert first != other


def test_stop_string_ends_the_request_and_is_not_shown(fast_engine):
    ids = encode(fast_engine, "Count: 1, 2, 3, 4, 5,")
    free = run(fast_engine, {"free": (ids, SamplingParams(temperature=0.0, max_tokens=30,
                                                           ignore_eos=True))})["free"]
    text = free["text"]
    assert len(text) > 6
    stop = text[3:6]
    stopped = run(fast_engine, {"stop": (ids, SamplingParams(
        temperature=0.0, max_tokens=30, ignore_eos=True, stop=(stop,)))})["stop"]
    assert stopped["reason"] == "stop"
    assert stopped["text"] == text[: text.index(stop)]
    assert stopped["outputs"][-1].stop_string == stop  # Anthropic reports which one matched
    assert free["outputs"][-1].stop_string is None


def test_prefix_cache_skips_the_shared_prefix(fast_engine):
    shared = " ".join(["the quiet harbour at dawn"] * 60)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    run(fast_engine, {"p1": (encode(fast_engine, shared + " first"), params)})
    second = run(fast_engine, {"p2": (encode(fast_engine, shared + " second"), params)})["p2"]
    assert second["outputs"][-1].cached_tokens >= 200


def test_abort_finishes_with_abort(fast_engine):
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    fast_engine.add_request("gone", encode(fast_engine, "Hello there"), params)
    fast_engine.step()
    fast_engine.abort_request("gone")
    outputs = []
    while fast_engine.has_unfinished_requests():
        outputs.extend(fast_engine.step())
    assert outputs[-1].request_id == "gone"
    assert outputs[-1].finished and outputs[-1].finish_reason == "abort"


def test_bad_requests_are_refused_clearly(fast_engine):
    with pytest.raises(ContextLengthExceeded):
        fast_engine.add_request("long", [5] * (fast_engine.max_model_len + 1),
                                SamplingParams(max_tokens=1))
    with pytest.raises(InvalidParameter) as caught:
        fast_engine.add_request("bias", [5, 6], SamplingParams(logit_bias={10**7: 1.0}))
    assert caught.value.param == "logit_bias"
    with pytest.raises(ContextLengthExceeded, match="max_tokens"):
        fast_engine.add_request("over", [5, 6],
                                SamplingParams(max_tokens=fast_engine.max_model_len))
    with pytest.raises(InvalidParameter) as caught:
        fast_engine.add_request("empty", [], SamplingParams(max_tokens=1))
    assert caught.value.param == "prompt"
    assert not fast_engine.has_unfinished_requests()


def test_a_traced_request_records_its_wait_prefill_chunks_and_decode_steps(tmp_path):
    from shoal.tracing.steps import RequestTrace

    engine = Engine(EngineConfig(source=resolve_model(DEFAULT_MODEL_ID),
                                 kv_cache_bytes=16 * 2**20, max_num_batched_tokens=16,
                                 max_num_seqs=4, cache_dir=tmp_path))
    prompt = encode(engine, "one two three four five six seven eight nine ten " * 3)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    engine.add_request("traced", prompt, params, trace=RequestTrace("c" * 32, "d" * 16))
    engine.add_request("untraced", encode(engine, "untraced"), params)
    engine.add_request("short", encode(engine, "hello"), params, trace=RequestTrace("e" * 32))
    while engine.has_unfinished_requests():
        engine.step()
    spans = engine.tracer.spans.of("c" * 32)
    chunks = -(-len(prompt) // 16)
    assert [s["name"] for s in spans] == ["wait"] + ["prefill"] * chunks + ["decode"] * 4
    prefills = spans[1:1 + chunks]
    assert sum(s["args"]["tokens"] for s in prefills) == len(prompt)
    assert [s["args"]["position"] for s in prefills] == list(range(0, len(prompt), 16))
    assert all(s["dur"] > 0 for s in spans[1:])
    assert [s["name"] for s in engine.tracer.spans.of("e" * 32)] == ["wait", "prefill"] + \
        ["decode"] * 4


def test_a_request_may_keep_special_tokens_in_its_text(fast_engine):
    # A harmony chat reads its headers (special tokens) from the text; others never see them.
    special = fast_engine.tokenizer.backend.token_to_id("<|im_start|>")
    prompt = encode(fast_engine, "Hello")
    texts = {}
    for keep in (False, True):
        params = SamplingParams(temperature=0.0, max_tokens=2, logit_bias={special: 100.0},
                                skip_special_tokens=not keep)
        texts[keep] = run(fast_engine, {f"keep{keep}": (prompt, params)})[f"keep{keep}"]["text"]
    assert texts == {False: "", True: "<|im_start|><|im_start|>"}
