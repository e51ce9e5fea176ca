"""Gated DeltaNet in triton: the one-token recurrent decode and the chunked (WY) prefill.

The recurrence, per value head with state S [dk, dv], for each token t (computed in fp32; the
slot pool stores S in fp32, or in bf16/fp16 to halve the bytes a decode step moves):
    q, k <- l2norm(q), l2norm(k)                 (when use_qk_l2norm)
    S    <- exp(g_t) * S
    S    <- S + k_t (beta_t * (v_t - S^T k_t))^T  (the delta rule)
    o_t  <- S^T q_t * scale
Value head h reads query/key head h // (Hv // Hk). States live in a slot pool [S, Hv, dk, dv];
`state_slots[b]` names sequence b's slot, updated in place.

Prefill splits each sequence into chunks of BT tokens. Within a chunk, with gc the cumulative
log decay and A_ij = beta_i k_i.k_j exp(gc_i - gc_j) for i > j, the WY form gives
    M = (I + A)^-1,  w = M (beta k exp(gc)),  u = M (beta v)
and then, chunk by chunk with the state S at the chunk's start,
    v' = u - w S
    o  = scale * ((q exp(gc)) S + tril(q k^T exp(gc_i - gc_j)) v')
    S  <- exp(gc_last) S + (k exp(gc_last - gc))^T v'
`_wy_prepare_kernel` does the first part for all chunks in parallel; `_chunk_scan_kernel` walks
each sequence's chunks in order, holding a [dk, BV] slice of the state in registers.
Every exponent is <= 0, so no exp overflows.

Size: The gated delta rule's chunked prefill and recurrent decode kernels with their launchers:
they share the state layout.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from worker.kernels.triton._launch import kernel, pdl_wait

L2NORM_EPS = 1e-6
STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Launch settings used when a call names none: the H200 winners at the 27B shape on a bf16 pool
# (bench/results/2026-11-29-h200-bb766f8-gpu_suite.json: decode 11.7 us per layer against 14.9
# for the earlier 32 x 2 warps; prefill 8 x 512 tokens 488 us per layer against 671 for chunk 32).
# bench/engine/suite.py's `gdn` section re-times the alternatives and stores its winners here.
DECODE_LAUNCH: dict[str, int] = {"block_v": 64, "num_warps": 4}
# Batches over WIDE_ROWS sequences (bench/results/2026-12-03-h200-dbc957a-gdn64.json: at 64 rows
# 32-column tiles take 99.7 us a layer against 75.9 for 64 x 2 warps, where at 8 rows they win).
WIDE_ROWS = 16
WIDE_DECODE_LAUNCH: dict[str, int] = {"block_v": 64, "num_warps": 2}
PREFILL_LAUNCH: dict[str, int] = {
    "chunk_size": 16,
    "block_v": 64,
    "prepare_warps": 2,
    "scan_warps": 4,
}


@kernel
def _decode_kernel(
    q,
    k,
    v,
    g,
    beta,
    state,
    state_slots,
    o,
    scale,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kh,
    stride_vb,
    stride_vh,
    HK: tl.constexpr,
    HV: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BV: tl.constexpr,
    EARLY_STATE: tl.constexpr,
    USE_L2NORM: tl.constexpr,
    PDL: tl.constexpr,
):
    i_bh = tl.program_id(0)
    i_v = tl.program_id(1)
    b = i_bh // HV
    hv = i_bh % HV
    hk = hv // (HV // HK)
    offs_k = tl.arange(0, DK)
    offs_v = i_v * BV + tl.arange(0, BV)
    slot = tl.load(state_slots + b).to(tl.int64)
    p_s = state + ((slot * HV + hv) * DK + offs_k[:, None]) * DV + offs_v[None, :]
    # EARLY_STATE: the caller says the kernel just before did not write the pool, so under
    # programmatic dependent launch the state (the bytes that bound this op) loads during its tail
    if EARLY_STATE:
        s_raw = tl.load(p_s)
        pdl_wait(PDL)
    else:
        pdl_wait(PDL)
        s_raw = tl.load(p_s)

    b_q = tl.load(q + b * stride_qb + hk * stride_qh + offs_k).to(tl.float32)
    b_k = tl.load(k + b * stride_kb + hk * stride_kh + offs_k).to(tl.float32)
    b_v = tl.load(v + b * stride_vb + hv * stride_vh + offs_v).to(tl.float32)
    b_g = tl.load(g + b * HV + hv).to(tl.float32)
    b_beta = tl.load(beta + b * HV + hv).to(tl.float32)
    if USE_L2NORM:
        b_q = b_q / tl.sqrt(tl.sum(b_q * b_q) + 1e-6)
        b_k = b_k / tl.sqrt(tl.sum(b_k * b_k) + 1e-6)

    b_s = s_raw.to(tl.float32) * tl.exp(b_g)
    delta = (b_v - tl.sum(b_s * b_k[:, None], 0)) * b_beta
    b_s += b_k[:, None] * delta[None, :]
    b_o = tl.sum(b_s * b_q[:, None], 0) * scale
    tl.store(p_s, b_s.to(state.dtype.element_ty))
    tl.store(o + (b * HV + hv) * DV + offs_v, b_o.to(o.dtype.element_ty))


def decode_launch(batch: int) -> dict[str, int]:
    """The launch settings for a decode of `batch` sequences."""
    return DECODE_LAUNCH if batch <= WIDE_ROWS else WIDE_DECODE_LAUNCH


def gated_delta_rule_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    state_slots: torch.Tensor,
    scale: float,
    use_qk_l2norm: bool,
    block_v: int | None = None,
    num_warps: int | None = None,
    early_state: bool = False,
) -> torch.Tensor:
    """One token per sequence: q, k [B, Hk, dk], v [B, Hv, dv], g, beta [B, Hv] -> o [B, Hv, dv].

    One program per (sequence, value head, block_v columns of the state): it reads its [dk,
    block_v] slice once and writes it once, the bytes that bound this op. `early_state`: the kernel launched just before this one did not write the pool
    (the model's layers: the conv or another sequence's prefill precede it), so under
    programmatic dependent launch the first state loads may start before that kernel ends."""
    batch, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    _check_heads(q, k, v, state)
    g, beta = g.contiguous(), beta.contiguous()
    o = torch.empty((batch, hv, dv), dtype=v.dtype, device=v.device)
    if batch == 0:
        return o
    launch = decode_launch(batch)
    block_v = min(dv, block_v or launch["block_v"])
    num_warps = num_warps or launch["num_warps"]
    _decode_kernel[(batch * hv, dv // block_v)](
        q,
        k,
        v,
        g,
        beta,
        state,
        state_slots,
        o,
        scale,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        HK=hk,
        HV=hv,
        DK=dk,
        DV=dv,
        BV=block_v,
        EARLY_STATE=early_state,
        USE_L2NORM=use_qk_l2norm,
        num_warps=num_warps,
    )
    return o


@kernel
def _wy_prepare_kernel(
    k,
    v,
    g,
    beta,
    cu_seqlens,
    num_seqs,
    gc_out,
    w_out,
    u_out,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    HK: tl.constexpr,
    HV: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BT: tl.constexpr,
    SUB: tl.constexpr,
    B_PAD: tl.constexpr,
    USE_L2NORM: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    i_c = tl.program_id(0)
    hv = tl.program_id(1)
    hk = hv // (HV // HK)
    # Which sequence and which of its chunks this program has, from cu_seqlens alone (no host
    # read, so the op can be graph-captured); programs past the last chunk mask everything.
    offs_b = tl.arange(0, B_PAD)
    starts = tl.load(cu_seqlens + offs_b, mask=offs_b < num_seqs, other=0)
    ends = tl.load(cu_seqlens + offs_b + 1, mask=offs_b < num_seqs, other=0)
    counts = (ends - starts + BT - 1) // BT
    chunks_through = tl.cumsum(counts, 0)
    seq = tl.sum((chunks_through <= i_c).to(tl.int32), 0)
    chunk = i_c - tl.sum(tl.where(offs_b == seq, chunks_through - counts, 0), 0)
    seq_c = tl.minimum(seq, num_seqs - 1)
    bos = tl.load(cu_seqlens + seq_c).to(tl.int64)
    eos = tl.where(seq < num_seqs, tl.load(cu_seqlens + seq_c + 1).to(tl.int64), bos)
    rows = bos + chunk * BT + tl.arange(0, BT)
    valid = rows < eos
    offs_k = tl.arange(0, DK)
    offs_v = tl.arange(0, DV)

    b_g = tl.load(g + rows * HV + hv, mask=valid, other=0.0).to(tl.float32)
    b_gc = tl.cumsum(b_g, 0)
    b_beta = tl.load(beta + rows * HV + hv, mask=valid, other=0.0).to(tl.float32)
    b_k = tl.load(
        k + rows[:, None] * stride_kt + hk * stride_kh + offs_k[None, :],
        mask=valid[:, None],
        other=0.0,
    ).to(tl.float32)
    if USE_L2NORM:
        b_k = b_k / tl.sqrt(tl.sum(b_k * b_k, 1) + 1e-6)[:, None]
    b_v = tl.load(
        v + rows[:, None] * stride_vt + hv * stride_vh + offs_v[None, :],
        mask=valid[:, None],
        other=0.0,
    ).to(tl.float32)

    # A: strictly lower triangle of beta_i k_i.k_j exp(gc_i - gc_j)
    i_idx = tl.arange(0, BT)[:, None]
    j_idx = tl.arange(0, BT)[None, :]
    lower = i_idx > j_idx
    decay = tl.exp(tl.where(lower, b_gc[:, None] - b_gc[None, :], float("-inf")))
    b_a = tl.dot(b_k * b_beta[:, None], tl.trans(b_k)) * decay

    # M = (I + A)^-1. Forward substitution, M_i = e_i - sum_{j<i} A_ij M_j, is the stable way (A's
    # entries can be near 1 for repeated keys) but sequential: it runs inside the diagonal blocks
    # of SUB rows, all blocks at once (row i of every block per step), giving the block-diagonal
    # inverse D. The off-diagonal part A_off then enters exactly through M = D - D A_off M, whose
    # iteration from D ends after BT/SUB - 1 steps (D A_off is nilpotent across blocks).
    same_block = (i_idx // SUB) == (j_idx // SUB)
    a_diag = tl.where(same_block, b_a, 0.0)
    eye = tl.where(i_idx == j_idx, 1.0, 0.0)
    b_m = eye
    for i in range(1, SUB):
        step_rows = (i_idx % SUB) == i
        b_m = tl.where(step_rows, eye - tl.dot(a_diag, b_m, input_precision="ieee"), b_m)
    if BT > SUB:
        d_a_off = tl.dot(b_m, tl.where(same_block, 0.0, b_a), input_precision="ieee")
        b_d = b_m
        for _ in tl.static_range(BT // SUB - 1):
            b_m = b_d - tl.dot(d_a_off, b_m, input_precision="ieee")

    b_w = tl.dot(b_m, b_k * (b_beta * tl.exp(b_gc))[:, None])
    b_u = tl.dot(b_m, b_v * b_beta[:, None])
    tl.store(gc_out + rows * HV + hv, b_gc, mask=valid)
    p_w = w_out + (rows[:, None] * HV + hv) * DK + offs_k[None, :]
    tl.store(p_w, b_w.to(w_out.dtype.element_ty), mask=valid[:, None])
    p_u = u_out + (rows[:, None] * HV + hv) * DV + offs_v[None, :]
    tl.store(p_u, b_u.to(u_out.dtype.element_ty), mask=valid[:, None])


@kernel
def _chunk_scan_kernel(
    q,
    k,
    gc,
    w,
    u,
    o,
    state,
    state_slots,
    has_initial_state,
    cu_seqlens,
    scale,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    HK: tl.constexpr,
    HV: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BT: tl.constexpr,
    BV: tl.constexpr,
    USE_L2NORM: tl.constexpr,
    DOT: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    seq = tl.program_id(0)
    hv = tl.program_id(1)
    i_v = tl.program_id(2)
    hk = hv // (HV // HK)
    bos = tl.load(cu_seqlens + seq).to(tl.int64)
    eos = tl.load(cu_seqlens + seq + 1).to(tl.int64)
    offs_k = tl.arange(0, DK)
    offs_v = i_v * BV + tl.arange(0, BV)
    causal = tl.arange(0, BT)[:, None] >= tl.arange(0, BT)[None, :]

    slot = tl.load(state_slots + seq).to(tl.int64)
    p_s = state + ((slot * HV + hv) * DK + offs_k[:, None]) * DV + offs_v[None, :]
    b_s = tl.load(p_s).to(tl.float32)
    if tl.load(has_initial_state + seq) == 0:
        b_s = tl.zeros([DK, BV], dtype=tl.float32)

    for chunk in range(0, tl.cdiv(eos - bos, BT)):
        rows = bos + chunk * BT + tl.arange(0, BT)
        valid = rows < eos
        b_q = tl.load(
            q + rows[:, None] * stride_qt + hk * stride_qh + offs_k[None, :],
            mask=valid[:, None],
            other=0.0,
        ).to(tl.float32)
        b_k = tl.load(
            k + rows[:, None] * stride_kt + hk * stride_kh + offs_k[None, :],
            mask=valid[:, None],
            other=0.0,
        ).to(tl.float32)
        if USE_L2NORM:
            b_q = b_q / tl.sqrt(tl.sum(b_q * b_q, 1) + 1e-6)[:, None]
            b_k = b_k / tl.sqrt(tl.sum(b_k * b_k, 1) + 1e-6)[:, None]
        b_q = b_q * scale
        b_gc = tl.load(gc + rows * HV + hv, mask=valid, other=0.0)
        b_w = tl.load(
            w + (rows[:, None] * HV + hv) * DK + offs_k[None, :], mask=valid[:, None], other=0.0
        )
        b_u = tl.load(
            u + (rows[:, None] * HV + hv) * DV + offs_v[None, :], mask=valid[:, None], other=0.0
        )
        last = tl.minimum(bos + (chunk + 1) * BT, eos) - 1
        g_last = tl.load(gc + last * HV + hv)

        b_s_op = b_s.to(DOT)
        b_vn = b_u.to(tl.float32) - tl.dot(b_w.to(DOT), b_s_op)
        b_vn_op = b_vn.to(DOT)
        decay = tl.exp(tl.where(causal, b_gc[:, None] - b_gc[None, :], float("-inf")))
        b_attn = tl.dot(b_q.to(DOT), tl.trans(b_k.to(DOT))) * decay
        b_o = tl.dot((b_q * tl.exp(b_gc)[:, None]).to(DOT), b_s_op)
        b_o += tl.dot(b_attn.to(DOT), b_vn_op)
        tl.store(
            o + (rows[:, None] * HV + hv) * DV + offs_v[None, :],
            b_o.to(o.dtype.element_ty),
            mask=valid[:, None],
        )
        b_kd = b_k * tl.exp(tl.where(valid, g_last - b_gc, float("-inf")))[:, None]
        b_s = b_s * tl.exp(g_last) + tl.dot(tl.trans(b_kd.to(DOT)), b_vn_op)

    tl.store(p_s, b_s.to(state.dtype.element_ty))


def gated_delta_rule_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state: torch.Tensor,
    state_slots: torch.Tensor,
    has_initial_state: torch.Tensor,
    scale: float,
    use_qk_l2norm: bool,
    chunk_size: int | None = None,
    block_v: int | None = None,
    dot16: bool = True,
    prepare_warps: int | None = None,
    scan_warps: int | None = None,
) -> torch.Tensor:
    """Varlen chunked prefill: q, k [T, Hk, dk], v [T, Hv, dv], g, beta [T, Hv] -> o [T, Hv, dv].

    No host reads: the grid depends on shapes only. `dot16` runs the chunk walk's dots on bf16
    operands (fp32 accumulate; w and u stored in bf16), else tf32 on fp32 operands. Unnamed
    launch settings come from PREFILL_LAUNCH (chunk 64 is much slower on an H200 and in fp32
    exceeds shared memory)."""
    tokens, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    _check_heads(q, k, v, state)
    batch = cu_seqlens.numel() - 1
    chunk_size = chunk_size or PREFILL_LAUNCH["chunk_size"]
    block_v = block_v or PREFILL_LAUNCH["block_v"]
    prepare_warps = prepare_warps or PREFILL_LAUNCH["prepare_warps"]
    scan_warps = scan_warps or PREFILL_LAUNCH["scan_warps"]
    g, beta = g.contiguous(), beta.contiguous()
    inner = torch.bfloat16 if dot16 else torch.float32
    gc = torch.empty((tokens, hv), dtype=torch.float32, device=v.device)
    w = torch.empty((tokens, hv, dk), dtype=inner, device=v.device)
    u = torch.empty((tokens, hv, dv), dtype=inner, device=v.device)
    o = torch.empty((tokens, hv, dv), dtype=v.dtype, device=v.device)
    if tokens == 0:
        return o
    # every sequence adds at most one partial chunk
    max_chunks = triton.cdiv(tokens, chunk_size) + batch
    _wy_prepare_kernel[(max_chunks, hv)](
        k,
        v,
        g,
        beta,
        cu_seqlens,
        batch,
        gc,
        w,
        u,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        HK=hk,
        HV=hv,
        DK=dk,
        DV=dv,
        BT=chunk_size,
        SUB=min(chunk_size, 16),
        B_PAD=max(2, triton.next_power_of_2(batch)),
        USE_L2NORM=use_qk_l2norm,
        num_warps=prepare_warps,
    )
    block_v = min(dv, block_v)
    _chunk_scan_kernel[(batch, hv, dv // block_v)](
        q,
        k,
        gc,
        w,
        u,
        o,
        state,
        state_slots,
        has_initial_state.to(torch.int32),
        cu_seqlens,
        scale,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        HK=hk,
        HV=hv,
        DK=dk,
        DV=dv,
        BT=chunk_size,
        BV=block_v,
        USE_L2NORM=use_qk_l2norm,
        DOT=tl.bfloat16 if dot16 and q.device.type != "cpu" else tl.float32,
        num_warps=scan_warps,
    )
    return o


def _check_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: torch.Tensor) -> None:
    hk, dk, hv, dv = q.shape[1], q.shape[2], v.shape[1], v.shape[2]
    if k.shape[1:] != q.shape[1:] or hv % hk or q.stride(2) != 1 or k.stride(2) != 1:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: bad heads")
    if v.stride(2) != 1 or state.dtype not in STATE_DTYPES or not state.is_contiguous():
        raise ValueError(
            "v needs a contiguous last dim and the state must be contiguous fp32/bf16/fp16"
        )
    if tuple(state.shape[1:]) != (hv, dk, dv):
        raise ValueError(f"state {tuple(state.shape)} does not match [S, {hv}, {dk}, {dv}]")
    if triton.next_power_of_2(dk) != dk or triton.next_power_of_2(dv) != dv:
        raise ValueError("dk and dv must be powers of two")
