"""Activations written a second time as int8 codes for the int4 GEMV's int8 products
(`reference.int4_mma_x8` defines them: a scale per row and group of 128 columns, absmax / 127;
codes floor(x / scale + 0.5), stored in the order the GEMV's lanes read).

Called from the epilogues of the kernels that produce an int4 GEMV's input in a decode step
(the norms and the attention's output gate), so the codes cost no launch and no second read."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from worker.kernels.reference import X8
from worker.kernels.triton._launch import kernel, pdl_release_wait


@triton.jit
def x8_offsets(cols):
    """The stored byte of natural column `cols` within its row: chunk c = cols // 64 is 64
    bytes, lane t's 16 at 16 t, byte 8 p + 4 h + b holding k = 32 p + 8 t + 4 h + (0, 2, 1, 3)[b]
    of the chunk (b and (0, 2, 1, 3)[b] swap 1 and 2)."""
    r = cols % 64
    e = r % 4
    b = tl.where(e == 1, 2, tl.where(e == 2, 1, e))
    return (cols // 64) * 64 + ((r // 8) % 4) * 16 + (r // 32) * 8 + ((r // 4) % 2) * 4 + b


@triton.jit
def store_x8(y, codes, scales, code_rows, scale_rows, col0, row_ok, n_cols,
             BR: tl.constexpr, BC: tl.constexpr):  # fmt: skip
    """Codes and scales of y [BR, BC] (fp32, the activation as stored: already rounded to its
    dtype), the tile's columns col0 + [0, BC) with col0 and BC multiples of 128: codes at
    codes + code_rows[:, None] + x8_offsets(col), scales at scales + scale_rows[:, None] +
    col // 128. Columns from n_cols on (zeros in y) and rows not row_ok are not written."""
    groups = tl.reshape(y, (BR, BC // 128, 128))
    scale = tl.max(tl.abs(groups), 2) / 127.0
    safe = tl.where(scale > 0, scale, 1.0)
    q = tl.reshape(tl.floor(groups / safe[:, :, None] + 0.5), (BR, BC))
    cols = col0 + tl.arange(0, BC)
    ok = row_ok[:, None] & (cols < n_cols)[None, :]
    tl.store(codes + code_rows[:, None] + x8_offsets(cols)[None, :], q.to(tl.int8), mask=ok)
    gcols = col0 // 128 + tl.arange(0, BC // 128)
    g_ok = row_ok[:, None] & (gcols * 128 < n_cols)[None, :]
    tl.store(scales + scale_rows[:, None] + gcols[None, :], scale, mask=g_ok)


def x8_block(width: int) -> int:
    """The power-of-two tile width a kernel storing codes of `width` columns needs (at least
    128: a group)."""
    return max(128, triton.next_power_of_2(width))


@kernel
def _quantize_x8_kernel(
    x, codes, scales, M, K, stride_x, BC: tl.constexpr, PDL: tl.constexpr,
    EARLY_RELEASE: tl.constexpr,
):  # fmt: skip
    # between two GEMVs (gate|up, down): the next may launch before this wait (pdl.py)
    pdl_release_wait(PDL, EARLY_RELEASE)
    row = tl.program_id(0).to(tl.int64)
    col0 = tl.program_id(1) * BC
    cols = col0 + tl.arange(0, BC)
    xv = tl.load(x + row * stride_x + cols, mask=cols < K, other=0.0).to(tl.float32)
    one = tl.zeros((1,), dtype=tl.int64)
    store_x8(tl.reshape(xv, (1, BC)), codes, scales, one + row * K, one + row * (K // 128), col0,
             one == 0, K, 1, BC)  # fmt: skip


def quantize_x8(x: torch.Tensor) -> X8:
    """x [M, K] (16-bit, K % 128 == 0) as int8 codes in one launch, for an int4 GEMV whose input
    no kernel before it writes as codes (the MLP's down projection: gate|up's epilogue sees 16
    outputs of a group)."""
    m, k = x.shape
    if k % 128:
        raise ValueError(f"int8 codes need rows of a multiple of 128, got {k}")
    if x.stride(1) != 1:
        x = x.contiguous()
    out = X8(
        torch.empty((m, k), dtype=torch.int8, device=x.device),
        torch.empty((m, k // 128), dtype=torch.float32, device=x.device),
        x.dtype,
    )
    if m:
        block = min(1024, x8_block(k))
        _quantize_x8_kernel[(m, triton.cdiv(k, block))](
            x, out.codes, out.scales, m, k, x.stride(0), BC=block, num_warps=4
        )
    return out
