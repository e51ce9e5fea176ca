"""Neox-style rotary embedding (rotate halves) of the first `rotary_dim` channels, every head of a
token in one program; the other channels pass through. One launch where the reference takes
about a dozen (gathers of the tables, casts, slices, products, concatenations). And the same
after an attention layer's q and k norms (`qk_norm_rotary`): the four launches of a decode
step's attention prologue in one."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from worker.kernels.triton._launch import kernel, pdl_wait
from worker.kernels.triton.kv_cache import inverse_scales


@triton.jit
def _rotate(xv, xp, positions, t, cos, sin, stride_table, cols, HALF: tl.constexpr):
    """Channels `cols` of fp32 rows xv rotated by token t's angles, xp holding each channel's
    partner (c + HALF in the first half, c - HALF in the second); the rest pass through."""
    rotated = cols < 2 * HALF
    first = cols < HALF
    pos = tl.load(positions + t).to(tl.int64)
    freq = tl.where(first, cols, cols - HALF)
    c = tl.load(cos + pos * stride_table + freq, mask=rotated, other=1.0)
    s = tl.load(sin + pos * stride_table + freq, mask=rotated, other=0.0)
    return tl.where(rotated, xv * c + tl.where(first, -xp, xp) * s, xv)


@triton.jit
def _partner(cols, HALF: tl.constexpr):
    return tl.where(cols < HALF, cols + HALF, cols - HALF)


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
    row = x + t * stride_xt + heads * stride_xh
    xv = tl.load(row + cols, mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(row + _partner(cols, HALF), mask=mask & (cols < 2 * HALF), other=0.0)
    y = _rotate(xv, xp.to(tl.float32), positions, t, cos, sin, stride_table, cols, HALF)
    tl.store(out + t * H * D + heads * D + cols, y.to(out.dtype.element_ty), mask=mask)


@triton.jit
def _normed(xv, rstd, w, UNIT_OFFSET: tl.constexpr, dtype: tl.constexpr):
    """rms_norm's output in fp32 after its roundings to `dtype` (worker/kernels/triton/norm.py)."""
    normed = xv * rstd[:, None]
    if UNIT_OFFSET:
        y = normed * (1.0 + w)
    else:
        y = normed.to(dtype).to(tl.float32) * w
    return y.to(dtype).to(tl.float32)


@triton.jit
def _norm_rotary_heads(
    x, weight, t, H, D, stride_xt, stride_xh, positions, cos, sin, stride_table, eps,
    HALF: tl.constexpr, BH: tl.constexpr, BD: tl.constexpr, UNIT_OFFSET: tl.constexpr,
    dtype: tl.constexpr,
):  # fmt: skip
    """Token t's heads [BH, BD] of x normed, rounded as rms_norm rounds, then rotated, in
    `dtype`."""
    heads = tl.arange(0, BH)[:, None]
    cols = tl.arange(0, BD)[None, :]
    mask = (heads < H) & (cols < D)
    partner = _partner(cols, HALF)
    row = x + t * stride_xt + heads * stride_xh
    xv = tl.load(row + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xv * xv, 1) / D + eps)
    w = tl.load(weight + cols, mask=cols < D, other=0.0).to(tl.float32)
    # the partner's normed value from its own load (a register holds no other column)
    xp = tl.load(row + partner, mask=mask & (cols < 2 * HALF), other=0.0).to(tl.float32)
    wp = tl.load(weight + partner, mask=cols < 2 * HALF, other=0.0).to(tl.float32)
    yv = _normed(xv, rstd, w, UNIT_OFFSET, dtype)
    yp = _normed(xp, rstd, wp, UNIT_OFFSET, dtype)
    y = _rotate(yv, yp, positions, t, cos, sin, stride_table, cols, HALF)
    return y.to(dtype)


@kernel
def _qk_norm_rotary_kernel(
    q,
    k,
    q_weight,
    k_weight,
    positions,
    cos,
    sin,
    q_out,
    k_out,
    HQ,
    HK,
    D,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_table,
    eps,
    HALF: tl.constexpr,
    BH: tl.constexpr,
    BD: tl.constexpr,
    UNIT_OFFSET: tl.constexpr,
    WRITE_KV: tl.constexpr,
    v,
    k_cache,
    v_cache,
    slot_mapping,
    stride_vt,
    stride_vh,
    inv_k_scale,
    inv_v_scale,
    PDL: tl.constexpr,
):
    """Program (t, 0): token t's query heads, (t, 1): its key heads; each head normed, rounded
    as rms_norm rounds, then rotated as apply_rotary rotates it. WRITE_KV: the key program
    stores its keys, and token t's values, into the paged caches at slot_mapping[t] (skipped
    when negative; an fp8 cache stores value / scale) instead of k_out, as write_kv_cache does:
    an attention layer's prologue in one launch."""
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, BH)[:, None]
    cols = tl.arange(0, BD)[None, :]
    dtype = q_out.dtype.element_ty
    if tl.program_id(1) == 0:
        y = _norm_rotary_heads(
            q, q_weight, t, HQ, D, stride_qt, stride_qh, positions, cos, sin,
            stride_table, eps, HALF, BH, BD, UNIT_OFFSET, dtype,
        )  # fmt: skip
        tl.store(q_out + t * HQ * D + heads * D + cols, y, mask=(heads < HQ) & (cols < D))
    else:
        y = _norm_rotary_heads(
            k, k_weight, t, HK, D, stride_kt, stride_kh, positions, cos, sin,
            stride_table, eps, HALF, BH, BD, UNIT_OFFSET, dtype,
        )  # fmt: skip
        mask = (heads < HK) & (cols < D)
        if WRITE_KV:
            slot = tl.load(slot_mapping + t)
            if slot >= 0:
                dst = slot.to(tl.int64) * HK * D + heads * D + cols
                kc = (y.to(tl.float32) * inv_k_scale).to(k_cache.dtype.element_ty)
                tl.store(k_cache + dst, kc, mask=mask)
                vr = tl.load(v + t * stride_vt + heads * stride_vh + cols, mask=mask, other=0.0)
                vc = (vr.to(tl.float32) * inv_v_scale).to(v_cache.dtype.element_ty)
                tl.store(v_cache + dst, vc, mask=mask)
        else:
            tl.store(k_out + t * HK * D + heads * D + cols, y, mask=mask)


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


def qk_norm_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    unit_offset: bool,
    positions: torch.Tensor,
    cos_sin: tuple[torch.Tensor, torch.Tensor],
    rotary_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D] and k [T, Hk, D] (last dim contiguous, strided heads read in place) normed
    per head and rotated, in one launch where the unfused way takes four."""
    q_out, k_out = _launch_qk_norm_rotary(
        q, k, q_weight, k_weight, eps, unit_offset, positions, cos_sin, rotary_dim, None
    )
    assert k_out is not None
    return q_out, k_out


def qk_norm_rotary_write_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    unit_offset: bool,
    positions: torch.Tensor,
    cos_sin: tuple[torch.Tensor, torch.Tensor],
    rotary_dim: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """`qk_norm_rotary`, with the normed, rotated k and v [T, Hk, D] stored into the paged caches
    [num_blocks, block_size, Hk, D] at `slot_mapping` as `write_kv_cache` stores them, in the
    same launch; q's result."""
    if v.shape != k.shape or v.stride(2) != 1:
        raise ValueError(
            f"v {tuple(v.shape)} must match k {tuple(k.shape)}, its last dim contiguous"
        )
    inv = inverse_scales(k_cache, v_cache, k_scale, v_scale)
    kv = (v, k_cache, v_cache, slot_mapping, *inv)
    q_out, _ = _launch_qk_norm_rotary(
        q, k, q_weight, k_weight, eps, unit_offset, positions, cos_sin, rotary_dim, kv
    )
    return q_out


def _launch_qk_norm_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    unit_offset: bool,
    positions: torch.Tensor,
    cos_sin: tuple[torch.Tensor, torch.Tensor],
    rotary_dim: int,
    kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float, float] | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(q's result, k's result, or None where `kv` (v, caches, slots, inverse scales) takes
    the keys)."""
    tokens, hq, dim = q.shape
    hk = k.shape[1]
    cos, sin = cos_sin
    if q.stride(2) != 1 or k.stride(2) != 1 or cos.stride(1) != 1 or sin.stride() != cos.stride():
        raise ValueError("qk_norm_rotary needs contiguous head dims and contiguous tables")
    if k.shape[0] != tokens or k.shape[2] != dim:
        raise ValueError(f"k {tuple(k.shape)} does not match q {tuple(q.shape)}")
    q_out = torch.empty((tokens, hq, dim), dtype=q.dtype, device=q.device)
    k_out = (
        None if kv is not None else torch.empty((tokens, hk, dim), dtype=k.dtype, device=k.device)
    )
    v, k_cache, v_cache, slots, inv_k, inv_v = (
        kv if kv is not None else (k, k, k, positions, 1.0, 1.0)
    )
    if tokens:
        _qk_norm_rotary_kernel[(tokens, 2)](
            q,
            k,
            q_weight,
            k_weight,
            positions,
            cos,
            sin,
            q_out,
            k_out if k_out is not None else q_out,
            hq,
            hk,
            dim,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            cos.stride(0),
            eps,
            HALF=rotary_dim // 2,
            BH=triton.next_power_of_2(max(hq, hk)),
            BD=triton.next_power_of_2(dim),
            UNIT_OFFSET=unit_offset,
            WRITE_KV=kv is not None,
            v=v,
            k_cache=k_cache,
            v_cache=v_cache,
            slot_mapping=slots,
            stride_vt=v.stride(0),
            stride_vh=v.stride(1),
            inv_k_scale=inv_k,
            inv_v_scale=inv_v,
            num_warps=8 if max(hq, hk) * dim >= 4096 else 4,
        )
    return q_out, k_out
