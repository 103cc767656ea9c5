"""The int8 KV cache against bf16's on real models: greedy agreement and loss on a fixed text.

Measured (8 chat prompts x 64 greedy tokens in one batch, 2 threads; the loss is the mean
cross-entropy over the 250-token text below, one prefill), int8 and, for scale, a float32
cache, each against a bf16 cache (docs/performance.md, "KV cache"):

    model, KV cache         identical prompts  tokens before the     tokens equal  loss (nats)
                            (of 8)             first divergence      overall       bf16: 3.4260
    SmolLM2-135M  int8      3                  55.5%                 57.2%         3.4212
                  float32   3                  59.0%                 60.2%         3.4278
    Qwen2.5-Coder int8      5                  73.4%                 73.6%         3.7188
     -0.5B        float32   7                  87.5%                 89.8%         3.7136
                                                                             bf16: 3.7170

Both models hold many near-ties that any rounding flips (float32's own divergence from bf16
shows how many); int8's loss stays within 0.005 nats of bf16's. With one float32 scale per
row instead of per 16 channels, Qwen2.5 lost 0.044 nats and kept 3/8 prompts (53.1%): its
keys carry a few large channels (kv/quant.py). Which near-ties flip moves with any kernel
change, so the test asserts these with a margin.
"""

from __future__ import annotations

import pytest
import torch
from forward_helpers import all_position_logits
from test_precision import QUESTIONS

from shoal.catalog.resolve import ModelNotFound, resolve_model
from shoal.engine.config import EngineConfig
from shoal.engine.engine import Engine
from shoal.engine.sampling import SamplingParams

pytestmark = pytest.mark.slow

NEW_TOKENS = 64
PROMPTS = QUESTIONS[:8]
TEXT = """The lighthouse keeper's log, kept for forty years on the northern cape, is mostly \
weather. Wind from the west at dawn, rain by noon, the lamp lit at half past four. But between \
the readings there are other notes. In the winter of the great storm he wrote that the sea came \
over the wall three times in one night, and that he carried the oil up the stairs in a bucket \
because the pipe had frozen. In spring he counted the birds returning to the cliffs and \
listed them by name. When the supply boat was late he rationed the coffee and wrote down how \
many cups were left each morning.

def running_total(values):
    \"\"\"Return the running totals of a list of numbers.\"\"\"
    total = 0
    result = []
    for value in values:
        total += value
        result.append(total)
    return result

Years later, when the light was automated and the keeper moved to the village, the log went \
to the museum, where visitors read it under glass. Most of them look for the storm. A few read \
the lists of birds, and one, a retired engineer, copied out every entry about the lamp and \
worked out how much oil the light had burned in four decades."""

MODELS = ("smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct")


def engine_for(model_id: str, kv_cache_dtype: str, cache_dir) -> Engine:
    try:
        source = resolve_model(model_id)
    except ModelNotFound as missing:
        pytest.skip(str(missing))
    return Engine(EngineConfig(source=source, threads=2, kv_cache_bytes=64 * 2**20,
                               kv_cache_dtype=kv_cache_dtype, cache_dir=cache_dir))


def greedy(engine: Engine) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for i, question in enumerate(PROMPTS):
        ids = engine.tokenizer.encode(engine.render_chat([{"role": "user", "content": question}]))
        engine.add_request(str(i), ids, params)
    out: list[list[int]] = [[] for _ in PROMPTS]
    for _ in range(10_000):
        if not engine.has_unfinished_requests():
            break
        for result in engine.step():
            out[int(result.request_id)].extend(result.token_ids)
    return out


def text_loss(engine: Engine) -> float:
    """Mean cross-entropy (nats) of each token of TEXT given the ones before it. Run last:
    it writes the KV blocks directly, past the scheduler."""
    ids = engine.tokenizer.encode(TEXT)
    blocks = list(range(-(-len(ids) // engine.config.block_size)))
    logits = all_position_logits(engine.runner, ids, blocks)  # [T, vocab]
    return torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:])).item()


def agreement(ours: list[list[int]], reference: list[list[int]]) -> dict:
    prefixes = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), NEW_TOKENS)
                for x, y in zip(ours, reference)]
    total = NEW_TOKENS * len(PROMPTS)
    return {"identical": sum(p == NEW_TOKENS for p in prefixes),
            "prefix_share": sum(prefixes) / total,
            "equal_share": sum(a == b for x, y in zip(ours, reference)
                               for a, b in zip(x, y)) / total}


def measure(model_id: str, cache_dir) -> dict:
    """The int8 cache against bf16's (the float32 cache's figures above were measured the
    same way, for scale; a test need not pay for a third model load)."""
    runs = {}
    for kv in ("bfloat16", "int8"):  # one engine at a time
        engine = engine_for(model_id, kv, cache_dir)
        assert engine.runner.kv_caches[0].dtype == getattr(torch, kv)
        tokens = greedy(engine)
        assert all(len(t) == NEW_TOKENS for t in tokens)
        runs[kv] = (tokens, text_loss(engine))
        del engine
    reference = runs["bfloat16"][0]
    return {kv: {**agreement(tokens, reference), "loss": loss}
            for kv, (tokens, loss) in runs.items() if kv != "bfloat16"} | {
        "bfloat16": {"loss": runs["bfloat16"][1]}}


# model -> (most extra loss in nats, fewest identical prompts, least share of tokens before
# the first divergence): about half the measured margins.
BOUNDS = {"smollm2-135m-instruct": (0.01, 1, 0.3),
          "qwen2.5-coder-0.5b-instruct": (0.02, 2, 0.4)}


@pytest.mark.parametrize("model_id", MODELS)
def test_int8_kv_agrees_with_bf16(model_id, tmp_path):
    result = measure(model_id, tmp_path)
    print(model_id, result)
    int8, bf16 = result["int8"], result["bfloat16"]
    extra_loss, identical, prefix_share = BOUNDS[model_id]
    assert int8["loss"] - bf16["loss"] < extra_loss, result
    assert int8["identical"] >= identical, result
    assert int8["prefix_share"] >= prefix_share, result
    assert int8["equal_share"] >= int8["prefix_share"], result
