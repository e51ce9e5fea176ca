"""Neox-style rotary embedding (rotate halves) of the first `rotary_dim` channels, every head of a
token in one program; the other channels pass through. One launch where the reference takes
about a dozen (gathers of the tables, casts, slices, products, concatenations)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from worker.kernels.triton._launch import dot_dtype, kernel, pdl_wait


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
    rotation,
    HALF: tl.constexpr,
    BH: tl.constexpr,
    BD: tl.constexpr,
    ROTATE: tl.constexpr,  # then each head times `rotation` [BD, BD], BN columns at a time
    BN: tl.constexpr,
    DOT: tl.constexpr,
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
    if ROTATE:
        # rounded to the activation dtype first, as the unfused path stores y before its GEMM
        yb = y.to(out.dtype.element_ty).to(DOT)
        k = tl.arange(0, BD)[:, None]
        n = tl.arange(0, BN)[None, :]
        for nc in tl.static_range(0, BD, BN):
            r = tl.load(rotation + k * BD + nc + n).to(DOT)
            o = tl.dot(yb, r)
            tl.store(
                out + t * H * D + heads * D + nc + n, o.to(out.dtype.element_ty), mask=heads < H
            )
    else:
        tl.store(out + t * H * D + heads * D + cols, y.to(out.dtype.element_ty), mask=mask)


def apply_rotary(
    x: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: tuple[torch.Tensor, torch.Tensor],
    rotary_dim: int,
    rotation: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [T, H, D] (last dim contiguous) rotated by fp32 tables cos/sin [max_pos, rotary_dim/2];
    with `rotation` [D, D] (contiguous, D a power of two >= 16), each head vector then times it
    on tensor cores in the same launch (staged KV's basis, `worker/kvcache/staged.py`)."""
    tokens, heads, dim = x.shape
    cos, sin = cos_sin
    if x.stride(2) != 1 or cos.stride(1) != 1 or sin.stride() != cos.stride():
        raise ValueError("rotary needs a contiguous head dim and contiguous tables")
    if rotation is not None and (
        rotation.shape != (dim, dim) or not rotation.is_contiguous() or dim & (dim - 1) or dim < 16
    ):
        raise ValueError(f"rotation {tuple(rotation.shape)}: needs a contiguous [{dim}, {dim}], D a power of two >= 16")  # fmt: skip
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
            x if rotation is None else rotation,
            HALF=rotary_dim // 2,
            # tensor-core products take 16 rows at least
            BH=triton.next_power_of_2(heads)
            if rotation is None
            else max(16, triton.next_power_of_2(heads)),  # fmt: skip
            BD=triton.next_power_of_2(dim),
            ROTATE=rotation is not None,
            BN=min(64, dim),
            DOT=dot_dtype(x.device),
            num_warps=4,
        )
    return out
