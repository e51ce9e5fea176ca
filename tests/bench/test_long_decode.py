"""The long-context decode bench lays its rows out as the staged engine itself would after
serving that many tokens (anchor and window pages recent, the rest compressed), and runs both
points on CPU with the tiny Qwen3.5 config."""

from __future__ import annotations

import argparse

import torch

from bench.engine.long_decode import decode_step_at, long_decode, long_decode_engine, page_tables
from worker.engine.sequence import SamplingParams
from worker.models import build_random, presets


def test_page_tables_keep_anchor_and_window_recent() -> None:
    plain = page_tables(2, 5, 100)
    assert plain == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    staged = page_tables(2, 5, 100, anchor_pages=1, window_pages=2)
    assert staged == [[0, 100, 101, 1, 2], [3, 102, 103, 4, 5]]


def args(*contexts: int) -> argparse.Namespace:
    return argparse.Namespace(
        device="cpu",
        concurrency=2,
        long_decode_contexts=",".join(map(str, contexts)),
        seed=0,
        preset="tiny-qwen3_5",
    )


def test_the_layout_matches_what_the_staged_engine_serves(one_thread) -> None:
    """A real sequence of `context` tokens in a staged engine: which of its pages are
    compressed is what `page_tables` lays out."""
    context = 16 * 20
    model = build_random(presets.PRESETS["tiny-qwen3.5"], "cpu", torch.float32, seed=1)
    engine = long_decode_engine(model, args(context), 2, context, "k4v3")
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    engine.add_request(list(range(1, context - 40)), params)
    seen = []
    while engine.has_unfinished_requests():
        engine.step()
        for seq in engine.scheduler.running:
            seen.append((seq.num_tokens, list(seq.block_table)))
    first = engine.runner.first_compressed_block
    # the last step that ran with every page full, but for the one it writes
    tokens, table = max((n, t) for n, t in seen if n == context - 1)
    cfg = engine.config
    [want] = page_tables(1, len(table), first, cfg.kv_staging_anchor_pages, cfg.kv_staging_window_pages)  # fmt: skip
    assert [b >= first for b in table] == [b >= first for b in want]
    assert tokens == context - 1 and len(table) == context // 16
    assert sum(b >= first for b in table) == len(table) - 9  # 1 anchor, 8 window pages


def test_both_caches_run_at_every_context(one_thread) -> None:
    config = presets.PRESETS["tiny-qwen3.5"]
    result = long_decode(args(16 * 12, 16 * 24), config, 60.0)
    assert set(result["points"]) == set(result["staged_over_fp8_kv"]) == {"192", "384"}
    for context, pages in (("192", 12), ("384", 24)):
        fp8_kv, staged = result["points"][context]["fp8_kv"], result["points"][context]["staged"]
        assert fp8_kv["compressed_pages_per_row"] == 0 and fp8_kv["recent_pages_per_row"] == pages
        # one anchor and 8 window pages recent
        assert staged["compressed_pages_per_row"] == pages - 9
        assert fp8_kv["decode_step_eager_ms"] > 0 and result["staged_over_fp8_kv"][context] > 0


def test_a_staged_step_reads_the_codes_it_is_given(one_thread) -> None:
    """The staged rows' logits change when the compressed pages' codes do: the step attends
    over them (not over the recent pool alone)."""
    model = build_random(presets.PRESETS["tiny-qwen3.5"], "cpu", torch.float32, seed=1)
    context = 16 * 24
    engine = long_decode_engine(model, args(context), 2, context, "k4v3")
    decode_step_at(engine, 2, context)
    runner = engine.runner
    inputs = runner.decode_inputs
    with torch.inference_mode():
        before = runner._logits(inputs.input_ids(2), inputs.meta(2)).clone()
        for cache in runner.staged_caches:
            cache.k_norms.fill_(1.0)
            cache.k_codes.random_(0, 256, generator=torch.Generator().manual_seed(0))
        after = runner._logits(inputs.input_ids(2), inputs.meta(2))
    assert not torch.allclose(before, after)
