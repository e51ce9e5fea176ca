"""The int4 weight kernels on one GPU at the Qwen3.6-27B shapes (group 128, symmetric).

    python -m bench.kernels.int4 --out results.json          # on a CUDA machine, < 4 minutes

Sections (each guarded: a failing variant or section is recorded and the rest run on; the JSON
is rewritten after every section, so a killed run keeps what it measured):
1. copy: device-to-device copy bandwidth, the roofline every GB/s is compared with.
2. decode: per weight shape, candidate `Int4Tiling`s of `int4_gemv` (code conversion and x
   layout variants, tile shapes, K splits, stream-K) at M = 8, each checked against
   `reference.int4_linear` and timed as CUDA-graph replays over weight copies larger than L2
   (median of 10 replays); the best few again at M = 1 and 16, the best at M = 32 and 64
   (against the dequantize + GEMM path there); FP8 `w8_gemv` at the same shape and M.
3. silu_mul: the fused gate|up + silu*mul GEMV against `int4_gemv` then silu_mul.
4. prefill: dequantize + cuBLAS bf16, dequantize to e4m3 + scaled_mm, against FP8 scaled_mm on
   an fp8 weight, at M = 512, 2048, 8192 (`triton.testing.do_bench`, median).
The table and the winners as `INT4_DECODE_TILINGS` / `INT4_SILU_MUL_TILINGS` entries (paste into
worker/kernels/triton/int4_gemm.py) are printed at the end and stored under "paste".
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import triton
import triton.testing

from bench.common import copy_bandwidth, err, graph_time, rel_err, result_path, write_result
from worker.kernels import reference
from worker.kernels.triton import fp8_gemm
from worker.kernels.triton import int4_gemm as i4
from worker.kernels.triton.activations import silu_mul
from worker.kernels.triton.int4_gemm import Int4Tiling

GROUP = 128
L2_SET_BYTES = 192 << 20  # weight copies per graph: several times the 50 MB L2
# (name, N, K): the decode GEMMs of Qwen3.6-27B, sibling projections fused
SHAPES = [
    ("mlp gate|up", 34816, 5120),
    ("mlp down", 5120, 17408),
    ("deltanet qkv|z", 16384, 5120),
    ("attention q|gate,k,v", 14336, 5120),
    ("deltanet out / attention o", 5120, 6144),
]
# H200 FP8 winners (bench/results/2026-11-29-h200-2a49ccd-gpu_suite.json), the comparison row
FP8_TILINGS = {
    (34816, 5120): fp8_gemm.DecodeTiling(64, 256, 1, 2, 2),
    (5120, 17408): fp8_gemm.DecodeTiling(64, 256, 3, 4, 4, two_pass=True),
    (16384, 5120): fp8_gemm.DecodeTiling(32, 256, 1, 2, 4),
    (14336, 5120): fp8_gemm.DecodeTiling(32, 256, 1, 2, 4),
    (5120, 6144): fp8_gemm.DecodeTiling(64, 256, 3, 4, 4, two_pass=True),
}


class Budget:
    def __init__(self, seconds: float) -> None:
        self.end = time.perf_counter() + seconds

    def left(self) -> float:
        return self.end - time.perf_counter()


def log(*args: Any) -> None:
    print(*args, file=sys.stderr, flush=True)


def int4_weights(n: int, k: int, copies: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Random codes and group scales (every code and magnitude pattern is equally fast)."""
    g = triton.cdiv(k, GROUP)
    return [
        (
            torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda"),
            (torch.rand(n, g, device="cuda") * 0.004 + 0.001).half(),
        )
        for _ in range(copies)
    ]


def int4_bytes(m: int, n: int, k: int) -> int:
    """What the GEMV must move: the packed weight, its scales, x and out."""
    return n * k // 2 + n * triton.cdiv(k, GROUP) * 2 + 2 * m * k + 2 * m * n


def entry_repr(tiling: Int4Tiling) -> str:
    fields = Int4Tiling()
    args = [f"{tiling.bn}", f"{tiling.bk}", f"{tiling.splits}"]
    args += [f"{tiling.num_warps}", f"{tiling.num_stages}"]
    for name in ("stream_k", "x_mode", "fast_cvt"):
        if getattr(tiling, name) != getattr(fields, name):
            args.append(f"{name}={getattr(tiling, name)!r}")
    return f"Int4Tiling({', '.join(args)})"


def split_for(n: int, k: int, bn: int, bk: int, programs: int) -> int:
    tiles, steps = triton.cdiv(n, bn), triton.cdiv(k, bk)
    return max(1, min(triton.cdiv(programs, tiles), max(1, steps // 4)))


def candidates(n: int, k: int) -> list[Int4Tiling]:
    """Mode variants on one tile shape first: the nibbles against x's even/odd columns (x_mode
    1) or re-interleaved (2), codes by the exponent trick in PTX (fast_cvt 2) or triton ops
    (1), on mma.sync (2 warps) or wgmma (4); the strided-x and plain-convert forms once each.
    `refine` then sweeps tiles, splits and stream-K in this shape's fastest mode."""
    cands = [i4.default_tiling(n, k, GROUP)]
    split = split_for(n, k, 64, 128, 4 * 132)
    for x_mode in (1, 2):
        for fast in (2, 1):
            for warps in (2, 4):
                cands.append(Int4Tiling(64, 128, split, warps, 3, x_mode=x_mode, fast_cvt=fast))
    cands.append(Int4Tiling(64, 128, split, 2, 3, x_mode=0, fast_cvt=2))
    cands.append(Int4Tiling(64, 128, split, 2, 3, x_mode=1, fast_cvt=0))
    return list(dict.fromkeys(cands))


def refine(n: int, k: int, x_mode: int, fast: int, warps: int) -> list[Int4Tiling]:
    cands = []
    shapes = [(32, 128, 1, 4), (32, 128, 2, 4), (64, 128, 2, 4), (64, 128, 2, 2)]
    shapes += [(64, 256, 2, 3), (128, 128, 2, 3), (128, 128, 4, 3), (64, 128, 4, 4)]
    shapes += [(32, 256, 1, 3), (64, 128, warps, 5)]
    for bn, bk, w, stages in shapes:
        for programs in (4 * 132, 8 * 132):
            split = split_for(n, k, bn, bk, programs)
            cands.append(Int4Tiling(bn, bk, split, w, stages, x_mode=x_mode, fast_cvt=fast))
    for bn, bk, w, stages, occupancy in (
        (64, 128, warps, 3, 4), (64, 128, warps, 3, 8), (32, 128, 1, 4, 8), (64, 128, 2, 4, 6),
    ):  # fmt: skip
        cands.append(Int4Tiling(bn, bk, 1, w, stages, occupancy, x_mode=x_mode, fast_cvt=fast))
    return list(dict.fromkeys(cands))


def time_int4(
    m: int,
    n: int,
    k: int,
    weights: list[tuple[torch.Tensor, torch.Tensor]],
    x: torch.Tensor,
    ref: torch.Tensor,
    tiling: Int4Tiling,
    bandwidth: float,
) -> dict[str, Any]:
    outs: list[Any] = [None] * len(weights)
    row: dict[str, Any] = {"tiling": entry_repr(tiling)}
    try:

        def call(i: int) -> None:
            outs[i] = i4.int4_gemv(x, weights[i][0], weights[i][1], None, GROUP, None, tiling)

        t = graph_time(call, len(weights), median_replay=True)
        e = rel_err(outs[-1], ref)
        gbs = int4_bytes(m, n, k) / t
        row.update({"us": t * 1e6, "gb_s": gbs / 1e9, "of_copy": gbs / bandwidth, "rel_err": e})
        row["ok"] = e < 1e-2
    except Exception as exc:
        row["error"] = err(exc)
    return row


def decode_shape(
    name: str, n: int, k: int, bandwidth: float, budget: Budget, share: float
) -> dict[str, Any]:
    deadline = time.perf_counter() + share
    copies = max(2, triton.cdiv(L2_SET_BYTES, n * k // 2))
    weights = int4_weights(n, k, copies)
    result: dict[str, Any] = {"n": n, "k": k, "copies": copies, "by_m": {}}
    xs = {m: torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for m in (1, 8, 16, 32, 64)}
    refs = {
        m: reference.int4_linear(xs[m], weights[-1][0], weights[-1][1], None, GROUP) for m in xs
    }
    floor_us = int4_bytes(8, n, k) / bandwidth * 1e6
    result["floor_us_m8"] = floor_us
    rows: list[dict[str, Any]] = []
    tried: set[Int4Tiling] = set()

    def run(tilings: list[Int4Tiling]) -> None:
        for tiling in tilings:
            if tiling in tried:
                continue
            if time.perf_counter() > deadline or budget.left() < 60:
                rows.append({"tiling": entry_repr(tiling), "skipped": "budget"})
                continue
            tried.add(tiling)
            row = time_int4(8, n, k, weights, xs[8], refs[8], tiling, bandwidth)
            row["_tiling"] = tiling
            rows.append(row)
            log(f"  {name} M=8 {row['tiling']}: {row.get('us', row.get('error'))}")

    def ranked() -> list[dict[str, Any]]:
        return sorted((r for r in rows if r.get("ok")), key=lambda r: r["us"])

    run(candidates(n, k))
    best = ranked()
    if best:
        mode = best[0]["_tiling"]
        run(refine(n, k, mode.x_mode, mode.fast_cvt, mode.num_warps))
    best = ranked()
    result["candidates_m8"] = [{k2: v for k2, v in r.items() if k2 != "_tiling"} for r in rows]
    if not best:
        result["error"] = "no correct candidate"
        return result
    winner: Int4Tiling = best[0]["_tiling"]
    result["best"] = {"tiling": entry_repr(winner), "us_m8": best[0]["us"]}
    top = [r["_tiling"] for r in best[:3]]
    # the other decode batch sizes: the top 3 at M = 1 and 16, the winner at 32 and 64
    for m in (1, 8, 16, 32, 64):
        per_m: dict[str, Any] = {}
        if m == 8:
            per_m["int4"] = {k2: v for k2, v in best[0].items() if k2 != "_tiling"}
        elif budget.left() > 45:
            timed = [
                time_int4(m, n, k, weights, xs[m], refs[m], t, bandwidth)
                for t in (top if m in (1, 16) else top[:1])
            ]
            good = [r for r in timed if r.get("ok")]
            per_m["int4_tried"] = timed
            if good:
                per_m["int4"] = min(good, key=lambda r: r["us"])
        if m >= 32 and budget.left() > 40:
            per_m["dequant_gemm"] = time_dequant_gemm(xs[m], weights, n, k)
        if m <= 16 and budget.left() > 40:
            per_m["fp8_w8_gemv"] = time_fp8_gemv(m, n, k, bandwidth)
        result["by_m"][m] = per_m
    weights.clear()
    torch.cuda.empty_cache()
    return result


def time_dequant_gemm(
    x: torch.Tensor, weights: list[tuple[torch.Tensor, torch.Tensor]], n: int, k: int
) -> dict[str, Any]:
    """The prefill path (scratch dequantize + cuBLAS) at a decode-sized M: graph replays."""
    outs: list[Any] = [None] * len(weights)
    try:

        def call(i: int) -> None:
            outs[i] = i4.int4_dequant_linear(x, weights[i][0], weights[i][1], None, GROUP, None)

        t = graph_time(call, len(weights), median_replay=True)
        ref = reference.int4_linear(x, weights[-1][0], weights[-1][1], None, GROUP)
        return {"us": t * 1e6, "rel_err": rel_err(outs[-1], ref)}
    except Exception as exc:
        return {"error": err(exc)}


def fp8_weights(n: int, k: int, copies: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [
        (
            (torch.randn(n, k, device="cuda") * 100).clamp(-448, 448).to(torch.float8_e4m3fn),
            torch.rand(n, device="cuda") * 1e-4 + 1e-5,
        )
        for _ in range(copies)
    ]


def time_fp8_gemv(m: int, n: int, k: int, bandwidth: float) -> dict[str, Any]:
    """FP8 w8_gemv at its H200 winner tiling (and its default), as the engine runs it."""
    copies = max(2, triton.cdiv(L2_SET_BYTES, n * k))
    result: dict[str, Any] = {}
    try:
        weights = fp8_weights(n, k, copies)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        outs: list[Any] = [None] * copies
        for label, tiling in (
            ("run15", FP8_TILINGS.get((n, k))),
            ("default", fp8_gemm.default_tiling(n, k)),
        ):
            if tiling is None:
                continue
            try:

                def call(i: int, tiling: Any = tiling) -> None:
                    outs[i] = fp8_gemm.w8_gemv(x, weights[i][0], weights[i][1], None, tiling)

                t = graph_time(call, copies, median_replay=True)
                gbs = (n * k + 2 * m * k + 2 * m * n) / t
                result[label] = {"us": t * 1e6, "gb_s": gbs / 1e9, "of_copy": gbs / bandwidth}
            except Exception as exc:
                result[label] = {"error": err(exc)}
        weights.clear()
    except Exception as exc:
        result["error"] = err(exc)
    return result


def silu_mul_section(bandwidth: float, budget: Budget, best: Int4Tiling | None) -> dict[str, Any]:
    n, k = SHAPES[0][1], SHAPES[0][2]
    f = n // 2
    copies = max(2, triton.cdiv(L2_SET_BYTES, n * k // 2))
    weights = int4_weights(n, k, copies)
    result: dict[str, Any] = {"n": n, "k": k, "by_m": {}}
    base = best or i4.default_tiling(n, k, GROUP)
    tilings = [i4.default_silu_mul_tiling(n, k, GROUP)]
    for bn in (16, 32, 64):
        for programs in (1 * 132, 4 * 132, 8 * 132):
            split = split_for(f, k, bn, base.bk, programs)
            tilings.append(
                Int4Tiling(
                    bn,
                    base.bk,
                    split,
                    base.num_warps,
                    base.num_stages,
                    x_mode=base.x_mode,
                    fast_cvt=base.fast_cvt,
                )  # fmt: skip
            )
    tilings = list(dict.fromkeys(tilings))
    for m in (8, 1, 16):  # the sweep at M = 8, its winner at the others
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ref = reference.int4_linear_silu_mul(x, weights[-1][0], weights[-1][1], None, GROUP)
        outs: list[Any] = [None] * copies
        per_m: dict[str, Any] = {}
        try:

            def two(i: int, x: torch.Tensor = x, outs: list[Any] = outs) -> None:
                gate_up = i4.int4_gemv(x, weights[i][0], weights[i][1], None, GROUP, None, best)
                outs[i] = silu_mul(gate_up)

            t = graph_time(two, copies, median_replay=True)
            per_m["unfused"] = {"us": t * 1e6, "rel_err": rel_err(outs[-1], ref)}
        except Exception as exc:
            per_m["unfused"] = {"error": err(exc)}
        fused = []
        chosen = (
            tilings
            if m == 8
            else list(dict.fromkeys([tilings[0], result.get("_best") or tilings[0]]))
        )
        for tiling in chosen:
            if budget.left() < 30:
                break
            row: dict[str, Any] = {"tiling": entry_repr(tiling)}
            try:

                def one(
                    i: int, tiling: Int4Tiling = tiling, x: torch.Tensor = x, outs: list[Any] = outs
                ) -> None:
                    outs[i] = i4.int4_gemv_silu_mul(
                        x, weights[i][0], weights[i][1], None, GROUP, None, tiling
                    )

                t = graph_time(one, copies, median_replay=True)
                e = rel_err(outs[-1], ref)
                gbs = int4_bytes(m, n, k) / t
                row.update({"us": t * 1e6, "of_copy": gbs / bandwidth, "rel_err": e})
                if e < 1e-2:
                    fused.append((t, tiling))
            except Exception as exc:
                row["error"] = err(exc)
            per_m.setdefault("fused", []).append(row)
            log(f"  silu_mul M={m} {row['tiling']}: {row.get('us', row.get('error'))}")
        if fused:
            t, tiling = min(fused, key=lambda c: c[0])
            per_m["best_fused"] = {"tiling": entry_repr(tiling), "us": t * 1e6}
            if m == 8:
                result["_best"] = tiling
                result["best"] = entry_repr(tiling)
        result["by_m"][m] = per_m
    result.pop("_best", None)
    weights.clear()
    torch.cuda.empty_cache()
    return result


def prefill_case(
    q: torch.Tensor, s: torch.Tensor, w8: torch.Tensor, s8: torch.Tensor, m: int
) -> dict[str, Any]:
    n, k = q.shape[0], 2 * q.shape[1]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w16 = reference.int4_dequantize(q, s, None, GROUP).bfloat16()
    ref = torch.nn.functional.linear(x, w16).float()
    scratch = i4.dequant_scratch(q.device, n, k, x.dtype)
    variants: dict[str, Callable[[], Any]] = {
        "dequant_bf16_only": lambda: i4.int4_dequantize(q, s, None, GROUP, x.dtype, scratch),
        "int4_dequant_bf16_cublas": lambda: i4.int4_dequant_linear(x, q, s, None, GROUP, fp8=False),
        "int4_dequant_fp8_scaled_mm": lambda: i4.int4_dequant_linear(
            x, q, s, None, GROUP, fp8=True
        ),
        "fp8_scaled_mm": lambda: fp8_gemm.scaled_mm(x, w8, s8),
        "bf16_cublas_same_weight": lambda: torch.nn.functional.linear(x, w16),
    }
    row: dict[str, Any] = {}
    for label, fn in variants.items():
        try:
            ms = float(triton.testing.do_bench(fn, warmup=3, rep=25, return_mode="median"))
            entry: dict[str, Any] = {"us": ms * 1e3}
            if label.startswith("int4_dequant"):
                entry["rel_err"] = rel_err(fn(), ref)
            if label != "dequant_bf16_only":
                entry["tflops"] = 2 * m * n * k / (ms * 1e-3) / 1e12
            row[label] = entry
        except Exception as exc:
            row[label] = {"error": err(exc)}
    return row


def prefill_section(budget: Budget) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for name, n, k in SHAPES:
        q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda")
        s = (torch.rand(n, triton.cdiv(k, GROUP), device="cuda") * 0.004 + 0.001).half()
        w8, s8 = fp8_weights(n, k, 1)[0]
        per_shape: dict[int, Any] = {}
        for m in (512, 2048, 8192):
            if budget.left() < 15:
                per_shape[m] = {"skipped": "budget"}
                continue
            try:
                row = prefill_case(q, s, w8, s8, m)
            except Exception as exc:
                row = {"error": err(exc)}
            per_shape[m] = row
            log(f"  prefill {name} M={m}: " + ", ".join(
                f"{lbl} {v.get('us', float('nan')):.0f}" for lbl, v in row.items()
                if isinstance(v, dict)
            ))  # fmt: skip
            torch.cuda.empty_cache()
        result[name] = per_shape
    return result


def print_table(report: dict[str, Any]) -> None:
    bw = report.get("copy_gb_s", float("nan"))
    print(f"\ncopy bandwidth {bw:.0f} GB/s ({report.get('device')})")
    print(f"{'shape':<28} {'M':>3} {'int4 us':>8} {'GB/s':>6} {'%copy':>6} {'fp8 us':>7}  tiling")
    for name, row in report.get("decode", {}).items():
        for m, per_m in row.get("by_m", {}).items():
            r4 = per_m.get("int4", {})
            f8 = per_m.get("fp8_w8_gemv", {})
            fp8_us = min(
                (v["us"] for v in f8.values() if isinstance(v, dict) and "us" in v),
                default=float("nan"),
            )
            extra = ""
            if "dequant_gemm" in per_m:
                extra = f"  dequant+gemm {per_m['dequant_gemm'].get('us', float('nan')):.1f} us"
            print(
                f"{name:<28} {m:>3} {r4.get('us', float('nan')):>8.2f} "
                f"{r4.get('gb_s', float('nan')):>6.0f} {100 * r4.get('of_copy', float('nan')):>5.1f}% "
                f"{fp8_us:>7.2f}  {r4.get('tiling', '-')}{extra}"
            )
    silu = report.get("silu_mul", {})
    for m, per_m in silu.get("by_m", {}).items():
        print(
            f"gate|up silu_mul M={m}: fused {per_m.get('best_fused', {}).get('us', float('nan')):.2f} us"
            f" ({per_m.get('best_fused', {}).get('tiling', '-')}),"
            f" unfused {per_m.get('unfused', {}).get('us', float('nan')):.2f} us"
        )
    for name, per_shape in report.get("prefill", {}).items():
        for m, row in per_shape.items():
            cells = ", ".join(
                f"{lbl} {v['us']:.0f}"
                for lbl, v in row.items()
                if isinstance(v, dict) and "us" in v
            )
            print(f"prefill {name} M={m} (us): {cells}")
    print("\n# paste into worker/kernels/triton/int4_gemm.py")
    for line in report.get("paste", []):
        print(line)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--out", default=None, help="JSON path (default $OUT/<date>-<gpu>-<sha>-int4_kernels.json)"
    )
    parser.add_argument("--budget-s", type=float, default=225.0)
    parser.add_argument("--shapes", default="", help="comma-separated shape names (default all)")
    args = parser.parse_args(argv)
    out = Path(args.out) if args.out else result_path("int4_kernels")
    budget = Budget(args.budget_s)
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "group_size": GROUP,
    }

    def write() -> None:
        write_result(out, report)

    def section(name: str, fn: Callable[[], Any]) -> Any:
        log(f"== {name} ({budget.left():.0f} s left)")
        began = time.perf_counter()
        try:
            value = fn()
        except Exception as exc:
            traceback.print_exc()
            value = {"error": err(exc)}
        report.setdefault("section_s", {})[name] = time.perf_counter() - began
        report[name] = value
        write()
        return value

    bandwidth = section("copy_gb_s", lambda: copy_bandwidth() / 1e9) * 1e9
    if not math.isfinite(bandwidth) or bandwidth <= 0:
        bandwidth = 4.27e12
    shapes = [s for s in SHAPES if not args.shapes or s[0] in args.shapes.split(",")]
    decode: dict[str, Any] = {}
    report["decode"] = decode
    for index, (name, n, k) in enumerate(shapes):
        share = (budget.left() - 90) / (len(shapes) - index)  # leave time for silu + prefill
        decode[name] = section_value = {}
        try:
            section_value.update(decode_shape(name, n, k, bandwidth, budget, share))
        except Exception as exc:
            traceback.print_exc()
            section_value["error"] = err(exc)
        write()
    gate_up_best = None
    for name, n, k in shapes:
        best = decode.get(name, {}).get("best")
        if best and (n, k) == (SHAPES[0][1], SHAPES[0][2]):
            gate_up_best = eval(best["tiling"], {"Int4Tiling": Int4Tiling})  # noqa: S307
    section("silu_mul", lambda: silu_mul_section(bandwidth, budget, gate_up_best))
    section("prefill", lambda: prefill_section(budget))
    paste = []
    for name, n, k in shapes:
        best = decode.get(name, {}).get("best")
        if best:
            pct = 100 * int4_bytes(8, n, k) / (best["us_m8"] * 1e-6) / bandwidth
            paste.append(
                f"    ({n}, {k}): {best['tiling']},  # {name}: {best['us_m8']:.1f} us at M=8, "
                f"{pct:.0f}% of copy"
            )
    silu = report.get("silu_mul", {})
    if isinstance(silu, dict) and silu.get("best"):
        n, k = SHAPES[0][1], SHAPES[0][2]
        paste.append(f"    # INT4_SILU_MUL_TILINGS: ({n}, {k}): {silu['best']},")
    report["paste"] = paste
    report["total_s"] = args.budget_s - budget.left()
    write()
    print_table(report)
    return report


if __name__ == "__main__":
    main()
