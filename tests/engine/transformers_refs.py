"""transformers' side of the golden, model and tokenizer tests: its greedy tokens, its GGUF
reads made affordable, and each GGUF's tokenizer loaded once a session (the golden and
tokenizer tests both compare with it; Gemma 3's takes ~30 s to build from its 262k-token
vocabulary)."""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path

import numpy as np
import pytest
import torch


def read_whole(path, mode="r", dtype=np.uint8) -> np.ndarray:
    """Stands in for np.memmap in the GGUF readers: the file read whole into memory."""
    return np.fromfile(path, dtype=dtype)


@contextlib.contextmanager
def one_gguf_read():
    """transformers parses a GGUF's metadata for the tokenizer, again for the config and
    again for the weights: ~20 s each for a 150k-token vocabulary, most of it in numpy's
    memmap subclass, whose views cost ~20x a plain array's (gguf.GGUFReader takes one for
    every token of the vocabulary). Inside this context the three share one reader of the
    file, read into memory, and the tensor-name map of an architecture is built once, not
    once per module of the model (~5 s for Qwen2.5's 24 layers)."""
    gguf = pytest.importorskip("gguf")
    read = functools.lru_cache(maxsize=1)(gguf.GGUFReader)
    name_map = functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf.gguf_reader.np, "memmap", read_whole)
        patch.setattr(gguf, "GGUFReader", lambda path, mode="r": read(str(path), mode))
        patch.setattr(gguf, "get_tensor_name_map", name_map)
        yield


def transformers_tokenizer(path: Path):
    """transformers' tokenizer of a GGUF file, built once a session (call it inside
    one_gguf_read when the same file's model loads next)."""
    pytest.importorskip("transformers")
    return _tokenizer(str(path))


@functools.lru_cache(maxsize=None)
def _tokenizer(path: str):
    import transformers

    file = Path(path)
    with contextlib.ExitStack() as stack:
        if not _inside_one_read():
            stack.enter_context(one_gguf_read())
        return transformers.AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)


def _inside_one_read() -> bool:
    import gguf.gguf_reader

    return gguf.gguf_reader.np.memmap is read_whole


def transformers_greedy(model, prompt_ids: list[int], steps: int) -> list[int]:
    """The reference's greedy tokens: an argmax loop over its KV cache (generate() would
    change min-token handling)."""
    out = []
    with torch.no_grad():
        result = model(torch.tensor([prompt_ids]), use_cache=True)
        for _ in range(steps):
            token = int(result.logits[0, -1].argmax())
            out.append(token)
            result = model(torch.tensor([[token]]), past_key_values=result.past_key_values,
                           use_cache=True)
    return out
