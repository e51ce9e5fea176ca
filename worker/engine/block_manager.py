"""Paged KV cache bookkeeping: which fixed-size blocks each sequence's tokens live in.

A sequence's tokens at positions [i * block_size, (i + 1) * block_size) live in block
`seq.block_table[i]`; the flat KV slot of position p is
`block_table[p // block_size] * block_size + p % block_size`.

Each block records the engine step of its last write (its page age).

Staged pages (optional, `num_compressed_blocks > 0`): block ids [0, num_blocks) are recent pages
(FP8 in the attention caches) and ids [first_compressed_block, first_compressed_block +
num_compressed_blocks) are compressed pages (TurboQuant codes); ids between the two kinds (the
runner's scratch page) are never handed out. New pages are always recent. `restage` decides, once per
step, which recent pages aged out: not one of a sequence's first `anchor_pages` (attention
sinks), not among its last `window_pages`, and not written in the last `min_age` steps. Each one
moves to a free compressed block (the table entry changes; the recent block is freed) and the
(recent, compressed) pairs are what the executor re-encodes before the step's forward. A
compressed page is never written again: only a sequence's last page takes new tokens.

Prefix caching (optional, `prefix_caching=True`; not combined with staging): a block whose
tokens are all computed is registered under a hash of its tokens chained with its prefix's hash
and the sequence's cache salt, so a later sequence with the same salt and the same leading
blocks takes the same block ids instead of computing them again. Blocks are reference-counted;
a registered block nobody holds stays cached in an LRU and is evicted (its registration
dropped) only when growth finds no free block, so the cache never fails a request that the pool
could hold without it.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict, deque
from collections.abc import Hashable

from worker.engine.sequence import PENDING_TOKEN, Sequence

NEVER_WRITTEN = -1

# The chain hash before a sequence's first block.
ROOT_HASH = 0


def block_key(parent: int, salt: Hashable, tokens: tuple[int, ...]) -> tuple[int, Hashable, tuple]:
    """What a full block is registered by: its prefix's chain hash, the salt, its tokens (the
    key is compared in full on a hit, so a hash collision can never share a wrong block)."""
    return (parent, salt, tokens)


def staged_recent_blocks(
    max_num_seqs: int,
    block_size: int,
    max_num_batched_tokens: int,
    window_pages: int = 8,
    anchor_pages: int = 1,
) -> int:
    """Recent pages that every running sequence's anchors, window and written page take, plus
    the pages of a step's prefill chunks until they are restaged next step."""
    chunk_pages = -(-max_num_batched_tokens // block_size) + max_num_seqs
    return max_num_seqs * (anchor_pages + window_pages + 1) + chunk_pages


def staged_pool_blocks(
    budget_bytes: int,
    recent_page_bytes: int,
    compressed_page_bytes: int,
    max_num_seqs: int,
    block_size: int,
    max_num_batched_tokens: int,
    window_pages: int = 8,
    anchor_pages: int = 1,
) -> tuple[int, int]:
    """(recent blocks, compressed blocks) for a byte budget: enough recent pages that every
    running sequence keeps its anchors, window, the page it writes and the pages of a step's
    prefill chunks until they are restaged next step; the rest of the budget compressed."""
    recent = staged_recent_blocks(
        max_num_seqs, block_size, max_num_batched_tokens, window_pages, anchor_pages
    )
    left = budget_bytes - recent * recent_page_bytes
    if left < 0:
        raise ValueError(
            f"a KV budget of {budget_bytes} bytes cannot hold the {recent} recent pages of "
            f"{recent_page_bytes} bytes that {max_num_seqs} sequences need"
        )
    return recent, left // compressed_page_bytes


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_compressed_blocks: int = 0,
        window_pages: int = 8,
        anchor_pages: int = 1,
        min_age: int = 1,
        first_compressed_block: int | None = None,
        prefix_caching: bool = False,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("need at least one block of at least one token")
        if num_compressed_blocks < 0 or window_pages < 1 or anchor_pages < 0 or min_age < 1:
            raise ValueError("staging needs a window of >= 1 page and pages at least 1 step old")
        self.num_blocks = num_blocks  # recent (uncompressed) blocks: what growth draws on
        self.block_size = block_size
        self.num_compressed_blocks = num_compressed_blocks
        self.window_pages = window_pages
        self.anchor_pages = anchor_pages
        self.min_age = min_age
        # compressed block ids start where the attention caches' recent pools end
        first = num_blocks if first_compressed_block is None else first_compressed_block
        if first < num_blocks:
            raise ValueError("compressed block ids must come after the recent ones")
        self.first_compressed_block = first
        total = first + num_compressed_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._free_compressed: deque[int] = deque(range(first, total))
        self._is_free = [True] * total
        self.last_write_step = [NEVER_WRITTEN] * total
        if prefix_caching and num_compressed_blocks:
            raise ValueError("prefix caching does not combine with staged KV")
        self.prefix_caching = prefix_caching
        self._ref = [0] * total  # sequences holding each block (prefix caching)
        self._key: dict[int, tuple] = {}  # registered block -> its block_key
        self._hash: dict[int, int] = {}  # registered block -> its chain hash
        self._cached: dict[int, int] = {}  # chain hash -> registered block
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unheld: LRU first
        self.num_evicted = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks growth may take: free ones, and cached ones nobody holds (evicted on use)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks `seq` must gain so that positions [0, num_tokens) have a slot."""
        return max(0, self.blocks_for(num_tokens) - len(seq.block_table))

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.num_new_blocks(seq, num_tokens) <= self.num_free_blocks

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Give `seq` blocks for positions [0, num_tokens); raises if there are too few."""
        needed = self.num_new_blocks(seq, num_tokens)
        if needed > self.num_free_blocks:
            raise RuntimeError(f"{needed} KV blocks needed, {self.num_free_blocks} free")
        for _ in range(needed):
            if self._free:
                block = self._free.popleft()
            else:  # under memory pressure: the least recently used cached block
                block, _ = self._evictable.popitem(last=False)
                self._unregister(block)
                self.num_evicted += 1
            self._is_free[block] = False
            self._ref[block] = 1
            seq.block_table.append(block)

    def free(self, seq: Sequence) -> None:
        # Freed blocks go to the back of the free list: the most recently used are reused last.
        # Cached blocks go to the back of the LRU, a sequence's last blocks first: its deepest
        # blocks (the least likely to match again) are evicted before its first ones.
        for block in reversed(seq.block_table) if self.prefix_caching else seq.block_table:
            if self.prefix_caching:
                self._ref[block] -= 1
                if self._ref[block] > 0:
                    continue
                if block in self._key:
                    self._evictable[block] = None
                    continue
            self._release(block)
        seq.block_table = []
        seq.block_hashes = []

    # --- prefix caching ----------------------------------------------------------------------

    def _unregister(self, block: int) -> None:
        del self._key[block]
        del self._cached[self._hash.pop(block)]

    def match(self, seq: Sequence, max_tokens: int) -> tuple[list[int], list[int]]:
        """(blocks, chain hashes) of the longest run of `seq`'s leading full blocks that are
        cached, covering at most `max_tokens` positions. Holds nothing (see `acquire`)."""
        if not self.prefix_caching:
            return [], []
        n = min(max_tokens, seq.num_tokens) // self.block_size
        tokens = seq.token_ids(0, n * self.block_size)
        if PENDING_TOKEN in tokens:
            return [], []
        blocks: list[int] = []
        hashes: list[int] = []
        parent, salt = ROOT_HASH, seq.params.cache_salt
        for i in range(n):
            key = block_key(
                parent, salt, tuple(tokens[i * self.block_size : (i + 1) * self.block_size])
            )
            h = hash(key)
            block = self._cached.get(h)
            if block is None or self._key[block] != key:
                break
            blocks.append(block)
            hashes.append(h)
            parent = h
        return blocks, hashes

    def num_unheld(self, blocks: list[int]) -> int:
        """How many of `blocks` sit in the LRU (taking them uses up free capacity)."""
        return sum(1 for b in blocks if b in self._evictable)

    def acquire(self, seq: Sequence, blocks: list[int], hashes: list[int]) -> None:
        """Make `blocks` (from `match`) the start of an empty `seq`'s block table."""
        if seq.block_table:
            raise RuntimeError("a sequence takes cached blocks only before it holds any")
        for block in blocks:
            self._evictable.pop(block, None)
            self._ref[block] += 1
        seq.block_table = list(blocks)
        seq.block_hashes = list(hashes)

    def register(self, seq: Sequence) -> None:
        """Register `seq`'s full blocks whose tokens are all computed (and known to the host)."""
        if not self.prefix_caching:
            return
        done = min(seq.num_computed_tokens, seq.num_tokens) // self.block_size
        first = len(seq.block_hashes)
        if first >= done:
            return
        parent = seq.block_hashes[-1] if seq.block_hashes else ROOT_HASH
        salt = seq.params.cache_salt
        for i in range(first, done):
            tokens = tuple(seq.token_ids(i * self.block_size, (i + 1) * self.block_size))
            if PENDING_TOKEN in tokens:
                return
            key = block_key(parent, salt, tokens)
            parent = hash(key)
            seq.block_hashes.append(parent)
            block = seq.block_table[i]
            if parent not in self._cached and block not in self._key:
                self._cached[parent] = block
                self._key[block] = key
                self._hash[block] = parent

    def _release(self, block: int) -> None:
        if self._is_free[block]:
            raise RuntimeError(f"KV block {block} freed twice")
        self._is_free[block] = True
        (self._free_compressed if self.is_compressed(block) else self._free).append(block)

    # --- staged pages ---------------------------------------------------------------------

    @property
    def num_free_compressed_blocks(self) -> int:
        return len(self._free_compressed)

    def is_compressed(self, block: int) -> bool:
        return block >= self.first_compressed_block

    def stale_pages(self, seq: Sequence, step: int) -> list[int]:
        """Indices into `seq.block_table` of its recent pages that aged out at `step`: past the
        anchors, before the window of the last `window_pages`, last written >= min_age ago.

        Found without a scan of the table: a sequence writes its pages in order, so their last
        writes never decrease along the table, and `restage` moves stale pages in table order,
        so past the anchors the compressed pages are a prefix and the stale recent ones follow
        it: a bisection to the first recent page, then the pages up to the first fresh one."""
        table = seq.block_table
        lo, hi = self.anchor_pages, len(table) - self.window_pages
        if lo >= hi:
            return []
        first = bisect.bisect_left(table, True, lo, hi, key=lambda b: not self.is_compressed(b))
        stale = []
        for i in range(first, hi):
            if step - self.last_write_step[table[i]] < self.min_age:
                break
            stale.append(i)
        return stale

    def restage(
        self, seqs: list[Sequence], step: int, max_pages: int | None = None
    ) -> list[tuple[int, int]]:
        """Move the stale pages of `seqs` (oldest sequences first, each one's pages in order) to
        compressed blocks, at most `max_pages` per call and while compressed blocks are free.
        Returns the (recent block, compressed block) pairs to re-encode before this step's
        forward; the recent blocks are already free for growth (writes to them are ordered
        after the re-encode on the device)."""
        moves: list[tuple[int, int]] = []
        if not self.num_compressed_blocks:
            return moves
        for seq in seqs:
            for i in self.stale_pages(seq, step):
                if not self._free_compressed or (max_pages is not None and len(moves) >= max_pages):
                    return moves
                recent, compressed = seq.block_table[i], self._free_compressed.popleft()
                self._is_free[compressed] = False
                self.last_write_step[compressed] = self.last_write_step[recent]
                seq.block_table[i] = compressed
                self._release(recent)
                moves.append((recent, compressed))
        return moves

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
