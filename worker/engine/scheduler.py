"""The scheduler: which sequences run this step, and how many of their tokens.

Policy (one step = one forward pass, at most `max_num_batched_tokens` tokens and
`max_num_seqs` sequences):

1. Decodes first: every running sequence with one token left to compute gets its token,
   oldest first. Decode latency never waits behind a long prompt.
2. Then running sequences still in prefill continue with their next chunk, oldest first.
3. Then waiting sequences are admitted first-come first-served while there is token budget,
   a free state slot, room under `max_num_seqs` and free KV blocks for their first chunk; the
   head of the queue is never skipped (no starvation of long prompts).

Prefill gathering (`prefill_gather_s` > 0): when a step would run nothing but new arrivals (no
decodes, no running prefill chunks), admission waits while arrivals keep coming: until
`prefill_gather_gap_s` passes with no new arrival, the oldest arrival has waited
`prefill_gather_s`, or the waiting prompts fill the token budget or the free sequence room.
Requests that arrive a few milliseconds apart (a wave of clients through HTTP) are then
prefilled in as few steps as requests arriving together are. Running sequences are never held; `admission_hold_s` says
how long the engine may sleep before scheduling again.

A chunk is as long as the remaining budget allows, so long prompts are split across steps
(chunked prefill) and mixed with decodes in the same batch.

When a running sequence needs a KV block and none is free, the newest running sequence not
yet scheduled this step is preempted by recompute: its blocks and state slot are freed and it
goes back to the front of the waiting queue with `num_computed_tokens = 0` (prompt and the
output so far are prefilled again later). If no other sequence can give way, the sequence
itself is preempted. No admissions happen in a step that preempted.

Prefix caching (the block manager's `prefix_caching`): a sequence being admitted with nothing
computed first takes the cached blocks of its longest cached prefix and starts computing after
them (at least its last token is always computed, for the logits). A model with DeltaNet layers
(`needs_state`) can only resume where a state checkpoint exists too, taken two ways, each a
copy of the sequence's state slot into a checkpoint slot after the step
(`ScheduledBatch.state_saves`):

- spacing checkpoints, every `checkpoint_blocks` blocks: a prefill chunk never crosses such a
  position without ending there, and the checkpoint is keyed by that prefix's chain hash at
  once (sequences running side by side share a system prompt through these);
- a tail checkpoint per running sequence: every step that ends at a block boundary (a prefill
  chunk, or a decode whose token completes a block) copies the state into the sequence's one
  held slot again, and when the sequence stops running (finished, aborted, preempted) that
  slot is keyed by the chain hash of the prefix it holds. A finished sequence that computed c
  tokens thus leaves the state at c // block_size * block_size, its answer included, whenever
  that boundary is past its prompt or a chunk end (a next turn of a conversation resumes
  there, not at the last spacing checkpoint of the previous prompt).

A hit resumes at the deepest block with both a cached KV block and a checkpoint, copying the
checkpoint into the sequence's slot before the step (`state_restores`).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from worker.engine.block_manager import BlockManager
from worker.engine.sequence import FinishReason, Sequence, SequenceStatus
from worker.engine.state_slots import StateCheckpoints, StateSlotPool


@dataclass
class ScheduledSeq:
    """One sequence's share of a step: positions [start, start + num_tokens) are fed."""

    seq: Sequence
    start: int
    num_tokens: int
    samples: bool  # the chunk reaches the sequence's last token: its logits give the next token

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def is_decode(self) -> bool:
        # One token on top of existing KV and state: the model's decode path serves it.
        return self.num_tokens == 1 and self.start > 0


@dataclass
class ScheduledBatch:
    step: int
    prefills: list[ScheduledSeq] = field(default_factory=list)
    decodes: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # Prefix caching: (source slot, destination slot) state copies to run before the forward
    # (checkpoint -> an admitted sequence's slot) and after it (a sequence's slot -> checkpoint)
    state_restores: list[tuple[int, int]] = field(default_factory=list)
    state_saves: list[tuple[int, int]] = field(default_factory=list)

    @property
    def entries(self) -> list[ScheduledSeq]:
        """Prefill chunks first, then decodes: the order of BatchMetadata."""
        return self.prefills + self.decodes

    @property
    def num_tokens(self) -> int:
        return sum(e.num_tokens for e in self.prefills) + len(self.decodes)

    @property
    def is_empty(self) -> bool:
        return not self.prefills and not self.decodes


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        state_slots: StateSlotPool,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        prefill_gather_s: float = 0.0,
        clock: Callable[[], float] = time.perf_counter,
        prefill_gather_gap_s: float | None = None,
        checkpoints: StateCheckpoints | None = None,
        checkpoint_blocks: int = 0,
        needs_state: bool = True,
    ) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if prefill_gather_s < 0:
            raise ValueError("prefill_gather_s must be >= 0")
        self.prefill_gather_s = prefill_gather_s
        self.prefill_gather_gap_s = (
            prefill_gather_s if prefill_gather_gap_s is None else (prefill_gather_gap_s)
        )
        self.clock = clock  # the clock of Sequence.arrival_time
        # > 0 after a schedule() that held arrivals: seconds until they are admitted anyway
        self.admission_hold_s = 0.0
        self.block_manager = block_manager
        self.state_slots = state_slots
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: oldest first
        self.step = 0
        self.checkpoints = (
            checkpoints if checkpoints is not None and checkpoints.num_slots else None
        )
        self.checkpoint_blocks = checkpoint_blocks
        self.needs_state = needs_state
        if self.checkpoints is not None and checkpoint_blocks < 1:
            raise ValueError("state checkpoints need a spacing of at least one block")
        # tokens between checkpoints; 0: chunks are not cut at checkpoint positions
        self._checkpoint_tokens = (
            checkpoint_blocks * block_manager.block_size
            if block_manager.prefix_caching and needs_state and self.checkpoints is not None
            else 0
        )

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        self.step += 1
        batch = ScheduledBatch(step=self.step)
        budget = self.max_num_batched_tokens
        scheduled: set[int] = set()

        for want_decodes in (True, False):
            for seq in list(self.running):
                if budget == 0:
                    break
                if seq.status is not SequenceStatus.RUNNING or seq.seq_id in scheduled:
                    continue  # preempted earlier in this step, or already in the batch
                is_decode = seq.num_computed_tokens > 0 and seq.num_uncomputed_tokens == 1
                if is_decode != want_decodes:
                    continue
                n = self._chunk(seq, seq.num_computed_tokens, budget)
                if not self._make_room(seq, seq.num_computed_tokens + n, scheduled, batch):
                    continue
                self._schedule(seq, n, batch)
                scheduled.add(seq.seq_id)
                budget -= n

        self.admission_hold_s = 0.0
        if batch.is_empty and not batch.preempted and self._gathering(budget):
            return batch
        while (
            self.waiting
            and budget > 0
            and not batch.preempted
            and len(self.running) < self.max_num_seqs
            and self.state_slots.num_free > 0
        ):
            seq = self.waiting[0]
            blocks, hashes, checkpoint = self._match(seq)
            start = len(blocks) * self.block_manager.block_size
            n = self._chunk(seq, start, budget)
            bm = self.block_manager
            need = bm.blocks_for(start + n) - len(blocks) + bm.num_unheld(blocks)
            if need > bm.num_free_blocks:
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            seq.state_slot = self.state_slots.allocate()
            if blocks:
                bm.acquire(seq, blocks, hashes)
                seq.num_computed_tokens = start
            if checkpoint is not None:
                batch.state_restores.append((checkpoint, seq.state_slot))
            if not seq.num_preemptions:
                seq.num_cached_tokens = min(start, seq.num_prompt_tokens)
            self.running.append(seq)
            self._schedule(seq, n, batch)
            budget -= n
        return batch

    def _match(self, seq: Sequence) -> tuple[list[int], list[int], int | None]:
        """(cached blocks, their chain hashes, checkpoint slot or None) `seq` resumes after."""
        if (
            not self.block_manager.prefix_caching
            or seq.num_computed_tokens
            or seq.params.prompt_logprobs is not None  # its logprobs need every position
        ):
            return [], [], None
        blocks, hashes = self.block_manager.match(seq, seq.num_tokens - 1)
        if not self.needs_state:
            return blocks, hashes, None
        if self.checkpoints is None:
            return [], [], None
        for k in range(len(blocks), 0, -1):  # tail checkpoints sit at any block boundary
            slot = self.checkpoints.get(hashes[k - 1])
            if slot is not None:
                return blocks[:k], hashes[:k], slot
        return [], [], None

    def _chunk(self, seq: Sequence, start: int, budget: int) -> int:
        """Tokens of `seq` to compute from `start` within `budget`; with state checkpoints a
        chunk ends at the next checkpoint position it would cross."""
        n = min(seq.num_tokens - start, budget)
        every = self._checkpoint_tokens
        if every and n > 1:
            boundary = (start // every + 1) * every
            n = min(n, boundary - start)
        return n

    def _gathering(self, budget: int) -> bool:
        """Whether to hold the waiting arrivals for more to come (see the module docstring)."""
        if self.prefill_gather_s <= 0 or not self.waiting:
            return False
        oldest = self.waiting[0]
        if oldest.num_preemptions:  # a preempted sequence resumes at once
            return False
        pending = sum(s.num_uncomputed_tokens for s in self.waiting)
        if pending >= budget or len(self.running) + len(self.waiting) >= self.max_num_seqs:
            return False
        newest = self.waiting[-1]
        until = min(
            oldest.arrival_time + self.prefill_gather_s,
            newest.arrival_time + self.prefill_gather_gap_s,
        )
        left = until - self.clock()
        if left <= 0:
            return False
        self.admission_hold_s = left
        return True

    def _make_room(
        self, seq: Sequence, num_tokens: int, scheduled: set[int], batch: ScheduledBatch
    ) -> bool:
        """Preempt until `seq` can hold `num_tokens`; False if `seq` itself was preempted."""
        while not self.block_manager.can_grow(seq, num_tokens):
            victim = next(
                (s for s in reversed(self.running) if s is not seq and s.seq_id not in scheduled),
                seq,
            )
            self._preempt(victim)
            batch.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _schedule(self, seq: Sequence, n: int, batch: ScheduledBatch) -> None:
        start = seq.num_computed_tokens
        self.block_manager.grow(seq, start + n)
        self.block_manager.record_write(seq, start, start + n, self.step)
        entry = ScheduledSeq(seq, start, n, samples=start + n == seq.num_tokens)
        (batch.decodes if entry.is_decode else batch.prefills).append(entry)

    def _release(self, seq: Sequence) -> None:
        if self.block_manager.prefix_caching:
            # blocks whose last tokens settled after the last step are registered before free,
            # so they stay cached (and name the tail checkpoint's prefix)
            self.block_manager.register(seq)
        if seq.checkpoint_slot is not None:
            assert self.checkpoints is not None
            blocks = seq.checkpoint_tokens // self.block_manager.block_size
            if 0 < blocks <= len(seq.block_hashes):
                self.checkpoints.bind(seq.checkpoint_slot, seq.block_hashes[blocks - 1])
            else:  # tokens it was computed from were dropped (computed past a stop)
                self.checkpoints.release(seq.checkpoint_slot)
            seq.checkpoint_slot, seq.checkpoint_tokens = None, 0
        self.block_manager.free(seq)
        if seq.state_slot is not None:
            self.state_slots.free(seq.state_slot)
            seq.state_slot = None
        seq.num_computed_tokens = 0

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)

    def complete(self, batch: ScheduledBatch, next_tokens: list[int | None]) -> None:
        """Record a step's results: chunks are now computed; sampling entries gain a token.

        `next_tokens` follows `batch.entries`; None where the entry did not sample.
        """
        for entry, token in zip(batch.entries, next_tokens, strict=True):
            entry.seq.num_computed_tokens = entry.end
            if entry.samples:
                if token is None:
                    raise ValueError(f"no token sampled for {entry.seq}")
                entry.seq.append_token(token)
            if self.block_manager.prefix_caching:
                self.block_manager.register(entry.seq)
        every = self._checkpoint_tokens
        if not every:
            return
        assert self.checkpoints is not None
        block_size = self.block_manager.block_size
        for entry in batch.entries:
            seq, end = entry.seq, entry.end
            if end % block_size or seq.state_slot is None or seq.is_finished:
                continue
            blocks = end // block_size
            if not entry.is_decode and end % every == 0 and len(seq.block_hashes) >= blocks:
                slot = self.checkpoints.put(seq.block_hashes[blocks - 1])
                if slot is not None:
                    batch.state_saves.append((seq.state_slot, slot))
            # the tail: keyed later, when the tokens before it are all known (a decode step's
            # input may still be in flight)
            if seq.checkpoint_slot is None:
                seq.checkpoint_slot = self.checkpoints.hold()
            if seq.checkpoint_slot is not None:
                batch.state_saves.append((seq.state_slot, seq.checkpoint_slot))
                seq.checkpoint_tokens = end

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Stop serving `seq` (done, aborted or failed) and free what it holds."""
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self._release(seq)
        else:
            self.waiting.remove(seq)
        seq.finish(reason)
