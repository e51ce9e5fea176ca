"""The int4-mma decode GEMV (worker/kernels/cuda/int4_mma.cu) at the Qwen3.6-27B shapes, beside
today's triton int4 GEMV and the FP8 GEMV, on one GPU.

    python -m bench.kernels.int4_mma --budget-s 240       # on a CUDA machine with nvcc

1. build: seconds to compile int4_mma.cu with nvcc (0 when cached).
2. copy: device-to-device copy bandwidth, the roofline.
3. decode: per weight shape, candidate `MmaTiling`s at M = 8 (rows per CTA, warps, K splits,
   loads in flight), each checked against the reference and timed as CUDA-graph replays over
   weight copies larger than L2 (median of 10 replays); the best at M = 1, 16, 32, 64; the
   triton int4 GEMV at its tuned tiling and FP8 `w8_gemv` at the same shape and M = 8; the
   best register-pipeline, register-ring and bulk-copy tilings again as probes without the math;
   the int8 products (`gemv_x8`, x as int8 per token and 128 k) at the best mode 9 and 10
   tilings, M = 8 and 16, beside the same tilings' 16-bit products.
4. prefill (gate|up and down, M = 512, 2048, 4096): the mma layout's dequantization + cuBLAS,
   the triton layout's, the e4m3 scratch + scaled_mm (`TOKENMILL_INT4_PREFILL=fp8`), the W4A8
   GEMM per candidate tiling (`=w4a8`), each with its relative error against the exact
   product, and an FP8 weight's scaled_mm of the shape. `--prefill-only` runs this alone.
Prints the table and `MMA_DECODE_TILINGS` entries to paste; writes JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
import traceback
from typing import Any

import torch
import triton
import triton.testing

from bench.common import copy_bandwidth, err, graph_time, out_path, rel_err, write_result
from bench.engine.gemv import keep_or_replace
from bench.kernels.int4 import GROUP, L2_SET_BYTES, SHAPES, int4_bytes, time_fp8_gemv
from worker.kernels import reference
from worker.kernels.cuda import int4_mma
from worker.kernels.cuda.int4_mma import MmaTiling
from worker.kernels.triton import int4_gemm as i4
from worker.kernels.triton.fp8_gemm import quantize_rows, scaled_mm


def log(*args: Any) -> None:
    print(*args, file=sys.stderr, flush=True)


def weights(n: int, k: int, copies: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:  # fmt: skip
    """(nibble qweight, scales, mma qweight, mma scales) per copy."""
    out = []
    for _ in range(copies):
        q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda")
        s = (torch.rand(n, triton.cdiv(k, GROUP), device="cuda") * 0.004 + 0.001).half()
        mq, ms = reference.int4_mma_pack(q, s)
        out.append((q, s, mq, ms))
    return out


# the built (depth, mode) variants, stream-K (mode 3) apart
PIPELINES = ((2, 0), (4, 1), (2, 2), (4, 2), (2, 7), (4, 7), (3, 9))


def candidates(n: int, k: int, modes: list[int] | None = None) -> list[MmaTiling]:
    """The tilings to time at (N, K): today's winner first, then by mode (in `modes` order,
    so that a tight budget reaches the modes named first)."""
    groups = k // GROUP
    out = {int4_mma.default_tiling(n, k, GROUP)}
    for rows in (1, 2, 4):
        if n % (16 * rows):
            continue
        blocks = n // (16 * rows)
        # 2 warps a CTA, 4-8 CTAs an SM: the FP8 w8_gemv's shape (small CTAs, each its own
        # pipeline), the one structure of that kernel not tried here yet
        for warps in (2, 4, 8):
            for ctas_per_sm in {2: (4, 8), 4: (1, 2, 3, 4), 8: (1, 2)}[warps]:
                splits = max(1, min(-(-ctas_per_sm * 132 // blocks), groups // warps))
                for depth, mode in PIPELINES:
                    out.add(MmaTiling(rows, warps, splits, depth, mode))
            for ctas_per_sm in (2, 4):  # stream-K
                for depth in (2, 4):
                    out.add(MmaTiling(rows, warps, ctas_per_sm, depth, 3))
        if rows == 2:  # the persistent ring: CTAs an SM (8 warps: 2 fit, 4 warps: 4)
            for warps, ctas in ((4, 1), (4, 2), (4, 3), (4, 4), (8, 1), (8, 2)):
                t = MmaTiling(rows, warps, ctas, 3, 10)
                if int4_mma.persistent_fits(t, 8, k, GROUP):
                    out.add(t)
        for warps in (4, 8):  # the bulk-copy ring: consumer warps, CTAs an SM, stages
            for ctas_per_sm in (1, 2):
                for depth in (3, 4, 6):
                    out.add(MmaTiling(rows, warps, ctas_per_sm, depth, 4))
    if modes is not None:
        out = {t for t in out if t.mode in modes}
    tuned = int4_mma.MMA_DECODE_TILINGS.get((n, k))
    if modes == [] and tuned is None:  # --tuned-only without a tuning file: the default
        out = {int4_mma.default_tiling(n, k, GROUP)}
    if tuned is not None:  # today's winner, the baseline of every run
        out.add(tuned)
    rank = {m: i for i, m in enumerate(modes or range(11))}
    return sorted(
        out, key=lambda t: (t != tuned, rank.get(t.mode, 10), t.rows, t.warps, t.splits, t.depth)
    )


def _time_weights(m: int, n: int, k: int, ws: list[Any], ref: torch.Tensor, tiling: MmaTiling,
                  bandwidth: float, product: Any, tolerance: float) -> dict[str, Any]:  # fmt: skip
    """`product(words, scales)` over the weight copies as CUDA-graph replays (median), checked
    against `ref` within `tolerance`."""
    outs: list[Any] = [None] * len(ws)
    row: dict[str, Any] = {"tiling": repr(tiling)}
    try:

        def call(i: int) -> None:
            outs[i] = product(ws[i][2], ws[i][3])

        t = graph_time(call, len(ws), median_replay=True)
        e = rel_err(outs[0], ref)
        gbs = int4_bytes(m, n, k) / t
        row.update({"us": t * 1e6, "gb_s": gbs / 1e9, "of_copy": gbs / bandwidth, "rel_err": e})
        row["ok"] = e < tolerance
    except Exception as exc:
        row["error"] = err(exc)
    return row


def time_mma(m: int, n: int, k: int, ws: list[Any], x: torch.Tensor, ref: torch.Tensor,
             tiling: MmaTiling, bandwidth: float) -> dict[str, Any]:  # fmt: skip
    return _time_weights(m, n, k, ws, ref, tiling, bandwidth,
                         lambda q, s: int4_mma.gemv(x, q, s, GROUP, tiling), 1e-2)  # fmt: skip


def time_x8(m: int, n: int, k: int, ws: list[Any], x: torch.Tensor, ref: torch.Tensor,
            tiling: MmaTiling, bandwidth: float) -> dict[str, Any]:  # fmt: skip
    """`gemv_x8` (int8 products, x rounded per token and 128 k once, outside the timing: the
    kernel before would write it) at `tiling`; its error is x's rounding against the exact
    product."""
    codes, xscales, _ = reference.int4_mma_x8(x)
    return _time_weights(m, n, k, ws, ref, tiling, bandwidth,
                         lambda q, s: int4_mma.gemv_x8(codes, xscales, q, s, GROUP, tiling), 2e-2)  # fmt: skip


def x8_section(good: list[dict[str, Any]], ws: list[Any], case: Any, n: int, k: int,
               bandwidth: float) -> dict[str, Any]:  # fmt: skip
    """The int8 products against the 16-bit ones at the fastest 2-tile tiling of each mode they
    run in (9, 10), M = 8 and 16, same weight copies; and at every 2-tile mode 9 / 10 tiling
    of the sweep at M = 8, the fastest as `best` (the tuning file's `int4_mma_x8_tilings`)."""
    out: dict[str, Any] = {"m8": []}
    for row16 in good:
        if "rows=2," in row16["tiling"] and any(f"mode={m})" in row16["tiling"] for m in int4_mma.X8_MODES):  # fmt: skip
            t = eval(row16["tiling"], {"MmaTiling": MmaTiling})  # noqa: S307 (our own repr)
            x, ref = case(8)
            row = time_x8(8, n, k, ws, x, ref, t, bandwidth)
            out["m8"].append({**row, "bf16_us": row16["us"]})
    timed = [r for r in out["m8"] if r.get("ok")]
    if timed:
        out["best"] = min(timed, key=lambda r: r["us"])
    for mode in int4_mma.X8_MODES:
        mine = [r for r in good if f"mode={mode})" in r["tiling"] and "rows=2," in r["tiling"]]
        if not mine:
            continue
        best = min(mine, key=lambda r: r["us"])
        t = eval(best["tiling"], {"MmaTiling": MmaTiling})  # noqa: S307 (our own repr)
        for m in (8, 16):
            x, ref = case(m)
            sixteen = best if m == 8 else time_mma(m, n, k, ws, x, ref, t, bandwidth)
            row = time_x8(m, n, k, ws, x, ref, t, bandwidth)
            row["bf16_us"] = sixteen.get("us")
            out[f"mode{mode}_m{m}"] = row
            log(f"  {n}x{k} M={m} x8 {best['tiling']}: {row.get('us', float('nan')):.1f} us "
                f"against {row['bf16_us'] or float('nan'):.1f} (16-bit x), err {row.get('rel_err', row.get('error'))}")  # fmt: skip
    return out


def time_triton(m: int, n: int, k: int, ws: list[Any], x: torch.Tensor, ref: torch.Tensor,
                bandwidth: float) -> dict[str, Any]:  # fmt: skip
    outs: list[Any] = [None] * len(ws)
    tiling = i4.INT4_DECODE_TILINGS.get((n, k)) or i4.default_tiling(n, k, GROUP)
    try:

        def call(i: int) -> None:
            outs[i] = i4.int4_gemv(x, ws[i][0], ws[i][1], None, GROUP, None, tiling)

        t = graph_time(call, len(ws), median_replay=True)
        gbs = int4_bytes(m, n, k) / t
        return {"us": t * 1e6, "of_copy": gbs / bandwidth, "rel_err": rel_err(outs[0], ref)}
    except Exception as exc:
        return {"error": err(exc)}


def probes(rows: list[dict[str, Any]], ws: list[Any], x: torch.Tensor, ref: torch.Tensor,
           n: int, k: int, bandwidth: float) -> dict[str, Any]:  # fmt: skip
    """Where the time goes: the best register-pipeline (mode 2), register-ring (mode 7) and
    bulk-copy (mode 4) tilings at M = 8 timed again as probes that stream the same weights
    without x or the products (modes 6, 8 and 5). A probe near copy bandwidth says the math
    holds the stream back. And modes 2 and 7 with one weight copy, L2-resident where it fits
    (50 MB on an H200): how much of the time is the weights' trip from HBM at all."""
    out: dict[str, Any] = {}
    for mode, probe in ((2, 6), (7, 8), (4, 5)):
        good = [r for r in rows if r.get("ok") and f"mode={mode})" in r["tiling"]]
        if not good:
            continue
        best = min(good, key=lambda r: r["us"])
        t = eval(best["tiling"], {"MmaTiling": MmaTiling})  # noqa: S307 (our own repr)
        row = time_mma(8, n, k, ws, x, ref, dataclasses.replace(t, mode=probe), bandwidth)
        row.pop("ok", None)
        row.pop("rel_err", None)
        out[f"mode{probe}"] = {"of": best["tiling"], "math_us": best["us"], **row}
        log(f"  {n}x{k} probe {probe} of {best['tiling']}: {row.get('us', float('nan')):.1f} us "
            f"{100 * row.get('of_copy', float('nan')):.0f}% (with the math {best['us']:.1f} us)")  # fmt: skip
        if probe in (6, 8):
            hot = time_mma(8, n, k, [ws[0]] * len(ws), x, ref, t, bandwidth)
            out[f"l2_hot_mode{mode}"] = {
                "of": best["tiling"],
                "math_us": best["us"],
                "us": hot.get("us"),
            }
            log(f"  {n}x{k} one weight copy (L2-resident where it fits): {hot.get('us', float('nan')):.1f} us")  # fmt: skip
    return out


def decode_shape(
    n: int, k: int, bandwidth: float, deadline: float, modes: list[int] | None = None
) -> dict[str, Any]:
    copies = max(2, triton.cdiv(L2_SET_BYTES, n * k // 2))
    ws = weights(n, k, copies)
    result: dict[str, Any] = {"copies": copies, "m8": [], "by_m": {}}
    refs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def case(m: int) -> tuple[torch.Tensor, torch.Tensor]:
        if m not in refs:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            w = reference.int4_dequantize(ws[0][0], ws[0][1], None, GROUP)
            refs[m] = (x, x.float() @ w.T)
        return refs[m]

    x, ref = case(8)
    for tiling in candidates(n, k, modes):
        if time.perf_counter() > deadline:
            result["m8"].append({"tiling": repr(tiling), "skipped": "budget"})
            continue
        row = time_mma(8, n, k, ws, x, ref, tiling, bandwidth)
        result["m8"].append(row)
        log(f"  {n}x{k} M=8 {row.get('tiling')}: {row.get('us', float('nan')):.1f} us "
            f"{100 * row.get('of_copy', float('nan')):.0f}% err {row.get('rel_err', row.get('error'))}")  # fmt: skip
    good = [r for r in result["m8"] if r.get("ok")]
    if not good:
        return result
    # the tuned tiling stays unless another beats it by KEEP_MARGIN: gate|up's mode 9 and 10 trade
    # places within 1 us from run to run here, while in the decode step mode 10 is 5 us faster
    tuned = repr(int4_mma.MMA_DECODE_TILINGS.get((n, k)))
    best_name = keep_or_replace({r["tiling"]: r["us"] for r in good}, tuned)
    best = next(r for r in good if r["tiling"] == best_name)
    result["best"] = best
    best_tiling = eval(best["tiling"], {"MmaTiling": MmaTiling})  # noqa: S307 (our own repr)
    result["by_m"][8] = {"mma": best, "triton": time_triton(8, n, k, ws, x, ref, bandwidth),
                         "fp8_w8_gemv": time_fp8_gemv(8, n, k, bandwidth)}  # fmt: skip
    for m in (1, 16, 32, 64):
        xm, refm = case(m)
        result["by_m"][m] = {"mma": time_mma(m, n, k, ws, xm, refm, best_tiling, bandwidth)}
    result["x8"] = x8_section(good, ws, case, n, k, bandwidth)
    result["probes"] = probes(result["m8"], ws, x, ref, n, k, bandwidth)
    ws.clear()
    torch.cuda.empty_cache()
    return result


# W4A8 prefill tilings timed beside the default (`int4_gemm.W4A8_TILING`, the first).
# (on one H200 the default won at every shape but one, by 1-5%: 2026-12-03-h200-64bbd63-int4_mma_w4a8.json)
W4A8_CANDIDATES = [i4.W4A8_TILING, i4.W4A8Tiling(64, 128, 128, 8, 4, 4)]


# 17-64-row W4A8 tilings (`int4_gemm.w4a8_wide`) timed beside the default for each shape.
W4A8_WIDE_CANDIDATES = [
    i4.W4A8WideTiling(64, 128, 1),
    i4.W4A8WideTiling(64, 128, 2),
    i4.W4A8WideTiling(128, 128, 1, 8),
    i4.W4A8WideTiling(32, 128, 2),
    i4.W4A8WideTiling(64, 256, 1, 4, 3),
]


def w4a8_wide_section() -> dict[str, Any]:
    """Per shape and M = 8, 16, 32, 64: today's triton int4 GEMV (the path at max_num_seqs > 8;
    at 8 rows the decode section's int4-mma GEMV is the one to beat),
    `w4a8_wide` at its default and candidate tilings, and FP8 `fp8_linear` (with the tuning
    file's 17-64-row tilings) on a weight of the same shape; CUDA-graph replays over weight
    copies larger than L2, each candidate's relative error against the exact product kept."""
    result: dict[str, Any] = {}
    for name, n, k in SHAPES:
        result[name] = _w4a8_wide_shape(n, k)
        torch.cuda.empty_cache()
    return result


def _w4a8_wide_shape(n: int, k: int) -> dict[str, Any]:
    from worker.kernels.triton.fp8_gemm import fp8_linear
    from worker.models.fp8 import quantize_weight

    copies = max(2, L2_SET_BYTES // int4_bytes(64, n, k))
    qs = [torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda") for _ in range(copies)]  # fmt: skip
    ss = [(torch.rand(n, k // GROUP, device="cuda") * 0.004 + 0.001).half() for _ in range(copies)]  # fmt: skip
    w8, w8s = quantize_weight(torch.randn(n, k, device="cuda") * 0.02)
    fp8_copies = max(2, L2_SET_BYTES // (n * k))
    w8c = [w8.clone() for _ in range(fp8_copies)]

    def int4(i: int, x: torch.Tensor) -> Any:
        return i4.int4_gemv(x, qs[i], ss[i], None, GROUP)

    def fp8(i: int, x: torch.Tensor) -> Any:
        return fp8_linear(x, w8c[i], w8s)

    def w4a8(i: int, x: torch.Tensor, t: Any) -> Any:
        return i4.w4a8_wide(x, qs[i], ss[i], GROUP, None, t)

    rows: dict[str, Any] = {}
    for m in (8, 16, 32, 64):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        exact = x.float() @ reference.int4_dequantize(qs[0], ss[0], None, GROUP).T
        row: dict[str, Any] = {
            "triton_int4_us": 1e6 * graph_time(_with_x(int4, x), copies),
            "fp8_us": 1e6 * graph_time(_with_x(fp8, x), fp8_copies),
            "w4a8": {},
        }
        for t in [None, *W4A8_WIDE_CANDIDATES]:
            label = str(t or i4.default_wide_tiling(n, k))
            try:
                got = w4a8(0, x, t)
                us = 1e6 * graph_time(_with_x(w4a8, x, t), copies)
                row["w4a8"][label] = {"us": us, "rel_err": rel_err(got, exact)}
            except Exception as exc:  # a tiling that does not fit is recorded, not fatal
                row["w4a8"][label] = {"error": err(exc)}
        rows[str(m)] = row
    return rows


def _with_x(fn: Any, x: torch.Tensor, *rest: Any) -> Any:
    """graph_time's fn(i) for fn(i, x, *rest): bound here, not in a loop's lambda."""
    return lambda i: fn(i, x, *rest)


def prefill_section() -> dict[str, Any]:
    result: dict[str, Any] = {}
    for name, n, k in SHAPES[:2]:
        q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda")
        s = (torch.rand(n, triton.cdiv(k, GROUP), device="cuda") * 0.004 + 0.001).half()
        mq, ms = reference.int4_mma_pack(q, s)
        same = torch.equal(
            int4_mma.dequantize(mq, ms, GROUP, torch.bfloat16),
            reference.int4_dequantize(q, s, None, GROUP).bfloat16(),
        )
        rows: dict[str, Any] = {"dequant_exact": same}

        def e4m3_path(x: torch.Tensor, mq: torch.Tensor = mq, ms: torch.Tensor = ms) -> Any:
            w8, channel = int4_mma.dequantize_e4m3(mq, ms, GROUP)
            return scaled_mm(x, w8, channel)

        def w4a8_path(x: torch.Tensor, t: Any, mq: torch.Tensor = mq, ms: torch.Tensor = ms) -> Any:
            a, a_scale = quantize_rows(x)
            codes = int4_mma.codes_e4m3(mq)
            return i4.w4a8_gemm(a, a_scale, codes, ms, GROUP, None, x.dtype, tiling=t)

        fp8_weight = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn)
        fp8_scale = torch.full((n,), 1e-2, device="cuda")

        for m in (512, 2048, 4096):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            mma_t = triton.testing.do_bench(
                lambda x=x, mq=mq, ms=ms: int4_mma.int4_mma_linear(x, mq, ms, GROUP)
            )
            tri_t = triton.testing.do_bench(
                lambda x=x, q=q, s=s: i4.int4_linear(x, q, s, None, GROUP)
            )
            e4m3_t = triton.testing.do_bench(lambda x=x: e4m3_path(x))
            exact = x.float() @ reference.int4_dequantize(q, s, None, GROUP).T
            rows[str(m)] = {
                "mma_us": mma_t * 1e3,
                "triton_us": tri_t * 1e3,
                # TOKENMILL_INT4_PREFILL=fp8 on the mma layout: e4m3 scratch + scaled_mm
                "mma_e4m3_us": e4m3_t * 1e3,
                "mma_e4m3_rel_err": rel_err(e4m3_path(x), exact),
                # an FP8 model's prefill GEMM of the shape (scaled_mm, x rounded per token)
                "fp8_scaled_mm_us": 1e3
                * triton.testing.do_bench(
                    lambda x=x, w=fp8_weight, sc=fp8_scale: scaled_mm(x, w, sc)
                ),
                # TOKENMILL_INT4_PREFILL=w4a8: codes + quantize_rows + w4a8_gemm, per tiling
                "w4a8": {},
            }
            # the default =w4a8 path: codes + quantize_blocks + cuBLAS's blockwise GEMM
            try:
                codes = int4_mma.codes_e4m3(mq)
                blockwise = i4.w4a8_linear(x, codes, ms, GROUP)
                rows[str(m)]["w4a8_blockwise"] = {
                    "refusal": i4.blockwise_refusal(x.device),
                    "rel_err": rel_err(blockwise, exact),
                    "us": 1e3
                    * triton.testing.do_bench(
                        lambda x=x, mq=mq, ms=ms: i4.w4a8_linear(
                            x, int4_mma.codes_e4m3(mq), ms, GROUP
                        )
                    ),
                    "gemm_us": 1e3
                    * triton.testing.do_bench(
                        lambda x=x, c=codes, ms=ms: i4.w4a8_linear(x, c, ms, GROUP)
                    ),
                }
            except Exception as exc:
                rows[str(m)]["w4a8_blockwise"] = {"error": err(exc)}
            for t in W4A8_CANDIDATES:
                try:
                    err_t = rel_err(w4a8_path(x, t), exact)
                    us = 1e3 * triton.testing.do_bench(lambda x=x, t=t: w4a8_path(x, t))
                    rows[str(m)]["w4a8"][str(t)] = {"us": us, "rel_err": err_t}
                except Exception as exc:  # a tiling that does not fit is recorded, not fatal
                    rows[str(m)]["w4a8"][str(t)] = {"error": err(exc)}
        result[name] = rows
        torch.cuda.empty_cache()
    return result


def fastest(candidates: dict[str, Any]) -> tuple[str | None, dict[str, Any]]:
    """The label and row of the fastest timed candidate (rows with an error have no "us")."""
    timed = {t: v for t, v in candidates.items() if "us" in v}
    best = min(timed, key=lambda t: timed[t]["us"], default=None)
    return best, timed.get(best, {}) if best else {}


def print_table(report: dict[str, Any]) -> None:
    print(f"\nbuild {report.get('build_s', float('nan')):.1f} s; copy {report.get('copy_gb_s', float('nan')):.0f} GB/s")  # fmt: skip
    print(
        f"{'shape':<28} {'M':>3} {'mma us':>7} {'%copy':>6} {'triton us':>9} {'fp8 us':>7}  tiling"
    )
    for name, row in report.get("decode", {}).items():
        for m, per_m in row.get("by_m", {}).items():
            r = per_m.get("mma", {})
            tri = per_m.get("triton", {}).get("us", float("nan"))
            f8 = per_m.get("fp8_w8_gemv", {})
            fp8 = min((v["us"] for v in f8.values() if isinstance(v, dict) and "us" in v), default=float("nan"))  # fmt: skip
            print(f"{name:<28} {m:>3} {r.get('us', float('nan')):>7.2f} "
                  f"{100 * r.get('of_copy', float('nan')):>5.1f}% {tri:>9.2f} {fp8:>7.2f}  {r.get('tiling', '-')}")  # fmt: skip
    for name, row in report.get("decode", {}).items():
        for probe, p in row.get("probes", {}).items():
            print(f"probe {name:<22} {probe}: {p.get('us', float('nan')):.2f} us "
                  f"({100 * p.get('of_copy', float('nan')):.1f}% of copy; with the math "
                  f"{p['math_us']:.2f} us) of {p['of']}")  # fmt: skip
    wide = report.get("w4a8_wide", {})
    if "error" in wide:
        print(f"w4a8_wide: {wide['error']}")
        wide = {}
    if wide:
        print(f"\n{'17-64 rows':<28} {'M':>3} {'int4 us':>8} {'w4a8 us':>8} {'err':>6} {'fp8 us':>7}  w4a8 tiling")  # fmt: skip
    for name, rows in wide.items():
        for m, r in rows.items():
            best, w = fastest(r["w4a8"])
            print(f"{name:<28} {m:>3} {r['triton_int4_us']:>8.1f} {w.get('us', float('nan')):>8.1f} "
                  f"{w.get('rel_err', float('nan')):>6.3f} {r['fp8_us']:>7.1f}  {best}")  # fmt: skip
    prefill = report.get("prefill", {})
    if "error" in prefill:
        print(f"prefill: {prefill['error']}")
        prefill = {}
    if prefill:
        print(f"\n{'prefill':<14} {'M':>5} {'bf16 us':>8} {'e4m3 us':>8} {'err':>6} {'w4a8 us':>8} "
              f"{'err':>6} {'blockw us':>9} {'gemm us':>8} {'err':>6} {'fp8 us':>7}  w4a8 tiling")  # fmt: skip
    for name, rows in prefill.items():
        for m, r in rows.items():
            if not isinstance(r, dict):
                continue
            best, w = fastest(r.get("w4a8", {}))
            b = r.get("w4a8_blockwise", {})
            nan = float("nan")
            print(f"{name[:14]:<14} {m:>5} {r['mma_us']:>8.1f} {r['mma_e4m3_us']:>8.1f} "
                  f"{r['mma_e4m3_rel_err']:>6.3f} {w.get('us', nan):>8.1f} "
                  f"{w.get('rel_err', nan):>6.3f} {b.get('us', nan):>9.1f} {b.get('gemm_us', nan):>8.1f} "
                  f"{b.get('rel_err', nan):>6.3f} {r['fp8_scaled_mm_us']:>7.1f}  {best}"
                  + (f"  blockwise: {b['error']}" if "error" in b else "")
                  + (f"  blockwise refused ({b['refusal']}): the Triton GEMM ran" if b.get("refusal") else ""))  # fmt: skip
    print("\n# MMA_DECODE_TILINGS (worker/kernels/cuda/int4_mma.py)")
    for line in report.get("paste", []):
        print(line)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--budget-s", type=float, default=240.0)
    parser.add_argument(
        "--write-tuning",
        action="store_true",
        help="store the winners as int4_mma_decode_tilings in the package's tuning file",
    )
    parser.add_argument(
        "--modes",
        default=None,
        help="only these kernel modes, timed in this order, e.g. 4,5,2 (default: all)",
    )
    parser.add_argument("--prefill-only", action="store_true", help="the prefill section alone")
    parser.add_argument(
        "--w4a8-wide",
        action="store_true",
        help="only the 17-64-row W4A8 section (and the prefill one unless --no-prefill)",
    )
    parser.add_argument("--no-prefill", action="store_true")
    parser.add_argument(
        "--tuned-only",
        action="store_true",
        help="time only the tuning file's tiling of each shape (and its probes), no sweep",
    )
    args = parser.parse_args(argv)
    modes = [int(m) for m in args.modes.split(",")] if args.modes else None
    if args.tuned_only:
        modes = []  # candidates() then keeps the tuned tiling alone
    out = out_path("int4_mma", args.out)
    start = time.perf_counter()
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    from worker.kernels import tuning

    report["tuning_applied"] = repr(tuning.apply(torch.device("cuda")))  # today's tilings
    began = time.perf_counter()
    int4_mma._library(torch.device("cuda"))
    report["build_s"] = time.perf_counter() - began
    start = time.perf_counter()  # the budget is for measuring, not for the build
    report["copy_gb_s"] = copy_bandwidth() / 1e9
    bandwidth = report["copy_gb_s"] * 1e9
    report["decode"] = {}
    report["paste"] = []
    for index, (name, n, k) in enumerate([] if args.prefill_only or args.w4a8_wide else SHAPES):
        left = args.budget_s - 40 - (time.perf_counter() - start)
        deadline = time.perf_counter() + left / (len(SHAPES) - index)
        try:
            report["decode"][name] = row = decode_shape(n, k, bandwidth, deadline, modes)
            if "best" in row:
                report["paste"].append(f"    ({n}, {k}): {row['best']['tiling']},  # {name}: "
                                       f"{row['best']['us']:.1f} us, {100 * row['best']['of_copy']:.0f}%")  # fmt: skip
        except Exception as exc:
            traceback.print_exc()
            report["decode"][name] = {"error": err(exc)}
        write_result(out, report)
    winners = {f"{n}x{k}": dataclasses.asdict(eval(report["decode"][name]["best"]["tiling"], {"MmaTiling": MmaTiling}))  # noqa: S307
               for name, n, k in SHAPES if "best" in report["decode"].get(name, {})}  # fmt: skip
    report["int4_mma_decode_tilings"] = winners
    x8_winners = {f"{n}x{k}": dataclasses.asdict(eval(report["decode"][name]["x8"]["best"]["tiling"], {"MmaTiling": MmaTiling}))  # noqa: S307
                  for name, n, k in SHAPES if "best" in report["decode"].get(name, {}).get("x8", {})}  # fmt: skip
    report["int4_mma_x8_tilings"] = x8_winners
    if args.write_tuning and winners:
        from worker.kernels import tuning

        path = tuning.path_for(torch.cuda.get_device_name())
        data = tuning.read(path) if path.exists() else tuning.snapshot(torch.cuda.get_device_name())
        data["int4_mma_decode_tilings"] = winners
        if x8_winners:
            data["int4_mma_x8_tilings"] = x8_winners
        tuning.write(path, data)
        report["tuning_file"] = str(path)
    if args.w4a8_wide:
        try:
            report["w4a8_wide"] = w4a8_wide_section()
        except Exception as exc:
            report["w4a8_wide"] = {"error": err(exc)}
        write_result(out, report)
    if not args.no_prefill:
        try:
            report["prefill"] = prefill_section()
        except Exception as exc:
            report["prefill"] = {"error": err(exc)}
    write_result(out, report)
    print_table(report)
    return report


if __name__ == "__main__":
    main()
