"""GGUF files with synthetic weights of real mixture-of-experts shapes, for bench/moe.py.

No MoE weights can be downloaded here, so the bench writes files with every tensor of a real
model's shape in the types a real file gives it, filled with valid random blocks (random
quant bytes, small positive fp16 scales: finite weights of about the size trained ones have),
and the tokenizer metadata of the Qwen2.5 GGUF the catalogue carries. The depth is cut so
that shoal and llama.cpp fit in memory side by side; the cut keeps the file's mix of types
by taking, for layer j of n, the type the full model gives layer j * full // n.

Writing streams tensor by tensor (the header first, then each tensor's bytes), so a 5 GB
file never sits in memory; it takes about a minute.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

from shoal.catalog.resolve import resolve_model

TOKENIZER_MODEL = "qwen2.5-coder-0.5b-instruct"  # Qwen2/Qwen3's tokenizer, 151,936 tokens


@dataclass(frozen=True)
class Shape:
    """A model's shapes and the GGUF architecture keys they become."""

    arch: str
    full_layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    top_k: int
    expert_ffn: int
    vocab: int
    rope_theta: float
    rms_eps: float
    extra_keys: dict = field(default_factory=dict)
    note: str = ""


QWEN3_30B_A3B = Shape(arch="qwen3moe", full_layers=48, hidden=2048, heads=32, kv_heads=4,
                      head_dim=128, experts=128, top_k=8, expert_ffn=768, vocab=151_936,
                      rope_theta=1e6, rms_eps=1e-6)
# gpt-oss-20b's shapes with the Qwen2.5 tokenizer: no o200k tokenizer exists here, so the
# vocabulary is Qwen's 151,936 rows, not gpt-oss's 201,088 (a smaller head and embedding).
GPT_OSS_20B = Shape(arch="gpt-oss", full_layers=24, hidden=2880, heads=64, kv_heads=8,
                    head_dim=64, experts=32, top_k=4, expert_ffn=2880, vocab=151_936,
                    rope_theta=150_000.0, rms_eps=1e-5,
                    extra_keys={"attention.sliding_window": 128,
                                "rope.scaling.type": "yarn", "rope.scaling.factor": 32.0,
                                "rope.scaling.original_context_length": 4096},
                    note="gpt-oss-20b shapes with the Qwen2.5 tokenizer and its 151,936-token "
                         "vocabulary (no o200k tokenizer here; gpt-oss has 201,088)")
SHAPES = {"qwen3moe": QWEN3_30B_A3B, "gpt-oss": GPT_OSS_20B}


def _use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's rule (src/llama-quant.cpp) for which layers Q4_K_M gives Q6_K."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]  # numpy order: [.., out, in] (GGUF's reversed)
    qtype: Q


def qwen3moe_tensors(s: Shape, layers: int) -> list[TensorSpec]:
    """Every tensor of a qwen3moe file in llama.cpp's Q4_K_M types: Q4_K everywhere but
    attn_v and ffn_down(_exps) in the layers _use_more_bits names (Q6_K), output Q6_K, the
    router (ffn_gate_inp, never quantized) and norms float32."""
    h, e, f = s.hidden, s.experts, s.expert_ffn
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    out = [TensorSpec("token_embd.weight", (s.vocab, h), Q.Q4_K)]
    for i in range(layers):
        more = Q.Q6_K if _use_more_bits(i * s.full_layers // layers, s.full_layers) else Q.Q4_K
        p = f"blk.{i}."
        out += [TensorSpec(p + "attn_norm.weight", (h,), Q.F32),
                TensorSpec(p + "attn_q.weight", (q, h), Q.Q4_K),
                TensorSpec(p + "attn_k.weight", (kv, h), Q.Q4_K),
                TensorSpec(p + "attn_v.weight", (kv, h), more),
                TensorSpec(p + "attn_output.weight", (h, q), Q.Q4_K),
                TensorSpec(p + "attn_q_norm.weight", (s.head_dim,), Q.F32),
                TensorSpec(p + "attn_k_norm.weight", (s.head_dim,), Q.F32),
                TensorSpec(p + "ffn_norm.weight", (h,), Q.F32),
                TensorSpec(p + "ffn_gate_inp.weight", (e, h), Q.F32),
                TensorSpec(p + "ffn_gate_exps.weight", (e, f, h), Q.Q4_K),
                TensorSpec(p + "ffn_up_exps.weight", (e, f, h), Q.Q4_K),
                TensorSpec(p + "ffn_down_exps.weight", (e, h, f), more)]
    return out + [TensorSpec("output_norm.weight", (h,), Q.F32),
                  TensorSpec("output.weight", (s.vocab, h), Q.Q6_K)]


def gpt_oss_tensors(s: Shape, layers: int) -> list[TensorSpec]:
    """gpt-oss as ggml-org's MXFP4 file stores it: experts MXFP4 with float32 biases,
    attention with biases and per-head sinks; 2,880 is no multiple of 256, so the dense
    matrices take Q8_0 (what llama.cpp falls back to for such rows)."""
    h, e, f = s.hidden, s.experts, s.expert_ffn
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    out = [TensorSpec("token_embd.weight", (s.vocab, h), Q.Q8_0)]
    for i in range(layers):
        p = f"blk.{i}."
        out += [TensorSpec(p + "attn_norm.weight", (h,), Q.F32),
                TensorSpec(p + "attn_q.weight", (q, h), Q.Q8_0),
                TensorSpec(p + "attn_q.bias", (q,), Q.F32),
                TensorSpec(p + "attn_k.weight", (kv, h), Q.Q8_0),
                TensorSpec(p + "attn_k.bias", (kv,), Q.F32),
                TensorSpec(p + "attn_v.weight", (kv, h), Q.Q8_0),
                TensorSpec(p + "attn_v.bias", (kv,), Q.F32),
                TensorSpec(p + "attn_output.weight", (h, q), Q.Q8_0),
                TensorSpec(p + "attn_output.bias", (h,), Q.F32),
                TensorSpec(p + "attn_sinks.weight", (s.heads,), Q.F32),
                TensorSpec(p + "post_attention_norm.weight", (h,), Q.F32),
                TensorSpec(p + "ffn_gate_inp.weight", (e, h), Q.F32),
                TensorSpec(p + "ffn_gate_inp.bias", (e,), Q.F32),
                TensorSpec(p + "ffn_gate_exps.weight", (e, f, h), Q.MXFP4),
                TensorSpec(p + "ffn_gate_exps.bias", (e, f), Q.F32),
                TensorSpec(p + "ffn_up_exps.weight", (e, f, h), Q.MXFP4),
                TensorSpec(p + "ffn_up_exps.bias", (e, f), Q.F32),
                TensorSpec(p + "ffn_down_exps.weight", (e, h, f), Q.MXFP4),
                TensorSpec(p + "ffn_down_exps.bias", (e, h), Q.F32)]
    return out + [TensorSpec("output_norm.weight", (h,), Q.F32),
                  TensorSpec("output.weight", (s.vocab, h), Q.Q8_0)]


TENSORS = {"qwen3moe": qwen3moe_tensors, "gpt-oss": gpt_oss_tensors}


def _f16_bytes(rng: np.random.Generator, n: int, low: float, high: float) -> np.ndarray:
    return rng.uniform(low, high, n).astype(np.float16).view(np.uint8).reshape(n, 2)


def random_blocks(qtype: Q, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Valid random data of a tensor, as the file stores it (uint8 [..., row bytes] for the
    quantized types): random quant bytes with scales chosen so weights stay within ~±0.05."""
    if qtype == Q.F32:
        if len(shape) == 1:  # norms and sinks near 1 / biases: harmless either way
            return rng.uniform(0.9, 1.1, shape).astype(np.float32)
        return rng.normal(0.0, 0.02, shape).astype(np.float32)
    block_weights, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    rows = int(np.prod(shape[:-1]))
    blocks = rows * shape[-1] // block_weights
    data = rng.integers(0, 256, (blocks, block_bytes), dtype=np.uint8)
    if qtype == Q.Q4_K:  # d, dmin fp16 first; w = d * sc * q - dmin * m (6-bit sc, m, q < 16)
        data[:, 0:2] = _f16_bytes(rng, blocks, 2e-5, 6e-5)
        data[:, 2:4] = _f16_bytes(rng, blocks, 1e-4, 4e-4)
    elif qtype == Q.Q6_K:  # d fp16 last; w = d * scale (int8) * (q - 32)
        data[:, -2:] = _f16_bytes(rng, blocks, 1e-5, 3e-5)
    elif qtype == Q.Q8_0:  # d fp16 first; w = d * q (int8)
        data[:, 0:2] = _f16_bytes(rng, blocks, 1e-4, 4e-4)
    elif qtype == Q.MXFP4:  # e8m0 scale first: 2^(e - 127); e2m1 values up to 6
        data[:, 0] = rng.integers(119, 122, blocks, dtype=np.uint8)
    else:
        raise ValueError(f"no random blocks for {qtype.name}")
    return data.reshape(*shape[:-1], -1)


def _tokenizer_fields() -> Iterator[tuple[str, object, gguf.GGUFValueType,
                                          gguf.GGUFValueType | None]]:
    reader = gguf.GGUFReader(resolve_model(TOKENIZER_MODEL).path)
    for name, f in reader.fields.items():
        if name.startswith("tokenizer."):
            sub = f.types[1] if len(f.types) > 1 else None
            yield name, f.contents(), f.types[0], sub


def write_model(path: Path, family: str, layers: int, seed: int = 0) -> Path:
    """Writes the synthetic file (through a temporary name, so a cut-off write is never
    taken for a finished file)."""
    s = SHAPES[family]
    specs = TENSORS[family](s, layers)
    tmp = path.with_suffix(".partial")
    writer = gguf.GGUFWriter(tmp, s.arch)
    a = s.arch
    writer.add_name(f"synthetic {family} {layers} layers")
    writer.add_uint32(f"{a}.block_count", layers)
    writer.add_uint32(f"{a}.context_length", 32768)
    writer.add_uint32(f"{a}.embedding_length", s.hidden)
    writer.add_uint32(f"{a}.feed_forward_length", s.expert_ffn * s.top_k)
    writer.add_uint32(f"{a}.attention.head_count", s.heads)
    writer.add_uint32(f"{a}.attention.head_count_kv", s.kv_heads)
    writer.add_uint32(f"{a}.attention.key_length", s.head_dim)
    writer.add_uint32(f"{a}.attention.value_length", s.head_dim)
    writer.add_float32(f"{a}.rope.freq_base", s.rope_theta)
    writer.add_float32(f"{a}.attention.layer_norm_rms_epsilon", s.rms_eps)
    writer.add_uint32(f"{a}.expert_count", s.experts)
    writer.add_uint32(f"{a}.expert_used_count", s.top_k)
    writer.add_uint32(f"{a}.expert_feed_forward_length", s.expert_ffn)
    for key, value in s.extra_keys.items():
        if isinstance(value, str):
            writer.add_string(f"{a}.{key}", value)
        elif isinstance(value, float):
            writer.add_float32(f"{a}.{key}", value)
        else:
            writer.add_uint32(f"{a}.{key}", value)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    for name, value, vtype, sub in _tokenizer_fields():
        writer.add_key_value(name, value, vtype, sub_type=sub)
    for spec in specs:
        if spec.qtype == Q.F32:
            writer.add_tensor_info(spec.name, spec.shape, np.dtype(np.float32),
                                   4 * int(np.prod(spec.shape)))
        else:
            block_weights, block_bytes = gguf.GGML_QUANT_SIZES[spec.qtype]
            nbytes = int(np.prod(spec.shape)) // block_weights * block_bytes
            stored = (*spec.shape[:-1], spec.shape[-1] // block_weights * block_bytes)
            writer.add_tensor_info(spec.name, stored, np.dtype(np.uint8), nbytes,
                                   raw_dtype=spec.qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for spec in specs:
        writer.write_tensor_data(random_blocks(spec.qtype, spec.shape, rng))
    writer.close()
    tmp.rename(path)
    return path


def model_path(work_dir: Path, family: str, layers: int) -> Path:
    """The cached file for (family, depth), written on first use."""
    path = work_dir / f"synthetic-{family}-{layers}l.gguf"
    if not path.exists():
        work_dir.mkdir(parents=True, exist_ok=True)
        write_model(path, family, layers)
    return path


def bytes_per_token(path: Path) -> dict:
    """Bytes a batch-1 decode step reads: every tensor in full but the embedding (one row)
    and the experts (top_k of each layer's experts)."""
    reader = gguf.GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()
    top_k = reader.fields[f"{arch}.expert_used_count"].contents()
    experts = reader.fields[f"{arch}.expert_count"].contents()
    parts = {"experts": 0.0, "embedding_row": 0.0, "rest": 0.0}
    total = 0
    for t in reader.tensors:
        n = int(t.n_bytes)
        total += n
        if "_exps" in t.name:
            parts["experts"] += n * top_k / experts
        elif t.name.startswith("token_embd"):
            parts["embedding_row"] += n / int(t.shape[-1])  # ne[1] is the vocabulary
        else:
            parts["rest"] += n
    return {"file_bytes": total, "read_per_token_bytes": int(sum(parts.values())),
            **{f"{key}_bytes": int(v) for key, v in parts.items()}}
