"""A llama-architecture GGUF with random F16 weights and a byte-level vocabulary, of any
size: what a test needs when a backend must hold real bytes (llama-server offloading a
model to a GPU) and no model of that size can be shipped. Written with the gguf package
alone (no transformers), in seconds for a few hundred MB."""

from __future__ import annotations

from pathlib import Path

import numpy as np


MERGES = ["h e", "l l", "Ġ t"]  # llama.cpp refuses a BPE vocabulary without merges


def byte_level_tokens() -> list[str]:
    """Three control tokens, GPT-2's printable form of every byte, then the merges'."""
    from shoal.engine.tokenizer.gguf_vocab import byte_alphabet

    alphabet = byte_alphabet()
    return (["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
            + [alphabet[b] for b in range(256)] + [m.replace(" ", "") for m in MERGES])


def write_random_llama_gguf(path: Path, hidden: int = 1024, layers: int = 8,
                            ffn: int = 2816, heads: int = 16, seed: int = 0,
                            extra_tokens: tuple[tuple[str, int], ...] = ()) -> int:
    """Writes the file; returns the bytes its tensors take. extra_tokens: (text, GGUF token
    type) appended to the vocabulary (a projector's image markers)."""
    import gguf

    tokens = byte_level_tokens() + [text for text, _ in extra_tokens]
    vocab = len(tokens)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(layers)
    writer.add_context_length(4096)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(heads)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 3] + [1] * (vocab - 3 - len(extra_tokens))
                           + [kind for _, kind in extra_tokens])
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                             "{{ m['content'] }}<|im_end|>\n{% endfor %}"
                             "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    rng = np.random.default_rng(seed)
    total = 0

    def add(name: str, *shape: int, norm: bool = False) -> None:
        nonlocal total
        if norm:
            values = np.ones(shape, dtype=np.float32)
        else:
            values = (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float16)
        writer.add_tensor(name, values)
        total += values.nbytes

    # GGUF shapes are written as numpy's [rows, columns] = [out, in].
    add("token_embd.weight", vocab, hidden)
    add("output_norm.weight", hidden, norm=True)
    add("output.weight", vocab, hidden)
    for layer in range(layers):
        block = f"blk.{layer}"
        add(f"{block}.attn_norm.weight", hidden, norm=True)
        for part in ("attn_q", "attn_k", "attn_v", "attn_output"):
            add(f"{block}.{part}.weight", hidden, hidden)
        add(f"{block}.ffn_norm.weight", hidden, norm=True)
        add(f"{block}.ffn_gate.weight", ffn, hidden)
        add(f"{block}.ffn_up.weight", ffn, hidden)
        add(f"{block}.ffn_down.weight", hidden, ffn)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return total
