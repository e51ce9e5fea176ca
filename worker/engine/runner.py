"""The one runner between decide and execute: ScheduledBatch -> tensors -> model -> tokens."""

from __future__ import annotations

from typing import Any

import torch

from worker.engine.batch import BatchMetadata
from worker.engine.sampler import Sampler
from worker.engine.scheduler import ScheduledBatch


def model_device(model: torch.nn.Module) -> torch.device:
    for tensor in model.parameters():
        return tensor.device
    return torch.device("cpu")


def model_dtype(model: torch.nn.Module) -> torch.dtype:
    for tensor in model.parameters():
        if tensor.is_floating_point():
            return tensor.dtype
    return torch.float32


class ModelRunner:
    """Owns the model's cache; runs one scheduled batch per call and returns sampled tokens.

    `forward` is the seam for CUDA graphs: a graph runner overrides it to replay captured
    decode-only steps (padded to a captured batch size) and falls back to eager otherwise.
    """

    def __init__(
        self,
        model: Any,
        num_blocks: int,
        block_size: int,
        num_state_slots: int,
        kv_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        self.model = model
        self.device = torch.device(device) if device is not None else model_device(model)
        self.block_size = block_size
        self.kv_dtype = kv_dtype or model_dtype(model)
        self.cache = model.allocate_cache(
            num_blocks, block_size, num_state_slots, self.kv_dtype, self.device
        )
        self.sampler = Sampler()

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, BatchMetadata]:
        """Input token ids [T] and the step's metadata, on the model's device."""
        entries = batch.entries
        query_lens = [e.num_tokens for e in entries]
        input_ids: list[int] = []
        for e in entries:
            input_ids.extend(e.seq.token_ids(e.start, e.end))
        starts = torch.tensor([e.start for e in entries], dtype=torch.int64)
        lens = torch.tensor(query_lens, dtype=torch.int64)
        cu_seqlens = torch.zeros(len(entries) + 1, dtype=torch.int32)
        cu_seqlens[1:] = torch.cumsum(lens, 0)

        # Position of every fed token: its sequence's start plus its offset within the chunk.
        seq_of_token = torch.repeat_interleave(torch.arange(len(entries)), lens)
        offset_in_chunk = torch.arange(int(lens.sum())) - cu_seqlens[:-1].long()[seq_of_token]
        positions = starts[seq_of_token] + offset_in_chunk

        max_blocks = max(len(e.seq.block_table) for e in entries)
        block_tables = torch.zeros(len(entries), max_blocks, dtype=torch.int32)
        for i, e in enumerate(entries):
            block_tables[i, : len(e.seq.block_table)] = torch.tensor(e.seq.block_table)
        blocks = block_tables[seq_of_token, positions // self.block_size].long()
        slot_mapping = blocks * self.block_size + positions % self.block_size

        state_slots = [e.seq.state_slot for e in entries]
        if any(s is None for s in state_slots):
            raise RuntimeError("a scheduled sequence holds no state slot")

        def on_device(t: torch.Tensor) -> torch.Tensor:
            return t.to(self.device, non_blocking=True)

        meta = BatchMetadata(
            seq_ids=[e.seq.seq_id for e in entries],
            num_prefills=len(batch.prefills),
            query_lens=query_lens,
            context_lens=on_device(torch.tensor([e.end for e in entries], dtype=torch.int32)),
            cu_seqlens=on_device(cu_seqlens),
            positions=on_device(positions),
            slot_mapping=on_device(slot_mapping),
            block_tables=on_device(block_tables),
            state_slots=on_device(torch.tensor(state_slots, dtype=torch.int64)),
            has_initial_state=on_device(torch.tensor([e.start > 0 for e in entries])),
            logits_indices=on_device(cu_seqlens[1:].long() - 1),
        )
        return on_device(torch.tensor(input_ids, dtype=torch.int64)), meta

    def forward(self, input_ids: torch.Tensor, meta: BatchMetadata) -> torch.Tensor:
        return self.model.forward(input_ids, meta, self.cache)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> list[int | None]:
        """Run one step; the next token of every entry that samples, None for the others."""
        entries = batch.entries
        input_ids, meta = self.prepare(batch)
        hidden = self.forward(input_ids, meta)
        rows = [i for i, e in enumerate(entries) if e.samples]
        next_tokens: list[int | None] = [None] * len(entries)
        if not rows:
            return next_tokens  # only prefill chunks that do not reach their sequence's end
        row_index = torch.tensor(rows, device=self.device)
        logits = self.model.compute_logits(hidden[meta.logits_indices[row_index]])
        sampled = self.sampler(logits, [entries[i].seq for i in rows])
        for i, token in zip(rows, sampled, strict=True):
            next_tokens[i] = token
        return next_tokens
