"""Decode GEMV variants over an int4 weight repacked at load into int32 words (candidates to
replace `int4_gemm.int4_gemv`; bench/int4_variants.py measures them against it and FP8).

Why a repack: in the checkpoint layout (uint8 [N, K / 2], two codes per byte) each thread of
the dot-operand layout needs one or two bytes of a row, so the GEMV spends its instructions on
gathering and re-pairing codes rather than on streaming HBM. Repacked (`pack_planes`, at load;
the checkpoint format is unchanged), each int32 word holds 8 codes of one output channel, and a
block of 16 words covers 128 consecutive k:

- plane layout: word w (0..15) of a block holds k = 16 i + w in bits 4i .. 4i + 3 (i = 0..7);
  a plane i of the block's [BN, 16] word tile is 16 consecutive k.
- pair layout: word w holds k = 32 j + 2 w in bits 4j and k = 32 j + 2 w + 1 in bits 4j + 16
  (j = 0..3); one shift and one lop3 of a word yield a 32-bit pair of two consecutive k, which
  is exactly a register of the 16-bit mma operand.

Codes stay unsigned 0..15; scales and mins stay as they are ([N, K / group], group a multiple
of 16, or of 32 for the pair layout).

Variants (`mode`):
- "dot": per block 8 tensor-core dots of [BN, 16] codes x [16, BM] (x's plane slice). The codes
  come from the int32 tile two planes at a time (on a GPU a PTX block: shift, one lop3 into the
  mantissa of 128 / 1024, one packed subtract); the mma then needs byte permutes to pair them.
- "pairs": the pair layout, 4 dots of [BN, 32] codes per block (the two halves of each word
  joined back into consecutive k).
- "pairs-xa": the same with x as the dot's left operand (out = x W^T, the weight as the right
  operand; groups of whole blocks only).
- "halves": the pair layout read as int16 [N, K / 4], where element e of a block holds
  k = 32 j + e in bits 4j: plane j of a [BN, 32] int16 tile is a [BN, 32] code tile, formed by
  one PTX block per two elements, so every op from the load to the dot is element-wise and the
  mma operand layout reaches back to the load (ldmatrix from shared memory, no permutes).
- "halves-biased": "halves" with the codes left as 128 + q (bf16; 1024 + q fp16): the PTX
  block loses its subtract, and the offset is taken out per block as (128 + 8) s times x's
  block sum, which the wrapper computes first (one small reduction launch).
- "fma": no tensor cores (1-4 rows): codes as fp32 1 + q / 16 (the nibble moved into the top of
  a mantissa of 1.0: one shift and one lop3 per code, no int -> float conversion), one FMA per
  code and row into a [BN, 16] accumulator per row, reduced once at the end; the sum is then
  sum x (q - 8) = 16 sum x c - 24 sum x (affine q s + m likewise).

Loop instructions per 64 x 128 step on 2 warps (sm_90 SASS, bench/int4_sass.py, triton 3.6 as
on the H200; today's checkpoint-layout GEMV: 381): dot 400, pairs 383, pairs-xa 420, halves 324,
halves-biased 303; per code and thread that is 2.98 for today, 2.37 for halves-biased and 2.0
for halves-biased on 128-channel tiles (240 registers); fma 5.3 at one row.

All split K across programs like `int4_gemv` (the last program to arrive at a column tile sums
the fp32 partials: one launch).

Size: The repacking and the decode GEMV variants measured in docs/performance.md, with their
launchers and references.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from worker.kernels.triton._launch import dot_dtype, kernel, pdl_wait
from worker.kernels.triton.fp8_gemm import _arrival_counters, _gemv_epilogue

PLANE_BLOCK = 128  # k per block of 16 words
PLANE_WORDS = PLANE_BLOCK // 8
MODES = ("dot", "pairs", "pairs-xa", "halves", "halves-biased", "fma")  # pair layout: 2-5


@dataclass(frozen=True)
class PlaneTiling:
    """BN output channels x `blocks` plane blocks (128 k each) per loop step, K split in `splits`
    ranges of whole steps."""

    bn: int = 64
    blocks: int = 1
    splits: int = 1
    num_warps: int = 2
    num_stages: int = 3


def _block_order(pairs: bool) -> torch.Tensor:
    """k (within a block) of each (word w, nibble p) of a block's 16 words, [16, 8]."""
    w = torch.arange(PLANE_WORDS)[:, None]
    p = torch.arange(8)[None, :]
    if pairs:
        return 32 * (p % 4) + 2 * w + p // 4
    return PLANE_WORDS * p + w


def pack_planes(qweight: torch.Tensor, pairs: bool = False) -> torch.Tensor:
    """Checkpoint layout uint8 [N, K / 2] -> plane words int32 [N, K / 8] (K % 128 == 0).
    pairs: the pair layout (nibbles 4j and 4j + 16 of word w are k = 32j + 2w and 2w + 1)."""
    n, half = qweight.shape
    k = 2 * half
    if k % PLANE_BLOCK:
        raise ValueError(f"plane packing needs K % {PLANE_BLOCK} == 0, got K = {k}")
    codes = torch.stack((qweight & 0xF, qweight >> 4), dim=-1).reshape(n, k // PLANE_BLOCK, -1)
    order = _block_order(pairs).to(qweight.device).reshape(-1)
    codes = codes[:, :, order].reshape(n, k // 8, 4, 2)  # [N, words, byte, nibble]
    packed = codes[..., 0] | (codes[..., 1] << 4)
    return packed.contiguous().view(torch.int32).view(n, k // 8)


def unpack_planes(words: torch.Tensor, pairs: bool = False) -> torch.Tensor:
    """plane words int32 [N, K / 8] -> the checkpoint layout uint8 [N, K / 2] (inverse of
    `pack_planes`)."""
    n = words.shape[0]
    b = words.contiguous().view(torch.uint8).view(n, -1, 4)
    nibbles = torch.stack((b & 0xF, b >> 4), dim=-1).reshape(n, -1, PLANE_BLOCK)
    codes = torch.empty_like(nibbles)
    codes[:, :, _block_order(pairs).to(words.device).reshape(-1)] = nibbles
    codes = codes.reshape(n, -1)
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()


def supports(k: int, group_size: int, pairs: bool = False) -> bool:
    """K in whole plane blocks; a group covers whole slices (16 k, or 32 k for the pair layout)
    and a block covers whole groups or lies inside one."""
    if k % PLANE_BLOCK or group_size % (2 * PLANE_WORDS if pairs else PLANE_WORDS):
        return False
    return group_size % PLANE_BLOCK == 0 or PLANE_BLOCK % group_size == 0


# ---------------------------------------------------------------- device functions


def _pair_ptx(shift: int, magic: str, neg: str, ty: str) -> str:
    """PTX: planes i and i + 4 (bits 4i and 4i + 16) of one word as two 16-bit codes."""
    return (
        f"{{\n.reg .b32 t, c;\nmov.b32 c, {neg};\n"
        f"shr.u32 t, $2, {shift};\n"
        f"lop3.b32 t, t, 0x000f000f, {magic}, 0xea;\n"
        f"add.{ty} t, t, c;\n"
        "mov.b32 {$0, $1}, t;\n}"
    )


def _pair_table() -> dict[tuple[str, bool, int], str]:
    table = {}
    for ty, magic, sym, aff in (
        ("bf16x2", "0x43004300", "0xC308C308", "0xC300C300"),
        ("f16x2", "0x64006400", "0xE408E408", "0xE400E400"),
    ):
        for shift in (0, 4, 8, 12):
            table[(ty, True, shift)] = _pair_ptx(shift, magic, sym, ty)
            table[(ty, False, shift)] = _pair_ptx(shift, magic, aff, ty)
    return table


_PAIRS = _pair_table()


def half_pair_ptx(shift: int, dtype: torch.dtype, symmetric: bool, biased: bool = False) -> str:
    """PTX: plane j = shift / 4 of two int16 elements (one 32-bit register) as two 16-bit
    codes in one register: shift, one lop3 into the magic's mantissa, one packed subtract (none
    when biased: the codes stay magic + q)."""
    ty, magic = ("bf16x2", "0x43004300") if dtype == torch.bfloat16 else ("f16x2", "0x64006400")
    neg = {
        ("bf16x2", True): "0xC308C308",
        ("bf16x2", False): "0xC300C300",
        ("f16x2", True): "0xE408E408",
        ("f16x2", False): "0xE400E400",
    }[(ty, symmetric)]
    shr = f"shr.u32 t, $1, {shift};\n" if shift else "mov.b32 t, $1;\n"
    if biased:
        return f"{{\n.reg .b32 t;\n{shr}lop3.b32 $0, t, 0x000f000f, {magic}, 0xea;\n}}"
    return (
        f"{{\n.reg .b32 t, c;\nmov.b32 c, {neg};\n{shr}"
        f"lop3.b32 t, t, 0x000f000f, {magic}, 0xea;\nadd.{ty} $0, t, c;\n}}"
    )


@triton.jit
def _half_plane(h, j: tl.constexpr, ASM: tl.constexpr, DOT: tl.constexpr, SYM: tl.constexpr,
                FAST: tl.constexpr, BIASED: tl.constexpr, MAGIC_F: tl.constexpr):  # fmt: skip
    """Codes of plane j (bits 4j) of int16 elements, in DOT: two elements per PTX block.
    BIASED: MAGIC_F + q (the PTX block's subtract left out)."""
    if FAST:
        if DOT == tl.bfloat16:
            c = tl.inline_asm_elementwise(ASM, "=r,r", [h], tl.bfloat16, True, 2)
        else:
            c = tl.inline_asm_elementwise(ASM, "=r,r", [h], tl.float16, True, 2)
    else:
        offset = 8.0 if SYM else 0.0
        if BIASED:
            offset = -MAGIC_F
        c = (((h >> (4 * j)) & 0xF).to(tl.float32) - offset).to(DOT)
    return c


_BF_SYM_0: tl.constexpr = tl.constexpr(_PAIRS[("bf16x2", True, 0)])
_BF_SYM_4: tl.constexpr = tl.constexpr(_PAIRS[("bf16x2", True, 4)])
_BF_SYM_8: tl.constexpr = tl.constexpr(_PAIRS[("bf16x2", True, 8)])
_BF_SYM_12: tl.constexpr = tl.constexpr(_PAIRS[("bf16x2", True, 12)])
_BF_AFF_0: tl.constexpr = tl.constexpr(_PAIRS[("bf16x2", False, 0)])
_BF_AFF_4: tl.constexpr = tl.constexpr(_PAIRS[("bf16x2", False, 4)])
_BF_AFF_8: tl.constexpr = tl.constexpr(_PAIRS[("bf16x2", False, 8)])
_BF_AFF_12: tl.constexpr = tl.constexpr(_PAIRS[("bf16x2", False, 12)])
_F16_SYM_0: tl.constexpr = tl.constexpr(_PAIRS[("f16x2", True, 0)])
_F16_SYM_4: tl.constexpr = tl.constexpr(_PAIRS[("f16x2", True, 4)])
_F16_SYM_8: tl.constexpr = tl.constexpr(_PAIRS[("f16x2", True, 8)])
_F16_SYM_12: tl.constexpr = tl.constexpr(_PAIRS[("f16x2", True, 12)])
_F16_AFF_0: tl.constexpr = tl.constexpr(_PAIRS[("f16x2", False, 0)])
_F16_AFF_4: tl.constexpr = tl.constexpr(_PAIRS[("f16x2", False, 4)])
_F16_AFF_8: tl.constexpr = tl.constexpr(_PAIRS[("f16x2", False, 8)])
_F16_AFF_12: tl.constexpr = tl.constexpr(_PAIRS[("f16x2", False, 12)])


@triton.jit
def _asm_pair(words, asm: tl.constexpr, DOT: tl.constexpr):
    if DOT == tl.bfloat16:
        lo, hi = tl.inline_asm_elementwise(asm, "=h,=h,r", [words], (tl.bfloat16,) * 2, True, 1)
    else:
        lo, hi = tl.inline_asm_elementwise(asm, "=h,=h,r", [words], (tl.float16,) * 2, True, 1)
    return lo, hi


@triton.jit
def _plane_pair(words, j: tl.constexpr, DOT: tl.constexpr, SYM: tl.constexpr,
                FAST: tl.constexpr):  # fmt: skip
    """Codes (q - 8 when SYM, else q) of planes j and j + 4 of int32 words, in DOT."""
    if FAST:
        if DOT == tl.bfloat16:
            if SYM:
                if j == 0:
                    lo, hi = _asm_pair(words, _BF_SYM_0, DOT)
                elif j == 1:
                    lo, hi = _asm_pair(words, _BF_SYM_4, DOT)
                elif j == 2:
                    lo, hi = _asm_pair(words, _BF_SYM_8, DOT)
                else:
                    lo, hi = _asm_pair(words, _BF_SYM_12, DOT)
            else:
                if j == 0:
                    lo, hi = _asm_pair(words, _BF_AFF_0, DOT)
                elif j == 1:
                    lo, hi = _asm_pair(words, _BF_AFF_4, DOT)
                elif j == 2:
                    lo, hi = _asm_pair(words, _BF_AFF_8, DOT)
                else:
                    lo, hi = _asm_pair(words, _BF_AFF_12, DOT)
        else:
            if SYM:
                if j == 0:
                    lo, hi = _asm_pair(words, _F16_SYM_0, DOT)
                elif j == 1:
                    lo, hi = _asm_pair(words, _F16_SYM_4, DOT)
                elif j == 2:
                    lo, hi = _asm_pair(words, _F16_SYM_8, DOT)
                else:
                    lo, hi = _asm_pair(words, _F16_SYM_12, DOT)
            else:
                if j == 0:
                    lo, hi = _asm_pair(words, _F16_AFF_0, DOT)
                elif j == 1:
                    lo, hi = _asm_pair(words, _F16_AFF_4, DOT)
                elif j == 2:
                    lo, hi = _asm_pair(words, _F16_AFF_8, DOT)
                else:
                    lo, hi = _asm_pair(words, _F16_AFF_12, DOT)
    else:
        offset = 8.0 if SYM else 0.0
        lo = ((words >> (4 * j)) & 0xF).to(tl.float32) - offset
        hi = ((words >> (4 * j + 16)) & 0xF).to(tl.float32) - offset
        lo = lo.to(DOT)
        hi = hi.to(DOT)
    return lo, hi


@triton.jit
def _plane_unit(words, i: tl.constexpr):
    """fp32 1 + q / 16 of plane i: the nibble moved to mantissa bits 19..22 of 1.0 (one shift,
    one and-or: ptxas's lop3)."""
    if 4 * i <= 19:
        t = words << (19 - 4 * i)
    else:
        t = words >> (4 * i - 19)  # (the sign bits it drags in stay above bit 22)
    return ((t & 0x00780000) | 0x3F800000).to(tl.float32, bitcast=True)


@triton.jit
def _block_scales(s_rows, m_rows, n_mask, kb, K, GROUP: tl.constexpr, WORDS: tl.constexpr,
                  HAS_MINS: tl.constexpr):  # fmt: skip
    """fp32 scales (and mins) [BN, 8] of the 8 plane slices of the block at kb."""
    kc = kb + tl.arange(0, 8) * WORDS
    g = kc // GROUP
    mask = n_mask[:, None] & (kc < K)[None, :]
    s = tl.load(s_rows[:, None] + g[None, :], mask=mask, other=0.0).to(tl.float32)
    m = tl.zeros_like(s)
    if HAS_MINS:
        m = tl.load(m_rows[:, None] + g[None, :], mask=mask, other=0.0).to(tl.float32)
    return s, m


@triton.jit
def _step_scales(s_rows, m_rows, n_mask, k0, K, BLOCKS: tl.constexpr, BLOCK: tl.constexpr,
                 GROUP: tl.constexpr, HAS_MINS: tl.constexpr):  # fmt: skip
    """fp32 scales (and mins) [BN, BLOCKS] of the blocks of the step at k0 (groups >= a block)."""
    kc = k0 + tl.arange(0, BLOCKS) * BLOCK
    mask = n_mask[:, None] & (kc < K)[None, :]
    g = kc // GROUP
    s = tl.load(s_rows[:, None] + g[None, :], mask=mask, other=0.0).to(tl.float32)
    m = tl.zeros_like(s)
    if HAS_MINS:
        m = tl.load(m_rows[:, None] + g[None, :], mask=mask, other=0.0).to(tl.float32)
    return s, m


@triton.jit
def _column(t, j: tl.constexpr, COLS: tl.constexpr):
    """Column j of a [BN, COLS] register tile."""
    return tl.sum(tl.where(tl.arange(0, COLS)[None, :] == j, t, 0.0), axis=1)


@triton.jit
def _col8(t, i: tl.constexpr):
    return tl.sum(tl.where(tl.arange(0, 8)[None, :] == i, t, 0.0), axis=1)


@triton.jit
def _fma_row(wt, x, r: tl.constexpr, M, stride_xm, kb, s, mn, s8, m8, WORDS: tl.constexpr,
             PER_BLOCK: tl.constexpr, HAS_MINS: tl.constexpr):  # fmt: skip
    """[BN, WORDS] fp32 contribution of row r of x to the block at kb: codes as 1 + q / 16,
    so sum x (q - 8) s = s (16 sum x c - 24 sum x) and sum x (q s + m) = s (16 sum x c - 16 sum x)
    + m sum x, the x sums kept per word (no cross-lane reduction per step)."""
    rw = tl.arange(0, WORDS)
    row_ok = (rw * 0 + r) < M  # (a tensor mask: the interpreter takes no scalar one)
    xr = x + r * stride_xm + kb
    part = tl.zeros(wt.shape, dtype=tl.float32)
    xs = tl.zeros((WORDS,), dtype=tl.float32)
    for i in tl.static_range(8):
        xi = tl.load(xr + i * WORDS + rw, mask=row_ok, other=0.0).to(tl.float32)
        ci = _plane_unit(wt, i)
        if PER_BLOCK:
            part += ci * xi[None, :]
            xs += xi
        else:  # a scale per plane slice
            si = _col8(s8, i)
            if HAS_MINS:
                mi = _col8(m8, i) - 16.0 * si
            else:
                mi = -24.0 * si
            part += (ci * (16.0 * si)[:, None] + mi[:, None]) * xi[None, :]
    if PER_BLOCK:
        if HAS_MINS:
            mi = mn - 16.0 * s
        else:
            mi = -24.0 * s
        part = part * (16.0 * s)[:, None] + mi[:, None] * xs[None, :]
    return part


@kernel
def _plane_gemv_kernel(
    x, words, scales, mins, bias, out, partial, arrivals, xsums,
    M, N, K, k_per_split, splits, stride_xm, stride_wn, stride_sn, stride_om, stride_xs,
    BM: tl.constexpr, BN: tl.constexpr, BLOCKS: tl.constexpr, GROUP: tl.constexpr,
    WORDS: tl.constexpr, HAS_MINS: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
    FMA: tl.constexpr, PAIRS: tl.constexpr, XA: tl.constexpr, HALVES: tl.constexpr,
    BIASED: tl.constexpr, MAGIC_F: tl.constexpr, ASM0: tl.constexpr, ASM1: tl.constexpr, ASM2: tl.constexpr, ASM3: tl.constexpr,
    DOT: tl.constexpr, FAST: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """out^T tile [BN, BM] over one K range (`k_per_split`, whole steps of BLOCKS blocks). A
    group of >= 128 k has one scale per block; smaller groups one per plane slice."""
    pid_n, split = tl.program_id(0), tl.program_id(1)
    rn = pid_n * BN + tl.arange(0, BN)
    rm = tl.arange(0, BM)
    rw = tl.arange(0, WORDS)
    n_mask = rn < N
    n_ok = n_mask[:, None]
    m_ok = (rm < M)[:, None]
    w_rows = words + rn[:, None].to(tl.int64) * stride_wn
    s_rows = scales + rn.to(tl.int64) * stride_sn
    m_rows = s_rows
    if HAS_MINS:
        m_rows = mins + rn.to(tl.int64) * stride_sn
    x_rows = x + rm[:, None] * stride_xm
    BLOCK: tl.constexpr = 8 * WORDS
    PER_BLOCK: tl.constexpr = GROUP >= BLOCK  # one scale per block
    k_start = split * k_per_split
    k_stop = tl.minimum(k_start + k_per_split, K)
    pdl_wait(PDL)
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    acc_t = tl.zeros((BM, BN), dtype=tl.float32)  # x as the left operand: out, not out^T
    a0 = tl.zeros((BN, WORDS), dtype=tl.float32)  # fma: per-row, per-word partial sums
    a1 = a0
    a2 = a0
    a3 = a0
    # a step's scales (and mins) are loaded a step ahead: 2-byte gathers, not async-copied,
    # would otherwise stall the step that uses them for an L2 round trip
    s_cur, m_cur = _step_scales(s_rows, m_rows, n_mask, k_start, K, BLOCKS, BLOCK, GROUP, HAS_MINS)
    for k0 in range(k_start, k_stop, BLOCKS * BLOCK):
        s_nxt, m_nxt = _step_scales(
            s_rows, m_rows, n_mask, k0 + BLOCKS * BLOCK, K, BLOCKS, BLOCK, GROUP, HAS_MINS
        )
        for blk in tl.static_range(BLOCKS):
            kb = k0 + blk * BLOCK
            if HALVES:  # the pair layout as int16: element e of a block holds k = 32 j + e
                r2 = tl.arange(0, 2 * WORDS)
                wt = tl.load(w_rows + (kb // 4 + r2)[None, :], mask=n_ok, other=0)
            else:
                wt = tl.load(w_rows + (kb // 8 + rw)[None, :], mask=n_ok, other=0)
            if PER_BLOCK:
                s = _column(s_cur, blk, BLOCKS)
                mn = _column(m_cur, blk, BLOCKS)
                s8 = tl.zeros((BN, 8), dtype=tl.float32)
                m8 = s8
            else:
                s8, m8 = _block_scales(s_rows, m_rows, n_mask, kb, K, GROUP, WORDS, HAS_MINS)
                s = tl.zeros((BN,), dtype=tl.float32)
                mn = s
            if FMA:  # one [BN, WORDS] accumulator per row: x broadcast along the channels
                a0 += _fma_row(wt, x, 0, M, stride_xm, kb, s, mn, s8, m8, WORDS, PER_BLOCK,
                               HAS_MINS)  # fmt: skip
                if BM > 1:
                    a1 += _fma_row(wt, x, 1, M, stride_xm, kb, s, mn, s8, m8, WORDS, PER_BLOCK,
                                   HAS_MINS)  # fmt: skip
                if BM > 2:
                    a2 += _fma_row(wt, x, 2, M, stride_xm, kb, s, mn, s8, m8, WORDS, PER_BLOCK,
                                   HAS_MINS)  # fmt: skip
                    a3 += _fma_row(wt, x, 3, M, stride_xm, kb, s, mn, s8, m8, WORDS, PER_BLOCK,
                                   HAS_MINS)  # fmt: skip
            elif HALVES:  # 4 dots of [BN, 32]: every op from the load on is element-wise
                part = tl.zeros((BN, BM), dtype=tl.float32)
                xs = tl.zeros((BM,), dtype=tl.float32)
                for j in tl.static_range(4):
                    if j == 0:
                        cj = _half_plane(wt, 0, ASM0, DOT, not HAS_MINS, FAST, BIASED, MAGIC_F)
                    elif j == 1:
                        cj = _half_plane(wt, 1, ASM1, DOT, not HAS_MINS, FAST, BIASED, MAGIC_F)
                    elif j == 2:
                        cj = _half_plane(wt, 2, ASM2, DOT, not HAS_MINS, FAST, BIASED, MAGIC_F)
                    else:
                        cj = _half_plane(wt, 3, ASM3, DOT, not HAS_MINS, FAST, BIASED, MAGIC_F)
                    xj = tl.load(x_rows + kb + j * 2 * WORDS + r2[None, :], mask=m_ok, other=0.0)
                    if BIASED:  # codes MAGIC_F + q: the offset leaves with the block's x sum
                        part = tl.dot(cj, tl.trans(xj.to(DOT)), part)
                    elif PER_BLOCK:
                        part = tl.dot(cj, tl.trans(xj.to(DOT)), part)
                        if HAS_MINS:
                            xs += tl.sum(xj.to(tl.float32), axis=1)
                    else:
                        part += tl.dot(cj, tl.trans(xj.to(DOT))) * _col8(s8, 2 * j)[:, None]
                        if HAS_MINS:
                            xsj = tl.sum(xj.to(tl.float32), axis=1)
                            part += _col8(m8, 2 * j)[:, None] * xsj[None, :]
                if BIASED:
                    xb = tl.load(xsums + rm * stride_xs + kb // BLOCK, mask=rm < M, other=0.0)
                    if HAS_MINS:  # sum x (q s + m) = s sum x (c - MAGIC) + m sum x
                        off = mn - MAGIC_F * s
                    else:  # sum x (q - 8) s = s sum x c - (MAGIC + 8) s sum x
                        off = -(MAGIC_F + 8.0) * s
                    acc += part * s[:, None]  # (two statements: two FMAs)
                    acc += off[:, None] * xb[None, :]
                elif PER_BLOCK:
                    acc += part * s[:, None]
                    if HAS_MINS:
                        acc += mn[:, None] * xs[None, :]
                else:
                    acc += part
            elif XA:  # the pair layout with x as the dot's left operand: out = x W^T
                part_t = tl.zeros((BM, BN), dtype=tl.float32)
                xs = tl.zeros((BM,), dtype=tl.float32)
                r2 = tl.arange(0, 2 * WORDS)
                for j in tl.static_range(4):
                    lo, hi = _plane_pair(wt, j, DOT, not HAS_MINS, FAST)
                    wj = tl.reshape(tl.join(lo, hi), (BN, 2 * WORDS))
                    xj = tl.load(x_rows + kb + j * 2 * WORDS + r2[None, :], mask=m_ok, other=0.0)
                    part_t = tl.dot(xj.to(DOT), tl.trans(wj), part_t)
                    if HAS_MINS:
                        xs += tl.sum(xj.to(tl.float32), axis=1)
                acc_t += part_t * s[None, :]
                if HAS_MINS:
                    acc_t += xs[:, None] * mn[None, :]
            elif PAIRS:  # per pair plane j: 32 consecutive k, (lo, hi) = (even, odd) k
                part = tl.zeros((BN, BM), dtype=tl.float32)
                xs = tl.zeros((BM,), dtype=tl.float32)
                r2 = tl.arange(0, 2 * WORDS)
                for j in tl.static_range(4):
                    lo, hi = _plane_pair(wt, j, DOT, not HAS_MINS, FAST)
                    wj = tl.reshape(tl.join(lo, hi), (BN, 2 * WORDS))
                    xj = tl.load(x_rows + kb + j * 2 * WORDS + r2[None, :], mask=m_ok, other=0.0)
                    if PER_BLOCK:
                        part = tl.dot(wj, tl.trans(xj.to(DOT)), part)
                        if HAS_MINS:
                            xs += tl.sum(xj.to(tl.float32), axis=1)
                    else:
                        part += tl.dot(wj, tl.trans(xj.to(DOT))) * _col8(s8, 2 * j)[:, None]
                        if HAS_MINS:
                            xsj = tl.sum(xj.to(tl.float32), axis=1)
                            part += _col8(m8, 2 * j)[:, None] * xsj[None, :]
                if PER_BLOCK:
                    acc += part * s[:, None]
                    if HAS_MINS:
                        acc += mn[:, None] * xs[None, :]
                else:
                    acc += part
            else:
                part = tl.zeros((BN, BM), dtype=tl.float32)
                xs = tl.zeros((BM,), dtype=tl.float32)
                for j in tl.static_range(4):
                    lo, hi = _plane_pair(wt, j, DOT, not HAS_MINS, FAST)
                    xl = tl.load(x_rows + kb + j * WORDS + rw[None, :], mask=m_ok, other=0.0)
                    xh = tl.load(x_rows + kb + (j + 4) * WORDS + rw[None, :], mask=m_ok, other=0.0)
                    if PER_BLOCK:
                        part = tl.dot(lo, tl.trans(xl.to(DOT)), part)
                        part = tl.dot(hi, tl.trans(xh.to(DOT)), part)
                        if HAS_MINS:
                            xs += tl.sum(xl.to(tl.float32), axis=1)
                            xs += tl.sum(xh.to(tl.float32), axis=1)
                    else:
                        pl = tl.dot(lo, tl.trans(xl.to(DOT)))
                        ph = tl.dot(hi, tl.trans(xh.to(DOT)))
                        part += pl * _col8(s8, j)[:, None] + ph * _col8(s8, j + 4)[:, None]
                        if HAS_MINS:
                            xsl = tl.sum(xl.to(tl.float32), axis=1)
                            xsh = tl.sum(xh.to(tl.float32), axis=1)
                            part += _col8(m8, j)[:, None] * xsl[None, :]
                            part += _col8(m8, j + 4)[:, None] * xsh[None, :]
                if PER_BLOCK:
                    acc += part * s[:, None]
                    if HAS_MINS:
                        acc += mn[:, None] * xs[None, :]
                else:
                    acc += part
        s_cur, m_cur = s_nxt, m_nxt
    if XA:
        acc += tl.trans(acc_t)
    if FMA:
        acc += tl.where(rm[None, :] == 0, tl.sum(a0, axis=1)[:, None], 0.0)
        acc += tl.where(rm[None, :] == 1, tl.sum(a1, axis=1)[:, None], 0.0)
        acc += tl.where(rm[None, :] == 2, tl.sum(a2, axis=1)[:, None], 0.0)
        acc += tl.where(rm[None, :] == 3, tl.sum(a3, axis=1)[:, None], 0.0)
    mask = n_ok & (rm < M)[None, :]
    if not SPLIT:
        _gemv_epilogue(acc, bias, bias, out, rn, rm, N, stride_om, mask, False, HAS_BIAS)
    else:
        slab = (rm[None, :] * N + rn[:, None]).to(tl.int64)
        tl.store(partial + split * M * N + slab, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial is written before the arrival is counted
        arrived = tl.atomic_add(arrivals + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == splits - 1:
            total = tl.zeros((BN, BM), dtype=tl.float32)
            for sp in range(0, splits):  # .cg: the other SMs' partials, from L2
                total += tl.load(
                    partial + sp * M * N + slab, mask=mask, other=0.0, cache_modifier=".cg"
                )
            tl.atomic_xchg(arrivals + pid_n, 0)
            _gemv_epilogue(total, bias, bias, out, rn, rm, N, stride_om, mask, False, HAS_BIAS)


def default_plane_tiling(n: int, k: int, mode: str, sms: int = 132) -> PlaneTiling:
    """64 channels x 128 k per step on 2 warps (the dot forms on mma.sync, as the checkpoint-layout
    GEMV's measured best; the FMA form then holds 4 channels per thread, so each x value it
    widens serves 4 codes), K split for ~4 programs per SM over at least 4 steps each."""
    bn, warps = 64, 2
    tiles, steps = triton.cdiv(n, bn), k // PLANE_BLOCK
    splits = max(1, min(triton.cdiv(4 * sms, tiles), steps // 4))
    return PlaneTiling(bn, 1, splits, warps, 3)


def int4_plane_gemv(
    x: torch.Tensor,
    words: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    group_size: int,
    bias: torch.Tensor | None = None,
    mode: str = "dot",
    tiling: PlaneTiling | None = None,
) -> torch.Tensor:
    """x [M <= 16, K] (16-bit) times an int4 weight in plane words [N, K / 8] (`pack_planes`)."""
    m, k = x.shape
    n = words.shape[0]
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} not in {MODES}")
    if m > (4 if mode == "fma" else 16):
        raise ValueError(f"int4_plane_gemv ({mode}) takes at most 16 rows (fma: 4), got {m}")
    halves = mode.startswith("halves")
    biased = mode == "halves-biased"
    pairs = mode.startswith("pairs") or halves
    xa = mode == "pairs-xa"
    if (xa or biased) and group_size % PLANE_BLOCK:
        raise ValueError(f"{mode} takes groups of whole plane blocks, got {group_size}")
    if words.dtype != torch.int32 or words.shape[1] * 8 != k or not supports(k, group_size, pairs):
        raise ValueError(f"plane words int32 [N, {k} / 8] with group {group_size} expected")
    if scales.shape != (n, triton.cdiv(k, group_size)):
        raise ValueError(f"scales {tuple(scales.shape)} do not match N {n}, K {k}")
    tiling = tiling or default_plane_tiling(n, k, mode)
    if k % (tiling.blocks * PLANE_BLOCK):  # steps must not run past K
        tiling = PlaneTiling(tiling.bn, 1, tiling.splits, tiling.num_warps, tiling.num_stages)
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    step = tiling.blocks * PLANE_BLOCK
    k_per_split = triton.cdiv(triton.cdiv(k, tiling.splits), step) * step
    splits = triton.cdiv(k, k_per_split)
    tiles = triton.cdiv(n, tiling.bn)
    partial = (
        torch.empty((splits, m, n), dtype=torch.float32, device=x.device) if splits > 1 else out
    )
    arrivals = _arrival_counters(x.device, tiles) if splits > 1 else out
    fma = mode == "fma"
    on_gpu = x.is_cuda
    bm = triton.next_power_of_2(m) if fma else max(16, triton.next_power_of_2(m))
    if not on_gpu:
        dot_args: dict[str, Any] = {"DOT": dot_dtype(x.device), "FAST": False}
    else:
        dot_args = {"DOT": tl.bfloat16 if x.dtype == torch.bfloat16 else tl.float16, "FAST": True}
    asm = {f"ASM{j}": "" for j in range(4)}
    if on_gpu and halves:
        asm = {f"ASM{j}": half_pair_ptx(4 * j, x.dtype, mins is None, biased) for j in range(4)}
    # biased: x's sum per block (fp32 [M, K / 128]); one small reduction launch
    xsums = x.view(m, k // PLANE_BLOCK, PLANE_BLOCK).sum(-1, dtype=torch.float32) if biased else out
    magic = 128.0 if not on_gpu or x.dtype == torch.bfloat16 else 1024.0
    w_arg = words.view(torch.int16) if halves else words  # [N, K / 4] halves
    _plane_gemv_kernel[(tiles, splits)](
        x, w_arg, scales, mins if mins is not None else scales,
        bias if bias is not None else scales, out, partial, arrivals, xsums,
        m, n, k, k_per_split, splits, x.stride(0), w_arg.stride(0), scales.stride(0),
        out.stride(0), xsums.stride(0), BM=bm, BN=tiling.bn, BLOCKS=tiling.blocks,
        GROUP=group_size,
        WORDS=PLANE_WORDS, HAS_MINS=mins is not None, HAS_BIAS=bias is not None,
        SPLIT=splits > 1, FMA=fma, PAIRS=pairs, XA=xa, HALVES=halves, BIASED=biased,
        MAGIC_F=magic, num_warps=tiling.num_warps,
        num_stages=tiling.num_stages if on_gpu else 1, **dot_args, **asm,
    )  # fmt: skip
    return out
