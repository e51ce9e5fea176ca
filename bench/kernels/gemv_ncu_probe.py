"""Run the FP8 decode GEMV once per layer shape (and the head) for Nsight Compute to profile.

    ncu --kernel-name regex:gemv --launch-skip 6 --set full -o $OUT/gemv \
        python -m bench.kernels.gemv_ncu_probe

Each shape runs 3 times (compile, warm, profiled) with the default tiling, so ncu's launch-skip
can step over the warm-ups; the weights are random fp8 at the Qwen3.6-27B shapes, batch 8.
"""

from __future__ import annotations

import argparse

import torch

from worker.kernels.triton.fp8_gemm import default_tiling, w8_gemv
from worker.models.fp8 import quantize_weight

SHAPES = {
    "gate|up": (34816, 5120),
    "down": (5120, 17408),
    "deltanet out / attention o": (5120, 6144),
    "head": (248320, 5120),
}


def main() -> None:
    argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    ).parse_args()
    x = torch.randn(8, 5120, device="cuda", dtype=torch.bfloat16)
    for name, (n, k) in SHAPES.items():
        q, s = quantize_weight(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02)
        xs = x if k == 5120 else torch.randn(8, k, device="cuda", dtype=torch.bfloat16)
        for _ in range(3):
            w8_gemv(xs, q, s, None, default_tiling(n, k))
        torch.cuda.synchronize()
        print(name, default_tiling(n, k), flush=True)


if __name__ == "__main__":
    main()
