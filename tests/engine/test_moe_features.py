"""What works for dense models works for mixture-of-experts ones (tiny random qwen3moe,
qwen2moe and mixtral with a byte-level tokenizer in their GGUF files): the int8 KV cache,
grammar-constrained output, speculative decoding with a draft model and with n-grams, seeded
sampling across prefix-cache hits and batches, and prefix KV from disk and from another
engine. K-quant experts: test_moe.py."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import tiny_models
import torch
from forward_helpers import all_position_logits, chunk, step
from rank_processes import follow, run_ranks, split_config
from tiny_models import MOE_FAMILIES
from tokenizer_fixtures import tiny_byte_level_metadata

from shoal.engine.config import EngineConfig, KvDiskConfig, ModelSource
from shoal.engine.engine import Engine
from shoal.engine.grammar_spec import GrammarSpec
from shoal.engine.model_runner import ModelRunner
from shoal.engine.models.loader import load_model
from shoal.engine.sampling import SamplingParams
from shoal.engine.speculation.config import SpeculativeConfig

BLOCK = 8
PROMPTS = [[(7 * i + j * 13) % 250 + 3 for j in range(10 + 5 * i)] for i in range(3)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tiny_models.TinyCheckpoint]:
    """family -> tiny checkpoint whose GGUF carries a byte-level tokenizer (the engine
    encodes and detokenizes); its vocabulary is the tokenizer's."""
    metadata = tiny_byte_level_metadata()
    directory = tmp_path_factory.mktemp("moe-features")
    return {family: tiny_models.build(family, directory, metadata=metadata,
                                      vocab_size=len(metadata["tokenizer.ggml.tokens"]))
            for family in MOE_FAMILIES}


# Engine features run on one family of each structure: plain top-k routing (qwen3moe),
# sigmoid group routing after a dense layer with a shared expert (glm4moe), and latent
# attention with softmax group routing (deepseek2); the per-family numerics (int8 rows,
# pipeline stages) run on every family.
FEATURE_FAMILIES = ("qwen3moe", "glm4moe", "deepseek2")


def engine_of(checkpoint, cache_dir, **fields) -> Engine:
    fields = dict(dtype="float32", threads=2, kv_cache_bytes=4 * 2**20, block_size=BLOCK,
                  max_num_batched_tokens=64, cache_dir=cache_dir) | fields
    return Engine(EngineConfig(source=ModelSource("tiny-moe", "gguf", checkpoint.gguf_path),
                               **fields))


def run_requests(engine: Engine, requests: dict[str, tuple], late: dict | None = None
                 ) -> dict[str, dict]:
    """requests: id -> (ids, params) or (ids, params, grammar); `late` ones join once every
    request of `requests` has its first token. Returns id -> ids, text, reason, cached and
    draft token counts."""
    def add(batch):
        for request_id, (ids, params, *grammar) in batch.items():
            engine.add_request(request_id, ids, params, grammar=grammar[0] if grammar else None)

    add(requests)
    pending = dict(late or {})
    results = {rid: {"ids": [], "text": "", "reason": None, "cached": 0, "drafts": 0}
               for rid in [*requests, *pending]}
    while engine.has_unfinished_requests():
        if pending and all(results[rid]["ids"] for rid in requests):
            add(pending)
            pending = {}
        for out in engine.step():
            entry = results[out.request_id]
            entry["ids"].extend(out.token_ids)
            entry["text"] += out.text
            entry["cached"] = max(entry["cached"], out.cached_tokens)
            entry["drafts"] = max(entry["drafts"], out.draft_tokens)
            if out.finished:
                entry["reason"] = out.finish_reason
    assert not pending, "the early requests finished before the late ones joined"
    return results


def token_ids(results: dict[str, dict]) -> dict[str, list[int]]:
    return {request_id: result["ids"] for request_id, result in results.items()}


# int8 KV cache ---------------------------------------------------------------------------

def _logits_along_greedy(runner: ModelRunner, reference: ModelRunner, steps: int
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [T, vocab] of both runners at every position of PROMPTS, then at `steps`
    decode steps (the prompts batched) fed the reference's greedy tokens."""
    tables = [list(range(16 * i, 16 * i + 16)) for i in range(len(PROMPTS))]
    ours = [all_position_logits(runner, p, t) for p, t in zip(PROMPTS, tables)]
    theirs = [all_position_logits(reference, p, t) for p, t in zip(PROMPTS, tables)]
    tokens = [int(logits[-1].argmax()) for logits in theirs]
    for offset in range(steps):
        chunks = [chunk(str(i), [token], len(prompt) + offset, table)
                  for i, (token, prompt, table) in enumerate(zip(tokens, PROMPTS, tables))]
        ours.append(step(runner, *chunks))
        theirs.append(step(reference, *chunks))
        tokens = [int(row.argmax()) for row in theirs[-1]]
    return torch.cat(ours), torch.cat(theirs)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_int8_kv_logits_follow_the_compute_dtypes_cache(checkpoints, family, dtype):
    """bfloat16: packed experts and the compiled attention kernels over int8 rows; float32:
    Python attention dequantizing them. Against a cache in the compute dtype, along its
    greedy continuations of three prompts (117 positions). A key rounded to int8 now and
    then flips a router's top-k choice, which a dense model has none of: measured, rows of
    cosine similarity > 0.995: qwen3moe 96.6% (bf16) / 98.3% (float32), qwen2moe 100 / 100,
    mixtral 98.3 / 99.1 (the dense llama: 100 / 100, worst row 0.9997); worst row 0.972,
    1.0, 0.905; the same next token at 97.4% or more of positions. DeepSeek's rows are its
    latents (one per token, which every head's keys and values are read from), whose int8
    rounding moves more rows: deepseek3 95.7% (bf16) / 96.6% (float32), deepseek2 99.1 /
    98.3, worst row 0.918; the same next token at 94.9% or more."""
    runners = {}
    for kv in (dtype, "int8"):
        loaded = load_model(ModelSource("moe", "gguf", checkpoints[family].gguf_path), dtype,
                            kv_cache_dtype=kv)
        assert loaded.cache_dtype == getattr(torch, kv)
        runners[kv] = ModelRunner(loaded, 16 * len(PROMPTS), BLOCK)
    ours, theirs = _logits_along_greedy(runners["int8"], runners[dtype], 24)
    assert torch.isfinite(ours).all()
    similarity = torch.nn.functional.cosine_similarity(ours, theirs, dim=-1)
    close_share = 0.92 if family.startswith("deepseek") else 0.95
    assert (similarity > 0.995).float().mean() >= close_share
    assert similarity.min() > 0.8
    assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean() >= close_share


@pytest.mark.parametrize("family", FEATURE_FAMILIES)
def test_an_engine_serves_a_moe_model_over_an_int8_cache_and_reuses_its_blocks(
        checkpoints, family, tmp_path):
    engine = engine_of(checkpoints[family], tmp_path, dtype="auto", kv_cache_dtype="int8")
    assert engine.runner.kv_caches[0].dtype == torch.int8
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    first = run_requests(engine, {str(i): (ids, greedy) for i, ids in enumerate(PROMPTS)})
    again = run_requests(engine, {"again": (PROMPTS[2], greedy)})["again"]
    assert again["cached"] == (len(PROMPTS[2]) - 1) // BLOCK * BLOCK > 0
    assert again["ids"] == first["2"]["ids"]


# Grammar-constrained output --------------------------------------------------------------

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "size": {"enum": ["S", "M", "L"]},
                         "count": {"type": "integer", "minimum": 0, "maximum": 99},
                         "ok": {"type": "boolean"}},
          "required": ["name", "size", "count", "ok"], "additionalProperties": False}


@pytest.mark.parametrize("family", FEATURE_FAMILIES)
def test_json_schema_and_lark_outputs_of_a_moe_model_parse_and_match(checkpoints, family,
                                                                     tmp_path):
    engine = engine_of(checkpoints[family], tmp_path, dtype="auto")
    lark = 'start: "<call>" word "</call>"\nword: /[a-z]{2,5}/'
    requests = {
        "greedy": (PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=120),
                   GrammarSpec(json_schema=SCHEMA)),
        "sampled": (PROMPTS[1], SamplingParams(temperature=1.0, seed=3, max_tokens=120),
                    GrammarSpec(json_schema=SCHEMA)),
        "lark": (PROMPTS[2], SamplingParams(temperature=0.8, seed=5, max_tokens=40),
                 GrammarSpec(lark=lark)),
        "free": (PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)),
    }
    results = run_requests(engine, requests)
    for request_id in ("greedy", "sampled"):
        assert results[request_id]["reason"] == "stop", results[request_id]
        jsonschema.validate(json.loads(results[request_id]["text"]), SCHEMA)
    assert results["lark"]["reason"] == "stop"
    assert re.fullmatch(r"<call>[a-z]{2,5}</call>", results["lark"]["text"])
    assert len(results["free"]["ids"]) == 8  # its unconstrained neighbour is left alone


# Speculative decoding and seeded sampling -------------------------------------------------

@pytest.fixture(scope="module")
def draft(tmp_path_factory) -> ModelSource:
    """A tiny dense llama with the targets' byte-level tokenizer and vocabulary."""
    metadata = tiny_byte_level_metadata()
    checkpoint = tiny_models.build("llama", tmp_path_factory.mktemp("draft"), metadata=metadata,
                                   vocab_size=len(metadata["tokenizer.ggml.tokens"]))
    return ModelSource("tiny-draft", "gguf", checkpoint.gguf_path)


def guessing(method: str, draft: ModelSource) -> dict:
    if method == "ngram":
        return dict(speculative=SpeculativeConfig("ngram", 4))
    return dict(speculative=SpeculativeConfig("draft", 4, draft.model_id), draft_source=draft)


LOOP = [40, 41, 42, 43, 44, 45] * 4  # repeats: the n-gram proposer has guesses to make


@pytest.mark.parametrize("method", ["draft", "ngram"])
@pytest.mark.parametrize("family", FEATURE_FAMILIES)
def test_greedy_tokens_are_the_same_with_guesses(checkpoints, draft, family, method,
                                                 tmp_path):
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    requests = {str(i): (ids, greedy) for i, ids in enumerate([LOOP, *PROMPTS])}
    plain = run_requests(engine_of(checkpoints[family], tmp_path / "plain"), requests)
    guessed = run_requests(engine_of(checkpoints[family], tmp_path / "guessed",
                                     **guessing(method, draft)), requests)
    assert token_ids(guessed) == token_ids(plain)
    assert sum(r["drafts"] for r in guessed.values()) > 0


def seeded_requests(tag: str) -> dict[str, tuple[list[int], SamplingParams]]:
    """8 requests sharing a 24-token opening (3 blocks the prefix cache can hand on): even
    ones sampled, each with its own seed and settings, odd ones greedy."""
    requests = {}
    for i in range(8):
        params = SamplingParams(temperature=0.7 + 0.1 * (i % 4), top_p=0.95 if i % 4 else 1.0,
                                top_k=50 if i % 3 == 0 else 0, seed=100 + i, max_tokens=12,
                                ignore_eos=True)
        if i % 2:
            params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        requests[f"{tag}{i}"] = (LOOP + [3 + i] * (1 + i), params)
    return requests


@pytest.mark.parametrize("family", FEATURE_FAMILIES)
def test_seeded_outputs_hold_across_cache_hits_batches_and_draft_guesses(checkpoints, draft,
                                                                         family, tmp_path):
    """Default precision. Each request alone on an engine without guesses, then the 8 in one
    batch on an engine with a draft model, their shared opening cached (a first request
    brought it), then the 8 joining 8 others while those decode: the same tokens every time
    (n-gram guesses over such a batch: test_moe.py)."""
    checkpoint = checkpoints[family]
    plain = engine_of(checkpoint, tmp_path / "plain", dtype="auto")
    alone = {rid: run_requests(plain, {rid: request})[rid]["ids"]
             for rid, request in seeded_requests("").items()}
    engine = engine_of(checkpoint, tmp_path / "guessed", dtype="auto", max_num_seqs=16,
                       **guessing("draft", draft))
    run_requests(engine, {"warm": (LOOP, SamplingParams(max_tokens=1))})
    batched = run_requests(engine, seeded_requests(""))
    assert all(result["cached"] >= len(LOOP) for result in batched.values())
    assert token_ids(batched) == alone
    assert sum(r["drafts"] for r in batched.values()) > 0
    others = {rid: (ids[::-1], params) for rid, (ids, params) in seeded_requests("other").items()}
    joined = run_requests(engine, others, late=seeded_requests(""))
    assert {rid: joined[rid]["ids"] for rid in alone} == alone


# Prefix KV from disk and from another engine ---------------------------------------------

def greedy_run(engine: Engine, request_id: str, prompt: list[int]) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    return run_requests(engine, {request_id: (prompt, params)})[request_id]


LONG_PROMPT = [(11 * j) % 250 + 3 for j in range(43)]  # 5 full blocks and 3 tokens more


@pytest.mark.parametrize("family", FEATURE_FAMILIES)
def test_a_restarted_engine_serves_a_moe_prompt_from_the_disk_tier_identically(
        checkpoints, family, tmp_path):
    disk = KvDiskConfig(root=tmp_path / "kv", max_bytes=64 * 2**20)
    engine = engine_of(checkpoints[family], tmp_path, kv_disk=disk)
    computed = greedy_run(engine, "cold", LONG_PROMPT)
    assert computed["cached"] == 0
    engine.close()  # writes out the disk tier's queue
    restarted = engine_of(checkpoints[family], tmp_path, kv_disk=disk)
    served = greedy_run(restarted, "warm", LONG_PROMPT)
    assert restarted.stats()["kv_disk_loaded_blocks"] == 5
    assert served["cached"] == 5 * BLOCK
    assert served["ids"] == computed["ids"]
    restarted.close()


@pytest.mark.parametrize("family", FEATURE_FAMILIES)
def test_a_moe_prefix_exported_from_one_engine_serves_another_identically(checkpoints, family,
                                                                          tmp_path):
    source, target = (engine_of(checkpoints[family], tmp_path) for _ in range(2))
    computed = greedy_run(source, "cold", LONG_PROMPT)
    blocks = source.export_prefix(LONG_PROMPT)
    assert blocks.num_blocks == 5
    assert target.import_prefix(blocks) == 5
    served = greedy_run(target, "warm", LONG_PROMPT)
    assert served["cached"] == 5 * BLOCK
    assert served["ids"] == computed["ids"]


# A pipeline over two ranks ----------------------------------------------------------------

def pipeline_requests(engine: Engine) -> dict[str, list[int]]:
    """Three greedy requests and a seeded sampled one, in one batch."""
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    requests = {str(i): (ids, greedy) for i, ids in enumerate(PROMPTS)}
    requests["seeded"] = (LOOP, SamplingParams(temperature=0.9, top_k=40, seed=7,
                                               max_tokens=16, ignore_eos=True))
    return token_ids(run_requests(engine, requests))


def pipeline_rank(rank: int, world: int, port: int, path: str, layers: int):
    # The last layer on the second stage, the rest (GLM's and DeepSeek's dense first layer
    # among them) on the first.
    config = split_config(rank, world, port, path, "pipeline",
                          [(0, layers - 1), (layers - 1, layers)], block_size=BLOCK)
    if rank:
        return follow(config)
    engine = Engine(config)
    try:
        return pipeline_requests(engine)
    finally:
        engine.close()


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_a_moe_model_split_in_two_pipeline_stages_answers_as_one_engine(checkpoints, family,
                                                                        tmp_path):
    """Each stage a process holding its layers (their experts with them), in float32: the
    same tokens as one engine, the sampled request's too."""
    path = str(checkpoints[family].gguf_path)
    engine = engine_of(checkpoints[family], tmp_path, threads=1)
    expected = pipeline_requests(engine)
    layers = engine.loaded.config.num_layers
    results = run_ranks(pipeline_rank, 2, path, layers, timeout_s=240)
    assert isinstance(results[1], int) and results[1] > 0  # the second stage served steps
    assert results[0] == expected
