"""Prefill gathering: an idle engine holds arrivals a few milliseconds so that requests spread
by HTTP are prefilled in one step; running sequences are never held."""

from __future__ import annotations

import asyncio
import time

from tests.worker.engine_fakes import FakeCausalLM
from tests.worker.helpers import small_engine
from worker.engine.async_engine import AsyncLLMEngine
from worker.engine.block_manager import BlockManager
from worker.engine.engine import EngineConfig
from worker.engine.scheduler import Scheduler
from worker.engine.sequence import SamplingParams, Sequence
from worker.engine.state_slots import StateSlotPool


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make(clock: Clock, gather_s: float = 0.003, max_num_seqs: int = 4, budget: int = 64):
    return Scheduler(
        BlockManager(64, 4), StateSlotPool(max_num_seqs), max_num_seqs, budget, gather_s, clock
    )


def seq(i: int, prompt_len: int, arrival: float, max_tokens: int = 8) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens)
    return Sequence(i, f"r{i}", [1] * prompt_len, params, arrival_time=arrival)


def test_an_idle_engine_holds_the_first_arrival_up_to_the_bound():
    clock = Clock()
    sched = make(clock)
    sched.add(seq(0, 10, arrival=clock.now))
    clock.now += 0.001
    batch = sched.schedule()
    assert batch.is_empty and abs(sched.admission_hold_s - 0.002) < 1e-9
    sched.add(seq(1, 10, arrival=clock.now))
    clock.now += 0.0021  # the oldest has waited its 3 ms
    batch = sched.schedule()
    assert [e.seq.seq_id for e in batch.prefills] == [0, 1] and sched.admission_hold_s == 0


def test_a_full_budget_or_full_room_is_admitted_at_once():
    clock = Clock()
    sched = make(clock, budget=16)
    sched.add(seq(0, 10, clock.now))
    sched.add(seq(1, 10, clock.now))  # 20 tokens waiting >= the 16-token budget
    assert [e.num_tokens for e in sched.schedule().prefills] == [10, 6]
    clock2 = Clock()
    sched2 = make(clock2, max_num_seqs=2)
    sched2.add(seq(0, 3, clock2.now))
    sched2.add(seq(1, 3, clock2.now))  # as many as can run
    assert len(sched2.schedule().prefills) == 2


def test_running_sequences_are_never_held_and_arrivals_join_them():
    clock = Clock()
    sched = make(clock)
    sched.add(seq(0, 4, clock.now))
    clock.now += 0.01
    first = sched.schedule()
    sched.complete(first, [7])
    sched.add(seq(1, 4, clock.now))  # arrives while seq 0 decodes
    batch = sched.schedule()
    assert [e.seq.seq_id for e in batch.decodes] == [0]
    assert [e.seq.seq_id for e in batch.prefills] == [1]  # admitted beside the decode
    assert sched.admission_hold_s == 0


def test_gathering_off_admits_at_once():
    clock = Clock()
    sched = make(clock, gather_s=0.0)
    sched.add(seq(0, 10, clock.now))
    assert len(sched.schedule().prefills) == 1


def test_the_async_engine_prefills_spread_arrivals_together():
    """Four requests 20 ms apart: with a 500 ms gathering bound one prefill step takes all four;
    without it the first is prefilled alone."""

    async def first_prefill(gather_s: float) -> int:
        model = FakeCausalLM()
        config = dict(max_num_seqs=8, max_num_batched_tokens=256, prefill_gather_s=gather_s)
        engine = AsyncLLMEngine(small_engine(model, **config))
        params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)

        async def one(i: int) -> None:
            await asyncio.sleep(0.02 * i)
            async for _ in engine.generate([1 + i, 2, 3], params, f"r{i}"):
                pass

        began = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(4)))
        assert time.perf_counter() - began < 5
        await engine.close()
        return next(m.num_prefills for m in model.batches if m.num_prefills)

    assert asyncio.run(first_prefill(0.5)) == 4
    assert asyncio.run(first_prefill(0.0)) == 1


def test_a_gap_with_no_arrival_ends_the_hold():
    clock = Clock()
    sched = Scheduler(BlockManager(64, 4), StateSlotPool(8), 8, 256, 0.025, clock, 0.003)
    sched.add(seq(0, 10, clock.now))
    for i in range(1, 4):  # arrivals every 2 ms keep the hold going
        clock.now += 0.002
        assert sched.schedule().is_empty
        sched.add(seq(i, 10, clock.now))
    clock.now += 0.002
    assert sched.schedule().is_empty and abs(sched.admission_hold_s - 0.001) < 1e-9
    clock.now += 0.0011  # 3 ms since the last arrival: the four go together
    assert [e.seq.seq_id for e in sched.schedule().prefills] == [0, 1, 2, 3]
    sched2 = Scheduler(BlockManager(64, 4), StateSlotPool(8), 8, 256, 0.005, clock, 0.003)
    sched2.add(seq(9, 10, clock.now))
    for _ in range(3):  # steady arrivals cannot hold the first past the bound
        clock.now += 0.002
        sched2.add(seq(10 + _, 2, clock.now))
        batch = sched2.schedule()
    assert len(batch.prefills) == 4


def test_the_worker_default_gathers_within_25_ms_with_3_ms_gaps(monkeypatch):
    assert EngineConfig().prefill_gather_s == 0.0
    assert EngineConfig.from_env().prefill_gather_s == 0.025
    assert EngineConfig.from_env().prefill_gather_gap_s == 0.003
    monkeypatch.setenv("TOKENMILL_ENGINE_PREFILL_GATHER_MS", "0")
    assert EngineConfig.from_env().prefill_gather_s == 0.0
