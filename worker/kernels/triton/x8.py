"""Activations written a second time as int8 codes for the int4 GEMV's int8 products
(`reference.int4_mma_x8` defines them: a scale per row and group of 128 columns, absmax / 127;
codes floor(x / scale + 0.5), stored in the order the GEMV's lanes read).

Called from the epilogues of the kernels that produce an int4 GEMV's input in a decode step
(the norms and the attention's output gate), so the codes cost no launch and no second read."""

from __future__ import annotations

import triton
import triton.language as tl


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
