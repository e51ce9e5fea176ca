"""FP8 (e4m3) weight GEMMs with per-output-channel scales: y = x @ (w * scale[:, None]).T + bias.

Two paths, picked by the number of rows (tokens) of x:
- few rows (decode): `w8a16`, a triton kernel that streams the fp8 weight once, widens it to fp16
  (one instruction per pair on Hopper; widening to bf16 is not) and dots with x cast to fp16,
  accumulating in fp32; the channel scale is applied in the epilogue. Memory-bound by design.
- many rows (prefill): `scaled_mm`, dynamic per-token activation quantization (one triton pass:
  row amax, scale, e4m3 cast) and `torch._scaled_mm` with rowwise scales on FP8 tensor cores.

`FP8_SCALED_MM_MIN_ROWS` (env TOKENMILL_FP8_SCALED_MM_MIN_ROWS, default 64) is the switch point;
bench/gpu_suite.py measures both paths at decode and prefill sizes and reports the crossover.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from worker.kernels.triton._launch import dot_dtype, kernel

FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_SCALED_MM_MIN_ROWS = int(os.environ.get("TOKENMILL_FP8_SCALED_MM_MIN_ROWS", "64"))


@kernel
def _w8a16_kernel(
    x,
    w,
    scale,
    bias,
    out,
    partial,
    M,
    N,
    K,
    k_per_split,
    stride_xm,
    stride_wn,
    stride_om,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT: tl.constexpr,
):
    """One [BM, BN] tile over one K range. SPLIT: the K range is split `k_per_split` at a time
    and fp32 partials go to partial[split, M, N] (summed and scaled by `_reduce_kernel`)."""
    pid_n, pid_m, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    k_start = split * k_per_split
    k_stop = tl.minimum(k_start + k_per_split, K)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(k_start, k_stop, BK):
        kk = k0 + rk
        xb = tl.load(
            x + rm[:, None].to(tl.int64) * stride_xm + kk[None, :],
            mask=(rm < M)[:, None] & (kk < k_stop)[None, :],
            other=0.0,
        )
        wb = tl.load(
            w + rn[None, :].to(tl.int64) * stride_wn + kk[:, None],
            mask=(rn < N)[None, :] & (kk < k_stop)[:, None],
            other=0.0,
        )
        acc += tl.dot(xb.to(DOT), wb.to(DOT))
    mask = (rm < M)[:, None] & (rn < N)[None, :]
    if SPLIT:
        offs = (split * M + rm[:, None]).to(tl.int64) * N + rn[None, :]
        tl.store(partial + offs, acc, mask=mask)
    else:
        acc = acc * tl.load(scale + rn, mask=rn < N, other=0.0)[None, :]
        if HAS_BIAS:
            acc += tl.load(bias + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(
            out + rm[:, None].to(tl.int64) * stride_om + rn[None, :],
            acc.to(out.dtype.element_ty),
            mask=mask,
        )


@kernel
def _reduce_kernel(
    partial, scale, bias, out, M, N, stride_om, SPLITS, BR: tl.constexpr, HAS_BIAS: tl.constexpr
):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BR + tl.arange(0, BR)
    mask = cols < N
    acc = tl.zeros((BR,), dtype=tl.float32)
    for split in range(0, SPLITS):
        acc += tl.load(partial + (split * M + row).to(tl.int64) * N + cols, mask=mask, other=0.0)
    acc = acc * tl.load(scale + cols, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out + row.to(tl.int64) * stride_om + cols, acc.to(out.dtype.element_ty), mask=mask)


# Decode tiling: 64 output channels x 256 K per step (16 KB of fp8 per stage), and enough K
# splits that about 4 programs per SM stream weight (H200 run 1: BN=16 or ~2 programs per SM
# reached only 1.1-1.2 TB/s; the head's 3,880 programs reached 4.2 TB/s).
_DECODE_BN, _DECODE_BK, _TARGET_PROGRAMS = 64, 256, 4 * 132


def decode_splits(n: int, k: int) -> int:
    tiles = triton.cdiv(n, _DECODE_BN)
    return max(1, min(triton.cdiv(_TARGET_PROGRAMS, tiles), triton.cdiv(k, _DECODE_BK)))


def w8a16(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    split_k: int | None = None,
) -> torch.Tensor:
    """x [M, K] (16-bit) times fp8 weight [N, K] with fp32 scale [N]; out [M, N] in x's dtype."""
    m, k = x.shape
    n = weight.shape[0]
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m <= 16:  # decode: one row block; split K so every SM streams weight
        bm, bn, bk, stages = 16, _DECODE_BN, _DECODE_BK, 4
        splits = split_k or decode_splits(n, k)
    else:
        bm, bn, bk, stages = 64, 128, 64, 3
        splits = split_k or 1
    k_per_split = triton.cdiv(triton.cdiv(k, splits), bk) * bk
    splits = triton.cdiv(k, k_per_split)
    partial = (
        torch.empty((splits, m, n), dtype=torch.float32, device=x.device) if splits > 1 else out
    )
    on_gpu = x.is_cuda
    _w8a16_kernel[(triton.cdiv(n, bn), triton.cdiv(m, bm), splits)](
        x,
        weight,
        scale,
        bias if bias is not None else scale,
        out,
        partial,
        m,
        n,
        k,
        k_per_split,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        BM=bm,
        BN=bn,
        BK=bk,
        HAS_BIAS=bias is not None,
        SPLIT=splits > 1,
        DOT=tl.float16 if on_gpu else dot_dtype(x.device),
        num_warps=4,
        num_stages=stages if on_gpu else 1,
    )
    if splits > 1:
        br = min(1024, triton.next_power_of_2(n))
        _reduce_kernel[(m, triton.cdiv(n, br))](
            partial,
            scale,
            bias if bias is not None else scale,
            out,
            m,
            n,
            out.stride(0),
            splits,
            BR=br,
            HAS_BIAS=bias is not None,
            num_warps=4,
        )
    return out


@kernel
def _quantize_rows_kernel(x, q, scales, K, stride_x, BK: tl.constexpr, FP8_MAX: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BK)
    amax = tl.zeros((BK,), dtype=tl.float32)
    for k0 in range(0, K, BK):
        xr = tl.load(x + row * stride_x + k0 + cols, mask=k0 + cols < K, other=0.0)
        amax = tl.maximum(amax, tl.abs(xr.to(tl.float32)))
    scale = tl.maximum(tl.max(amax, 0) / FP8_MAX, 1e-12)
    tl.store(scales + row, scale)
    for k0 in range(0, K, BK):
        xr = tl.load(x + row * stride_x + k0 + cols, mask=k0 + cols < K, other=0.0)
        qr = (xr.to(tl.float32) / scale).to(q.dtype.element_ty)
        tl.store(q + row * K + k0 + cols, qr, mask=k0 + cols < K)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (per-token) e4m3 quantization: q [M, K] fp8 and scales [M, 1] fp32, x ~ q * s."""
    m, k = x.shape
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if x.stride(1) != 1:
        x = x.contiguous()
    _quantize_rows_kernel[(m,)](
        x, q, scales, k, x.stride(0), BK=min(4096, triton.next_power_of_2(k)), FP8_MAX=FP8_MAX
    )
    return q, scales


def scaled_mm(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """FP8 tensor-core GEMM: per-token quantized x times the per-channel scaled fp8 weight."""
    q, x_scales = quantize_rows(x)
    out = torch._scaled_mm(
        q,
        weight.t(),
        scale_a=x_scales,
        scale_b=scale.view(1, -1),
        out_dtype=x.dtype,
    )
    return out if bias is None else out + bias


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., K] -> [..., N]: w8a16 below FP8_SCALED_MM_MIN_ROWS rows, scaled_mm from there."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] >= FP8_SCALED_MM_MIN_ROWS:
        out = scaled_mm(rows, weight, scale, bias)
    else:
        out = w8a16(rows, weight, scale, bias)
    return out.view(*x.shape[:-1], weight.shape[0])
