"""The bf16, fp8 and w4 sections: the engine at the load point (one warm-up round, then repeats
while the section's budget lasts), with CUDA-graph decode whose setup (GEMV tilings, PDL on/off)
is chosen by timing the captured step itself."""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from typing import Any

import torch

from bench.common import GIB, cuda_time, free_gpu, percentile
from bench.engine.gemv import (
    TOP_TILINGS,
)
from bench.engine.load_point import random_prompts, run_round
from bench.engine.profiler import (
    SlowSteps,
    StepLog,
    engine_phases,
    overlap_check,
)
from worker.engine.block_manager import staged_recent_blocks
from worker.engine.config import DEFAULT_STEP_TOKENS
from worker.engine.engine import EngineConfig, LLMEngine
from worker.engine.sequence import SamplingParams

FP8_E4M3 = torch.float8_e4m3fn


def build_model(
    args: argparse.Namespace, config: Any, precision: str, embeddings: str = "auto"
) -> tuple[str, Any, Any]:
    """(device, dtype, model): random weights at `config`'s shape, in `precision` ("bf16",
    "fp8" or "w4"), built on the device; the embedding table then placed as the worker places
    it (`place_embeddings`: "auto" puts W4's in pinned host memory on a GPU)."""
    from worker.models import build_random
    from worker.models.causal_lm import place_embeddings
    from worker.models.fp8 import quantize_fp8

    device, dtype = args.device, torch.bfloat16 if args.device == "cuda" else torch.float32
    model = build_random(config, device, dtype, seed=args.seed)
    if precision == "fp8":
        quantize_fp8(model)
    elif precision == "w4":
        from worker.models.int4 import quantize_int4

        quantize_int4(model)
    place_embeddings(model, embeddings, precision)
    free_gpu()
    return device, dtype, model


def resident_bytes(model: Any, on_gpu: bool) -> int:
    """Parameter bytes on the GPU (`on_gpu`) or in host memory."""
    return sum(
        p.numel() * p.element_size()
        for p in model.parameters()
        if (p.device.type == "cuda") == on_gpu
    )


def load_point_engine(
    model: Any,
    args: argparse.Namespace,
    precision: str,
    max_num_seqs: int,
    batched_tokens: int,
    pad_decode: bool | None = None,
    tokenizer: Any = None,
    kv_staging: str | None = None,
) -> LLMEngine:
    """An engine for the load point's lengths: KV for `max_num_seqs` whole sequences (fp8
    unless bf16 weights), `batched_tokens` a step (0: the engine's default for the weights); a tokenizer only where the section needs
    text (grammars). With `kv_staging` ("k4v3") the pool is staged: the recent pages the
    sequences need on top of room for them all compressed, so no page stays FP8 for want of a
    compressed one."""
    max_model_len = args.prompt_len + args.max_tokens
    blocks = -(-max_model_len // 16) * max_num_seqs
    if kv_staging is not None:
        blocks += staged_recent_blocks(
            max_num_seqs,
            16,
            batched_tokens or DEFAULT_STEP_TOKENS,
            EngineConfig.kv_staging_window_pages,
            EngineConfig.kv_staging_anchor_pages,
        )
    return LLMEngine(
        model,
        tokenizer,
        EngineConfig(
            block_size=16,
            num_kv_blocks=blocks,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=batched_tokens,
            max_model_len=max_model_len,
            kv_dtype=FP8_E4M3 if precision != "bf16" else None,
            device=args.device,
            pad_decode=pad_decode,
            kv_staging=kv_staging,
        ),
    )


def engine_config(
    args: argparse.Namespace,
    config: Any,
    precision: str,
    budget: float,
    kv_staging: str | None = None,
    embeddings: str = "auto",
) -> dict[str, Any]:
    """The engine at the load point with `precision` weights: "bf16", "fp8" (e4m3 per channel)
    or "w4" (int4 group 128 with the FP8 LM head, `quantize_int4`'s default scheme); fp8 and w4
    run an fp8 KV cache, staged when `kv_staging` is set (the `staged` section: "k4v3"); the
    embedding table placed per `embeddings` (`place_embeddings`)."""
    began = time.perf_counter()
    device, dtype, model = build_model(args, config, precision, embeddings)
    fp8 = precision == "fp8"
    build_s = time.perf_counter() - began
    # pad_decode on CPU too, so the plumbing check covers the same path
    engine = load_point_engine(
        model,
        args,
        precision,
        args.concurrency,
        args.batched_tokens,
        True,
        kv_staging=kv_staging,
    )
    host_bytes = resident_bytes(model, on_gpu=False) if device == "cuda" else 0
    result: dict[str, Any] = {
        "max_num_batched_tokens": engine.config.max_num_batched_tokens,
        "kv_staging": kv_staging,
        "num_compressed_blocks": engine.block_manager.num_compressed_blocks,
        # resident on the GPU; a table in host memory counts apart
        "weights_gib": resident_bytes(model, on_gpu=device == "cuda") / GIB,
        "host_weights_gib": host_bytes / GIB,
        "embeddings": "host" if host_bytes else "device",
        "kv_dtype": str(engine.runner.kv_dtype),
        "state_dtype": str(engine.runner.state_dtype),
        "kv_bytes_per_token": engine.kv_bytes_per_token(),
        "attention_kv_gib_at_1m_tokens": engine.kv_bytes_per_token() * 1e6 / GIB,
        "deltanet_state_bytes_per_sequence": engine.state_bytes_per_sequence(),
        "deltanet_state_mib_per_sequence": engine.state_bytes_per_sequence() / 2**20,
        "build_s": build_s,
        "graph_capture_s": time.perf_counter() - began - build_s,
        "cuda_graph_sizes": sorted(engine.runner.graphs),
        "graph_error": engine.runner.graph_error,
        "fused_projections": engine.config.fuse_projections,
        "overlap_decode": engine.overlap_decode,
    }
    if device == "cuda":
        from worker.kernels.triton import fp8_gemm as fp8k

        table: dict[tuple[int, int], Any] = fp8k.DECODE_TILINGS if fp8 else fp8k.BF16_DECODE_TILINGS
        if precision == "w4":
            from worker.kernels.triton import int4_gemm

            table = int4_gemm.INT4_DECODE_TILINGS
        result["decode_tilings"] = {f"{n}x{k}": str(t) for (n, k), t in table.items()}
    if device == "cuda":
        from worker.kernels import ops

        result["kernels"] = ops.explain(device, dtype, engine.runner.kv_dtype)
        result["gpu_memory_gib"] = torch.cuda.memory_allocated() / GIB

    if device == "cuda":
        result["decode_setup"] = choose_decode_setup(engine.runner, args.concurrency, fp8)
    if engine.config.warm_up:  # as the worker does before it announces itself
        warming = time.perf_counter()
        result["warm_up_compositions"] = len(engine.warm_up())
        result["warm_up_s"] = time.perf_counter() - warming
    steps = StepLog(engine.runner)
    rng = random.Random(args.seed)
    vocab = config.vocab_size
    warm = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    run_round(engine, random_prompts(args.concurrency, args.prompt_len, vocab, rng), 8, warm)
    result["phases"] = engine_phases(engine)
    # a second warm round whose (warm, same-shape) prefill step is profiled kernel by kernel
    steps.profile_prefill = True
    run_round(engine, random_prompts(args.concurrency, args.prompt_len, vocab, rng), 8, warm)
    result["phases"]["prefill_profile"] = steps.prefill_profile
    result["overlap_check"] = overlap_check(
        engine, random_prompts(args.concurrency, args.prompt_len, vocab, rng)
    )
    steps.clear()

    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    repeats: list[Any] = []
    kinds_before = dict(engine.step_kinds)
    restaged_before = engine.runner.restaged_pages
    from worker.kernels.triton._launch import compiles

    compiles_before = compiles()
    slow = SlowSteps(engine)
    while len(repeats) < args.repeats:
        spent = time.perf_counter() - began
        longest = max((r.wall_s for r in repeats), default=0.0)
        if repeats and spent + 1.2 * longest > budget:
            break
        prompts = random_prompts(args.num_requests, args.prompt_len, vocab, rng)
        r = run_round(engine, prompts, args.concurrency, params)
        repeats.append(r)
        print(
            f"  repeat {len(repeats)}: {r.output_tok_s:.1f} tok/s, {r.wall_s:.1f} s",
            file=sys.stderr,
        )
    result["phases"].update(steps.summary())
    # how the timed rounds' steps ran (engine.step_kinds) and the pages they restaged
    result["step_kinds"] = {
        kind: n - kinds_before.get(kind, 0) for kind, n in engine.step_kinds.items()
    }
    result["restaged_pages"] = engine.runner.restaged_pages - restaged_before
    # after warm-up no step should wait on a compile or run past 250 ms (docs/performance.md)
    result["compiles_after_warm_up"] = compiles() - compiles_before
    result["steps_over_250ms"] = slow.close()
    ttft = [t for r in repeats for t in r.ttft_s]
    e2e = [t for r in repeats for t in r.e2e_s]
    tok_s = statistics.median(r.output_tok_s for r in repeats)
    result.update(
        {
            "repeats": len(repeats),
            "output_tok_s": tok_s,
            "output_tok_s_repeats": [r.output_tok_s for r in repeats],
            "completion_tokens": sum(r.completion_tokens for r in repeats),
            "preemptions": sum(r.preemptions for r in repeats),
            "ttft_p50_s": percentile(ttft, 50),
            "ttft_p95_s": percentile(ttft, 95),
            "e2e_p50_s": percentile(e2e, 50),
            "e2e_p95_s": percentile(e2e, 95),
            "gpu_hours_per_1m_output_tokens": 1e6 / tok_s / 3600,
        }
    )
    del engine, model
    return result


def choose_decode_setup(runner: Any, rows: int, fp8: bool) -> dict[str, Any]:
    """The decode step as the engine replays it, timed while its GEMV tilings and PDL change: the
    sweep times each GEMV alone, but the step of the same kernels (eager sums within 0.02 ms)
    measured 8.71-8.88 ms in runs 11 and 13 and 9.20-9.39 in runs 12 and 14, with PDL helping
    (-0.3 ms) or hurting (+0.15) depending on which of the near-equal tilings the sweep picked
    (e.g. the down projection's). So: PDL off with the swept tilings; PDL on with the swept
    tilings, then with the engine's defaults (fp8), keeping the faster; then one shape at a time
    switched to each of its runners-up, keeping a switch that makes the step faster (the bf16
    table has no runners-up). The fastest setup stays on for the load point."""
    from worker.kernels.pdl import pdl_enabled, set_pdl
    from worker.kernels.triton import fp8_gemm as fp8k

    table = fp8k.DECODE_TILINGS if fp8 else fp8k.BF16_DECODE_TILINGS
    set_pdl(os.environ.get("TOKENMILL_PDL", "1") != "0")  # an earlier section may have left it off
    can_pdl = pdl_enabled(runner.device)
    trials: list[dict[str, Any]] = []

    def step_ms(on: bool) -> float:
        set_pdl(on)
        runner.graphs.clear()
        runner.capture_graphs()
        if rows not in runner.graphs:
            return float("inf")
        return 1e3 * cuda_time(runner.graphs[rows][0].replay, iters=20, warmup=3)

    swept = dict(table)
    off = step_ms(False)
    trials.append({"setup": "swept, pdl off", "ms": off})
    best_ms, best_pdl, best_table = off, False, dict(swept)
    if can_pdl:
        current = step_ms(True)
        trials.append({"setup": "swept, pdl on", "ms": current})
        if fp8:  # the engine's built-in tilings (what a worker runs without a sweep)
            table.update({(n, k): fp8k.default_tiling(n, k) for n, k in swept})
            ms = step_ms(True)
            trials.append({"setup": "default tilings, pdl on", "ms": ms})
            if ms < current - 0.01:
                current = ms
            else:
                table.update(swept)
        for key in [key for key in TOP_TILINGS if key in table] if fp8 else []:
            kept = table[key]
            for tiling in TOP_TILINGS[key]:
                if tiling == kept:
                    continue
                table[key] = tiling
                ms = step_ms(True)
                trials.append({"setup": f"pdl on, {key[0]}x{key[1]}: {tiling}", "ms": ms})
                if ms < current - 0.01:
                    current, kept = ms, tiling
            table[key] = kept
        if current < best_ms:
            best_ms, best_pdl, best_table = current, True, dict(table)
    table.clear()
    table.update(best_table)
    step_ms(best_pdl)
    return {
        "trials": trials,
        "chosen": {"pdl": best_pdl, "step_ms": best_ms},
        "tilings": {f"{n}x{k}": str(t) for (n, k), t in best_table.items()},
    }
