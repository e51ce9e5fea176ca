"""The sweep_fp8 and sweep_w4 sections: the engine at each concurrency of --sweep."""

from __future__ import annotations

import argparse
import random
import sys
import time
from typing import Any

from bench.common import median, percentile
from bench.engine.configs import (
    build_model,
    load_point_engine,
)
from bench.engine.load_point import random_prompts, run_round
from bench.engine.profiler import StepLog, engine_phases, stage_padding
from worker.engine.sequence import SamplingParams


def concurrency_sweep(
    args: argparse.Namespace, config: Any, precision: str, budget: float
) -> dict[str, Any]:
    """The engine alone at concurrency 1, 2, 4, ... (`--sweep`), 2 x C requests of the load
    point's lengths per point after one warm round, on one engine sized for the largest C and
    warmed up first (its ready time is reported): output tok/s, TTFT p50/p95, decode step ms
    (overlapped decode's launch-to-launch time at the point's batch), preemptions, and the
    kernel compiles each point met after warm-up (should be 0); with --repeats N, N timed
    rounds a point, the median one reported and all kept."""
    from worker.kernels.triton._launch import compiles

    began = time.perf_counter()
    device, _, model = build_model(args, config, precision)
    engine = load_point_engine(model, args, precision, max(args.sweep), args.sweep_batched_tokens)
    built = time.perf_counter()
    compositions = engine.warm_up()
    result: dict[str, Any] = {
        "build_and_capture_s": built - began,
        "warm_up_s": time.perf_counter() - built,
        "warm_up_compositions": len(compositions),
        "max_num_batched_tokens": engine.config.max_num_batched_tokens,
        "points": [],
    }
    steps = StepLog(engine.runner)
    rng = random.Random(args.seed)
    for c in args.sweep:
        if time.perf_counter() - began > budget:
            result["points"].append({"concurrency": c, "skipped": "budget"})
            continue
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        run_round(engine, random_prompts(c, args.prompt_len, config.vocab_size, rng), c, params)
        rounds = []
        for _ in range(max(1, args.repeats)):
            steps.clear()
            before = compiles()
            prompts = random_prompts(2 * c, args.prompt_len, config.vocab_size, rng)
            r = run_round(engine, prompts, c, params)
            full = [s for kind, n, s in steps.steps if kind in ("decode", "overlapped") and n == c]
            rounds.append(
                {
                    "output_tok_s": r.output_tok_s,
                    "ttft_p50_s": percentile(r.ttft_s, 50),
                    "ttft_p95_s": percentile(r.ttft_s, 95),
                    "decode_step_ms_p50": median(full, 1e3),
                    "preemptions": r.preemptions,
                    "compiles_after_warm_up": compiles() - before,
                    "wall_s": r.wall_s,
                }
            )
            print(f"  C={c}: {r.output_tok_s:.1f} tok/s", file=sys.stderr)
        # the point is its median round by output tok/s; every round is kept beside it
        by_speed = sorted(rounds, key=lambda x: x["output_tok_s"])
        result["points"].append(
            {"concurrency": c, **by_speed[(len(rounds) - 1) // 2], "rounds": rounds}
        )
    # where a step's time goes at the larger batches: kernel groups of a padded step whose rows
    # stream their own DeltaNet states (one-token contexts: attention is not counted)
    result["decode_phases"] = {}
    for c in args.sweep:
        if c >= 16 and c in engine.runner.sizes and time.perf_counter() - began < budget:
            try:
                result["decode_phases"][c] = engine_phases(engine, c, pdl=False, own_states=True)
            except Exception as exc:  # a profile is extra: keep the points
                result["decode_phases"][c] = {"error": repr(exc)[:300]}
    if precision == "fp8" and time.perf_counter() - began < budget:
        result["wide_gemv_check"] = wide_gemv_check(engine, [c for c in args.sweep if c > 16])
    del engine, model
    return result


def wide_gemv_check(engine: Any, batches: list[int]) -> dict[str, Any]:
    """The padded decode step at each of `batches` (> 16 rows) as a graph replay, with the
    measured wide GEMV tilings (WIDE_DECODE_TILINGS) and with scaled_mm in their place, on the
    same engine (graphs re-captured for each)."""
    from bench.common import cuda_time
    from worker.kernels.triton import fp8_gemm

    if not fp8_gemm.WIDE_DECODE_TILINGS:
        return {"skipped": "no wide tilings (python -m bench.kernels.fp8_rows --write-tuning)"}
    runner = engine.runner
    result: dict[str, Any] = {"tilings": len(fp8_gemm.WIDE_DECODE_TILINGS)}
    saved = fp8_gemm.FP8_WIDE_GEMV
    try:
        for wide in (True, False, True):
            fp8_gemm.FP8_WIDE_GEMV = wide
            runner.graphs.clear()
            runner.capture_graphs()
            for rows in batches:
                if rows not in runner.graphs:
                    continue
                stage_padding(runner.decode_inputs, rows, own_states=True)
                graph = runner.graphs[rows][0]
                key = f"{rows} {'wide gemv' if wide else 'scaled_mm'} ms"
                result.setdefault(key, []).append(1e3 * cuda_time(graph.replay, iters=20, warmup=3))
    finally:
        fp8_gemm.FP8_WIDE_GEMV = saved
        runner.graphs.clear()
        runner.capture_graphs()
    return result
