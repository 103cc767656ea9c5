"""ModelRunner: a SchedulerOutput -> flat token tensors + attention metadata -> forward -> logits.

All chunks' tokens go through the linear layers as one [T_total, hidden] matrix. Attention
runs per group: consecutive single-token chunks (decodes) form one padded batch; every longer
chunk (a prefill piece) is its own group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shoal.engine.kv.row_buffer import RowBuffer
from shoal.engine.kv.tensors import allocate_kv_cache
from shoal.engine.models.layers.attention import (
    AttentionGroup,
    AttentionMetadata,
    AttentionView,
    DecodeRows,
    RowKeys,
    RowBufferWrite,
)
from shoal.engine.models.loader import LoadedModel
from shoal.engine.scheduler_output import ScheduledChunk, SchedulerOutput


@dataclass
class StepPart:
    """Chunks computed in one forward pass, rows in the order of `chunks` (indices into
    the step's chunks)."""

    meta: AttentionMetadata
    token_ids: torch.Tensor  # [T] int64
    chunks: list[int]


@dataclass
class PreparedStep:
    """A step's parts; sample_order maps the parts' logits rows back to chunk order (None
    when they already are)."""

    parts: list[StepPart]
    sample_order: torch.Tensor | None = None


@dataclass(frozen=True)
class _KeyWindow:
    """Keys positions [lo_b, ctx_b) of each request b in a group, padded to `length`."""

    lo: list[int]
    ctx: list[int]

    @property
    def length(self) -> int:
        return max(c - lo for lo, c in zip(self.lo, self.ctx))

    @property
    def uniform(self) -> bool:
        return len({c - lo for lo, c in zip(self.lo, self.ctx)}) == 1


class ModelRunner:
    """Owns the paged KV cache of one model stage and runs its forward pass."""

    def __init__(self, loaded: LoadedModel, num_blocks: int, block_size: int,
                 device: str | torch.device = "cpu", row_buffer_tokens: int = 0) -> None:
        """row_buffer_tokens: slots for the decode row buffer (kv/row_buffer.py); 0 gathers every
        step."""
        self.loaded = loaded
        self.model = loaded.module
        self.config = loaded.config
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device = torch.device(device)
        start, end = loaded.layer_range
        self.kv_caches = allocate_kv_cache(self.config, end - start, num_blocks, block_size,
                                           loaded.cache_dtype, self.device, row_buffer_tokens)
        self.row_buffer = (RowBuffer(num_blocks * block_size, row_buffer_tokens)
                           if row_buffer_tokens else None)
        backend = self.model.plan.backend
        self.mask_dtype = backend.attention_dtype
        # Where the backend attends row by row (the compiled kernels), each group is
        # described by its rows' keys: a row's result does not depend on how its prompt
        # was split. A model whose attention is torch's on every backend (latent
        # attention) takes views of its keys instead.
        self._row_attention = backend.attends_rows and self.model.row_attention

    def block_tensors(self) -> list[torch.Tensor]:
        """Every cache tensor whose axis 1 is the slot axis, layer by layer: what moving a
        block's KV out of or into this cache copies (kv/transfer.py). A quantized cache
        lists its scale tensors here too."""
        return list(self.kv_caches)

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput,
                hidden_states: torch.Tensor | None = None) -> torch.Tensor:
        """float32 logits [num_logits, vocab]: for each chunk with needs_sample, in chunk
        order, its num_logits rows (one, or one per draft and one more). A stage without
        the output head returns hidden states [T_total, hidden] instead (rows in the order
        of prepare()'s parts), and a stage without the embedding takes them as
        `hidden_states`."""
        return self.execute_prepared(self.prepare(scheduler_output), hidden_states)

    @torch.inference_mode()
    def execute_prepared(self, step: PreparedStep,
                         hidden_states: torch.Tensor | None = None) -> torch.Tensor:
        """execute() on a step from prepare(): a pipeline rank prepares while the rank
        before it computes, then waits for its hidden states."""
        if not self.model.has_embedding and hidden_states is None:
            raise ValueError("this stage has no embedding: pass hidden_states")
        outputs = []
        row = 0
        for part in step.parts:
            count = part.token_ids.shape[0]
            inputs = part.token_ids if self.model.has_embedding else \
                hidden_states[row:row + count]
            row += count
            hidden = self.model(inputs, part.meta, self.kv_caches)
            if not self.model.has_head:
                outputs.append(hidden)
                continue
            meta = part.meta
            if meta.logits_indices.shape[0] != hidden.shape[0]:
                hidden = hidden[meta.logits_indices]
            outputs.append(self.model.compute_logits(hidden, meta.logits_prompt_from))
        out = outputs[0] if len(outputs) == 1 else torch.cat(outputs)
        if not self.model.has_head or step.sample_order is None:
            return out
        return out[step.sample_order]

    def prepare(self, scheduler_output: SchedulerOutput) -> PreparedStep:
        """Flat token ids, positions, KV slots and attention groups for one step, in parts.

        Generated tokens (single-token chunks that are not prompt, and a generated token
        with the guesses after it) run on the compiled decode kernel where it applies, a
        row per token; everything else on the Python path, its generated tokens first. A
        token is thus always computed the same way whatever shares its step, and a guess
        that is kept has the bits it would have had without guessing.
        """
        chunks = scheduler_output.chunks
        for chunk in chunks:
            self._check(chunk)
        decodes = [i for i, c in enumerate(chunks)
                   if len(c.token_ids) == 1 + c.num_drafts and not c.prompt]
        fused = self.model.fused_decoder() if decodes else None
        parts: list[StepPart] = []
        rest = list(range(len(chunks)))
        rows = sum(len(chunks[i].token_ids) for i in decodes)
        if fused is not None and rows <= fused.max_rows:
            parts.append(self._part(chunks, decodes, fused=True))
            rest = [i for i in rest if i not in set(decodes)]
        if rest:
            ordered = ([i for i in rest if not chunks[i].prompt]
                       + [i for i in rest if chunks[i].prompt])
            parts.append(self._part(chunks, ordered, fused=False))
        if self.row_buffer is not None and not any(
                g.row_buffer_write for part in parts for g in part.meta.groups):
            self.row_buffer.reset()
        in_parts = [i for part in parts for i in part.chunks if chunks[i].needs_sample]
        in_chunks = [i for i, c in enumerate(chunks) if c.needs_sample]
        order = None
        if in_parts != in_chunks:
            # A chunk's logits rows stay together (more than one when it carries drafts).
            first, row = {}, 0
            for chunk_index in in_parts:
                first[chunk_index] = row
                row += chunks[chunk_index].num_logits
            order = torch.tensor([first[i] + j for i in in_chunks
                                  for j in range(chunks[i].num_logits)],
                                 dtype=torch.long, device=self.device)
        return PreparedStep(parts=parts, sample_order=order)

    def _part(self, chunks: tuple[ScheduledChunk, ...], indices: list[int],
              fused: bool) -> StepPart:
        members = tuple(chunks[i] for i in indices)
        token_ids: list[int] = []
        positions: list[int] = []
        logits_rows: list[int] = []
        prompt_from = logits_prompt_from = None
        for chunk in members:
            if chunk.prompt and prompt_from is None:
                prompt_from, logits_prompt_from = len(token_ids), len(logits_rows)
            token_ids.extend(chunk.token_ids)
            positions.extend(range(chunk.start_position, chunk.context_len))
            if chunk.needs_sample:
                # The last token's row, and a row per draft before it (verification).
                logits_rows.extend(range(len(token_ids) - chunk.num_logits, len(token_ids)))
        device = self.device
        decode = None
        if fused:
            # One row per token: a chunk with guesses repeats its block table per position.
            per_chunk = torch.tensor([len(c.token_ids) for c in members])
            tables = self._block_tables(members).repeat_interleave(per_chunk, 0)
            decode = DecodeRows(tables=tables, context_lens=torch.tensor(positions) + 1,
                                block_size=self.block_size,
                                chained=any(c.num_drafts for c in members))
        meta = AttentionMetadata(
            positions=torch.tensor(positions, dtype=torch.long, device=device),
            slot_mapping=self._slot_mapping(members).to(device),
            groups=[] if fused else self._groups(members),
            logits_indices=torch.tensor(logits_rows, dtype=torch.long, device=device),
            decode=decode, prompt_from=prompt_from, logits_prompt_from=logits_prompt_from)
        return StepPart(meta=meta, token_ids=torch.tensor(token_ids, dtype=torch.long,
                                                          device=device),
                        chunks=indices)

    def _check(self, chunk: ScheduledChunk) -> None:
        if not chunk.token_ids:
            raise ValueError(f"request {chunk.request_id}: empty chunk")
        if chunk.context_len > self.config.max_position:
            raise ValueError(f"request {chunk.request_id}: position {chunk.context_len - 1} "
                             f"exceeds the model's context ({self.config.max_position})")
        if -(-chunk.context_len // self.block_size) > len(chunk.block_ids):
            raise ValueError(f"request {chunk.request_id}: block table too short for "
                             f"{chunk.context_len} tokens")

    def _slot_mapping(self, chunks) -> torch.Tensor:
        size = self.block_size
        slots = [chunk.block_ids[p // size] * size + p % size
                 for chunk in chunks for p in range(chunk.start_position, chunk.context_len)]
        return torch.tensor(slots, dtype=torch.long)

    def _groups(self, chunks: tuple[ScheduledChunk, ...]) -> list[AttentionGroup]:
        groups: list[AttentionGroup] = []
        row = index = 0
        while index < len(chunks):
            end = index + 1
            if len(chunks[index].token_ids) == 1:
                # Single-token chunks share a group, prompt and generated ones apart (each
                # kind has its own row attention).
                while (end < len(chunks) and len(chunks[end].token_ids) == 1
                       and chunks[end].prompt == chunks[index].prompt):
                    end += 1
            members = chunks[index:end]
            groups.append(self._group(row, members))
            row += sum(len(c.token_ids) for c in members)
            index = end
        return groups

    def _group(self, row: int, members: tuple[ScheduledChunk, ...]) -> AttentionGroup:
        query_len = len(members[0].token_ids)
        ctx = [c.context_len for c in members]
        if self._row_attention:
            window = self.config.sliding_window
            sliding = self._row_keys(members, window) if window is not None else None
            return AttentionGroup(
                token_start=row, batch=len(members), query_len=query_len,
                full=AttentionView(gather=None, mask=None, rows=self._row_keys(members, None)),
                sliding=None if sliding is None else AttentionView(gather=None, mask=None,
                                                                   rows=sliding))
        if query_len == 1 and self.row_buffer is not None:
            buffered = self._row_buffer_group(row, members, ctx)
            if buffered is not None:
                return buffered
        single = members[0].block_ids if len(members) == 1 else None
        if single is not None and members[0].start_position == 0 and query_len > 1:
            # A fresh prefill attends only to its own new keys: no gather needed.
            full = AttentionView(gather=None, mask=None, is_causal=True)
        else:
            full = self._view(members, _KeyWindow([0] * len(ctx), ctx), query_len, None)
        sliding = None
        window = self.config.sliding_window
        if window is not None and max(ctx) > window:
            lo = [max(0, c - query_len - window + 1) for c in ctx]
            sliding = self._view(members, _KeyWindow(lo, ctx), query_len, window)
        return AttentionGroup(token_start=row, batch=len(members), query_len=query_len,
                              full=full, sliding=sliding)

    def _row_keys(self, members: tuple[ScheduledChunk, ...], window: int | None) -> RowKeys:
        """Each member's rows over its own keys: position p sees positions [lo, p], lo = 0
        or, in a sliding window, p - window + 1."""
        size = self.block_size
        slots, bases, positions, los = [], [], [], []
        base = 0
        for chunk in members:
            every = torch.arange(chunk.context_len)
            table = torch.tensor(chunk.block_ids, dtype=torch.long)
            slots.append(table[every // size] * size + every % size)
            new = torch.arange(chunk.start_position, chunk.context_len)
            positions.append(new)
            los.append(new * 0 if window is None else (new - window + 1).clamp(min=0))
            bases.append(torch.full_like(new, base))
            base += chunk.context_len
        device = self.device
        return RowKeys(key_slots=torch.cat(slots).to(device), base=torch.cat(bases).to(device),
                       position=torch.cat(positions).to(device), lo=torch.cat(los).to(device),
                       prompt=members[0].prompt)

    def _row_buffer_group(self, row: int, members: tuple[ScheduledChunk, ...],
                          ctx: list[int]) -> AttentionGroup | None:
        """A decode group read from the row buffer, where it would otherwise gather; None if
        a lone request can slice the cache or the batch does not fit the row buffer."""
        if len(members) == 1 and self._span(members[0].block_ids, 0, ctx[0]) is not None:
            return None
        layout = self.row_buffer.fit(tuple(c.request_id for c in members), tuple(ctx))
        if layout is None:
            return None
        first, row_len = layout.first, layout.row_len
        keys = _KeyWindow([0] * len(ctx), ctx)
        if layout.rebuild:
            write = RowBufferWrite(first, rebuild=self._gather(members, keys, row_len))
        else:
            slots = [first + b * row_len + c - 1 for b, c in enumerate(ctx)]
            write = RowBufferWrite(first, append=torch.tensor(slots, device=self.device))
        mask = None if keys.uniform else self._mask(keys, 1, None)
        full = AttentionView(gather=None, mask=mask, buffered=(first, row_len, 0, max(ctx)))
        sliding = None
        window = self.config.sliding_window
        if window is not None and max(ctx) > window:
            # Sliding layers read only the rows' last `window` positions (and mask the rest).
            lo = max(0, min(ctx) - window)
            window_keys = _KeyWindow([lo] * len(ctx), ctx)
            sliding = AttentionView(gather=None, mask=self._mask(window_keys, 1, window),
                                    buffered=(first, row_len, lo, max(ctx)))
        return AttentionGroup(token_start=row, batch=len(members), query_len=1, full=full,
                              sliding=sliding, row_buffer_write=write)

    def _view(self, members: tuple[ScheduledChunk, ...], keys: _KeyWindow, query_len: int,
              window: int | None) -> AttentionView:
        """The keys [lo, ctx) of each member: a slice of the cache when a lone request's
        blocks are consecutive, else a gather; masked unless every key is visible."""
        span = None
        if len(members) == 1:
            span = self._span(members[0].block_ids, keys.lo[0], keys.ctx[0])
        mask = None
        if query_len > 1 or not keys.uniform:
            mask = self._mask(keys, query_len, window)
        gather = None if span is not None else self._gather(members, keys)
        return AttentionView(gather=gather, mask=mask, span=span)

    def _span(self, block_ids, lo: int, ctx: int) -> tuple[int, int] | None:
        """Slots [first, end) of key positions [lo, ctx) when their blocks are consecutive."""
        size = self.block_size
        blocks = block_ids[lo // size:-(-ctx // size)]
        if any(b != blocks[0] + i for i, b in enumerate(blocks)):
            return None
        first = blocks[0] * size + lo % size
        return first, first + ctx - lo

    def _gather(self, members, keys: _KeyWindow, length: int | None = None) -> torch.Tensor:
        """[B * L] KV slots, row-major [B, L] (L = length, by default the longest window);
        padding repeats each row's last real slot."""
        size = self.block_size
        tables = self._block_tables(members)  # padding uses block 0 (its keys are masked out)
        lo = torch.tensor(keys.lo, dtype=torch.long)[:, None]
        ctx = torch.tensor(keys.ctx, dtype=torch.long)[:, None]
        positions = torch.arange(keys.length if length is None else length)
        key_pos = torch.minimum(lo + positions[None, :], ctx - 1)  # [B, L]
        gather = tables.gather(1, key_pos // size) * size + key_pos % size
        return gather.flatten().to(self.device)

    def _block_tables(self, members) -> torch.Tensor:
        """[B, max blocks] int64: each member's blocks up to its context, padded with 0."""
        needed = [-(-c.context_len // self.block_size) for c in members]
        width = max(needed)
        return torch.tensor([list(c.block_ids[:n]) + [0] * (width - n)
                             for c, n in zip(members, needed)], dtype=torch.long)

    def _mask(self, keys: _KeyWindow, query_len: int, window: int | None) -> torch.Tensor:
        """[B, 1, Tq, L] additive mask: 0 where query t of row b sees key l, else -inf."""
        lo = torch.tensor(keys.lo, dtype=torch.long)[:, None]
        ctx = torch.tensor(keys.ctx, dtype=torch.long)[:, None]
        key_pos = lo + torch.arange(keys.length)[None, :]               # [B, L]
        query_pos = ctx - query_len + torch.arange(query_len)[None, :]  # [B, Tq]
        allowed = (key_pos < ctx)[:, None, :] & (key_pos[:, None, :] <= query_pos[:, :, None])
        if window is not None:
            allowed &= key_pos[:, None, :] > query_pos[:, :, None] - window
        # Additive float mask, converted once here instead of inside every layer.
        mask = torch.zeros(allowed.shape, dtype=self.mask_dtype)
        mask.masked_fill_(~allowed, float("-inf"))
        return mask.unsqueeze(1).to(self.device)
