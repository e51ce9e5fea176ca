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

from worker.kernels.triton._launch import kernel


@kernel
def _rms_norm_kernel(
    x,
    gate,
    residual,
    total,
    weight,
    out,
    n_rows,
    D,
    stride_x,
    stride_gate,
    stride_residual,
    eps,
    BR: tl.constexpr,
    BD: tl.constexpr,
    UNIT_OFFSET: tl.constexpr,
    GATED: tl.constexpr,
    ADD: tl.constexpr,
):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BD)
    mask = (rows < n_rows)[:, None] & (cols < D)[None, :]
    rows64 = rows.to(tl.int64)
    xr = tl.load(x + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
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
        z = tl.load(gate + rows64[:, None] * stride_gate + cols[None, :], mask=mask, other=0.0).to(
            tl.float32
        )
        y = y * z / (1.0 + tl.exp(-z))
    tl.store(out + rows64[:, None] * D + cols[None, :], y.to(out.dtype.element_ty), mask=mask)


def _launch(
    x: torch.Tensor,
    gate: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    unit_offset: bool,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, x + residual) with residual; (normed, normed) without."""
    dim = x.shape[-1]
    extra = [t for t in (gate, residual) if t is not None]
    if x.stride(-1) != 1 or any(t.stride(-1) != 1 for t in extra):
        raise ValueError("rms norm needs a contiguous last dim")
    rows = x.reshape(-1, dim)  # a view unless x's leading dims cannot be flattened
    gate_rows = gate.reshape(-1, dim) if gate is not None else rows
    residual_rows = residual.reshape(-1, dim) if residual is not None else rows
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    total = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else out
    n_rows = rows.shape[0]
    if n_rows == 0:
        return out, total
    block_d = triton.next_power_of_2(dim)
    block_rows = max(1, min(16, 4096 // block_d))  # ~4K elements per program
    _rms_norm_kernel[(triton.cdiv(n_rows, block_rows),)](
        rows,
        gate_rows,
        residual_rows,
        total,
        weight,
        out,
        n_rows,
        dim,
        rows.stride(0),
        gate_rows.stride(0),
        residual_rows.stride(0),
        eps,
        BR=block_rows,
        BD=block_d,
        UNIT_OFFSET=unit_offset,
        GATED=gate is not None,
        ADD=residual is not None,
        num_warps=8 if block_d >= 4096 else 4,
    )
    return out, total


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool) -> torch.Tensor:
    """RMSNorm over the last axis of x[..., D]; unit_offset scales by (1 + weight)."""
    return _launch(x, None, weight, eps, unit_offset)[0]


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) in one pass over both."""
    return _launch(x, None, weight, eps, unit_offset, residual)


def gated_rms_norm(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """norm(x) * weight * silu(gate) for x, gate [N, D]."""
    return _launch(x, gate, weight, eps, unit_offset=False)[0]
