"""Int4 weight GEMMs (docs/worker-contract.md, "Int4 weights"): y = x @ dequant(qweight).T + bias.

Two paths, picked by the number of rows (tokens) of x:
- decode (M <= `INT4_GEMV_MAX_ROWS`, default 64): `int4_gemv`, one triton launch that streams the
  packed weight once as the dot's left operand (out^T = W x^T), as fp8_gemm's w8_gemv does. Each
  [BN, KS/2] byte tile (KS = one group, or a part of one) is split into its low nibbles (even k)
  and high nibbles (odd k) in registers, turned into exact 16-bit codes, and dotted against x's
  even and odd columns: two dots, no interleave. The group's scale multiplies the fp32 partial
  sum; affine mins add m * sum_k x. K is split across programs (the last program to arrive at a
  column tile sums the fp32 partials: no second launch) or cut into equal stream-K ranges.
  `int4_gemv_silu_mul` is the same GEMV over a fused gate|up weight with the MLP's activation in
  its epilogue. Tilings per (N, K) come from `INT4_DECODE_TILINGS` (bench/kernels/int4.py sweeps
  them at the real shapes and prints entries to paste), else from `default_tiling`.
- prefill (more rows): `int4_dequantize` writes the 16-bit weight (or e4m3 with per-channel scales,
  `TOKENMILL_INT4_PREFILL=fp8`) into one reusable scratch per device, then cuBLAS (`F.linear`) or
  fp8_gemm's `scaled_mm` runs on it: the dequant costs one weight write + read, small next to the
  GEMM's time at prefill sizes. `=w4a8` writes the codes alone (exact in e4m3) and `w4a8_gemm`
  applies the group scales to FP8 tensor-core sums, so only x is rounded.
- decode at 17-64 rows, opt-in (`TOKENMILL_INT4_W4A8_ROWS`): `w4a8_wide`, the codes turned to
  e4m3 in registers and dotted with x rounded per token on FP8 tensor cores.

Codes become 16-bit floats exactly (0..15, minus 8 when symmetric) with the exponent trick: the
code OR'ed into the mantissa of 1024 (fp16) or 128 (bf16) is 1024 + q (128 + q) exactly, so one
integer OR and one subtract replace an int -> float conversion (a quarter-rate instruction on
sm_90 that would cap the GEMV well below the HBM bandwidth). The dot runs in x's dtype, so bf16
activations are never rounded to fp16.

Size: Every int4 matmul of one weight format (decode GEMV, prefill paths) with launchers and
tilings.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from worker.kernels.triton._launch import dot_dtype, kernel, pdl_wait
from worker.kernels.triton.activations import silu_mul
from worker.kernels.triton.fp8_gemm import (
    _arrival_counters,
    _gemv_epilogue,
    _round_to_e4m3,
    _split_k,
    _stream_k_count,
    _stream_k_workspace,
    _sum_splits,
    quantize_blocks,
    quantize_rows,
    scaled_mm,
    stream_k_programs,
)

INT4_GEMV_MAX_ROWS = int(os.environ.get("TOKENMILL_INT4_GEMV_MAX_ROWS", "64"))
# How prefill rows multiply int4 weights (TOKENMILL_INT4_PREFILL): "bf16", dequantized into a
# 16-bit scratch for cuBLAS; "fp8", into e4m3 over per-channel scales for scaled_mm (each weight
# rounded to e4m3: +2.4% perplexity on SmolLM2); "w4a8", the codes exactly in e4m3 and
# `w4a8_linear` applying the group scales to its fp32 sums (symmetric weights; only the
# activations are rounded, per token, as FP8's prefill rounds them: +0.7% on SmolLM2); "auto"
# (the default), "w4a8" where cuBLAS's blockwise GEMM runs it (on one H200 a W4 prefill step of
# 2,048 tokens took 151 against 185 ms through the bf16 scratch), else "bf16" (the Triton W4A8
# GEMM measured slower than the scratch).
PREFILL_PATHS = ("auto", "bf16", "fp8", "w4a8")


def prefill_path(value: str) -> str:
    """A TOKENMILL_INT4_PREFILL value, checked: a typo would otherwise run bf16 silently."""
    path = value.strip().lower() or "auto"
    if path not in PREFILL_PATHS:
        raise ValueError(f"TOKENMILL_INT4_PREFILL={value!r}: expected one of {PREFILL_PATHS}")
    return path


INT4_PREFILL = prefill_path(os.environ.get("TOKENMILL_INT4_PREFILL", "auto"))


def prefill_path_for(device: torch.device, group_size: int) -> str:
    """The prefill path INT4_PREFILL takes for a weight of `group_size` on `device`: "auto"
    resolved (W4A8 where cuBLAS's blockwise GEMM takes the groups, else bf16)."""
    if INT4_PREFILL != "auto":
        return INT4_PREFILL
    return "w4a8" if group_size % 128 == 0 and blockwise_runs(device) else "bf16"


_E4M3_MAX = 448.0


@dataclass(frozen=True)
class Int4Tiling:
    """How `int4_gemv` tiles one (N, K) weight: BN output channels x BK of K per loop step (BK a
    multiple of the group size, or a divisor of it), K split in `splits` ranges, or cut into one
    wave of equal stream-K ranges with `stream_k` programs per SM."""

    bn: int = 64
    bk: int = 128
    splits: int = 1
    num_warps: int = 2
    num_stages: int = 3
    stream_k: int = 0
    # how the nibbles meet x: 1 dots the low (even k) and high (odd k) codes against x's even
    # and odd columns, split in registers; 2 re-interleaves the codes (join) for one dot with
    # contiguous x; 0 loads x's even/odd columns with stride 2 (not async-copied: 2x slower)
    x_mode: int = 1
    # codes to 16-bit (GPU): 2 the exponent trick in PTX on packed registers (`_nibbles_ptx`),
    # 1 the same trick in triton ops, 0 a plain int -> float conversion (H200 gate|up, M = 8,
    # 64 x 128 tiles: 2 warps 46.9 us with 2, 4 warps 56-58 us with 2 or 1, 109 us with 0)
    fast_cvt: int = 2


# The fastest measured tiling per weight shape (bench/kernels/int4.py prints these entries), at
# M = 8 on the H200 (run 3; group 128; copy 4.24 TB/s; FP8 w8_gemv at the same shape beside).
INT4_DECODE_TILINGS: dict[tuple[int, int], Int4Tiling] = {
    (34816, 5120): Int4Tiling(64, 256, 2, 2, 3),  # mlp gate|up: 46.8 us, 47% (fp8 50.2 us)
    (5120, 17408): Int4Tiling(64, 256, 7, 2, 3),  # mlp down: 29.4 us, 37% (fp8 29.1 us)
    (16384, 5120): Int4Tiling(64, 128, 3, 2, 3),  # deltanet qkv|z: 22.6 us, 46% (fp8 25.3)
    (14336, 5120): Int4Tiling(64, 128, 3, 2, 3),  # attention q|gate,k,v: 22.3 us, 41% (24.5)
    (5120, 6144): Int4Tiling(64, 256, 6, 2, 3),  # deltanet out / attention o: 12.5 us (13.8)
}
# The fused gate|up + silu*mul GEMV per fused weight shape (2F, K); None: the projection then
# silu_mul measured faster (H200 run 3, the 27B MLP at M = 8: fused 51.7 us, two launches 48.6).
INT4_SILU_MUL_TILINGS: dict[tuple[int, int], Int4Tiling | None] = {(34816, 5120): None}


def default_tiling(n: int, k: int, group_size: int = 128, sms: int = 132) -> Int4Tiling:
    """64 channels x 128 of K per step (64 bytes of each weight row: four 16-byte loads) on 2
    warps (mma.sync: 20% faster than 4 warps on wgmma in the H200 probe), K split so that ~4
    programs per SM stream weight, each over at least 4 K steps."""
    bk = _compatible_bk(128, group_size)
    tiles, steps = triton.cdiv(n, 64), triton.cdiv(k, bk)
    splits = max(1, min(triton.cdiv(4 * sms, tiles), steps // 4))
    return Int4Tiling(64, bk, splits)


def _compatible_bk(bk: int, group_size: int) -> int:
    """A BK whose steps each stay inside one group or cover whole groups (a power of two >= 32,
    as the dots need 16 of each nibble half)."""
    if bk % group_size == 0 or group_size % bk == 0:
        return bk
    return group_size


def _gemv_supports(k: int, group_size: int) -> bool:
    """The GEMV's steps are powers of two >= 32 that stay inside one group."""
    return k % 2 == 0 and group_size >= 32 and group_size & (group_size - 1) == 0


# ---------------------------------------------------------------- device functions


@triton.jit
def _codes(b, DOT: tl.constexpr, OFFSET: tl.constexpr, FAST: tl.constexpr, MAGIC: tl.constexpr,
           MAGIC_F: tl.constexpr):  # fmt: skip
    """The low (even k) and high (odd k) nibbles of packed bytes b as DOT values q - OFFSET,
    exactly. FAST: the code OR'ed into the mantissa of MAGIC_F (bits MAGIC), minus MAGIC_F."""
    if FAST == 2:  # the same trick in PTX on packed registers: 4 bytes -> 8 codes
        return _codes_asm(b, DOT, OFFSET)
    lo = b & 0xF
    hi = b >> 4
    if FAST:
        lo = (lo.to(tl.uint16) | MAGIC).to(DOT, bitcast=True) - (MAGIC_F + OFFSET)
        hi = (hi.to(tl.uint16) | MAGIC).to(DOT, bitcast=True) - (MAGIC_F + OFFSET)
    else:
        lo = lo.to(DOT) - OFFSET
        hi = hi.to(DOT) - OFFSET
    return lo, hi


def _nibbles_ptx(magic: str, neg: str, ty: str) -> str:
    """PTX of one byte quad -> 4 low and 4 high codes: bytes b0..b3 spread to 16-bit lanes (prmt),
    each nibble masked into the mantissa of the magic number (lop3) and magic (+ 8 when
    symmetric) subtracted two lanes at a time: 12 instructions per 8 codes, where the
    elementwise form costs ~5 per code (H200 run 2's PTX)."""
    return (
        "{\n.reg .b32 t0, t1, t2, t3, z, c;\nmov.b32 z, 0;\n"
        f"mov.b32 c, {neg};\n"
        "prmt.b32 t0, $4, z, 0x4140;\nprmt.b32 t1, $4, z, 0x4342;\n"
        "shr.u32 t2, t0, 4;\nshr.u32 t3, t1, 4;\n"
        f"lop3.b32 $0, t0, 0x000f000f, {magic}, 0xea;\n"
        f"lop3.b32 $1, t1, 0x000f000f, {magic}, 0xea;\n"
        f"lop3.b32 $2, t2, 0x000f000f, {magic}, 0xea;\n"
        f"lop3.b32 $3, t3, 0x000f000f, {magic}, 0xea;\n"
        f"add.{ty} $0, $0, c;\nadd.{ty} $1, $1, c;\nadd.{ty} $2, $2, c;\nadd.{ty} $3, $3, c;\n}}"
    )


# (magic, -(magic value + offset)): bf16 128 + q, fp16 1024 + q; symmetric codes are q - 8
_PTX_BF16_SYM: tl.constexpr = tl.constexpr(_nibbles_ptx("0x43004300", "0xC308C308", "bf16x2"))
_PTX_BF16_AFF: tl.constexpr = tl.constexpr(_nibbles_ptx("0x43004300", "0xC300C300", "bf16x2"))
_PTX_F16_SYM: tl.constexpr = tl.constexpr(_nibbles_ptx("0x64006400", "0xE408E408", "f16x2"))
_PTX_F16_AFF: tl.constexpr = tl.constexpr(_nibbles_ptx("0x64006400", "0xE400E400", "f16x2"))


@triton.jit
def _codes_asm(b, DOT: tl.constexpr, OFFSET: tl.constexpr):
    """`_codes` in PTX on packed registers, 4 bytes (8 codes) per instance."""
    if DOT == tl.bfloat16:
        if OFFSET == 8.0:
            lo, hi = tl.inline_asm_elementwise(
                _PTX_BF16_SYM, "=r,=r,=r,=r,r", [b], (tl.bfloat16, tl.bfloat16), True, 4
            )
        else:
            lo, hi = tl.inline_asm_elementwise(
                _PTX_BF16_AFF, "=r,=r,=r,=r,r", [b], (tl.bfloat16, tl.bfloat16), True, 4
            )
    else:
        if OFFSET == 8.0:
            lo, hi = tl.inline_asm_elementwise(
                _PTX_F16_SYM, "=r,=r,=r,=r,r", [b], (tl.float16, tl.float16), True, 4
            )
        else:
            lo, hi = tl.inline_asm_elementwise(
                _PTX_F16_AFF, "=r,=r,=r,=r,r", [b], (tl.float16, tl.float16), True, 4
            )
    return lo, hi


@triton.jit
def _x_chunk(x_rows, m_ok, k0, K, KS: tl.constexpr, MASK_K: tl.constexpr, HAS_MINS: tl.constexpr,
             XMODE: tl.constexpr):  # fmt: skip
    """x's columns k0 .. k0 + KS - 1: (even, odd, sum over the chunk per row) for the two-dot
    modes, (all, all, sum) for the interleaved mode. The sum (fp32) feeds the affine mins."""
    HALF: tl.constexpr = KS // 2
    if XMODE == 0:
        ke = k0 + 2 * tl.arange(0, HALF)
        mask = m_ok
        if MASK_K:
            mask = m_ok & (ke < K)[None, :]
        xa = tl.load(x_rows + ke[None, :], mask=mask, other=0.0)
        xb = tl.load(x_rows + ke[None, :] + 1, mask=mask, other=0.0)
    else:
        kk = k0 + tl.arange(0, KS)
        mask = m_ok
        if MASK_K:
            mask = m_ok & (kk < K)[None, :]
        xa = tl.load(x_rows + kk[None, :], mask=mask, other=0.0)
        xb = xa
        if XMODE == 1:
            xa, xb = tl.split(tl.reshape(xa, (xa.shape[0], HALF, 2)))
    xsum = tl.zeros((xa.shape[0],), dtype=tl.float32)
    if HAS_MINS:
        xsum = tl.sum(xa.to(tl.float32), axis=1)
        if XMODE != 2:
            xsum += tl.sum(xb.to(tl.float32), axis=1)
    return xa, xb, xsum


@triton.jit
def _group_params(s_rows, m_rows, rn, N, k0, K, SUB: tl.constexpr, KS: tl.constexpr,
                  GROUP: tl.constexpr, HAS_MINS: tl.constexpr):  # fmt: skip
    """fp32 scales (and mins) [BN, SUB] of the SUB chunks of the step at k0. The kernels load
    them a step ahead: they are 2-byte gathers (no async copy), so a load in the step that uses
    them would stall it for a full L2 round trip."""
    kc = k0 + tl.arange(0, SUB) * KS
    g = kc // GROUP
    mask = (rn < N)[:, None] & (kc < K)[None, :]
    s = tl.load(s_rows[:, None] + g[None, :], mask=mask, other=0.0).to(tl.float32)
    m = tl.zeros_like(s)
    if HAS_MINS:
        m = tl.load(m_rows[:, None] + g[None, :], mask=mask, other=0.0).to(tl.float32)
    return s, m


@triton.jit
def _col(t, j: tl.constexpr, SUB: tl.constexpr):
    """Column j of a [BN, SUB] register tile."""
    return tl.sum(tl.where(tl.arange(0, SUB)[None, :] == j, t, 0.0), axis=1)


@triton.jit
def _w_chunk(q_rows, n_ok, k0, K, xa, xb, xsum, s, mn, KS: tl.constexpr, MASK_K: tl.constexpr,
             HAS_MINS: tl.constexpr, XMODE: tl.constexpr, DOT: tl.constexpr, FAST: tl.constexpr,
             MAGIC: tl.constexpr, MAGIC_F: tl.constexpr):  # fmt: skip
    """fp32 [BN, BM] contribution of weight columns k0 .. k0 + KS - 1 (inside one group): the
    codes' dot with x times the group's scale s [BN], plus its min mn times the chunk's x sum."""
    HALF: tl.constexpr = KS // 2
    kb = k0 // 2 + tl.arange(0, HALF)
    if MASK_K:
        b = tl.load(q_rows + kb[None, :], mask=n_ok & (kb < K // 2)[None, :], other=0)
    else:  # whole steps: a row-only mask keeps the 16-byte vector loads
        b = tl.load(q_rows + kb[None, :], mask=n_ok, other=0)
    if HAS_MINS:  # affine: w = q * s + m
        lo, hi = _codes(b, DOT, 0.0, FAST, MAGIC, MAGIC_F)
    else:  # symmetric: w = (q - 8) * s
        lo, hi = _codes(b, DOT, 8.0, FAST, MAGIC, MAGIC_F)
    if XMODE == 2:
        w = tl.reshape(tl.join(lo, hi), (lo.shape[0], KS))
        part = tl.dot(w, tl.trans(xa.to(DOT)))
    else:
        part = tl.dot(lo, tl.trans(xa.to(DOT)))
        part = tl.dot(hi, tl.trans(xb.to(DOT)), part)
    part = part * s[:, None]
    if HAS_MINS:
        part += mn[:, None] * xsum[None, :]
    return part


# ---------------------------------------------------------------- decode GEMV


@kernel
def _int4_gemv_kernel(
    x, qw, scales, mins, bias, out, partial, arrivals,
    M, N, K, k_per_split, splits, stride_xm, stride_qn, stride_sn, stride_om,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, KS: tl.constexpr, GROUP: tl.constexpr,
    HAS_MINS: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, EVEN_K: tl.constexpr,
    XMODE: tl.constexpr, DOT: tl.constexpr, FAST: tl.constexpr, MAGIC: tl.constexpr,
    MAGIC_F: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """out^T tile [BN, BM] over one K range (`k_per_split`, a multiple of BK). SPLIT: the range's
    fp32 partial goes to partial[split, M, N]; the program arriving last at the column tile sums
    the partials, adds bias, writes out and re-arms the tile's counter (as fp8_gemm's GEMV)."""
    pid_n, split = tl.program_id(0), tl.program_id(1)
    rn = pid_n * BN + tl.arange(0, BN)
    rm = tl.arange(0, BM)
    n_ok = (rn < N)[:, None]
    m_ok = (rm < M)[:, None]
    q_rows = qw + rn[:, None].to(tl.int64) * stride_qn
    s_rows = scales + rn.to(tl.int64) * stride_sn
    m_rows = s_rows  # (unused when symmetric)
    if HAS_MINS:
        m_rows = mins + rn.to(tl.int64) * stride_sn
    x_rows = x + rm[:, None] * stride_xm
    k_start = split * k_per_split
    pdl_wait(PDL)
    SUB: tl.constexpr = BK // KS
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    s_cur, m_cur = _group_params(s_rows, m_rows, rn, N, k_start, K, SUB, KS, GROUP, HAS_MINS)
    for k0 in range(k_start, tl.minimum(k_start + k_per_split, K), BK):
        s_nxt, m_nxt = _group_params(s_rows, m_rows, rn, N, k0 + BK, K, SUB, KS, GROUP, HAS_MINS)
        for sub in tl.static_range(SUB):
            kc = k0 + sub * KS
            xa, xb, xsum = _x_chunk(x_rows, m_ok, kc, K, KS, not EVEN_K, HAS_MINS, XMODE)
            acc += _w_chunk(
                q_rows, n_ok, kc, K, xa, xb, xsum, _col(s_cur, sub, SUB), _col(m_cur, sub, SUB),
                KS, not EVEN_K, HAS_MINS, XMODE, DOT, FAST, MAGIC, MAGIC_F,
            )  # fmt: skip
        s_cur, m_cur = s_nxt, m_nxt
    mask = n_ok & (rm < M)[None, :]
    if not SPLIT:
        _gemv_epilogue(acc, bias, bias, out, rn, rm, N, stride_om, mask, False, HAS_BIAS)
    else:
        total, last = _sum_splits(acc, partial, arrivals, pid_n, split, splits, M, N, rn, rm, mask)
        if last:
            _gemv_epilogue(total, bias, bias, out, rn, rm, N, stride_om, mask, False, HAS_BIAS)


@triton.jit
def _stream_k_params(scales, mins, rb, N, K, step, ksteps, stride_sn, BN: tl.constexpr,
                     BK: tl.constexpr, SUB: tl.constexpr, KS: tl.constexpr, GROUP: tl.constexpr,
                     HAS_MINS: tl.constexpr):  # fmt: skip
    """`_group_params` of flat stream-K step `step` (its tile's rows, its K step)."""
    tile = step // ksteps
    rn = tile * BN + rb
    s_rows = scales + rn.to(tl.int64) * stride_sn
    m_rows = s_rows
    if HAS_MINS:
        m_rows = mins + rn.to(tl.int64) * stride_sn
    k0 = (step - tile * ksteps) * BK
    return _group_params(s_rows, m_rows, rn, N, k0, K, SUB, KS, GROUP, HAS_MINS)


@kernel
def _int4_stream_k_kernel(
    x, qw, scales, mins, bias, out, workspace, arrivals,
    M, N, K, ksteps, total_steps, stride_xm, stride_qn, stride_sn, stride_om,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, KS: tl.constexpr, GROUP: tl.constexpr,
    HAS_MINS: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, XMODE: tl.constexpr,
    DOT: tl.constexpr, FAST: tl.constexpr, MAGIC: tl.constexpr, MAGIC_F: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """Stream-K (fp8_gemm's `_gemv_stream_k_kernel` over int4 steps): the (column tile, K step)
    work is cut into one equal contiguous range per program of a one-wave grid, so every SM
    streams the same number of weight bytes. Whole tiles are written directly; a range's partial
    tiles at its ends add fp32 into workspace[tile] and count their K steps at the tile's arrival
    counter, and the program completing the count writes the tile (fp8_gemm's `_stream_k_count`,
    which re-zeroes the workspace and the counter for the next launch)."""
    pid, programs = tl.program_id(0), tl.num_programs(0)
    start = (pid * total_steps) // programs
    stop = ((pid + 1) * total_steps) // programs
    first_tile = start // ksteps
    first_ks = start - first_tile * ksteps
    rm = tl.arange(0, BM)
    rb = tl.arange(0, BN)
    m_ok = (rm < M)[:, None]
    x_rows = x + rm[:, None] * stride_xm
    pdl_wait(PDL)
    SUB: tl.constexpr = BK // KS
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    s_cur, m_cur = _stream_k_params(scales, mins, rb, N, K, start, ksteps, stride_sn, BN, BK, SUB,
                                    KS, GROUP, HAS_MINS)  # fmt: skip
    # one flat loop over the range, so the weight pipeline runs on across tile boundaries; no
    # barrier or acquire/release atomic in it (either stops triton from pipelining the loads)
    for step in range(start, stop):
        tile = step // ksteps
        ks = step - tile * ksteps
        rn = tile * BN + rb
        n_ok = (rn < N)[:, None]
        q_rows = qw + rn[:, None].to(tl.int64) * stride_qn
        s_nxt, m_nxt = _stream_k_params(scales, mins, rb, N, K, step + 1, ksteps, stride_sn, BN,
                                        BK, SUB, KS, GROUP, HAS_MINS)  # fmt: skip
        for sub in tl.static_range(SUB):
            kc = ks * BK + sub * KS
            xa, xb, xsum = _x_chunk(x_rows, m_ok, kc, K, KS, not EVEN_K, HAS_MINS, XMODE)
            acc += _w_chunk(
                q_rows, n_ok, kc, K, xa, xb, xsum, _col(s_cur, sub, SUB), _col(m_cur, sub, SUB),
                KS, not EVEN_K, HAS_MINS, XMODE, DOT, FAST, MAGIC, MAGIC_F,
            )  # fmt: skip
        s_cur, m_cur = s_nxt, m_nxt
        if (ks == ksteps - 1) | (step == stop - 1):  # this tile's part of the range is done
            mask = n_ok & (rm < M)[None, :]
            if (tl.where(tile == first_tile, first_ks, 0) == 0) & (ks == ksteps - 1):
                _gemv_epilogue(acc, bias, bias, out, rn, rm, N, stride_om, mask, False, HAS_BIAS)
            else:
                slab = workspace + tile.to(tl.int64) * BN * BM + rb[:, None] * BM + rm[None, :]
                tl.atomic_add(slab, acc, mask=mask, sem="relaxed")
            acc = tl.zeros((BN, BM), dtype=tl.float32)
    tl.debug_barrier()  # every thread's workspace adds are done before the steps are counted
    last_tile = (stop - 1) // ksteps
    last_end = stop - last_tile * ksteps
    if first_tile == last_tile:
        if (first_ks > 0) | (last_end < ksteps):
            _stream_k_count(
                first_tile, last_end - first_ks, ksteps, workspace, arrivals, bias, bias, out,
                M, N, stride_om, BM, BN, False, HAS_BIAS,
            )  # fmt: skip
    else:
        if first_ks > 0:
            _stream_k_count(
                first_tile, ksteps - first_ks, ksteps, workspace, arrivals, bias, bias, out,
                M, N, stride_om, BM, BN, False, HAS_BIAS,
            )  # fmt: skip
        if last_end < ksteps:
            _stream_k_count(
                last_tile, last_end, ksteps, workspace, arrivals, bias, bias, out,
                M, N, stride_om, BM, BN, False, HAS_BIAS,
            )  # fmt: skip


@kernel
def _int4_silu_mul_kernel(
    x, qw, scales, mins, bias, out, partial, arrivals,
    M, F, K, k_per_split, splits, stride_xm, stride_qn, stride_sn, stride_om,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, KS: tl.constexpr, GROUP: tl.constexpr,
    HAS_MINS: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, EVEN_K: tl.constexpr,
    XMODE: tl.constexpr, DOT: tl.constexpr, FAST: tl.constexpr, MAGIC: tl.constexpr,
    MAGIC_F: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """out [M, F] = silu(x W_gate^T) * (x W_up^T) for a fused gate|up int4 weight [2F, K] (gate
    rows first; its scales and mins fused the same way): BN gate channels and the same BN up
    channels per program, one x chunk per two weight chunks. SPLIT: partials go to
    partial[split, M, 2F] and the last program to arrive at the column tile forms the
    activation. Rounded as the unfused path rounds (gate|up output, silu, product, each in out's
    dtype), so the [M, 2F] intermediate is never written."""
    pid_n, split = tl.program_id(0), tl.program_id(1)
    rn = pid_n * BN + tl.arange(0, BN)
    rm = tl.arange(0, BM)
    n_ok = (rn < F)[:, None]
    m_ok = (rm < M)[:, None]
    gate_q = qw + rn[:, None].to(tl.int64) * stride_qn
    up_q = gate_q + F.to(tl.int64) * stride_qn
    gate_s = scales + rn.to(tl.int64) * stride_sn
    up_s = gate_s + F.to(tl.int64) * stride_sn
    gate_m = gate_s
    up_m = up_s
    if HAS_MINS:
        gate_m = mins + rn.to(tl.int64) * stride_sn
        up_m = gate_m + F.to(tl.int64) * stride_sn
    x_rows = x + rm[:, None] * stride_xm
    k_start = split * k_per_split
    pdl_wait(PDL)
    SUB: tl.constexpr = BK // KS
    acc_gate = tl.zeros((BN, BM), dtype=tl.float32)
    acc_up = tl.zeros((BN, BM), dtype=tl.float32)
    gs_cur, gm_cur = _group_params(gate_s, gate_m, rn, F, k_start, K, SUB, KS, GROUP, HAS_MINS)
    us_cur, um_cur = _group_params(up_s, up_m, rn, F, k_start, K, SUB, KS, GROUP, HAS_MINS)
    for k0 in range(k_start, tl.minimum(k_start + k_per_split, K), BK):
        gs_nxt, gm_nxt = _group_params(gate_s, gate_m, rn, F, k0 + BK, K, SUB, KS, GROUP, HAS_MINS)
        us_nxt, um_nxt = _group_params(up_s, up_m, rn, F, k0 + BK, K, SUB, KS, GROUP, HAS_MINS)
        for sub in tl.static_range(SUB):
            kc = k0 + sub * KS
            xa, xb, xsum = _x_chunk(x_rows, m_ok, kc, K, KS, not EVEN_K, HAS_MINS, XMODE)
            acc_gate += _w_chunk(
                gate_q, n_ok, kc, K, xa, xb, xsum, _col(gs_cur, sub, SUB), _col(gm_cur, sub, SUB),
                KS, not EVEN_K, HAS_MINS, XMODE, DOT, FAST, MAGIC, MAGIC_F,
            )  # fmt: skip
            acc_up += _w_chunk(
                up_q, n_ok, kc, K, xa, xb, xsum, _col(us_cur, sub, SUB), _col(um_cur, sub, SUB),
                KS, not EVEN_K, HAS_MINS, XMODE, DOT, FAST, MAGIC, MAGIC_F,
            )  # fmt: skip
        gs_cur, gm_cur, us_cur, um_cur = gs_nxt, gm_nxt, us_nxt, um_nxt
    mask = n_ok & (rm < M)[None, :]
    if not SPLIT:
        _silu_mul_epilogue(acc_gate, acc_up, bias, out, rn, rm, F, stride_om, mask, HAS_BIAS)
    else:
        slab = (rm[None, :] * 2 * F + rn[:, None]).to(tl.int64)
        tl.store(partial + split * M * 2 * F + slab, acc_gate, mask=mask)
        tl.store(partial + split * M * 2 * F + F + slab, acc_up, mask=mask)
        tl.debug_barrier()  # every thread's partials are written before the arrival is counted
        arrived = tl.atomic_add(arrivals + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == splits - 1:
            acc_gate = tl.zeros((BN, BM), dtype=tl.float32)
            acc_up = tl.zeros((BN, BM), dtype=tl.float32)
            for s in range(0, splits):
                base = partial + s * M * 2 * F + slab
                acc_gate += tl.load(base, mask=mask, other=0.0, cache_modifier=".cg")
                acc_up += tl.load(base + F, mask=mask, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(arrivals + pid_n, 0)
            _silu_mul_epilogue(acc_gate, acc_up, bias, out, rn, rm, F, stride_om, mask, HAS_BIAS)


@triton.jit
def _silu_mul_epilogue(acc_gate, acc_up, bias, out, rn, rm, F, stride_om, mask,
                       HAS_BIAS: tl.constexpr):  # fmt: skip
    if HAS_BIAS:
        acc_gate += tl.load(bias + rn, mask=rn < F, other=0.0).to(tl.float32)[:, None]
        acc_up += tl.load(bias + F + rn, mask=rn < F, other=0.0).to(tl.float32)[:, None]
    gate = acc_gate.to(out.dtype.element_ty).to(tl.float32)
    up = acc_up.to(out.dtype.element_ty).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out.dtype.element_ty).to(tl.float32)
    tl.store(
        out + rm[None, :] * stride_om + rn[:, None], (act * up).to(out.dtype.element_ty), mask=mask
    )


def _dot_args(x: torch.Tensor, tiling: Int4Tiling) -> dict[str, Any]:
    """The dot dtype and the code conversion: x's 16-bit dtype on a GPU (fp32 under the
    interpreter, whose bf16 dot multiplies raw bits), the exponent trick's bits per dtype."""
    if not x.is_cuda:
        return {"DOT": dot_dtype(x.device), "FAST": False, "MAGIC": 0, "MAGIC_F": 0.0}
    if x.dtype == torch.bfloat16:
        return {"DOT": tl.bfloat16, "FAST": int(tiling.fast_cvt), "MAGIC": 0x4300, "MAGIC_F": 128.0}
    return {"DOT": tl.float16, "FAST": int(tiling.fast_cvt), "MAGIC": 0x6400, "MAGIC_F": 1024.0}


def _block_m(m: int) -> int:
    return max(16, triton.next_power_of_2(m))


def _warps(tiling: Int4Tiling, bm: int) -> int:
    """32- and 64-row blocks take at least 4 warps (H200: gate|up at M = 64 ran 99 us on 4 warps,
    229 us on the 2-warp tiling that is fastest up to 16 rows)."""
    return tiling.num_warps if bm <= 16 else max(4, tiling.num_warps)


def _check(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, group_size: int) -> None:
    k = x.shape[-1]
    if qweight.dtype != torch.uint8 or qweight.shape[-1] * 2 != k:
        raise ValueError(f"qweight must be uint8 [N, K / 2] for K = {k}, got {qweight.shape}")
    if scales.shape != (qweight.shape[0], triton.cdiv(k, group_size)):
        raise ValueError(
            f"scales {tuple(scales.shape)} do not match {qweight.shape}, group {group_size}"
        )


def _tiling_for(table: dict[tuple[int, int], Int4Tiling], n: int, k: int, group_size: int,
                tiling: Int4Tiling | None) -> Int4Tiling:  # fmt: skip
    tiling = tiling or table.get((n, k)) or default_tiling(n, k, group_size)
    bk = _compatible_bk(tiling.bk, group_size)
    if bk != tiling.bk:
        tiling = Int4Tiling(**{**tiling.__dict__, "bk": bk})
    return tiling


def int4_gemv(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    group_size: int,
    bias: torch.Tensor | None = None,
    tiling: Int4Tiling | None = None,
) -> torch.Tensor:
    """Decode GEMM in one launch: x [M <= 64, K] (16-bit) times an int4 weight [N, K]."""
    m, k = x.shape
    n = qweight.shape[0]
    if m > 64:
        raise ValueError(f"int4_gemv takes at most 64 rows, got {m}")
    _check(x, qweight, scales, group_size)
    tiling = _tiling_for(INT4_DECODE_TILINGS, n, k, group_size, tiling)
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    bm, bk = _block_m(m), tiling.bk
    ks = min(bk, group_size)
    on_gpu = x.is_cuda
    common: dict[str, Any] = dict(
        BM=bm, BN=tiling.bn, BK=bk, KS=ks, GROUP=group_size, HAS_MINS=mins is not None,
        HAS_BIAS=bias is not None, EVEN_K=k % bk == 0, XMODE=tiling.x_mode,
        num_warps=_warps(tiling, bm), num_stages=tiling.num_stages if on_gpu else 1,
        **_dot_args(x, tiling),
    )  # fmt: skip
    tiles = triton.cdiv(n, tiling.bn)
    strides = (x.stride(0), qweight.stride(0), scales.stride(0), out.stride(0))
    b = bias if bias is not None else scales
    mn = mins if mins is not None else scales
    if tiling.stream_k:
        ksteps = triton.cdiv(k, bk)
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count if on_gpu else 4
        programs = stream_k_programs(tiles, ksteps, sms, tiling.stream_k)
        workspace = _stream_k_workspace(x.device, tiles * tiling.bn * bm)
        arrivals = _arrival_counters(x.device, tiles)
        _int4_stream_k_kernel[(programs,)](
            x, qweight, scales, mn, b, out, workspace, arrivals,
            m, n, k, ksteps, tiles * ksteps, *strides, **common,
        )  # fmt: skip
        return out
    k_per_split, splits, partial, arrivals = _split_k(out, k, tiling.splits, bk, tiles)
    _int4_gemv_kernel[(tiles, splits)](
        x, qweight, scales, mn, b, out, partial, arrivals,
        m, n, k, k_per_split, splits, *strides, SPLIT=splits > 1, **common,
    )  # fmt: skip
    return out


def default_silu_mul_tiling(two_f: int, k: int, group_size: int = 128) -> Int4Tiling:
    """Each program streams BN gate and BN up channels: the gate|up GEMV's tiling at half the
    channels (the same weight bytes per program and step)."""
    whole = INT4_DECODE_TILINGS.get((two_f, k)) or default_tiling(two_f, k, group_size)
    if whole.stream_k:
        whole = default_tiling(two_f, k, group_size)
    return Int4Tiling(**{**whole.__dict__, "bn": max(16, whole.bn // 2)})


def int4_gemv_silu_mul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    group_size: int,
    bias: torch.Tensor | None = None,
    tiling: Int4Tiling | None = None,
) -> torch.Tensor:
    """silu(gate) * up [M, F] of x [M <= 64, K] and a fused gate|up int4 weight [2F, K], in one
    launch (the activation is formed where the split partials are summed)."""
    m, k = x.shape
    two_f = qweight.shape[0]
    if m > 64 or two_f % 2:
        raise ValueError(f"int4_gemv_silu_mul takes <= 64 rows and an even 2F, got {m}, {two_f}")
    _check(x, qweight, scales, group_size)
    f = two_f // 2
    tiling = tiling or INT4_SILU_MUL_TILINGS.get((two_f, k))
    tiling = tiling or default_silu_mul_tiling(two_f, k, group_size)
    tiling = _tiling_for({}, two_f, k, group_size, tiling)
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty((m, f), dtype=x.dtype, device=x.device)
    bm, bk = _block_m(m), tiling.bk
    tiles = triton.cdiv(f, tiling.bn)
    k_per_split, splits, partial, arrivals = _split_k(out, k, tiling.splits, bk, tiles, two_f)
    on_gpu = x.is_cuda
    _int4_silu_mul_kernel[(tiles, splits)](
        x, qweight, scales, mins if mins is not None else scales,
        bias if bias is not None else scales, out, partial, arrivals,
        m, f, k, k_per_split, splits, x.stride(0), qweight.stride(0), scales.stride(0),
        out.stride(0), BM=bm, BN=tiling.bn, BK=bk, KS=min(bk, group_size), GROUP=group_size,
        HAS_MINS=mins is not None, HAS_BIAS=bias is not None, SPLIT=splits > 1,
        EVEN_K=k % bk == 0, XMODE=tiling.x_mode, num_warps=_warps(tiling, bm),
        num_stages=tiling.num_stages if on_gpu else 1, **_dot_args(x, tiling),
    )  # fmt: skip
    return out


# ---------------------------------------------------------------- prefill: dequantize + GEMM


@kernel
def _int4_dequant_kernel(
    qw, scales, mins, w, channel_scale, N, K, G, stride_qn, stride_sn, stride_wn,
    BN: tl.constexpr, BJ: tl.constexpr, GP: tl.constexpr, GROUP: tl.constexpr,
    HAS_MINS: tl.constexpr, OUT_FP8: tl.constexpr, EXACT_E4M3: tl.constexpr,
    CODES: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """w [N, K] = the int4 weight dequantized (in fp32 as the reference: code times scale is
    exact, so fusing the min's add into an FMA rounds the same), rounded to w's dtype. OUT_FP8:
    divided by a per-channel scale (the largest magnitude the channel's groups can reach / 448,
    written by the first K program) so it fits e4m3. CODES (symmetric): q - 8 alone, exact in
    any of w's dtypes."""
    pid_n, pid_j = tl.program_id(0), tl.program_id(1)
    rn = pid_n * BN + tl.arange(0, BN)
    rj = pid_j * BJ + tl.arange(0, BJ)
    n_ok = rn < N
    mask = n_ok[:, None] & (rj < K // 2)[None, :]
    pdl_wait(PDL)
    b = tl.load(qw + rn[:, None].to(tl.int64) * stride_qn + rj[None, :], mask=mask, other=0)
    g = (2 * rj) // GROUP  # k = 2j and 2j + 1 share a group (even group sizes)
    s_off = rn[:, None].to(tl.int64) * stride_sn + g[None, :]
    lo = (b & 0xF).to(tl.float32)
    hi = (b >> 4).to(tl.float32)
    if CODES:
        w_lo = lo - 8.0
        w_hi = hi - 8.0
    else:
        s = tl.load(scales + s_off, mask=mask, other=0.0).to(tl.float32)
        if HAS_MINS:
            mn = tl.load(mins + s_off, mask=mask, other=0.0).to(tl.float32)
            w_lo = lo * s + mn
            w_hi = hi * s + mn
        else:
            w_lo = (lo - 8.0) * s
            w_hi = (hi - 8.0) * s
    if OUT_FP8 and not CODES:
        rg = tl.arange(0, GP)
        g_off = rn[:, None].to(tl.int64) * stride_sn + rg[None, :]
        g_mask = n_ok[:, None] & (rg < G)[None, :]
        sg = tl.load(scales + g_off, mask=g_mask, other=0.0).to(tl.float32)
        if HAS_MINS:
            mg = tl.load(mins + g_off, mask=g_mask, other=0.0).to(tl.float32)
            bound = tl.maximum(tl.abs(mg), tl.abs(15.0 * sg + mg))
        else:
            bound = 8.0 * tl.abs(sg)
        cs = tl.maximum(tl.max(bound, axis=1), 1e-12) / 448.0
        if pid_j == 0:
            tl.store(channel_scale + rn, cs, mask=n_ok)
        w_lo = w_lo / cs[:, None]
        w_hi = w_hi / cs[:, None]
        if EXACT_E4M3:  # the interpreter's e4m3 cast loses carries: round in fp32 first
            w_lo = _round_to_e4m3(w_lo)
            w_hi = _round_to_e4m3(w_hi)
    wv = tl.reshape(tl.join(w_lo, w_hi), (BN, 2 * BJ))
    kk = pid_j * 2 * BJ + tl.arange(0, 2 * BJ)
    tl.store(
        w + rn[:, None].to(tl.int64) * stride_wn + kk[None, :],
        wv.to(w.dtype.element_ty),
        mask=n_ok[:, None] & (kk < K)[None, :],
    )


def int4_dequantize(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    group_size: int,
    dtype: torch.dtype = torch.bfloat16,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weight [N, K] in `dtype` (bf16/fp16/fp32, or float8_e4m3fn with the per-channel fp32
    scales [N] it needs, the second value), into `out` when given (a scratch view)."""
    n, half = qweight.shape
    k = 2 * half
    if group_size % 2:
        raise ValueError(f"int4 groups must be of even size, got {group_size}")
    groups = scales.shape[1]
    w = out if out is not None else torch.empty((n, k), dtype=dtype, device=qweight.device)
    fp8 = dtype == torch.float8_e4m3fn
    channel_scale = torch.empty(n, dtype=torch.float32, device=qweight.device) if fp8 else None
    bn, bj = 32, 128
    _int4_dequant_kernel[(triton.cdiv(n, bn), triton.cdiv(half, bj))](
        qweight, scales, mins if mins is not None else scales, w,
        channel_scale if channel_scale is not None else scales,
        n, k, groups, qweight.stride(0), scales.stride(0), w.stride(0),
        BN=bn, BJ=bj, GP=triton.next_power_of_2(groups), GROUP=group_size,
        HAS_MINS=mins is not None, OUT_FP8=fp8, EXACT_E4M3=not qweight.is_cuda, CODES=False,
        num_warps=4,
    )  # fmt: skip
    return w, channel_scale


def int4_codes_e4m3(qweight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The codes q - 8 of a symmetric int4 weight [N, K / 2] as e4m3 [N, K] (exact), into `out`
    when given (a scratch view): the W4A8 prefill GEMM's weight operand."""
    n, half = qweight.shape
    k = 2 * half
    w = (
        out
        if out is not None
        else torch.empty((n, k), dtype=torch.float8_e4m3fn, device=qweight.device)
    )
    bn, bj = 32, 128
    _int4_dequant_kernel[(triton.cdiv(n, bn), triton.cdiv(half, bj))](
        qweight, qweight, qweight, w, qweight, n, k, 1, qweight.stride(0), 0, w.stride(0),
        BN=bn, BJ=bj, GP=1, GROUP=k, HAS_MINS=False, OUT_FP8=True, EXACT_E4M3=False, CODES=True,
        num_warps=4,
    )  # fmt: skip
    return w


_scratch: dict[tuple[torch.device, str], torch.Tensor] = {}


def dequant_scratch(
    device: torch.device, n: int, k: int, dtype: torch.dtype, slot: str = "weight"
) -> torch.Tensor:
    """An [N, K] view of one per-device buffer (per `slot`: the weight, its block scales), grown
    to the largest seen: prefill GEMMs on one stream dequantize into it one after another, so no
    call allocates its weight."""
    nbytes = n * k * dtype.itemsize
    buf = _scratch.get((device, slot))
    if buf is None or buf.numel() < nbytes:
        buf = _scratch[(device, slot)] = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return buf[:nbytes].view(dtype).view(n, k)


def int4_dequant_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    group_size: int,
    bias: torch.Tensor | None = None,
    fp8: bool | None = None,
) -> torch.Tensor:
    """Prefill rows x [M, K]: the weight dequantized into the scratch, then cuBLAS in x's dtype,
    or (fp8) e4m3 with per-channel scales and fp8_gemm's per-token scaled_mm, or (INT4_PREFILL
    "w4a8", symmetric weights) the codes and `w4a8_linear`."""
    n, k = qweight.shape[0], 2 * qweight.shape[1]
    path = prefill_path_for(x.device, group_size)
    if fp8 is None and path == "w4a8" and mins is None:
        codes = int4_codes_e4m3(qweight, dequant_scratch(x.device, n, k, torch.float8_e4m3fn))
        return w4a8_linear(x, codes, scales, group_size, bias, mma_scales=False)
    fp8 = path == "fp8" if fp8 is None else fp8
    if fp8 and x.is_cuda:
        w8 = dequant_scratch(x.device, n, k, torch.float8_e4m3fn)
        _, channel_scale = int4_dequantize(qweight, scales, mins, group_size, w8.dtype, w8)
        assert channel_scale is not None
        return scaled_mm(x, w8, channel_scale, bias)
    w = dequant_scratch(x.device, n, k, x.dtype)
    int4_dequantize(qweight, scales, mins, group_size, x.dtype, w)
    return torch.nn.functional.linear(x, w, bias)


# ---------------------------------------------------------------- the registered ops


def int4_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., K] -> [..., N]: the int4 GEMV up to INT4_GEMV_MAX_ROWS rows, dequantize + GEMM from
    there (and for group sizes the GEMV's steps cannot follow)."""
    k = x.shape[-1]
    rows = x.reshape(-1, k)
    n = qweight.shape[0]
    if _takes_w4a8_wide(rows.shape[0], k, group_size, mins):
        out = w4a8_wide(rows, qweight, scales, group_size, bias)
    elif rows.shape[0] <= min(INT4_GEMV_MAX_ROWS, 64) and _gemv_supports(k, group_size):
        out = int4_gemv(rows, qweight, scales, mins, group_size, bias)
    else:
        out = int4_dequant_linear(rows, qweight, scales, mins, group_size, bias)
    return out.view(*x.shape[:-1], n)


def int4_linear_silu_mul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """silu(gate) * up [..., F] of x [..., K] and a fused gate|up int4 weight [2F, K]: decode rows
    in one GEMV launch with the activation in its epilogue (unless INT4_SILU_MUL_TILINGS measured
    two launches faster for the shape), prefill rows as the projection then silu_mul."""
    from worker.kernels.triton.activations import silu_mul

    k = x.shape[-1]
    rows = x.reshape(-1, k)
    two_f = qweight.shape[0]
    gemv = rows.shape[0] <= min(INT4_GEMV_MAX_ROWS, 64) and _gemv_supports(k, group_size)
    gemv = gemv and not _takes_w4a8_wide(rows.shape[0], k, group_size, mins)
    measured_unfused = INT4_SILU_MUL_TILINGS.get((two_f, k), ()) is None
    if not gemv or two_f % 2 or measured_unfused:
        return silu_mul(int4_linear(x, qweight, scales, mins, group_size, bias))
    out = int4_gemv_silu_mul(rows, qweight, scales, mins, group_size, bias)
    return out.view(*x.shape[:-1], two_f // 2)


# ---------------------------------------------------------------- W4A8 prefill


@dataclass(frozen=True)
class W4A8Tiling:
    """Tiles of `w4a8_gemm`: BM rows x BN channels per program, BK of K per step (a divisor of
    the group size, so each step's partial sum takes one group scale), GROUP_M row tiles
    walked together (L2 reuse of the weight tiles)."""

    bm: int = 128
    bn: int = 128
    bk: int = 128
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 4


# Before a measurement on the GPU: the shape Triton's Hopper FP8 GEMMs commonly take.
W4A8_TILING = W4A8Tiling()


@kernel
def _w4a8_gemm_kernel(
    a,
    a_scale,
    w,
    w_scale,
    bias,
    out,
    M,
    N,
    K,
    stride_am,
    stride_wn,
    stride_om,
    s_tile,
    s_group,
    s_row,
    GROUP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
    FP8_DOT: tl.constexpr,
    DOT: tl.constexpr,
):
    """out [M, N] = (a * a_scale) @ (w * s).T: a [M, K] e4m3 rounded per row (a_scale [M]), w
    [N, K] e4m3 holding int4 codes exactly, s the group scales, scale (n, g) at w_scale +
    (n // 16) s_tile + g s_group + (n % 16) s_row (the int4-mma layout's [N / 16, G, 16], or a
    plain [N, G]). Each BK step's fp32 partial sum takes its group's scale: no weight rounding."""
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BM)
    tiles_n = tl.cdiv(N, BN)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    rows_here = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % rows_here
    pid_n = (pid % per_group) // rows_here
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    m_ok = rm < M
    n_ok = rn < N
    a_rows = a + rm.to(tl.int64)[:, None] * stride_am
    w_cols = w + rn.to(tl.int64)[None, :] * stride_wn
    s_cols = w_scale + (rn // 16).to(tl.int64) * s_tile + (rn % 16) * s_row
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        ab = tl.load(a_rows + (k0 + rk)[None, :], mask=m_ok[:, None], other=0.0)
        wb = tl.load(w_cols + (k0 + rk)[:, None], mask=n_ok[None, :], other=0.0)
        if FP8_DOT:
            part = tl.dot(ab, wb)
        else:
            part = tl.dot(ab.to(DOT), wb.to(DOT))
        s = tl.load(s_cols + (k0 // GROUP) * s_group, mask=n_ok, other=0.0).to(tl.float32)
        acc += part * s[None, :]
    acc *= tl.load(a_scale + rm, mask=m_ok, other=0.0)[:, None]
    if HAS_BIAS:
        acc += tl.load(bias + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    o = out + rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
    tl.store(o, acc.to(out.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def w4a8_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    mma_scales: bool = True,
    tiling: W4A8Tiling | None = None,
) -> torch.Tensor:
    """a [M, K] e4m3 with row scales a_scale [M, 1] (`quantize_rows`) times int4 codes [N, K]
    held in e4m3 with group scales (`mma_scales`: the int4-mma layout's [N / 16, G, 16], else
    [N, G]) -> [M, N] in out_dtype."""
    m, k = a.shape
    n = codes.shape[0]
    t = tiling or W4A8_TILING
    bk = min(t.bk, group_size)
    if group_size % bk or k % bk:
        raise ValueError(f"w4a8_gemm needs K ({k}) and the group ({group_size}) in steps of {bk}")
    if mma_scales:
        groups = scales.shape[1]
        s_tile, s_group, s_row = scales.stride(0), scales.stride(1), scales.stride(2)
    else:
        groups = scales.shape[1]
        s_tile, s_group, s_row = 16 * scales.stride(0), scales.stride(1), scales.stride(0)
    if groups * group_size < k:
        raise ValueError(f"{groups} groups of {group_size} do not cover K = {k}")
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0:
        return out
    grid = (triton.cdiv(m, t.bm) * triton.cdiv(n, t.bn),)
    on_gpu = a.is_cuda
    _w4a8_gemm_kernel[grid](
        a, a_scale, codes, scales, bias if bias is not None else out, out,
        m, n, k, a.stride(0), codes.stride(0), out.stride(0), s_tile, s_group, s_row,
        GROUP=group_size, HAS_BIAS=bias is not None, BM=t.bm, BN=t.bn, BK=bk,
        GROUP_M=t.group_m, FP8_DOT=on_gpu, DOT=dot_dtype(a.device),
        **({"num_warps": t.num_warps, "num_stages": t.num_stages} if on_gpu else {}),
    )  # fmt: skip
    return out


# cuBLAS's blockwise-scaled FP8 GEMM (`torch.nn.functional.scaled_mm`, 1x128 blocks on both
# operands, CUDA 12.9+ on sm_90): x rounded per token and block of 128, the int4 codes exactly
# in e4m3 with their group scales as the weight's 1x128 blocks, so it is the W4A8 product itself
# at cuBLAS's speed. `w4a8_gemm` (Triton, x per token) where it cannot run.
# TOKENMILL_INT4_W4A8_GEMM=triton keeps the Triton GEMM (to compare them).
W4A8_GEMM = os.environ.get("TOKENMILL_INT4_W4A8_GEMM", "auto").strip().lower()
# CUDA device index -> why cuBLAS's blockwise GEMM cannot run there ("" when it ran correctly)
_BLOCKWISE_REFUSAL: dict[int, str] = {}


def blockwise_scales(
    scales: torch.Tensor, group_size: int, k: int, mma_scales: bool
) -> torch.Tensor:
    """A weight's group scales as cuBLAS's 1x128 blocks: [N, K / 128] fp32, strides (1, N).
    `scales` is [N, G], or the int4-mma layout's [N / 16, G, 16] (`mma_scales`)."""
    if mma_scales:
        by_group = scales.permute(1, 0, 2).reshape(scales.shape[1], -1)
    else:
        by_group = scales.t()
    by_group = by_group.float().repeat_interleave(group_size // 128, dim=0)[: k // 128]
    return by_group.contiguous().t()


def _blockwise_gemm(
    a: torch.Tensor, a_scale: torch.Tensor, codes: torch.Tensor, b_scale: torch.Tensor, dtype: Any
) -> torch.Tensor:
    f = torch.nn.functional
    blocks = f.ScalingType.BlockWise1x128  # type: ignore[attr-defined]
    return f.scaled_mm(a, codes.t(), a_scale, blocks, b_scale, blocks, output_dtype=dtype)  # type: ignore[attr-defined]


def blockwise_refusal(device: torch.device) -> str:
    """Why cuBLAS's 1x128 blockwise FP8 GEMM cannot serve the W4A8 prefill on this device ("" when
    it can), found once per device on a small product against its fp32 value: a CPU,
    TOKENMILL_INT4_W4A8_GEMM=triton, torch without `scaled_mm`, or the error cuBLAS gave (it needs
    CUDA 12.9+ and sm_90)."""
    if device.type != "cuda":
        return "not a CUDA device"
    if W4A8_GEMM == "triton":
        return "TOKENMILL_INT4_W4A8_GEMM=triton"
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _BLOCKWISE_REFUSAL:
        _BLOCKWISE_REFUSAL[index] = _try_blockwise(torch.device("cuda", index))
    return _BLOCKWISE_REFUSAL[index]


def _try_blockwise(device: torch.device) -> str:
    if not hasattr(torch.nn.functional, "scaled_mm"):
        return f"torch {torch.__version__} has no torch.nn.functional.scaled_mm"
    try:
        gen = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(48, 256, device=device, generator=gen, dtype=torch.bfloat16)
        codes = torch.randint(-8, 8, (128, 256), device=device, generator=gen)
        s = torch.rand(128, 2, device=device, generator=gen) + 0.5
        a, a_scale = quantize_blocks(x, 128, 16)
        b_scale = blockwise_scales(s, 128, 256, False)
        e4m3 = codes.to(torch.float8_e4m3fn)
        got = _blockwise_gemm(a, a_scale, e4m3, b_scale, torch.float32)[:48]
        want = (a[:48].float() * a_scale[:48].repeat_interleave(128, 1)) @ (
            codes.float() * s.repeat_interleave(128, 1)
        ).T
    except (RuntimeError, TypeError, ValueError, AttributeError) as exc:
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
    # cuBLAS sums in its own order: ~1e-4 of the largest output on one H200
    worst = ((got - want).abs().max() / want.abs().max()).item()
    if not worst <= 1e-3:
        return f"wrong product (largest difference {worst:.3g} of the largest output)"
    return ""


def blockwise_runs(device: torch.device) -> bool:
    """Whether `w4a8_linear` takes cuBLAS's blockwise GEMM on this device (`blockwise_refusal`)."""
    return not blockwise_refusal(device)


def takes_blockwise(x: torch.Tensor, group_size: int) -> bool:
    """Whether `w4a8_linear` runs x [M, K] through cuBLAS's blockwise GEMM: groups and K in whole
    blocks of 128, on a device where it runs."""
    return group_size % 128 == 0 and x.shape[-1] % 128 == 0 and blockwise_runs(x.device)


def w4a8_linear(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
    mma_scales: bool = True,
    block_scales: torch.Tensor | None = None,
    silu_paired: int = 0,
) -> torch.Tensor:
    """x [M, K] (16-bit) times int4 codes [N, K] held exactly in e4m3 with group scales (see
    `blockwise_scales` for the layouts): cuBLAS's blockwise FP8 GEMM where it runs
    (`takes_blockwise`; `block_scales`, when given, are `blockwise_scales` already built), else
    `w4a8_gemm`. Only x is rounded. `silu_paired` > 0: x is a gate|up output [M, 2K] in pairs of
    that many gate and up columns and the product takes its activation silu(gate) * up, formed
    as x is rounded on the blockwise path (no 16-bit [M, K] between them)."""
    if silu_paired and not takes_blockwise(x[:, : x.shape[1] // 2], group_size):
        x, silu_paired = silu_mul(x, paired=silu_paired), 0
    m, k = x.shape[0], x.shape[1] // (2 if silu_paired else 1)
    if silu_paired or takes_blockwise(x, group_size):
        a, a_scale = quantize_blocks(x, 128, 16, silu_paired)
        b_scale = (
            blockwise_scales(scales, group_size, k, mma_scales)
            if block_scales is None
            else block_scales
        )
        out = _blockwise_gemm(a, a_scale, codes, b_scale, x.dtype)[:m]
        return out if bias is None else out + bias
    a, a_scale = quantize_rows(x)
    return w4a8_gemm(a, a_scale, codes, scales, group_size, bias, x.dtype, mma_scales=mma_scales)


# ---------------------------------------------------------------- W4A8 decode, 17-64 rows


@dataclass(frozen=True)
class W4A8WideTiling:
    """Tiles of `w4a8_wide`: BN channels per program (the tensor-core M side), all rows of x
    as the N side, BK of K per step (within one group), K cut into `splits` ranges."""

    bn: int = 64
    bk: int = 128
    splits: int = 1
    num_warps: int = 4
    num_stages: int = 3


# Before a measurement on the GPU: channels per program and splits so a 27B shape fills the
# 132 SMs at least once (the small ones split K).
def default_wide_tiling(n: int, k: int) -> W4A8WideTiling:
    tiles = triton.cdiv(n, 64)
    splits = max(1, min(8, 264 // tiles, k // 1024))
    return W4A8WideTiling(64, 128, splits)


@kernel
def _w4a8_wide_kernel(
    a, a_scale, qw, scales, bias, out, partial, arrivals,
    M, N, K, k_per_split, stride_am, stride_qn, stride_sn, stride_om,
    GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    BK: tl.constexpr, SPLIT: tl.constexpr, FP8_DOT: tl.constexpr, DOT: tl.constexpr,
    FAST: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """out [M, N] = (a * a_scale) @ (q - 8) s^T for a nibble-layout symmetric int4 weight qw
    [N, K / 2] and x rounded per token to e4m3 with each BK block's even k first, then its odd
    k (`w4a8_wide`): the low nibbles dot the even half, the high ones the odd half, as e4m3
    codes on FP8 tensor cores (out^T = W x^T: channels on the M side), each step's fp32 sum
    times its group's scale. Split K: each split's partial to `partial`, the last to arrive at
    a column tile sums them in order (the same bits every run) and writes the tile."""
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    splits = tl.num_programs(1)
    rn = pid_n * BN + tl.arange(0, BN)
    rm = tl.arange(0, BM)
    rj = tl.arange(0, BK // 2)
    n_ok = rn < N
    m_ok = rm < M
    w_rows = qw + rn.to(tl.int64)[:, None] * stride_qn
    a_rows = a + rm.to(tl.int64)[:, None] * stride_am
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    k_start = split * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    pdl_wait(PDL)
    for k0 in range(k_start, k_end, BK):
        b = tl.load(w_rows + (k0 // 2 + rj)[None, :], mask=n_ok[:, None], other=0)
        a_lo = tl.load(a_rows + (k0 + rj)[None, :], mask=m_ok[:, None], other=0.0)
        a_hi = tl.load(a_rows + (k0 + BK // 2 + rj)[None, :], mask=m_ok[:, None], other=0.0)
        if FP8_DOT:
            lo, hi = _codes(b, tl.float16, 8.0, FAST, 0x6400, 1024.0)
            part = tl.dot(lo.to(tl.float8e4nv), tl.trans(a_lo))
            part = tl.dot(hi.to(tl.float8e4nv), tl.trans(a_hi), part)
        else:
            lo, hi = _codes(b, DOT, 8.0, False, 0, 0.0)
            part = tl.dot(lo, tl.trans(a_lo.to(DOT)))
            part = tl.dot(hi, tl.trans(a_hi.to(DOT)), part)
        s = tl.load(scales + rn.to(tl.int64) * stride_sn + k0 // GROUP, mask=n_ok, other=0.0)
        acc += part * s.to(tl.float32)[:, None]
    acc *= tl.load(a_scale + rm, mask=m_ok, other=0.0)[None, :]
    mask = n_ok[:, None] & m_ok[None, :]
    if not SPLIT:
        _gemv_epilogue(acc, bias, bias, out, rn, rm, N, stride_om, mask, False, HAS_BIAS)
    else:
        total, last = _sum_splits(acc, partial, arrivals, pid_n, split, splits, M, N, rn, rm, mask)
        if last:
            _gemv_epilogue(total, bias, bias, out, rn, rm, N, stride_om, mask, False, HAS_BIAS)


def wide_x_e4m3(x: torch.Tensor, bk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] rounded to e4m3 per row, each BK block reordered to its even k then its odd k
    (the order `_w4a8_wide_kernel` dots the low and high nibbles in); the row scales [M, 1]."""
    return quantize_rows(x, split=bk)


def w4a8_wide(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
    tiling: W4A8WideTiling | None = None,
) -> torch.Tensor:
    """x [17-64 rows, K] (16-bit) times a symmetric nibble-layout int4 weight [N, K / 2] with
    scales [N, G]: x rounded per token to e4m3, the codes to e4m3 in the kernel, FP8 tensor
    cores, the group scales on the fp32 sums (`TOKENMILL_INT4_W4A8_ROWS`)."""
    m, k = x.shape
    n = qweight.shape[0]
    t = tiling or INT4_W4A8_WIDE_TILINGS.get((n, k)) or default_wide_tiling(n, k)
    if m > 64 or k % t.bk or group_size % t.bk:
        raise ValueError(f"w4a8_wide takes <= 64 rows and K, group in steps of {t.bk}")
    a, a_scale = wide_x_e4m3(x, t.bk)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    tiles = triton.cdiv(n, t.bn)
    k_per_split, splits, partial, arrivals = _split_k(out, k, t.splits, t.bk, tiles)
    on_gpu = x.is_cuda
    _w4a8_wide_kernel[(tiles, splits)](
        a, a_scale, qweight, scales, bias if bias is not None else out, out, partial, arrivals,
        m, n, k, k_per_split, a.stride(0), qweight.stride(0), scales.stride(0), out.stride(0),
        GROUP=group_size, HAS_BIAS=bias is not None, BM=max(16, triton.next_power_of_2(m)),
        BN=t.bn, BK=t.bk, SPLIT=splits > 1, FP8_DOT=on_gpu, DOT=dot_dtype(x.device),
        FAST=2 if on_gpu else 0,
        **({"num_warps": t.num_warps, "num_stages": t.num_stages} if on_gpu else {}),
    )  # fmt: skip
    return out


# Decode rows from which `int4_linear` takes `w4a8_wide` (TOKENMILL_INT4_W4A8_ROWS; 0, the
# default until it is measured on the GPU: never): up to 64, symmetric weights, groups of a
# multiple of 128.
def w4a8_rows(value: str) -> int:
    """A TOKENMILL_INT4_W4A8_ROWS value, checked: 0 (off) or 1-64."""
    rows = int(value) if value.strip().lstrip("-").isdigit() else -1
    if not 0 <= rows <= 64:
        raise ValueError(f"TOKENMILL_INT4_W4A8_ROWS={value!r}: expected 0 (off) or 1-64 rows")
    return rows


INT4_W4A8_ROWS = w4a8_rows(os.environ.get("TOKENMILL_INT4_W4A8_ROWS", "0"))
# Measured tilings per (N, K) (none yet: `default_wide_tiling`).
INT4_W4A8_WIDE_TILINGS: dict[tuple[int, int], W4A8WideTiling] = {}


def _takes_w4a8_wide(m: int, k: int, group_size: int, mins: torch.Tensor | None) -> bool:
    return 0 < INT4_W4A8_ROWS <= m <= 64 and mins is None and group_size % 128 == 0 and k % 128 == 0
