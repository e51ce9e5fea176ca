"""The long-prompt bench serves the same prompt lengths through FP8 KV (pages read as they are,
or widened first) and staged KV (both prefill ways) on one model, each engine sized as a worker is; on CPU with the tiny config."""

from __future__ import annotations

import argparse

import pytest

from bench.engine.long_context import CACHES, long_prompts_by_cache
from worker.models import presets

pytest.importorskip("triton")


def test_every_cache_serves_every_length_and_the_prefill_way_is_restored(one_thread) -> None:
    from worker.kernels.triton import paged_attention, turboquant

    before = turboquant._PREFILL, paged_attention.FP8_SCRATCH_FROM_TOKENS
    args = argparse.Namespace(
        device="cpu",
        seed=0,
        preset="tiny-qwen3_5",
        long_prompt_lengths="512,1024",
        long_prompt_caches=",".join(CACHES),
        long_batched_tokens=256,  # chunks, so pages age out while the prompt prefills
    )
    result = long_prompts_by_cache(args, presets.PRESETS["tiny-qwen3.5"], 300.0)
    assert (turboquant._PREFILL, paged_attention.FP8_SCRATCH_FROM_TOKENS) == before
    for name, (staging, _, _) in CACHES.items():
        points = result[name]["single"]
        assert [p["length"] for p in points] == [512, 1024]
        assert all(p["prefill_tok_s"] > 0 and p["preemptions"] == 0 for p in points)
        assert (result[name]["compressed_blocks"] > 0) == (staging is not None)
