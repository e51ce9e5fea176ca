"""Paged KV block bookkeeping and the DeltaNet state-slot pool."""

from __future__ import annotations

import pytest

from worker.engine.block_manager import NEVER_WRITTEN, BlockManager
from worker.engine.sequence import SamplingParams, Sequence
from worker.engine.state_slots import StateSlotPool


def seq(i: int = 0, n: int = 1) -> Sequence:
    return Sequence(i, f"r{i}", list(range(n)), SamplingParams())


def test_grow_gives_whole_blocks_and_slots_follow_the_table():
    bm = BlockManager(num_blocks=8, block_size=4)
    s = seq()
    bm.grow(s, 5)
    assert len(s.block_table) == 2 and bm.num_free_blocks == 6
    bm.grow(s, 8)  # still fits in two blocks
    assert len(s.block_table) == 2
    bm.grow(s, 9)
    assert len(s.block_table) == 3
    b0, b1, b2 = s.block_table
    assert [bm.slot(s, p) for p in (0, 3, 4, 8)] == [b0 * 4, b0 * 4 + 3, b1 * 4, b2 * 4]


def test_blocks_are_never_shared_and_free_returns_them():
    bm = BlockManager(num_blocks=6, block_size=2)
    a, b = seq(0), seq(1)
    bm.grow(a, 6)
    bm.grow(b, 6)
    assert not set(a.block_table) & set(b.block_table)
    assert bm.num_free_blocks == 0
    assert not bm.can_grow(a, 7) and bm.can_grow(a, 6)
    with pytest.raises(RuntimeError, match="needed"):
        bm.grow(a, 7)
    bm.free(a)
    assert a.block_table == [] and bm.num_free_blocks == 3
    assert bm.can_grow(b, 12)


def test_double_free_is_detected():
    bm = BlockManager(num_blocks=2, block_size=2)
    a = seq()
    bm.grow(a, 2)
    table = list(a.block_table)
    bm.free(a)
    a.block_table = table
    with pytest.raises(RuntimeError, match="twice"):
        bm.free(a)


def test_page_ages_record_the_step_of_the_last_write():
    bm = BlockManager(num_blocks=4, block_size=4)
    s = seq()
    bm.grow(s, 10)
    assert all(bm.last_write_step[b] == NEVER_WRITTEN for b in s.block_table)
    bm.record_write(s, 0, 6, step=1)  # positions 0-5: blocks 0 and 1
    bm.record_write(s, 6, 7, step=5)  # position 6: block 1 again
    bm.record_write(s, 8, 10, step=7)  # block 2
    assert bm.page_ages(s, step=10) == [9, 5, 3]
    bm.record_write(s, 3, 3, step=9)  # empty range writes nothing
    assert bm.page_ages(s, step=10) == [9, 5, 3]


def test_state_slot_pool():
    pool = StateSlotPool(3)
    slots = [pool.allocate() for _ in range(3)]
    assert sorted(slots) == [0, 1, 2] and pool.num_free == 0
    with pytest.raises(RuntimeError, match="no free"):
        pool.allocate()
    pool.free(slots[1])
    assert pool.allocate() == slots[1]
    pool.free(0)
    with pytest.raises(RuntimeError, match="twice"):
        pool.free(0)


def test_sizes_must_be_positive():
    with pytest.raises(ValueError):
        BlockManager(0, 16)
    with pytest.raises(ValueError):
        StateSlotPool(0)
