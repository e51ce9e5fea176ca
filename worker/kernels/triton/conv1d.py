"""Depthwise causal conv1d (DeltaNet's short conv, kernel K = 4) with per-sequence state slots.

conv_state[slot] [C, K-1] holds a sequence's previous K-1 inputs, oldest first. Output channel c
at token t is act(bias_c + sum_j weight[c, j] * x[t - (K-1) + j, c]), reading inputs before the
sequence start from the state (or zeros for a first chunk).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from worker.kernels.triton._launch import kernel


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
):
    b = tl.program_id(0)
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
    taps = weight.shape[1]
    _check(x, weight, conv_state, activation)
    out = torch.empty((batch, channels), dtype=x.dtype, device=x.device)
    block_c = 256
    _conv_update_kernel[(batch, triton.cdiv(channels, block_c))](
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
        num_warps=4,
    )
    return out


@kernel
def _conv_prefill_kernel(
    x,
    weight,
    bias,
    conv_state,
    state_slots,
    has_initial_state,
    cu_seqlens,
    out,
    stride_xt,
    C,
    K: tl.constexpr,
    KP: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
):
    seq = tl.program_id(0)
    i_t = tl.program_id(1)
    offs_c = tl.program_id(2) * BC + tl.arange(0, BC)
    in_c = offs_c < C
    bos = tl.load(cu_seqlens + seq).to(tl.int64)
    eos = tl.load(cu_seqlens + seq + 1).to(tl.int64)
    length = eos - bos
    slot = tl.load(state_slots + seq).to(tl.int64)
    # earliest readable state entry, as a negative input index: -(K-1), or 0 when there is no
    # initial state (a vector compare, since the interpreter mis-types vector & scalar masks)
    first_src = -(K - 1) * tl.load(has_initial_state + seq)
    p_state = conv_state + (slot * C + offs_c) * (K - 1)
    t_rel = i_t * BT + tl.arange(0, BT)  # token index within the sequence
    valid = t_rel < length

    y = tl.zeros([BT, BC], dtype=tl.float32)
    for j in range(K):
        src = t_rel - (K - 1) + j  # input index within the sequence, negative: from the state
        from_x = valid & (src >= 0)
        vals = tl.load(
            x + (bos + src)[:, None] * stride_xt + offs_c[None, :],
            mask=from_x[:, None] & in_c[None, :],
            other=0.0,
        ).to(tl.float32)
        from_state = valid & (src < 0) & (src >= first_src)
        vals += tl.load(
            p_state[None, :] + (K - 1 + src)[:, None],
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
        out + (bos + t_rel)[:, None] * C + offs_c[None, :],
        y.to(out.dtype.element_ty),
        mask=valid[:, None] & in_c[None, :],
    )

    # The first token block is the only reader of the old state, so it writes the new one: the
    # sequence's last K-1 inputs, reaching back into the old state when the sequence is short.
    if i_t == 0:
        taps = tl.arange(0, KP)
        src = length - (K - 1) + taps
        in_window = taps < K - 1
        mask = in_window[:, None] & in_c[None, :]
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
        tl.store(
            p_state[None, :] + taps[:, None], new_state.to(conv_state.dtype.element_ty), mask=mask
        )


def causal_conv1d_prefill(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    conv_state: torch.Tensor,
    state_slots: torch.Tensor,
    has_initial_state: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Varlen causal conv over x[T, C]; writes each sequence's last K-1 inputs to its state slot.

    The grid covers the longest sequence (one host read of cu_seqlens)."""
    tokens, channels = x.shape
    taps = weight.shape[1]
    _check(x, weight, conv_state, activation)
    batch = cu_seqlens.numel() - 1
    out = torch.empty((tokens, channels), dtype=x.dtype, device=x.device)
    if tokens == 0:
        return out
    longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max().item())
    block_t, block_c = 32, 128
    grid = (batch, triton.cdiv(longest, block_t), triton.cdiv(channels, block_c))
    _conv_prefill_kernel[grid](
        x,
        weight,
        bias if bias is not None else weight,
        conv_state,
        state_slots,
        has_initial_state.to(torch.int32),
        cu_seqlens,
        out,
        x.stride(0),
        channels,
        K=taps,
        KP=triton.next_power_of_2(taps),
        BT=block_t,
        BC=block_c,
        HAS_BIAS=bias is not None,
        SILU=activation == "silu",
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
