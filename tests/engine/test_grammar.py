"""Grammar masks in the sampler, and the grammar compiler on the real SmolLM2 vocabulary."""

from __future__ import annotations

import json

import pytest
import torch

from shoal.catalog.resolve import DEFAULT_MODEL_ID, resolve_model
from shoal.engine.grammar import GrammarCompiler
from shoal.engine.grammar_spec import GrammarSpec, InvalidGrammar
from shoal.engine.sampler import Sampler, SamplingRow
from shoal.engine.sampling import SamplingParams
from shoal.engine.tokenizer.tokenizer import Tokenizer

EOS = 0
VOCAB = 8
# Token 1 is by far the most likely; the mask allows only 3 and 5.
LOGITS = torch.tensor([[0.0, 9.0, 1.0, 0.5, 2.0, 0.0, 3.0, 1.0]])
ALLOWED = torch.tensor([False, False, False, True, False, True, False, False])


def row(allowed=ALLOWED, output=(), generator=None, **params) -> SamplingRow:
    return SamplingRow(params=SamplingParams(**params), prompt_token_ids=[1, 2],
                       output_token_ids=list(output), generator=generator,
                       allowed_tokens=allowed)


@pytest.mark.parametrize("params", [
    {"temperature": 0.0},
    {"temperature": 1.0},
    {"temperature": 2.0, "top_k": 3},
    {"temperature": 1.0, "top_p": 0.5},
    {"temperature": 1.0, "min_p": 0.5, "seed": 3},
    {"temperature": 0.0, "repetition_penalty": 1.5, "frequency_penalty": 1.0},
    {"temperature": 0.0, "logit_bias": {1: 100.0, 6: 50.0}},
])
def test_every_sampling_mode_honours_the_mask(params):
    generator = torch.Generator().manual_seed(3) if "seed" in params else None
    rows = [row(generator=generator, **params)] * 64
    result = Sampler([EOS])(LOGITS.expand(64, -1), rows)
    assert set(result.token_ids) <= {3, 5}


def test_greedy_picks_the_best_allowed_token_and_logprobs_are_renormalised():
    result = Sampler([EOS])(LOGITS, [row(temperature=0.0, logprobs=True, top_logprobs=3)])
    assert result.token_ids == [3]  # the allowed tokens 3 and 5 have logits 0.5 and 0.0
    reported = result.logprobs[0]
    expected = torch.log_softmax(torch.tensor([0.5, 0.0]), dim=0)
    assert reported.logprob == pytest.approx(float(expected[0]), abs=1e-5)
    assert [t for t, _ in reported.top[:2]] == [3, 5]
    assert reported.top[2][1] == -9999.0  # masked tokens have no probability


def test_a_masked_row_does_not_change_its_unmasked_neighbours():
    logits = torch.randn(3, VOCAB)
    plain = Sampler([EOS])(logits, [row(allowed=None, temperature=0.0)] * 3).token_ids
    mixed = Sampler([EOS])(logits, [row(allowed=None, temperature=0.0), row(temperature=0.0),
                                    row(allowed=None, temperature=0.0)]).token_ids
    assert mixed[0] == plain[0] and mixed[2] == plain[2] and mixed[1] in (3, 5)


# ---- the compiler on SmolLM2's vocabulary ----------------------------------------------------

@pytest.fixture(scope="module")
def smollm2():
    tokenizer = Tokenizer.load(resolve_model(DEFAULT_MODEL_ID))
    return tokenizer, GrammarCompiler(tokenizer.backend, 49152, tokenizer.eos_token_ids)


def test_mask_admits_exactly_the_grammar(smollm2):
    tokenizer, compiler = smollm2
    constraint = compiler.compile(GrammarSpec(json_schema={
        "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
        "additionalProperties": False}))
    for token_id in tokenizer.encode('{"ok": ', add_special_tokens=False):
        assert compiler.allowed_tokens([constraint])[0, token_id]
        assert constraint.advance(token_id)
    allowed = compiler.allowed_tokens([constraint])[0].nonzero().flatten().tolist()
    texts = {tokenizer.token_text(t) for t in allowed}
    assert texts and all("true".startswith(t) or "false".startswith(t) for t in texts)
    for token_id in tokenizer.encode("true}", add_special_tokens=False):
        assert constraint.advance(token_id)
    assert constraint.is_complete


def test_batched_masks_are_per_request(smollm2):
    tokenizer, compiler = smollm2
    digits = compiler.compile(GrammarSpec(lark='start: /[0-9]+/ "."'))
    letters = compiler.compile(GrammarSpec(lark='start: /[a-z]+/ "."'))
    masks = compiler.allowed_tokens([digits, letters])  # [2, V]
    assert masks.shape == (2, 49152)
    seven, cat = (tokenizer.encode(t, add_special_tokens=False)[0] for t in ("7", "cat"))
    assert masks[0, seven] and not masks[0, cat]
    assert masks[1, cat] and not masks[1, seven]


@pytest.mark.parametrize("spec", [
    GrammarSpec(json_schema={"type": "nonsense"}),
    GrammarSpec(json_schema={"$ref": "#/$defs/missing"}),
    GrammarSpec(lark="start: undefined_rule"),
])
def test_bad_grammars_are_rejected_with_a_reason(smollm2, spec):
    with pytest.raises(InvalidGrammar) as error:
        smollm2[1].compile(spec)
    assert str(error.value)


def test_lark_can_embed_a_json_schema(smollm2):
    tokenizer, compiler = smollm2
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    constraint = compiler.compile(GrammarSpec(lark='start: "<x>" obj "</x>"\nobj: %json '
                                                   + json.dumps(schema)))
    assert constraint.matcher.consume_tokens(
        tokenizer.encode('<x>{"n": 12}</x>', add_special_tokens=False))
    assert constraint.is_complete
