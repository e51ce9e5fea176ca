"""Fused RMSNorm (plain and unit-offset), the residual add + RMSNorm of a decoder layer, and the
DeltaNet output norm gated by silu, in one pass: each row is read once and written once,
statistics in fp32.

Rounding follows the references: unit-offset scales in fp32; the plain and gated forms round the
normalised row to the input dtype before multiplying by the weight (Llama / HF transformers).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from worker.kernels.reference import X8
from worker.kernels.triton._launch import kernel, pdl_release_wait
from worker.kernels.triton.x8 import store_x8


@kernel
def _rms_norm_kernel(
    x,
    gate,
    residual,
    total,
    weight,
    out,
    codes,
    scales,
    n_rows,
    D,
    H,
    stride_xt,
    stride_xh,
    stride_gt,
    stride_gh,
    stride_residual,
    eps,
    BR: tl.constexpr,
    BD: tl.constexpr,
    UNIT_OFFSET: tl.constexpr,
    GATED: tl.constexpr,
    ADD: tl.constexpr,
    X8: tl.constexpr,
    PDL: tl.constexpr,
    EARLY_RELEASE: tl.constexpr,
):
    # between two GEMVs in a decode step: the next one may launch before this wait (pdl.py)
    pdl_release_wait(PDL, EARLY_RELEASE)
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BD)
    mask = (rows < n_rows)[:, None] & (cols < D)[None, :]
    rows64 = rows.to(tl.int64)
    # row r of [T, H, D] inputs (H = 1 for [N, D]) at (r // H) * stride_t + (r % H) * stride_h:
    # strided views (heads split off a fused projection) are read in place, no copy
    token, head = rows64 // H, rows64 % H
    x_rows = token * stride_xt + head * stride_xh
    xr = tl.load(x + x_rows[:, None] + cols[None, :], mask=mask, other=0.0)
    if ADD:  # total = x + residual, rounded to the activation dtype, then normalised
        r = tl.load(residual + rows64[:, None] * stride_residual + cols[None, :], mask=mask)
        xr = (xr.to(tl.float32) + r.to(tl.float32)).to(x.dtype.element_ty)
        tl.store(total + rows64[:, None] * D + cols[None, :], xr, mask=mask)
    xf = xr.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 1) / D + eps)
    normed = xf * rstd[:, None]
    w = tl.load(weight + cols, mask=cols < D, other=0.0).to(tl.float32)
    if UNIT_OFFSET:
        y = normed * (1.0 + w)[None, :]
    else:
        y = normed.to(x.dtype.element_ty).to(tl.float32) * w[None, :]
    if GATED:
        g_rows = token * stride_gt + head * stride_gh
        z = tl.load(gate + g_rows[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        y = y * z / (1.0 + tl.exp(-z))
    tl.store(out + rows64[:, None] * D + cols[None, :], y.to(out.dtype.element_ty), mask=mask)
    if X8:  # the output again as int8 codes, for the int4 GEMV after this norm (x8.py)
        stored = tl.where(mask, y.to(out.dtype.element_ty).to(tl.float32), 0.0)
        store_x8(
            stored, codes, scales, rows64 * D, rows64 * (D // 128), 0, rows < n_rows, D, BR, BD
        )


def _launch(
    x: torch.Tensor,
    gate: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    unit_offset: bool,
    residual: torch.Tensor | None = None,
    x8: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, X8 | None]:
    """(normed, x + residual) with residual; (normed, normed) without; with `x8`, also the
    normed rows (flattened to [tokens, heads * D] for [T, H, D] inputs) as int8 codes."""
    dim = x.shape[-1]
    extra = [t for t in (gate, residual) if t is not None]
    if x.stride(-1) != 1 or any(t.stride(-1) != 1 for t in extra):
        raise ValueError("rms norm needs a contiguous last dim")
    if gate is not None and gate.shape != x.shape:
        raise ValueError(f"gate {tuple(gate.shape)} does not match x {tuple(x.shape)}")
    x3, gate3 = _as_rows(x), _as_rows(gate if gate is not None else x)
    residual_rows = residual.reshape(-1, dim) if residual is not None else x3[0]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    total = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else out
    n_rows = x.numel() // dim if dim else 0
    codes = scales = out
    if x8:
        if dim % 128:
            raise ValueError(f"int8 codes need rows of a multiple of 128, got {dim}")
        codes = torch.empty(x.shape, dtype=torch.int8, device=x.device)
        scales = torch.empty((*x.shape[:-1], dim // 128), dtype=torch.float32, device=x.device)
    codes8 = (
        X8(codes.reshape(x.shape[0], -1), scales.reshape(x.shape[0], -1), x.dtype) if x8 else None
    )
    if n_rows == 0:
        return out, total, codes8
    block_d = triton.next_power_of_2(dim)
    block_rows = max(1, min(16, 4096 // block_d))  # ~4K elements per program
    _rms_norm_kernel[(triton.cdiv(n_rows, block_rows),)](
        x3[0],
        gate3[0],
        residual_rows,
        total,
        weight,
        out,
        codes,
        scales,
        n_rows,
        dim,
        x3[1],
        x3[2],
        x3[3],
        gate3[2],
        gate3[3],
        residual_rows.stride(0),
        eps,
        BR=block_rows,
        BD=block_d,
        UNIT_OFFSET=unit_offset,
        GATED=gate is not None,
        ADD=residual is not None,
        X8=x8,
        num_warps=8 if block_d >= 4096 else 4,
    )
    return out, total, codes8


def _as_rows(t: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """(tensor, heads, token stride, head stride): rows of [T, H, D] or [N, D] addressed in
    place; other ranks are flattened to [N, D] (a copy only if they must be)."""
    if t.dim() == 3:
        return t, t.shape[1], t.stride(0), t.stride(1)
    rows = t if t.dim() == 2 else t.reshape(-1, t.shape[-1])
    return rows, 1, rows.stride(0), 0


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool) -> torch.Tensor:
    """RMSNorm over the last axis of x[..., D]; unit_offset scales by (1 + weight)."""
    return _launch(x, None, weight, eps, unit_offset)[0]


def rms_norm_x8(
    x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool
) -> tuple[torch.Tensor, X8]:
    """rms_norm, and its output as int8 codes for the int4 GEMV after it, from one pass."""
    out, _, codes = _launch(x, None, weight, eps, unit_offset, x8=True)
    assert codes is not None
    return out, codes


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) in one pass over both."""
    out, total, _ = _launch(x, None, weight, eps, unit_offset, residual)
    return out, total


def add_rms_norm_x8(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool
) -> tuple[torch.Tensor, torch.Tensor, X8]:
    """add_rms_norm, and the normed rows as int8 codes, from one pass."""
    out, total, codes = _launch(x, None, weight, eps, unit_offset, residual, x8=True)
    assert codes is not None
    return out, total, codes


def gated_rms_norm(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """norm(x) * weight * silu(gate) for x, gate [N, D]."""
    return _launch(x, gate, weight, eps, unit_offset=False)[0]


def gated_rms_norm_x8(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, X8]:
    """gated_rms_norm of x [T, H, D], and its output as int8 codes of rows [T, H * D]."""
    out, _, codes = _launch(x, gate, weight, eps, unit_offset=False, x8=True)
    assert codes is not None
    return out, codes
