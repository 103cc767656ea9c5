"""Speculative decoding on real models: the same greedy tokens with and without guessing,
seeded requests that repeat, and sampled tokens whose distribution guessing leaves alone."""

from __future__ import annotations

import collections

import pytest
from prompts import EDIT
from scipy.stats import chi2_contingency

from shoal.catalog.resolve import ModelNotFound, resolve_model
from shoal.engine import engine as engine_module
from shoal.engine.config import EngineConfig
from shoal.engine.engine import Engine
from shoal.engine.sampling import SamplingParams
from shoal.engine.speculation.config import SpeculativeConfig
from shoal.engine.speculation.length import DraftLength

pytestmark = pytest.mark.slow

PROMPTS = {
    # Guesses mostly right: the answer copies the prompt.
    "edit": EDIT,
    # Guesses sometimes right: lists repeat their own phrasing.
    "list": "List the planets of the solar system, one per line, each as 'Planet N: NAME "
            "is planet number N from the sun.'",
    # Guesses mostly wrong.
    "chat": "Why is the sky blue? Answer in two sentences.",
}


def make_engine(model: str, dtype: str, speculative: SpeculativeConfig | None,
                cache_dir, kv_cache_dtype: str = "auto") -> Engine:
    try:
        source = resolve_model(model)
        draft_source = (resolve_model(speculative.draft_model)
                        if speculative is not None and speculative.method == "draft" else None)
    except ModelNotFound as missing:
        pytest.skip(str(missing))
    return Engine(EngineConfig(source=source, dtype=dtype, threads=2,
                               kv_cache_bytes=64 * 2**20, max_num_batched_tokens=512,
                               speculative=speculative, draft_source=draft_source,
                               cache_dir=cache_dir,
                               kv_cache_dtype=kv_cache_dtype))


def generate(engine: Engine, requests: dict[str, tuple[list[int], SamplingParams]],
             before_step=lambda engine: None) -> dict[str, dict]:
    results = {rid: {"ids": [], "last": None} for rid in requests}
    for request_id, (ids, params) in requests.items():
        engine.add_request(request_id, ids, params)
    for _ in range(20_000):
        if not engine.has_unfinished_requests():
            break
        before_step(engine)
        for out in engine.step():
            results[out.request_id]["ids"].extend(out.token_ids)
            results[out.request_id]["last"] = out
    assert not engine.has_unfinished_requests()
    return results


def chat_ids(engine: Engine, text: str) -> list[int]:
    return engine.tokenizer.encode(engine.render_chat([{"role": "user", "content": text}]),
                                   add_special_tokens=False)


@pytest.mark.parametrize("model, dtype, kv_cache_dtype, max_tokens", [
    ("smollm2-135m-instruct", "float32", "auto", 80),
    ("qwen2.5-coder-0.5b-instruct", "float32", "auto", 32),  # ~10 tokens/s in float32 here
    ("smollm2-135m-instruct", "auto", "auto", 120),  # the default precision keeps its bits too
    ("smollm2-135m-instruct", "auto", "int8", 120),  # guesses' rows quantized as plain rows
])
def test_greedy_output_is_the_same_with_and_without_guessing(model, dtype, kv_cache_dtype,
                                                             max_tokens, tmp_path,
                                                             monkeypatch):
    """One engine that guesses; its plain runs ask for x_speculative "off", one at a time
    (batch 1), and its guessing runs share steps. Every step guesses its most: how many pay
    depends on this machine's step times (length.py), which a test must not."""
    monkeypatch.setattr(DraftLength, "wanted", lambda length: length.most)
    engine = make_engine(model, dtype, SpeculativeConfig("ngram", 8), tmp_path,
                         kv_cache_dtype)
    plain = SamplingParams(temperature=0.0, max_tokens=max_tokens, speculative="off")
    guessed = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    requests = {name: chat_ids(engine, text) for name, text in PROMPTS.items()}
    alone = {name: generate(engine, {name: (ids, plain)})[name]
             for name, ids in requests.items()}
    together = generate(engine, {name: (ids, guessed) for name, ids in requests.items()})
    proposed = accepted = 0
    for name in PROMPTS:
        assert together[name]["ids"] == alone[name]["ids"], name
        last = together[name]["last"]
        assert last.completion_tokens == alone[name]["last"].completion_tokens
        assert alone[name]["last"].draft_tokens == 0
        proposed += last.draft_tokens
        accepted += last.accepted_draft_tokens
    assert 0 < accepted < proposed  # guesses were kept and rejected along the way
    edited = together["edit"]["last"]
    assert edited.accepted_draft_tokens > 0.3 * edited.completion_tokens  # mostly copied


def test_a_request_asks_for_guessing_on_an_engine_that_does_not_guess(tmp_path, monkeypatch):
    monkeypatch.setattr(DraftLength, "wanted", lambda length: length.most)
    engine = make_engine("smollm2-135m-instruct", "auto", None, tmp_path)
    ids = chat_ids(engine, PROMPTS["edit"])
    plain = generate(engine, {"plain": (ids, SamplingParams(temperature=0.0, max_tokens=120))})
    asked = SamplingParams(temperature=0.0, max_tokens=120, speculative="ngram")
    edit = generate(engine, {"edit": (ids, asked)})["edit"]
    assert edit["ids"] == plain["plain"]["ids"]
    assert plain["plain"]["last"].draft_tokens == 0
    assert edit["last"].accepted_draft_tokens > 0.3 * edit["last"].completion_tokens


def test_a_seeded_request_repeats_with_guessing_and_its_cached_prefix(tmp_path):
    engine = make_engine("smollm2-135m-instruct", "auto", SpeculativeConfig("ngram"),
                         tmp_path)
    params = SamplingParams(temperature=0.7, top_p=0.95, seed=77, max_tokens=100)
    ids = chat_ids(engine, PROMPTS["edit"])
    first = generate(engine, {"a": (ids, params)})["a"]
    again = generate(engine, {"b": (ids, params)})["b"]
    assert again["last"].cached_tokens > 0
    assert first["ids"] == again["ids"]
    assert first["last"].accepted_draft_tokens > 0


def test_guessing_leaves_the_sampled_distribution_alone(tmp_path, monkeypatch):
    """Two-sample chi-square on the second and third sampled tokens of 600 seeded requests,
    plain against guessing. Guesses are forced (the greedy continuation), so verification
    runs at every step and keeps about half of them. A verifier that keeps every guess fails
    the same test, so it can tell."""
    engine = make_engine("smollm2-135m-instruct", "auto", None, tmp_path)
    ids = chat_ids(engine, "Name one colour.")
    greedy = generate(engine, {"g": (ids, SamplingParams(temperature=0.0, max_tokens=4))})
    continuation = greedy["g"]["ids"]

    def force_guesses(engine: Engine) -> None:
        for request in engine.scheduler.decoding():
            done = len(request.output_token_ids)
            request.draft_token_ids = list(continuation[done:done + 2])

    def histogram(guess: bool, tag: str, honest: bool = True) -> collections.Counter:
        params = [SamplingParams(temperature=1.0, top_k=3, seed=seed, max_tokens=3)
                  for seed in range(600)]
        requests = {f"{tag}{i}": (ids, p) for i, p in enumerate(params)}
        results = generate(engine, requests, force_guesses if guess else lambda e: None)
        counts = collections.Counter(tuple(r["ids"][1:3]) for r in results.values())
        if guess and honest:
            proposed = sum(r["last"].draft_tokens for r in results.values())
            kept = sum(r["last"].accepted_draft_tokens for r in results.values())
            assert proposed > 600 and 0.2 * proposed < kept < 0.9 * proposed
        return counts

    def p_value(a: collections.Counter, b: collections.Counter) -> float:
        cells = sorted(set(a) | set(b), key=lambda c: -(a[c] + b[c]))
        common = cells[:8]  # rare pairs pooled into one cell
        table = [[a[c] for c in common] + [sum(a[c] for c in cells[8:])],
                 [b[c] for c in common] + [sum(b[c] for c in cells[8:])]]
        table = [[row[i] for i in range(len(row)) if table[0][i] + table[1][i] > 0]
                 for row in table]
        return chi2_contingency(table).pvalue

    plain = histogram(False, "p")
    guessed = histogram(True, "s")
    assert p_value(plain, guessed) > 0.001

    def keep_every_guess(drafts, samples):
        return list(drafts) + [samples[-1]]

    monkeypatch.setattr(engine_module, "kept_tokens", keep_every_guess)
    wrong = histogram(True, "w", honest=False)
    assert p_value(plain, wrong) < 1e-6


@pytest.mark.parametrize("model, draft, dtype, max_tokens", [
    ("qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-0.5b-instruct", "float32", 32),
    # The real pair, whose guesses are sometimes wrong, in the default precision (which keeps
    # a row's bits whatever shares its step); in float32 the 1.5B alone took a minute here.
    ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct", "auto", 60),
])
def test_greedy_output_is_the_same_with_a_draft_model(model, draft, dtype, max_tokens,
                                                      tmp_path, monkeypatch):
    """One engine with a draft model; its plain runs ask for x_speculative "off". Every
    step guesses its most (whether or not that pays on this machine today)."""
    monkeypatch.setattr(DraftLength, "wanted", lambda length: length.most)
    engine = make_engine(model, dtype, SpeculativeConfig("draft", 6, draft), tmp_path)
    plain = SamplingParams(temperature=0.0, max_tokens=max_tokens, speculative="off")
    guessed = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    prompts = PROMPTS if dtype == "auto" or "smollm2" in model else \
        {"chat": PROMPTS["chat"]}  # Qwen2.5 in float32 decodes slowly
    requests = {name: chat_ids(engine, text) for name, text in prompts.items()}
    alone = {name: generate(engine, {name: (ids, plain)})[name]
             for name, ids in requests.items()}
    together = generate(engine, {name: (ids, guessed) for name, ids in requests.items()})
    proposed = accepted = 0
    for name in prompts:
        assert together[name]["ids"] == alone[name]["ids"], name
        assert alone[name]["last"].draft_tokens == 0
        proposed += together[name]["last"].draft_tokens
        accepted += together[name]["last"].accepted_draft_tokens
    assert accepted > 0
    if model != draft:
        assert accepted < proposed  # a smaller model guesses wrong sometimes
