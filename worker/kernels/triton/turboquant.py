"""Triton kernels over staged KV pages (worker/models/cache.py StagedAttentionCache): recent
pages FP8, compressed pages TurboQuant codes + fp16 norms, every vector in the codec's rotated
basis (worker/kvcache/turboquant.py). References: worker.kernels.reference.

- `turboquant_restage`: programs of 16 vectors of a page (its block_size x Hkv vectors of K
  and V): norm, nearest centroid per coordinate (the count of decision bounds below it), codes
  folded (`turboquant.fold_codes`: the decoders read magnitude and sign off the bits as they
  are) and packed LSB-first (byte j, bit t holds bit (8j + t) % b of coordinate (8j + t) // b),
  so each run of 8 coordinates is b whole bytes: a sum of shifted codes, stored bytewise.
- `staged_attention_decode`: flash-decoding as `paged_attention_decode` (grid (sequence,
  kv head, split), the GQA group's query heads as the rows of one dot). A tile's codes load
  as whole words (8 coordinates per 32-bit word at 4 bits; the 3 bytes of 8 coordinates at 3
  bits) and decode in registers, without gathers (`_decode_codes`: shifts and a select tree
  on each code's bits over the 2^(b-1) magnitudes of the symmetric codebook, loaded once per
  program, the sign xor-ed in); the dots take the centroids and the per-vector norms scale the
  scores (K) and the probabilities (V). A tile runs the code dots only if it holds compressed
  tokens and the FP8 dots only if it holds recent ones (one kind, except where a sequence's
  anchor or window pages meet its compressed ones). The query is already rotated and the
  output stays rotated (the layer un-rotates it once per head).
- `staged_attention_prefill`: compressed pages dequantized (the same `_decode_codes`) into a
  scratch of every page the batch's tables name (`_scratch_kernel`), then the plain prefill
  kernel over the scratch; or, "direct", the prefill kernel's grid and rows (`prefill_rows`)
  with each key tile's codes decoded in registers as in the decode kernel.

Importing this module registers the three ops with `worker.kernels.ops`.

Size: TurboQuant encode, decode and the mixed-page attention kernels: they share the rotation
and the codebook layout.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from worker.kernels import ops
from worker.kernels.triton._launch import dot_dtype, kernel, pdl_wait
from worker.kernels.triton.activations import sigmoid_mul
from worker.kernels.triton.paged_attention import (
    _LOG2E,
    _combine_kernel,
    check_rows_fit_32_bits,
    paged_attention_prefill,
    prefill_queries,
    prefill_rows,
    split_plan,
    split_range,
)
from worker.models.cache import StagedAttentionCache

# the decode kernel's defaults (tokens per tile, warps, pipelining depth): at the 27B shape
# (D = 256, GQA 6, K4/V3) 64 x 4 compiles to the fewest instructions per coordinate on the
# code path, without spills under Triton 3.6 (docs/performance.md); bench/engine/staged_kv.py
# times the others
_TOKENS_PER_STEP = 64
_NUM_WARPS = 4
_NUM_STAGES = 2
# centroid lookup on CUDA: "prmt_v3" (4-bit keys and 3-bit values by byte permutes, inline
# PTX), "prmt" (keys only) or "tree" (select tree); at 8 x 32K on one H200, 2,048-token splits:
# 476, 511 and 617 us a layer, each checked against the reference (bench/engine/staged_kv.py)
_LOOKUP = "prmt_v3"
# 3-bit codes' loads: "words" (3 int32 loads per 32 coordinates, coalesced, prefetched by the
# loop's pipeliner: 19% fewer instructions on the code path at 64 x 4 under Triton 3.6, the
# same output to the bit on CPU) or "bytes" (3 byte loads per 8 coordinates, one row per lane:
# 32 cache lines per load instruction); bench/engine/staged_kv.py times both
_CODE_LOADS = "words"
_INT32_SIGN = tl.constexpr(-(1 << 31))  # the fp32 sign bit as an int32
# the re-encode's vectors a program (4 warps): 16 x 256 coordinates, 32 a thread
_RESTAGE_ROWS = 16


@triton.jit
def _encode_rows(
    src,
    rows,
    scale,
    bounds,
    codes,
    norms,
    out_rows,
    D: tl.constexpr,
    BITS: tl.constexpr,
    R: tl.constexpr,
):
    """Encode the vectors src[rows] (R of D values) into codes[out_rows] and norms[out_rows].
    Each run of 8 coordinates packs into BITS whole bytes of the LSB-first stream, so every
    code is computed once and placed by a shift."""
    G: tl.constexpr = D // 8
    g = tl.arange(0, G)
    t = tl.arange(0, 8)
    raw = tl.load(src + rows[:, None, None] * D + (g[None, :, None] * 8 + t[None, None, :]))
    raw = raw.to(tl.float32)  # [R, G, 8]
    x = raw * scale
    norm = tl.sqrt(tl.sum(tl.sum(x * x, 2), 1))  # [R]
    tl.store(norms + out_rows, norm.to(norms.dtype.element_ty))
    u = raw * (scale / tl.maximum(norm, 1e-30))[:, None, None]
    # the code is the number of decision bounds below u (torch.bucketize's convention)
    code = tl.zeros([R, G, 8], dtype=tl.int32)
    for j in tl.static_range((1 << BITS) - 1):
        code += (u > tl.load(bounds + j)).to(tl.int32)
    code = code ^ ((code >> (BITS - 1)) * ((1 << (BITS - 1)) - 1))  # stored folded (fold_codes)
    word = tl.sum(code << (t * BITS)[None, None, :], 2)  # [R, G]: disjoint bits, so sum = or
    out = codes + out_rows[:, None] * (D * BITS // 8) + g[None, :] * BITS
    for b in tl.static_range(BITS):
        tl.store(out + b, ((word >> (8 * b)) & 0xFF).to(tl.uint8))


@kernel
def _restage_kernel(
    k_cache,
    v_cache,
    k_codes,
    k_norms,
    v_codes,
    v_norms,
    k_bounds,
    v_bounds,
    recent_blocks,
    compressed_blocks,
    k_scale,
    v_scale,
    D: tl.constexpr,
    ROWS: tl.constexpr,  # block_size * Hkv: the vectors of one page
    R: tl.constexpr,  # vectors a program (divides ROWS)
    K_BITS: tl.constexpr,
    V_BITS: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid (page, run of R vectors of the page)."""
    pdl_wait(PDL)
    i = tl.program_id(0)
    r = tl.program_id(1) * R + tl.arange(0, R)
    rows = tl.load(recent_blocks + i).to(tl.int64) * ROWS + r
    out_rows = tl.load(compressed_blocks + i).to(tl.int64) * ROWS + r
    _encode_rows(k_cache, rows, k_scale, k_bounds, k_codes, k_norms, out_rows, D, K_BITS, R)
    _encode_rows(v_cache, rows, v_scale, v_bounds, v_codes, v_norms, out_rows, D, V_BITS, R)


def _scales(cache: StagedAttentionCache) -> tuple[float, float]:
    fp8 = cache.k_cache.dtype.itemsize == 1
    return (cache.k_scale, cache.v_scale) if fp8 else (1.0, 1.0)


def turboquant_restage(
    cache: StagedAttentionCache, recent_blocks: torch.Tensor, compressed_blocks: torch.Tensor
) -> None:
    """Re-encode recent pages (block ids) into compressed pool entries (indices)."""
    n = recent_blocks.numel()
    if n == 0:
        return
    _, block_size, hkv, dim = cache.k_cache.shape
    rows = block_size * hkv
    if triton.next_power_of_2(dim) != dim or dim < 8 or not cache.k_cache.is_contiguous():
        raise ValueError(f"unsupported page shape {tuple(cache.k_cache.shape)}")
    k_scale, v_scale = _scales(cache)
    k_bounds, v_bounds = cache.decision_bounds()
    per_program = min(rows & -rows, _RESTAGE_ROWS)  # a power of two that divides the page
    _restage_kernel[(n, rows // per_program)](
        cache.k_cache,
        cache.v_cache,
        cache.k_codes,
        cache.k_norms,
        cache.v_codes,
        cache.v_norms,
        k_bounds,
        v_bounds,
        # the kernel reads them as contiguous int32: no copy when the caller made them so
        recent_blocks.to(torch.int32).contiguous(),
        compressed_blocks.to(torch.int32).contiguous(),
        k_scale,
        v_scale,
        D=dim,
        ROWS=rows,
        R=per_program,
        K_BITS=cache.k_bits,
        V_BITS=cache.v_bits,
        num_warps=4,
    )


@triton.jit
def _half_codebook(centroids, BITS: tl.constexpr):
    """The lower half of a symmetric codebook (c[2^b - 1 - i] = -c[i]) as 8 fp32 scalars
    c[0..2^(b-1)) (negative, ascending), repeated past 2^(b-1): loaded once per program."""
    H: tl.constexpr = 1 << (BITS - 1)
    return (
        tl.load(centroids + 0 % H),
        tl.load(centroids + 1 % H),
        tl.load(centroids + 2 % H),
        tl.load(centroids + 3 % H),
        tl.load(centroids + 4 % H),
        tl.load(centroids + 5 % H),
        tl.load(centroids + 6 % H),
        tl.load(centroids + 7 % H),
    )


@triton.jit
def _code_groups(codes, crow, mask, D: tl.constexpr, BITS: tl.constexpr, WORDS: tl.constexpr):
    """[R, D / 8] int32: the codes of coordinates 8g..8g+7 of rows crow [R] (0 where ~mask),
    as the b bytes of the LSB-first stream that hold them (bits 8b..32 zero, except at 3 bits
    with WORDS, where bits 24..32 are left over from the next group: `_decode_codes` reads bits
    below 8b only)."""
    G: tl.constexpr = D // 8
    g = tl.arange(0, G)
    m = mask[:, None]
    if BITS == 3 and WORDS and G % 4 == 0:
        # 3 bits as int32 words (rows of 3D/8 bytes are word-aligned when D % 32 == 0): words
        # 3k..3k+2 hold groups 4k..4k+3 (24 bits each), so a tile is 3 word loads per 4 groups,
        # not 3 byte loads per group; 4-byte elements also let the loop's pipeliner prefetch them
        # (cp.async moves 4 bytes or more). The loads are 1-D over (row, k), reshaped after:
        # under Triton 3.6 that keeps consecutive lanes on one row's words (4 rows per warp
        # load; [R, Q] loads took the layout the dot propagates back, a row per lane, 32 cache
        # lines per load) and the decoded V tile reaches shared memory in 16-byte stores
        R: tl.constexpr = crow.shape[0]
        Q: tl.constexpr = G // 4
        flat = tl.arange(0, R * Q)
        frow = tl.reshape(tl.broadcast_to(crow[:, None], [R, Q]), [R * Q])
        fmask = tl.reshape(tl.broadcast_to(mask[:, None], [R, Q]), [R * Q])
        words = codes.to(tl.pointer_type(tl.int32)) + frow * (3 * Q) + 3 * (flat % Q)
        w0 = tl.reshape(tl.load(words, mask=fmask, other=0), [R, Q])
        w1 = tl.reshape(tl.load(words + 1, mask=fmask, other=0), [R, Q])
        w2 = tl.reshape(tl.load(words + 2, mask=fmask, other=0), [R, Q])
        g1 = ((w0 >> 24) & 0xFF) | (w1 << 8)
        g2 = ((w1 >> 16) & 0xFFFF) | (w2 << 16)
        g3 = w2 >> 8
        # [R, Q, 2, 2], index (a, b) = group 4k + 2a + b: row-major = natural order
        t = tl.reshape(tl.join(tl.join(w0, g2), tl.join(g1, g3)), [R, G])
    elif BITS == 4:  # one aligned word per group
        ptr = codes.to(tl.pointer_type(tl.int32)) + crow[:, None] * G + g[None, :]
        t = tl.load(ptr, mask=m, other=0)
    elif BITS == 2:
        ptr = codes.to(tl.pointer_type(tl.int16)) + crow[:, None] * G + g[None, :]
        t = tl.load(ptr, mask=m, other=0).to(tl.int32) & 0xFFFF
    elif BITS == 1:
        t = tl.load(codes + crow[:, None] * G + g[None, :], mask=m, other=0).to(tl.int32)
    else:  # 3 bits: 3 bytes per group, not word-aligned
        ptr = codes + crow[:, None] * (G * BITS) + (g * BITS)[None, :]
        t = tl.load(ptr, mask=m, other=0).to(tl.int32)
        t = t | (tl.load(ptr + 1, mask=m, other=0).to(tl.int32) << 8)
        t = t | (tl.load(ptr + 2, mask=m, other=0).to(tl.int32) << 16)
    return t


@triton.jit
def _slot(t, cb, SLOT: tl.constexpr, BITS: tl.constexpr):
    """Centroid of code SLOT of each group: a select tree on the folded code's magnitude bits,
    its sign bit (the top bit) xor-ed into the float."""
    s: tl.constexpr = SLOT * BITS
    if BITS == 1:
        mag = tl.zeros(t.shape, tl.float32) + cb[0]
    else:
        p0 = (t & (1 << s)) != 0
        if BITS == 2:
            mag = tl.where(p0, cb[1], cb[0])
        else:
            a = tl.where(p0, cb[1], cb[0])
            b = tl.where(p0, cb[3], cb[2])
            p1 = (t & (1 << (s + 1))) != 0
            if BITS == 3:
                mag = tl.where(p1, b, a)
            else:
                c = tl.where(p0, cb[5], cb[4])
                d = tl.where(p0, cb[7], cb[6])
                p2 = (t & (1 << (s + 2))) != 0
                mag = tl.where(p2, tl.where(p1, d, c), tl.where(p1, b, a))
    top: tl.constexpr = s + BITS - 1
    sign = (t << (31 - top)) & _INT32_SIGN
    return (mag.to(tl.int32, bitcast=True) ^ sign).to(tl.float32, bitcast=True)


@triton.jit
def _decode_codes(t, cb, D: tl.constexpr, BITS: tl.constexpr):
    """Unit-vector coordinates [R, D] fp32 (centroids, no norm) of the code groups t [R, D / 8]
    (`_code_groups`), in the natural coordinate order, with no gathers: code i of a group is
    bits [b i, b i + b) of its int, stored folded (`turboquant.fold_codes`): its low b - 1 bits
    index the magnitudes of the codebook's lower half and its top bit is the sign, so the tree
    has 2^(b-1) leaves."""
    v0 = _slot(t, cb, 0, BITS)
    v1 = _slot(t, cb, 1, BITS)
    v2 = _slot(t, cb, 2, BITS)
    v3 = _slot(t, cb, 3, BITS)
    v4 = _slot(t, cb, 4, BITS)
    v5 = _slot(t, cb, 5, BITS)
    v6 = _slot(t, cb, 6, BITS)
    v7 = _slot(t, cb, 7, BITS)
    # [R, G, 2, 2, 2], index (d1, d2, d3) = slot 4 d1 + 2 d2 + d3: row-major = natural order
    r0 = tl.join(tl.join(v0, v4), tl.join(v2, v6))
    r1 = tl.join(tl.join(v1, v5), tl.join(v3, v7))
    return tl.reshape(tl.join(r0, r1), [t.shape[0], D])


# 4-bit codes by byte permutes (PTX `prmt`): per group (8 folded codes, one word, passed as $8
# for the signs and $9 for the magnitudes), the fp16/bf16 bytes of the 8 magnitudes are two
# 8-entry byte tables (lo: $10 $11, hi: $12 $13); the nibbles (top bits masked) select 4 bytes
# per prmt, the top bits become sign masks by prmt's sign-replicate mode (bit 7 of each byte of
# the word and the word << 4), and two prmts per pair interleave lo and hi bytes into half2
# words: 16 integer instructions per 8 coordinates, where the select tree takes ~8 per
# coordinate.
_PRMT_4BIT: tl.constexpr = tl.constexpr(
    "{\n.reg .b32 s03, s47, l03, h03, l47, h47, t4, g03, g47, p01, p23, p45, p67;\n"
    "and.b32 s03, $9, 0x7777;\nshr.u32 s47, $9, 16;\nand.b32 s47, s47, 0x7777;\n"
    "prmt.b32 l03, $10, $11, s03;\nprmt.b32 h03, $12, $13, s03;\n"
    "prmt.b32 l47, $10, $11, s47;\nprmt.b32 h47, $12, $13, s47;\n"
    "shl.b32 t4, $8, 4;\nprmt.b32 g03, t4, $8, 0xD9C8;\nprmt.b32 g47, t4, $8, 0xFBEA;\n"
    "lop3.b32 h03, h03, g03, 0x80808080, 0x78;\nlop3.b32 h47, h47, g47, 0x80808080, 0x78;\n"
    "prmt.b32 p01, l03, h03, 0x5140;\nprmt.b32 p23, l03, h03, 0x7362;\n"
    "prmt.b32 p45, l47, h47, 0x5140;\nprmt.b32 p67, l47, h47, 0x7362;\n"
    "mov.b32 {$0, $1}, p01;\nmov.b32 {$2, $3}, p23;\n"
    "mov.b32 {$4, $5}, p45;\nmov.b32 {$6, $7}, p67;\n}"
)
_PRMT_CONSTRAINTS: tl.constexpr = tl.constexpr("=h,=h,=h,=h,=h,=h,=h,=h,r,r,r,r,r,r")


@triton.jit
def _byte_tables(cb, DOT: tl.constexpr):
    """The 8 magnitudes of a 4-bit codebook in DOT (16-bit) as 4 words of byte tables: lo bytes
    of c[0..3], of c[4..7], hi bytes of c[0..3], of c[4..7] (for `_decode_codes_prmt`)."""
    h0 = cb[0].to(DOT).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    h1 = cb[1].to(DOT).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    h2 = cb[2].to(DOT).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    h3 = cb[3].to(DOT).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    h4 = cb[4].to(DOT).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    h5 = cb[5].to(DOT).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    h6 = cb[6].to(DOT).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    h7 = cb[7].to(DOT).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    lo0 = (h0 & 0xFF) | ((h1 & 0xFF) << 8) | ((h2 & 0xFF) << 16) | ((h3 & 0xFF) << 24)
    lo1 = (h4 & 0xFF) | ((h5 & 0xFF) << 8) | ((h6 & 0xFF) << 16) | ((h7 & 0xFF) << 24)
    hi0 = (h0 >> 8) | ((h1 >> 8) << 8) | ((h2 >> 8) << 16) | ((h3 >> 8) << 24)
    hi1 = (h4 >> 8) | ((h5 >> 8) << 8) | ((h6 >> 8) << 16) | ((h7 >> 8) << 24)
    return lo0, lo1, hi0, hi1


@triton.jit
def _nibbles3(t):
    """The 8 folded 3-bit codes of a group (bits 3i..3i+3 of t) one per nibble (nibble i), bit 3
    of each nibble a copy of the code's top bit (its sign): 3-bit codes in the form
    `_decode_codes_prmt` takes, with the 3-bit half codebook as its tables (c[0..3], repeated,
    so bit 2 of a nibble picks the same magnitude). 8 integer instructions."""
    x = (t & 0xFFF) | ((t << 4) & 0xFFF0000)  # codes 4..7 to the upper half
    x = (x & 0x3F003F) | ((x << 2) & 0x3F003F00)  # pairs of codes to bytes
    x = (x & 0x07070707) | ((x << 1) & 0x70707070)  # codes to nibbles
    return x | ((x << 1) & -0x77777778)  # 0x88888888: bit 2 of each nibble copied to bit 3


@triton.jit
def _decode_codes_prmt(t, tables, D: tl.constexpr, DOT: tl.constexpr):
    """`_decode_codes` of 4-bit codes, in DOT, by byte permutes (CUDA only: inline PTX)."""
    zero = t * 0
    args = [t, t, zero + tables[0], zero + tables[1], zero + tables[2], zero + tables[3]]
    if DOT == tl.bfloat16:
        v0, v1, v2, v3, v4, v5, v6, v7 = tl.inline_asm_elementwise(
            _PRMT_4BIT, _PRMT_CONSTRAINTS, args, (tl.bfloat16,) * 8, True, 1
        )
    else:
        v0, v1, v2, v3, v4, v5, v6, v7 = tl.inline_asm_elementwise(
            _PRMT_4BIT, _PRMT_CONSTRAINTS, args, (tl.float16,) * 8, True, 1
        )
    r0 = tl.join(tl.join(v0, v4), tl.join(v2, v6))
    r1 = tl.join(tl.join(v1, v5), tl.join(v3, v7))
    return tl.reshape(tl.join(r0, r1), [t.shape[0], D])


@triton.jit
def _dequant_tile(codes, norms, cb, crow, mask, D: tl.constexpr, BITS: tl.constexpr):
    """Rotated-basis vectors [R, D] fp32 of compressed rows crow [R] (0 where ~mask)."""
    unit = _decode_codes(_code_groups(codes, crow, mask, D, BITS, False), cb, D, BITS)
    norm = tl.load(norms + crow, mask=mask, other=0.0).to(tl.float32)
    return unit * norm[:, None]


@triton.jit
def _codebooks(k_centroids, v_centroids, K_BITS: tl.constexpr, V_BITS: tl.constexpr, DOT: tl.constexpr, PRMT: tl.constexpr, PRMT_V3: tl.constexpr):  # fmt: skip
    """(keys' half codebook, their lookup tables, values' half codebook, theirs): the byte
    tables where decoded by byte permutes, else the codebook again (`_unit_rows`)."""
    k_cb = _half_codebook(k_centroids, K_BITS)
    v_cb = _half_codebook(v_centroids, V_BITS)
    k_tables = _byte_tables(k_cb, DOT) if PRMT else k_cb
    v_tables = _byte_tables(v_cb, DOT) if PRMT_V3 else v_cb
    return k_cb, k_tables, v_cb, v_tables


@triton.jit
def _unit_rows(groups, cb, tables, D: tl.constexpr, BITS: tl.constexpr, DOT: tl.constexpr, PRMT: tl.constexpr, NIBBLES3: tl.constexpr):  # fmt: skip
    """A tile's code groups (`_code_groups`) decoded to unit vectors [R, D] in DOT: by byte
    permutes (PRMT: `tables` from `_byte_tables`; NIBBLES3: 3-bit codes spread to nibbles
    first) or by the select tree over `cb`."""
    if PRMT:
        if NIBBLES3:
            return _decode_codes_prmt(_nibbles3(groups), tables, D, DOT)
        return _decode_codes_prmt(groups, tables, D, DOT)
    return _decode_codes(groups, cb, D, BITS).to(DOT)


@triton.jit
def _plain_rows(cache, row, plain, D: tl.constexpr):
    """The FP8 (or 16-bit) rows `row` [R] of a recent pool, 0 where not `plain`."""
    offs_d = tl.arange(0, D)
    return tl.load(cache + row[:, None] * D + offs_d[None, :], mask=plain[:, None], other=0.0)


@triton.jit
def _tile_pools(table, t0, end, num_recent, BLOCK_SIZE: tl.constexpr, BN: tl.constexpr):
    """(FP8 pages, compressed pages) among the pages of row `table` that tokens [t0, t0 + BN)
    below `end` fall in, counted from scalar loads of their ids. A tile starting inside a page
    (a partition that is not a multiple of BN) spans one page more."""
    PAGES: tl.constexpr = (BN + BLOCK_SIZE - 1) // BLOCK_SIZE + 1
    first = t0 // BLOCK_SIZE
    stop = tl.minimum(t0 + BN, end)
    n_plain = 0
    n_comp = 0
    for j in tl.static_range(PAGES):
        if (first + j) * BLOCK_SIZE < stop:
            page = tl.load(table + first + j)
            compressed = (page >= num_recent).to(tl.int32)
            n_comp += compressed
            n_plain += 1 - compressed
    return n_plain, n_comp


@kernel
def _staged_decode_kernel(
    q,
    k_cache,
    v_cache,
    k_codes,
    k_norms,
    v_codes,
    v_norms,
    k_centroids,
    v_centroids,
    context_lens,
    block_tables,
    part_out,
    part_lse,
    out,
    softmax_scale,
    k_scale,
    v_scale,
    num_recent,
    stride_qb,
    stride_qh,
    stride_bt,
    num_splits,
    partition,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    GP: tl.constexpr,
    BN: tl.constexpr,
    K_BITS: tl.constexpr,
    V_BITS: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr,
    DOT: tl.constexpr,
    STAGES: tl.constexpr,  # the loop's software-pipelining depth (its loads prefetched)
    PRMT: tl.constexpr,  # 4-bit keys by byte permutes (`_decode_codes_prmt`), CUDA only
    PRMT_V3: tl.constexpr,  # 3-bit values by byte permutes too (`_nibbles3`), CUDA only
    WORDS3: tl.constexpr,  # 3-bit codes loaded as int32 words (`_code_groups`)
    PDL: tl.constexpr,
):
    k_cb, k_tables, v_cb, v_tables = _codebooks(k_centroids, v_centroids, K_BITS, V_BITS, DOT, PRMT, PRMT_V3)  # fmt: skip
    pdl_wait(PDL)
    b = tl.program_id(0)
    hkv = tl.program_id(1)
    split = tl.program_id(2)
    group = HQ // HKV
    heads = hkv * group + tl.arange(0, GP)
    in_group = tl.arange(0, GP) < group
    offs_d = tl.arange(0, D)

    ctx = tl.load(context_lens + b)
    start, end = split_range(ctx, split, num_splits, partition, BN)
    b_q = tl.load(
        q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=in_group[:, None],
        other=0.0,
    ).to(DOT)

    m_i = tl.full([GP], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GP], dtype=tl.float32)
    # the output transposed, [D, GP]: the PV dot as V^T p^T has M = D, so on Hopper it runs as a
    # warpgroup MMA with the decoded V tile as stored (p V compiled to 17-23% more instructions
    # on the code path, and 16-bit shared-memory stores of the V tile under Triton 3.6)
    acc = tl.zeros([D, GP], dtype=tl.float32)
    for t0 in tl.range(start, end, BN, num_stages=STAGES):
        tokens = t0 + tl.arange(0, BN)
        valid = tokens < end
        # never negative: unsigned, a token's page and offset are a shift and a mask
        unsigned = tokens.to(tl.uint32)
        offset = (unsigned % BLOCK_SIZE).to(tl.int32)
        page_of = (unsigned // BLOCK_SIZE).to(tl.int32)
        page = tl.load(block_tables + b * stride_bt + page_of, mask=valid, other=0)
        packed = page >= num_recent
        plain = valid & ~packed
        comp = valid & packed
        # which pools the tile holds: all codes (the bulk of a long context), all FP8 (anchors,
        # window), or both (a tile across the boundary): each pool's dot runs only if present.
        # Read off the tile's few page ids as scalars, the same in every thread: a sum over
        # the tokens took a cross-warp reduction, three barriers a tile.
        n_plain, n_comp = _tile_pools(block_tables + b * stride_bt, t0, end, num_recent, BLOCK_SIZE, BN)  # fmt: skip
        # row numbers fit 32 bits (2^31 rows: 2^27 pages of 16 x 16 heads); their byte
        # offsets may not, so 64 bits from there on
        row = ((page * BLOCK_SIZE + offset) * HKV + hkv).to(tl.int64)
        crow = ((page - num_recent) * BLOCK_SIZE + offset) * HKV + hkv
        crow = tl.where(comp, crow, 0).to(tl.int64)
        # the codes' loads at the loop's top level, where the pipeliner prefetches them (a
        # masked lane moves no bytes); FP8 tiles (a sequence's anchor and window pages) load
        # inside their branch, so the code path carries none of their registers
        k_groups = _code_groups(k_codes, crow, comp, D, K_BITS, WORDS3)
        k_norm = tl.load(k_norms + crow, mask=comp, other=0.0).to(tl.float32)
        # per-token factors, not per-coordinate ones: the code dot runs on the centroids (unit
        # vectors) and the norm scales the score; a factor is 0 off its pool (the FP8 rows
        # there load as 0, the code rows decode to finite centroids), so the two dots add up
        scores = tl.zeros([GP, BN], dtype=tl.float32)
        if n_comp > 0:
            k_unit = _unit_rows(k_groups, k_cb, k_tables, D, K_BITS, DOT, PRMT, False)
            scores += tl.dot(b_q, tl.trans(k_unit)) * (k_norm * softmax_scale)[None, :]
        if n_plain > 0:
            k_plain = _plain_rows(k_cache, row, plain, D)
            scores += tl.dot(b_q, tl.trans(k_plain.to(DOT))) * (k_scale * softmax_scale)
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)

        v_groups = _code_groups(v_codes, crow, comp, D, V_BITS, WORDS3)
        v_norm = tl.load(v_norms + crow, mask=comp, other=0.0).to(tl.float32)
        acc = acc * alpha[None, :]
        if n_comp > 0:  # the norm scales p, not each coordinate of v
            v_unit = _unit_rows(v_groups, v_cb, v_tables, D, V_BITS, DOT, PRMT_V3, True)
            acc = tl.dot(tl.trans(v_unit), tl.trans((p * v_norm[None, :]).to(DOT)), acc)
        if n_plain > 0:
            v_plain = _plain_rows(v_cache, row, plain, D)
            p_plain = p * tl.where(plain, v_scale, 0.0)[None, :]
            acc = tl.dot(tl.trans(v_plain.to(DOT)), tl.trans(p_plain.to(DOT)), acc)
        m_i = m_new

    if SINGLE_SPLIT:
        result = acc / l_i[None, :]
        tl.store(
            out + (b * HQ + heads[None, :]) * D + offs_d[:, None],
            result.to(out.dtype.element_ty),
            mask=in_group[None, :],
        )
    else:
        safe_l = tl.where(l_i > 0, l_i, 1.0)
        lse = tl.where(l_i > 0, m_i + tl.log(safe_l), float("-inf"))
        slot = (b * HQ + heads) * num_splits + split
        tl.store(part_lse + slot, lse, mask=in_group)
        tl.store(  # an empty split writes its lse (-inf) only: the merge skips its row
            part_out + slot[None, :] * D + offs_d[:, None],
            acc / safe_l[None, :],
            mask=(in_group & (l_i > 0))[None, :],
        )


def _dot(cache: StagedAttentionCache, q: torch.Tensor) -> Any:
    # fp8 widens to fp16 in one instruction; decoded codes * norms stay far inside fp16's range
    fp8 = cache.k_cache.dtype.itemsize == 1
    return tl.float16 if fp8 and q.is_cuda else dot_dtype(q.device)


def check_staged_inputs(
    q: torch.Tensor, cache: StagedAttentionCache, block_tables: torch.Tensor
) -> None:
    """What the staged attention kernels take: q [*, Hq, D] with a contiguous last dim, Hq a
    multiple of the pools' Hkv, D a power of two, contiguous pools whose rows fit 32 bits."""
    hq, dim = q.shape[-2:]
    hkv = cache.k_cache.shape[2]
    if q.stride(-1) != 1 or not (cache.k_cache.is_contiguous() and cache.v_cache.is_contiguous()):
        raise ValueError("q needs a contiguous last dim and the caches must be contiguous")
    if hq % hkv or triton.next_power_of_2(dim) != dim or block_tables.stride(1) != 1:
        raise ValueError(
            f"unsupported shape q {tuple(q.shape)}, cache {tuple(cache.k_cache.shape)}"
        )
    check_rows_fit_32_bits(cache.k_cache)
    check_rows_fit_32_bits(cache.k_norms)


def staged_attention_decode(
    q: torch.Tensor,
    cache: StagedAttentionCache,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    partition: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    lookup: str | None = None,
    code_loads: str | None = None,
    max_registers: int | None = None,
) -> torch.Tensor:
    """Rotated q [B, Hq, D] over mixed pages; the rotated output [B, Hq, D]. block_n (tokens
    per tile, a power of two >= 16), num_warps and num_stages default to the module's
    `_TOKENS_PER_STEP`, `_NUM_WARPS`, `_NUM_STAGES` (the bench varies them); lookup (default
    `_LOOKUP`) "prmt" decodes 4-bit keys by byte permutes on CUDA, "prmt_v3" 3-bit values
    too, "tree" both by the select tree (always on CPU, and for other widths); code_loads
    (default `_CODE_LOADS`) "words" loads 3-bit codes as int32 words, "bytes" byte by byte;
    max_registers caps the registers per thread on CUDA (ptxas' maxnreg: more programs per SM,
    at the risk of spills); partition fixes the tokens per split (default: each row cuts its own
    context into `decode_splits`' count)."""
    batch, hq, dim = q.shape
    _, block_size, hkv, _ = cache.k_cache.shape
    check_staged_inputs(q, cache, block_tables)
    way = lookup or _LOOKUP
    if way not in ("tree", "prmt", "prmt_v3"):
        raise ValueError(f"lookup must be 'tree', 'prmt' or 'prmt_v3', got {way!r}")
    loads = code_loads or _CODE_LOADS
    if loads not in ("words", "bytes"):
        raise ValueError(f"code_loads must be 'words' or 'bytes', got {loads!r}")
    # ptxas' register cap is a compile option of CUDA kernels; the interpreter has none
    cap = {"maxnreg": max_registers} if max_registers and q.is_cuda else {}
    capacity = block_tables.shape[1] * block_size
    num_splits, partition = split_plan(capacity, batch, hkv, partition, q.device)
    out = torch.empty((batch, hq, dim), dtype=q.dtype, device=q.device)
    single = num_splits == 1
    part_out = out if single else q.new_empty((batch, hq, num_splits, dim), dtype=torch.float32)
    part_lse = out if single else q.new_empty((batch, hq, num_splits), dtype=torch.float32)
    k_scale, v_scale = _scales(cache)
    _staged_decode_kernel[(batch, hkv, num_splits)](
        q,
        cache.k_cache,
        cache.v_cache,
        cache.k_codes,
        cache.k_norms,
        cache.v_codes,
        cache.v_norms,
        cache.k_centroids,
        cache.v_centroids,
        context_lens,
        block_tables,
        part_out,
        part_lse,
        out,
        scale,
        k_scale,
        v_scale,
        cache.num_recent_blocks,
        q.stride(0),
        q.stride(1),
        block_tables.stride(0),
        num_splits,
        partition,
        HQ=hq,
        HKV=hkv,
        D=dim,
        BLOCK_SIZE=block_size,
        GP=max(16, triton.next_power_of_2(hq // hkv)),
        BN=block_n or _TOKENS_PER_STEP,
        K_BITS=cache.k_bits,
        V_BITS=cache.v_bits,
        SINGLE_SPLIT=single,
        DOT=_dot(cache, q),
        STAGES=num_stages or _NUM_STAGES,
        PRMT=way in ("prmt", "prmt_v3") and q.is_cuda and cache.k_bits == 4,
        PRMT_V3=way == "prmt_v3" and q.is_cuda and cache.v_bits == 3,
        WORDS3=loads == "words",
        num_warps=num_warps or _NUM_WARPS,
        **cap,
    )
    if not single:
        _combine_kernel[(batch * hq,)](
            part_out,
            part_lse,
            out,
            1.0,
            num_splits,
            D=dim,
            SP=triton.next_power_of_2(num_splits),
            num_warps=4,
        )
    return out


@kernel
def _scratch_kernel(
    k_cache,
    v_cache,
    k_codes,
    k_norms,
    v_codes,
    v_norms,
    k_centroids,
    v_centroids,
    block_tables,
    k_out,
    v_out,
    k_scale,
    v_scale,
    num_recent,
    D: tl.constexpr,
    ROWS: tl.constexpr,  # block_size * Hkv
    ROWS_P: tl.constexpr,  # ROWS rounded up to a power of two (e.g. 3 KV heads)
    K_BITS: tl.constexpr,
    V_BITS: tl.constexpr,
    PDL: tl.constexpr,
):
    """Scratch page e (entry e of the flattened tables) = the page the entry names, decoded."""
    k_cb = _half_codebook(k_centroids, K_BITS)
    v_cb = _half_codebook(v_centroids, V_BITS)
    pdl_wait(PDL)
    e = tl.program_id(0)
    page = tl.load(block_tables + e)
    packed = page >= num_recent
    r = tl.arange(0, ROWS_P)
    valid = r < ROWS
    offs_d = tl.arange(0, D)
    comp = (tl.full([ROWS_P], 0, tl.int32) + packed.to(tl.int32) > 0) & valid
    plain = (~comp) & valid
    row = page.to(tl.int64) * ROWS + r
    crow = tl.where(comp, (page - num_recent).to(tl.int64) * ROWS + r, 0)
    dst = (e.to(tl.int64) * ROWS + r)[:, None] * D + offs_d[None, :]
    k_plain = tl.load(k_cache + row[:, None] * D + offs_d[None, :], mask=plain[:, None], other=0.0)
    k_comp = _dequant_tile(k_codes, k_norms, k_cb, crow, comp, D, K_BITS)
    k = tl.where(comp[:, None], k_comp, k_plain.to(tl.float32) * k_scale)
    tl.store(k_out + dst, k.to(k_out.dtype.element_ty), mask=valid[:, None])
    v_plain = tl.load(v_cache + row[:, None] * D + offs_d[None, :], mask=plain[:, None], other=0.0)
    v_comp = _dequant_tile(v_codes, v_norms, v_cb, crow, comp, D, V_BITS)
    v = tl.where(comp[:, None], v_comp, v_plain.to(tl.float32) * v_scale)
    tl.store(v_out + dst, v.to(v_out.dtype.element_ty), mask=valid[:, None])


def staged_scratch(
    cache: StagedAttentionCache, block_tables: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """As `reference.staged_scratch`: every page the tables [B, M] name, decoded to plain
    caches of `dtype` [B * M, block_size, Hkv, D], and the tables into them."""
    batch, width = block_tables.shape
    _, block_size, hkv, dim = cache.k_cache.shape
    rows = block_size * hkv
    shape = (batch * width, block_size, hkv, dim)
    keys = torch.empty(shape, dtype=dtype, device=block_tables.device)
    values = torch.empty_like(keys)
    tables = torch.arange(batch * width, dtype=torch.int32, device=block_tables.device)
    if batch * width == 0:
        return keys, values, tables.view(batch, width)
    k_scale, v_scale = _scales(cache)
    _scratch_kernel[(batch * width,)](
        cache.k_cache,
        cache.v_cache,
        cache.k_codes,
        cache.k_norms,
        cache.v_codes,
        cache.v_norms,
        cache.k_centroids,
        cache.v_centroids,
        block_tables.contiguous(),
        keys,
        values,
        k_scale,
        v_scale,
        cache.num_recent_blocks,
        D=dim,
        ROWS=rows,
        ROWS_P=triton.next_power_of_2(rows),
        K_BITS=cache.k_bits,
        V_BITS=cache.v_bits,
        num_warps=4,
    )
    return keys, values, tables.view(batch, width)


@kernel
def _staged_prefill_kernel(
    q, k_cache, v_cache, k_codes, k_norms, v_codes, v_norms, k_centroids, v_centroids,
    cu_seqlens, context_lens, block_tables, positions, out, qk_scale, k_scale, v_scale,
    num_recent, num_seqs, stride_qt, stride_qh, stride_bt, HQ: tl.constexpr,
    HKV: tl.constexpr, D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BM: tl.constexpr,
    BN: tl.constexpr, SEQS: tl.constexpr, K_BITS: tl.constexpr, V_BITS: tl.constexpr,
    DOT: tl.constexpr, PRMT: tl.constexpr, PRMT_V3: tl.constexpr, WORDS3: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """`_prefill_kernel`'s grid and rows over mixed pages: each key tile decodes its codes in
    registers as the decode kernel does (the norms scale the scores and the probabilities), so
    no page is decoded to memory; one loop, causal masks on every tile."""
    k_cb, k_tables, v_cb, v_tables = _codebooks(k_centroids, v_centroids, K_BITS, V_BITS, DOT, PRMT, PRMT_V3)  # fmt: skip
    pdl_wait(PDL)
    h = tl.program_id(0)
    hkv = h // (HQ // HKV)
    b, start, rows, in_chunk, pos, kv_end, _ = prefill_rows(
        cu_seqlens, context_lens, positions, num_seqs, tl.program_id(1), BM, BN, SEQS
    )
    if b >= num_seqs:
        return
    b_q = prefill_queries(q, start, rows, in_chunk, h, stride_qt, stride_qh, D, DOT)
    m_i = tl.full([BM], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BM], dtype=tl.float32)
    acc = tl.zeros([BM, D], dtype=tl.float32)
    table = block_tables + b * stride_bt
    for n0 in range(0, kv_end, BN):
        keys = n0 + tl.arange(0, BN)
        present = keys < kv_end
        unsigned = keys.to(tl.uint32)
        offset = (unsigned % BLOCK_SIZE).to(tl.int32)
        page = tl.load(table + (unsigned // BLOCK_SIZE).to(tl.int32), mask=present, other=0)
        packed = page >= num_recent
        plain = present & ~packed
        comp = present & packed
        n_plain, n_comp = _tile_pools(table, n0, kv_end, num_recent, BLOCK_SIZE, BN)
        row = ((page * BLOCK_SIZE + offset) * HKV + hkv).to(tl.int64)
        crow = ((page - num_recent) * BLOCK_SIZE + offset) * HKV + hkv
        crow = tl.where(comp, crow, 0).to(tl.int64)
        scores = tl.zeros([BM, BN], dtype=tl.float32)
        if n_comp > 0:
            k_groups = _code_groups(k_codes, crow, comp, D, K_BITS, WORDS3)
            k_norm = tl.load(k_norms + crow, mask=comp, other=0.0).to(tl.float32)
            k_unit = _unit_rows(k_groups, k_cb, k_tables, D, K_BITS, DOT, PRMT, False)
            scores += tl.dot(b_q, tl.trans(k_unit)) * (k_norm * qk_scale)[None, :]
        if n_plain > 0:
            k_plain = _plain_rows(k_cache, row, plain, D)
            scores += tl.dot(b_q, tl.trans(k_plain.to(DOT))) * (k_scale * qk_scale)
        visible = present[None, :] & (keys[None, :] <= pos[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if n_comp > 0:  # the norm scales p, not each coordinate of v
            v_groups = _code_groups(v_codes, crow, comp, D, V_BITS, WORDS3)
            v_norm = tl.load(v_norms + crow, mask=comp, other=0.0).to(tl.float32)
            v_unit = _unit_rows(v_groups, v_cb, v_tables, D, V_BITS, DOT, PRMT_V3, True)
            acc = tl.dot((p * v_norm[None, :]).to(DOT), v_unit, acc)
        if n_plain > 0:
            v_plain = _plain_rows(v_cache, row, plain, D)
            p_plain = p * tl.where(plain, v_scale, 0.0)[None, :]
            acc = tl.dot(p_plain.to(DOT), v_plain.to(DOT), acc)
        m_i = m_new
    o_ptrs = out + ((start + rows)[:, None] * HQ + h) * D + tl.arange(0, D)[None, :]
    tl.store(o_ptrs, (acc / l_i[:, None]).to(out.dtype.element_ty), mask=in_chunk[:, None])


# "scratch": every page the tables name decoded to memory first, then the plain prefill kernel;
# "direct": the prefill kernel decodes each key tile's codes in registers, no scratch memory,
# but again for every query tile and head: on one H200 level at the load point, 1.7x scratch's
# TTFT at 32K and 3.7x at 128K (docs/performance.md, "Long context")
_PREFILL = "scratch"


def staged_prefill_tiles(dim: int) -> tuple[int, int, int]:
    """(query rows BM, keys per tile BN, warps) of the direct prefill: at D = 256, 64 x 32 x 8
    is the largest tiling that compiles without spills for sm_90 (128 x 64 x 8 spills 840
    bytes a thread: the accumulator, the queries and a decoded tile do not fit 255 registers)."""
    return 64, 32, 8 if dim >= 256 else 4


def staged_attention_prefill(
    q: torch.Tensor,
    cache: StagedAttentionCache,
    cu_seqlens: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    way: str | None = None,
) -> torch.Tensor:
    """Rotated q [T, Hq, D] over mixed pages. `way` (default `_PREFILL`): "scratch" decodes every
    page the tables name into a scratch of q's dtype (2 x B x M pages a call: a pass over the
    whole context every chunk, quadratic in a long prompt's chunks), then runs the plain prefill
    kernel; "direct" decodes the codes inside the prefill kernel, tile by tile (each query tile
    of each query head decodes its keys again: work that grows with the chunk, not memory)."""
    way = way or _PREFILL
    if way == "scratch":
        keys, values, tables = staged_scratch(cache, block_tables, q.dtype)
        return paged_attention_prefill(
            q, keys, values, cu_seqlens, context_lens, tables, positions, scale
        )
    if way != "direct":
        raise ValueError(f"way must be 'direct' or 'scratch', got {way!r}")
    tokens, hq, dim = q.shape
    _, block_size, hkv, _ = cache.k_cache.shape
    num_seqs = cu_seqlens.shape[0] - 1
    check_staged_inputs(q, cache, block_tables)
    out = torch.empty((tokens, hq, dim), dtype=q.dtype, device=q.device)
    if tokens == 0 or num_seqs == 0:
        return out
    bm, bn, warps = staged_prefill_tiles(dim)
    k_scale, v_scale = _scales(cache)
    _staged_prefill_kernel[(hq, triton.cdiv(tokens, bm) + num_seqs)](
        q, cache.k_cache, cache.v_cache, cache.k_codes, cache.k_norms, cache.v_codes,
        cache.v_norms, cache.k_centroids, cache.v_centroids, cu_seqlens, context_lens,
        block_tables, positions, out, scale * _LOG2E, k_scale, v_scale, cache.num_recent_blocks,
        num_seqs, q.stride(0), q.stride(1), block_tables.stride(0), HQ=hq, HKV=hkv, D=dim,
        BLOCK_SIZE=block_size, BM=bm, BN=bn, SEQS=triton.next_power_of_2(num_seqs),
        K_BITS=cache.k_bits, V_BITS=cache.v_bits, DOT=_dot(cache, q),
        PRMT=_LOOKUP in ("prmt", "prmt_v3") and q.is_cuda and cache.k_bits == 4,
        PRMT_V3=_LOOKUP == "prmt_v3" and q.is_cuda and cache.v_bits == 3,
        WORDS3=_CODE_LOADS == "words", num_warps=warps, num_stages=2,
    )  # fmt: skip
    return out


def cuda_staged(
    device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype | None
) -> tuple[bool, str]:
    """Staged pages: CUDA, 16-bit queries, an fp8 e4m3 or 16-bit recent pool."""
    ok, reason = ops.cuda_only(device, dtype, kv_dtype)
    if not ok:
        return ok, reason
    kv = kv_dtype or dtype
    if dtype not in (torch.bfloat16, torch.float16) or kv not in (
        torch.bfloat16,
        torch.float16,
        torch.float8_e4m3fn,
    ):
        return False, f"needs bf16/fp16 queries and a bf16/fp16/fp8-e4m3 recent pool, got {kv}"
    return True, f"CUDA, {kv} recent pages + TurboQuant codes"


def cuda_restage(
    device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype | None
) -> tuple[bool, str]:
    """Re-encoding reads the recent pool (dtype = its dtype here): any float pool on CUDA."""
    return ops.cuda_only(device, dtype, kv_dtype)


@triton.jit
def _rotation_block(r, cols, D: tl.constexpr, INVERSE: tl.constexpr):
    """Columns `cols` of the rotation [D, D] (INVERSE: of its transpose), as a [D, BN] tile."""
    k = tl.arange(0, D)
    if INVERSE:  # r^T[k, c] = r[c, k]
        return tl.load(r + cols[None, :] * D + k[:, None])
    return tl.load(r + k[:, None] * D + cols[None, :])


@triton.jit
def _rotate_rows(x, stride_t, stride_h, H, rt, out, N, pid_m, cols, D: tl.constexpr, BM: tl.constexpr, DOT: tl.constexpr):  # fmt: skip
    """Rows pid_m * BM.. of x [T, H, D] (row t * H + h, heads strided) times the tile rt, into
    the contiguous out [N, D]."""
    rows = pid_m * BM + tl.arange(0, BM)
    ok = (rows < N)[:, None]
    t, h = (rows // H).to(tl.int64), rows % H
    k = tl.arange(0, D)
    xt = tl.load(x + t[:, None] * stride_t + h[:, None] * stride_h + k[None, :], mask=ok, other=0.0)
    y = tl.dot(xt.to(DOT), rt.to(DOT))
    tl.store(out + rows[:, None].to(tl.int64) * D + cols[None, :], y.to(out.dtype.element_ty), mask=ok)  # fmt: skip


@kernel
def _rotate_qkv_kernel(
    q, k, v, r, q_out, k_out, v_out, sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, HQ, HKV, NQ, NKV,
    Q_TILES, KV_TILES, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, DOT: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """q, k and v rows (tiles of BM, in that order along the grid's x) times the rotation's
    columns pid_n * BN..: the three in one launch."""
    pid, cols = tl.program_id(0), tl.program_id(1) * BN + tl.arange(0, BN)
    rt = _rotation_block(r, cols, D, False)  # a constant: before the wait
    pdl_wait(PDL)
    if pid < Q_TILES:
        _rotate_rows(q, sq_t, sq_h, HQ, rt, q_out, NQ, pid, cols, D, BM, DOT)
    elif pid < Q_TILES + KV_TILES:
        _rotate_rows(k, sk_t, sk_h, HKV, rt, k_out, NKV, pid - Q_TILES, cols, D, BM, DOT)
    else:
        _rotate_rows(v, sv_t, sv_h, HKV, rt, v_out, NKV, pid - Q_TILES - KV_TILES, cols, D, BM, DOT)  # fmt: skip


def _dot_of(x: torch.Tensor) -> Any:
    return tl.float16 if x.dtype == torch.float16 and x.is_cuda else dot_dtype(x.device)


_ROTATE_BM = 16
# Rows (tokens x heads) from which the rotations run as cuBLAS GEMMs: each 16-row tile re-reads
# a 32 KB block of the rotation, 1 GB from L2 for a 4,096-token prefill's q (7.3 ms of that step
# on one H200, 16 layers), where a GEMM's tiles read it a few times in all. Decode steps (8 x 24
# rows) stay in one launch.
_ROTATE_GEMM_ROWS = 4096


def rotate_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rotation: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`ops.rotate_qkv` in one launch (with PDL), reading strided heads in place."""
    d = q.shape[-1]
    if any(x.stride(-1) != 1 for x in (q, k, v)):
        raise ValueError("rotate_qkv needs each head's D contiguous")
    outs = tuple(torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))
    nq, nkv = q.shape[0] * q.shape[1], k.shape[0] * k.shape[1]
    if nq == 0:
        return outs  # type: ignore[return-value]
    if nq >= _ROTATE_GEMM_ROWS:
        for x, out in zip((q, k, v), outs, strict=True):
            torch.matmul(x, rotation, out=out)
        return outs  # type: ignore[return-value]
    q_tiles, kv_tiles = triton.cdiv(nq, _ROTATE_BM), triton.cdiv(nkv, _ROTATE_BM)
    bn = min(d, 64)
    _rotate_qkv_kernel[(q_tiles + 2 * kv_tiles, d // bn)](
        q, k, v, rotation, *outs, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0),
        v.stride(1), q.shape[1], k.shape[1], nq, nkv, q_tiles, kv_tiles, D=d, BM=_ROTATE_BM,
        BN=bn, DOT=_dot_of(q), num_warps=4,
    )  # fmt: skip
    return outs  # type: ignore[return-value]


@kernel
def _unrotate_gate_kernel(
    x, r, gate, out, N, H, s_gt, s_gh, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    HAS_GATE: tl.constexpr, DOT: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """out rows [BM, BN] = (x rows @ r^T[:, cols]) rounded to x's dtype, times sigmoid(gate)
    rounded likewise (as `sigmoid_mul` rounds)."""
    pid, cols = tl.program_id(0), tl.program_id(1) * BN + tl.arange(0, BN)
    rt = _rotation_block(r, cols, D, True)
    pdl_wait(PDL)
    rows = pid * BM + tl.arange(0, BM)
    ok = (rows < N)[:, None]
    k = tl.arange(0, D)
    xt = tl.load(x + rows[:, None].to(tl.int64) * D + k[None, :], mask=ok, other=0.0)
    y = tl.dot(xt.to(DOT), rt.to(DOT)).to(out.dtype.element_ty)
    if HAS_GATE:
        t, h = (rows // H).to(tl.int64), rows % H
        g = tl.load(gate + t[:, None] * s_gt + h[:, None] * s_gh + cols[None, :], mask=ok, other=0.0)  # fmt: skip
        sig = (1.0 / (1.0 + tl.exp(-g.to(tl.float32)))).to(out.dtype.element_ty).to(tl.float32)
        y = (y.to(tl.float32) * sig).to(out.dtype.element_ty)
    tl.store(out + rows[:, None].to(tl.int64) * D + cols[None, :], y, mask=ok)


def unrotate_sigmoid_mul(
    x: torch.Tensor, gate: torch.Tensor | None, rotation: torch.Tensor
) -> torch.Tensor:
    """`ops.unrotate_sigmoid_mul` in one launch (with PDL), the gate read in place."""
    tokens, heads, d = x.shape
    if not x.is_contiguous():
        x = x.contiguous()
    if gate is not None and (gate.shape != x.shape or gate.stride(-1) != 1):
        raise ValueError(f"unrotate_sigmoid_mul: gate {tuple(gate.shape)} against {tuple(x.shape)}")  # fmt: skip
    out = torch.empty((tokens, heads * d), dtype=x.dtype, device=x.device)
    n = tokens * heads
    if n == 0:
        return out
    if n >= _ROTATE_GEMM_ROWS:
        torch.mm(x.view(n, d), rotation.T, out=out.view(n, d))
        return out if gate is None else sigmoid_mul(out, gate)
    bn = min(d, 64)
    g = gate if gate is not None else x
    _unrotate_gate_kernel[(triton.cdiv(n, _ROTATE_BM), d // bn)](
        x, rotation, g, out, n, heads, g.stride(0), g.stride(1), D=d, BM=_ROTATE_BM, BN=bn,
        HAS_GATE=gate is not None, DOT=_dot_of(x), num_warps=4,
    )  # fmt: skip
    return out


def cuda_rotation(
    device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype | None
) -> tuple[bool, str]:
    """The staged cache's rotations: 16-bit heads (whose dtype holds the rotation exactly)."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return False, f"needs 16-bit heads on CUDA, got {dtype} on {device.type}"
    return True, "CUDA, 16-bit heads of the staged cache's power-of-two width"


ops.register("rotate_qkv", rotate_qkv, cuda_rotation, name="triton.rotate_qkv")
ops.register(
    "unrotate_sigmoid_mul", unrotate_sigmoid_mul, cuda_rotation, name="triton.unrotate_sigmoid_mul"
)
ops.register("turboquant_restage", turboquant_restage, cuda_restage, name="triton.tq_restage")
ops.register(
    "staged_attention_decode", staged_attention_decode, cuda_staged, name="triton.staged_decode"
)
ops.register(
    "staged_attention_prefill",
    staged_attention_prefill,
    cuda_staged,
    name="triton.staged_prefill(scratch)",
)
