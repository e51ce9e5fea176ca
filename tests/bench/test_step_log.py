"""The engine bench's step log on CPU: every step logged once with the pages restaged before
it, and those pages add up to what the runner restaged."""

from __future__ import annotations

import random

import torch

from bench.engine.profiler import StepLog
from worker.engine.engine import EngineConfig, LLMEngine
from worker.engine.sequence import SamplingParams
from worker.models import build_random, presets


def test_the_step_log_counts_every_restaged_page_once() -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        config = presets.PRESETS["tiny-qwen3.5"]
        model = build_random(config, "cpu", torch.float32, seed=1)
        engine = LLMEngine(
            model,
            None,
            EngineConfig(
                block_size=16,
                max_num_seqs=2,
                max_model_len=320,
                kv_staging="k4v3",
                device="cpu",
                pad_decode=True,
                warm_up=False,
            ),
        )
        log = StepLog(engine.runner)
        rng = random.Random(0)
        prompts = [[rng.randrange(config.vocab_size) for _ in range(200)] for _ in range(2)]
        engine.generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    finally:
        torch.set_num_threads(threads)
    summary = log.summary()
    assert engine.runner.restaged_pages > 0
    # the last launch's step is never closed by a next launch: its pages may be pending
    assert sum(log.restaged) + log._restaged_since == engine.runner.restaged_pages
    assert len(log.restaged) == len(log.steps)
    assert summary["overlapped_decode_steps_after_restage"] > 0
    assert summary["steps_wall_s_sum"] >= sum(s for _, _, s in log.steps) - 1e-9
    assert summary["restage_host_s_sum"] > 0
