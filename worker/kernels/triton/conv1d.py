"""Depthwise causal conv1d (DeltaNet's short conv, kernel K = 4) with per-sequence state slots.

conv_state[slot] [C, K-1] holds a sequence's previous K-1 inputs, oldest first. Output channel c
at token t is act(bias_c + sum_j weight[c, j] * x[t - (K-1) + j, c]), reading inputs before the
sequence start from the state (or zeros for a first chunk).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from worker.kernels.triton._launch import kernel, pdl_release_wait, pdl_wait
from worker.kernels.triton.activations import gdn_gates_row, store_gdn_gates

# Heads a b|a program of the conv update takes (`_ba_gates`): 48 heads, 8 rows -> 192 programs
# beside the 320 of the conv, each reading 4 weight rows (40 KB at the 27B shape's 5120 columns)
GH: tl.constexpr = tl.constexpr(2)
# Columns of hidden a b|a program takes a turn
BA_COLUMNS = 1024


@triton.jit
def _ba_gates(
    hidden,
    ba_weight,
    A_log,
    dt_bias,
    g,
    beta,
    row,
    H,
    HIDDEN,
    stride_hidden,
    stride_ba,
    first,
    BK: tl.constexpr,
):
    """Heads [first, first + GH) of one token's DeltaNet gates, their b and a logits formed from
    `hidden` in fp32 and rounded to its dtype, as the 16-bit GEMV before gdn_gates rounds them."""
    heads = first + tl.arange(0, GH)
    mask = heads < H
    cols = tl.arange(0, BK)
    acc_b = tl.zeros([GH, BK], dtype=tl.float32)
    acc_a = tl.zeros([GH, BK], dtype=tl.float32)
    p_b = ba_weight + heads[:, None].to(tl.int64) * stride_ba
    p_a = ba_weight + (H + heads[:, None]).to(tl.int64) * stride_ba
    # pipelined (cp.async, 3 turns in flight): a program is a chain of loads, not of math
    for k0 in tl.range(0, HIDDEN, BK, num_stages=3):
        k = k0 + cols
        in_k = k < HIDDEN
        x = tl.load(hidden + row * stride_hidden + k, mask=in_k, other=0.0).to(tl.float32)
        both = mask[:, None] & in_k[None, :]
        acc_b += tl.load(p_b + k[None, :], mask=both, other=0.0).to(tl.float32) * x[None, :]
        acc_a += tl.load(p_a + k[None, :], mask=both, other=0.0).to(tl.float32) * x[None, :]
    dtype = hidden.dtype.element_ty
    b_row = tl.sum(acc_b, 1).to(dtype).to(tl.float32)
    a_row = tl.sum(acc_a, 1).to(dtype).to(tl.float32)
    store_gdn_gates(a_row, b_row, heads, mask, A_log, dt_bias, g, beta, row, H)


@kernel
def _conv_update_kernel(
    x,
    weight,
    bias,
    conv_state,
    state_slots,
    out,
    stride_xb,
    C,
    K: tl.constexpr,
    KP: tl.constexpr,
    BC: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    GATES: tl.constexpr,
    gate_a,
    gate_b,
    A_log,
    dt_bias,
    g,
    beta,
    H,
    stride_a,
    stride_b,
    BH: tl.constexpr,
    BA: tl.constexpr,
    hidden,
    ba_weight,
    HIDDEN,
    stride_hidden,
    stride_ba,
    NCB,
    BK: tl.constexpr,
    PDL: tl.constexpr,
    EARLY_RELEASE: tl.constexpr,
):
    """GATES: the first channel block of each row also computes that row's DeltaNet gates
    (`gdn_gates`), saving the decode step a launch per DeltaNet layer. BA: the gates' logits are
    formed here too, b|a = hidden @ ba_weight^T (b's rows first), by more programs of each row
    after its NCB channel blocks, GH heads each (a 16-bit GEMV's launch fewer a layer).
    EARLY_RELEASE: the DeltaNet recurrence after it loads its states (which no kernel of the
    step before it writes) while this one waits and runs."""
    pdl_release_wait(PDL, EARLY_RELEASE)
    b = tl.program_id(0)
    if GATES:
        if BA:
            if tl.program_id(1) >= NCB:
                _ba_gates(
                    hidden,
                    ba_weight,
                    A_log,
                    dt_bias,
                    g,
                    beta,
                    b.to(tl.int64),
                    H,
                    HIDDEN,
                    stride_hidden,
                    stride_ba,
                    (tl.program_id(1) - NCB) * GH,
                    BK,
                )
        elif tl.program_id(1) == 0:
            gdn_gates_row(
                gate_a, gate_b, A_log, dt_bias, g, beta, b.to(tl.int64), H, stride_a, stride_b, BH
            )
    offs_c = tl.program_id(1) * BC + tl.arange(0, BC)
    taps = tl.arange(0, KP)
    in_c = offs_c < C
    slot = tl.load(state_slots + b).to(tl.int64)
    # window[c, j] for j < K-1 from the state, j == K-1 is this token
    p_state = conv_state + (slot * C + offs_c[:, None]) * (K - 1) + taps[None, :]
    from_state = in_c[:, None] & (taps[None, :] < K - 1)
    window = tl.load(p_state, mask=from_state, other=0.0).to(tl.float32)
    x_t = tl.load(x + b * stride_xb + offs_c, mask=in_c, other=0.0).to(tl.float32)
    window = tl.where(taps[None, :] == K - 1, x_t[:, None], window)
    w = tl.load(
        weight + offs_c[:, None] * K + taps[None, :],
        mask=in_c[:, None] & (taps[None, :] < K),
        other=0.0,
    ).to(tl.float32)
    y = tl.sum(window * w, 1)
    if HAS_BIAS:
        y += tl.load(bias + offs_c, mask=in_c, other=0.0).to(tl.float32)
    if SILU:
        y = y / (1.0 + tl.exp(-y))
    tl.store(out + b * C + offs_c, y.to(out.dtype.element_ty), mask=in_c)
    # shift by one: new state[j] = old state[j + 1], the last entry this token (loaded before
    # any store, so the in-place update is safe)
    shifted = tl.load(p_state + 1, mask=in_c[:, None] & (taps[None, :] < K - 2), other=0.0)
    shifted = tl.where(taps[None, :] == K - 2, x_t[:, None], shifted.to(tl.float32))
    tl.store(p_state, shifted.to(conv_state.dtype.element_ty), mask=from_state)


def causal_conv1d_update(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    state_slots: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """One decode step for x[B, C]; shifts conv_state[state_slots] [.., C, K-1] in place."""
    batch, channels = x.shape
    _check(x, weight, conv_state, activation)
    out = torch.empty((batch, channels), dtype=x.dtype, device=x.device)
    _launch_conv_update(x, weight, bias, conv_state, state_slots, out, activation, None)
    return out


def conv_update_with_gates(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    state_slots: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The silu conv update of x[B, C] and the DeltaNet gates of a, b [B, H] in one launch."""
    if a.stride(1) != 1 or b.stride(1) != 1:
        raise ValueError("gdn gates need a contiguous head dim")
    heads = a.shape[1]
    return _conv_update_and_gates(
        x, weight, conv_state, state_slots, heads, b.dtype, (a, b), None, A_log, dt_bias
    )


def conv_update_with_ba_gates(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    state_slots: torch.Tensor,
    hidden: torch.Tensor,
    ba_weight: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`conv_update_with_gates` with the gates' logits b|a = hidden[B, D] @ ba_weight[2H, D]^T
    (b's rows first, as the fused in_proj_b|a holds them) formed in the same launch."""
    if hidden.stride(1) != 1 or ba_weight.stride(1) != 1:
        raise ValueError("the b|a logits need contiguous rows of hidden and of the weight")
    if hidden.shape[0] != x.shape[0] or ba_weight.shape[1] != hidden.shape[1]:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} and b|a weight "
            f"{tuple(ba_weight.shape)} do not match x {tuple(x.shape)}"
        )
    heads = ba_weight.shape[0] // 2
    if ba_weight.shape[0] != 2 * heads or A_log.shape != (heads,) or dt_bias.shape != (heads,):
        raise ValueError(
            f"b|a weight {tuple(ba_weight.shape)} needs b's and a's rows for the "
            f"{A_log.shape[0]} heads of A_log {tuple(A_log.shape)} and dt_bias {tuple(dt_bias.shape)}"
        )
    return _conv_update_and_gates(
        x,
        weight,
        conv_state,
        state_slots,
        heads,
        hidden.dtype,
        None,
        (hidden, ba_weight),
        A_log,
        dt_bias,
    )


def _conv_update_and_gates(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    state_slots: torch.Tensor,
    heads: int,
    beta_dtype: torch.dtype,
    logits: tuple[torch.Tensor, torch.Tensor] | None,
    ba: tuple[torch.Tensor, torch.Tensor] | None,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The conv update with the gates from their a, b `logits`, or from `ba` (hidden, weight)."""
    batch, channels = x.shape
    _check(x, weight, conv_state, "silu")
    out = torch.empty((batch, channels), dtype=x.dtype, device=x.device)
    g = torch.empty((batch, heads), dtype=torch.float32, device=x.device)
    beta = torch.empty((batch, heads), dtype=beta_dtype, device=x.device)
    a, b = logits if logits is not None else (x, x)
    gates = (a, b, A_log, dt_bias, g, beta)
    _launch_conv_update(x, weight, None, conv_state, state_slots, out, "silu", gates, heads, ba)
    return out, g, beta


def _launch_conv_update(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    state_slots: torch.Tensor,
    out: torch.Tensor,
    activation: str | None,
    gates: tuple[torch.Tensor, ...] | None,
    heads: int = 1,
    ba: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    batch, channels = x.shape
    taps = weight.shape[1]
    block_c = 256
    a, b, A_log, dt_bias, g, beta = gates if gates is not None else (x,) * 6
    hidden, ba_weight = ba if ba is not None else (x, x)
    conv_blocks = triton.cdiv(channels, block_c)
    ba_blocks = triton.cdiv(heads, GH.value) if ba is not None else 0
    _conv_update_kernel[(batch, conv_blocks + ba_blocks)](
        x,
        weight,
        bias if bias is not None else weight,
        conv_state,
        state_slots,
        out,
        x.stride(0),
        channels,
        K=taps,
        KP=triton.next_power_of_2(taps),
        BC=block_c,
        HAS_BIAS=bias is not None,
        SILU=activation == "silu",
        GATES=gates is not None,
        gate_a=a,
        gate_b=b,
        A_log=A_log,
        dt_bias=dt_bias,
        g=g,
        beta=beta,
        H=heads,
        stride_a=a.stride(0),
        stride_b=b.stride(0),
        BH=triton.next_power_of_2(heads),
        BA=ba is not None,
        hidden=hidden,
        ba_weight=ba_weight,
        HIDDEN=hidden.shape[1],
        stride_hidden=hidden.stride(0),
        stride_ba=ba_weight.stride(0),
        NCB=conv_blocks,
        BK=BA_COLUMNS,
        num_warps=4,
    )


@kernel
def _conv_prefill_kernel(
    x,
    weight,
    bias,
    conv_state,
    state_slots,
    has_initial_state,
    cu_seqlens,
    num_seqs,
    out,
    n_tokens,
    stride_xt,
    C,
    K: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
    B_PAD: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    PDL: tl.constexpr,
):
    """Outputs for BT tokens of the flat token axis (which may span sequences) x BC channels."""
    pdl_wait(PDL)
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    offs_c = tl.program_id(1) * BC + tl.arange(0, BC)
    in_c = offs_c < C
    valid = t < n_tokens
    # each token's sequence: how many sequences end at or before it
    offs_b = tl.arange(0, B_PAD)
    ends = tl.load(cu_seqlens + 1 + offs_b, mask=offs_b < num_seqs, other=2**31 - 1)
    seq = tl.minimum(tl.sum((ends[None, :] <= t[:, None]).to(tl.int32), 1), num_seqs - 1)
    bos = tl.load(cu_seqlens + seq)
    slot = tl.load(state_slots + seq).to(tl.int64)
    # earliest readable state entry, as an offset from the sequence start: -(K-1) or 0
    first_src = -(K - 1) * tl.load(has_initial_state + seq)
    p_state = conv_state + (slot * C)[:, None] * (K - 1) + offs_c[None, :] * (K - 1)

    y = tl.zeros([BT, BC], dtype=tl.float32)
    for j in range(K):
        src = t - (K - 1) + j  # flat input index; before bos it comes from the state
        rel = src - bos
        from_x = valid & (rel >= 0)
        vals = tl.load(
            x + src.to(tl.int64)[:, None] * stride_xt + offs_c[None, :],
            mask=from_x[:, None] & in_c[None, :],
            other=0.0,
        ).to(tl.float32)
        from_state = valid & (rel < 0) & (rel >= first_src)
        vals += tl.load(
            p_state + (K - 1 + rel)[:, None],
            mask=from_state[:, None] & in_c[None, :],
            other=0.0,
        ).to(tl.float32)
        w_j = tl.load(weight + offs_c * K + j, mask=in_c, other=0.0).to(tl.float32)
        y += vals * w_j[None, :]
    if HAS_BIAS:
        y += tl.load(bias + offs_c, mask=in_c, other=0.0).to(tl.float32)[None, :]
    if SILU:
        y = y / (1.0 + tl.exp(-y))
    tl.store(
        out + t.to(tl.int64)[:, None] * C + offs_c[None, :],
        y.to(out.dtype.element_ty),
        mask=valid[:, None] & in_c[None, :],
    )


@kernel
def _conv_prefill_state_kernel(
    x,
    conv_state,
    state_slots,
    has_initial_state,
    cu_seqlens,
    stride_xt,
    C,
    K: tl.constexpr,
    KP: tl.constexpr,
    BC: tl.constexpr,
    PDL: tl.constexpr,
):
    """Each sequence's new state: its last K-1 inputs, reaching back into the old state when it is
    shorter than K-1 (run after the outputs, which read the old state)."""
    pdl_wait(PDL)
    seq = tl.program_id(0)
    offs_c = tl.program_id(1) * BC + tl.arange(0, BC)
    in_c = offs_c < C
    bos = tl.load(cu_seqlens + seq).to(tl.int64)
    length = tl.load(cu_seqlens + seq + 1).to(tl.int64) - bos
    slot = tl.load(state_slots + seq).to(tl.int64)
    first_src = -(K - 1) * tl.load(has_initial_state + seq)
    p_state = conv_state + (slot * C + offs_c) * (K - 1)
    taps = tl.arange(0, KP)
    src = length - (K - 1) + taps
    mask = (taps < K - 1)[:, None] & in_c[None, :]
    new_state = tl.load(
        x + (bos + src)[:, None] * stride_xt + offs_c[None, :],
        mask=mask & (src >= 0)[:, None],
        other=0.0,
    ).to(tl.float32)
    new_state += tl.load(
        p_state[None, :] + (K - 1 + src)[:, None],
        mask=mask & ((src < 0) & (src >= first_src))[:, None],
        other=0.0,
    ).to(tl.float32)
    tl.store(p_state[None, :] + taps[:, None], new_state.to(conv_state.dtype.element_ty), mask=mask)


def causal_conv1d_prefill(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    conv_state: torch.Tensor,
    state_slots: torch.Tensor,
    has_initial_state: torch.Tensor,
    activation: str | None = "silu",
    block_t: int = 32,
    block_c: int = 128,
) -> torch.Tensor:
    """Varlen causal conv over x[T, C]; writes each sequence's last K-1 inputs to its state slot.

    Two launches with shape-only grids (no host reads): outputs over the flat token axis, then
    the states."""
    tokens, channels = x.shape
    taps = weight.shape[1]
    _check(x, weight, conv_state, activation)
    batch = cu_seqlens.numel() - 1
    out = torch.empty((tokens, channels), dtype=x.dtype, device=x.device)
    has_state = has_initial_state.to(torch.int32)
    if tokens > 0:
        _conv_prefill_kernel[(triton.cdiv(tokens, block_t), triton.cdiv(channels, block_c))](
            x,
            weight,
            bias if bias is not None else weight,
            conv_state,
            state_slots,
            has_state,
            cu_seqlens,
            batch,
            out,
            tokens,
            x.stride(0),
            channels,
            K=taps,
            BT=block_t,
            BC=block_c,
            B_PAD=max(2, triton.next_power_of_2(batch)),
            HAS_BIAS=bias is not None,
            SILU=activation == "silu",
            num_warps=4,
        )
    _conv_prefill_state_kernel[(batch, triton.cdiv(channels, 256))](
        x,
        conv_state,
        state_slots,
        has_state,
        cu_seqlens,
        x.stride(0),
        channels,
        K=taps,
        KP=triton.next_power_of_2(taps),
        BC=256,
        num_warps=4,
    )
    return out


def _check(
    x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, activation: str | None
) -> None:
    if activation not in ("silu", None):
        raise ValueError(f"unsupported activation {activation!r}")
    if x.stride(-1) != 1 or not weight.is_contiguous() or not conv_state.is_contiguous():
        raise ValueError("x needs a contiguous last dim; weight and conv_state must be contiguous")
    if conv_state.shape[1:] != (weight.shape[0], weight.shape[1] - 1):
        raise ValueError(f"conv_state {tuple(conv_state.shape)} vs weight {tuple(weight.shape)}")
