"""One GPU call, every number of the H200 results table: our engine in BF16 and FP8, Hugging Face
transformers at the same shape, and the bandwidth roofline, at the load point.

    PYTHONPATH=. python3 bench/engine/suite.py                 # on the GPU; JSON to $OUT
    python -m bench.engine.suite --preset tiny-qwen3_5 --device cpu --budget-s 120   # plumbing check

Sections, in order (each guarded: a failure is recorded and the next one runs; the JSON is
rewritten after every section, so a killed run still leaves what it measured):
1. roofline: device-to-device copy bandwidth; decode-step floor = bytes a batch-8 step must move
   (weights + DeltaNet state read and written) / bandwidth.
2. fp8_gemm: w8a16 (triton) vs torch._scaled_mm (rowwise) vs bf16 F.linear at M=8 and M=4096 for
   the big projection shapes; sets the w8a16 -> scaled_mm switch for the FP8 engine.
   gemv: every decode GEMV shape's tilings timed alone (and the MLP's fused gate|up activation
   against two launches); gdn: the DeltaNet recurrence's decode and chunked-prefill launch
   settings at the model's shape; each stores its winners where the kernels read them.
3. bf16, fp8: the engine at the load point (32 requests, 8 in flight, 512 prompt + 256 output
   tokens; one warm-up round, then up to 5 repeats while the section's time budget lasts), with
   CUDA-graph decode whose setup (GEMV tilings, PDL on/off) is chosen by timing the captured
   step itself (`decode_setup`); plus phases: decode step as a graph replay, the same step eager, a
   per-kernel profile of the eager step (kernels grouped), and the 8 x 512 prefill step.
4. hf: transformers Qwen3_5ForCausalLM bf16 (sdpa; fla kernels when importable), static batch 8,
   512 prompt: generate 1 token and 1 + D tokens; decode step = difference / D; the 256-token
   run is extrapolated as t(1) + 255 x step (method recorded in the JSON).
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import random
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.engine.load_point import percentile, random_prompts, run_round
from worker.engine.engine import EngineConfig, LLMEngine
from worker.engine.sequence import SamplingParams

GIB = 1024**3
FP8_E4M3 = torch.float8_e4m3fn


class Suite:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.start = time.perf_counter()
        self.out = Path(args.out or os.environ.get("OUT") or "bench/results")
        self.out.mkdir(parents=True, exist_ok=True)
        self.report: dict[str, Any] = {
            "load_point": {
                "num_requests": args.num_requests,
                "concurrency": args.concurrency,
                "prompt_len": args.prompt_len,
                "max_tokens": args.max_tokens,
                "max_repeats": args.repeats,
            },
            "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
            "torch": torch.__version__,
            "sections": {},
        }

    def left(self) -> float:
        return self.args.budget_s - (time.perf_counter() - self.start)

    def section(self, name: str, fn: Callable[[float], dict[str, Any]], share: float) -> None:
        """Run one section with `share` of the time left (it gets at least what it needs to
        start; it checks its own budget as it goes)."""
        budget = self.left() * share
        print(f"== {name} (budget {budget:.0f} s, {self.left():.0f} s left)", file=sys.stderr)
        began = time.perf_counter()
        try:
            result = fn(budget)
        except Exception as exc:  # record and go on: the other sections still count
            traceback.print_exc()
            result = {"error": f"{type(exc).__name__}: {exc}"}
        result["section_s"] = time.perf_counter() - began
        self.report["sections"][name] = result
        self.write()
        free_gpu()

    def write(self) -> None:
        (self.out / "gpu_suite.json").write_text(json.dumps(self.report, indent=2, default=str))


def free_gpu() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def cuda_time(fn: Callable[[], Any], iters: int, warmup: int = 1) -> float:
    """Mean seconds per call on the GPU (events), after warm-up calls."""
    for _ in range(warmup):
        fn()
    if not torch.cuda.is_available():
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) / iters
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / 1e3 / iters


# --- 1. roofline ----------------------------------------------------------------------------


def roofline(args: argparse.Namespace, config: Any) -> dict[str, Any]:
    n = (1 << 30) if args.device == "cuda" else (1 << 22)
    src = torch.empty(n, dtype=torch.uint8, device=args.device)
    dst = torch.empty_like(src)
    seconds = cuda_time(lambda: dst.copy_(src), iters=20, warmup=3)
    bandwidth = 2 * n / seconds  # bytes read + written
    params = config.num_parameters()
    state = state_bytes_per_seq(config)
    batch = args.concurrency
    rows = {}
    for name, weight_bytes in (("bf16", 2 * params), ("fp8", params)):
        step_bytes = weight_bytes + 2 * batch * state  # state read and written
        step_s = step_bytes / bandwidth
        rows[name] = {
            "weight_bytes": weight_bytes,
            "step_bytes": step_bytes,
            "decode_step_ms": step_s * 1e3,
            "decode_tok_s": batch / step_s,
        }
    return {"copy_bandwidth_gb_s": bandwidth / 1e9, "batch": batch, "configs": rows}


def state_bytes_per_seq(config: Any, value_bytes: int = 2) -> int:
    """Recurrent state bytes per sequence; the engine's default pool holds bf16 (run 11 on; fp32
    before: twice this)."""
    c = config
    layers = len(c.linear_attention_layers)
    recurrent = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim
    recurrent *= value_bytes
    return layers * recurrent


# --- 2. fp8 GEMM paths ----------------------------------------------------------------------


def fp8_gemm(args: argparse.Namespace, config: Any) -> dict[str, Any]:
    from worker.kernels.triton import fp8_gemm as fp8k
    from worker.models.fp8 import quantize_weight

    h, f, v = config.hidden_size, config.intermediate_size, config.vocab_size
    shapes = {
        "gate|up": (f, h),
        "down": (h, f),
        "in_proj_qkv": (config.conv_dim, h),
        "head": (v, h),
    }
    rows_list = (8, 4096) if args.device == "cuda" else (8, 64)
    results: dict[str, Any] = {}
    wins = {m: {"w8a16": 0.0, "scaled_mm": 0.0} for m in rows_list}
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, device=args.device, dtype=torch.bfloat16) * 0.02
        q, s = quantize_weight(w)
        for m in rows_list:
            x = torch.randn(m, k, device=args.device, dtype=torch.bfloat16)
            row: dict[str, Any] = {"weight_bytes_fp8": n * k, "flop": 2 * m * n * k}
            paths: dict[str, Callable[[], torch.Tensor]] = {
                "bf16": functools.partial(torch.nn.functional.linear, x, w),
                "w8a16": functools.partial(fp8k.w8a16, x, q, s),
                "scaled_mm": functools.partial(fp8k.scaled_mm, x, q, s),
            }
            ref = torch.nn.functional.linear(x, (q.float() * s[:, None]).bfloat16()).float()
            for path, fn in paths.items():
                try:
                    err = ((fn().float() - ref).norm() / ref.norm()).item()
                    t = cuda_time(fn, iters=10, warmup=2)
                    row[path] = {"us": t * 1e6, "rel_err_vs_dequant": err}
                    row[path]["gb_s"] = (n * k * (2 if path == "bf16" else 1)) / t / 1e9
                    row[path]["tflop_s"] = 2 * m * n * k / t / 1e12
                    if path in wins[m]:
                        wins[m][path] += t
                except Exception as exc:
                    row[path] = {"error": f"{type(exc).__name__}: {exc}"}
                    if path in wins[m]:
                        wins[m][path] = float("inf")
            results[f"{name} M={m}"] = row
        del w, q, s
    small, large = rows_list
    # the switch: scaled_mm from the first size where it is faster in total
    if wins[small]["scaled_mm"] < wins[small]["w8a16"]:
        switch = 1
    elif wins[large]["scaled_mm"] < wins[large]["w8a16"]:
        switch = 64
    else:
        switch = 1 << 30  # scaled_mm broken or slower everywhere
    fp8k.FP8_SCALED_MM_MIN_ROWS = switch
    return {"shapes": results, "totals_s": wins, "scaled_mm_min_rows": switch}


# --- 2b. preflight of the fused elementwise kernels, and the decode GEMV sweep -----------------


def preflight(args: argparse.Namespace, config: Any) -> dict[str, Any]:
    """Each fused elementwise kernel against its reference at the 27B decode shapes; a kernel
    that fails is unregistered (the engine then runs the reference) and the failure recorded."""
    from worker.kernels import ops, reference

    dev, dt = args.device, torch.bfloat16
    t, h, f = args.concurrency, config.hidden_size, config.intermediate_size
    nv, d = config.linear_num_value_heads, config.head_dim
    rot = config.rotary_dim
    angles = torch.outer(torch.arange(4096.0, device=dev), torch.rand(rot // 2, device=dev))
    a_b = torch.randn(t, 2 * nv + 8, device=dev, dtype=dt) * 4
    x, res = torch.randn(t, h, device=dev, dtype=dt), torch.randn(t, h, device=dev, dtype=dt)
    w = torch.randn(h, device=dev, dtype=dt) * 0.1
    qg = torch.randn(t, config.num_attention_heads, 2 * d, device=dev, dtype=dt)
    positions = torch.randint(0, 4096, (t,), device=dev)
    cases: dict[str, tuple[Any, ...]] = {
        "add_rms_norm": (x, res, w, 1e-6, True),
        "silu_mul": (torch.randn(t, 2 * f, device=dev, dtype=dt) * 3,),
        "gdn_gates": (
            a_b[:, :nv],
            a_b[:, nv : 2 * nv],
            torch.rand(nv, device=dev).add(0.5).log(),
            torch.randn(nv, device=dev),
        ),
        "apply_rotary": (qg[..., :d], positions, (angles.cos(), angles.sin()), rot),
        "sigmoid_mul": (torch.randn(t, qg.shape[1] * d, device=dev, dtype=dt), qg[..., d:]),
        # strided heads read in place: the q norm on q_proj's query half, DeltaNet's z gate
        "rms_norm": (qg[..., :d], torch.randn(d, device=dev, dtype=dt) * 0.1, 1e-6, True),
        "gated_rms_norm": (
            torch.randn(t, nv, config.linear_value_head_dim, device=dev, dtype=dt),
            torch.randn(t, nv, 2 * config.linear_value_head_dim, device=dev, dtype=dt)[
                ..., : config.linear_value_head_dim
            ],
            torch.randn(config.linear_value_head_dim, device=dev, dtype=dt),
            1e-6,
        ),
    }
    from worker.models.fp8 import quantize_weight

    gate_up_w, gate_up_s = quantize_weight(torch.randn(2 * f, h, device=dev, dtype=dt) * 0.02)
    cases["linear_silu_mul"] = (x, gate_up_w, gate_up_s, None)
    conv_state = torch.randn(t + 1, config.conv_dim, 3, device=dev, dtype=dt)
    conv_case = (
        torch.randn(t, config.conv_dim, device=dev, dtype=dt),
        torch.randn(config.conv_dim, 4, device=dev, dtype=dt),
        conv_state,
        torch.arange(t, device=dev),
        *cases["gdn_gates"],
    )
    result: dict[str, Any] = {}
    for op, case in cases.items():
        impl = ops.select(op, torch.device(dev), dt)
        try:
            out, ref = impl.fn(*case), getattr(reference, op)(*case)
            outs = out if isinstance(out, tuple) else (out,)
            refs = ref if isinstance(ref, tuple) else (ref,)
            errs = [
                ((o.double() - r.double()).norm() / r.double().norm()).item()
                for o, r in zip(outs, refs, strict=True)
            ]
            ok = all(e < 2e-2 for e in errs)
            result[op] = {"impl": impl.name, "rel_err": errs, "ok": ok}
        except Exception as exc:
            ok = False
            result[op] = {"impl": impl.name, "error": f"{type(exc).__name__}: {exc}"}
        if not ok and op == "linear_silu_mul":  # the two launches, not the slow reference
            from worker.kernels.triton import fp8_gemm

            fp8_gemm.SILU_MUL_TILINGS[(2 * f, h, True)] = None
            result[op]["unfused"] = True
        elif not ok and impl.name != "reference":
            ops.unregister(op, impl.name)
            result[op]["unregistered"] = True
    # the conv update shifts its state in place: each side gets its own copy
    op = "conv_update_with_gates"
    impl = ops.select(op, torch.device(dev), dt)
    try:
        mine = impl.fn(*conv_case[:2], conv_state.clone(), *conv_case[3:])
        theirs = getattr(reference, op)(*conv_case[:2], conv_state.clone(), *conv_case[3:])
        errs = [
            ((o.double() - r.double()).norm() / r.double().norm()).item()
            for o, r in zip(mine, theirs, strict=True)
        ]
        result[op] = {"impl": impl.name, "rel_err": errs, "ok": all(e < 2e-2 for e in errs)}
    except Exception as exc:
        result[op] = {"impl": impl.name, "error": f"{type(exc).__name__}: {exc}", "ok": False}
    if not result[op]["ok"] and impl.name != "reference":
        ops.unregister(op, impl.name)
        result[op]["unregistered"] = True
    return result


def decode_shapes(config: Any) -> dict[str, tuple[int, int]]:
    """(N, K) of every fused decode GEMM of the model (attention o and DeltaNet out share one)."""
    c = config
    h, nv = c.hidden_size, c.linear_num_value_heads
    q_out = c.num_attention_heads * c.head_dim * (2 if c.attn_output_gate else 1)
    return {
        "gate|up": (2 * c.intermediate_size, h),
        "down": (h, c.intermediate_size),
        "deltanet qkv|z|b|a": (c.conv_dim + c.linear_value_dim + 2 * nv, h),
        "deltanet out / attention o": (h, c.linear_value_dim),
        "attention q|k|v": (q_out + 2 * c.num_key_value_heads * c.head_dim, h),
        "head": (c.vocab_size, h),
    }


def gemv_candidates(n: int, k: int, weight_bytes: int = 1) -> list[Any]:
    """Tilings to time for one shape: a few tile shapes, each with the split that aims at ~4
    programs per SM and the one that best fills whole waves (`wave_splits`); for fp8 also the
    old two-launch kernel. The split count is a runtime argument: no compile per split.

    fp8 tries only tiles of 16-32 channels (mma.sync): the 64/128-channel wgmma tiles ran at
    40-60% of copy bandwidth in run 3. For the 5120-row shapes (out/o at 51% in run 3) it also
    tries every split from 1 to 4, fewer warps (more programs resident) and deeper or finer
    staging, so more bytes are in flight per SM."""
    from worker.kernels.triton.fp8_gemm import DecodeTiling, default_tiling, wave_splits

    def per_sm(bn: int, bk: int) -> int:
        return max(1, min(-(-(4 * 132) // -(-n // bn)), -(-k // bk)))

    narrow = n <= 20_000
    if weight_bytes == 1:
        shapes = [(32, 256, 4, 4), (32, 512, 4, 3)]
        if narrow:
            shapes += [(32, 128, 4, 6), (32, 256, 2, 4), (16, 256, 2, 4)]
        # Nsight Compute on gate|up (run 7): 4 blocks of 49 KB per SM (25% occupancy, shared
        # memory bound), the shared-memory pipe 73% busy: fewer stages and 64-channel tiles on
        # mma.sync (2 warps: no wgmma) for more resident blocks and half the x traffic per byte
        shapes += [(32, 256, 2, 2), (32, 128, 2, 3), (32, 128, 4, 3), (64, 128, 2, 3)]
        shapes += [(64, 256, 2, 2), (64, 128, 2, 4), (64, 256, 2, 3), (64, 512, 2, 2)]
        shapes += [(128, 128, 2, 2), (128, 256, 2, 2), (128, 128, 4, 2)]
    else:  # 16-bit weights: twice the shared memory per stage
        shapes = [(64, 128, 4, 4), (64, 128, 4, 3), (128, 128, 8, 3), (32, 256, 4, 4)]
    if n > 100_000:  # the head: thousands of column tiles whatever the tiling
        shapes = shapes[:2]
    cands = []
    if weight_bytes == 1:
        base = default_tiling(n, k)
        cands += [base, DecodeTiling(two_pass=True, splits=base.splits)]
    for bn, bk, warps, stages in shapes:
        tiling = DecodeTiling(bn, bk, 1, warps, stages)
        splits = {per_sm(bn, bk), wave_splits(n, k, tiling, weight_bytes)}
        if weight_bytes == 1 and narrow and (bn, bk) in ((32, 256), (16, 256)):
            splits |= {1, 2, 3, 4}
        for split in sorted(splits):
            cands.append(DecodeTiling(bn, bk, split, warps, stages))
    if weight_bytes == 1 and n > 100_000:
        # W8A8 (x rounded to e4m3 per K step, fp8 x fp8 wgmma from shared memory): run 5 found
        # it 96% of copy bandwidth on the head and 57-72% on the layer shapes, so the head only
        for bn, bk, warps, stages in ((64, 128, 4, 6), (128, 128, 4, 3)):
            cands.append(DecodeTiling(bn, bk, 1, warps, stages, act_fp8=True))
    # stream-K: one wave of equal (tile, K step) ranges; occupancy = programs per SM
    if weight_bytes == 1:
        stream = [(32, 256, 4, 4, (2, 3, 4)), (32, 256, 2, 4, (3, 4)), (16, 256, 2, 4, (4, 6))]
        stream += [(32, 128, 2, 6, (4, 5))]
    else:
        stream = [(64, 128, 4, 3, (1, 2)), (32, 128, 4, 4, (2, 3))]
    if n <= 100_000 and k % 256 == 0:
        for bn, bk, warps, stages, occupancies in stream:
            for occupancy in occupancies:
                cands.append(DecodeTiling(bn, bk, 1, warps, stages, stream_k=occupancy))
    return list(dict.fromkeys(cands))  # drop repeats, keep order


def graph_time(fn: Callable[[int], Any], copies: int, replays: int = 10) -> float:
    """Seconds per call: a CUDA graph of `copies` calls (each on its own weight copy, so the set
    is larger than L2) replayed `replays` times."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(copies):
            fn(i)  # warm: compile, allocate
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(copies):
            fn(i)
    graph.replay()
    return cuda_time(graph.replay, iters=replays, warmup=1) / copies


def gemv_sweep(args: argparse.Namespace, config: Any, budget: float) -> dict[str, Any]:
    """Every decode GEMM shape at M = batch: candidate tilings of the one-launch FP8 GEMV (and the
    old two-launch split-K), timed as graph replays over weight sets larger than L2, checked
    against the dequantized reference after the replays; the fastest correct one per shape goes
    into DECODE_TILINGS for the FP8 engine. cuBLAS bf16 F.linear at the same shape for reference."""
    if args.device != "cuda":
        return {"skipped": "the sweep times CUDA graphs"}
    deadline = time.perf_counter() + budget
    results = {
        name: sweep_shape(args, n, k, deadline) for name, (n, k) in decode_shapes(config).items()
    }
    return {
        "gate_up_silu_mul": silu_mul_sweep(args, *decode_shapes(config)["gate|up"]),
        "shapes": results,
        "fp8_gemv_ms_per_step_estimate": gemv_step_estimate(config, results),
        "bf16_gemm_ms_per_step_estimate": gemv_step_estimate(config, results, "bf16_chosen"),
    }


def sweep_shape(args: argparse.Namespace, n: int, k: int, deadline: float) -> dict[str, Any]:
    from worker.kernels.triton import fp8_gemm as fp8k
    from worker.models.fp8 import quantize_weight

    m, dev = args.concurrency, args.device
    floor = n * k / (args.copy_bandwidth or 4.27e12)
    copies = max(2, -(-(192 << 20) // (n * k)))
    row: dict[str, Any] = {"n": n, "k": k, "copies": copies, "floor_us": floor * 1e6}
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    w16 = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    cublas = float("inf")
    try:
        cublas = graph_time(lambda i: torch.nn.functional.linear(x, w16[i]), copies)
        row["bf16_cublas"] = {"us": cublas * 1e6, "of_roofline": 2 * floor / cublas}
    except Exception as exc:
        row["bf16_cublas"] = {"error": f"{type(exc).__name__}: {exc}"}
    # 16-bit weights through the same GEMV: chosen only where it beats cuBLAS by 3%
    ref16 = torch.nn.functional.linear(x, w16[-1]).float()
    outs: list[Any] = [None] * copies
    best16: tuple[float, Any] | None = None
    tried16 = []
    for tiling in gemv_candidates(n, k, weight_bytes=2):
        if time.perf_counter() > deadline:
            break
        entry16: dict[str, Any] = {"tiling": str(tiling)}
        try:

            def call16(i: int, tiling: Any = tiling) -> None:
                outs[i] = fp8k.w8_gemv(x, w16[i], None, None, tiling)

            t = graph_time(call16, copies)
            err = ((outs[-1].float() - ref16).norm() / ref16.norm()).item()
            entry16.update({"us": t * 1e6, "of_roofline": 2 * floor / t, "rel_err": err})
            if err < 1e-2 and t < 0.97 * cublas and (best16 is None or t < best16[0]):
                best16 = (t, tiling)
        except Exception as exc:
            entry16["error"] = f"{type(exc).__name__}: {exc}"[:300]
        tried16.append(entry16)
    row["bf16_gemv_candidates"] = tried16
    if best16 is not None:
        fp8k.BF16_DECODE_TILINGS[(n, k)] = best16[1]
        row["bf16_chosen"] = {"tiling": str(best16[1]), "us": best16[0] * 1e6}
    else:
        row["bf16_chosen"] = {"tiling": "cuBLAS", "us": cublas * 1e6}
    qs = [quantize_weight(w) for w in w16]
    w16.clear()
    free_gpu()
    ref = torch.nn.functional.linear(x, (qs[-1][0].float() * qs[-1][1][:, None]).bfloat16())
    best: tuple[float, Any] | None = None
    tried = []
    correct: list[tuple[float, Any]] = []  # (us, tiling) of every correct candidate
    for tiling in gemv_candidates(n, k):
        if time.perf_counter() > deadline:
            tried.append({"tiling": str(tiling), "skipped": "section budget"})
            continue
        entry: dict[str, Any] = {"tiling": str(tiling)}
        try:

            def call(i: int, tiling: Any = tiling) -> None:
                outs[i] = fp8k.w8_gemv(x, qs[i][0], qs[i][1], None, tiling)

            t = graph_time(call, copies)
            err = ((outs[-1].float() - ref.float()).norm() / ref.float().norm()).item()
            entry.update({"us": t * 1e6, "of_roofline": floor / t, "rel_err": err})
            # W8A8 adds e4m3 rounding of x (~2.5% relative on random data, as scaled_mm)
            bound = 4e-2 if tiling.act_fp8 else 1e-2
            if err < bound:
                correct.append((t * 1e6, tiling))
            if err < bound and (best is None or t < best[0]):
                best = (t, tiling)
        except Exception as exc:
            entry["error"] = f"{type(exc).__name__}: {exc}"[:300]
        tried.append(entry)
    row["candidates"] = tried
    if best is not None and time.perf_counter() < deadline:
        # what programmatic dependent launch buys this shape: the winner again with PDL off
        from worker.kernels.pdl import set_pdl

        set_pdl(False)
        try:

            def call_no_pdl(i: int, tiling: Any = best[1]) -> None:
                outs[i] = fp8k.w8_gemv(x, qs[i][0], qs[i][1], None, tiling)

            row["chosen_without_pdl_us"] = graph_time(call_no_pdl, copies) * 1e6
        except Exception as exc:
            row["chosen_without_pdl_us"] = f"{type(exc).__name__}: {exc}"[:300]
        finally:
            set_pdl(True)
    if n < 100_000:  # the engine's decode choice tries the runners-up (the head: one launch)
        TOP_TILINGS[(n, k)] = [tiling for _, tiling in sorted(correct, key=lambda c: c[0])[:3]]
        row["top"] = [str(t) for t in TOP_TILINGS[(n, k)]]
    if best is None:  # nothing correct measured in time: the default (run 3's winners)
        fp8k.DECODE_TILINGS[(n, k)] = fp8k.default_tiling(n, k)
        row["chosen"] = {"tiling": f"default {fp8k.default_tiling(n, k)} (none measured)"}
    else:
        fp8k.DECODE_TILINGS[(n, k)] = best[1]
        row["chosen"] = {"tiling": str(best[1]), "us": best[0] * 1e6}
    return row


def silu_mul_sweep(args: argparse.Namespace, n: int, k: int) -> dict[str, Any]:
    """The MLP's activation: the gate|up GEMV with silu * mul in its epilogue (one launch, a few
    tilings) against the swept gate|up GEMV then the silu_mul kernel (two launches), fp8 and bf16
    weights; the faster goes into SILU_MUL_TILINGS (None: the two launches)."""
    from worker.kernels.triton import fp8_gemm as fp8k

    report: dict[str, Any] = {}
    for fp8 in (True, False):
        try:
            report["fp8" if fp8 else "bf16"] = silu_mul_choice(args, n, k, fp8)
        except Exception as exc:
            fp8k.SILU_MUL_TILINGS[(n, k, fp8)] = None
            report["fp8" if fp8 else "bf16"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        free_gpu()
    return report


def silu_mul_choice(args: argparse.Namespace, n: int, k: int, fp8: bool) -> dict[str, Any]:
    from worker.kernels.triton import fp8_gemm as fp8k
    from worker.kernels.triton.activations import silu_mul
    from worker.models.fp8 import quantize_weight

    m, dev = args.concurrency, args.device
    copies = max(2, -(-(192 << 20) // (n * k)))
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    sets: list[tuple[torch.Tensor, torch.Tensor | None]] = []
    for _ in range(copies):
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        q, s = quantize_weight(w) if fp8 else (w, None)
        sets.append((q, s))
        del w
    outs: list[Any] = [None] * copies
    fp8k.SILU_MUL_TILINGS.pop((n, k, fp8), None)
    tilings = [fp8k.silu_mul_tiling(n // 2, k, fp8), fp8k.DecodeTiling(32, 128, 1, 2, 3)]
    tilings += [fp8k.DecodeTiling(32, 256, 1, 2, 2), fp8k.DecodeTiling(16, 256, 1, 2, 3)]
    tilings += [fp8k.DecodeTiling(32, 128, 1, 4, 4)]

    def two(i: int) -> None:
        w, s = sets[i]
        outs[i] = silu_mul(fp8k.fp8_linear(x, w, s) if s is not None else fp8k.linear(x, w))

    unfused = graph_time(two, copies)
    want = outs[-1].float()
    row: dict[str, Any] = {"two_launches_us": unfused * 1e6}
    best: tuple[float, Any] = (unfused, None)
    for tiling in dict.fromkeys(tilings):

        def one(i: int, tiling: Any = tiling) -> None:
            outs[i] = fp8k.linear_silu_mul(x, *sets[i], None, tiling)

        try:
            t = graph_time(one, copies)
            err = ((outs[-1].float() - want).norm() / want.norm()).item()
            row[str(tiling)] = {"us": t * 1e6, "rel_err": err}
            if err < 1e-2 and t < best[0]:
                best = (t, tiling)
        except Exception as exc:
            row[str(tiling)] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    fp8k.SILU_MUL_TILINGS[(n, k, fp8)] = best[1]
    row["chosen"] = {"tiling": str(best[1] or "two launches"), "us": best[0] * 1e6}
    return row


def gdn_sweep(args: argparse.Namespace, config: Any, budget: float) -> dict[str, Any]:
    """The DeltaNet recurrence's launch settings at the model's shape, on a bf16 state pool (the
    engine's default): decode (block_v x warps; a graph over one state pool per DeltaNet layer,
    so the states come from HBM as in the engine) and the 8 x prompt chunked prefill (chunk,
    block_v, warps of its two kernels). Each variant is checked against the op's default; the
    fastest correct one goes into DECODE_LAUNCH / PREFILL_LAUNCH."""
    if args.device != "cuda":
        return {"skipped": "times CUDA kernels"}
    from worker.kernels.triton import delta_rule as dr

    deadline = time.perf_counter() + budget
    c, b, dev = config, args.concurrency, args.device
    hk, hv = c.linear_num_key_heads, c.linear_num_value_heads
    dk, dv = c.linear_key_head_dim, c.linear_value_head_dim
    layers, scale = len(c.linear_attention_layers), dk**-0.5

    def inputs(tokens: int) -> tuple[torch.Tensor, ...]:
        packed = torch.randn(tokens, 2 * hk * dk + hv * dv, device=dev, dtype=torch.bfloat16)
        q = packed[:, : hk * dk].view(tokens, hk, dk)
        k = packed[:, hk * dk : 2 * hk * dk].view(tokens, hk, dk)
        v = packed[:, 2 * hk * dk :].view(tokens, hv, dv)
        g = -torch.nn.functional.softplus(torch.randn(tokens, hv, device=dev) - 1.0)
        beta = torch.rand(tokens, hv, device=dev, dtype=torch.bfloat16)
        return q, k, v, g, beta

    report: dict[str, Any] = {"decode": {}, "prefill": {}}
    q, k, v, g, beta = inputs(b)
    pools = [(torch.randn(b + 1, hv, dk, dv, device=dev) * 0.05).bfloat16() for _ in range(layers)]
    first = pools[0].clone()  # each variant's check starts from these states (timing moves them)
    slots = torch.randperm(b, device=dev)
    outs: list[Any] = [None] * layers
    default = dict(dr.DECODE_LAUNCH)
    best: tuple[float, dict[str, int]] | None = None
    want: Any = None
    for bv, warps in ((32, 2), (64, 4), (64, 2), (64, 8), (128, 4), (32, 4), (16, 2), (128, 8)):
        if time.perf_counter() > deadline:
            break
        launch = {"block_v": bv, "num_warps": warps}
        try:

            def decode(i: int, launch: dict[str, int] = launch) -> None:
                outs[i] = dr.gated_delta_rule_decode(
                    q, k, v, g, beta, pools[i], slots, scale, True, **launch
                )

            t = graph_time(decode, layers)
            pool = first.clone()
            got = dr.gated_delta_rule_decode(q, k, v, g, beta, pool, slots, scale, True, **launch)
            got = torch.cat([got.float().flatten(), pool.float().flatten()])
            want = got if want is None else want
            err = ((got - want).norm() / want.norm()).item()
            report["decode"][f"bv={bv} w={warps}"] = {"us": t * 1e6, "rel_err": err}
            if err < 1e-2 and (best is None or t < best[0]):
                best = (t, launch)
        except Exception as exc:
            report["decode"][f"bv={bv} w={warps}"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    dr.DECODE_LAUNCH.update(best[1] if best else default)
    report["decode_chosen"] = dict(dr.DECODE_LAUNCH)
    pools.clear()
    free_gpu()

    tokens = b * args.prompt_len
    q, k, v, g, beta = inputs(tokens)
    cu = torch.arange(0, tokens + 1, args.prompt_len, device=dev, dtype=torch.int32)
    state = torch.zeros(b, hv, dk, dv, device=dev, dtype=torch.bfloat16)
    fresh = torch.zeros(b, dtype=torch.bool, device=dev)
    ids = torch.arange(b, device=dev)
    default = dict(dr.PREFILL_LAUNCH)
    best, want = None, None
    variants = [(32, 64, 4, 4), (32, 32, 4, 4), (32, 64, 2, 4), (32, 64, 8, 4), (32, 32, 4, 2)]
    variants += [(32, 128, 4, 8), (64, 64, 4, 4), (64, 64, 8, 8), (16, 64, 2, 4), (32, 32, 2, 2)]
    for chunk, bv, pw, sw in variants:
        if time.perf_counter() > deadline:
            break
        launch = {"chunk_size": chunk, "block_v": bv, "prepare_warps": pw, "scan_warps": sw}
        name = f"BT={chunk} bv={bv} w={pw}/{sw}"
        try:

            def prefill(launch: dict[str, int] = launch) -> Any:
                return dr.gated_delta_rule_prefill(
                    q, k, v, g, beta, cu, state, ids, fresh, scale, True,
                    chunk_size=launch["chunk_size"], block_v=launch["block_v"],
                    prepare_warps=launch["prepare_warps"], scan_warps=launch["scan_warps"],
                )  # fmt: skip

            t = cuda_time(prefill, iters=5, warmup=1)
            got = prefill().float()
            want = got if want is None else want
            err = ((got - want).norm() / want.norm()).item()
            report["prefill"][name] = {"us": t * 1e6, "rel_err": err}
            if err < 2e-2 and (best is None or t < best[0]):
                best = (t, launch)
        except Exception as exc:
            report["prefill"][name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    dr.PREFILL_LAUNCH.update(best[1] if best else default)
    report["prefill_chosen"] = dict(dr.PREFILL_LAUNCH)
    free_gpu()
    return report


# (N, K) -> the sweep's three fastest correct tilings of each layer shape, fastest first.
TOP_TILINGS: dict[tuple[int, int], list[Any]] = {}


def w4_gemv(args: argparse.Namespace, budget: float) -> dict[str, Any]:
    """The int4 decode GEMV sweep at the 27B shapes (bench/kernels/int4.py, its own JSON beside
    this one): checks each tiling against the reference, times it (% of its own copy-bandwidth
    reading) and stores the winners in INT4_DECODE_TILINGS for the w4 engine section."""
    from bench.kernels import int4 as int4_kernels
    from worker.kernels.triton import int4_gemm

    out = Path(args.out or os.environ.get("OUT") or "bench/results") / "int4_kernels.json"
    report = int4_kernels.main(["--budget-s", str(budget), "--out", str(out)])
    for name, n, k in int4_kernels.SHAPES:  # the winners, for the w4 engine section
        best = report.get("decode", {}).get(name, {}).get("best")
        if best:
            tiling = eval(best["tiling"], {"Int4Tiling": int4_gemm.Int4Tiling})  # noqa: S307
            int4_gemm.INT4_DECODE_TILINGS[(n, k)] = tiling
    return {"json": str(out), "paste": report.get("paste"), "copy_gb_s": report.get("copy_gb_s")}


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


def l2_probe(args: argparse.Namespace, config: Any) -> dict[str, Any]:
    """How much faster a decode GEMV runs when its weights are already in L2: each shape timed
    cold (a different weight copy per call, the set larger than L2) and as the second of two
    back-to-back calls on the same copy (hot = pair - cold). Tells whether streaming the next
    projection's weights into L2 during the latency-bound kernels could pay."""
    if args.device != "cuda":
        return {"skipped": "needs CUDA"}

    shapes = decode_shapes(config)
    out: dict[str, Any] = {}
    for name in ("deltanet out / attention o", "attention q|k|v", "down", "gate|up"):
        out[name] = l2_probe_shape(args, *shapes[name])
        free_gpu()
    return out


def l2_probe_shape(args: argparse.Namespace, n: int, k: int) -> dict[str, Any]:
    from worker.kernels.triton import fp8_gemm as fp8k
    from worker.models.fp8 import quantize_weight

    copies = max(2, -(-(192 << 20) // (n * k)))
    x = torch.randn(args.concurrency, k, device=args.device, dtype=torch.bfloat16)
    qs = [
        quantize_weight(torch.randn(n, k, device=args.device, dtype=torch.bfloat16) * 0.02)
        for _ in range(copies)
    ]
    tiling = fp8k.DECODE_TILINGS.get((n, k)) or fp8k.default_tiling(n, k)

    def once(i: int) -> None:
        fp8k.w8_gemv(x, qs[i][0], qs[i][1], None, tiling)

    def twice(i: int) -> None:
        once(i)
        once(i)

    cold = graph_time(once, copies)
    pair = graph_time(twice, copies)
    floor = n * k / (args.copy_bandwidth or 4.27e12)
    return {
        "mb": n * k / 1e6,
        "tiling": str(tiling),
        "cold_us": cold * 1e6,
        "hot_us": (pair - cold) * 1e6,
        "cold_of_roofline": floor / cold,
    }


def gemv_step_estimate(config: Any, shapes: dict[str, Any], key: str = "chosen") -> float | None:
    """Sum of the chosen GEMV times over one decode step's GEMMs."""
    c = config
    attn = sum(1 for t in c.layer_types if t == "full_attention")
    gdn = c.num_hidden_layers - attn
    count = {
        "gate|up": c.num_hidden_layers,
        "down": c.num_hidden_layers,
        "deltanet qkv|z|b|a": gdn,
        "deltanet out / attention o": c.num_hidden_layers,
        "attention q|k|v": attn,
        "head": 1,
    }
    try:
        return sum(count[k] * shapes[k][key]["us"] for k in count) / 1e3
    except (KeyError, TypeError):
        return None


# --- 3. our engine --------------------------------------------------------------------------


class StepLog:
    """Wraps runner.execute: wall time of every step, tagged prefill (any prefill chunk) or
    decode (the number of decodes). The sampler's host copy ends every step, so wall = GPU.
    Also wraps runner.launch_decode (overlapped decode, which does not wait for its step):
    the time from one launch to the next is that step's wall time."""

    def __init__(self, runner: Any) -> None:
        self.runner, self.inner = runner, runner.execute
        self.inner_launch = runner.launch_decode
        self.steps: list[tuple[str, int, float]] = []
        self.profile_prefill = False  # profile the next prefill step's kernels (once)
        self.prefill_profile: dict[str, Any] | None = None
        self.last_launch: tuple[int, float] | None = None  # (decodes, start) of the last launch
        runner.execute = self
        runner.launch_decode = self.launch

    def launch(self, batch: Any) -> Any:
        t0 = time.perf_counter()
        if self.last_launch is not None:
            n, started = self.last_launch
            self.steps.append(("overlapped", n, t0 - started))
        self.last_launch = (len(batch.decodes), t0)
        return self.inner_launch(batch)

    def __call__(self, batch: Any) -> Any:
        self.last_launch = None  # a synchronous step ends the chain of launches
        if batch.prefills and self.profile_prefill and torch.cuda.is_available():
            self.profile_prefill = False
            box: list[Any] = []
            self.prefill_profile = profile_step(
                lambda: box.append(self.inner(batch)), steps=1, warm=False
            )
            return box[-1]
        t0 = time.perf_counter()
        out = self.inner(batch)
        kind = "prefill" if batch.prefills else "decode"
        self.steps.append((kind, batch.num_tokens, time.perf_counter() - t0))
        return out

    def summary(self) -> dict[str, Any]:
        full = self.runner.sizes[-1]
        decode = [s for k, n, s in self.steps if k == "decode" and n == full]
        overlapped = [s for k, n, s in self.steps if k == "overlapped" and n == full]
        prefill = [s for k, _, s in self.steps if k == "prefill"]
        return {
            "decode_steps": len(decode),
            "decode_step_wall_ms_p50": 1e3 * statistics.median(decode) if decode else None,
            "overlapped_decode_steps": len(overlapped),
            "overlapped_decode_step_wall_ms_p50": (
                1e3 * statistics.median(overlapped) if overlapped else None
            ),
            "prefill_steps": len(prefill),
            "prefill_step_wall_ms_p50": 1e3 * statistics.median(prefill) if prefill else None,
            "prefill_tokens_per_step_max": max(
                (n for k, n, _ in self.steps if k == "prefill"), default=0
            ),
        }


KERNEL_GROUPS = (
    ("fp8 gemv (one launch)", ("_gemv_kernel",)),
    ("fused elementwise (silu*mul, gdn gates, rotary)", ("_silu_mul", "_gdn_gates", "_rotary")),
    ("fp8 w8a16", ("w8a16",)),
    ("fp8 quantize rows", ("quantize_rows",)),
    ("gemm", ("gemm", "gemv", "nvjet", "cutlass", "sm90_xmma", "splitk", "scaled_mm")),
    ("gdn decode", ("gdn", "delta", "recurrent")),
    ("conv1d", ("conv",)),
    ("paged attention", ("decode_partition", "combine", "paged")),
    ("kv write", ("write_kv",)),
    ("norms", ("rms_norm",)),
)


def kernel_group(name: str) -> str:
    low = name.lower()
    for group, keys in KERNEL_GROUPS:
        if any(k in low for k in keys):
            return group
    return "other (elementwise, copies, index)"


def profile_step(fn: Callable[[], Any], steps: int, warm: bool = True) -> dict[str, Any]:
    """Per-kernel GPU time of `fn` (eager), per step: the top kernels and the groups."""
    from torch.profiler import ProfilerActivity, profile

    if warm:
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    kernels = []
    for e in prof.key_averages():
        # self time: a CPU op's device total would count its kernels a second time
        device_us = float(getattr(e, "self_device_time_total", 0) or 0)
        if device_us <= 0:
            continue
        kernels.append((e.key, e.count / steps, device_us / steps))
    kernels.sort(key=lambda k: -k[2])
    groups: dict[str, dict[str, float]] = {}
    for name, count, us in kernels:
        g = groups.setdefault(kernel_group(name), {"ms": 0.0, "launches": 0.0})
        g["ms"] += us / 1e3
        g["launches"] += count
    return {
        "total_ms": sum(k[2] for k in kernels) / 1e3,
        "groups": dict(sorted(groups.items(), key=lambda g: -g[1]["ms"])),
        "top": [
            {"kernel": name[:120], "launches": count, "ms": us / 1e3}
            for name, count, us in kernels[:25]
        ],
    }


def engine_phases(engine: LLMEngine) -> dict[str, Any]:
    """Decode step (batch max_num_seqs) as a graph replay and eager, and a kernel profile.
    All rows are padding (scratch block and slot): no sequence is touched."""
    runner = engine.runner
    inputs: Any = runner.decode_inputs
    if inputs is None:
        return {"error": "no padded decode path"}
    rows = runner.sizes[-1]
    inputs.fill_padding(0, inputs.max_rows)
    inputs.upload()
    ids, meta = inputs.input_ids(rows), inputs.meta(rows)
    phases: dict[str, Any] = {"batch": rows, "graph_error": runner.graph_error}
    with torch.inference_mode():
        if rows in runner.graphs:
            graph = runner.graphs[rows][0]
            phases["decode_step_graph_ms"] = 1e3 * cuda_time(graph.replay, iters=20, warmup=3)
            # host side of one step: the replay call alone, then the staging upload alone
            sync()
            t0 = time.perf_counter()
            graph.replay()
            phases["graph_replay_call_host_ms"] = 1e3 * (time.perf_counter() - t0)
            sync()
            t0 = time.perf_counter()
            for _ in range(20):
                inputs.upload(rows)
            phases["staging_upload_host_ms"] = 1e3 * (time.perf_counter() - t0) / 20
            sync()
            phases.update(graph_step_without_pdl(runner, rows))
        eager = lambda: runner._logits(ids, meta)  # noqa: E731
        phases["decode_step_eager_ms"] = 1e3 * cuda_time(eager, iters=5, warmup=1)
        if torch.cuda.is_available():
            phases["decode_step_eager_profile"] = profile_step(eager, steps=3)
    return phases


def graph_step_without_pdl(runner: Any, rows: int) -> dict[str, Any]:
    """The same padded decode step captured again with programmatic dependent launch off, timed,
    then captured back with it on: what PDL buys one whole step."""
    from worker.kernels.pdl import pdl_enabled, set_pdl

    if not pdl_enabled(runner.device):
        return {"pdl": "off (TOKENMILL_PDL=0, a pre-Hopper GPU, or capture fell back)"}
    result: dict[str, Any] = {"pdl": "on"}
    try:
        set_pdl(False)
        runner.graphs.clear()
        runner.capture_graphs()
        if rows in runner.graphs:
            graph = runner.graphs[rows][0]
            result["decode_step_graph_ms_without_pdl"] = 1e3 * cuda_time(
                graph.replay, iters=20, warmup=3
            )
    finally:
        set_pdl(True)
        runner.graphs.clear()
        runner.capture_graphs()
    return result


def overlap_check(engine: LLMEngine, prompts: list[list[int]]) -> dict[str, Any]:
    """The same greedy requests served synchronously and overlapped must get the same tokens
    (the overlapped path feeds the graph's own argmax back on the device)."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    served: dict[bool, list[list[int]]] = {}
    enabled = engine.overlap_decode
    try:
        for overlap in (False, True):
            engine.overlap_decode = overlap and enabled
            served[overlap] = [o.new_token_ids for o in engine.generate(prompts, params)]
    finally:
        engine.overlap_decode = enabled
    return {
        "overlap_enabled": enabled,
        "tokens_compared": sum(len(t) for t in served[False]),
        "equal": served[False] == served[True],
    }


def build_model(args: argparse.Namespace, config: Any, precision: str) -> tuple[str, Any, Any]:
    """(device, dtype, model): random weights at `config`'s shape, in `precision` ("bf16",
    "fp8" or "w4"), built on the device."""
    from worker.models import build_random
    from worker.models.fp8 import quantize_fp8

    device, dtype = args.device, torch.bfloat16 if args.device == "cuda" else torch.float32
    model = build_random(config, device, dtype, seed=args.seed)
    if precision == "fp8":
        quantize_fp8(model)
    elif precision == "w4":
        from worker.models.int4 import quantize_int4

        quantize_int4(model)
    free_gpu()
    return device, dtype, model


def load_point_engine(
    model: Any,
    args: argparse.Namespace,
    precision: str,
    max_num_seqs: int,
    batched_tokens: int,
    pad_decode: bool | None = None,
) -> LLMEngine:
    """An engine for the load point's lengths: KV for `max_num_seqs` whole sequences (fp8
    unless bf16 weights), `batched_tokens` a step."""
    max_model_len = args.prompt_len + args.max_tokens
    return LLMEngine(
        model,
        None,
        EngineConfig(
            block_size=16,
            num_kv_blocks=-(-max_model_len // 16) * max_num_seqs,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=batched_tokens,
            max_model_len=max_model_len,
            kv_dtype=FP8_E4M3 if precision != "bf16" else None,
            device=args.device,
            pad_decode=pad_decode,
        ),
    )


def engine_config(
    args: argparse.Namespace, config: Any, precision: str, budget: float
) -> dict[str, Any]:
    """The engine at the load point with `precision` weights: "bf16", "fp8" (e4m3 per channel)
    or "w4" (int4 group 128 with the FP8 LM head, `quantize_int4`'s default scheme); fp8 and w4
    run an fp8 KV cache."""
    began = time.perf_counter()
    device, dtype, model = build_model(args, config, precision)
    fp8 = precision == "fp8"
    build_s = time.perf_counter() - began
    # pad_decode on CPU too, so the plumbing check covers the same path
    engine = load_point_engine(
        model, args, precision, args.concurrency, args.prompt_len * args.concurrency, True
    )
    result: dict[str, Any] = {
        "weights_gib": sum(p.numel() * p.element_size() for p in model.parameters()) / GIB,
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

        table = fp8k.DECODE_TILINGS if fp8 else fp8k.BF16_DECODE_TILINGS
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
    steps.steps.clear()

    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    repeats: list[Any] = []
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


def concurrency_sweep(
    args: argparse.Namespace, config: Any, precision: str, budget: float
) -> dict[str, Any]:
    """The engine alone at concurrency 1, 2, 4, ... (`--sweep`), 2 x C requests of the load
    point's lengths per point after one warm round, on one engine sized for the largest C and
    warmed up first (its ready time is reported): output tok/s, TTFT p50/p95, decode step ms
    (overlapped decode's launch-to-launch time at the point's batch), preemptions, and the
    kernel compiles each point met after warm-up (should be 0)."""
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
        "max_num_batched_tokens": args.sweep_batched_tokens,
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
        steps.steps.clear()
        before = compiles()
        r = run_round(
            engine, random_prompts(2 * c, args.prompt_len, config.vocab_size, rng), c, params
        )
        full = [s for kind, n, s in steps.steps if kind in ("decode", "overlapped") and n == c]
        result["points"].append(
            {
                "concurrency": c,
                "output_tok_s": r.output_tok_s,
                "ttft_p50_s": percentile(r.ttft_s, 50),
                "ttft_p95_s": percentile(r.ttft_s, 95),
                "decode_step_ms_p50": 1e3 * statistics.median(full) if full else None,
                "preemptions": r.preemptions,
                "compiles_after_warm_up": compiles() - before,
                "wall_s": r.wall_s,
            }
        )
        print(f"  C={c}: {r.output_tok_s:.1f} tok/s", file=sys.stderr)
    del engine, model
    return result


# --- 4. Hugging Face transformers -----------------------------------------------------------


def hf_config(config: Any) -> Any:
    import transformers

    return transformers.Qwen3_5TextConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        layer_types=list(config.layer_types),
        linear_num_key_heads=config.linear_num_key_heads,
        linear_num_value_heads=config.linear_num_value_heads,
        linear_key_head_dim=config.linear_key_head_dim,
        linear_value_head_dim=config.linear_value_head_dim,
        linear_conv_kernel_dim=config.linear_conv_kernel_dim,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )


def hf_baseline(args: argparse.Namespace, config: Any, budget: float) -> dict[str, Any]:
    import transformers

    began = time.perf_counter()
    result: dict[str, Any] = {"transformers": transformers.__version__}
    try:
        import fla  # noqa: F401

        result["fla"] = getattr(fla, "__version__", "present")
    except Exception as exc:
        result["fla"] = f"not importable ({type(exc).__name__}): torch fallback kernels"
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    with torch.device(args.device):
        model = transformers.Qwen3_5ForCausalLM._from_config(
            hf_config(config), dtype=dtype, attn_implementation="sdpa"
        )
    model.eval()
    result["weights_gib"] = sum(p.numel() * p.element_size() for p in model.parameters()) / GIB
    result["build_s"] = time.perf_counter() - began
    batch = torch.randint(0, config.vocab_size, (args.concurrency, args.prompt_len))
    ids = batch.to(args.device)

    def generate(n: int) -> float:
        sync()
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
            )
        sync()
        return time.perf_counter() - t0

    generate(2)  # warm: kernel compilation, allocator
    first = generate(1)
    left = budget - (time.perf_counter() - began)
    # decode tokens to time: as many as fit in half of what is left (at most 64, at least 4)
    step_guess = max(first / 4, 0.02)
    d = int(max(4, min(64, (left * 0.5 - first) / step_guess)))
    longer = generate(1 + d)
    step = (longer - first) / d
    e2e = first + (args.max_tokens - 1) * step
    result.update(
        {
            "method": (
                f"static batch {args.concurrency}: t(1 token) = prefill + 1 step; decode step = "
                f"(t(1+{d}) - t(1)) / {d}; e2e for {args.max_tokens} tokens extrapolated as "
                f"t(1) + {args.max_tokens - 1} x step; tok/s = batch x tokens / e2e; TTFT = t(1)"
            ),
            "decode_tokens_timed": d,
            "t1_s": first,
            "decode_step_ms": step * 1e3,
            "ttft_p50_s": first,
            "ttft_p95_s": first,
            "e2e_p50_s": e2e,
            "e2e_p95_s": e2e,
            "output_tok_s": args.concurrency * args.max_tokens / e2e,
            "gpu_hours_per_1m_output_tokens": 1e6
            / (args.concurrency * args.max_tokens / e2e)
            / 3600,
        }
    )
    return result  # the model goes with this frame


def write_tuning(suite: Suite, into_package: bool) -> None:
    """The settings this run chose and measured, as the GPU's tuning file: a copy in the out
    folder, and the package's own file with --write-tuning."""
    from worker.kernels import tuning

    gpu = torch.cuda.get_device_name()
    data = tuning.snapshot(gpu, measured_by="python -m bench.engine.suite")
    tuning.write(suite.out / f"tuning-{tuning.gpu_slug(gpu)}.json", data)
    if into_package:
        tuning.write(tuning.path_for(gpu), data)
    suite.report["tuning_file"] = str(tuning.path_for(gpu)) if into_package else None


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# --- table ----------------------------------------------------------------------------------


def print_table(report: dict[str, Any]) -> None:
    s = report["sections"]
    cols = ("output tok/s", "TTFT p50/p95 s", "E2E p50/p95 s", "weights GiB", "KV GiB@1M",
            "state MiB/seq", "GPU-h/1M tok", "decode ms (graph/eager)")  # fmt: skip
    print(" | ".join(["config", *cols]))
    for name in ("bf16", "fp8", "w4", "hf"):
        r = s.get(name, {})
        if "output_tok_s" not in r:
            print(f"{name} | {r.get('error', 'not run')}")
            continue
        ph = r.get("phases", {})
        decode = (
            f"{ph.get('decode_step_graph_ms', float('nan')):.2f}/"
            f"{ph.get('decode_step_eager_ms', float('nan')):.2f}"
            if ph
            else f"{r.get('decode_step_ms', float('nan')):.2f} (HF)"
        )
        print(
            " | ".join(
                [
                    name,
                    f"{r['output_tok_s']:.1f}",
                    f"{r['ttft_p50_s']:.3f}/{r['ttft_p95_s']:.3f}",
                    f"{r['e2e_p50_s']:.2f}/{r['e2e_p95_s']:.2f}",
                    f"{r['weights_gib']:.2f}",
                    f"{r.get('attention_kv_gib_at_1m_tokens', float('nan')):.2f}",
                    f"{r.get('deltanet_state_mib_per_sequence', float('nan')):.1f}",
                    f"{r['gpu_hours_per_1m_output_tokens']:.3f}",
                    decode,
                ]
            )
        )
    for name in ("sweep_fp8", "sweep_w4"):
        for point in s.get(name, {}).get("points", []):
            if "output_tok_s" in point:
                print(
                    f"{name} C={point['concurrency']}: {point['output_tok_s']:.1f} tok/s, TTFT "
                    f"p50/p95 {point['ttft_p50_s']:.3f}/{point['ttft_p95_s']:.3f} s, decode "
                    f"{point['decode_step_ms_p50'] or float('nan'):.2f} ms, "
                    f"{point['preemptions']} preemptions, {point['compiles_after_warm_up']} compiles"
                )
    w4, fp8 = s.get("w4", {}), s.get("fp8", {})
    if "output_tok_s" in w4 and "output_tok_s" in fp8:
        print(f"W4 / FP8 output tok/s: {w4['output_tok_s'] / fp8['output_tok_s']:.3f}")
    roof = s.get("roofline", {})
    for name, row in roof.get("configs", {}).items():
        print(
            f"roofline {name}: {row['decode_step_ms']:.2f} ms/step, {row['decode_tok_s']:.0f} tok/s "
            f"(copy {roof['copy_bandwidth_gb_s']:.0f} GB/s)"
        )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--preset", default="qwen3_6-27b")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--budget-s", type=float, default=500.0, help="the whole suite's time guard")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sections", default="roofline,preflight,gemv,w4_gemv,fp8_gemm,fp8,w4,bf16,hf")
    p.add_argument("--out", help="folder for gpu_suite.json (default $OUT, else bench/results)")
    p.add_argument(
        "--sweep", default="1,2,4,8,16,32,64", help="concurrencies of the sweep sections"
    )
    p.add_argument("--sweep-batched-tokens", type=int, default=4096)
    p.add_argument(
        "--write-tuning",
        action="store_true",
        help="write the settings the sweeps chose to worker/kernels/tuning/<gpu>.json "
        "(a copy always goes to the out folder)",
    )
    args = p.parse_args(argv)
    args.sweep = [int(c) for c in args.sweep.split(",") if c]
    from worker.models.presets import PRESETS

    config = PRESETS[args.preset.replace("_", ".")]
    suite = Suite(args)
    suite.report["model"] = f"{config.name} (random weights)"
    wanted = args.sections.split(",")
    # shares of the time left when each section starts
    plan: list[tuple[str, Callable[[float], dict[str, Any]], float]] = [
        ("roofline", lambda b: roofline(args, config), 0.1),
        ("preflight", lambda b: preflight(args, config), 0.1),
        ("gemv", lambda b: gemv_sweep(args, config, b), 0.2),
        ("gdn", lambda b: gdn_sweep(args, config, b), 0.1),
        ("l2_probe", lambda b: l2_probe(args, config), 0.1),
        ("fp8_gemm", lambda b: fp8_gemm(args, config), 0.1),
        ("w4_gemv", lambda b: w4_gemv(args, b), 0.1),
        ("fp8", lambda b: engine_config(args, config, "fp8", b), 0.35),
        ("w4", lambda b: engine_config(args, config, "w4", b), 0.5),
        ("bf16", lambda b: engine_config(args, config, "bf16", b), 0.9),
        ("sweep_fp8", lambda b: concurrency_sweep(args, config, "fp8", b), 0.5),
        ("sweep_w4", lambda b: concurrency_sweep(args, config, "w4", b), 0.9),
        ("hf", lambda b: hf_baseline(args, config, b), 0.9),
    ]
    args.copy_bandwidth = None
    if {"gemv", "gdn", "w4_gemv"} & set(wanted):
        from worker.kernels import tuning

        tuning.mark_swept()  # the engine sections run what the sweeps chose, not a file
    for name, fn, share in plan:
        if name in wanted:
            suite.section(name, fn, share)
            if name == "roofline":
                gb_s = suite.report["sections"]["roofline"].get("copy_bandwidth_gb_s")
                args.copy_bandwidth = gb_s * 1e9 if gb_s else None
    suite.report["suite_s"] = time.perf_counter() - suite.start
    suite.write()
    if args.device == "cuda":
        write_tuning(suite, args.write_tuning)
    print_table(suite.report)
    return suite.report


if __name__ == "__main__":
    main()
