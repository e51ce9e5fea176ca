"""AsyncLLMEngine: concurrent streams, cancel by leaving the stream, bad requests."""

from __future__ import annotations

import asyncio

import pytest

from tests.worker.engine_fakes import FakeCausalLM, greedy_reference
from worker.engine.async_engine import AsyncLLMEngine
from worker.engine.engine import EngineConfig, LLMEngine
from worker.engine.sequence import FinishReason, SamplingParams


@pytest.fixture
async def engine():
    config = EngineConfig(block_size=4, max_num_seqs=3, max_num_batched_tokens=16, max_model_len=64)
    wrapper = AsyncLLMEngine(LLMEngine(FakeCausalLM(), None, config))
    yield wrapper
    await wrapper.close()


async def collect(engine: AsyncLLMEngine, prompt: list[int], max_tokens: int, rid: str):
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    outs = [o async for o in engine.generate(prompt, params, rid)]
    return outs


async def test_concurrent_streams_get_their_own_tokens(engine):
    prompts = [[i, i + 1, i + 2] for i in range(6)]
    results = await asyncio.gather(
        *(collect(engine, p, 5 + i, f"r{i}") for i, p in enumerate(prompts))
    )
    for i, (prompt, outs) in enumerate(zip(prompts, results, strict=True)):
        assert [t for o in outs for t in o.new_token_ids] == greedy_reference(prompt, 5 + i)
        assert outs[-1].finished and outs[-1].finish_reason is FinishReason.LENGTH
        assert not any(o.finished for o in outs[:-1])


async def test_leaving_the_stream_aborts_the_request(engine):
    params = SamplingParams(temperature=0, max_tokens=50)
    stream = engine.generate([1, 2, 3], params, "long")
    first = await anext(stream)
    assert first.new_token_ids == greedy_reference([1, 2, 3], 1)
    await stream.aclose()
    for _ in range(100):  # the abort lands between steps in the engine thread
        if not engine.engine.has_unfinished_requests():
            break
        await asyncio.sleep(0.01)
    assert not engine.engine.has_unfinished_requests()
    bm = engine.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    # the engine keeps serving
    outs = await collect(engine, [4, 5], 3, "after")
    assert [t for o in outs for t in o.new_token_ids] == greedy_reference([4, 5], 3)


async def test_a_bad_request_fails_only_its_caller(engine):
    with pytest.raises(ValueError, match="at most 64"):
        await collect(engine, list(range(64)), 3, "too-long")
    outs = await collect(engine, [7], 2, "fine")
    assert outs[-1].finished


async def test_close_fails_streams_still_open(engine):
    engine.engine.model.step_delay = 0.05  # 63 tokens take seconds: close comes first
    stream = engine.generate([1], SamplingParams(temperature=0, max_tokens=10_000), "endless")
    await anext(stream)
    await engine.close()
    with pytest.raises(RuntimeError, match="shut down"):
        while True:
            await anext(stream)


async def test_a_step_wakes_the_event_loop_once_for_all_its_streams(engine):
    """Every output of a step reaches its stream through one call into the loop: wake-ups
    grow with steps, not with steps x streams."""
    loop = asyncio.get_running_loop()
    calls: list[int] = []
    inner = loop.call_soon_threadsafe

    def counted(callback, *args):  # type: ignore[no-untyped-def]
        calls.append(len(args[0]) if args and isinstance(args[0], list) else 0)
        return inner(callback, *args)

    loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
    try:
        results = await asyncio.gather(*(collect(engine, [i, i + 1], 8, f"w{i}") for i in range(3)))
    finally:
        del loop.call_soon_threadsafe
    for i, outs in enumerate(results):
        assert [t for o in outs for t in o.new_token_ids] == greedy_reference([i, i + 1], 8)
    deliveries = [n for n in calls if n]
    assert sum(deliveries) == sum(len(outs) for outs in results)
    assert max(deliveries) == 3  # the three streams' tokens of a step in one call
    assert len(deliveries) < sum(len(outs) for outs in results)
