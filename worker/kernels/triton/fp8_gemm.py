"""FP8 (e4m3) weight GEMMs with per-output-channel scales: y = x @ (w * scale[:, None]).T + bias.

Two paths, picked by the number of rows (tokens) of x:
- few rows (decode, M <= 16): `w8_gemv`, one triton launch that streams the fp8 weight once as
  the dot's left operand (out^T = W x^T), widens it to fp16 (one instruction per pair on Hopper;
  widening to bf16 is not) and accumulates in fp32. Small-N shapes split K; the last program to
  finish a column tile (an arrival counter) sums the fp32 partials, scales and writes the
  output, so there is no second launch. The tiling per (N, K) comes from `DECODE_TILINGS`
  (bench/engine/suite.py sweeps candidates at the real shapes and fills it), else from
  `default_tiling` (measured: 32-channel mma.sync tiles; the LM head on w8a16 in one launch).
  The same kernel serves 16-bit weights (`linear`) where it beats cuBLAS.
- rows between FP8_GEMV_MAX_ROWS and FP8_SCALED_MM_MIN_ROWS (none by default): `w8a16`, the
  same weight streaming with x as the left operand.
- more rows (decode at concurrency > 16, prefill): `scaled_mm`, dynamic per-token activation
  quantization (one triton pass: row amax, scale, e4m3 cast) and `torch._scaled_mm` with rowwise scales on FP8 tensor cores.

`FP8_SCALED_MM_MIN_ROWS` (env TOKENMILL_FP8_SCALED_MM_MIN_ROWS, default 17) is the switch point.
Measured on one H200, the 27B engine at concurrency 32 (32-row decode steps): w8a16 29.5 ms a
step (960 tok/s), scaled_mm 15.7 ms (1,631 tok/s), w8_gemv with a 32-row tile
(TOKENMILL_FP8_GEMV_MAX_ROWS=32) 15.9 ms (1,619 tok/s); hence scaled_mm from 17 rows.

Size: Every FP8 matmul of one weight format (decode GEMV split-K and stream-K, w8a16, scaled_mm,
fused silu) with launchers and tilings.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from worker.kernels.triton._launch import dot_dtype, kernel, pdl_wait
from worker.kernels.triton.activations import silu_mul, silu_times

FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_MAX_VALUE: tl.constexpr = tl.constexpr(FP8_MAX)  # the same, inside kernels
FP8_SCALED_MM_MIN_ROWS = int(os.environ.get("TOKENMILL_FP8_SCALED_MM_MIN_ROWS", "17"))
# The most rows `w8_gemv` takes (TOKENMILL_FP8_GEMV_MAX_ROWS, at most 64): past 16 its row tile
# grows to the next power of two; between this and FP8_SCALED_MM_MIN_ROWS, `w8a16`.
FP8_GEMV_MAX_ROWS = min(int(os.environ.get("TOKENMILL_FP8_GEMV_MAX_ROWS", "16")), 64)


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
    PDL: tl.constexpr,
):
    """One [BM, BN] tile over one K range. SPLIT: the K range is split `k_per_split` at a time
    and fp32 partials go to partial[split, M, N] (summed and scaled by `_reduce_kernel`)."""
    pdl_wait(PDL)
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
    partial,
    scale,
    bias,
    out,
    M,
    N,
    stride_om,
    SPLITS,
    BR: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
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
def _gemv_kernel(
    x,
    x_scale,
    w,
    scale,
    bias,
    out,
    partial,
    arrivals,
    M,
    N,
    K,
    k_per_split,
    splits,
    stride_xm,
    stride_wn,
    stride_om,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    SPLIT: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT: tl.constexpr,
    ACT_FP8: tl.constexpr,
    X_PER_TOKEN: tl.constexpr,
    FP8_DOT: tl.constexpr,
    LATE_WAIT: tl.constexpr,
    PDL: tl.constexpr,
):
    """out^T tile [BN, BM] = W[BN, K-range] @ x^T[K-range, BM]. SPLITS > 1: fp32 partials go to
    partial[split, M, N]; the program that arrives last at its column tile sums them, applies
    scale and bias, writes out and re-arms the tile's counter (zero) for the next launch. The split
    count is a runtime argument, so one compiled kernel serves every shape and split.

    ACT_FP8 (fp8 weights): each K step's x block is quantized to e4m3 per row (scale = row amax /
    448 over the block's BK columns, finer than the per-token scales of prefill's scaled_mm) so
    the dot takes both operands in fp8 (FP8_DOT: straight from shared memory on the tensor
    cores, no widening of the weight; under the interpreter the fp8 values are dotted in DOT).
    X_PER_TOKEN (with ACT_FP8): x arrives quantized already, e4m3 with one scale per row
    (x_scale [M], `quantize_rows`), so no program repeats the quantization; the row scales
    multiply the fp32 sums once, after the loop.

    LATE_WAIT: x was written before the launch just before this one (`w8_gemv`'s
    `beside_previous`), so the products run beside that launch and the PDL wait comes before
    the first write, not before the first load."""
    pid_n, split = tl.program_id(0), tl.program_id(1)
    rn = pid_n * BN + tl.arange(0, BN)
    rm = tl.arange(0, BM)
    rk = tl.arange(0, BK)
    n_ok = (rn < N)[:, None]
    m_ok = (rm < M)[None, :]
    w_rows = w + rn[:, None].to(tl.int64) * stride_wn
    x_rows = x + rm[:, None] * stride_xm
    k_start = split * k_per_split
    if not LATE_WAIT:
        pdl_wait(PDL)
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    # the last split may be shorter (k_per_split is rounded up to BK): stop at K
    for k0 in range(k_start, tl.minimum(k_start + k_per_split, K), BK):
        kk = k0 + rk
        if EVEN_K:  # K % BK == 0, so every step is whole: no K mask, full 16-byte loads
            wb = tl.load(w_rows + kk[None, :], mask=n_ok, other=0.0)
            x_mask = (rm < M)[:, None]
        else:
            wb = tl.load(w_rows + kk[None, :], mask=n_ok & (kk < K)[None, :], other=0.0)
            x_mask = (rm < M)[:, None] & (kk < K)[None, :]
        xb = tl.load(x_rows + kk[None, :], mask=x_mask, other=0.0)
        if X_PER_TOKEN:
            if FP8_DOT:
                acc += tl.dot(wb, tl.trans(xb))
            else:
                acc += tl.dot(wb.to(DOT), tl.trans(xb.to(DOT)))
        elif ACT_FP8:
            xf = xb.to(tl.float32)
            # not `x_scale`: a loop-carried name must keep the argument's pointer type
            block_scale = tl.maximum(tl.max(tl.abs(xf), axis=1), 1e-30) / FP8_MAX_VALUE
            if FP8_DOT:
                xq = (xf / block_scale[:, None]).to(tl.float8e4nv)
                part = tl.dot(wb, tl.trans(xq))
            else:
                xq = _round_to_e4m3(xf / block_scale[:, None])
                part = tl.dot(wb.to(DOT), tl.trans(xq.to(DOT)))
            acc += part * block_scale[None, :]
        else:
            acc += tl.dot(wb.to(DOT), tl.trans(xb.to(DOT)))
    mask = n_ok & m_ok
    if LATE_WAIT:
        pdl_wait(PDL)
    if X_PER_TOKEN:
        acc *= tl.load(x_scale + rm, mask=rm < M, other=0.0)[None, :]
    if not SPLIT:
        _gemv_epilogue(acc, scale, bias, out, rn, rm, N, stride_om, mask, HAS_SCALE, HAS_BIAS)
    else:
        total, last = _sum_splits(acc, partial, arrivals, pid_n, split, splits, M, N, rn, rm, mask)
        if last:
            _gemv_epilogue(total, scale, bias, out, rn, rm, N, stride_om, mask, HAS_SCALE, HAS_BIAS)


@kernel
def _gemv_stream_k_kernel(
    x,
    w,
    scale,
    bias,
    out,
    workspace,
    arrivals,
    M,
    N,
    ksteps,
    total_steps,
    stride_xm,
    stride_wn,
    stride_om,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT: tl.constexpr,
    PDL: tl.constexpr,
):
    """Stream-K decode GEMV: the (column tile, K step) work is cut into one equal contiguous
    range per program, and the grid is one wave of resident programs, so every program streams
    the same number of weight bytes and they all finish together (with one tile per program, a
    2.06-wave grid spends its last third on a few SMs). A range covers whole tiles (written
    directly) and at most two partial ones at its ends: those add fp32 into workspace[tile]
    with atomics and count their K steps at the tile's arrival counter; the program that
    completes the count applies scale and bias, writes out, and re-zeroes the workspace and the
    counter for the next launch. K % BK == 0 (the wrapper checks). `stream_k_programs` keeps
    every tile to at most two adds, so the sum does not depend on their order."""
    pid, programs = tl.program_id(0), tl.num_programs(0)
    start = (pid * total_steps) // programs
    stop = ((pid + 1) * total_steps) // programs
    first_tile = start // ksteps
    first_ks = start - first_tile * ksteps
    rm = tl.arange(0, BM)
    rk = tl.arange(0, BK)
    rb = tl.arange(0, BN)
    m_ok = (rm < M)[None, :]
    x_rows = x + rm[:, None] * stride_xm
    pdl_wait(PDL)
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    # One flat loop over the range (as triton's persistent matmul), so the weight pipeline runs
    # on across tile boundaries; nothing in it may synchronise threads (a barrier or an
    # acquire/release atomic there stops triton 3.6 from pipelining the loads), so partial tiles
    # only add into the workspace here and are counted after the loop.
    for step in range(start, stop):
        tile = step // ksteps
        ks = step - tile * ksteps
        rn = tile * BN + rb
        n_ok = (rn < N)[:, None]
        kk = ks * BK + rk
        wb = tl.load(w + rn[:, None].to(tl.int64) * stride_wn + kk[None, :], mask=n_ok, other=0.0)
        xb = tl.load(x_rows + kk[None, :], mask=(rm < M)[:, None], other=0.0)
        acc += tl.dot(wb.to(DOT), tl.trans(xb.to(DOT)))
        if (ks == ksteps - 1) | (step == stop - 1):  # this tile's part of the range is done
            mask = n_ok & m_ok
            if (tl.where(tile == first_tile, first_ks, 0) == 0) & (ks == ksteps - 1):
                _gemv_epilogue(
                    acc, scale, bias, out, rn, rm, N, stride_om, mask, HAS_SCALE, HAS_BIAS
                )
            else:
                slab = workspace + tile.to(tl.int64) * BN * BM + rb[:, None] * BM + rm[None, :]
                tl.atomic_add(slab, acc, mask=mask, sem="relaxed")
            acc = tl.zeros((BN, BM), dtype=tl.float32)
    tl.debug_barrier()  # every thread's workspace adds are done before the steps are counted
    last_tile = (stop - 1) // ksteps
    last_end = stop - last_tile * ksteps  # exclusive K step where the range leaves its last tile
    if first_tile == last_tile:
        if (first_ks > 0) | (last_end < ksteps):
            _stream_k_count(
                first_tile, last_end - first_ks, ksteps, workspace, arrivals, scale, bias, out,
                M, N, stride_om, BM, BN, HAS_SCALE, HAS_BIAS,
            )  # fmt: skip
    else:
        if first_ks > 0:
            _stream_k_count(
                first_tile, ksteps - first_ks, ksteps, workspace, arrivals, scale, bias, out,
                M, N, stride_om, BM, BN, HAS_SCALE, HAS_BIAS,
            )  # fmt: skip
        if last_end < ksteps:
            _stream_k_count(
                last_tile, last_end, ksteps, workspace, arrivals, scale, bias, out,
                M, N, stride_om, BM, BN, HAS_SCALE, HAS_BIAS,
            )  # fmt: skip


@triton.jit
def _stream_k_count(
    tile, counted, ksteps, workspace, arrivals, scale, bias, out, M, N, stride_om,
    BM: tl.constexpr, BN: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
):  # fmt: skip
    """Count `counted` K steps of a partial tile; the program completing the tile's K writes it
    from the workspace (L2, .cg) and re-zeroes the workspace slab and the counter."""
    done = tl.atomic_add(arrivals + tile, counted, sem="acq_rel", scope="gpu")
    if done + counted == ksteps:
        rm = tl.arange(0, BM)
        rb = tl.arange(0, BN)
        rn = tile * BN + rb
        mask = (rn < N)[:, None] & (rm < M)[None, :]
        slab = workspace + tile.to(tl.int64) * BN * BM + rb[:, None] * BM + rm[None, :]
        total = tl.load(slab, mask=mask, other=0.0, cache_modifier=".cg")
        tl.store(slab, tl.zeros((BN, BM), dtype=tl.float32), mask=mask)
        tl.atomic_xchg(arrivals + tile, 0)
        _gemv_epilogue(total, scale, bias, out, rn, rm, N, stride_om, mask, HAS_SCALE, HAS_BIAS)


@triton.jit
def _round_to_e4m3(v):
    """v (|v| <= 448) rounded to the nearest e4m3 value, ties to even as the GPU's cast and
    torch's, in fp32 arithmetic: the interpreter's fp8 cast loses the carry when rounding up
    into the next binade (127.6 -> 64), so CPU runs round by hand (3 mantissa bits; subnormal
    spacing 2^-9 below 2^-6)."""
    a = tl.abs(v)
    step = tl.exp2(tl.maximum(tl.floor(tl.log2(tl.maximum(a, 1e-30))), -6.0) - 3.0)
    t = a / step
    n = tl.floor(t + 0.5)
    odd = n - 2.0 * tl.floor(n * 0.5) == 1.0
    n = tl.where((n - t == 0.5) & odd, n - 1.0, n)
    r = tl.minimum(n * step, 448.0)
    return tl.where(v < 0, -r, r)


@triton.jit
def _sum_splits(acc, partial, arrivals, pid_n, split, splits, M, N, rn, rm, mask):
    """Split K's in-launch reduction of one [BN, BM] column tile: this split's partial to
    `partial`, then the last split to arrive sums them all in split order (the same bits every
    run) and re-arms the tile's counter. (the sum, whether this program is that last one)"""
    slab = (rm[None, :] * N + rn[:, None]).to(tl.int64)
    tl.store(partial + split * M * N + slab, acc, mask=mask)
    tl.debug_barrier()  # every thread's partial is written before the arrival is counted
    arrived = tl.atomic_add(arrivals + pid_n, 1, sem="acq_rel", scope="gpu")
    last = arrived == splits - 1
    total = tl.zeros_like(acc)
    if last:
        for s in range(0, splits):  # .cg: the other SMs' partials, from L2
            total += tl.load(partial + s * M * N + slab, mask=mask, other=0.0, cache_modifier=".cg")
        tl.atomic_xchg(arrivals + pid_n, 0)
    return total, last


@triton.jit
def _gemv_epilogue(
    acc,
    scale,
    bias,
    out,
    rn,
    rm,
    N,
    stride_om,
    mask,
    HAS_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    if HAS_SCALE:
        acc = acc * tl.load(scale + rn, mask=rn < N, other=0.0)[:, None]
    if HAS_BIAS:
        acc += tl.load(bias + rn, mask=rn < N, other=0.0).to(tl.float32)[:, None]
    tl.store(out + rm[None, :] * stride_om + rn[:, None], acc.to(out.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class DecodeTiling:
    """How `w8_gemv` tiles one (N, K) weight: BN output channels x BK of K per step, K split in
    `splits` ranges; `two_pass` uses the older w8a16 kernel + reduce launch instead."""

    bn: int = 64
    bk: int = 256
    splits: int = 1
    num_warps: int = 4
    num_stages: int = 4
    two_pass: bool = False
    # fp8 weights only: quantize x per K step to e4m3 and dot fp8 x fp8 (W8A8, as prefill's
    # scaled_mm). (An L2 prefetch of each row's first bytes ahead of the PDL wait was measured
    # in run 5 and gained nothing: removed.)
    act_fp8: bool = False
    # > 0: the stream-K kernel with this many programs per SM (one wave, equal ranges)
    stream_k: int = 0
    # with act_fp8: x quantized once per token before the launch (`quantize_rows`), instead of
    # per K step inside every program (which repeats it N / bn times)
    x_per_token: bool = False


# Filled by bench/engine/suite.py's sweep (fastest measured tiling per weight shape); else default.
DECODE_TILINGS: dict[tuple[int, int], DecodeTiling] = {}
# Decode batches of 17-64 rows (concurrency 17-64): (N, K, 32 or 64 rows) -> the `w8_gemv`
# tiling measured faster than scaled_mm at that shape (`python -m bench.kernels.fp8_rows
# --write-tuning`, the GPU's tuning file); a shape not here runs scaled_mm. Off with
# TOKENMILL_FP8_WIDE_GEMV=0.
WIDE_DECODE_TILINGS: dict[tuple[int, int, int], DecodeTiling] = {}
FP8_WIDE_GEMV = os.environ.get("TOKENMILL_FP8_WIDE_GEMV", "1") != "0"


def wide_rows(m: int) -> int:
    """The row bucket of a 17-64-row decode batch in WIDE_DECODE_TILINGS."""
    return 32 if m <= 32 else 64


# 16-bit weights: the GEMV runs only for shapes measured faster than cuBLAS. Preset with the
# H200 winners at the Qwen3.6-27B shapes (bench/results/2026-11-29-h200-fd36d78-gpu_suite.json:
# 91-96% of copy bandwidth against cuBLAS's 82-94%); the sweep replaces them when it runs.
BF16_DECODE_TILINGS: dict[tuple[int, int], DecodeTiling] = {
    (34816, 5120): DecodeTiling(64, 128, 1, 4, 3),  # MLP gate|up
    (5120, 17408): DecodeTiling(64, 128, 7, 4, 3),  # MLP down
    (16480, 5120): DecodeTiling(64, 128, 1, 4, 4),  # DeltaNet qkv|z|b|a
    (248320, 5120): DecodeTiling(64, 128, 1, 4, 3),  # LM head
}


def default_tiling(n: int, k: int) -> DecodeTiling:
    """The fp8 tiling without a sweep, from the H200 sweep (bench/results/
    2026-11-29-h200-fd36d78-gpu_suite.json): 32-channel tiles (mma.sync; the 64-channel wgmma
    tilings, which widen fp8 from shared memory two bytes at a time, ran at 40-60% of copy
    bandwidth) with ~3 programs per SM. A head-sized N (thousands of column tiles) runs best as
    W8A8 on 64-channel wgmma tiles, both fp8 operands from shared memory
    (2026-11-29-h200-{72aa760,88106d9,c21ec29}-gpu_suite.json: 95.5-95.9% of copy bandwidth,
    against 90% for the w8a16 kernel). Shapes of <= 20k rows run with 2 warps per program
    (2026-11-29-h200-20e472a-gpu_suite.json: 4-10% faster than 4 warps on all four, e.g. out/o
    13.7 vs 14.3 us, q|k|v 22.9 vs 25.2 us)."""
    if triton.cdiv(n, _DECODE_BN) >= 8 * 132:
        return DecodeTiling(64, 128, 1, 4, 6, act_fp8=True)
    if n > 20_000:  # the MLP's gate|up: 64-channel tiles on mma.sync (2 warps), 3 stages:
        # 86% of copy bandwidth against 75-79% for 32-channel tiles
        # (2026-11-29-h200-b3a6e81-gpu_suite_run{8,9}.json; Nsight Compute: 4 blocks of 49 KB
        # per SM left the shared-memory pipe 73% busy)
        return DecodeTiling(64, 128, 1, 2, 3)
    return channel32_tiling(n, k, 2 if n <= 20_000 else 4)


def channel32_tiling(n: int, k: int, num_warps: int) -> DecodeTiling:
    """32-channel mma.sync tiles, 256 of K per step, K split for ~3 programs per SM."""
    tiles = triton.cdiv(n, 32)
    splits = max(1, min(triton.cdiv(3 * 132, tiles), triton.cdiv(k, _DECODE_BK) // 4))
    return DecodeTiling(32, _DECODE_BK, splits, num_warps, 4)


def programs_per_sm(tiling: DecodeTiling, weight_bytes: int = 1) -> int:
    """Resident programs per H100/H200 SM for a tiling: shared memory (228 KB: `stages` buffers
    of the weight tile and the x tile, as triton 3.9 lays them out for sm_90) or warps (64),
    whichever binds. W8A8 stages hold the bf16 x tile beside the fp8 weight tile (compiled for
    sm_90 with triton 3.6: 64 x 256, 4 stages = 94 KB)."""
    x_rows = 32 if tiling.act_fp8 else 16
    smem = tiling.num_stages * (tiling.bn + x_rows) * tiling.bk * weight_bytes
    return max(1, min(228 * 1024 // (smem + 1024), 64 // tiling.num_warps))


def wave_splits(n: int, k: int, tiling: DecodeTiling, weight_bytes: int = 1, sms: int = 132) -> int:
    """The K split that best fills whole waves of resident programs (a last, mostly empty wave
    runs at a fraction of the bandwidth), keeping at least 4 K steps per program."""
    slots = sms * programs_per_sm(tiling, weight_bytes)
    tiles, steps = triton.cdiv(n, tiling.bn), triton.cdiv(k, tiling.bk)
    best, best_fill = 1, 0.0
    for splits in range(1, max(1, steps // 4) + 1):
        k_per_split = triton.cdiv(steps, splits) * tiling.bk
        real = triton.cdiv(k, k_per_split)
        waves = tiles * real / slots
        fill = waves / math.ceil(waves)
        if fill > best_fill + 0.02:
            best, best_fill = real, fill
    return best


_arrivals: dict[torch.device, torch.Tensor] = {}
_MAX_TILES = 1 << 16


def _arrival_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """Per-device int32 counters, zero between launches (each split GEMV re-arms the ones it
    used); launches on one stream run one after another, so they can share them."""
    if tiles > _MAX_TILES:
        raise ValueError(f"{tiles} column tiles: more than the {_MAX_TILES} arrival counters")
    counters = _arrivals.get(device)
    if counters is None:
        counters = _arrivals[device] = torch.zeros(_MAX_TILES, dtype=torch.int32, device=device)
    return counters


def _split_k(
    out: torch.Tensor, k: int, splits: int, bk: int, tiles: int, width: int | None = None
) -> tuple[int, int, torch.Tensor, torch.Tensor]:
    """K cut into at most `splits` ranges of whole BK steps for a GEMV writing `out` [M, N]:
    (K per split, the splits that remain, an fp32 partial [splits, M, width or N] and the
    arrival counters of its `tiles` column tiles; both are `out` when one split remains)."""
    k_per_split = triton.cdiv(triton.cdiv(k, splits), bk) * bk
    splits = triton.cdiv(k, k_per_split)
    if splits == 1:
        return k_per_split, 1, out, out
    m, n = out.shape
    partial = torch.empty((splits, m, width or n), dtype=torch.float32, device=out.device)
    return k_per_split, splits, partial, _arrival_counters(out.device, tiles)


def w8_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor | None,
    bias: torch.Tensor | None = None,
    tiling: DecodeTiling | None = None,
    beside_previous: bool = False,
) -> torch.Tensor:
    """Decode GEMM in one launch: x [M <= 16, K] 16-bit times weight [N, K], either fp8 with an
    fp32 scale [N] (widened to fp16 for the dot) or 16-bit like x (scale None).

    beside_previous: x was written before the launch just before this one, which this GEMV
    does not read. Under PDL the launch before lets this one start as soon as it passed its own
    wait (so x is complete by then); this one then loads and multiplies beside it, and waits for
    it only before writing, so a kernel that waits for this one also finds the one before
    finished. The plain kernel only (the two-pass and stream-K forms wait first, as always)."""
    m, k = x.shape
    n = weight.shape[0]
    if m > 64:
        raise ValueError(f"w8_gemv takes at most 64 rows, got {m}")
    fp8 = weight.dtype == torch.float8_e4m3fn
    if fp8 != (scale is not None):
        raise ValueError("fp8 weights take a scale, 16-bit weights none")
    tiling = tiling or DECODE_TILINGS.get((n, k)) or default_tiling(n, k)
    # Past 16 rows the row tile grows; the two-pass and stream-K forms keep 16-row slabs.
    bm = 16 if m <= 16 else triton.next_power_of_2(m)
    if tiling.two_pass and bm == 16:
        assert scale is not None, "the two-pass kernel is fp8-only"
        return w8a16(x, weight, scale, bias, split_k=tiling.splits)
    if tiling.stream_k and k % tiling.bk == 0 and bm == 16:
        return _stream_k_gemv(x, weight, scale, bias, tiling)
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    tiles = triton.cdiv(n, tiling.bn)
    k_per_split, splits, partial, arrivals = _split_k(out, k, tiling.splits, tiling.bk, tiles)
    on_gpu = x.is_cuda
    dot = _gemv_dot(x, fp8)
    per_token = fp8 and tiling.act_fp8 and tiling.x_per_token
    x_scale: torch.Tensor = out
    if per_token:
        x, x_scale = quantize_rows(x)
    _gemv_kernel[(tiles, splits)](
        x,
        x_scale,
        weight,
        scale if scale is not None else weight,
        bias if bias is not None else weight,
        out,
        partial,
        arrivals,
        m,
        n,
        k,
        k_per_split,
        splits,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        BM=bm,
        BN=tiling.bn,
        BK=tiling.bk,
        SPLIT=splits > 1,
        HAS_SCALE=scale is not None,
        HAS_BIAS=bias is not None,
        EVEN_K=k % tiling.bk == 0,
        DOT=dot,
        ACT_FP8=fp8 and tiling.act_fp8,
        X_PER_TOKEN=per_token,
        FP8_DOT=on_gpu,
        LATE_WAIT=beside_previous,
        num_warps=tiling.num_warps,
        num_stages=tiling.num_stages if on_gpu else 1,
    )
    return out


_workspaces: dict[torch.device, torch.Tensor] = {}


def _stream_k_workspace(device: torch.device, floats: int) -> torch.Tensor:
    """Per-device fp32 accumulators, zero between launches (the finishing program of each tile
    zeroes what it used), grown on demand; launches on one stream share it."""
    buf = _workspaces.get(device)
    if buf is None or buf.numel() < floats:
        buf = _workspaces[device] = torch.zeros(floats, dtype=torch.float32, device=device)
    return buf


def stream_k_programs(tiles: int, ksteps: int, sms: int, per_sm: int) -> int:
    """The stream-K grid: one wave of `per_sm` programs an SM, but never more than 2 per column
    tile, so every tile's partial sums are at most two fp32 adds into a zeroed slot. a + b is
    b + a, so the output has the same bits whichever program adds first, and greedy decoding
    repeats itself (three adds would not: (a + b) + c may differ from (a + c) + b). Up to
    `tiles` programs each range spans a tile's K steps or more; exactly 2 a tile splits each
    tile's K at one point."""
    slots = sms * per_sm
    if ksteps >= 2 and 2 * tiles <= slots:
        return 2 * tiles
    return max(1, min(tiles, slots))


def _stream_k_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    tiling: DecodeTiling,
) -> torch.Tensor:
    m, k = x.shape
    n = weight.shape[0]
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    tiles, ksteps = triton.cdiv(n, tiling.bn), k // tiling.bk
    on_gpu = x.is_cuda
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count if on_gpu else 4
    programs = stream_k_programs(tiles, ksteps, sms, tiling.stream_k)
    workspace = _stream_k_workspace(x.device, tiles * tiling.bn * 16)
    arrivals = _arrival_counters(x.device, tiles)
    fp8 = scale is not None
    if on_gpu:
        dot = tl.float16 if fp8 else (tl.bfloat16 if x.dtype == torch.bfloat16 else tl.float16)
    else:
        dot = dot_dtype(x.device)
    _gemv_stream_k_kernel[(programs,)](
        x,
        weight,
        scale if scale is not None else weight,
        bias if bias is not None else weight,
        out,
        workspace,
        arrivals,
        m,
        n,
        ksteps,
        tiles * ksteps,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        BM=16,
        BN=tiling.bn,
        BK=tiling.bk,
        HAS_SCALE=fp8,
        HAS_BIAS=bias is not None,
        DOT=dot,
        num_warps=tiling.num_warps,
        num_stages=tiling.num_stages if on_gpu else 1,
    )
    return out


def _gemv_dot(x: torch.Tensor, fp8: bool) -> Any:
    """The dtype a decode GEMV's dot runs in: fp8 weights widen to fp16 on a GPU."""
    if not x.is_cuda:
        return dot_dtype(x.device)
    return tl.float16 if fp8 else (tl.bfloat16 if x.dtype == torch.bfloat16 else tl.float16)


@kernel
def _gemv_silu_mul_kernel(
    x,
    w,
    scale,
    out,
    M,
    F,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT: tl.constexpr,
    PDL: tl.constexpr,
):
    """out [M, F] = silu(x W_gate^T) * (x W_up^T) for a gate|up weight [2F, K] (gate rows first):
    each program takes BN gate channels and the same BN up channels, two weight tiles per K step
    beside one x tile, and forms the activation in its epilogue, rounded as the unfused path
    rounds (gate|up output, then silu, then the product, each in out's dtype). The MLP's
    activation then costs no launch and its [M, 2F] intermediate is never written."""
    pid_n = tl.program_id(0)
    rn = pid_n * BN + tl.arange(0, BN)
    rm = tl.arange(0, BM)
    rk = tl.arange(0, BK)
    n_ok = (rn < F)[:, None]
    gate_rows = w + rn[:, None].to(tl.int64) * stride_wn
    up_rows = gate_rows + F.to(tl.int64) * stride_wn
    x_rows = x + rm[:, None] * stride_xm
    pdl_wait(PDL)
    acc_gate = tl.zeros((BN, BM), dtype=tl.float32)
    acc_up = tl.zeros((BN, BM), dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + rk
        if EVEN_K:
            w_mask = n_ok
            x_mask = (rm < M)[:, None]
        else:
            w_mask = n_ok & (kk < K)[None, :]
            x_mask = (rm < M)[:, None] & (kk < K)[None, :]
        wg = tl.load(gate_rows + kk[None, :], mask=w_mask, other=0.0)
        wu = tl.load(up_rows + kk[None, :], mask=w_mask, other=0.0)
        xt = tl.trans(tl.load(x_rows + kk[None, :], mask=x_mask, other=0.0).to(DOT))
        acc_gate += tl.dot(wg.to(DOT), xt)
        acc_up += tl.dot(wu.to(DOT), xt)
    if HAS_SCALE:
        acc_gate = acc_gate * tl.load(scale + rn, mask=rn < F, other=0.0)[:, None]
        acc_up = acc_up * tl.load(scale + F + rn, mask=rn < F, other=0.0)[:, None]
    gate = acc_gate.to(out.dtype.element_ty).to(tl.float32)
    up = acc_up.to(out.dtype.element_ty).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out.dtype.element_ty).to(tl.float32)
    tl.store(
        out + rm[None, :] * stride_om + rn[:, None],
        (act * up).to(out.dtype.element_ty),
        mask=n_ok & (rm < M)[None, :],
    )


# The fused gate|up GEMV per (2F, K, fp8 weights): bench/engine/suite.py's sweep stores the fastest
# measured tiling, or None where the projection then silu_mul (two launches) measured faster.
# Preset with the H200 results at the Qwen3.6-27B MLP (bench/results/2026-11-29-h200-*-gpu_suite*
# .json of 7e5e0dd to 2a49ccd): fp8 49.0 us fused against 54.4 for two launches; bf16 88.9
# against 88.0, so two launches.
SILU_MUL_TILINGS: dict[tuple[int, int, bool], DecodeTiling | None] = {
    (34816, 5120, True): DecodeTiling(32, 256, 1, 2, 2),
    (34816, 5120, False): None,
}


def silu_mul_tiling(f: int, k: int, fp8: bool) -> DecodeTiling:
    """Tiles of the fused gate|up GEMV (`bn` channels of each half per program): the gate|up
    GEMV's own tiling halved where that runs in one K range as plain tiles (the same weight
    bytes and x tile per program, H200 gate|up winner: 64 x 128, 2 warps, 3 stages), else
    32 + 32 channels, 128 of K, 2 warps, 3 stages."""
    table = DECODE_TILINGS if fp8 else BF16_DECODE_TILINGS
    whole = table.get((2 * f, k)) or (default_tiling(2 * f, k) if fp8 else None)
    if whole and whole.splits == 1 and not (whole.two_pass or whole.stream_k or whole.act_fp8):
        return DecodeTiling(max(16, whole.bn // 2), whole.bk, 1, whole.num_warps, whole.num_stages)
    return DecodeTiling(32, 128, 1, 2, 3)


def linear_silu_mul(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor | None,
    bias: torch.Tensor | None = None,
    tiling: DecodeTiling | None = None,
) -> torch.Tensor:
    """silu(gate) * up of x [..., K] times a fused gate|up weight [2F, K] (fp8 with scales [2F],
    or 16-bit with scale None) -> [..., F]: decode rows (<= 16, no bias) in one GEMV launch
    whose epilogue forms the activation; other calls as the projection, then silu_mul."""
    rows = x.reshape(-1, x.shape[-1])
    two_f, k = weight.shape
    fp8 = weight.dtype == torch.float8_e4m3fn
    unfused = False
    if tiling is None and (two_f, k, fp8) in SILU_MUL_TILINGS:
        tiling = SILU_MUL_TILINGS[(two_f, k, fp8)]
        unfused = tiling is None
    if rows.shape[0] > 16 or bias is not None or two_f % 2 or unfused:
        gate_up = linear(x, weight, bias) if scale is None else fp8_linear(x, weight, scale, bias)
        return silu_mul(gate_up)
    if fp8 != (scale is not None):
        raise ValueError("fp8 weights take a scale, 16-bit weights none")
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m, f = rows.shape[0], two_f // 2
    tiling = tiling or silu_mul_tiling(f, k, fp8)
    out = torch.empty((m, f), dtype=x.dtype, device=x.device)
    _gemv_silu_mul_kernel[(triton.cdiv(f, tiling.bn),)](
        rows,
        weight,
        scale if scale is not None else weight,
        out,
        m,
        f,
        k,
        rows.stride(0),
        weight.stride(0),
        out.stride(0),
        BM=16,
        BN=tiling.bn,
        BK=tiling.bk,
        HAS_SCALE=scale is not None,
        EVEN_K=k % tiling.bk == 0,
        DOT=_gemv_dot(x, fp8),
        num_warps=tiling.num_warps,
        num_stages=tiling.num_stages if x.is_cuda else 1,
    )
    return out.view(*x.shape[:-1], f)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    beside_previous: bool = False,
) -> torch.Tensor:
    """16-bit linear: the one-launch GEMV for decode rows where the sweep found it faster than
    cuBLAS (BF16_DECODE_TILINGS), F.linear everywhere else. beside_previous: see `w8_gemv`."""
    rows = x.reshape(-1, x.shape[-1])
    n, k = weight.shape
    tiling = BF16_DECODE_TILINGS.get((n, k)) if rows.shape[0] <= 16 else None
    if tiling is None or weight.dtype != x.dtype:
        return torch.nn.functional.linear(x, weight, bias)
    out = w8_gemv(rows, weight, None, bias, tiling, beside_previous)
    return out.view(*x.shape[:-1], weight.shape[0])


@kernel
def _quantize_rows_kernel(
    x,
    q,
    scales,
    K,
    stride_x,
    BK: tl.constexpr,
    FP8_MAX: tl.constexpr,
    EXACT_E4M3: tl.constexpr,
    SPLIT: tl.constexpr,
    PDL: tl.constexpr,
):
    """One row of x rounded to e4m3 over its amax / FP8_MAX. EXACT_E4M3 (CPU): rounded in fp32
    first, as the interpreter's own cast loses carries (`_round_to_e4m3`). SPLIT > 0: each
    block of SPLIT columns is stored even columns first, then odd (`int4_gemm.wide_x_e4m3`)."""
    pdl_wait(PDL)
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
        v = xr.to(tl.float32) / scale
        if EXACT_E4M3:
            v = _round_to_e4m3(v)
        dest = k0 + cols
        if SPLIT > 0:
            j = dest % SPLIT
            dest = dest - j + (j % 2) * (SPLIT // 2) + j // 2
        tl.store(q + row * K + dest, v.to(q.dtype.element_ty), mask=k0 + cols < K)


def quantize_rows(x: torch.Tensor, split: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (per-token) e4m3 quantization: q [M, K] fp8 and scales [M, 1] fp32, x ~ q * s.
    `split` > 0 (a divisor of K): each block of that many columns of q holds x's even columns
    first, then its odd ones."""
    m, k = x.shape
    if split and (k % split or split % 2):
        raise ValueError(f"quantize_rows: K ({k}) must be whole even blocks of {split}")
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if x.stride(1) != 1:
        x = x.contiguous()
    _quantize_rows_kernel[(m,)](
        x, q, scales, k, x.stride(0), BK=min(4096, triton.next_power_of_2(k)), FP8_MAX=FP8_MAX,
        EXACT_E4M3=not x.is_cuda, SPLIT=split,
    )  # fmt: skip
    return q, scales


@kernel
def _quantize_blocks_kernel(
    x,
    q,
    scales,
    M,
    rows,
    K,
    stride_x,
    BLOCK: tl.constexpr,
    NB: tl.constexpr,
    FP8_MAX: tl.constexpr,
    EXACT_E4M3: tl.constexpr,
    SILU_PAIRED: tl.constexpr,
    PDL: tl.constexpr,
):
    """NB blocks of BLOCK columns of one row of x, each rounded to e4m3 over its own amax; the
    scales go to [K / BLOCK, rows] (column-major [rows, K / BLOCK], as cuBLAS's blockwise GEMM
    reads them). Rows from M to `rows` are padding: zero codes. SILU_PAIRED > 0: x is a gate|up
    output [M, 2K] whose columns alternate that many gate and up columns, and the values
    rounded are silu(gate) * up as `silu_mul` rounds them (never stored in 16 bits)."""
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    first = tl.program_id(1) * NB
    b = first + tl.arange(0, NB)
    cols = b[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    ok = cols < K
    src = tl.minimum(row, M - 1)  # padding rows read the last row, then zero it
    if SILU_PAIRED:
        gate_cols = (cols // SILU_PAIRED) * (2 * SILU_PAIRED) + cols % SILU_PAIRED
        gate = tl.load(x + src * stride_x + gate_cols, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(x + src * stride_x + gate_cols + SILU_PAIRED, mask=ok, other=0.0)
        xr = silu_times(gate, up.to(tl.float32), x.dtype.element_ty).to(tl.float32)
    else:
        xr = tl.load(x + src * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    xr = tl.where(row < M, xr, 0.0)
    scale = tl.maximum(tl.max(tl.abs(xr), 1) / FP8_MAX, 1e-12)
    tl.store(scales + b.to(tl.int64) * rows + row, scale, mask=b * BLOCK < K)
    v = xr / scale[:, None]
    if EXACT_E4M3:
        v = _round_to_e4m3(v)
    tl.store(q + row * K + cols, v.to(q.dtype.element_ty), mask=ok)


def quantize_blocks(
    x: torch.Tensor, block: int = 128, row_multiple: int = 1, silu_paired: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-(token, block of `block` columns) e4m3 quantization: q [R, K] fp8 and scales [R,
    K / block] fp32 with strides (1, R), x ~ q * s blockwise (cuBLAS's 1x128 scaling). R is M
    rounded up to `row_multiple`; the rows past M are zero. `silu_paired` > 0: x is a gate|up
    output [M, 2K] in pairs of that many gate and up columns (`silu_mul(x, paired)`), and
    what is quantized is its activation silu(gate) * up [M, K]."""
    m, k = x.shape
    if silu_paired:
        k //= 2
    if k % block:
        raise ValueError(f"quantize_blocks needs K ({k}) in blocks of {block}")
    rows = -(-m // row_multiple) * row_multiple
    q = torch.empty((rows, k), dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty((k // block, rows), dtype=torch.float32, device=x.device)
    if x.stride(1) != 1:
        x = x.contiguous()
    if rows:
        nb = min(8, triton.next_power_of_2(k // block))
        _quantize_blocks_kernel[(rows, triton.cdiv(k // block, nb))](
            x, q, scales, m, rows, k, x.stride(0), BLOCK=block, NB=nb, FP8_MAX=FP8_MAX,
            EXACT_E4M3=not x.is_cuda, SILU_PAIRED=silu_paired,
        )  # fmt: skip
    return q, scales.t()


@kernel
def _silu_mul_quantize_rows_kernel(
    y,
    q,
    scales,
    F,
    stride_y,
    BK: tl.constexpr,
    FP8_MAX: tl.constexpr,
    EXACT_E4M3: tl.constexpr,
    PDL: tl.constexpr,
    PAIRED: tl.constexpr = 0,
):
    """quantize_rows(silu_mul(y)) for one row of a gate|up output y [., 2F]: the activation is
    rounded to y's dtype as `silu_mul` rounds it, so the codes and scale have the same bits, but
    it never goes to memory (computed twice instead: for the row's amax, then for its codes).
    PAIRED > 0: y's columns alternate that many gate and up columns (`silu_mul(y, PAIRED)`)."""
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BK)
    amax = tl.zeros((BK,), dtype=tl.float32)
    for k0 in range(0, F, BK):
        h = _silu_mul_cols(y, row, stride_y, F, k0 + cols, PAIRED)
        amax = tl.maximum(amax, tl.abs(h))
    scale = tl.maximum(tl.max(amax, 0) / FP8_MAX, 1e-12)
    tl.store(scales + row, scale)
    for k0 in range(0, F, BK):
        v = _silu_mul_cols(y, row, stride_y, F, k0 + cols, PAIRED) / scale
        if EXACT_E4M3:
            v = _round_to_e4m3(v)
        tl.store(q + row * F + k0 + cols, v.to(q.dtype.element_ty), mask=k0 + cols < F)


@triton.jit
def _silu_mul_cols(y, row, stride_y, F, cols, PAIRED: tl.constexpr):
    """silu(gate) * up at `cols` of one row, in fp32 after each rounding `silu_mul` does."""
    mask = cols < F
    if PAIRED:
        gate_cols = (cols // PAIRED) * (2 * PAIRED) + cols % PAIRED
        up_cols = gate_cols + PAIRED
    else:
        gate_cols, up_cols = cols, F + cols
    gate = tl.load(y + row * stride_y + gate_cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(y + row * stride_y + up_cols, mask=mask, other=0.0).to(tl.float32)
    return silu_times(gate, up, y.dtype.element_ty).to(tl.float32)


def silu_mul_quantize_rows(y: torch.Tensor, paired: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows(silu_mul(y, paired)) for a gate|up output y [M, 2F], without the [M, F]
    16-bit activation between them: codes [M, F] e4m3 and scales [M, 1] fp32. `paired` > 0:
    y's columns alternate that many gate and up columns (an int4-mma gate|up's paired tiles)."""
    m, two_f = y.shape
    f = two_f // 2
    q = torch.empty((m, f), dtype=torch.float8_e4m3fn, device=y.device)
    scales = torch.empty((m, 1), dtype=torch.float32, device=y.device)
    if y.stride(1) != 1:
        y = y.contiguous()
    if m:
        _silu_mul_quantize_rows_kernel[(m,)](
            y, q, scales, f, y.stride(0), BK=min(4096, triton.next_power_of_2(f)), FP8_MAX=FP8_MAX,
            EXACT_E4M3=not y.is_cuda, PAIRED=paired,
        )  # fmt: skip
    return q, scales


def scaled_mm(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    x_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """FP8 tensor-core GEMM: per-token quantized x times the per-channel scaled fp8 weight. With
    `x_scale`, x is rounded per token already (e4m3) and the output is `out_dtype`."""
    q, x_scales = (x, x_scale) if x_scale is not None else quantize_rows(x)
    out = torch._scaled_mm(
        q,
        weight.t(),
        scale_a=x_scales,
        scale_b=scale.view(1, -1),
        out_dtype=out_dtype or x.dtype,
    )
    return out if bias is None else out + bias


# Past the decode rows (prefill steps, where scaled_mm rounds its input per token anyway) the down
# projection takes silu(gate) * up as e4m3 codes straight from the gate|up output
# (`fp8_linear_of_silu_mul`); TOKENMILL_FP8_FUSED_SILU_QUANT=0 forms the 16-bit activation first.
# Not at 17-64 rows: there its one program a row left most SMs idle, and on one H200 the C = 64
# step took 16.16 ms against 15.14 with silu_mul then the wide GEMV (docs/performance.md).
FP8_FUSED_SILU_QUANT = os.environ.get("TOKENMILL_FP8_FUSED_SILU_QUANT", "1") != "0"
FP8_FUSED_SILU_QUANT_MIN_ROWS = 65


def _wide_tiling(weight: torch.Tensor, m: int) -> DecodeTiling | None:
    """The measured tiling for a 17-64-row decode batch of `weight` (None: not measured, other
    rows, or TOKENMILL_FP8_WIDE_GEMV=0)."""
    if not (FP8_WIDE_GEMV and 16 < m <= 64):
        return None
    return WIDE_DECODE_TILINGS.get((*weight.shape, wide_rows(m)))


def fp8_linear_of_silu_mul(
    y: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """fp8_linear(silu_mul(y)) for a gate|up output y [..., 2F] and the down projection's e4m3
    weight [N, F]: from FP8_FUSED_SILU_QUANT_MIN_ROWS rows one kernel forms the activation and
    the per-token e4m3 codes scaled_mm takes, so the 16-bit activation is never written (at a
    4,096-token prefill step, 143 MB written and read back a layer)."""
    rows = y.reshape(-1, y.shape[-1])
    m = rows.shape[0]
    if not (
        FP8_FUSED_SILU_QUANT and m >= max(FP8_FUSED_SILU_QUANT_MIN_ROWS, FP8_SCALED_MM_MIN_ROWS)
    ):
        return fp8_linear(silu_mul(y), weight, scale, bias)
    q, x_scale = silu_mul_quantize_rows(rows)
    out = scaled_mm(q, weight, scale, bias, x_scale=x_scale, out_dtype=y.dtype)
    return out.view(*y.shape[:-1], weight.shape[0])


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., K] -> [..., N]: w8_gemv up to FP8_GEMV_MAX_ROWS rows, and at 17-64 rows where
    WIDE_DECODE_TILINGS has the shape; w8a16 below FP8_SCALED_MM_MIN_ROWS, scaled_mm from there."""
    rows = x.reshape(-1, x.shape[-1])
    m = rows.shape[0]
    wide = _wide_tiling(weight, m)
    if wide is not None:
        out = w8_gemv(rows, weight, scale, bias, wide)
    elif m >= FP8_SCALED_MM_MIN_ROWS:
        out = scaled_mm(rows, weight, scale, bias)
    elif m <= max(16, FP8_GEMV_MAX_ROWS):
        out = w8_gemv(rows, weight, scale, bias)
    else:
        out = w8a16(rows, weight, scale, bias)
    return out.view(*x.shape[:-1], weight.shape[0])
