"""Run the int4 decode GEMVs (int4-mma in both pipelines, triton's) and the FP8 GEMV at two
Qwen3.6-27B shapes, batch 8, for Nsight Compute to profile.

    ncu --clock-control none -k regex:"w4_gemv|int4_gemv|w8_gemv" --section SpeedOfLight \
        --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
        --section SchedulerStats --section SourceCounters \
        --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio \
        --log-file ncu.txt python -m bench.kernels.int4_ncu_probe

Each kernel runs twice (compile/warm, then the same again), so both launches are comparable.
"""

from __future__ import annotations

import argparse

import torch

from worker.kernels import reference
from worker.kernels.cuda import int4_mma
from worker.kernels.cuda.int4_mma import MmaTiling
from worker.kernels.triton import int4_gemm as i4
from worker.kernels.triton.fp8_gemm import default_tiling, w8_gemv
from worker.models.fp8 import quantize_weight
from worker.models.int4 import quantize_rtn

SHAPES = {"gate|up": (34816, 5120), "deltanet qkv|z": (16384, 5120)}
# on one grid (4 row tiles, 8 warps): mode 2's register pipeline, the register ring (7) and the
# cp.async ring (1): where each warp's time goes, by stall reason
MMA = {
    "gate|up": [MmaTiling(4, 8, 1, 2, 2), MmaTiling(4, 8, 1, 2, 7), MmaTiling(4, 8, 1, 4, 1)],
    "deltanet qkv|z": [
        MmaTiling(4, 8, 1, 2, 2),
        MmaTiling(4, 8, 1, 2, 7),
        MmaTiling(4, 8, 1, 4, 1),
    ],
}


def main() -> None:
    argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    ).parse_args()
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        x = torch.randn(8, k, device="cuda", dtype=torch.bfloat16)
        q = quantize_rtn(w, 128, True)
        mq, ms = reference.int4_mma_pack(q.qweight, q.scales)
        for tiling in MMA[name]:
            for _ in range(2):
                int4_mma.gemv(x, mq, ms, 128, tiling)
            print(name, tiling, flush=True)
        for _ in range(2):
            i4.int4_gemv(x, q.qweight, q.scales, None, 128)
        if name == "gate|up":
            f8, s8 = quantize_weight(w)
            for _ in range(2):
                w8_gemv(x, f8, s8, None, default_tiling(n, k))
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
