"""The scheduler alone, in plain Python: policy, budget, preemption, abort, invariants."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from worker.engine.block_manager import BlockManager
from worker.engine.scheduler import Scheduler
from worker.engine.sequence import FinishReason, SamplingParams, Sequence, SequenceStatus
from worker.engine.state_slots import StateSlotPool


def make(num_blocks=64, block_size=4, max_num_seqs=4, budget=32) -> Scheduler:
    return Scheduler(
        BlockManager(num_blocks, block_size), StateSlotPool(max_num_seqs), max_num_seqs, budget
    )


def seq(i: int, prompt_len: int, max_tokens: int = 8) -> Sequence:
    return Sequence(i, f"r{i}", [1] * prompt_len, SamplingParams(max_tokens=max_tokens))


def run_step(sched: Scheduler):
    """Schedule and complete one step, sampling token 7 wherever a token is due."""
    batch = sched.schedule()
    sched.complete(batch, [7 if e.samples else None for e in batch.entries])
    return batch


def test_first_step_prefills_whole_prompts_within_budget():
    sched = make(budget=32)
    for i in range(3):
        sched.add(seq(i, 10))
    batch = sched.schedule()
    assert [(e.seq.seq_id, e.start, e.num_tokens) for e in batch.prefills] == [
        (0, 0, 10),
        (1, 0, 10),
        (2, 0, 10),
    ]
    assert not batch.decodes and batch.num_tokens == 30
    assert all(
        s.status is SequenceStatus.RUNNING and s.state_slot is not None for s in sched.running
    )


def test_long_prompt_is_chunked_and_decodes_go_first():
    sched = make(budget=8)
    short, long = seq(0, 3), seq(1, 20)
    sched.add(short)
    sched.add(long)
    b1 = run_step(sched)  # short's prompt (3) + the first 5 of long's
    assert [(e.seq.seq_id, e.num_tokens) for e in b1.prefills] == [(0, 3), (1, 5)]
    assert [e.samples for e in b1.entries] == [True, False]
    b2 = run_step(sched)  # short decodes first, long gets the remaining 7
    assert [(e.seq.seq_id, e.num_tokens) for e in b2.decodes] == [(0, 1)]
    assert [(e.seq.seq_id, e.start, e.num_tokens) for e in b2.prefills] == [(1, 5, 7)]
    assert b2.entries[0].seq is long  # BatchMetadata order: prefill chunks, then decodes
    b3 = run_step(sched)
    assert [(e.seq.seq_id, e.start, e.num_tokens) for e in b3.prefills] == [(1, 12, 7)]
    b4 = run_step(sched)  # long's last prompt token rides the decode path (state exists)
    assert [(e.seq.seq_id, e.start, e.num_tokens, e.samples) for e in b4.decodes] == [
        (0, 5, 1, True),
        (1, 19, 1, True),
    ]
    assert long.output_token_ids == [7]


def test_max_num_seqs_and_fcfs_head_is_not_skipped():
    sched = make(max_num_seqs=2, num_blocks=8, block_size=4, budget=100)
    sched.add(seq(0, 4))
    sched.add(seq(1, 4))
    sched.add(seq(2, 4))
    batch = sched.schedule()
    assert [e.seq.seq_id for e in batch.entries] == [0, 1]
    assert [s.seq_id for s in sched.waiting] == [2]

    sched = make(num_blocks=4, block_size=4, budget=100)
    sched.add(seq(0, 8))
    sched.add(seq(1, 12))  # needs 3 blocks, only 2 left: waits
    sched.add(seq(2, 2))  # would fit, but must not overtake seq 1
    batch = sched.schedule()
    assert [e.seq.seq_id for e in batch.entries] == [0]


def test_preemption_frees_the_newest_and_requeues_it_first():
    sched = make(num_blocks=4, block_size=4, budget=100)
    a, b = seq(0, 8), seq(1, 8)
    sched.add(a)
    sched.add(b)
    run_step(sched)  # both prefilled: 4 blocks used, each sequence holds 8 computed + 1 new
    assert sched.block_manager.num_free_blocks == 0
    batch = sched.schedule()  # a's decode at position 8 needs a third block: b gives way
    assert batch.preempted == [b]
    assert [e.seq.seq_id for e in batch.decodes] == [0]
    assert b.status is SequenceStatus.WAITING and b.block_table == [] and b.state_slot is None
    assert b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert list(sched.waiting) == [b] and b.output_token_ids == [7]
    sched.complete(batch, [7])
    # b's recompute feeds prompt + output (9 tokens) once a finishes and frees its blocks.
    sched.finish(a, FinishReason.STOP)
    batch = sched.schedule()
    assert [(e.seq.seq_id, e.start, e.num_tokens, e.samples) for e in batch.prefills] == [
        (1, 0, 9, True)
    ]


def test_a_lone_sequence_preempts_itself_when_nothing_else_gives_way():
    sched = make(num_blocks=2, block_size=4, budget=100)
    a = seq(0, 8)
    sched.add(a)
    run_step(sched)
    batch = sched.schedule()
    assert batch.preempted == [a] and batch.is_empty
    assert a.status is SequenceStatus.WAITING


def test_abort_waiting_and_running():
    sched = make(max_num_seqs=1)
    a, b = seq(0, 4), seq(1, 4)
    sched.add(a)
    sched.add(b)
    run_step(sched)
    sched.finish(a, FinishReason.CANCELLED)
    sched.finish(b, FinishReason.CANCELLED)
    sched.finish(b, FinishReason.STOP)  # finishing twice is harmless
    assert a.finish_reason is FinishReason.CANCELLED and b.finish_reason is FinishReason.CANCELLED
    assert not sched.has_unfinished()
    assert sched.block_manager.num_free_blocks == 64 and sched.state_slots.num_free == 1


def test_page_ages_follow_the_steps():
    sched = make(block_size=4, budget=100)
    a = seq(0, 6)
    sched.add(a)
    run_step(sched)  # step 1 writes positions 0-5 (blocks 0, 1)
    run_step(sched)  # step 2 writes position 6 (block 1)
    run_step(sched)  # step 3 writes position 7 (block 1)
    assert sched.block_manager.page_ages(a, step=3) == [2, 0]


@settings(max_examples=60, deadline=None)
@given(
    prompts=st.lists(st.integers(1, 40), min_size=1, max_size=10),
    max_tokens=st.lists(st.integers(1, 12), min_size=10, max_size=10),
    num_blocks=st.integers(13, 40),
    budget=st.integers(1, 48),
    max_num_seqs=st.integers(1, 5),
    abort_at=st.lists(st.integers(0, 60), max_size=3),
)
def test_invariants_under_random_load(
    prompts, max_tokens, num_blocks, budget, max_num_seqs, abort_at
):
    block_size = 4  # 13 blocks hold one sequence of 52 tokens, the longest here
    sched = make(num_blocks, block_size, max_num_seqs, budget)
    seqs = [seq(i, p, max_tokens[i]) for i, p in enumerate(prompts)]
    for s in seqs:
        sched.add(s)
    for step in range(2000):
        if not sched.has_unfinished():
            break
        if step in abort_at and (sched.running or sched.waiting):
            victim = (sched.running or list(sched.waiting))[0]
            sched.finish(victim, FinishReason.CANCELLED)
        batch = run_step(sched)
        assert batch.num_tokens <= budget and len(batch.entries) <= max_num_seqs
        assert len(sched.running) <= max_num_seqs
        tables = [b for s in sched.running for b in s.block_table]
        assert len(tables) == len(set(tables))  # no block shared
        assert len(tables) + sched.block_manager.num_free_blocks == num_blocks  # none leaked
        slots = [s.state_slot for s in sched.running]
        assert None not in slots and len(set(slots)) == len(slots)
        assert all(not s.block_table and s.state_slot is None for s in sched.waiting)
        for s in sched.running:
            assert s.num_computed_tokens <= len(s.block_table) * block_size
            if s.num_output_tokens >= s.params.max_tokens:
                sched.finish(s, FinishReason.LENGTH)
    assert not sched.has_unfinished()
    assert all(s.is_finished for s in seqs)
    assert sched.block_manager.num_free_blocks == num_blocks
    assert sched.state_slots.num_free == max_num_seqs
