"""The w4_gemv section: the int4 decode GEMV sweep of bench/kernels/int4.py at the 27B shapes,
its winners stored for the w4 engine section."""

from __future__ import annotations

import argparse
from typing import Any

from bench.common import result_path


def w4_gemv(args: argparse.Namespace, budget: float) -> dict[str, Any]:
    """The int4 decode GEMV sweep at the 27B shapes (bench/kernels/int4.py, its own JSON beside
    this one): checks each tiling against the reference, times it (% of its own copy-bandwidth
    reading) and stores the winners in INT4_DECODE_TILINGS for the w4 engine section."""
    from bench.kernels import int4 as int4_kernels
    from worker.kernels.triton import int4_gemm

    out = result_path("int4_kernels", args.out)
    report = int4_kernels.main(["--budget-s", str(budget), "--out", str(out)])
    for name, n, k in int4_kernels.SHAPES:  # the winners, for the w4 engine section
        best = report.get("decode", {}).get(name, {}).get("best")
        if best:
            tiling = eval(best["tiling"], {"Int4Tiling": int4_gemm.Int4Tiling})  # noqa: S307
            int4_gemm.INT4_DECODE_TILINGS[(n, k)] = tiling
    return {"json": str(out), "paste": report.get("paste"), "copy_gb_s": report.get("copy_gb_s")}
