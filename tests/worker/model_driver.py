"""A minimal hand-driven runner for model tests: block and slot bookkeeping, BatchMetadata built
per step (prefill chunks first, then decodes), greedy continuation. Deliberately independent of
`worker.engine` so the models are checked on their own."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from worker.engine.batch import BatchMetadata
from worker.models.causal_lm import CausalLM


@dataclass
class DrivenSequence:
    tokens: list[int]
    slot: int
    prompt_len: int
    computed: int = 0
    blocks: list[int] = field(default_factory=list)
    # Logits (float32) of the token at each position after it was computed.
    logits: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len :]


class ModelDriver:
    def __init__(
        self,
        model: CausalLM,
        num_blocks: int = 64,
        block_size: int = 4,
        num_slots: int = 8,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.cache = model.allocate_cache(
            num_blocks, block_size, num_slots, kv_dtype or model.dtype, model.device
        )
        self.free_blocks = list(range(num_blocks))
        self.free_slots = list(range(num_slots))
        self.seqs: dict[int, DrivenSequence] = {}

    def add(self, seq_id: int, prompt: list[int]) -> None:
        self.seqs[seq_id] = DrivenSequence(list(prompt), self.free_slots.pop(0), len(prompt))

    def remove(self, seq_id: int) -> DrivenSequence:
        seq = self.seqs.pop(seq_id)
        self.free_blocks = seq.blocks + self.free_blocks  # reused first: stale data must not leak
        self.free_slots.insert(0, seq.slot)
        return seq

    @torch.no_grad()
    def step(self, feeds: dict[int, int]) -> None:
        """Feed `feeds[seq_id]` not-yet-computed tokens of each sequence in one forward step."""
        device = self.model.device
        is_prefill = {s: self.seqs[s].computed == 0 or n > 1 for s, n in feeds.items()}
        order = [s for s in feeds if is_prefill[s]] + [s for s in feeds if not is_prefill[s]]
        ids, positions, slots, cu, ctx, tables = [], [], [], [0], [], []
        for s in order:
            seq, n = self.seqs[s], feeds[s]
            start, end = seq.computed, seq.computed + n
            assert end <= len(seq.tokens)
            while len(seq.blocks) * self.block_size < end:
                seq.blocks.append(self.free_blocks.pop(0))
            ids += seq.tokens[start:end]
            positions += list(range(start, end))
            slots += [
                seq.blocks[p // self.block_size] * self.block_size + p % self.block_size
                for p in range(start, end)
            ]
            cu.append(cu[-1] + n)
            ctx.append(end)
            tables.append(seq.blocks)
        width = max(len(t) for t in tables)
        meta = BatchMetadata(
            seq_ids=order,
            num_prefills=sum(is_prefill.values()),
            query_lens=[feeds[s] for s in order],
            context_lens=torch.tensor(ctx, dtype=torch.int32, device=device),
            cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=device),
            positions=torch.tensor(positions, dtype=torch.int64, device=device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            block_tables=torch.tensor(
                [t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device
            ),
            state_slots=torch.tensor(
                [self.seqs[s].slot for s in order], dtype=torch.int64, device=device
            ),
            has_initial_state=torch.tensor(
                [self.seqs[s].computed > 0 for s in order], dtype=torch.bool, device=device
            ),
            logits_indices=torch.tensor(cu[1:], dtype=torch.int64, device=device) - 1,
        )
        hidden = self.model(torch.tensor(ids, dtype=torch.int64, device=device), meta, self.cache)
        logits = self.model.compute_logits(hidden[meta.logits_indices]).cpu()
        for row, s in enumerate(order):
            seq = self.seqs[s]
            seq.computed += feeds[s]
            seq.logits[seq.computed - 1] = logits[row]

    def greedy_step(self, seq_ids: list[int], prefill_chunk: int = 1 << 30) -> None:
        """One step for these sequences: the next prompt chunk or the last generated token; a
        sequence whose every token is computed gets its greedy next token appended."""
        feeds = {}
        for s in seq_ids:
            seq = self.seqs[s]
            feeds[s] = min(prefill_chunk, len(seq.tokens) - seq.computed)
        self.step(feeds)
        for s in seq_ids:
            seq = self.seqs[s]
            if seq.computed == len(seq.tokens):
                seq.tokens.append(int(seq.logits[seq.computed - 1].argmax()))

    def generate(self, prompt: list[int], new_tokens: int, seq_id: int = 0) -> DrivenSequence:
        """Greedy generation of one sequence, alone in the batch."""
        self.add(seq_id, prompt)
        while len(self.seqs[seq_id].generated) < new_tokens:
            self.greedy_step([seq_id])
        return self.remove(seq_id)
