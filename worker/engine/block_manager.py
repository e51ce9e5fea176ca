"""Paged KV cache bookkeeping: which fixed-size blocks each sequence's tokens live in.

A sequence's tokens at positions [i * block_size, (i + 1) * block_size) live in block
`seq.block_table[i]`; the flat KV slot of position p is
`block_table[p // block_size] * block_size + p % block_size`.

Each block records the engine step of its last write (its page age), so that a later staged
cache can re-encode pages that have not been written for a while (FP8 -> 3-bit).
"""

from __future__ import annotations

from collections import deque

from worker.engine.sequence import Sequence

NEVER_WRITTEN = -1


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("need at least one block of at least one token")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._is_free = [True] * num_blocks
        self.last_write_step = [NEVER_WRITTEN] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks `seq` must gain so that positions [0, num_tokens) have a slot."""
        return max(0, self.blocks_for(num_tokens) - len(seq.block_table))

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.num_new_blocks(seq, num_tokens) <= len(self._free)

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Give `seq` blocks for positions [0, num_tokens); raises if there are too few."""
        needed = self.num_new_blocks(seq, num_tokens)
        if needed > len(self._free):
            raise RuntimeError(f"{needed} KV blocks needed, {len(self._free)} free")
        for _ in range(needed):
            block = self._free.popleft()
            self._is_free[block] = False
            seq.block_table.append(block)

    def free(self, seq: Sequence) -> None:
        # Freed blocks go to the back of the free list: the most recently used are reused last.
        for block in seq.block_table:
            if self._is_free[block]:
                raise RuntimeError(f"KV block {block} freed twice")
            self._is_free[block] = True
            self._free.append(block)
        seq.block_table = []

    def record_write(self, seq: Sequence, start: int, end: int, step: int) -> None:
        """Mark the blocks holding positions [start, end) of `seq` as written at `step`."""
        if end <= start:
            return
        for i in range(start // self.block_size, (end - 1) // self.block_size + 1):
            self.last_write_step[seq.block_table[i]] = step

    def page_ages(self, seq: Sequence, step: int) -> list[int]:
        """Steps since each of `seq`'s blocks was last written (in block-table order)."""
        return [step - self.last_write_step[b] for b in seq.block_table]

    def slot(self, seq: Sequence, position: int) -> int:
        return seq.block_table[position // self.block_size] * self.block_size + (
            position % self.block_size
        )
