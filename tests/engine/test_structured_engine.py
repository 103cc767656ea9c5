"""Constrained generation on the built-in 135M model: every output parses and validates."""

from __future__ import annotations

import json

import jsonschema
import pytest

from shoal.catalog.resolve import DEFAULT_MODEL_ID, resolve_model
from shoal.engine.config import EngineConfig
from shoal.engine.engine import Engine
from shoal.engine.grammar_spec import GrammarSpec, InvalidGrammar
from shoal.engine.sampling import SamplingParams

pytestmark = pytest.mark.slow

SCHEMAS = {
    "person": {"type": "object",
               "properties": {"name": {"type": "string", "maxLength": 40},
                              "age": {"type": "integer", "minimum": 0, "maximum": 120}},
               "required": ["name", "age"], "additionalProperties": False},
    "nested": {"type": "object",
               "properties": {
                   "city": {"type": "object",
                            "properties": {"name": {"type": "string", "maxLength": 30},
                                           "population": {"type": "integer", "minimum": 0,
                                                          "maximum": 10**9}},
                            "required": ["name", "population"], "additionalProperties": False},
                   "tags": {"type": "array", "items": {"type": "string", "maxLength": 20},
                            "minItems": 1, "maxItems": 3}},
               "required": ["city", "tags"], "additionalProperties": False},
    "enums": {"type": "object",
              "properties": {"colour": {"enum": ["red", "green", "blue"]},
                             "size": {"type": "string", "enum": ["S", "M", "L"]},
                             "in_stock": {"type": "boolean"}},
              "required": ["colour", "size", "in_stock"], "additionalProperties": False},
    "numbers": {"type": "array", "items": {"type": "integer", "minimum": -999, "maximum": 999},
                "minItems": 2, "maxItems": 4},
    "any_object": {"type": "object"},
}
PROMPT = "Describe a person who lives in a city, as JSON."


def chat_ids(engine: Engine, text: str) -> list[int]:
    return engine.tokenizer.encode(engine.render_chat([{"role": "user", "content": text}]))


def run(engine: Engine, requests: dict) -> dict[str, dict]:
    """requests: id -> (ids, params, grammar); returns id -> {text, ids, reason}."""
    for request_id, (ids, params, grammar) in requests.items():
        engine.add_request(request_id, ids, params, grammar=grammar)
    results = {rid: {"text": "", "ids": [], "reason": None} for rid in requests}
    for _ in range(2_000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            results[out.request_id]["text"] += out.text
            results[out.request_id]["ids"] += out.token_ids
            if out.finished:
                results[out.request_id]["reason"] = out.finish_reason
    assert not engine.has_unfinished_requests()
    return results


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Engine:
    return Engine(EngineConfig(source=resolve_model(DEFAULT_MODEL_ID),
                               kv_cache_bytes=64 * 2**20, max_num_batched_tokens=512,
                               cache_dir=tmp_path_factory.mktemp("cache")))


def test_every_output_parses_and_validates_greedy_and_sampled(engine):
    ids = chat_ids(engine, PROMPT)
    requests = {}
    for name, schema in SCHEMAS.items():
        requests[f"{name}-greedy"] = (ids, SamplingParams(temperature=0.0, max_tokens=120),
                                      GrammarSpec(json_schema=schema))
        if name == "any_object":
            # Unbounded free-form strings: sampling lets the 135M model ramble past any
            # max_tokens, which rightly ends "length" with unfinished JSON. Only schemas
            # that bound their strings are guaranteed to close under sampling.
            continue
        requests[f"{name}-sampled"] = (ids, SamplingParams(temperature=0.8, seed=7,
                                                           max_tokens=120),
                                       GrammarSpec(json_schema=schema))
    results = run(engine, requests)
    for request_id, result in results.items():
        schema = SCHEMAS[request_id.rsplit("-", 1)[0]]
        assert result["reason"] == "stop", (request_id, result)
        value = json.loads(result["text"])
        jsonschema.validate(value, schema)
        # The grammar ended the request: the end token was never needed.
        assert not set(result["ids"]) & engine.tokenizer.eos_token_ids


def test_a_forced_call_grammar_yields_one_valid_call(engine):
    arguments = {"type": "object",
                 "properties": {"city": {"type": "string", "maxLength": 30},
                                "unit": {"enum": ["celsius", "fahrenheit"]}},
                 "required": ["city", "unit"], "additionalProperties": False}
    call = {"type": "object", "properties": {"name": {"const": "get_weather"},
                                             "arguments": arguments},
            "required": ["name", "arguments"], "additionalProperties": False}
    lark = 'start: "<tool_call>\\n" call "\\n</tool_call>"\ncall: %json ' + json.dumps(call)
    ids = chat_ids(engine, "What is the weather in Paris?")
    result = run(engine, {"call": (ids, SamplingParams(temperature=0.0, max_tokens=80),
                                   GrammarSpec(lark=lark))})["call"]
    assert result["reason"] == "stop"
    text = result["text"]
    assert text.startswith("<tool_call>\n") and text.endswith("\n</tool_call>")
    parsed = json.loads(text[len("<tool_call>\n"):-len("\n</tool_call>")])
    jsonschema.validate(parsed, call)


def test_length_limit_still_applies(engine):
    result = run(engine, {"short": (chat_ids(engine, PROMPT),
                                    SamplingParams(temperature=0.0, max_tokens=3),
                                    GrammarSpec(json_schema=SCHEMAS["person"]))})["short"]
    assert result["reason"] == "length" and len(result["ids"]) == 3
    assert result["text"].startswith("{")


def test_invalid_schema_is_refused_before_queueing(engine):
    with pytest.raises(InvalidGrammar):
        engine.add_request("bad", chat_ids(engine, PROMPT), SamplingParams(max_tokens=5),
                           grammar=GrammarSpec(json_schema={"type": "nonsense"}))
    assert not engine.has_unfinished_requests()
