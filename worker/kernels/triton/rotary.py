"""Neox-style rotary embedding (rotate halves) of the first `rotary_dim` channels, every head of a
token in one program; the other channels pass through. One launch where the reference takes
about a dozen (gathers of the tables, casts, slices, products, concatenations)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from worker.kernels.triton._launch import kernel, pdl_wait


@kernel
def _rotary_kernel(
    x,
    positions,
    cos,
    sin,
    out,
    H,
    D,
    stride_xt,
    stride_xh,
    stride_table,
    HALF: tl.constexpr,
    BH: tl.constexpr,
    BD: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, BH)[:, None]
    cols = tl.arange(0, BD)[None, :]
    mask = (heads < H) & (cols < D)
    rotated = cols < 2 * HALF
    row = x + t * stride_xt + heads * stride_xh
    xv = tl.load(row + cols, mask=mask, other=0.0).to(tl.float32)
    first = cols < HALF
    partner = tl.where(first, cols + HALF, cols - HALF)
    xp = tl.load(row + partner, mask=mask & rotated, other=0.0).to(tl.float32)
    pos = tl.load(positions + t).to(tl.int64)
    freq = tl.where(first, cols, cols - HALF)
    c = tl.load(cos + pos * stride_table + freq, mask=rotated, other=1.0)
    s = tl.load(sin + pos * stride_table + freq, mask=rotated, other=0.0)
    y = tl.where(rotated, xv * c + tl.where(first, -xp, xp) * s, xv)
    tl.store(out + t * H * D + heads * D + cols, y.to(out.dtype.element_ty), mask=mask)


def apply_rotary(
    x: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: tuple[torch.Tensor, torch.Tensor],
    rotary_dim: int,
) -> torch.Tensor:
    """x [T, H, D] (last dim contiguous) rotated by fp32 tables cos/sin [max_pos, rotary_dim/2]."""
    tokens, heads, dim = x.shape
    cos, sin = cos_sin
    if x.stride(2) != 1 or cos.stride(1) != 1 or sin.stride() != cos.stride():
        raise ValueError("rotary needs a contiguous head dim and contiguous tables")
    out = torch.empty((tokens, heads, dim), dtype=x.dtype, device=x.device)
    if tokens:
        _rotary_kernel[(tokens,)](
            x,
            positions,
            cos,
            sin,
            out,
            heads,
            dim,
            x.stride(0),
            x.stride(1),
            cos.stride(0),
            HALF=rotary_dim // 2,
            BH=triton.next_power_of_2(heads),
            BD=triton.next_power_of_2(dim),
            num_warps=4,
        )
    return out
