"""The compiled kernels' output heads: an estimate with its top candidates rescored exactly.

The head is the biggest single read of a decode step (SmolLM2's tied Q8_0 table is 28 MB,
Qwen2.5-Coder-0.5B's untied one 145 MB, Gemma 3's tied one 178 MB, Qwen2.5-Coder-1.5B's
Q6_K one 191 MB). Generated rows read an estimate of it and recompute the estimate's top 64
tokens of each row exactly (256 for a narrow head's 4-bit estimate): the tokens sampling can
realistically pick get the head's exact values, the far tail keeps the estimate.

A head in another wide type (Qwen2.5-Coder-1.5B's Q6_K) estimates from a copy where memory
allows one: 3-bit codes (heads of hidden >=
COPY_3_BITS_MIN_HIDDEN) or 4-bit codes, with a scale and minimum per 64 weights (3.5 or 4.5
bits a weight, kernels/quant_head_copy.h), multiplied with x rounded to int8 (Int8Estimate):
vpdpbusd on VNNI, vpmaddubsw on AVX2 (the same bits), the copy read as one stream. On
Qwen2.5-Coder-1.5B's head the 3-bit copy (102 MB) takes 1.3-2.1 ms a row on an AVX512 host
where a Q4_1 copy (146 MB) on the exact kernels took 2.7-3.7; on a 2-core AVX2 host 4.2 ms
against 5.7-7.0, and 4 rows 13 ms against 15.5. Prompt rows (the first token of each
request) use the exact head.

A Q8_0 head (SmolLM2's, Gemma 3's, Qwen2.5-Coder-0.5B's) splits its table into its codes'
high and low nibbles instead, in the bytes Q8_0 takes (SplitTable,
kernels/quant_head_split.h): the high nibbles are the estimate, half the bytes to read, and
both give exact rows, for the candidates and for a tied embedding's lookups. No copy: the
head takes no memory beyond the file's. Gemma 3's head takes 1.3 ms a row on a 2-core
AVX512 host where an estimate from the Q8_0 codes themselves took 4.9. Over ~700-900
generated rows of real text the split estimate put the exact top 8 within its top 44
(Gemma 3), 60 (SmolLM2) and 17 (the 0.5B), the exact top token within its top 10, 7 and 2;
it rescores 256, as a narrow head's 4-bit copy does. Against the 4-bit copies SmolLM2 and
the 0.5B kept before (16 and 77 MB), decode steps measured the same or faster (one row,
and 16 rows, on a 2-core AVX512 host, runs in alternation). Such a head has no exact pass
over the whole table, so its prompt rows too are the estimate with the top candidates exact.

Every row of the head takes the generated-token arithmetic (QuantLinear's prompt=False), the
last prompt row too: it is one row per request, where the prompt path's tile split would
decode the whole head for it (27 ms of Gemma 3's 500-token prefill).
"""

from __future__ import annotations

import torch

from shoal.engine.backends.packing import QuantLinear, file_bytes, pack, packed_type
from shoal.engine.models.layers.base import Layer
from shoal.engine.models.layers.embedding import Embedding
from shoal.engine.models.layers.head import ExactHead
from shoal.engine.weights.quant import RawTensor

# Candidates recomputed exactly per generated row. The exact winner lies inside the
# estimate's top 64 on every row measured, so greedy decoding is unchanged. A narrow head's
# 4-bit copy orders the next few more loosely (SmolLM2: the exact top 8 within the top 93
# and 145 in two runs of sampled rows of synthetic text; 51 on real text), so it rescores
# 256: 0.04 ms more a row than 64 on SmolLM2, 1.1 ms more for 16 rows.
RESCORE_CANDIDATES = 64
NARROW_RESCORE_CANDIDATES = 256
# An estimate pays for itself only for big heads stored in 6 bits or more.
ESTIMATE_MIN_WEIGHTS = 8 * 2**20
_WIDE_TYPES = {"Q6_K", "Q8_0", "F16", "BF16", "F32"}
# Rows requantized at a time while a copy is built (bounds the float32 scratch; a multiple of
# the layouts' 16-row strips).
_ESTIMATE_CHUNK_ROWS = 4096
COPY_BLOCK = 64  # weights per scale and minimum of a copy
SPLIT_BLOCK = 32  # weights per scale of a split Q8_0 table (Q8_0's block)
_FP16_MAX = 65504.0
# 3-bit codes order the top tokens well enough only for wide heads. Worst estimate rank of
# the exact top 8 over ~900 rows of real text, with 3-bit / 4-bit codes: hidden 1536
# (Qwen2.5-Coder-1.5B) 36 / 18, 896 (the 0.5B) 62 / 17, 576 (SmolLM2) 326 / 51.
COPY_3_BITS_MIN_HIDDEN = 1024


def packed_head(kernel, raw: RawTensor, embedding: Embedding | None, spare_bytes: int
                ) -> Layer:
    """The head of a packed table [vocab, hidden] (packed_type(raw) is not None): a split
    table, an exact head with a 3- or 4-bit copy for its estimate where spare_bytes allow,
    or the exact head alone. A tied head multiplies with the embedding's packed bytes, so
    the table is held once."""
    if splits_table(kernel, raw):
        return _split_head(kernel, raw, embedding)
    vocab, hidden = raw.shape
    tied = embedding is not None
    estimated = raw.quant in _WIDE_TYPES and vocab * hidden >= ESTIMATE_MIN_WEIGHTS
    bits = 3 if hidden >= COPY_3_BITS_MIN_HIDDEN else 4
    copies = (estimated and kernel.quant_copy_estimate_available() and hidden % COPY_BLOCK == 0
              and _copy_bytes(vocab, hidden, bits) <= spare_bytes)
    code, packed = (embedding.type_code, embedding.packed) if tied else pack(raw, kernel)
    if copies:
        copy = _copy(kernel, code, packed, vocab, hidden, bits)
        if copy is not None:  # None: a weight beyond fp16's range (the copy's scales)
            return EstimatedHead(_exact(kernel, code, packed, vocab, hidden),
                                 Int8Estimate(kernel, copy, vocab, hidden, bits=bits), tied,
                                 _candidates(bits, hidden))
    return ExactHead(_exact(kernel, code, packed, vocab, hidden), tied)


def splits_table(kernel, raw: RawTensor) -> bool:
    """Whether packed_head makes this head a split table (SplitTable): a Q8_0 head big
    enough to estimate, on a CPU with the split kernels. A tied embedding need not pack
    the table first (Embedding(..., split_by_head=True))."""
    vocab, hidden = raw.shape
    return (raw.quant == "Q8_0" and packed_type(raw) is not None
            and vocab * hidden >= ESTIMATE_MIN_WEIGHTS and hidden % SPLIT_BLOCK == 0
            and kernel.quant_split_estimate_available())


def _split_head(kernel, raw: RawTensor, embedding: Embedding | None) -> SplitHead:
    """A Q8_0 head as its split table (SplitTable), built from the file's bytes once a tied
    embedding has let go of its packed table: the table is never held twice, not even while
    loading."""
    vocab, hidden = raw.shape
    if embedding is not None:
        embedding.packed = None
    split = kernel.quant_head_split_from_file(file_bytes(raw), vocab, hidden)
    raw.release()
    table = SplitTable(kernel, split, vocab, hidden)
    if embedding is not None:
        embedding.use_split(table)
    return SplitHead(table, embedding is not None, _candidates(4, hidden))


def _exact(kernel, code: int, packed: torch.Tensor, vocab: int, hidden: int) -> QuantLinear:
    return QuantLinear(kernel.QuantLinear([code], [packed], [vocab], hidden, None),
                       float_out=True)


def _candidates(bits: int, hidden: int) -> int:
    """Rows rescored: a narrow head's 4-bit estimate orders the top tokens more loosely."""
    return NARROW_RESCORE_CANDIDATES if bits == 4 and hidden < COPY_3_BITS_MIN_HIDDEN \
        else RESCORE_CANDIDATES


def _rescored(logits: torch.Tensor, candidates: int, exact_columns) -> torch.Tensor:
    """logits [S, V] (an estimate) with each row's top `candidates` replaced by
    exact_columns(indices [S, C]) -> [S, C]."""
    indices = logits.topk(min(candidates, logits.shape[-1]), dim=-1).indices  # [S, C]
    return logits.scatter_(1, indices, exact_columns(indices))


class EstimatedHead(Layer):
    """logits of generated rows: the estimate, with each row's top `candidates` recomputed
    exactly; of prompt rows (from prompt_from on): the exact head."""

    def __init__(self, exact: QuantLinear, estimate, tied: bool,
                 candidates: int = RESCORE_CANDIDATES) -> None:
        super().__init__()
        self.exact, self.estimate, self.tied = exact, estimate, tied
        self.out_features, self.candidates = exact.out_features, candidates

    def forward(self, x: torch.Tensor, prompt_from: int | None = None) -> torch.Tensor:
        """x: [S, hidden] bf16 -> float32 logits [S, vocab]."""
        rows = x.shape[0]
        if rows == 0:  # a step with nothing to sample (a prompt's middle chunk)
            return torch.empty(0, self.out_features, dtype=torch.float32, device=x.device)
        generated = rows if prompt_from is None else min(prompt_from, rows)
        parts = []
        if generated:
            parts.append(self._rescored(x[:generated]))
        if generated < rows:
            parts.append(self.exact(x[generated:]))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _rescored(self, x: torch.Tensor) -> torch.Tensor:
        return _rescored(self.estimate.forward(x, True, False), self.candidates,
                         lambda indices: self.exact.op.forward_columns(x, indices))

    def nbytes(self) -> int:
        return self.estimate.nbytes() + (0 if self.tied else self.exact.nbytes())


class SplitHead(Layer):
    """logits of a split Q8_0 table (SplitTable): for every row, prompt rows too (the table
    has no exact pass of its own, and a prompt gives one row per request), the estimate with
    its top `candidates` recomputed exactly."""

    def __init__(self, table: SplitTable, tied: bool, candidates: int) -> None:
        super().__init__()
        self.table, self.tied, self.candidates = table, tied, candidates
        self.out_features = table.vocab

    def forward(self, x: torch.Tensor, prompt_from: int | None = None) -> torch.Tensor:
        """x: [S, hidden] bf16 -> float32 logits [S, vocab]."""
        if x.shape[0] == 0:
            return torch.empty(0, self.out_features, dtype=torch.float32, device=x.device)
        return _rescored(self.table.estimate(x), self.candidates,
                         lambda indices: self.table.columns(x, indices))

    def nbytes(self) -> int:
        return 0 if self.tied else self.table.nbytes()


class SplitTable:
    """A Q8_0 [vocab, hidden] table as its codes' high and low nibbles
    (kernels/quant_head_split.h), in the bytes Q8_0 takes: the high nibbles alone are the
    head's estimate (half the bytes to read), both give exact rows (gguf's values). A tied
    embedding looks its rows up here."""

    def __init__(self, kernel, split: torch.Tensor, vocab: int, hidden: int) -> None:
        self.kernel, self.split, self.vocab, self.hidden = kernel, split, vocab, hidden

    def estimate(self, x: torch.Tensor) -> torch.Tensor:
        """x: [S, hidden] bf16 -> float32 [S, vocab], x rounded to int8 per 32."""
        return self.kernel.quant_int8_estimate_split(self.split, self.vocab, self.hidden, x)

    def columns(self, x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """x [S, hidden] bf16 times rows indices [S, C] exactly -> float32 [S, C]."""
        return self.kernel.quant_head_split_columns(self.split, self.vocab, self.hidden, x,
                                                    indices)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 [T, hidden]: rows ids [T], gguf's values."""
        return self.kernel.quant_head_split_rows(self.split, self.vocab, self.hidden, ids)

    def nbytes(self) -> int:
        return self.split.numel()


class Int8Estimate:
    """The head's 3- or 4-bit copy times x quantized to int8 (VNNI or AVX2); the copy's bytes
    are the estimate's own. QuantLinear's forward for the estimate's one use."""

    def __init__(self, kernel, packed: torch.Tensor, vocab: int, hidden: int, bits: int) -> None:
        self.kernel, self.packed, self.vocab, self.hidden = kernel, packed, vocab, hidden
        self.bits = bits

    def forward(self, x: torch.Tensor, float_out: bool = True, prompt: bool = False
                ) -> torch.Tensor:
        """x: [S, hidden] bf16 -> float32 [S, vocab]."""
        return self.kernel.quant_int8_estimate_copy(self.packed, self.vocab, self.hidden,
                                                    self.bits, x)

    def nbytes(self) -> int:
        return self.packed.numel()


def _copy_bytes(vocab: int, hidden: int, bits: int) -> int:
    """kernels/quant_head_copy.h: per 16 rows x 64 weights, 32 bytes of scales and minima
    and the codes."""
    return -(-vocab // 16) * (hidden // COPY_BLOCK) * (64 + 128 * bits)


def _copy(kernel, code: int, packed: torch.Tensor, vocab: int, hidden: int, bits: int
          ) -> torch.Tensor | None:
    """The packed head requantized to a bits-bit copy a chunk of rows at a time (R a
    multiple of 16 but for the last chunk): the copy's layout is strips of 16 rows, so the
    chunks' bytes join in order. None when a weight lies beyond fp16's range (the copy's
    scales and minima are fp16): such a head keeps no copy."""
    parts = []
    for start in range(0, vocab, _ESTIMATE_CHUNK_ROWS):
        rows = torch.arange(start, min(vocab, start + _ESTIMATE_CHUNK_ROWS))
        values = kernel.quant_dequantize_rows(code, packed, vocab, hidden, rows)  # [R, H]
        if not values.abs().amax() <= _FP16_MAX:  # NaN fails too
            return None
        parts.append(kernel.quant_head_copy_pack(values, bits))
    return torch.cat(parts)

