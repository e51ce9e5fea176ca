"""Long context on the 27B shape (FP8 weights and KV, random weights): one prompt of 32K, 128K
and 262K tokens alone (TTFT, prefill tok/s, decode ms per token at that context), then 32
concurrent 32K-token sequences (output tok/s, TTFT, decode step at batch 32, preemptions).

The engine is sized as a worker is: the KV pool from `gpu_memory_fraction` of free memory, the
context limit from the model's config (262,144 for Qwen3.6). Each point checks the section's
time budget first (its estimate: the previous point's prefill rate, quadratic in the length)
and is skipped rather than started when it would not finish.

    PYTHONPATH=. python3 -m bench.engine.suite --sections long_context --budget-s 540
"""

from __future__ import annotations

import argparse
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


def long_context(args: argparse.Namespace, config: Any, budget: float) -> dict[str, Any]:
    began = time.perf_counter()
    _, _, model = build_model(args, config, "fp8")
    engine = LLMEngine(
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
        ),
    )
    result: dict[str, Any] = {
        "build_s": time.perf_counter() - began,
        "max_model_len": engine.config.max_model_len,
        "kv_blocks": engine.block_manager.num_blocks,
        "kv_tokens": engine.block_manager.num_blocks * 16,
        "max_num_batched_tokens": args.long_batched_tokens,
        "single": [],
    }
    rng = random.Random(args.seed)
    one_prompt(engine, 4096, config.vocab_size, rng)  # compiles the prefill and decode paths
    rate: float | None = None
    last_len = 0
    for length in SINGLE_LENGTHS:
        length = min(length, engine.config.max_model_len)
        if length == last_len:  # a model with a shorter context: each length once
            continue
        left = budget - (time.perf_counter() - began)
        estimate = 0.0 if rate is None else length / rate * (length / last_len) + 10
        if estimate > left:
            result["single"].append({"length": length, "skipped": f"budget ({estimate:.0f} s)"})
            continue
        point = one_prompt(engine, length, config.vocab_size, rng)
        point["length"] = length
        result["single"].append(point)
        rate, last_len = point["prefill_tok_s"], length
        print(
            f"  {length} tokens: TTFT {point['ttft_s']:.2f} s, "
            f"{point['prefill_tok_s']:.0f} prefill tok/s, "
            f"decode {point['decode_ms_per_token']:.2f} ms/token",
            file=sys.stderr,
        )
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
