"""The decode step at long context, FP8 KV against staged KV in one run: `--concurrency` rows
(8), each with each of `--long-decode-contexts` tokens (768, the load point's longest, and
32,768) in its cache, FP8 weights. The staged KV target says: staged step <= FP8 KV's + 10% at
8 x 32K.

No prefill: the rows' pages are laid out directly in the padded decode inputs, as a block
manager would have them after that many steps (staged: the anchor and window pages recent,
the rest compressed). A step's time does not depend on what the pages hold, so each point
takes seconds, not the minutes that prefilling 262K tokens twice would. Each engine is sized
for exactly these rows (`num_kv_blocks`), so both fit beside the weights on one H200.

    PYTHONPATH=. python3 -m bench.engine.suite --sections long_decode --budget-s 200
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from typing import Any

import torch

from bench.common import cuda_time
from bench.engine.configs import FP8_E4M3, build_model
from bench.engine.profiler import profile_step
from worker.engine.block_manager import staged_recent_blocks
from worker.engine.config import DEFAULT_STEP_TOKENS
from worker.engine.engine import EngineConfig, LLMEngine
from worker.kernels import ops
from worker.kernels.cuda import staged_decode

BLOCK_SIZE = 16


def page_tables(
    rows: int,
    pages: int,
    first_compressed: int,
    anchor_pages: int | None = None,
    window_pages: int | None = None,
) -> list[list[int]]:
    """Each row's block table: `pages` distinct recent blocks (ids from 0); with staging
    (`anchor_pages` and `window_pages` given) only the first `anchor_pages` and the last
    `window_pages` are recent, the pages between them compressed (ids from
    `first_compressed`)."""
    tables: list[list[int]] = []
    recent, compressed = 0, first_compressed
    for _ in range(rows):
        table = []
        for i in range(pages):
            if anchor_pages is not None and window_pages is not None:
                stale = anchor_pages <= i < pages - window_pages
            else:
                stale = False
            if stale:
                table.append(compressed)
                compressed += 1
            else:
                table.append(recent)
                recent += 1
        tables.append(table)
    return tables


def long_decode_engine(
    model: Any, args: argparse.Namespace, rows: int, context: int, staging: str | None
) -> LLMEngine:
    pages = -(-context // BLOCK_SIZE)
    blocks = rows * pages
    if staging is not None:  # the recent pages the engine keeps on top (anchors, windows, ...)
        blocks += staged_recent_blocks(
            rows,
            BLOCK_SIZE,
            DEFAULT_STEP_TOKENS,
            EngineConfig.kv_staging_window_pages,
            EngineConfig.kv_staging_anchor_pages,
        )
    return LLMEngine(
        model,
        None,
        EngineConfig(
            block_size=BLOCK_SIZE,
            num_kv_blocks=blocks,
            max_num_seqs=rows,
            max_model_len=context,
            kv_dtype=FP8_E4M3,
            device=args.device,
            pad_decode=True,
            kv_staging=staging,
            warm_up=False,
        ),
    )


def stage_long_rows(engine: LLMEngine, rows: int, context: int) -> list[list[int]]:
    """Rows [0, rows) of the padded decode inputs as sequences of `context` tokens, each on
    its own state slot, laid out by `page_tables` (staged when the engine stages); uploaded.
    Returns the tables."""
    runner = engine.runner
    inputs: Any = runner.decode_inputs
    cfg = engine.config
    staged = bool(runner.staged_caches)
    pages = -(-context // cfg.block_size)
    tables = page_tables(
        rows,
        pages,
        runner.first_compressed_block,
        cfg.kv_staging_anchor_pages if staged else None,
        cfg.kv_staging_window_pages if staged else None,
    )
    inputs.fill_padding(0, inputs.max_rows)
    h = inputs.host
    last = context - 1
    for r, table in enumerate(tables):
        h["block_tables"][r, :pages] = torch.tensor(table, dtype=torch.int32)
        h["context_lens"][r] = context
        h["positions"][r] = last
        h["slot_mapping"][r] = (
            table[last // cfg.block_size] * cfg.block_size + last % cfg.block_size
        )
        h["state_slots"][r] = r
    inputs.upload()
    return tables


def decode_step_at(engine: LLMEngine, rows: int, context: int) -> dict[str, Any]:
    """The decode step of `rows` rows at `context` tokens each: as a graph replay (where one was
    captured for that batch) and eager, with the eager step's kernel profile on a GPU."""
    runner = engine.runner
    tables = stage_long_rows(engine, rows, context)
    first = runner.first_compressed_block
    point: dict[str, Any] = {
        "compressed_pages_per_row": sum(b >= first for b in tables[0]),
        "recent_pages_per_row": sum(b < first for b in tables[0]),
    }
    inputs: Any = runner.decode_inputs
    ids, meta = inputs.input_ids(rows), inputs.meta(rows)
    with torch.inference_mode():
        if rows in runner.graphs:
            graph = runner.graphs[rows][0]
            point["decode_step_graph_ms"] = 1e3 * cuda_time(graph.replay, iters=20, warmup=3)
        eager = lambda: runner._logits(ids, meta)  # noqa: E731
        point["decode_step_eager_ms"] = 1e3 * cuda_time(eager, iters=3, warmup=1)
        if torch.cuda.is_available():
            point["decode_step_eager_profile"] = profile_step(eager, steps=2)
    return point


def long_decode(args: argparse.Namespace, config: Any, budget: float) -> dict[str, Any]:
    """Each cache's engine sized for the longest context, then its step at every context of
    `--long-decode-contexts` (the load point's ~768 first: what its graph replays of one-token
    rows do not show)."""
    began = time.perf_counter()
    rows = args.concurrency
    contexts = [int(c) for c in str(args.long_decode_contexts).split(",") if c]
    _, _, model = build_model(args, config, "fp8")
    result: dict[str, Any] = {"rows": rows, "contexts": contexts, "points": {}}
    # staged twice: with the default decode kernel (CUDA where it runs) and with the Triton one
    engines = (
        ("fp8_kv", None, None),
        ("staged", "k4v3", None),
        ("staged_triton", "k4v3", "triton"),
    )
    for name, staging, kernel in engines:
        if kernel and not torch.cuda.is_available():
            continue  # on a CPU both are the reference
        switch = os.environ.get(staged_decode.SWITCH)
        if kernel:
            os.environ[staged_decode.SWITCH] = kernel
            ops.reset_choices()
        engine = long_decode_engine(model, args, rows, max(contexts), staging)
        for context in contexts:
            point = decode_step_at(engine, rows, context)
            point["num_compressed_blocks"] = engine.block_manager.num_compressed_blocks
            result["points"].setdefault(str(context), {})[name] = point
            step = point.get("decode_step_graph_ms", point["decode_step_eager_ms"])
            print(f"  {name}: {rows} x {context} decode step {step:.2f} ms", file=sys.stderr)
        del engine
        if kernel:
            os.environ.pop(staged_decode.SWITCH)
            if switch is not None:
                os.environ[staged_decode.SWITCH] = switch
            ops.reset_choices()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    key = "decode_step_graph_ms" if args.device == "cuda" else "decode_step_eager_ms"
    result["staged_over_fp8_kv"] = {}
    result["staged_triton_over_fp8_kv"] = {}
    for context, points in result["points"].items():
        fp8_kv = points["fp8_kv"].get(key)
        for name in ("staged", "staged_triton"):
            step = points.get(name, {}).get(key)
            if fp8_kv and step:
                result[f"{name}_over_fp8_kv"][context] = step / fp8_kv
    result["section_s"] = time.perf_counter() - began
    return result
