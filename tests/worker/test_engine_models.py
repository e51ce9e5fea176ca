"""Real tiny models (random weights) through the engine: batching, chunked prefill, preemption
and join/leave must not change greedy outputs compared to serving one sequence at a time."""

from __future__ import annotations

import random

import pytest
import torch

from worker.engine.engine import EngineConfig, LLMEngine
from worker.engine.sequence import SamplingParams

presets = pytest.importorskip("worker.models.presets")
from worker.models import build_random  # noqa: E402

MAX_TOKENS = 10


pytestmark = pytest.mark.usefixtures("one_thread")


def prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(vocab) for _ in range(rng.randint(3, 40))] for _ in range(6)]


def serve(model, config: EngineConfig, batch: list[list[int]]) -> tuple[list[list[int]], int]:
    engine = LLMEngine(model, None, config)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    # Join mid-way: half the requests arrive after the first steps ran.
    ids = [engine.add_request(p, params) for p in batch[: len(batch) // 2]]
    tokens: dict[str, list[int]] = {}
    preemptions, steps = 0, 0
    while engine.has_unfinished_requests() or len(ids) < len(batch):
        steps += 1
        if steps == 3:
            ids += [engine.add_request(p, params) for p in batch[len(ids) :]]
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                preemptions += out.metrics.num_preemptions
    return [tokens[i] for i in ids], preemptions


@pytest.mark.parametrize("preset", ["tiny-qwen3.5", "tiny-llama"])
def test_batched_chunked_preempted_equals_one_at_a_time(preset):
    config = presets.PRESETS[preset]
    # float64: batching and chunking reorder sums; no near-tie between logits may flip a token.
    model = build_random(config, "cpu", torch.float64, seed=1)
    batch = prompts(config.vocab_size)

    alone = EngineConfig(block_size=4, max_num_seqs=1, max_num_batched_tokens=256, max_model_len=64)
    expected = [serve(model, alone, [p])[0][0] for p in batch]

    # 4 sequences, 7-token steps, 20 blocks of 4 (one 64-token sequence needs 16): chunks,
    # mixed steps and preemption all happen.
    busy = EngineConfig(
        block_size=4, max_num_seqs=4, max_num_batched_tokens=7, max_model_len=64, num_kv_blocks=20
    )
    got, preemptions = serve(model, busy, batch)
    assert preemptions > 0
    assert got == expected
    assert all(len(t) == MAX_TOKENS for t in got)
