"""Paged attention for decode (one query token per sequence), split over the context
(flash-decoding): grid (sequence, kv head, split).

Each program takes all Hq // Hkv query heads of its kv head at once (GQA: the K and V tiles are
read once for the whole group, padded to 16 rows for the tensor cores) and one partition of the
context, gathering BN tokens per step through the block table. It keeps an online softmax and
writes its partial output with its log-sum-exp; `_combine_kernel` merges the partitions.

The grid depends only on shapes (block_tables' width, not the context lengths), so the op can be
captured in a CUDA graph; trimming block_tables to the batch's longest context keeps the number
of empty partitions small. FP8 caches (e4m3, value / scale stored) are widened to fp16 for the
dot (q too; post-norm queries are far inside fp16's range); k_scale folds into the softmax scale and v_scale into the output. Under the CPU interpreter
the dots run in fp32 (its bf16 dot multiplies raw bits).

Prefill (a chunk of query tokens per sequence) is `paged_attention_prefill`, further down:
flash attention over the same caches, grid (query head, query tile), same fp8 handling; over a
long context the FP8 pages are widened once into a 16-bit scratch first (`widened_pages`).

Size: Decode and prefill kernels over one paged layout, with their launchers: they share the
page-addressing code.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from worker.kernels.triton._launch import dot_dtype, kernel, pdl_wait

# programs a decode launch aims at: four per SM of an H100/H200 (at 8 x 32K on one H200, 16
# splits a sequence took 257 us a layer against 395 for 9: bench/engine/staged_kv.py)
_TARGET_PROGRAMS = 4 * 132
_TOKENS_PER_STEP = 64
# the fewest tokens a split takes of a row's context: shorter splits measured no faster and
# cost more merging (run 2)
_MIN_SPLIT_TOKENS = tl.constexpr(128)
_LOG2E = 1.4426950408889634  # the prefill softmax runs in exp2


@kernel
def _decode_partition_kernel(
    q,
    k_cache,
    v_cache,
    context_lens,
    block_tables,
    part_out,
    part_lse,
    out,
    softmax_scale,
    v_scale,
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
    start, end = split_range(ctx, split, num_splits, partition, BN)
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
        # never negative: unsigned, a token's page and offset are a shift and a mask
        unsigned = tokens.to(tl.uint32)
        page_of = (unsigned // BLOCK_SIZE).to(tl.int32)
        page = tl.load(block_tables + b * stride_bt + page_of, mask=valid, other=0)
        # row numbers fit 32 bits (2^31 rows: 2^27 pages of 16 x 16 heads); their byte
        # offsets may not, so 64 bits from there on
        row = ((page * BLOCK_SIZE + (unsigned % BLOCK_SIZE).to(tl.int32)) * HKV + hkv).to(tl.int64)
        b_k = tl.load(k_cache + row[:, None] * D + offs_d[None, :], mask=valid[:, None], other=0.0)
        scores = tl.dot(b_q, tl.trans(b_k.to(DOT))) * softmax_scale
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        b_v = tl.load(v_cache + row[:, None] * D + offs_d[None, :], mask=valid[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT), b_v.to(DOT))
        m_i = m_new

    if SINGLE_SPLIT:
        result = acc * (v_scale / l_i)[:, None]
        tl.store(
            out + (b * HQ + heads[:, None]) * D + offs_d[None, :],
            result.to(out.dtype.element_ty),
            mask=in_group[:, None],
        )
    else:
        # an empty split (past the context) leaves l_i = 0: it writes lse -inf only, and the
        # merge neither weighs nor reads its row
        safe_l = tl.where(l_i > 0, l_i, 1.0)
        lse = tl.where(l_i > 0, m_i + tl.log(safe_l), float("-inf"))
        slot = (b * HQ + heads) * num_splits + split
        tl.store(part_lse + slot, lse, mask=in_group)
        tl.store(
            part_out + slot[:, None] * D + offs_d[None, :],
            acc / safe_l[:, None],
            mask=(in_group & (l_i > 0))[:, None],
        )


@triton.jit
def split_range(ctx, split, num_splits, partition, BN: tl.constexpr):
    """[start, end) of a sequence's tokens that split `split` reads: `partition` tokens a split
    when > 0, else the sequence's own context cut into num_splits parts of whole BN-token tiles,
    at least _MIN_SPLIT_TOKENS each (so a row's splits share its context evenly whatever the
    table's capacity; a split past the context is empty). BN must divide _MIN_SPLIT_TOKENS."""
    per = tl.maximum(tl.cdiv(tl.cdiv(ctx, num_splits), BN) * BN, _MIN_SPLIT_TOKENS)
    if partition > 0:
        per = partition
    start = split * per
    return start, tl.minimum(start + per, ctx)


@kernel
def _combine_kernel(
    part_out,
    part_lse,
    out,
    v_scale,
    num_splits,
    D: tl.constexpr,
    SP: tl.constexpr,
    PDL: tl.constexpr,
    CH: tl.constexpr = 16,
):
    pdl_wait(PDL)
    bh = tl.program_id(0)  # b * HQ + h
    splits = tl.arange(0, SP)
    lse = tl.load(
        part_lse + bh * num_splits + splits, mask=splits < num_splits, other=float("-inf")
    )
    top = tl.max(lse, 0)
    total = tl.sum(tl.exp(lse - top), 0)
    offs_d = tl.arange(0, D)
    # the partial outputs CH splits at a time: a [SP, D] tile at once is 512 fp32 a thread at
    # batch 1 (132 splits, SP 256, D 256), spilled
    acc = tl.zeros([D], dtype=tl.float32)
    for first in range(0, num_splits, CH):
        chunk = first + tl.arange(0, CH)
        lse_c = tl.load(
            part_lse + bh * num_splits + chunk, mask=chunk < num_splits, other=float("-inf")
        )
        parts = tl.load(
            part_out + (bh * num_splits + chunk)[:, None] * D + offs_d[None, :],
            mask=((chunk < num_splits) & (lse_c > float("-inf")))[:, None],
            other=0.0,
        )
        acc += tl.sum(parts * tl.exp(lse_c - top)[:, None], 0)
    result = acc * (v_scale / total)
    tl.store(out + bh * D + offs_d, result.to(out.dtype.element_ty))


def decode_splits(batch: int, kv_heads: int, device: torch.device) -> int:
    """Splits per sequence: enough programs to fill the GPU (on a CPU, where the interpreter runs
    them one by one, 8: enough to exercise the merge). Each row cuts its own context into these
    (`split_range`); splits past a short context are empty and cost a launch slot, not a pass."""
    # by the batch's power-of-two bucket only, not the table's width: the count is a
    # compile-time choice of the merge (SP), so one variant per bucket, which the engine's
    # warm-up meets in its steps of each decode bucket; no width needs warming up
    if device.type != "cuda":
        return 8
    return max(1, triton.cdiv(_TARGET_PROGRAMS, triton.next_power_of_2(batch) * kv_heads))


def check_rows_fit_32_bits(cache: torch.Tensor) -> None:
    """The decode loops number a page's (token, head) rows in 32 bits: a pool [blocks,
    block_size, Hkv, ...] of 2^31 rows or more is refused (2^27 pages of 16 x 16 heads)."""
    rows = cache.shape[0] * cache.shape[1] * cache.shape[2]
    if rows >= 2**31:
        raise ValueError(f"a pool of {rows} (token, head) rows does not fit the decode's 32 bits")


def split_plan(
    capacity: int, batch: int, kv_heads: int, partition: int | None, device: torch.device
) -> tuple[int, int]:
    """(splits, partition argument): a fixed `partition` (tokens a split) where given, else
    decode_splits' count with per-row partitions (0)."""
    if partition:
        return triton.cdiv(capacity, partition), partition
    return decode_splits(batch, kv_heads, device), 0


def paged_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    partition: int | None = None,
) -> torch.Tensor:
    """q [B, Hq, D] over caches [num_blocks, block_size, Hkv, D] (bf16/fp16 or fp8 e4m3)."""
    batch, hq, dim = q.shape
    _, block_size, hkv, _ = k_cache.shape
    if q.stride(2) != 1 or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("q needs a contiguous last dim and the caches must be contiguous")
    if hq % hkv or triton.next_power_of_2(dim) != dim or block_tables.stride(1) != 1:
        raise ValueError(f"unsupported shape q {tuple(q.shape)}, cache {tuple(k_cache.shape)}")
    check_rows_fit_32_bits(k_cache)
    capacity = block_tables.shape[1] * block_size
    num_splits, partition = split_plan(capacity, batch, hkv, partition, q.device)
    out = torch.empty((batch, hq, dim), dtype=q.dtype, device=q.device)
    single = num_splits == 1
    part_out = out if single else q.new_empty((batch, hq, num_splits, dim), dtype=torch.float32)
    part_lse = out if single else q.new_empty((batch, hq, num_splits), dtype=torch.float32)
    _decode_partition_kernel[(batch, hkv, num_splits)](
        q,
        k_cache,
        v_cache,
        context_lens,
        block_tables,
        part_out,
        part_lse,
        out,
        scale * k_scale,
        v_scale,
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
        BN=_TOKENS_PER_STEP,
        SINGLE_SPLIT=single,
        # fp8 widens to fp16 in one instruction (to bf16 it takes a detour through fp32)
        DOT=tl.float16 if k_cache.dtype.itemsize == 1 and q.is_cuda else dot_dtype(q.device),
        num_warps=4,
        num_stages=2,
    )
    if not single:
        _combine_kernel[(batch * hq,)](
            part_out,
            part_lse,
            out,
            v_scale,
            num_splits,
            D=dim,
            SP=triton.next_power_of_2(num_splits),
            num_warps=4,
        )
    return out


# ---------------------------------------------------------------- prefill
#
# Flash attention over the paged cache: grid (query head, query tile). One program takes BM
# tokens of one sequence's chunk for one query head and walks that sequence's keys 0..p (p the
# tile's last absolute position) BN at a time through the block table, with an online softmax in
# fp32. Keys the whole tile sees run unmasked; only the few steps on the diagonal are masked.
#
# One query head per program, not the Hq // Hkv heads of a kv head packed into the rows: at
# D = 256 the fp32 accumulator [rows, D] caps a program at ~128 rows, so packing 6 heads would
# give tiles of ~21 tokens; the total K/V read (tiles x keys per tile) is the same either way and
# a prefill batch's K/V (8 x 512 tokens: 16 MiB bf16) sits in L2. Instead the query head is the
# fastest grid axis, so the 6 heads of one kv head run side by side on the same tile and share
# its K/V blocks in L2. Packing would only trim masked diagonal work, at the cost of gathered
# query rows.
#
# No host syncs (so the op can be captured): the tile -> sequence map is computed by each
# program from cu_seqlens (tiles per sequence, their running sum), and the grid is an upper
# bound from shapes: sum_b ceil(len_b / BM) <= ceil(T / BM) + B. Surplus programs return at once.
# Within a sequence tiles run last-first, so the longest (latest) tiles start first.


@triton.jit
def prefill_rows(cu_seqlens, context_lens, positions, num_seqs, tile, BM: tl.constexpr, BN: tl.constexpr, SEQS: tl.constexpr):  # fmt: skip
    """A prefill program's query rows: (sequence b, its first token start, the rows (last tile
    first within the sequence), which are in the chunk, their positions, the key bound kv_end,
    and unmasked_end, below which every row sees every key in whole BN tiles). b >= num_seqs:
    the program has no rows."""
    # which sequence this tile belongs to: the number of sequences whose tiles all come before
    seqs = tl.arange(0, SEQS)
    listed = seqs < num_seqs
    starts = tl.load(cu_seqlens + seqs, mask=listed, other=0)
    lens = tl.load(cu_seqlens + seqs + 1, mask=listed, other=0) - starts
    tiles = (lens + BM - 1) // BM
    tiles_through = tl.cumsum(tiles, 0)
    b = tl.sum((tiles_through <= tile).to(tl.int32), 0)
    mine = seqs == b
    start = tl.sum(tl.where(mine, starts, 0), 0)
    length = tl.sum(tl.where(mine, lens, 0), 0)
    last_tile = tl.sum(tl.where(mine, tiles_through, 0), 0) - 1
    rows = (last_tile - tile) * BM + tl.arange(0, BM)  # last-first within the sequence
    # a surplus program (b = num_seqs) has last_tile -1, so negative rows: none of them are in
    # the chunk (they once were, and their query and position loads read before the tensors)
    in_chunk = (rows >= 0) & (rows < length)
    ctx = tl.load(context_lens + tl.minimum(b, num_seqs - 1))
    # padding rows take position 0: they see key 0, so their softmax stays finite (not stored)
    pos = tl.load(positions + start + rows, mask=in_chunk, other=0).to(tl.int32)
    # keys every row sees (below the tile's first position) run unmasked; the rest, up to its
    # last position, are masked per row. Both stop at the context length.
    kv_end = tl.minimum(tl.max(pos, 0) + 1, ctx)
    unmasked_end = (tl.minimum(tl.min(tl.where(in_chunk, pos, ctx), 0) + 1, kv_end) // BN) * BN
    return b, start, rows, in_chunk, pos, kv_end, unmasked_end


@triton.jit
def prefill_queries(q, start, rows, in_chunk, h, stride_qt, stride_qh, D: tl.constexpr, DOT: tl.constexpr):  # fmt: skip
    """Query head h of the program's rows (`prefill_rows`), in DOT; 0 past the chunk."""
    offs_d = tl.arange(0, D)
    q_ptrs = q + (start + rows)[:, None] * stride_qt + h * stride_qh + offs_d[None, :]
    return tl.load(q_ptrs, mask=in_chunk[:, None], other=0.0).to(DOT)


@kernel
def _prefill_kernel(
    q,
    k_cache,
    v_cache,
    cu_seqlens,
    context_lens,
    block_tables,
    positions,
    out,
    qk_scale,
    v_scale,
    num_seqs,
    stride_qt,
    stride_qh,
    stride_bt,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    SEQS: tl.constexpr,
    DOT: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    h = tl.program_id(0)
    hkv = h // (HQ // HKV)
    b, start, rows, in_chunk, pos, kv_end, unmasked_end = prefill_rows(
        cu_seqlens, context_lens, positions, num_seqs, tl.program_id(1), BM, BN, SEQS
    )
    if b >= num_seqs:
        return
    offs_d = tl.arange(0, D)
    b_q = prefill_queries(q, start, rows, in_chunk, h, stride_qt, stride_qh, D, DOT)

    m_i = tl.full([BM], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BM], dtype=tl.float32)
    acc = tl.zeros([BM, D], dtype=tl.float32)
    table = block_tables + b * stride_bt
    for n0 in range(0, unmasked_end, BN):
        keys = n0 + tl.arange(0, BN)
        page = tl.load(table + keys // BLOCK_SIZE)
        slot = (page.to(tl.int64) * BLOCK_SIZE + keys % BLOCK_SIZE) * HKV + hkv
        b_k = tl.load(k_cache + slot[:, None] * D + offs_d[None, :])
        scores = tl.dot(b_q, tl.trans(b_k.to(DOT))) * qk_scale
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        b_v = tl.load(v_cache + slot[:, None] * D + offs_d[None, :])
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT), b_v.to(DOT))
        m_i = m_new
    for n0 in range(unmasked_end, kv_end, BN):
        keys = n0 + tl.arange(0, BN)
        present = keys < kv_end
        page = tl.load(table + keys // BLOCK_SIZE, mask=present, other=0)
        slot = (page.to(tl.int64) * BLOCK_SIZE + keys % BLOCK_SIZE) * HKV + hkv
        b_k = tl.load(
            k_cache + slot[:, None] * D + offs_d[None, :], mask=present[:, None], other=0.0
        )
        scores = tl.dot(b_q, tl.trans(b_k.to(DOT))) * qk_scale
        visible = present[None, :] & (keys[None, :] <= pos[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        b_v = tl.load(
            v_cache + slot[:, None] * D + offs_d[None, :], mask=present[:, None], other=0.0
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT), b_v.to(DOT))
        m_i = m_new

    result = acc * (v_scale / l_i)[:, None]
    o_ptrs = out + ((start + rows)[:, None] * HQ + h) * D + offs_d[None, :]
    tl.store(o_ptrs, result.to(out.dtype.element_ty), mask=in_chunk[:, None])


def prefill_tiles(dim: int) -> tuple[int, int, int]:
    """(query rows BM, keys per step BN, warps) per head dim. At D = 256 two warpgroups take 64
    rows each (a full m64 wgmma apiece). H200 sweep at 8 x 512, 24 q / 4 kv heads
    (bench/results/2026-11-29-h200-88106d9-kernels_bench_prefill.json, us per layer, bf16 / fp8
    cache): 128 x 64 x 8 warps 132 / 181, 64 x 32 x 4 warps 133 / 179, 128 x 32 x 8 warps
    161 / 204, the rest slower.
    128 x 64 is best or within 1% on both."""
    if dim >= 256:
        return 128, 64, 8
    return 64, 64, 4


# FP8 pages widen to fp16 inside the prefill kernel once per query tile and query head, so over a
# long context the conversions, not the bytes, bound it. From this many tokens of table width a
# chunk's pages are widened once, into an fp16 scratch (exact: every e4m3 value is an fp16
# value), and the kernel runs on 16-bit pages with the same dot type: the same output. On one
# H200 (27B shape, one prompt, 8K chunks): TTFT at 8K 0.49 s either way, at 32K 2.54 -> 2.39 s,
# at 128K 19.43 -> 16.64 s (docs/performance.md, "Long context"). 0: never.
FP8_SCRATCH_FROM_TOKENS = 16_384
# ... while the scratch (B x table width pages of K and V, in fp16) stays within this many bytes:
# 262K tokens of one sequence at the 27B shape take 1 GiB (plus half that in passing, the
# gathered e4m3 pages); a step of many long rows keeps the in-kernel widening rather than take
# GiBs beside a KV pool sized from free memory
FP8_SCRATCH_MAX_BYTES = 1 << 30


def widened_pages(
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(keys, values, tables): every page the tables [B, M] name, in fp16, as caches [B * M,
    block_size, Hkv, D], and the tables into them."""
    batch, width = block_tables.shape
    pages = block_tables.reshape(-1).long()
    keys = k_cache.index_select(0, pages).to(torch.float16)
    values = v_cache.index_select(0, pages).to(torch.float16)
    tables = torch.arange(batch * width, dtype=torch.int32, device=block_tables.device)
    return keys, values, tables.view(batch, width)


def paged_attention_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 2,
    widen_from_tokens: int | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's chunk q [T, Hq, D] over its context in the caches
    [num_blocks, block_size, Hkv, D] (bf16/fp16 or fp8 e4m3): cached prefix + this chunk.
    FP8 pages go through `widened_pages` from `widen_from_tokens` of table width (default
    FP8_SCRATCH_FROM_TOKENS; 0: never) while the scratch fits FP8_SCRATCH_MAX_BYTES."""
    tokens, hq, dim = q.shape
    _, block_size, hkv, _ = k_cache.shape
    num_seqs = cu_seqlens.shape[0] - 1
    if q.stride(2) != 1 or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("q needs a contiguous last dim and the caches must be contiguous")
    if hq % hkv or triton.next_power_of_2(dim) != dim or block_tables.stride(1) != 1:
        raise ValueError(f"unsupported shape q {tuple(q.shape)}, cache {tuple(k_cache.shape)}")
    out = torch.empty((tokens, hq, dim), dtype=q.dtype, device=q.device)
    if tokens == 0 or num_seqs == 0:
        return out
    fp8 = k_cache.dtype.itemsize == 1
    # fp8 widens to fp16 in one instruction (to bf16 it takes a detour through fp32)
    dot = tl.float16 if fp8 and q.is_cuda else dot_dtype(q.device)
    widen_from = FP8_SCRATCH_FROM_TOKENS if widen_from_tokens is None else widen_from_tokens
    long_enough = 0 < widen_from <= block_tables.shape[1] * block_size
    scratch_bytes = 4 * block_tables.numel() * k_cache[0].numel()  # K and V, 2 bytes a value
    if fp8 and long_enough and scratch_bytes <= FP8_SCRATCH_MAX_BYTES:
        k_cache, v_cache, block_tables = widened_pages(k_cache, v_cache, block_tables)
    bm, bn, warps = prefill_tiles(dim)
    bm, bn, warps = block_m or bm, block_n or bn, num_warps or warps
    _prefill_kernel[(hq, triton.cdiv(tokens, bm) + num_seqs)](
        q,
        k_cache,
        v_cache,
        cu_seqlens,
        context_lens,
        block_tables,
        positions,
        out,
        scale * k_scale * _LOG2E,
        v_scale,
        num_seqs,
        q.stride(0),
        q.stride(1),
        block_tables.stride(0),
        HQ=hq,
        HKV=hkv,
        D=dim,
        BLOCK_SIZE=block_size,
        BM=bm,
        BN=bn,
        SEQS=triton.next_power_of_2(num_seqs),
        DOT=dot,
        num_warps=warps,
        num_stages=num_stages,
    )
    return out
