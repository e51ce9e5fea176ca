"""How the int4-mma decode GEMV's time scales with the number of CTA waves and with each CTA's
K, at M = 8: separates a fixed cost per CTA (prologue: scales and the ring's first loads;
epilogue: the warps' reduction and the write) from the cost per chunk.

    python -m bench.kernels.int4_mma_scaling [--out DIR]

t(waves, K) ~ waves x (fixed + chunks a warp x per chunk): one wave at K, 2K, 4K fits the two
terms; 1-4 waves at one K checks the waves' sum. Weight copies exceed L2, as in
bench/kernels/int4_mma.py. Prints a table and writes <date>-<gpu>-<sha>-int4_mma_scaling.json.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from bench.common import copy_bandwidth, graph_time, out_path, write_result
from bench.kernels.int4 import GROUP, int4_bytes
from bench.kernels.int4_mma import weights
from worker.kernels.cuda import int4_mma
from worker.kernels.cuda.int4_mma import MmaTiling

# the tuned gate|up tilings: 2 row tiles and 8 warps a CTA (2 CTAs an SM), and 4 warps (4)
TILINGS = (MmaTiling(2, 8, 1, 3, 9), MmaTiling(2, 4, 1, 3, 9))


def fit(ks: list[int], us: list[float]) -> tuple[float, float]:
    """Least squares us = fixed + per_k * K."""
    n = len(ks)
    mk, mu = sum(ks) / n, sum(us) / n
    per_k = sum((k - mk) * (u - mu) for k, u in zip(ks, us, strict=True)) / sum(
        (k - mk) ** 2 for k in ks
    )
    return mu - per_k * mk, per_k


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    out = out_path("int4_mma_scaling", args.out)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bandwidth = copy_bandwidth()
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(), "copy_gb_s": bandwidth / 1e9}
    rows = []
    for tiling in TILINGS:
        slots = sms * (2 if tiling.warps == 8 else 4)  # CTAs resident at 128 registers
        one_wave = slots * 16 * tiling.rows
        shapes = [(w * one_wave, 5120) for w in (1, 2, 4)] + [(34816, 5120)]
        shapes += [(one_wave, k) for k in (2560, 10240, 20480)]
        for n, k in shapes:
            copies = max(2, -(-160_000_000 // (n * k // 2)))
            ws = weights(n, k, copies)
            x = torch.randn(8, k, device="cuda", dtype=torch.bfloat16)

            def call(i: int, ws: Any = ws, x: torch.Tensor = x, tiling: MmaTiling = tiling) -> None:
                int4_mma.gemv(x, ws[i][2], ws[i][3], GROUP, tiling)

            t = graph_time(call, copies, median_replay=True)
            waves = n / one_wave
            row = {
                "tiling": repr(tiling),
                "n": n,
                "k": k,
                "waves": waves,
                "us": t * 1e6,
                "us_per_wave": t * 1e6 / waves,
                "of_copy": int4_bytes(8, n, k) / t / bandwidth,
            }
            rows.append(row)
            print(
                f"{tiling.warps} warps  N {n:6d}  K {k:6d}  waves {waves:5.2f}  {row['us']:7.2f} us"
                f"  {row['us_per_wave']:6.2f} us/wave  {100 * row['of_copy']:5.1f}% of copy",
                flush=True,
            )
            del ws
        one = [r for r in rows if r["tiling"] == repr(tiling) and r["n"] == one_wave]
        fixed, per_k = fit([r["k"] for r in one], [r["us"] for r in one])
        report.setdefault("fit", {})[repr(tiling)] = {"fixed_us": fixed, "us_per_1k_k": per_k * 1e3}
        print(f"{tiling}: one wave = {fixed:.2f} us fixed + {per_k * 1e3:.2f} us per 1,024 of K")
    report["rows"] = rows
    write_result(out, report)
    return report


if __name__ == "__main__":
    main()
