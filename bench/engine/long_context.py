"""Long context on the 27B shape (FP8 weights and KV, random weights): one prompt of 32K, 128K
and 262K tokens alone (TTFT, prefill tok/s, decode ms per token at that context), then 32
concurrent 32K-token sequences (output tok/s, TTFT, decode step at batch 32, preemptions).

The engine is sized as a worker is: the KV pool from `gpu_memory_fraction` of free memory, the
context limit from the model's config (262,144 for Qwen3.6). Each point checks the section's
time budget first (its estimate: the previous point's prefill rate, quadratic in the length)
and is skipped rather than started when it would not finish.

`long_prompts_by_cache` (the suite's long_prompt_caches section) serves single prompts of
`--long-prompt-lengths` through each cache of `CACHES` in turn, on one model: FP8 KV with its
pages widened inside the prefill kernel or into an fp16 scratch first, staged KV with each
prefill way.

    PYTHONPATH=. python3 -m bench.engine.suite --sections long_context --budget-s 540
    PYTHONPATH=. python3 -m bench.engine.suite --sections long_prompt_caches
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time
from typing import Any

import torch

from bench.common import median, percentile
from bench.engine.configs import build_model
from bench.engine.load_point import random_prompts, run_round, sync
from bench.engine.profiler import StepLog
from worker.engine.engine import EngineConfig, LLMEngine
from worker.engine.sequence import SamplingParams

SINGLE_LENGTHS = (32_768, 131_072, 262_144)
CONCURRENT = (32, 32_768)  # sequences, tokens each
OUTPUT_TOKENS = 32


def one_prompt(engine: LLMEngine, length: int, vocab: int, rng: random.Random) -> dict[str, Any]:
    """One request of `length` tokens (prompt + OUTPUT_TOKENS) alone in the engine."""
    prompt = [rng.randrange(vocab) for _ in range(length - OUTPUT_TOKENS)]
    params = SamplingParams(temperature=0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    sync(engine)
    began = time.perf_counter()
    [out] = engine.generate([prompt], params)
    sync(engine)
    wall = time.perf_counter() - began
    ttft = out.metrics.ttft or wall
    return {
        "prompt_tokens": len(prompt),
        "ttft_s": ttft,
        "prefill_tok_s": len(prompt) / ttft,
        "decode_ms_per_token": (wall - ttft) / max(OUTPUT_TOKENS - 1, 1) * 1e3,
        "wall_s": wall,
        "preemptions": out.metrics.num_preemptions,
    }


def worker_sized_engine(
    model: Any, args: argparse.Namespace, kv_staging: str | None = None
) -> LLMEngine:
    """An engine sized as a worker is: the KV pool from free memory, the model's context limit."""
    return LLMEngine(
        model,
        None,
        EngineConfig(
            block_size=16,
            max_num_seqs=CONCURRENT[0],
            max_num_batched_tokens=args.long_batched_tokens,
            max_model_len=0,  # the model's own limit
            kv_dtype=torch.float8_e4m3fn,
            device=args.device,
            warm_up=False,
            kv_staging=kv_staging,
        ),
    )


def single_prompts(
    engine: LLMEngine, lengths: list[int], vocab: int, rng: random.Random, deadline: float
) -> list[dict[str, Any]]:
    """`one_prompt` at each length (the model's limit at most), after a 4K prompt that compiles
    the prefill and decode paths; a length whose estimate (the previous point's prefill rate,
    quadratic in the length) would pass `deadline` is skipped."""
    one_prompt(engine, 4096, vocab, rng)
    points: list[dict[str, Any]] = []
    rate: float | None = None
    last_len = 0
    for length in lengths:
        length = min(length, engine.config.max_model_len)
        if length == last_len:  # a model with a shorter context: each length once
            continue
        left = deadline - time.perf_counter()
        estimate = 0.0 if rate is None else length / rate * (length / last_len) + 10
        if estimate > left:
            points.append({"length": length, "skipped": f"budget ({estimate:.0f} s)"})
            continue
        point = one_prompt(engine, length, vocab, rng)
        point["length"] = length
        points.append(point)
        rate, last_len = point["prefill_tok_s"], length
        print(
            f"  {length} tokens: TTFT {point['ttft_s']:.2f} s, "
            f"{point['prefill_tok_s']:.0f} prefill tok/s, "
            f"decode {point['decode_ms_per_token']:.2f} ms/token",
            file=sys.stderr,
        )
    return points


# name -> (kv_staging, staged prefill way, FP8 pages widened from this many tokens) of
# `long_prompts_by_cache` (FP8 KV's prefill widens its pages into an fp16 scratch from
# paged_attention.FP8_SCRATCH_FROM_TOKENS of context; 0: never, 1: always)
CACHES: dict[str, tuple[str | None, str | None, int | None]] = {
    "fp8_kv": (None, None, 0),
    "fp8_kv_widened": (None, None, 1),
    "staged": ("k4v3", "scratch", None),
    "staged_direct": ("k4v3", "direct", None),
}


def long_prompts_by_cache(args: argparse.Namespace, config: Any, budget: float) -> dict[str, Any]:
    """Single long prompts (`--long-prompt-lengths`) through each cache of
    `--long-prompt-caches` (`CACHES`): FP8 KV with its pages read as they are or widened to
    fp16 first, staged KV (K4/V3) with each prefill way ("scratch" decodes every page a chunk's
    tables name into a 16-bit scratch, "direct" decodes each key tile in the prefill kernel).
    One model; one worker-sized engine at a time, each an equal share of the time left."""
    from worker.kernels.triton import paged_attention, turboquant

    began = time.perf_counter()
    _, _, model = build_model(args, config, "fp8")
    lengths = [int(n) for n in str(args.long_prompt_lengths).split(",") if n]
    names = [n for n in str(args.long_prompt_caches).split(",") if n]
    if unknown := set(names) - set(CACHES):
        raise ValueError(f"unknown caches {sorted(unknown)}; known: {', '.join(CACHES)}")
    result: dict[str, Any] = {"lengths": lengths, "build_s": time.perf_counter() - began}
    rng = random.Random(args.seed)
    for i, name in enumerate(names):
        staging, way, widen = CACHES[name]
        share = (budget - (time.perf_counter() - began)) / (len(names) - i)
        print(f"  {name}", file=sys.stderr)
        kept = turboquant._PREFILL, paged_attention.FP8_SCRATCH_FROM_TOKENS
        turboquant._PREFILL = way or kept[0]
        paged_attention.FP8_SCRATCH_FROM_TOKENS = kept[1] if widen is None else widen
        try:
            engine = worker_sized_engine(model, args, staging)
            result[name] = {
                "kv_blocks": engine.block_manager.num_blocks,
                "compressed_blocks": engine.block_manager.num_compressed_blocks,
                "single": single_prompts(
                    engine, lengths, config.vocab_size, rng, time.perf_counter() + share
                ),
            }
            del engine
        finally:
            turboquant._PREFILL, paged_attention.FP8_SCRATCH_FROM_TOKENS = kept
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    result["section_s"] = time.perf_counter() - began
    return result


def long_context(args: argparse.Namespace, config: Any, budget: float) -> dict[str, Any]:
    began = time.perf_counter()
    _, _, model = build_model(args, config, "fp8")
    engine = worker_sized_engine(model, args)
    result: dict[str, Any] = {
        "build_s": time.perf_counter() - began,
        "max_model_len": engine.config.max_model_len,
        "kv_blocks": engine.block_manager.num_blocks,
        "kv_tokens": engine.block_manager.num_blocks * 16,
        "max_num_batched_tokens": args.long_batched_tokens,
    }
    rng = random.Random(args.seed)
    result["single"] = single_prompts(
        engine, list(SINGLE_LENGTHS), config.vocab_size, rng, began + budget
    )
    done = [p for p in result["single"] if "prefill_tok_s" in p]
    rate = done[-1]["prefill_tok_s"] if done else None
    n, length = CONCURRENT[0], min(CONCURRENT[1], engine.config.max_model_len)
    left = budget - (time.perf_counter() - began)
    estimate = 0.0 if rate is None else n * length / rate + 20
    if estimate > left:
        result["concurrent"] = {"skipped": f"budget ({estimate:.0f} s)"}
        return result
    steps = StepLog(engine.runner)
    prompts = random_prompts(n, length - OUTPUT_TOKENS * 2, config.vocab_size, rng)
    params = SamplingParams(temperature=0, max_tokens=OUTPUT_TOKENS * 2, ignore_eos=True)
    r = run_round(engine, prompts, n, params)
    full = [s for kind, k, s in steps.steps if kind in ("decode", "overlapped") and k == n]
    result["concurrent"] = {
        "sequences": n,
        "tokens_each": length,
        "output_tok_s": r.output_tok_s,
        "ttft_p50_s": percentile(r.ttft_s, 50),
        "ttft_p95_s": percentile(r.ttft_s, 95),
        "decode_step_ms_p50": median(full, 1e3),
        "preemptions": r.preemptions,
        "wall_s": r.wall_s,
    }
    print(
        f"  {n} x {length}: {r.output_tok_s:.1f} tok/s, {r.preemptions} preemptions, "
        f"decode step {result['concurrent']['decode_step_ms_p50']} ms",
        file=sys.stderr,
    )
    return result
