"""Triton kernels over staged KV pages (worker/models/cache.py StagedAttentionCache): recent
pages FP8, compressed pages TurboQuant codes + fp16 norms, every vector in the codec's rotated
basis (worker/kvcache/turboquant.py). References: worker.kernels.reference.

- `turboquant_restage`: one program per page, its block_size x Hkv vectors of K and V: norm,
  nearest centroid per coordinate, codes packed LSB-first (byte j, bit t holds bit (8j + t) % b
  of coordinate (8j + t) // b; each packed bit is computed from its own coordinate, so no
  register shuffles are needed).
- `staged_attention_decode`: flash-decoding as `paged_attention_decode` (grid (sequence,
  kv head, split), the GQA group's query heads as the rows of one dot), reading each token of a
  tile from whichever pool its page is in: both loads are masked, so a token costs only its own
  pool's bytes, and the tile's keys and values are merged before the dots. The query is
  already rotated and the output stays rotated (the layer un-rotates it once per head).
- `staged_attention_prefill`: compressed pages dequantized into a scratch of every page the
  batch's tables name (`_scratch_kernel`), then the plain prefill kernel over the scratch.

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
from worker.kernels.triton.paged_attention import (
    _combine_kernel,
    decode_partition,
    paged_attention_prefill,
)
from worker.models.cache import StagedAttentionCache

_TOKENS_PER_STEP = 64


@triton.jit
def _encode_row(
    src,
    row,
    scale,
    bounds,
    codes,
    norms,
    out_row,
    D: tl.constexpr,
    BITS: tl.constexpr,
    NBYTES: tl.constexpr,
    NBP: tl.constexpr,
):
    """Encode the vector src[row] (D values) into codes[out_row] and norms[out_row]."""
    offs_d = tl.arange(0, D)
    x = tl.load(src + row * D + offs_d).to(tl.float32) * scale
    norm = tl.sqrt(tl.sum(x * x, 0))
    tl.store(norms + out_row, norm.to(norms.dtype.element_ty))
    # packed byte j, bit t: bit q % BITS of coordinate q // BITS, q = 8 j + t
    byte = tl.arange(0, NBYTES)
    q = byte[:, None] * 8 + tl.arange(0, 8)[None, :]  # [NBYTES, 8]
    present = byte < (D * BITS // 8)
    coord = tl.where(present[:, None], q // BITS, 0)
    level = tl.arange(0, NBP)
    b = tl.load(bounds + level, mask=level < (1 << BITS) - 1, other=float("inf"))
    # the coordinates again, by bit position (L1 hits): u = x / |x| per packed bit
    u = tl.load(src + row * D + coord).to(tl.float32) * (scale / tl.maximum(norm, 1e-30))
    code = tl.sum((u[:, :, None] > b[None, None, :]).to(tl.int32), 2)
    bit = (code >> (q % BITS)) & 1
    packed = tl.sum(bit << tl.arange(0, 8)[None, :], 1)
    tl.store(codes + out_row * (D * BITS // 8) + byte, packed.to(tl.uint8), mask=present)


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
    K_BITS: tl.constexpr,
    V_BITS: tl.constexpr,
    K_NBYTES: tl.constexpr,
    V_NBYTES: tl.constexpr,
    NBP: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid (page, vector of the page)."""
    pdl_wait(PDL)
    i = tl.program_id(0)
    r = tl.program_id(1)
    row = tl.load(recent_blocks + i).to(tl.int64) * ROWS + r
    out_row = tl.load(compressed_blocks + i).to(tl.int64) * ROWS + r
    _encode_row(
        k_cache, row, k_scale, k_bounds, k_codes, k_norms, out_row, D, K_BITS, K_NBYTES, NBP
    )
    _encode_row(
        v_cache, row, v_scale, v_bounds, v_codes, v_norms, out_row, D, V_BITS, V_NBYTES, NBP
    )


def _scales(cache: StagedAttentionCache) -> tuple[float, float]:
    fp8 = cache.k_cache.dtype.itemsize == 1
    return (cache.k_scale, cache.v_scale) if fp8 else (1.0, 1.0)


def _bounds(centroids: torch.Tensor) -> torch.Tensor:
    return (centroids[1:] + centroids[:-1]) / 2


def turboquant_restage(
    cache: StagedAttentionCache, recent_blocks: torch.Tensor, compressed_blocks: torch.Tensor
) -> None:
    """Re-encode recent pages (block ids) into compressed pool entries (indices)."""
    n = recent_blocks.numel()
    if n == 0:
        return
    _, block_size, hkv, dim = cache.k_cache.shape
    rows = block_size * hkv
    if triton.next_power_of_2(dim) != dim or not cache.k_cache.is_contiguous():
        raise ValueError(f"unsupported page shape {tuple(cache.k_cache.shape)}")
    k_scale, v_scale = _scales(cache)
    k_bytes, v_bytes = dim * cache.k_bits // 8, dim * cache.v_bits // 8
    _restage_kernel[(n, rows)](
        cache.k_cache,
        cache.v_cache,
        cache.k_codes,
        cache.k_norms,
        cache.v_codes,
        cache.v_norms,
        _bounds(cache.k_centroids),
        _bounds(cache.v_centroids),
        recent_blocks.to(torch.int32),
        compressed_blocks.to(torch.int32),
        k_scale,
        v_scale,
        D=dim,
        ROWS=rows,
        K_BITS=cache.k_bits,
        V_BITS=cache.v_bits,
        K_NBYTES=triton.next_power_of_2(k_bytes),
        V_NBYTES=triton.next_power_of_2(v_bytes),
        NBP=max(2, triton.next_power_of_2((1 << max(cache.k_bits, cache.v_bits)) - 1)),
        num_warps=1,
    )


@triton.jit
def _dequant_tile(
    codes,
    norms,
    centroids,
    crow,
    mask,
    D: tl.constexpr,
    BITS: tl.constexpr,
):
    """Rotated-basis vectors [R, D] fp32 of compressed rows crow [R] (0 where ~mask)."""
    offs_d = tl.arange(0, D)
    nbytes: tl.constexpr = D * BITS // 8
    bit = offs_d * BITS
    lo = bit >> 3
    ptr = codes + crow[:, None] * nbytes + lo[None, :]
    word = tl.load(ptr, mask=mask[:, None], other=0).to(tl.int32)
    if 8 % BITS != 0:  # a code may straddle two bytes
        hi_ok = mask[:, None] & ((lo + 1) < nbytes)[None, :]
        word = word | (tl.load(ptr + 1, mask=hi_ok, other=0).to(tl.int32) << 8)
    code = (word >> (bit & 7)[None, :]) & ((1 << BITS) - 1)
    value = tl.load(centroids + code)
    norm = tl.load(norms + crow, mask=mask, other=0.0).to(tl.float32)
    return value * norm[:, None]


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
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    GP: tl.constexpr,
    BN: tl.constexpr,
    PARTITION: tl.constexpr,
    K_BITS: tl.constexpr,
    V_BITS: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr,
    DOT: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    b = tl.program_id(0)
    hkv = tl.program_id(1)
    split = tl.program_id(2)
    group = HQ // HKV
    heads = hkv * group + tl.arange(0, GP)
    in_group = tl.arange(0, GP) < group
    offs_d = tl.arange(0, D)

    ctx = tl.load(context_lens + b)
    start = split * PARTITION
    end = tl.minimum(start + PARTITION, ctx)
    b_q = tl.load(
        q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=in_group[:, None],
        other=0.0,
    ).to(DOT)

    m_i = tl.full([GP], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GP], dtype=tl.float32)
    acc = tl.zeros([GP, D], dtype=tl.float32)
    for t0 in range(start, end, BN):
        tokens = t0 + tl.arange(0, BN)
        valid = tokens < end
        page = tl.load(block_tables + b * stride_bt + tokens // BLOCK_SIZE, mask=valid, other=0)
        packed = page >= num_recent
        plain = valid & ~packed
        comp = valid & packed
        offset = tokens % BLOCK_SIZE
        row = (page.to(tl.int64) * BLOCK_SIZE + offset) * HKV + hkv
        crow = ((page - num_recent).to(tl.int64) * BLOCK_SIZE + offset) * HKV + hkv
        crow = tl.where(comp, crow, 0)

        k_plain = tl.load(
            k_cache + row[:, None] * D + offs_d[None, :], mask=plain[:, None], other=0.0
        )
        k_comp = _dequant_tile(k_codes, k_norms, k_centroids, crow, comp, D, K_BITS)
        b_k = tl.where(packed[:, None], k_comp, k_plain.to(tl.float32) * k_scale)
        scores = tl.dot(b_q, tl.trans(b_k.to(DOT))) * softmax_scale
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)

        v_plain = tl.load(
            v_cache + row[:, None] * D + offs_d[None, :], mask=plain[:, None], other=0.0
        )
        v_comp = _dequant_tile(v_codes, v_norms, v_centroids, crow, comp, D, V_BITS)
        b_v = tl.where(packed[:, None], v_comp, v_plain.to(tl.float32) * v_scale)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT), b_v.to(DOT))
        m_i = m_new

    if SINGLE_SPLIT:
        result = acc / l_i[:, None]
        tl.store(
            out + (b * HQ + heads[:, None]) * D + offs_d[None, :],
            result.to(out.dtype.element_ty),
            mask=in_group[:, None],
        )
    else:
        safe_l = tl.where(l_i > 0, l_i, 1.0)
        lse = tl.where(l_i > 0, m_i + tl.log(safe_l), float("-inf"))
        slot = (b * HQ + heads) * num_splits + split
        tl.store(part_lse + slot, lse, mask=in_group)
        tl.store(
            part_out + slot[:, None] * D + offs_d[None, :],
            acc / safe_l[:, None],
            mask=in_group[:, None],
        )


def _dot(cache: StagedAttentionCache, q: torch.Tensor) -> Any:
    # fp8 widens to fp16 in one instruction; decoded codes * norms stay far inside fp16's range
    fp8 = cache.k_cache.dtype.itemsize == 1
    return tl.float16 if fp8 and q.is_cuda else dot_dtype(q.device)


def staged_attention_decode(
    q: torch.Tensor,
    cache: StagedAttentionCache,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    partition: int | None = None,
) -> torch.Tensor:
    """Rotated q [B, Hq, D] over mixed pages; the rotated output [B, Hq, D]."""
    batch, hq, dim = q.shape
    _, block_size, hkv, _ = cache.k_cache.shape
    if q.stride(2) != 1 or not (cache.k_cache.is_contiguous() and cache.v_cache.is_contiguous()):
        raise ValueError("q needs a contiguous last dim and the caches must be contiguous")
    if hq % hkv or triton.next_power_of_2(dim) != dim or block_tables.stride(1) != 1:
        raise ValueError(
            f"unsupported shape q {tuple(q.shape)}, cache {tuple(cache.k_cache.shape)}"
        )
    capacity = block_tables.shape[1] * block_size
    partition = partition or decode_partition(capacity, batch, hkv)
    num_splits = triton.cdiv(capacity, partition)
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
        HQ=hq,
        HKV=hkv,
        D=dim,
        BLOCK_SIZE=block_size,
        GP=max(16, triton.next_power_of_2(hq // hkv)),
        BN=_TOKENS_PER_STEP,
        PARTITION=partition,
        K_BITS=cache.k_bits,
        V_BITS=cache.v_bits,
        SINGLE_SPLIT=single,
        DOT=_dot(cache, q),
        num_warps=4,
        num_stages=2,
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
    k_comp = _dequant_tile(k_codes, k_norms, k_centroids, crow, comp, D, K_BITS)
    k = tl.where(comp[:, None], k_comp, k_plain.to(tl.float32) * k_scale)
    tl.store(k_out + dst, k.to(k_out.dtype.element_ty), mask=valid[:, None])
    v_plain = tl.load(v_cache + row[:, None] * D + offs_d[None, :], mask=plain[:, None], other=0.0)
    v_comp = _dequant_tile(v_codes, v_norms, v_centroids, crow, comp, D, V_BITS)
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


def staged_attention_prefill(
    q: torch.Tensor,
    cache: StagedAttentionCache,
    cu_seqlens: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Rotated q [T, Hq, D] over mixed pages: the pages decoded to a scratch in q's dtype, then
    the plain prefill kernel. The scratch costs 2 x B x M pages of q's dtype per call."""
    keys, values, tables = staged_scratch(cache, block_tables, q.dtype)
    return paged_attention_prefill(
        q, keys, values, cu_seqlens, context_lens, tables, positions, scale
    )


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
